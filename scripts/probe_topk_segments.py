"""The final top-K's segment length and versions, measured: the two kernels of each top-K version of
`--versions` (the kernel lab's, gpu/lab/topk.py: segments, then one block per request) over candidates
shaped as the shipped scoring kernel leaves them for a pool of `--slots` slots (its output blocks times
`cap`, a `--fill` share of them holding a key, the rest 0), for each segment length of
`--segment-lens` and each batch size of `--requests`.

Every configuration's answers are first checked equal to `topk_host` (score descending, ties by ad id)
on the same candidates; then each is timed with CUDA events (the median of `--repeat` launches after a
warm-up). Keys are drawn from a few thousand values, so ties at the k-th key occur as in real scores.

    PYTHONPATH=. python3 scripts/probe_topk_segments.py --out FILE
    PYTHONPATH=. python3 scripts/probe_topk_segments.py --device sim --slots 200000 --requests 1,2 --repeat 2
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="gpu", choices=("gpu", "sim"))
    ap.add_argument("--slots", type=int, default=10_001_152, help="pool slots the scoring kernel covered")
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--fill", type=float, default=0.6, help="share of the candidate entries holding a key")
    ap.add_argument("--requests", default="1,64", help="batch sizes, comma-separated")
    ap.add_argument("--segment-lens", default="16384,8192,4096,2048", help="comma-separated")
    ap.add_argument("--versions", default="2", help="top-K versions of the kernel lab, comma-separated")
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import numpy as np

    from andromeda_nb.devices import resolve

    resolve(args.device, kernels=True)
    from andromeda_nb.measure import software
    from andromeda_nb.provenance import report_probe
    from gpu import runtime
    from gpu.graphs import run_plan
    from gpu.kernels import score as sk
    from gpu.kernels import topk as tk
    from gpu.kernels._bits import keys_to_f32_host
    from gpu.lab import topk as topk_lab

    cuda = runtime.cuda()
    kernel = sk.get_kernel(sk.version(None, "moe", "fp16", 64), "moe", "fp16", 64, 6, 2)
    nb = sk.n_blocks(args.slots, kernel.ads_per_block)
    cap = sk.cap_for(args.k, kernel.ads_per_block)
    k = args.k
    rng = np.random.default_rng(5)
    rows = []
    for R in (int(x) for x in args.requests.split(",")):
        keys = rng.integers(0xBF000000, 0xBF000000 + 4000,  # positive scores about 0.5
                             size=(R, nb, cap), dtype=np.uint32)
        keys[rng.random((R, nb, cap)) >= args.fill] = 0
        slots = rng.permutation(nb * cap).astype(np.int32)[: nb * cap].reshape(1, nb, cap).repeat(R, axis=0)
        slot_ad_id = (np.arange(nb * cap, dtype=np.int64) * 7 + 3)
        d_keys, d_slots, d_ids = cuda.to_device(keys), cuda.to_device(slots), cuda.to_device(slot_ad_id)
        expect = []
        for r in range(R):
            live = keys[r].reshape(-1) != 0
            ids = slot_ad_id[slots[r].reshape(-1)[live]]
            scores = keys[r].reshape(-1)[live].copy()  # order by key: as float32 keys order the scores
            order = np.lexsort((ids, -scores.astype(np.int64)))[:k]
            expect.append((ids[order], scores[order]))
        for number, seg_len in ((int(v), int(x)) for v in args.versions.split(",") for x in args.segment_lens.split(",")):
            n_seg = tk.n_segments(nb * cap, seg_len)
            P = tk.scratch_size(k)
            bufs = dict(sk=cuda.device_array((R, P), np.uint32), ss=cuda.device_array((R, P), np.int32),
                        sid=cuda.device_array((R, P), np.int64), out_id=cuda.device_array((R, k), np.int64),
                        out_score=cuda.device_array((R, k), np.float32), out_count=cuda.device_array(R, np.int32),
                        seg_key=cuda.device_array((R, n_seg, k), np.uint32),
                        seg_slot=cuda.device_array((R, n_seg, k), np.int32))
            recipe = replace(topk_lab.VERSIONS[number].recipe, segment_len=seg_len)
            plan = recipe.plan(d_keys, d_slots, cap, d_ids, k, bufs, R)
            run_plan(plan)
            cuda.synchronize()
            got_ids, got_scores = bufs["out_id"].copy_to_host(), bufs["out_score"].copy_to_host()
            count = bufs["out_count"].copy_to_host()
            ok = all(count[r] == len(expect[r][0]) and np.array_equal(got_ids[r, :count[r]], expect[r][0])
                     and np.array_equal(got_scores[r, :count[r]], keys_to_f32_host(expect[r][1])) for r in range(R))
            row = {"version": number, "requests": R, "segment_len": seg_len, "segments": n_seg, "candidates_per_request": nb * cap,
                   "checked_equal": bool(ok)}
            if args.device == "gpu" and ok:
                start, stop = cuda.event(), cuda.event()
                times = []
                for i in range(args.repeat + 3):
                    start.record()
                    run_plan(plan)
                    stop.record()
                    stop.synchronize()
                    if i >= 3:
                        times.append(cuda.event_elapsed_time(start, stop) * 1e3)
                row["median_us"] = float(np.median(times))
                row["p90_us"] = float(np.percentile(times, 90))
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    result = {"kind": "topk_segments", "slots": args.slots, "k": k, "fill": args.fill, "output_blocks": nb, "cap": cap,
              "rows": rows, "all_checked_equal": all(r["checked_equal"] for r in rows), "env": software()}
    report_probe(result, "probe_topk_segments.py", sys.argv[1:] if argv is None else argv, args.out)
    return 0 if result["all_checked_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
