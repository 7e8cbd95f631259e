"""What the match's geographic block skip leaves unread on the pools `bench pipeline` times.

Builds the tiled pool of `bench pipeline` (copies of a generated base corpus, `build_tiled_index`, the
world's geographic bits) in both slot layouts, the corpus's order ('format') and clustered by geography
('geo'), on the host (the simulator's arrays: no kernel runs), and reports for requests taken one at a
time and in groups of 64: the share of the match's blocks (256 slots) whose summary meets no bit of the
group's mask (`GpuTargetingIndex.skipped_blocks`), and the share of the bytes a full scan reads (slot
columns and clause programs, `live_bytes`) that lie in those blocks; and of the ads left to read, the
share whose own mask meets no request of the group, with their bytes: what a per-slot test before the
clause programs would leave unread on top. Custom locations and the summary are left out of all. It says how much a kernel could save; only the device says what it does save.

    PYTHONPATH=. python3 scripts/probe_geo_skip.py --pool 1000000 --out FILE
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

from andromeda_nb.measure import log  # noqa: E402
from andromeda_nb.provenance import finish_probe  # noqa: E402


def probe(pool: int, base_ads: int, n_requests: int, seed: int, progress: bool = True) -> dict:
    from andromeda_nb.compiled import encode_requests
    from andromeda_nb.geo_layout import clustered_order, world_buckets
    from benchmarks.tiling import generate_base
    from benchmarks.match import build_tiled_index

    base = generate_base(base_ads, n_requests, seed, progress)
    copies = max(1, -(-pool // base_ads))
    buckets = world_buckets(seed)
    encoded = encode_requests(base.requests)
    out = {"pool_ads": copies * len(base.ads), "base_ads": len(base.ads), "copies": copies,
           "requests": len(base.requests), "seed": seed, "layouts": {}}
    for layout in ("format", "geo"):
        t0 = time.time()
        rank = clustered_order(base.compiled.format, buckets.ad_masks(base.compiled)) if layout == "geo" else None
        index = build_tiled_index(base.compiled, copies, rank=rank, buckets=buckets, device="sim")
        block = index._k.SUMMARY_SLOTS
        cap = index.capacity
        # bytes a scan reads per block: resid, prog_ptr, sched per slot, and the programs of its slots
        per_slot = 4 + 8 + 16
        block_bytes = np.full(-(-cap // block), block * per_slot, np.float64)
        np.add.at(block_bytes, np.arange(cap) // block, index.len_h[:cap] * 4.0)
        row = {"slots": cap, "blocks": len(block_bytes), "build_s": round(time.time() - t0, 2)}
        slot_bytes = per_slot + index.len_h[:cap] * 4.0
        used = index.geo_h[:cap] != 0
        for g in (1, 64):
            skip = index.skipped_blocks(encoded, g)
            # slots the block skip leaves to read whose own mask meets no request of the group: what a
            # per-slot test before the clause programs would leave unread on top
            extra_slots, extra_bytes = [], []
            for gi, gm in enumerate(index.group_masks_of(encoded, g)):
                read = np.repeat(~skip[gi], block)[:cap] & used
                miss = read & ((index.geo_h[:cap] & gm) == 0)
                extra_slots.append(miss.sum() / max(1, used.sum()))
                extra_bytes.append(slot_bytes[miss].sum() / block_bytes.sum())
            row[f"group_{g}"] = {"blocks_skipped": round(float(skip.mean()), 4),
                                 "bytes_skipped": round(float((skip * block_bytes).sum(1).mean() / block_bytes.sum()), 4),
                                 "ads_read_failing_slot_test": round(float(np.mean(extra_slots)), 4),
                                 "bytes_a_slot_test_would_skip_more": round(float(np.mean(extra_bytes)), 4),
                                 "groups": int(skip.shape[0])}
        log(progress, f"{layout}: {row}")
        out["layouts"][layout] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pool", type=int, default=1_000_000, help="pool ads (copies of the base corpus)")
    ap.add_argument("--base-ads", type=int, default=8192, help="ads of the base corpus (bench pipeline's default)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0, help="bench pipeline's default")
    ap.add_argument("--out", help="write the JSON here")
    a = ap.parse_args()
    result = probe(a.pool, a.base_ads, a.requests, a.seed)
    finish_probe(result, "probe_geo_skip.py", sys.argv[1:], a.out)

if __name__ == "__main__":
    main()
