"""The fronts of a co-located server (`serve colocated --fronts N`): processes that take the clients'
exchanges and the host work of their requests off the engine's process.

One engine reads the pool once for every request of its batch, so on a GPU it serves most in large
batches; but a process that runs Flight's exchanges, decodes requests and encodes answers for many
clients spends most of its time holding its one interpreter lock (docs/BENCHMARKS.md, "The served
path with many clients"), and several engines on one GPU each run small batches and take the device
in time slices. A front process keeps the engine whole and spreads the per-request work: it serves
the `["retrieve"]` exchange on a Flight server of its own (`serving.engine_worker.WorkerEndpoint`,
with the server's guard and limits; the server's GetFlightInfo lists the fronts), and its batcher
gathers the requests of the calls that come together, decodes and checks them as a one-engine
server does, and runs them on a `LaneEngine`: one columnar request batch (`serving.request_columns`),
its requests numbered 0 to n - 1 (the calls of many clients may share request ids), sent on a
request lane (`serving.engine_channel.Lanes`) to an engine worker, whose batcher joins it with
the other fronts' batches into one engine batch. The answer batch that comes back is split per
request and each call's answers encoded here. So the engine's process does one call's Python per
front batch, not per request.

A front holds no updates: the server's own front takes them and acknowledges a call once every
engine worker applied it, so a request a front sends afterwards is answered after it; the answers
name the seq the engine worker reflected.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from .engine_channel import Lanes, split_answer
from .engine_worker import EngineWorker
from .protocol import ANSWER_SCHEMA


@dataclass
class CorpusHead:
    """What a front needs of a corpus to check requests: its model (experts, widths, dimensions,
    formats), seed and meta (the snapshot's seq); no ads. `requests` is empty: a front warms nothing
    up (its engine is another process's)."""

    model: object
    seed: int
    meta: dict
    requests: list = field(default_factory=list)


def corpus_head(data_dir) -> CorpusHead:
    from andromeda_nb.store import load_head

    meta, model = load_head(data_dir)
    return CorpusHead(model=model, seed=int(meta["seed"]), meta=meta)


class LaneEngine:
    """An engine worker in another process (`name`, its lane socket at `path`), as a front's batcher
    runs it: `retrieve_at(requests, k)` sends the batch on a lane and returns (answers, the seq they
    reflect). `limits`: the server's (`serving.limits.ServiceLimits`): the engine worker holds each
    call to them, so a batch past its requests or bytes goes in parts that keep within them; its
    `deadline_s` is how long a part may wait for its answers."""

    device = "lane"

    def __init__(self, path: str, name: str, limits=None):
        from .limits import DEFAULT_LIMITS

        self.name, self.limits = name, limits or DEFAULT_LIMITS
        self.timeout_s = self.limits.deadline_s
        self.lanes = Lanes(path, name, self._lost)
        self._ids = itertools.count(1)
        self._schema: tuple[pa.Schema, bytes] | None = None

    def _lost(self):
        import pyarrow.flight as flight

        return flight.FlightUnavailableError(f"{self.name} closed the request lane before answering (it has ended "
                                             "or is stopping): the call was not answered; the server's health "
                                             "says why")

    def _schema_bytes(self, schema: pa.Schema) -> bytes:
        cached = self._schema
        if cached is None or not cached[0].equals(schema):
            cached = self._schema = (schema, schema.serialize().to_pybytes())
        return cached[1]

    def retrieve_at(self, requests, k: int) -> tuple[list, int]:
        """Each request's top `k` (ad ids int64, scores float32), and the seq of the last update they
        all reflect (the least of its parts', when it went in parts: a part past the limits is halved
        until each keeps within them, or is one request)."""
        n = len(requests)
        batch = columnar_batch(requests, k, np.arange(n, dtype=np.int64))
        if n < 2 or (n <= self.limits.max_batch_requests
                     and batch.get_total_buffer_size() <= self.limits.max_request_bytes):
            return self._ask(batch)
        first, first_seq = self.retrieve_at(requests[: n // 2], k)
        rest, rest_seq = self.retrieve_at(requests[n // 2:], k)
        return first + rest, min(first_seq, rest_seq)

    def _ask(self, batch: pa.RecordBatch) -> tuple[list, int]:
        msg = self.lanes.request(next(self._ids), self._schema_bytes(batch.schema), batch.serialize(),
                                 self.timeout_s, "request batch (the server's deadline, --deadline)")
        _, seq, _, _, data = split_answer(msg)
        return split_answers(pa.ipc.read_record_batch(pa.py_buffer(data), ANSWER_SCHEMA), batch.num_rows), seq

    def retrieve(self, requests, k: int) -> list:
        return self.retrieve_at(requests, k)[0]

    def describe(self) -> dict:
        return {"device": self.device, "engine": self.name}

    def close(self) -> None:
        self.lanes.close()


def columnar_batch(requests, k: int, request_ids: np.ndarray) -> pa.RecordBatch:
    """The columnar request batch of `requests` (`Request` objects, or `RequestColumns` as a columnar
    call decodes to) at `k`, request i numbered `request_ids[i]`."""
    from .request_columns import RequestColumns, request_columns

    if isinstance(requests, RequestColumns):
        return requests.record_batch(k, request_ids)
    return request_columns(requests, k, request_ids=request_ids)


def split_answers(out: pa.RecordBatch, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The answers of requests numbered 0 to n - 1 from their answer batch (each request's rows
    together, in request order, as the engine's answer batch holds them)."""
    rid = out.column(0).to_numpy()
    if len(rid) and (np.any(rid[1:] < rid[:-1]) or rid[0] < 0 or rid[-1] >= n):
        raise RuntimeError(f"the engine's answer batch is not {n} requests' rows in request order")
    ad_ids, scores = out.column(1).to_numpy(), out.column(2).to_numpy()
    ends = np.searchsorted(rid, np.arange(n, dtype=np.int64), side="right")
    starts = np.concatenate([[0], ends[:-1]])
    return [(ad_ids[a:b], scores[a:b]) for a, b in zip(starts.tolist(), ends.tolist())]


class FrontWorker(EngineWorker):
    """A front process's worker (module docstring): the one-engine batcher around a `LaneEngine`,
    with no lock of its own (the engine worker runs one batch at a time and applies updates between
    them) and the seq each batch's answers came with."""

    def _warm_up(self, dataset) -> None:
        """Nothing: the engine is the engine worker's, warmed up there; a front applies no updates."""

    def _run_batch(self, requests, k):
        answers, seq = self.engine.retrieve_at(requests, k)
        self.seq = max(self.seq, seq)
        return answers, seq


__all__ = ["CorpusHead", "FrontWorker", "LaneEngine", "columnar_batch", "corpus_head", "split_answers"]
