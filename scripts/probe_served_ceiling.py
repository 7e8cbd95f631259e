"""What the co-located server itself can serve: the `EngineServer` (Flight exchange, request decoding,
batching, answer encoding) around an engine that answers at once from a table computed beforehand,
so the figure is the server's own ceiling in requests per second, with no engine time in it. Clients
run in `--client-processes` processes of `--clients / --client-processes` threads each (one process of
32 threads measures the clients' interpreter as much as the server).

    PYTHONPATH=. python3 scripts/probe_served_ceiling.py --data DIR --clients 32 --client-processes 4

If the ceiling is close to the GPU engine's in-process batch rate, the served path cannot reach it
whatever the engine does; the fix is then in the server's per-call host work.

With `--engines N` the server is the co-located front with N engine worker processes
(`serving.engine_front`, as `serve colocated --engines N`), each around its own answer table
(`benchmarks.table_worker`): the figure is then the front's ceiling, and `front_cpu_ms_per_request`
its process's CPU a request (the workers' is `engine_cpu_ms_per_request`). `--fronts M` adds M front
processes beside the workers (`serve colocated --fronts`), which the clients follow: each front's
batch reaches a worker as one call, and `fronts_cpu_ms_per_request` is their processes' CPU a
request. `--engine-ms`, `--engine-host-ms` and `--overlap` apply to the workers' tables as to the
one-process server's.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from andromeda_nb.measure import write_json  # noqa: E402
from andromeda_nb.provenance import script_command, stamp  # noqa: E402


def main(argv=None) -> int:
    from serving.hostmem import keep_freed_memory

    keep_freed_memory()  # as the servers do (serving.hostmem)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--client-processes", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--batch-wait-ms", type=float, default=0.2)
    ap.add_argument("--exchange", default="call", choices=("call", "stream"),
                    help="'call': an exchange per request; 'stream': one exchange per client, a batch per request")
    ap.add_argument("--request-format", default="json", choices=("json", "columns"),
                    help="the clients' request batches: the JSON column, or the columnar batch")
    ap.add_argument("--engine-ms", type=float, default=0.0,
                    help="a wait per engine batch without the interpreter lock, as a device's (0: none)")
    ap.add_argument("--engine-calls", type=int, default=1,
                    help="the --engine-ms wait made as this many foreign calls (ctypes), each letting go of the "
                         "interpreter lock and taking it back, as a GPU batch's driver calls do")
    ap.add_argument("--engine-host-ms", type=float, default=0.0,
                    help="host work per engine batch holding the interpreter lock, as an engine's host share "
                         "(encoding, the user side; 0: none)")
    ap.add_argument("--overlap", action="store_true",
                    help="the batcher overlaps its batches (serve colocated --overlap-batches): a batch's host work "
                         "while the wait of the one before runs (one-process server only)")
    ap.add_argument("--decode-ahead", action="store_true",
                    help="decode on a thread a stage ahead of the engine, not on the batcher's worker between batches")
    ap.add_argument("--switch-interval-ms", type=float, default=None,
                    help="the server interpreter's thread switch interval (sys.setswitchinterval); default: a "
                         "serving process's (serving.process.SWITCH_INTERVAL_MS) with --engines, else Python's 5 ms")
    ap.add_argument("--engines", type=int, default=0,
                    help="the co-located front over this many worker processes, each around an answer table "
                         "(0: one process, the one-engine server)")
    ap.add_argument("--fronts", type=int, default=0,
                    help="with --engines N: this many front processes beside the workers (serve colocated --fronts), "
                         "which the clients follow")
    ap.add_argument("--no-freeze", action="store_true",
                    help="leave what was built in the garbage collector's sight (a serving process freezes it)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.clients % args.client_processes:
        ap.error("--clients must be a multiple of --client-processes")

    from serving.engine_server import EngineServer
    from andromeda_nb.store import load_dataset
    from benchmarks.clients import AnswerTable, drive

    if args.switch_interval_ms is None and args.engines:
        from serving.process import SWITCH_INTERVAL_MS

        args.switch_interval_ms = SWITCH_INTERVAL_MS  # as `serve colocated` runs its front
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    dataset = load_dataset(args.data)
    if args.fronts and not args.engines:
        ap.error("--fronts: the fronts send their batches to engine workers; give --engines 1 or more")
    if args.engines:
        from serving.engine_front import start_pooled_server
        from serving.guard import OPEN

        config = {"data": args.data, "device": "cpu", "batch_wait_s": args.batch_wait_ms / 1e3,
                  "decode_ahead": args.decode_ahead, "table_k": args.k, "engine_ms": args.engine_ms,
                  "engine_host_ms": args.engine_host_ms, "overlap": args.overlap,
                  "switch_interval_ms": args.switch_interval_ms}
        server = start_pooled_server(dataset, "grpc://127.0.0.1:0", module="benchmarks.table_worker", config=config,
                                     engines=args.engines, fronts=args.fronts,
                                     front_endpoint={"host": "127.0.0.1", "guard": OPEN.to_json()})
    else:
        server = EngineServer(AnswerTable.computed(dataset, args.k, args.engine_ms / 1e3, args.engine_calls,
                                                   args.engine_host_ms / 1e3),
                              dataset, batch_wait_s=args.batch_wait_ms / 1e3, decode_ahead=args.decode_ahead,
                              overlap=args.overlap)
    location = f"grpc://127.0.0.1:{server.port}"
    if not args.no_freeze:
        import gc

        gc.collect()
        gc.freeze()  # as a serving process does before it serves (serving.process.serve_until_stopped)
    threading.Thread(target=server.serve, daemon=True).start()
    locations = server.retrieve_endpoints() if args.fronts else location  # the clients follow the fronts
    cpu0 = time.process_time()  # this process is the server (or its front): the clients run in their own processes
    before = server.extra_stats() if args.engines else {}
    result = drive(locations, args.data, k=args.k, clients=args.clients, processes=args.client_processes,
                   seconds=args.seconds, exchange=args.exchange, request_format=args.request_format)
    result["server_cpu_ms_per_request"] = 1e3 * (time.process_time() - cpu0) / max(1, result["requests"])
    if args.engines:
        result["front_cpu_ms_per_request"] = result.pop("server_cpu_ms_per_request")
        after = server.extra_stats()
        for name, key in (("engine_cpu_ms_per_request", "engine_cpu_s"), ("fronts_cpu_ms_per_request", "front_cpu_s")):
            if key in after:  # the engine workers' processes, and the fronts', apart
                result[name] = 1e3 * (after[key] - before[key]) / max(1, result["requests"])
        result["front_batching"] = after.get("front_batching")
        stats = after["batching"]
    else:
        stats = server.batcher.stats()
    result["call_path"] = server.call_path.snapshot()
    server.shutdown()
    server.close_resources()
    out = {"ads": dataset.n_ads, "requests": len(dataset.requests), "k": args.k, "engines": args.engines,
           "fronts": args.fronts,
           "engine_ms": args.engine_ms, "engine_host_ms": args.engine_host_ms, "overlap": args.overlap,
           "switch_interval_ms": args.switch_interval_ms, **result,
           "batching": stats}
    stamp(out, command=script_command("probe_served_ceiling.py", argv if argv is not None else sys.argv[1:]))
    engine = "no engine time" if not args.engine_ms else f"a wait of {args.engine_ms:g} ms a batch"
    engine += f", {args.engine_host_ms:g} ms of host work a batch" if args.engine_host_ms else ""
    engine += ", batches overlapped" if args.overlap else ""
    cpu = (f"the front's CPU {out['front_cpu_ms_per_request']:.3f} ms a request, the workers' "
           f"{out['engine_cpu_ms_per_request']:.3f} ({args.engines} workers)"
           + (f", the fronts' {out['fronts_cpu_ms_per_request']:.3f} ({args.fronts} fronts)" if args.fronts else "")
           if args.engines else f"server CPU {out['server_cpu_ms_per_request']:.3f} ms a request")
    print(f"server ceiling (answers looked up, {engine}): {out['requests_per_s']:.0f} requests/s, {cpu}, "
          f"p50 {out['latency_ms']['p50']:.2f} ms, p99 {out['latency_ms']['p99']:.2f} ms, "
          f"{args.clients} clients in {args.client_processes} processes, batching {stats}, call path {result['call_path']}")
    if args.out:
        write_json(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
