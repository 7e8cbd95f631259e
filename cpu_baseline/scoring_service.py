"""The remote scoring service: its own process holding the ad embeddings, scoring candidate lists.

Protocol (Arrow Flight; docs/PROTOCOL.md has the full text):

* `DoExchange`, descriptor path `["score"]`. The caller (the index host) writes one record batch per
  request: column `ad_id` int64, the candidates, with the request's user side as the batch's
  `app_metadata`: float32 little-endian U (E, D), Q (E, D), gamma (F, D), beta (F, D), concatenated
  (`user_side_bytes`). For every batch the service writes one batch back: column `score` float32,
  one per candidate, same order.
* `DoAction("health")`: sizes (ads, rows, D, E, F, top_k, precision) and `fingerprint`, a hash of
  the corpus's ad ids, so an index host can check that both hold the same corpus.
* `DoAction("stats")`: requests, candidates, batches, bytes_in, bytes_out, errors, updates.
* `DoAction("update")`: JSON Lines of DESIGN section 6, already checked against the live ids by the
  index host that owns the stream. Upserts store the ad's embedding (quantized to the table's
  precision) and format; retires forget the ad; status changes need nothing here. Answer:
  `{"applied": n}`.

The candidates travel as ad ids, the keys both services share, and this service finds each one's
row itself (`andromeda_nb.rows.RowMap`): how it lays out its table is its own business, as between
any two services owned apart. That indirection, and the 8 bytes an id costs on the wire, is what
the co-located design removes by keeping match and scoring in one slot layout.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from andromeda_nb.flight import InvalidInput, ServiceStats, to_flight_error
from andromeda_nb.model import quantize
from andromeda_nb.rows import RowMap
from andromeda_nb.services import fingerprint

from .scorer import CpuScorer

SCORE_PATH = ("score",)
CANDIDATE_SCHEMA = pa.schema([("ad_id", pa.int64())])
SCORE_SCHEMA = pa.schema([("score", pa.float32())])
ACTIONS = {
    "health": "liveness, sizes and corpus fingerprint (JSON)",
    "stats": "counters: requests, candidates, batches, bytes_in, bytes_out, errors, updates (JSON)",
    "update": "body: JSON Lines updates (checked by the index host); answer: {\"applied\": n}",
}


def user_side_bytes(U, Q, gamma, beta) -> bytes:
    return b"".join(np.ascontiguousarray(x, "<f4").tobytes() for x in (U, Q, gamma, beta))


def split_user_side(buf: bytes, E: int, D: int, F: int):
    """Inverse of `user_side_bytes`: (U, Q, gamma, beta) float32."""
    want = (2 * E + 2 * F) * D * 4
    if len(buf) != want:
        raise InvalidInput(f"user side: expected {want} bytes (U, Q ({E}, {D}), gamma, beta ({F}, {D}) "
                           f"float32), got {len(buf)}")
    flat = np.frombuffer(buf, "<f4")
    sizes = [E * D, E * D, F * D, F * D]
    shapes = [(E, D), (E, D), (F, D), (F, D)]
    out, lo = [], 0
    for size, shape in zip(sizes, shapes):
        out.append(flat[lo : lo + size].reshape(shape))
        lo += size
    return tuple(out)


class ScoringServer(flight.FlightServerBase):
    """Holds `CpuScorer` plus the ad id <-> row map; serves `["score"]` and the actions above."""

    name = "scorer"

    def __init__(self, dataset, location: str = "grpc://127.0.0.1:0", *, delay_s: float = 0.0, **kwargs):
        super().__init__(location, **kwargs)
        table = dataset.embeddings
        self.precision = table.precision
        self.E, self.D, self.F = dataset.model.E, dataset.model.D, dataset.model.F
        self.scorer = CpuScorer.from_table(table, dataset.formats, dataset.model.top_k)
        self.scorer.warm_up(self.E, self.F)
        self.rows = RowMap(dataset.ad_ids)
        if len(self.rows):  # compile the lookup now, not in the first request (rows are int64, as warmed)
            self.rows.rows_of(dataset.ad_ids[:1])
        self.fingerprint = fingerprint(dataset.ad_ids)
        self.delay_s = delay_s  # test hook: a slow scorer
        self.stats = ServiceStats()
        self.candidates = 0
        self.seed = dataset.seed
        self._lock = threading.RLock()
        self._stopping = threading.Event()

    # --- scoring -------------------------------------------------------------------------------------
    def do_exchange(self, context, descriptor, reader, writer):
        try:
            path = tuple(p.decode() if isinstance(p, bytes) else p for p in (descriptor.path or ()))
            if path != SCORE_PATH:
                raise InvalidInput(f"unknown exchange {list(path)}; this service serves {list(SCORE_PATH)}")
            writer.begin(SCORE_SCHEMA)
            for chunk in reader:
                if chunk.data is None:
                    continue
                if chunk.data.schema != CANDIDATE_SCHEMA:
                    raise InvalidInput(f"candidate batch must have the one column 'ad_id' int64, got {chunk.data.schema}")
                if chunk.app_metadata is None:
                    raise InvalidInput("candidate batch carries no user side (app_metadata)")
                U, Q, gamma, beta = split_user_side(chunk.app_metadata.to_pybytes(), self.E, self.D, self.F)
                ad_ids = chunk.data.column(0).to_numpy(zero_copy_only=False)
                if self.delay_s:
                    time.sleep(self.delay_s)
                with self._lock:
                    try:
                        rows = self.rows.rows_of(ad_ids)
                    except KeyError as exc:
                        raise InvalidInput(f"candidate {exc.args[0]} here") from None
                    scores = self.scorer.score_user_side(rows, U, Q, gamma, beta)
                out = pa.record_batch([pa.array(scores)], schema=SCORE_SCHEMA)
                writer.write_batch(out)
                self.stats.add(requests=1, batches=1, bytes_in=chunk.data.nbytes + chunk.app_metadata.size,
                               bytes_out=out.nbytes)
                with self._lock:
                    self.candidates += len(ad_ids)
        except Exception as exc:
            self.stats.add(errors=1)
            if isinstance(exc, IndexError):
                exc = InvalidInput(str(exc))
            raise to_flight_error(exc) from None

    # --- actions -------------------------------------------------------------------------------------
    def do_action(self, context, action):
        body = action.body.to_pybytes() if action.body is not None else b""
        try:
            if action.type == "health":
                result = self.health()
            elif action.type == "stats":
                with self._lock:
                    result = {"server": self.name, **self.stats.snapshot(), "candidates": self.candidates}
            elif action.type == "update":
                result = self.apply_update_text(body.decode("utf-8"))
            else:
                raise InvalidInput(f"unknown action {action.type!r}; actions: {', '.join(ACTIONS)}")
        except Exception as exc:
            self.stats.add(errors=1)
            raise to_flight_error(exc) from None
        yield flight.Result(json.dumps(result).encode())

    def list_actions(self, context):
        return list(ACTIONS.items())

    def health(self) -> dict:
        with self._lock:
            return {"status": "ok", "server": self.name, "ads": len(self.rows), "rows": self.rows.n_rows,
                    "D": self.D, "E": self.E, "F": self.F, "top_k": self.scorer.top_k,
                    "precision": self.precision, "fingerprint": self.fingerprint}

    def apply_update_text(self, text: str) -> dict:
        from andromeda_nb.updates import read_updates
        from andromeda_nb.types import Retire, Upsert

        updates, malformed = read_updates(text.splitlines(), seed=self.seed, dim=self.D, formats=self.F)
        if malformed:
            raise InvalidInput(f"update line {malformed[0].line_no}: {malformed[0].reason}")
        with self._lock:
            for _, update in updates:
                if isinstance(update, Upsert):
                    self._store(update.ad)
                elif isinstance(update, Retire) and update.ad_id in self.rows:
                    self.rows.release(update.ad_id)
            self.stats.add(updates=len(updates))
        return {"applied": len(updates)}

    def _store(self, ad) -> None:
        row, _ = self.rows.assign(ad.ad_id)
        stored = quantize(np.asarray(ad.embedding, np.float32).reshape(1, -1), self.precision)
        self.scorer.set_row(row, stored.values[0], float(stored.scale[0]), int(ad.format))

    # --- lifecycle -----------------------------------------------------------------------------------
    def stop(self) -> None:
        self._stopping.set()


class ScorerClient:
    """The index host's side of the `["score"]` hop: one exchange per group of requests."""

    def __init__(self, location: str, *, timeout_s: float = 10.0):
        self.location = location
        self.timeout_s = timeout_s
        self.client = flight.connect(location)
        self.calls = 0

    def _error(self, exc: Exception, what: str) -> Exception:
        if isinstance(exc, flight.FlightTimedOutError):
            return flight.FlightTimedOutError(
                f"scoring service at {self.location} did not answer {what} within {self.timeout_s:g} s")
        if isinstance(exc, flight.FlightUnavailableError):
            return flight.FlightUnavailableError(f"scoring service at {self.location} is unavailable: {exc}")
        if isinstance(exc, flight.FlightError):
            return flight.FlightInternalError(f"scoring service at {self.location} failed: {exc}")
        return exc

    def action(self, name: str, body: bytes = b"") -> dict:
        try:
            results = list(self.client.do_action(flight.Action(name, body),
                                                 options=flight.FlightCallOptions(timeout=self.timeout_s)))
        except Exception as exc:
            raise self._error(exc, f"action {name!r}") from None
        return json.loads(results[0].body.to_pybytes())

    def score(self, work: list[tuple[np.ndarray, bytes]]) -> list[np.ndarray]:
        """`work`: per request (candidate ad ids int64, user-side bytes); returns float32 scores each."""
        if not work:
            return []
        self.calls += 1
        out = []
        try:
            writer, reader = self.client.do_exchange(flight.FlightDescriptor.for_path(*SCORE_PATH),
                                                     options=flight.FlightCallOptions(timeout=self.timeout_s))
            with writer:
                writer.begin(CANDIDATE_SCHEMA)
                for ad_ids, side in work:  # lock-step: one answer read per batch written (no flow-control stall)
                    batch = pa.record_batch([pa.array(np.asarray(ad_ids, np.int64))], schema=CANDIDATE_SCHEMA)
                    writer.write_with_metadata(batch, pa.py_buffer(side))
                    out.append(reader.read_chunk().data.column(0).to_numpy(zero_copy_only=False))
                writer.done_writing()
                for chunk in reader:  # end of stream
                    if chunk.data is not None:
                        out.append(chunk.data.column(0).to_numpy(zero_copy_only=False))
        except Exception as exc:
            raise self._error(exc, f"{len(work)} candidate lists") from None
        if len(out) != len(work) or any(len(s) != len(r) for s, (r, _) in zip(out, work)):
            raise flight.FlightInternalError(f"scoring service at {self.location} answered "
                                             f"{len(out)} score lists for {len(work)} requests")
        return out

    def close(self) -> None:
        self.client.close()


__all__ = ["CANDIDATE_SCHEMA", "SCORE_PATH", "SCORE_SCHEMA", "ScorerClient", "ScoringServer", "fingerprint",
           "split_user_side", "user_side_bytes"]
