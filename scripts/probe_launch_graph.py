"""Where one request's host time goes on a GPU machine, and what a CUDA graph of its launches saves.

On the pool of `andromeda bench pipeline` (a tiled base corpus, fp16, D = 64, k = 100), one request at
a time, as `gpu.engine.GpuEngine` serves a lone batch:

1. `cProfile` over the engine's steps for one request (user side, encoding, match preparation and
   upload, match launch, scoring and top-K launches, answers): the functions by their own time;
2. each host call alone, the median of many in microseconds (the device synchronized between calls,
   outside the timing);
3. the shipped batch pipeline (`gpu.pipeline`: the upload, five kernels and three copies as one plan),
   step by step and replayed from CUDA graphs; every answer checked equal to the direct launches'
   before anything is timed, then the latency of one request each way, interleaved, and the graph
   path's host calls and profile.

    PYTHONPATH=. python3 scripts/probe_launch_graph.py --pool 10000000 --out OUT.json
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
    parser.add_argument("--pool", type=int, default=10_000_000)
    parser.add_argument("--layout", default="geo")
    parser.add_argument("--requests", type=int, default=300, help="timed requests per figure")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import numpy as np

    from andromeda_nb.provenance import finish_probe
    from andromeda_nb.compiled import encode_requests
    from andromeda_nb.model import user_sides
    from andromeda_nb.scoring import fold_tables_batch
    from benchmarks.score import CHECK_K, pipeline_pool

    pp = pipeline_pool(pool=args.pool, layout=args.layout)

    index, fs, model, requests = pp.index, pp.scorer, pp.model, pp.requests
    k, stream, N = CHECK_K, index.stream, args.requests
    result = dict(pp.header)

    def tables(reqs):
        return fold_tables_batch(*user_sides(model, reqs))

    def direct(req):  # GpuEngine.retrieve of one request
        tabs = tables(req)
        batch = index.prepare(encode_requests(req), reuse=True)
        elig = index.kept_output(1)
        index.run(batch, elig)
        b = fs.launch(elig, tabs, k, stream)
        return fs.fetch(b, 1, stream)

    for r in requests[:8]:
        direct([r])
    # 1. the profile
    prof = cProfile.Profile()
    prof.enable()
    for i in range(N):
        direct([requests[i % len(requests)]])
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    print(text.getvalue()[:9000])
    result["profile_tottime"] = text.getvalue()[:20000]

    # 2. each host call alone
    calls: dict[str, list] = {}

    def timed(name, fn):
        stream.synchronize()
        t = time.perf_counter()
        out = fn()
        calls.setdefault(name, []).append((time.perf_counter() - t) * 1e6)
        stream.synchronize()
        return out

    for i in range(N):
        req = [requests[i % len(requests)]]
        tabs = timed("user_side", lambda: tables(req))
        enc = timed("encode_requests", lambda: encode_requests(req))
        batch = timed("index.prepare", lambda: index.prepare(enc, reuse=True))
        elig = timed("index.kept_output", lambda: index.kept_output(1))
        timed("index._index_arrays", index._index_arrays)
        timed("index.run", lambda: index.run(batch, elig))
        b = timed("fs._buffers", lambda: fs._buffers(1, k))
        d_tabs = timed("fs._upload_tables", lambda: fs._upload_tables(b, np.ascontiguousarray(tabs, np.float32), stream))
        cap = timed("cap_for", lambda: __import__("gpu.kernels.score", fromlist=["cap_for"]).cap_for(k, fs.kernel.ads_per_block))
        timed("score launch (prep + kernel)", lambda: fs.kernel.launch(fs.d_emb, fs.d_scale, fs.d_chunk_format, elig, d_tabs,
                                                                       cap, b["cand_key"], b["cand_slot"], stream))
        timed("final_topk", lambda: fs.final_topk(b, cap, k, 1, stream))
        timed("fetch", lambda: fs.fetch(b, 1, stream))
    result["host_calls_us"] = {name: float(np.median(v)) for name, v in calls.items()}
    for name, v in result["host_calls_us"].items():
        print(f"{name:32s} {v:9.1f} us")

    # 3. the shipped batch pipeline (gpu.pipeline), step by step and from CUDA graphs
    from gpu.pipeline import BatchPipeline

    pipes = {"direct_steps": BatchPipeline(index, fs, graphs=False), "graph": BatchPipeline(index, fs, graphs=True)}

    def pipe_run(pipe, req):
        prepared = pipe.prepare(encode_requests(req), tables(req))
        return pipe.fetch(pipe.launch(prepared, k))

    checks = {name: 0 for name in pipes}
    for i in range(64):
        req = [requests[i % len(requests)]]
        want = direct(req)
        for name, pipe in pipes.items():
            for _ in range(3):  # first sighting, capture, replay
                got = pipe_run(pipe, req)
            checks[name] += int(np.array_equal(got[0][0], want[0][0]) and np.array_equal(got[0][1], want[0][1])
                                and len(want[0][0]) > 0)
    result["equal_to_direct_of_64"] = checks
    result["graphs"] = {"captures": pipes["graph"].graphs.captures, "kept": len(pipes["graph"].graphs)}
    print("answers equal to the direct launches (of 64):", checks, result["graphs"])
    lat = {"direct": [], **{name: [] for name in pipes}}
    for i in range(N):
        req = [requests[i % len(requests)]]
        for name in lat:
            t = time.perf_counter()
            direct(req) if name == "direct" else pipe_run(pipes[name], req)
            lat[name].append((time.perf_counter() - t) * 1e3)
    result["latency_ms"] = {name: {"p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99))}
                            for name, v in lat.items()}
    for name, v in result["latency_ms"].items():
        print(f"latency {name:16s} p50 {v['p50']:.3f} ms  p99 {v['p99']:.3f} ms")
    # the graph path's host calls, each alone
    g = pipes["graph"]
    gcalls: dict[str, list] = {}
    for i in range(N):
        req = [requests[i % len(requests)]]
        stream.synchronize()
        t0 = time.perf_counter()
        tabs = tables(req)
        t1 = time.perf_counter()
        enc = encode_requests(req)
        t2 = time.perf_counter()
        prepared = g.prepare(enc, tabs)
        t3 = time.perf_counter()
        launched = g.launch(prepared, k)
        t4 = time.perf_counter()
        g.fetch(launched)
        t5 = time.perf_counter()
        for name, dt in zip(("user_side", "encode", "prepare", "launch", "fetch_wait"),
                            (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            gcalls.setdefault(name, []).append(dt * 1e6)
    result["graph_host_calls_us"] = {name: float(np.median(v)) for name, v in gcalls.items()}
    print("graph path, host calls (median us):", {n: round(v, 1) for n, v in result["graph_host_calls_us"].items()})
    prof = cProfile.Profile()
    prof.enable()
    for i in range(N):
        pipe_run(g, [requests[i % len(requests)]])
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(20)
    print(text.getvalue()[:6000])
    result["graph_profile_tottime"] = text.getvalue()[:12000]
    finish_probe(result, "probe_launch_graph.py", sys.argv[1:] if argv is None else argv, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
