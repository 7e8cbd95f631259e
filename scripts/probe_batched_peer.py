"""A batch of requests scored and ranked by the shipped kernels against a batched, eligibility-masked
PyTorch peer (`benchmarks.peers.BatchedMaskedPeer`), on one pool, in one run.

The pool is `bench pipeline`'s: a generated or imported corpus (`--data`, as `serve colocated` serves it)
or, without it, the tiled pool. For the first `--requests` requests: their eligibility from the GPU
match, their user-side tables as the engine folds them; then
* the project: the shipped scoring kernel and final top-K over the batch (`FusedScorer.launch`, one
  launch of each, the batch's tables already on the device), timed by CUDA events;
* the peer, eager and compiled (`torch.compile(mode=COMPILE_MODE, dynamic=True)`), timed the same way
  over the same stages (scores, masks, top K), its per-batch table and mask preparation included.
Every answer of `--check-requests` requests of the batch, the project's and each peer's, is checked
against the float64 reference over the oracle's eligible set first (DESIGN section 4's tie-aware
rule); a peer that fails is reported as failing. Without PyTorch and a GPU the peer rows are skipped
with the reason.

    PYTHONPATH=. python3 scripts/probe_batched_peer.py --data /tmp/d10000000 --requests 64 --out FILE
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=None, help="corpus directory (default: the tiled pool of bench pipeline)")
    ap.add_argument("--pool", type=int, default=10_000_000, help="tiled pool size, without --data")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--check-requests", type=int, default=8)
    ap.add_argument("--block-slots", type=int, default=1 << 18, help="slots a peer block scores at once")
    ap.add_argument("--device", default="gpu", choices=("gpu", "sim"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import numpy as np

    from andromeda_nb.compiled import encode_requests
    from andromeda_nb.model import user_sides
    from andromeda_nb.provenance import report_probe
    from andromeda_nb.scoring import fold_tables_batch
    from benchmarks import score as bs
    from benchmarks.peers import COMPILE_MODE, BatchedMaskedPeer, torch_reason
    from gpu import runtime

    k = args.k
    if args.data:
        pp = bs.data_pool(args.data, k=k, device=args.device, progress=True)
    else:
        pp = bs.pipeline_pool(pool=args.pool, n_requests=max(args.requests, 64), k=k, device=args.device)
    cuda = runtime.cuda()
    reqs = pp.requests[: args.requests]
    R = len(reqs)
    check_one = bs.answer_checker(pp, pp.oracle(), k)
    checked = sorted(set(np.linspace(0, R - 1, min(R, args.check_requests)).round().astype(int).tolist()))

    def checks(answers) -> dict:
        rows = [check_one(r, *answers[r]) for r in checked]
        return {"requests_checked": len(rows), "ok": all(ok for ok, _, _ in rows),
                "max_abs_err": max((err for _, err, _ in rows), default=0.0),
                "first_failure": next((msg for ok, _, msg in rows if not ok), None)}

    fs, index = pp.scorer, pp.index
    elig = index.match_slots(encode_requests(reqs))  # device uint32 (R, S / 32)
    tabs = np.ascontiguousarray(fold_tables_batch(*user_sides(pp.model, reqs)), np.float32)
    d_tabs = cuda.to_device(tabs)
    answers = fs.fetch(fs.launch(elig, d_tabs, k), R)
    n_slots = fs.n_slots
    result = {"kind": "batched_peer", "data": args.data, "slots": int(n_slots), "requests": R, "k": k,
              "precision": pp.precision, "project": {"checks": checks(answers)}, "peers": []}

    def timed_device(fn) -> float:  # median seconds of the launches, by CUDA events
        fn()
        cuda.synchronize()
        start, stop = cuda.event(), cuda.event()
        times = []
        for _ in range(args.repeat):
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(cuda.event_elapsed_time(start, stop) / 1e3)
        return statistics.median(times)

    if args.device == "gpu":
        t = timed_device(lambda: fs.launch(elig, d_tabs, k))
        result["project"].update(time_ms=t * 1e3, pool_ads_per_s=R * n_slots / t)
        print(f"project: {t * 1e3:.3f} ms for {R} requests, {R * n_slots / t / 1e9:.1f} G pool ads/s, "
              f"checks {'passed' if result['project']['checks']['ok'] else 'FAILED'}", file=sys.stderr)

    reason = torch_reason() if args.device == "gpu" else "the simulator: no PyTorch peer"
    if reason is None and pp.precision != "fp16":
        reason = f"the peer reads fp16 rows; this pool is {pp.precision}"
    if reason is None:
        import cupy
        import torch

        values, scales = pp.rows(cupy.arange(n_slots))
        if not bool((scales == 1).all()):
            reason = "the peer assumes unit scales (fp16 storage)"
    if reason is not None:
        result["peers_skipped"] = reason
        print(f"peers skipped: {reason}", file=sys.stderr)
    else:
        slots = index.slots
        peer = BatchedMaskedPeer(values, np.asarray(slots.chunk_format), slots.chunk_slots, pp.model.E,
                                 pp.model.top_k, k, args.block_slots)
        tabs_t = torch.from_numpy(tabs).cuda()
        elig_t = torch.from_dlpack(cupy.asarray(elig).view(cupy.int32))
        slot_ad_id = slots.slot_ad_id
        for name, fn in (("torch batched masked eager", peer.block_scores),
                         ("torch batched masked compiled", torch.compile(peer.block_scores, mode=COMPILE_MODE,
                                                                         dynamic=True))):
            t0 = time.time()
            try:
                v, s = peer.run(fn, tabs_t, elig_t)
                torch.cuda.synchronize()
            except (RuntimeError, TypeError) as e:  # a variant this PyTorch cannot run
                result["peers"].append({"peer": name, "skipped": f"{type(e).__name__}: {str(e)[:200]}"})
                continue
            first_s = time.time() - t0
            v, s = v.cpu().numpy(), s.cpu().numpy()
            got = [(slot_ad_id[s[r][np.isfinite(v[r])]], v[r][np.isfinite(v[r])]) for r in range(R)]
            c = checks(got)
            t = timed_device(lambda: peer.run(fn, tabs_t, elig_t))
            row = {"peer": name, "time_ms": t * 1e3, "pool_ads_per_s": R * n_slots / t, "first_call_s": round(first_s, 1),
                   "checks": c, "passes": c["ok"]}
            if "compiled" in name:
                row["compile_mode"] = COMPILE_MODE
            result["peers"].append(row)
            print(f"{name}: {t * 1e3:.3f} ms, {R * n_slots / t / 1e9:.1f} G pool ads/s, checks "
                  f"{'passed' if c['ok'] else 'FAILED: ' + str(c['first_failure'])[:200]}", file=sys.stderr)
        passing = [p for p in result["peers"] if p.get("passes")]
        if passing and "time_ms" in result["project"]:
            best = min(passing, key=lambda p: p["time_ms"])
            result["project_over_best_peer"] = {"value": best["time_ms"] / result["project"]["time_ms"],
                                                "peer": best["peer"], "target": ">= 10"}
    report_probe(result, "probe_batched_peer.py", sys.argv[1:] if argv is None else argv, args.out)
    return 0 if result["project"]["checks"]["ok"] and all(p.get("passes", True) for p in result["peers"]) else 1


if __name__ == "__main__":
    sys.exit(main())
