"""Writes the committed sample in data/sample/ (see data/README.md): 200 ad lines of which 10 are
malformed on purpose, 20 requests and a 30-line update stream with 4 rejected updates.

    python data/make_sample.py            # rewrites data/sample/*.jsonl (identical every run)
"""

from __future__ import annotations

import json
from pathlib import Path

from andromeda_nb import corpus

SEED = 7
N_VALID = 190
SAMPLE_DIR = Path(__file__).resolve().parent / "sample"

# (line in ads.jsonl, how the ad is broken, the JSON path the rejection names)
MALFORMED = (
    (17, "unknown top-level targeting key", "targeting.interests"),
    (38, "age_min above age_max", "targeting.age_min"),
    (59, "empty id list in a flexible_spec object", "targeting.flexible_spec[0].interests"),
    (80, "custom location radius of 120 km", "targeting.geo_locations.custom_locations[0].radius"),
    (101, "no geo_locations and no custom_audiences", "targeting.geo_locations"),
    (122, "gender 3", "targeting.genders[0]"),
    (143, "not JSON (a truncated line)", None),
    (164, "unknown publisher platform", "targeting.publisher_platforms[1]"),
    (185, "age_min given as a string", "targeting.age_min"),
    (200, "ad_id repeated from line 1", "ad_id"),
)


def _break(kind_line: int, ad: dict, first_ad: dict) -> str:
    t = ad["targeting"]
    if kind_line == 17:
        t["interests"] = [6003139266461]
    elif kind_line == 38:
        t["age_min"], t["age_max"] = 40, 30
    elif kind_line == 59:
        t["flexible_spec"] = [{"interests": []}]
    elif kind_line == 80:
        t["geo_locations"] = {"custom_locations": [
            {"latitude": 52.52, "longitude": 13.405, "radius": 120, "distance_unit": "kilometer"}]}
    elif kind_line == 101:
        t.pop("geo_locations", None)
        t.pop("custom_audiences", None)
    elif kind_line == 122:
        t["genders"] = [3]
    elif kind_line == 143:
        return json.dumps(ad)[:90]
    elif kind_line == 164:
        t["publisher_platforms"] = ["facebook", "tiktok"]
    elif kind_line == 185:
        t["age_min"] = "18"
    elif kind_line == 200:
        ad = dict(ad, ad_id=first_ad["ad_id"])
    return json.dumps(ad)


def main() -> None:
    SAMPLE_DIR.mkdir(parents=True, exist_ok=True)
    chunk = next(corpus.iter_ads(N_VALID + len(MALFORMED) + 12, SEED))
    ads = [chunk.ad_object(i, with_embedding=i < 3) for i in range(len(chunk))]  # 3 carry embeddings
    valid, broken, fresh = ads[:N_VALID], ads[N_VALID : N_VALID + len(MALFORMED)], ads[N_VALID + len(MALFORMED) :]
    lines, v, b = [], iter(valid), iter(broken)
    broken_at = {line for line, _, _ in MALFORMED}
    for line in range(1, N_VALID + len(MALFORMED) + 1):
        lines.append(_break(line, next(b), valid[0]) if line in broken_at else json.dumps(next(v)))
    (SAMPLE_DIR / "ads.jsonl").write_text("\n".join(lines) + "\n")

    requests = corpus.make_requests(20, SEED)
    for r in requests[2:]:
        del r["signals"]  # derived from request_id and the seed on import
    (SAMPLE_DIR / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))

    ids = [a["ad_id"] for a in valid]
    updates = []
    for ad in fresh[:8]:  # 8 new ads
        updates.append({"op": "upsert", "ad": ad})
    for i in range(8):  # 8 status changes of existing ads
        status = ("PAUSED", "ACTIVE", "ARCHIVED", "DELETED")[i % 4]
        updates.append({"op": "status", "ad_id": ids[5 * i], "status": status})
    for i in range(6):  # 6 retirements, two of them of ads created above
        updates.append({"op": "retire", "ad_id": ids[40 + 7 * i] if i < 4 else fresh[i - 4]["ad_id"]})
    changed = dict(valid[1], status="PAUSED", format=2)  # replace every field of an existing ad
    changed["targeting"] = dict(changed["targeting"], genders=[2])
    updates.append({"op": "upsert", "ad": changed})
    updates.append({"op": "upsert", "ad": fresh[0]})  # the retired id comes back
    updates.append({"op": "status", "ad_id": fresh[0]["ad_id"], "status": "PAUSED"})
    updates.append({"op": "status", "ad_id": fresh[3]["ad_id"], "status": "PAUSED"})
    updates.append({"op": "retire", "ad_id": 999})  # rejected: never existed
    updates.append({"op": "status", "ad_id": ids[40], "status": "ACTIVE"})  # rejected: retired above
    too_old = {"age_min": 70, "geo_locations": {"countries": ["US"]}}
    updates.append({"op": "upsert", "ad": dict(fresh[9], targeting=too_old)})  # rejected: age_min 70
    lines = [json.dumps(u) for u in updates] + ['{"op": "retire", "ad_id": ']  # rejected: not JSON
    (SAMPLE_DIR / "updates.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
