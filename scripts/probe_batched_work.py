"""The tensor-core work and the row reads of a batch's scoring, counted from the slot layout and the
match (no kernel run), for three designs:

* walk: each request lists its eligible slots chunk by chunk and runs 32-row tiles over the list
  (the shipped compacted walk, `gpu.kernels.score_mma`): ceil(eligible / 32) tiles per (request,
  chunk); every eligible (ad, request) pair reads its ad's row (from L2 after the first request).
* per-request tiles: a group of requests reads each 32-slot tile once and runs it for each request
  of the group that has an eligible ad in it (the lab's batched v9, `gpu.lab.score_batched`).
* dense group: a group reads each 32-slot tile with an eligible ad for any of its requests once and
  runs one product over all the group's columns (the batched design `gpu.lab.score_batched`'s
  docstring names next), which costs as many tile products as the group has requests.

One unit throughout: a 32-row tile times one request's columns (2 m16 tiles x 2 n8 tiles x 4 k-steps
x 3 products in the exact mode at D = 64), so the ratios do not depend on the kernel's constants. The
floor is the eligible pairs / 32. Slots: the engine's layout (format by format in chunks of 256,
clustered by geography, `andromeda_nb.geo_layout.clustered_order`); eligibility from the CPU index.

    PYTHONPATH=. python3 scripts/probe_batched_work.py --data DIR --requests 64 --groups 8,16,64 --out FILE
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from andromeda_nb.measure import software, write_json  # noqa: E402
from andromeda_nb.provenance import script_command, stamp  # noqa: E402

TILE = 32  # rows of a tile product
CHUNK = 256  # slots of one format a chunk


def slots_of(formats: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Slot of each ad: format by format in chunks of CHUNK (each format's last chunk padded), ads in
    `rank` order within their format."""
    slot = np.empty(len(formats), np.int64)
    base = 0
    for f in np.unique(formats):
        rows = np.flatnonzero(formats == f)
        rows = rows[np.lexsort((rows, rank[rows]))]
        slot[rows] = base + np.arange(len(rows))
        base += -(-len(rows) // CHUNK) * CHUNK
    return slot


def listed_tiles(eligible_slots: list[np.ndarray], slot_format: np.ndarray, span: int) -> int:
    """Tiles of a walk that lists each request's eligible slots of one format over `span` slots
    (CHUNK: the shipped walk, a list a chunk) and runs 32-row tiles over each list."""
    total = 0
    for s in eligible_slots:
        key = (s // span) * 64 + slot_format[s]  # a list per span and format
        _, counts = np.unique(key, return_counts=True)
        total += int((-(-counts // TILE)).sum())
    return total


def round_steps(eligible_slots: list[np.ndarray], slot_format: np.ndarray, warps: int = 8) -> dict:
    """A round of the wide walk gives each of `warps` warps one chunk: its time is its busiest warp's
    tiles (max over the warps of ceil(n / 32)). Pooled (lab v16): a round whose listing chunks share a
    format deals its ceil(sum n / 32) tiles to the warps in turn, ceil(that / warps) a warp; a mixed
    round as before. Summed over every request's rounds (only rounds with an eligible slot), with the
    tile products of each."""
    chunk_format = slot_format[::CHUNK]
    out = {"rounds": 0, "walk_steps": 0, "pooled_steps": 0, "pooled_rounds": 0, "walk_tiles": 0, "pooled_tiles": 0}
    for s in eligible_slots:
        counts = np.bincount(s // CHUNK, minlength=len(chunk_format))
        pad = -len(counts) % warps
        n = np.concatenate([counts, np.zeros(pad, np.int64)]).reshape(-1, warps)
        f = np.concatenate([chunk_format, np.full(pad, -1)]).reshape(-1, warps)
        busy = n.sum(axis=1) > 0
        n, f = n[busy], f[busy]
        tiles = -(-n // TILE)
        listing = np.where(n > 0, f, -1)
        first = listing.max(axis=1)  # a listing chunk's format (formats are >= 0)
        uniform = ((listing == first[:, None]) | (listing < 0)).all(axis=1)
        pooled_tiles = -(-n.sum(axis=1) // TILE)
        out["rounds"] += int(len(n))
        out["pooled_rounds"] += int(uniform.sum())
        out["walk_steps"] += int(tiles.max(axis=1).sum())
        out["pooled_steps"] += int(np.where(uniform, -(-pooled_tiles // warps), tiles.max(axis=1)).sum())
        out["walk_tiles"] += int(tiles.sum())
        out["pooled_tiles"] += int(np.where(uniform, pooled_tiles, tiles.sum(axis=1)).sum())
    out["pooled_steps_over_walk"] = round(out["pooled_steps"] / max(1, out["walk_steps"]), 3)
    out["pooled_tiles_over_walk"] = round(out["pooled_tiles"] / max(1, out["walk_tiles"]), 3)
    return out


def work(eligible_slots: list[np.ndarray], slot_format: np.ndarray, groups: list[int], spans=(4096,)) -> dict:
    """Tile products and row reads of each design for the requests' eligible slots."""
    n_slots = len(slot_format)
    n_tiles = -(-n_slots // TILE)
    pairs = sum(len(s) for s in eligible_slots)
    walk = listed_tiles(eligible_slots, slot_format, CHUNK)
    tiles_seen = [np.unique(s // TILE) for s in eligible_slots]
    out = {"pairs": pairs, "eligible_share": round(pairs / (len(eligible_slots) * n_slots), 5),
           "floor_tiles": round(pairs / TILE), "walk": {"tile_products": walk, "row_reads": pairs}}
    for rg in groups:
        per_request = dense = reads = 0
        for lo in range(0, len(eligible_slots), rg):
            seen = tiles_seen[lo:lo + rg]
            union = np.unique(np.concatenate(seen)) if seen else np.empty(0, np.int64)
            per_request += sum(len(t) for t in seen)
            dense += len(union) * len(seen)
            reads += len(union) * TILE
        out[f"group_{rg}"] = {"per_request_tiles": {"tile_products": per_request, "over_walk": round(per_request / walk, 2)},
                              "dense": {"tile_products": dense, "over_walk": round(dense / walk, 2)},
                              "row_reads": reads, "row_reads_over_walk": round(reads / pairs, 3)}
    for span in spans:  # a walk whose lists run over several chunks of one format
        tiles = listed_tiles(eligible_slots, slot_format, span)
        out[f"walk_lists_over_{span}"] = {"tile_products": tiles, "over_walk": round(tiles / walk, 3)}
    out["rounds_of_8_chunks"] = round_steps(eligible_slots, slot_format)
    out["tiles"] = n_tiles
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a corpus directory (`andromeda generate`)")
    ap.add_argument("--requests", type=int, default=64, help="the batch: the corpus's first N requests")
    ap.add_argument("--groups", default="8,16,64", help="requests a group of the batched designs, comma-separated")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from andromeda_nb.geo_layout import GeoBuckets, clustered_order
    from andromeda_nb.corpus import build_world
    from andromeda_nb.store import load_dataset
    from cpu_baseline.index import CpuTargetingIndex

    dataset = load_dataset(args.data)
    ct = dataset.compiled
    requests = list(dataset.requests)[: args.requests]
    if len(requests) < args.requests:
        ap.error(f"--requests {args.requests}: the corpus holds {len(requests)}")
    masks = GeoBuckets.of_world(build_world(dataset.seed)).ad_masks(ct)
    slot = slots_of(ct.format, clustered_order(ct.format, masks))
    row_of = np.full(int(ct.ad_id.max()) + 1, -1, np.int64)
    row_of[ct.ad_id] = np.arange(len(ct))
    eligible = [np.sort(slot[row_of[np.asarray(ids, np.int64)]]) for ids in
                CpuTargetingIndex.from_compiled(ct).match(requests)]
    slot_format = np.full(int(slot.max()) + 1, 63, np.int64)  # padding: a format of its own
    slot_format[slot] = ct.format
    result = {"kind": "batched_work_probe", "ads": len(ct), "requests": len(requests), "chunk": CHUNK, "tile": TILE,
              **work(eligible, slot_format, [int(g) for g in args.groups.split(",")], (1024, 4096, 16384)),
              "software": software()}
    stamp(result, command=script_command("probe_batched_work.py", argv if argv is not None else sys.argv[1:]))
    print(result)
    if args.out:
        write_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
