"""How much a layout co-design by geography could save: the slot order clustered by the countries an
ad's geo clause names, and a per-chunk summary that lets a launch skip every chunk none of whose ads
any request of the group could match on geography.

For every ad, a 64-bit geo mask: bit b(t) for every term t of its geo_locations clause, where b maps a
country to its own bit and a region or city to its country's bit (`andromeda_nb.corpus.build_world`
for the corpus's seed; any other term to a hash); all 64 bits for an ad with custom locations or no
geo clause (with `--bucket hash`, every term its own hashed bit: what an index knows without the
geographic hierarchy). A request's mask: the bits of the geo terms it holds. A chunk's summary: the OR of its
ads' masks. Where summary AND mask is 0, no ad of the chunk can be eligible: the test is exact for
any bucket function, because an ad's clause term and a request's term set the same bit.

Two slot orders within each format's chunks of 256: the corpus's (as `SlotAllocator.from_ads` lays
it out), and clustered (ads sorted by mask popcount, then mask). For each, per request and per
group of 64: the share of chunks the summary skips, the share no eligible ad touches (what a
perfect skip would leave), eligible ads per touched chunk, and the 32-row tiles of one chunk's
eligible slots that the scoring kernel's walk fills, per chunk of the pool (its work); and per ad,
the share of the pool whose mask meets one request's (what a per-slot test would pass). Eligibility
from the CPU index.

The masks, the clustered order and the chunk summaries are `andromeda_nb.geo_layout`'s.

    PYTHONPATH=. python3 scripts/probe_geo_layout.py --data DIR --out FILE
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from andromeda_nb.measure import software, write_json  # noqa: E402
from andromeda_nb.geo_layout import ALL, GeoBuckets, chunk_summaries, clustered_order  # noqa: E402
from andromeda_nb.provenance import script_command, stamp  # noqa: E402

GROUP = 64
TILE_ROWS = 32  # rows of the scoring kernel's tile of one chunk's eligible slots


def layout(formats: np.ndarray, key: np.ndarray | None, chunk: int) -> np.ndarray:
    """Slot of each ad: format by format in chunks of `chunk` (each format's last chunk padded), ads
    in corpus order or sorted by `key` within their format."""
    slot = np.empty(len(formats), np.int64)
    base = 0
    for f in np.unique(formats):
        rows = np.flatnonzero(formats == f)
        if key is not None:
            rows = rows[np.lexsort((rows, key[rows]))]
        slot[rows] = base + np.arange(len(rows))
        base += -(-len(rows) // chunk) * chunk
    return slot


def measure(masks, slot, eligible, req_masks, chunk: int) -> dict:
    n_chunks = int(slot.max()) // chunk + 1
    summary = chunk_summaries(slot, masks, n_chunks, chunk)
    per = {"skipped": [], "untouched": [], "eligible_per_touched_chunk": [], "tiles_per_chunk": []}
    groups = {"skipped": [], "untouched": []}
    for lo in range(0, len(req_masks), GROUP):
        g_mask, g_touched = 0, np.zeros(n_chunks, bool)
        for r in range(lo, min(lo + GROUP, len(req_masks))):
            touched = np.bincount(slot[eligible[r]] // chunk, minlength=n_chunks)
            skipped = (summary & np.uint64(req_masks[r])) == 0
            assert not (skipped & (touched > 0)).any(), "the summary skipped a chunk with an eligible ad"
            per["skipped"].append(skipped.mean())
            per["untouched"].append((touched == 0).mean())
            if (touched > 0).any():
                per["eligible_per_touched_chunk"].append(touched[touched > 0].mean())
            per["tiles_per_chunk"].append((-(-touched // TILE_ROWS)).sum() / n_chunks)  # 32-row tiles the walk fills
            g_mask |= req_masks[r]
            g_touched |= touched > 0
        groups["skipped"].append(((summary & np.uint64(g_mask)) == 0).mean())
        groups["untouched"].append((~g_touched).mean())
    out = {"chunks": n_chunks,
           "one_request": {k: round(float(np.mean(v)), 4) for k, v in per.items()},
           f"group_of_{GROUP}": {k: round(float(np.mean(v)), 4) for k, v in groups.items()}}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a generated corpus directory")
    ap.add_argument("--chunk", type=int, default=256, help="slots per chunk")
    ap.add_argument("--bucket", choices=("country", "hash"), default="country",
                    help="country: a region or city sets its country's bit (the corpus's world); hash: every "
                         "term its own hashed bit (no hierarchy needed)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from andromeda_nb.corpus import build_world
    from andromeda_nb.store import load_dataset
    from cpu_baseline.index import CpuTargetingIndex

    dataset = load_dataset(args.data)
    ct = dataset.compiled
    buckets = GeoBuckets.of_world(build_world(dataset.seed)) if args.bucket == "country" else GeoBuckets()
    masks = buckets.ad_masks(ct)
    requests = list(dataset.requests)
    req_masks = [buckets.request_mask(r) for r in requests]
    row_of = {int(a): i for i, a in enumerate(ct.ad_id)}
    eligible = [np.asarray([row_of[int(a)] for a in ids], np.int64)
                for ids in CpuTargetingIndex.from_compiled(ct).match(requests)]
    popcount = np.asarray([bin(int(m)).count("1") for m in masks], np.uint64)
    rank = clustered_order(ct.format, masks)  # within each format: bits, then the mask itself
    layouts = {"corpus_order": layout(ct.format, None, args.chunk), "clustered": layout(ct.format, rank, args.chunk)}
    result = {"kind": "geo_layout_probe", "ads": len(ct), "requests": len(requests), "chunk": args.chunk,
              "ads_with_geo_mask": round(float((masks != ALL).mean()), 4),
              "single_country_ads": round(float((popcount == 1).mean()), 4),
              "bucket": args.bucket,
              # per ad, one request: the share of the pool whose geo mask meets the request's
              "ads_passing_geo_test": round(float(np.mean([((masks & np.uint64(m)) != 0).mean() for m in req_masks])), 4),
              "eligible_share": round(float(np.mean([len(e) for e in eligible]) / len(ct)), 4),
              "layouts": {name: measure(masks, slot, eligible, req_masks, args.chunk) for name, slot in layouts.items()},
              "software": software()}
    stamp(result, command=script_command("probe_geo_layout.py", argv if argv is not None else sys.argv[1:]))
    print(json.dumps({k: result[k] for k in ("ads", "bucket", "ads_with_geo_mask", "single_country_ads", "eligible_share",
                                              "ads_passing_geo_test",
                                              "layouts")}, indent=1))
    if args.out:
        write_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
