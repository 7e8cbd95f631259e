"""Many plain Flight clients against one `["retrieve"]` server, for the served-path measurements
(`scripts/bench_served.py`, `scripts/probe_served_ceiling.py`): `clients` threads spread over
`processes` processes, each thread its own `pyarrow.flight` client sending one request per exchange
for `seconds`. One process of many threads measures that process's interpreter as much as the
server; several processes give the clients their own cores, as separate machines would.

    result = drive(location, data_dir, k=100, clients=32, processes=4, seconds=20, want=answers)

`want` (optional): the answer each request must get, by request position; answers to the first pass
of every thread are compared with it, and the mismatches counted and named. `AnswerTable` is an
engine that answers from a table computed beforehand, to measure a server with no engine time.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import numpy as np


class AnswerTable:
    """An `interfaces.Engine` whose answers were computed beforehand, looked up by request id: a
    server around it serves at its own ceiling (decoding, batching, encoding), with no engine time."""

    device = "table"

    def __init__(self, answers: dict):
        self.answers = answers

    def retrieve(self, requests, k):
        return [tuple(a[:k] for a in self.answers[r.request_id]) for r in requests]

    def apply(self, update):
        raise RuntimeError("an answer table takes no updates")

    def describe(self):
        return {"device": self.device, "engine": "answer table (computed beforehand)"}

    def close(self):
        pass

    def __contains__(self, ad_id):
        return False


def _process(location: str, data: str, k: int, threads: int, first: int, stride: int, seconds: float,
             want, out) -> None:
    from andromeda_nb import flight as fl
    from andromeda_nb.guard import connect
    from andromeda_nb.store import load_dataset

    requests = load_dataset(data).requests
    latencies: list[float] = []
    wrong: list[str] = []
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def client(t: int) -> None:
        conn = connect(location)
        i, mine = first + t * stride, []
        try:
            while time.perf_counter() < stop:
                r = requests[i % len(requests)]
                s = time.perf_counter()
                ids, _ = fl.retrieve_over_flight(location, [r], k, client=conn)[0]
                mine.append(time.perf_counter() - s)
                if want is not None and i < len(requests) and not np.array_equal(ids, want[i]):
                    with lock:
                        wrong.append(f"request {r.request_id}")
                i += threads * stride
        finally:
            conn.close()
            with lock:
                latencies.extend(mine)

    pool = [threading.Thread(target=client, args=(t,)) for t in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    out.put((latencies, wrong))


def drive(location: str, data: str, *, k: int, clients: int, processes: int = 1, seconds: float = 20.0,
          want=None) -> dict:
    """Run the clients (module docstring); returns requests/s, latency p50/p99 and the wrong answers."""
    if clients < 1 or processes < 1 or clients % processes:
        raise ValueError(f"{clients} clients do not split evenly over {processes} processes")
    want = None if want is None else [np.asarray(ids) for ids, _ in want]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    per = clients // processes
    procs = [ctx.Process(target=_process, args=(location, data, k, per, p, processes, seconds, want, out))
             for p in range(processes)]
    started = time.perf_counter()
    for p in procs:
        p.start()
    results = [out.get(timeout=seconds + 300) for _ in procs]
    elapsed = time.perf_counter() - started
    for p in procs:
        p.join(30)
    ms = np.asarray([x for lat, _ in results for x in lat]) * 1e3
    wrong = [w for _, ws in results for w in ws]
    return {"requests_per_s": len(ms) / seconds, "requests": int(len(ms)), "clients": clients,
            "client_processes": processes, "seconds": seconds, "wall_s": elapsed,
            "latency_ms": {"p50": float(np.percentile(ms, 50)) if len(ms) else None,
                           "p99": float(np.percentile(ms, 99)) if len(ms) else None},
            "wrong_answers": wrong[:10], "n_wrong": len(wrong)}


__all__ = ["AnswerTable", "drive"]
