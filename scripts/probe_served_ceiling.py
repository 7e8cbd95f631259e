"""What the co-located server itself can serve: the `EngineServer` (Flight exchange, request decoding,
batching, answer encoding) around an engine that answers at once from a table computed beforehand,
so the figure is the server's own ceiling in requests per second, with no engine time in it. Clients
run in `--client-processes` processes of `--clients / --client-processes` threads each (one process of
32 threads measures the clients' interpreter as much as the server).

    PYTHONPATH=. python3 scripts/probe_served_ceiling.py --data DIR --clients 32 --client-processes 4

If the ceiling is close to the GPU engine's in-process batch rate, the served path cannot reach it
whatever the engine does; the fix is then in the server's per-call host work.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from andromeda_nb.provenance import host_info  # noqa: E402


class TableEngine:
    """An engine whose answers were computed beforehand (by the CPU engine) and are looked up by
    request id: no engine time in the served figure."""

    device = "table"

    def __init__(self, answers: dict):
        self.answers = answers

    def retrieve(self, requests, k):
        return [tuple(a[:k] for a in self.answers[r.request_id]) for r in requests]

    def apply(self, update):
        raise RuntimeError("the table engine takes no updates")

    def describe(self):
        return {"device": self.device, "engine": "table (answers computed beforehand)"}

    def close(self):
        pass

    def __contains__(self, ad_id):
        return False


def _clients(location: str, data: str, threads: int, first: int, step: int, seconds: float, k: int, q) -> None:
    from andromeda_nb import flight as fl
    from andromeda_nb.guard import connect
    from andromeda_nb.store import load_dataset

    requests = load_dataset(data).requests
    done = [0] * threads
    lat: list[float] = []
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def one(t: int):
        conn = connect(location)
        i, mine = first + t * step, []
        while time.perf_counter() < stop:
            s = time.perf_counter()
            fl.retrieve_over_flight(location, [requests[i % len(requests)]], k, client=conn)
            mine.append(time.perf_counter() - s)
            done[t] += 1
            i += threads * step
        conn.close()
        with lock:
            lat.extend(mine)

    ts = [threading.Thread(target=one, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    q.put((sum(done), lat))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--client-processes", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--batch-wait-ms", type=float, default=0.2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.clients % args.client_processes:
        ap.error("--clients must be a multiple of --client-processes")

    from andromeda_nb.engine_server import EngineServer
    from andromeda_nb.store import load_dataset
    from migration.architectures import build_engine

    dataset = load_dataset(args.data)
    cpu = build_engine(dataset, "cpu")
    answers = {r.request_id: a for r, a in zip(dataset.requests, cpu.retrieve(dataset.requests, args.k))}
    cpu.close()
    server = EngineServer(TableEngine(answers), dataset, batch_wait_s=args.batch_wait_ms / 1e3)
    location = f"grpc://127.0.0.1:{server.port}"
    threading.Thread(target=server.serve, daemon=True).start()
    per = args.clients // args.client_processes
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_clients, args=(location, args.data, per, p, args.client_processes, args.seconds,
                                                 args.k, q)) for p in range(args.client_processes)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    results = [q.get(timeout=args.seconds + 120) for _ in procs]
    elapsed = time.perf_counter() - t0
    for p in procs:
        p.join(30)
    stats = server.batcher.stats()
    server.shutdown()
    n = sum(r[0] for r in results)
    ms = np.asarray([x for r in results for x in r[1]]) * 1e3
    out = {"ads": dataset.n_ads, "requests": len(dataset.requests), "k": args.k, "clients": args.clients,
           "client_processes": args.client_processes, "seconds": args.seconds,
           "requests_per_s": n / args.seconds, "calls": int(n), "wall_s": elapsed,
           "latency_ms": {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99))},
           "batching": stats, "host": host_info(),
           "command": "python3 scripts/probe_served_ceiling.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    print(f"server ceiling (answers looked up, no engine time): {out['requests_per_s']:.0f} requests/s, "
          f"p50 {out['latency_ms']['p50']:.2f} ms, p99 {out['latency_ms']['p99']:.2f} ms, "
          f"{args.clients} clients in {args.client_processes} processes, batching {stats}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
