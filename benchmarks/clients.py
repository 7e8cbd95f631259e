"""Many plain Flight clients against one `["retrieve"]` server, for the served-path measurements
(`scripts/bench_served.py`, `scripts/probe_served_ceiling.py`): `clients` threads spread over
`processes` processes, each thread its own `pyarrow.flight` client sending one request at a time for
`seconds`, each in an exchange of its own (`exchange='call'`) or as the next batch of one exchange
the client keeps open (`'stream'`: no stream set-up per request, on either side). One process of many threads measures that process's interpreter as much as the
server; several processes give the clients their own cores, as separate machines would.

    result = drive(location, data_dir, k=100, clients=32, processes=4, seconds=20, want=answers)

`want` (optional): the answer each request must get, by request position; answers to the first pass
of every thread are compared with it, and the mismatches counted and named. `AnswerTable` is an
engine that answers from a table computed beforehand, to measure a server with no engine time.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time
from collections.abc import Sequence

import numpy as np


def content_key(request) -> bytes:
    """A request told apart from the others of its corpus without its id: its signals, as float32 bytes
    (every request form carries them; drawn per request, so no two requests of a corpus share them,
    which `AnswerTable.computed` checks)."""
    return np.asarray(request.signals, np.float32).tobytes()


class AnswerTable:
    """An `interfaces.Engine` whose answers were computed beforehand, looked up by request id: a
    server around it serves at its own ceiling (decoding, batching, encoding), with no engine time."""

    device = "table"

    max_batch = 1 << 30  # a batch in steps (serving.overlap) of any size

    def __init__(self, answers: dict, wait_s: float = 0.0, calls: int = 1, host_s: float = 0.0,
                 by_content: dict | None = None):
        self.answers = answers
        # the same answers by what a request holds (`content_key`), for a table behind fronts
        # (serving.lane_engine), which number the requests of a batch 0 to n - 1; None: by request id
        self.by_content = by_content
        # host work per batch holding the interpreter lock, as an engine's host share (encoding, user side)
        self.host_s = float(host_s)
        # a wait per batch without the interpreter lock, as a device's: the server's host work can
        # overlap it (a probe of the pipeline, not of any engine); in `calls` foreign calls, each of
        # which lets go of the lock and takes it back, as a GPU batch's driver calls through ctypes do
        self.wait_s = float(wait_s)
        self.calls = max(1, int(calls))

    @classmethod
    def computed(cls, dataset, k: int, wait_s: float = 0.0, calls: int = 1, host_s: float = 0.0) -> "AnswerTable":
        """The answers to every request of `dataset` at `k`, computed once by the CPU engine."""
        from migration.architectures import build_engine

        engine = build_engine(dataset, "cpu")
        try:
            answers = engine.retrieve(dataset.requests, k)
        finally:
            engine.close()
        by_content = {content_key(r): a for r, a in zip(dataset.requests, answers)}
        if len(by_content) < len(answers):
            by_content = None  # two requests alike but for their ids: looked up by id only
        return cls({r.request_id: a for r, a in zip(dataset.requests, answers)}, wait_s, calls, host_s, by_content)

    def retrieve(self, requests, k):
        self._host_work()
        self._wait(self.wait_s)
        return self._looked_up(requests, k)

    # a batch in steps (serving.overlap): the host work at `begin`, the wait from `launch` to `fetch`
    def begin(self, requests, alone: bool = False):
        self._host_work()
        return list(requests)

    def launch(self, begun, k: int):
        return begun, k, time.perf_counter() + self.wait_s

    def ready(self, launched) -> bool:
        return time.perf_counter() >= launched[2]

    def fetch(self, launched):
        requests, k, done_at = launched
        self._wait(done_at - time.perf_counter())
        return self._looked_up(requests, k)

    def _looked_up(self, requests, k: int) -> list:
        if self.by_content is not None:
            return [tuple(a[:k] for a in self.by_content[content_key(r)]) for r in requests]
        return [tuple(a[:k] for a in self.answers[r.request_id]) for r in requests]

    def _host_work(self) -> None:
        """`host_s` of work holding the interpreter lock (a loop of Python steps)."""
        end = time.perf_counter() + self.host_s
        while time.perf_counter() < end:
            pass

    def _wait(self, wait_s: float) -> None:
        """A wait without the interpreter lock, as a device's."""
        if wait_s > 0:
            if self.calls == 1:
                time.sleep(wait_s)
            else:
                import ctypes

                usleep = ctypes.CDLL(None).usleep
                for _ in range(self.calls):
                    usleep(int(1e6 * wait_s / self.calls))

    def apply(self, update):
        raise RuntimeError("an answer table takes no updates")

    def describe(self):
        return {"device": self.device, "engine": "answer table (computed beforehand)"}

    def close(self):
        pass

    def __contains__(self, ad_id):
        return False


EXCHANGES = ("call", "stream")


class KeptExchange:
    """One `["retrieve"]` exchange kept open: each call writes one request batch and reads its answer
    batch (the server answers batch by batch); reopened when the server ends it (its deadline)."""

    def __init__(self, conn):
        self.conn, self.writer, self.reader = conn, None, None

    def retrieve(self, encoded):
        import pyarrow.flight as flight

        from serving import protocol as fl

        batches, ids = encoded
        for attempt in (0, 1):
            if self.writer is None:
                self.writer, self.reader = self.conn.do_exchange(flight.FlightDescriptor.for_path(*fl.RETRIEVE_PATH))
                self.writer.begin(batches[0].schema)
            try:
                self.writer.write_batch(batches[0])
                return fl.split_answers(self.reader.read_chunk().data, ids)
            except Exception:  # noqa: BLE001 - the exchange ended (deadline, restart): open another once
                self.close()
                if attempt:
                    raise

    def close(self):
        if self.writer is not None:
            try:
                self.writer.close()
            except Exception:  # noqa: BLE001 - closing a broken exchange
                pass
        self.writer = self.reader = None


def _process(locations: list[str], data: str, k: int, threads: int, first: int, stride: int, seconds: float,
             want, out, exchange: str = "call", ready=None, go=None, request_format: str = "json") -> None:
    from serving import protocol as fl
    from serving.guard import connect
    from andromeda_nb.store import load_requests

    requests = load_requests(data)  # the requests alone: loading the ads would only compete with the server
    encoded = ([fl.encode_requests_for_exchange([r], k, request_format=request_format) for r in requests]
               if exchange == "stream" else None)
    latencies: list[float] = []
    wrong: list[str] = []
    lock = threading.Lock()
    if ready is not None:  # every process starts sending at once, when all are ready
        ready.put(first)
        go.wait()
    stop = time.perf_counter() + seconds

    def client(t: int) -> None:
        i, mine = first + t * stride, []
        location = locations[i % len(locations)]  # clients spread evenly over the servers
        conn = connect(location)
        stream = KeptExchange(conn) if exchange == "stream" else None
        try:
            while time.perf_counter() < stop:
                r = requests[i % len(requests)]
                s = time.perf_counter()
                if stream is None:
                    ids, _ = fl.retrieve_over_flight(location, [r], k, client=conn, request_format=request_format)[0]
                else:
                    ids, _ = stream.retrieve(encoded[i % len(requests)])[0]
                mine.append(time.perf_counter() - s)
                if want is not None and i < len(requests) and not np.array_equal(ids, want[i]):
                    with lock:
                        wrong.append(f"request {r.request_id}")
                i += threads * stride
        finally:
            if stream is not None:
                stream.close()
            conn.close()
            with lock:
                latencies.extend(mine)

    pool = [threading.Thread(target=client, args=(t,)) for t in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    out.put((latencies, wrong))


def drive(location: str | Sequence[str], data: str, *, k: int, clients: int, processes: int = 1,
          seconds: float = 20.0, want=None, exchange: str = "call", request_format: str = "json") -> dict:
    """Run the clients (module docstring); returns requests/s, latency p50/p99 and the wrong answers.
    `location`: a server's, or several: client i talks to the (i mod n)-th.
    `exchange`: 'call' opens an exchange for every request; 'stream' keeps one open per client and
    sends each request as the next batch on it (requests encoded beforehand). `request_format`: the
    request batches' kind, 'json' or 'columns' (`serving.protocol.REQUEST_FORMATS`)."""
    if clients < 1 or processes < 1 or clients % processes:
        raise ValueError(f"{clients} clients do not split evenly over {processes} processes")
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange is one of {', '.join(EXCHANGES)}, not {exchange!r}")
    want = None if want is None else [np.asarray(ids) for ids, _ in want]
    ctx = mp.get_context("spawn")
    out, ready, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    per = clients // processes
    locations = [location] if isinstance(location, str) else list(location)
    procs = [ctx.Process(target=_process, args=(locations, data, k, per, p, processes, seconds, want, out, exchange,
                                                ready, go, request_format))
             for p in range(processes)]
    for p in procs:
        p.start()
    waiting, deadline = len(procs), time.monotonic() + 300
    while waiting:
        try:
            ready.get(timeout=0.5)
            waiting -= 1
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode is not None]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"a client process ended before sending (exit codes {dead})" if dead
                                   else "the client processes were not ready within 300 s")
    started = time.perf_counter()
    go.set()
    results = [out.get(timeout=seconds + 300) for _ in procs]
    elapsed = time.perf_counter() - started
    for p in procs:
        p.join(30)
    ms = np.asarray([x for lat, _ in results for x in lat]) * 1e3
    wrong = [w for _, ws in results for w in ws]
    return {"requests_per_s": len(ms) / seconds, "requests": int(len(ms)), "clients": clients,
            "client_processes": processes, "exchange": exchange, "request_format": request_format,
            "seconds": seconds, "wall_s": elapsed,
            "latency_ms": {"p50": float(np.percentile(ms, 50)) if len(ms) else None,
                           "p99": float(np.percentile(ms, 99)) if len(ms) else None},
            "wrong_answers": wrong[:10], "n_wrong": len(wrong)}


__all__ = ["AnswerTable", "EXCHANGES", "KeptExchange", "content_key", "drive"]
