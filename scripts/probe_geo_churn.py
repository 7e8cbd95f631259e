"""Whether the geographic block skip survives real-time updates: a corpus laid out clustered by
geography (`GpuEngine(layout="geo")`'s order), its update stream applied in calls of 1,000, and the
share of the match's blocks skipped (`GpuTargetingIndex.skipped_blocks`) before and after, for the
corpus's requests one at a time and in groups of 64, with each way upserts can take a slot
(`gpu.index.PLACEMENTS`): by geography (shipped), the same but widening a block for an ad of every
bit, and the top of the allocator's free list (the order before placement). Host arrays only (the
simulator's; no kernel runs). Also the capacity each ends with and the blocks whose summary is every
bit (read by every request).

    andromeda generate --ads 100000 --requests 64 --seed 1 --updates 20000 --out DIR
    PYTHONPATH=. python3 scripts/probe_geo_churn.py --data DIR --out FILE
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")  # host arrays: nothing here launches a kernel
os.environ.setdefault("ANDROMEDA_SIM_POISON", "0")

from andromeda_nb.measure import log  # noqa: E402
from andromeda_nb.provenance import finish_probe  # noqa: E402


def probe(data: str, spare: float, call: int, progress: bool = True) -> dict:
    from andromeda_nb.compiled import encode_requests
    from andromeda_nb.geo_layout import ALL, clustered_order, world_buckets
    from andromeda_nb.store import load_dataset
    from andromeda_nb.updates import read_updates
    from gpu.index import PLACEMENTS, GpuTargetingIndex

    ds = load_dataset(data)
    path = Path(data) / "updates.jsonl"
    if not path.exists():
        raise SystemExit(f"{path}: no update stream (generate the corpus with --updates N)")
    updates = [u for _, u in read_updates(str(path), seed=ds.seed, dim=ds.model.D, formats=ds.model.F)[0]]
    kinds: dict[str, int] = {}
    for u in updates:
        kinds[type(u).__name__] = kinds.get(type(u).__name__, 0) + 1
    ct = ds.compiled
    buckets = world_buckets(ds.seed)
    rank = clustered_order(ct.format, buckets.ad_masks(ct))
    encoded = encode_requests(ds.requests)
    out = {"ads": len(ct), "requests": len(ds.requests), "updates": kinds, "spare": spare, "call": call,
           "placements": {}}
    for placement in PLACEMENTS:
        index = GpuTargetingIndex.from_compiled(ct, device="sim", rank=rank, buckets=buckets, spare=spare)
        index.placement = placement

        def state():
            return {"blocks_skipped_1": round(float(index.skipped_blocks(encoded, 1).mean()), 4),
                    "blocks_skipped_64": round(float(index.skipped_blocks(encoded, 64).mean()), 4),
                    "capacity": index.capacity, "blocks_of_every_bit": int((index.summary_h == ALL).sum())}

        row = {"before": state()}
        t0 = time.time()
        for i in range(0, len(updates), call):
            index.apply_many(updates[i:i + call])
        row["apply_s"] = round(time.time() - t0, 2)
        row["after"] = state()
        log(progress, f"{placement}: {row}")
        out["placements"][placement] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="a generated corpus directory with updates.jsonl")
    ap.add_argument("--spare", type=float, default=0.05, help="free slots kept per format at build")
    ap.add_argument("--call", type=int, default=1000, help="updates per apply_many call")
    ap.add_argument("--out", help="write the JSON here")
    a = ap.parse_args()
    result = probe(a.data, a.spare, a.call)
    finish_probe(result, "probe_geo_churn.py", sys.argv[1:], a.out)

if __name__ == "__main__":
    main()
