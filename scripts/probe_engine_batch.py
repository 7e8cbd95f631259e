"""Where a batch's time goes in the co-located engine on a generated corpus, as `bench_served.py`'s
in-process figure runs it (`GpuEngine.retrieve` of one batch, waited for before the next).

For each batch size: `retrieve` timed whole; then the same batch's stages, each waited for: the
user side and the match preparation on the host (wall clock), the match, scoring and top-K on the
device (CUDA events between the plan's steps), the answers' way to the host; then `cProfile` over
whole `retrieve` calls, the functions by their own time, and the time the host spends waiting for
the device. Every answer is checked equal to the engine's first answers before anything is timed.

    PYTHONPATH=. python3 scripts/probe_engine_batch.py --data /tmp/c1000000 --batches 1,16,64
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="corpus directory (made by `andromeda generate`)")
    parser.add_argument("--device", default="gpu", choices=("gpu", "sim"))
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=30, help="timed calls per figure")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import numpy as np

    from andromeda_nb.provenance import finish_probe
    from andromeda_nb.compiled import encode_requests
    from serving.hostmem import keep_freed_memory
    from andromeda_nb.store import load_dataset
    from migration.architectures import build_engine

    keep_freed_memory()  # as the servers do
    ds = load_dataset(args.data)
    t0 = time.perf_counter()
    engine = build_engine(ds, args.device)
    build_s = time.perf_counter() - t0
    requests = list(ds.requests)
    pipe = engine.pipeline
    from gpu import runtime

    cuda = runtime.cuda()
    marks = [cuda.event(timing=True) for _ in range(4)] if args.device == "gpu" else None
    result: dict = {"ads": ds.n_ads, "requests": len(requests), "k": args.k, "build_s": build_s,
                    "precision": ds.precision, "dim": ds.model.D,
                    "layout": engine.layout, "match_version": engine.index.version,
                    "score_version": str(engine.scorer.version), "batches": []}
    for size in [int(b) for b in args.batches.split(",")]:
        reqs = [requests[i % len(requests)] for i in range(size)]
        want = engine.retrieve(reqs, args.k)
        for _ in range(3):
            got = engine.retrieve(reqs, args.k)
            if not all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(want, got)):
                raise SystemExit(f"batch {size}: the engine's answers changed between calls")
        t = time.perf_counter()
        for _ in range(args.repeat):
            engine.retrieve(reqs, args.k)
        whole = (time.perf_counter() - t) / args.repeat
        stages: dict[str, list] = {"user_side_host": [], "encode_host": [], "prepare_host": [], "launch_host": [],
                                   "match_kernel": [], "score_kernel": [], "topk_kernel": [], "answers_host": []}
        for _ in range(args.repeat if marks else 0):
            h0 = time.perf_counter()
            tabs = engine.tables(reqs)
            h1 = time.perf_counter()
            enc = encode_requests(reqs)
            h2 = time.perf_counter()
            prepared = pipe.prepare(enc, tabs)
            h3 = time.perf_counter()
            launched = pipe.launch(prepared, args.k, marks)
            h4 = time.perf_counter()
            marks[3].synchronize()
            h5 = time.perf_counter()
            pipe.fetch(launched)
            h6 = time.perf_counter()
            for name, dt in zip(("user_side_host", "encode_host", "prepare_host", "launch_host"),
                                (h1 - h0, h2 - h1, h3 - h2, h4 - h3)):
                stages[name].append(dt * 1e3)
            for name, (a, z) in zip(("match_kernel", "score_kernel", "topk_kernel"), zip(marks, marks[1:])):
                stages[name].append(cuda.event_elapsed_time(a, z))
            stages["answers_host"].append((h6 - h5) * 1e3)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.repeat):
            engine.retrieve(reqs, args.k)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        row = {"batch": size, "retrieve_ms": whole * 1e3, "requests_per_s": size / whole,
               "stages_ms": {n: float(np.median(v)) for n, v in stages.items() if v},
               "profile_tottime": text.getvalue()}
        result["batches"].append(row)
        print(f"batch {size:3d}: retrieve {whole * 1e3:.3f} ms ({size / whole:,.0f} requests/s); stages "
              + "  ".join(f"{n} {v:.3f}" for n, v in row["stages_ms"].items()), flush=True)
        print("\n".join(text.getvalue().splitlines()[:40]), flush=True)
    argv = sys.argv[1:] if argv is None else argv
    finish_probe(result, "probe_engine_batch.py", argv, args.out)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
