"""Batched tensor-core scorer (v9) against the shipped v8 on a random pool: answers, then timings.

gpu/lab/score_batched.py against gpu/kernels/score_mma.py's shipped walk, one batch of requests,
the answers checked first, then timed, all written as JSON.

    python3 scripts/probe_score_batched.py --ads 10000000 --requests 64 --eligible 0.06 \
        --out results/probe_score_batched.json

Builds `--ads` slots of random fp16 (or int8) embeddings, D = 64, `--formats` formats, on the device
(benchmarks.score.make_pool), the requests' user sides from `MoeModel.init(0)` (one derived request
each), and eligibility clustered in tiles as a match leaves it: each request sees a random
`--tile-share` of the 32-slot tiles (a generated corpus: 42%), each slot of such a tile with the
probability that makes `--eligible` of the pool eligible. Then:
1. checks: every request's answer (FusedScorer: scoring and the final top-K) of each batched variant
   equals the shipped kernel's, ids and scores bit for bit, and `--reference` requests' answers
   against the float64 reference (andromeda_nb.reference) over all their eligible ads;
2. timings: CUDA events around the scoring plan alone (table preparation + scoring kernel) and around
   scoring + final top-K, after `--warmup` launches, median of `--repeats`; G pool ads/s = pool x
   requests / seconds, and the napkin math: the pool's bytes over the scoring time.
Variants: `--registers` (the batched kernel's register limits to time; 0 = what the compiler takes)
times `--selects` (who selects a request's list: the block, or one warp a request).

Under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) it runs end to end at a tiny size (`--ads 8192
--requests 3`: 22 minutes on 2 cores, 12 with `--selects block --registers 0`), on the host, timing one
run of scoring and final top-K of each kernel: its timings say nothing of a device.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def clustered_eligibility(xp, R: int, S: int, share: float, tile_share: float, seed: int):
    """uint32 (R, S / 32) on `xp`: per request a random `tile_share` of the tiles, each of their slots
    eligible with probability share / tile_share."""
    density = min(1.0, share / tile_share)
    rs = xp.random.RandomState(seed)
    shifts = xp.arange(32, dtype=xp.uint32)
    out = xp.empty((R, S // 32), xp.uint32)
    for r in range(R):
        tiles = rs.random_sample(S // 32) < tile_share
        bits = (rs.random_sample((S // 32, 32)) < density) & tiles[:, None]
        out[r] = (bits.astype(xp.uint32) << shifts).sum(axis=1, dtype=xp.uint32)
    return out


def kernel_attributes(kernel) -> dict:
    """Registers, shared and local memory of a compiled numba kernel (empty under the simulator)."""
    out = {}
    for name, attr in (("registers", "get_regs_per_thread"), ("shared_bytes", "get_shared_mem_per_block"),
                       ("local_bytes", "get_local_mem_per_thread")):
        try:
            value = getattr(kernel, attr)()  # a dict over the compiled signatures when there are several
            out[name] = int(next(iter(value.values())) if isinstance(value, dict) else value)
        except Exception:  # the simulator, or a numba without the attribute
            pass
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ads", type=int, default=10_000_000)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--eligible", type=float, default=0.06, help="share of the pool eligible per request")
    ap.add_argument("--tile-share", type=float, default=0.42, help="share of 32-slot tiles holding an eligible ad")
    ap.add_argument("--precision", default="fp16", choices=("fp16", "int8"))
    ap.add_argument("--formats", type=int, default=8)
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--registers", default="0,128", help="batched register limits to time (0: unlimited)")
    ap.add_argument("--selects", default="block,warp", help="who selects the batched kernel's lists")
    ap.add_argument("--list-entries", type=int, default=None,
                    help="(key, offset) pairs a batched block holds (default score_batched.LIST_ENTRIES: 6144, "
                         "73 KiB of static shared memory a block; 2560 keeps it under 48 KiB)")
    ap.add_argument("--reference", type=int, default=2, help="requests checked against the float64 reference")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from andromeda_nb.devices import resolve

    sim = resolve("auto", kernels=True, what="the batched scoring probe") == "sim"
    from gpu import runtime

    cuda = runtime.cuda()
    if sim:
        xp = np
        args.warmup, args.repeats = 0, 1
    else:
        import cupy as xp

    from andromeda_nb.compare import compare_topk
    from andromeda_nb.model import EmbeddingTable, MoeModel
    from andromeda_nb.reference import reference_scores
    from andromeda_nb.scoring import fold_user_side
    from andromeda_nb.slots import CHUNK_SLOTS
    from benchmarks.match import environment
    from benchmarks.score import _request_tables, make_pool
    from gpu.fused import FusedScorer
    from gpu.graphs import run_plan
    from gpu.kernels import score as sk
    from gpu.kernels.tiles import words_per_ad
    from gpu.lab import score_batched as sb

    t_start = time.perf_counter()
    R, k, D = args.requests, args.k, 64
    S = (args.ads // 4096) * 4096
    model = MoeModel.init(0, D=D, F=args.formats)
    sides = [_request_tables(model, args.seed + r)[0] for r in range(R)]  # one derived request each
    tabs = np.stack([fold_user_side(us) for us in sides]).astype(np.float32)
    pool = make_pool(xp, S, D, args.precision, model.F, args.seed, keep_rows=False)
    elig = clustered_eligibility(xp, R, S, args.eligible, args.tile_share, args.seed + 1)
    if sim:
        d_emb, d_scale, d_elig = cuda.to_device(pool.tiles), cuda.to_device(pool.scale), cuda.to_device(elig)
    else:
        d_emb, d_scale, d_elig = (cuda.as_cuda_array(a) for a in (pool.tiles, pool.scale, elig))
    d_tabs = cuda.to_device(tabs)
    ids = np.arange(S, dtype=np.int64)
    common = dict(precision=args.precision, dim=D, experts=model.E, top_e=model.top_k)
    shipped = FusedScorer.on_device(d_emb, d_scale, pool.chunk_format, ids, **common)
    variants = {}
    for select in args.selects.split(","):
        for regs in (int(x) for x in args.registers.split(",")):
            fs = FusedScorer.on_device(d_emb, d_scale, pool.chunk_format, ids, version=sb.BATCHED, **common)
            fs.kernel = sb.get_batched_kernel(args.precision, D, model.E, model.top_k, max_registers=regs or None,
                                              select=select, list_entries=args.list_entries or sb.LIST_ENTRIES)
            variants[f"v9 batched {select} select r{regs or 'max'}"] = fs
    setup_s = time.perf_counter() - t_start

    elig_host = elig if sim else xp.asnumpy(elig)
    per_request = np.unpackbits(elig_host.view(np.uint8), axis=1, bitorder="little").sum(axis=1)
    tile_any = (elig_host != 0).mean()
    tile_union = (np.bitwise_or.reduce(elig_host, axis=0) != 0).mean()
    result = {
        "env": environment(cuda), "simulator": sim, "pool": S, "requests": R, "k": k, "precision": args.precision,
        "dim": D, "experts": model.E, "top_e": model.top_k, "formats": model.F,
        "eligible_share": float(per_request.mean() / S), "tiles_seen_per_request": float(tile_any),
        "tiles_seen_by_batch": float(tile_union), "versions": {"shipped": sk.VERSIONS[sk.SHIPPED].name},
        "arithmetic": "float32 (default mode: exact hi + lo tensor-core products)",
        "setup_s": round(setup_s, 1), "checks": {}, "timings": {}, "checks_ok": True,
    }

    # 1. answers: every variant equal to the shipped kernel's; a few requests against the reference
    want = shipped.topk(d_elig, d_tabs, k)
    for name, fs in variants.items():
        got = fs.topk(d_elig, d_tabs, k)
        bad = [r for r in range(R)
               if not (np.array_equal(got[r][0], want[r][0]) and np.array_equal(got[r][1], want[r][1]))]
        result["checks"][name] = {"requests_equal_to_shipped": R - len(bad), "first_unequal": bad[:5],
                                  "attributes": kernel_attributes(fs.kernel.kernel),
                                  "group_size": fs.kernel.group_size(R, k)}
        result["checks_ok"] &= not bad
    W = words_per_ad(args.precision, D)
    for r in range(min(args.reference, R)):
        rows = np.flatnonzero(np.unpackbits(elig_host[r].view(np.uint8), bitorder="little"))
        tiles_r, lanes = rows // 32, rows % 32
        words = np.arange(W)
        # word j of slot s in the 'tiles' layout (gpu.kernels.tiles)
        flat = (tiles_r[:, None] * (W // 4) + words[None, :] // 4) * 128 + lanes[:, None] * 4 + words[None, :] % 4
        got_words = pool.tiles[xp.asarray(flat.reshape(-1))]
        got_words = got_words if sim else xp.asnumpy(got_words)
        stored = np.float16 if args.precision == "fp16" else np.int8
        values = np.ascontiguousarray(got_words.reshape(len(rows), W)).view(stored)
        scale = pool.scale[xp.asarray(rows)]
        scale = scale if sim else xp.asnumpy(scale)
        table = EmbeddingTable(values, np.asarray(scale, np.float32), args.precision)
        formats = np.repeat(pool.chunk_format, CHUNK_SLOTS)[rows]
        ref = reference_scores(model, sides[r], table, np.arange(len(rows)), formats)
        cmp = compare_topk(ids[rows], ref, want[r][0], want[r][1], k)
        result["checks"].setdefault("reference", []).append(
            {"request": r, "eligible": int(len(rows)), "ok": bool(cmp.ok), "message": cmp.message})
        result["checks_ok"] &= bool(cmp.ok)
    print(json.dumps({"checks_ok": result["checks_ok"], "checks": result["checks"]}, indent=1), file=sys.stderr)

    # 2. timings
    def timed(fn) -> dict:
        for _ in range(args.warmup):
            fn()
        cuda.synchronize()
        times = []
        for _ in range(args.repeats):
            if sim:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            else:
                e0, e1 = cuda.event(timing=True), cuda.event(timing=True)
                e0.record()
                fn()
                e1.record()
                e1.synchronize()
                times.append(cuda.event_elapsed_time(e0, e1))
        ms = float(np.median(times))
        pool_bytes = S * W * 4
        return {"median_ms": round(ms, 4), "min_ms": round(float(np.min(times)), 4), "repeats": len(times),
                "G_pool_ads_per_s": round(S * R / (ms / 1e3) / 1e9, 2),
                "pool_read_once_TBps": round(pool_bytes / (ms / 1e3) / 1e12, 3)}

    for name, fs in {"shipped v8": shipped, **variants}.items():
        b = fs._buffers(R, k)
        cap = sk.cap_for(k, fs.kernel.ads_per_block)
        score_plan, topk_plan, _ = fs.plan(d_elig, d_tabs, k)

        result["timings"][name] = {
            # under the simulator one host-timed run of the whole path, to run the code end to end
            "scoring": None if sim else timed(lambda: run_plan(score_plan, 0)),
            "scoring_and_final_topk": timed(lambda: run_plan(score_plan + topk_plan, 0)),
            "candidates_per_request": int(b["cand_key"].shape[1] * cap),
        }
        print(name, json.dumps(result["timings"][name]), file=sys.stderr)
    for stage in ("scoring", "scoring_and_final_topk"):
        if result["timings"]["shipped v8"][stage] is None:
            continue
        base = result["timings"]["shipped v8"][stage]["median_ms"]
        for name in variants:
            result["timings"][name][f"{stage}_speedup_over_shipped"] = round(
                base / result["timings"][name][stage]["median_ms"], 2)
    # napkin math: bytes each design must read, and the batched kernel's tensor-core work
    pairs = int((elig_host != 0).sum())  # (tile, request) pairs the batched kernel scores, 32 ads each
    per_product = 2 if args.precision == "fp16" or args.precision == "int8" else 3  # exact: hi x hi + hi x lo
    flops = pairs * 32 * 2 * model.E * D * 2 * per_product
    rg = next(iter(variants.values())).kernel.group_size(R, k)
    result["napkin"] = {
        "pool_bytes": S * W * 4, "pool_read_once_ms_at_3.35TBps": round(S * W * 4 / 3.35e12 * 1e3, 3),
        "shipped_gathers_bytes": int(per_request.sum()) * W * 4,
        "batched_groups": -(-R // rg), "batched_group_size": rg,
        "batched_l2_rereads_bytes": (-(-R // rg) - 1) * S * W * 4,
        "tile_request_pairs": pairs, "batched_tensor_tflop": round(flops / 1e12, 3),
        "batched_tensor_ms_at_600TFLOPs": round(flops / 600e12 * 1e3, 3),
    }
    result["total_s"] = round(time.perf_counter() - t_start, 1)
    from andromeda_nb.provenance import script_command, stamp

    stamp(result, command=script_command("probe_score_batched.py", sys.argv[1:] if argv is None else argv))
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0 if result["checks_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
