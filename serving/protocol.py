"""The `["retrieve"]` Flight exchange of DESIGN section 5, written once for every server and client.

Both retrieval servers (the remote-scoring index host in `cpu_baseline/` and the co-located server in
`serving.engine_server`) subclass `RetrieveServer` and implement a few methods; everything else
(schemas, parsing the request batches within the server's limits, answer batches and the update
sequence number each carries, the `health` / `stats` / `update` / `compact` actions, tokens per call,
counters, error mapping, a bounded shutdown on SIGTERM) lives here, so a client cannot tell the two
apart except by speed.

Server side::

    class MyServer(RetrieveServer):
        def retrieve_at(self, requests, ks):   # -> ([(ids int64, scores float32)], seq of the state answered)
        def apply_updates(self, body, started):  # JSON Lines of DESIGN section 6 (bytes, or the streamed
                                               # exchange's update_body.ChunkedBody) -> dict (JSON-ready ack)
        def health_info(self):                 # -> dict merged into the `health` answer
        def health_state(self):                # -> ("ok" | "degraded", [reasons])

    server = MyServer("grpc://127.0.0.1:0", seed=..., experts=..., width=..., limits=..., guard=...)
    server.serve_until_stopped()               # SIGTERM / SIGINT: stop taking calls, finish, return

Client side::

    answers = retrieve_over_flight("grpc://127.0.0.1:PORT", requests, k=100)   # [(ids, scores), ...]
    flight_action("grpc://127.0.0.1:PORT", "stats")                              # -> dict

Wire format (see docs/PROTOCOL.md):

* `DoExchange`, descriptor path `["retrieve"]`. The client writes record batches of
  `REQUEST_SCHEMA` (`request_id` int64, `request` utf8 JSON with `user`, `context` and optionally
  `signals`, `k` int32 in 1..MAX_K). For every batch it writes, the server writes one batch of
  `ANSWER_SCHEMA` (`request_id` int64, `ad_id` int64, `score` float32): each request's rows in rank
  order (score descending, ties by ad id ascending), requests in the order they came; its
  app_metadata is `{"seq": n}`, the last update the answers reflect (`answer_seq`).
* `DoAction("health")` -> one JSON result `{"status": "ok" | "degraded", ...}`; `DoAction("stats")` ->
  JSON counters (requests, batches, bytes_in, bytes_out, errors, updates, uptime_s, in_flight);
  `DoAction("update")` with a JSON Lines body of updates (DESIGN section 6) -> JSON acknowledgement
  from `apply_updates`, once the updates are logged on disk; `DoAction("compact")`.

Errors: a malformed request or update, or one over a limit, is a `FlightServerError` whose message
starts with "invalid request:" (or "invalid update:") and names the request id and the problem or
the limit; a dependency that is down is `FlightUnavailableError`, one that is too slow (or a call past
the deadline) `FlightTimedOutError`; a missing or wrong token `FlightUnauthenticatedError`, a reader
token where the admin token is needed `FlightUnauthorizedError`; anything else is a
`FlightInternalError`. Every error is counted in `stats`, and the server keeps serving.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from andromeda_nb import jsontext
from andromeda_nb.batching import BATCH_REQUESTS, in_batches
from andromeda_nb.quoting import MESSAGE_LIMIT, clip, quote
from andromeda_nb.types import Request, TargetingError

from .durable import DeadlineExceeded, ReadGate, ServerStopping
from .hostmem import GIVE_BACK_BODY_BYTES, request_give_back
from .guard import ADMIN, OPEN, READER, ClientCredentials, ServerGuard, connect
from .inputs import InvalidInput, check_k, parse_batch_request
from .limits import DEFAULT_LIMITS, LimitExceeded, ServiceLimits
from .process import serve_until_stopped
from .request_columns import decode_columns, is_columnar, request_columns
from .update_body import ChunkedBody
from .wal import LogError

RETRIEVE_PATH = ("retrieve",)
UPDATE_PATH = ("update",)  # the streamed update call: the body in chunks, checked as they arrive
UPDATE_CHUNK_SCHEMA = pa.schema([("chunk", pa.binary())])
UPDATE_CHUNK_BYTES = 1 << 20  # what a client puts in one chunk
REQUEST_SCHEMA = pa.schema([("request_id", pa.int64()), ("request", pa.utf8()), ("k", pa.int32())])
ANSWER_SCHEMA = pa.schema([("request_id", pa.int64()), ("ad_id", pa.int64()), ("score", pa.float32())])
ACTIONS = {
    "health": "liveness, state (ok or degraded, with reasons) and what the server holds (JSON)",
    "stats": "counters: requests, batches, bytes_in, bytes_out, errors, updates, uptime_s, in_flight (JSON)",
    "update": "body: JSON Lines updates (DESIGN section 6); answer: JSON acknowledgement, once logged on disk",
    "compact": "fold the update log into a new snapshot of the corpus directory (JSON summary)",
}
ACTION_ROLES = {"health": READER, "stats": READER, "update": ADMIN, "compact": ADMIN}
DEFAULT_CLIENT_BATCH = BATCH_REQUESTS  # requests per record batch a client sends (andromeda_nb.batching)


# --- counters -----------------------------------------------------------------------------------------


@dataclass
class ServiceStats:
    """Thread-safe counters a server reports through `DoAction("stats")`. Bytes are Arrow payload
    bytes of the record batches (the counting relay measures bytes on the wire separately)."""

    requests: int = 0
    batches: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    errors: int = 0
    updates: int = 0
    update_bytes: int = 0  # bytes of update bodies taken in (read from the update exchange, or from an action)
    started: float = field(default_factory=time.time)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + int(value))

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "requests": self.requests,
                "batches": self.batches,
                "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out,
                "errors": self.errors,
                "updates": self.updates,
                "update_bytes": self.update_bytes,
                "uptime_s": round(time.time() - self.started, 3),
            }


class CallPath:
    """Where a served call's time goes, summed over the calls of a batching server (DoAction "stats",
    `call_path`), each phase between two `time.perf_counter()` stamps:

    * `exchange_in`: the exchange thread, from the batch's arrival to handing it to the batcher;
    * `queued`: waiting for the batcher's worker to take it;
    * `batched`: from taken to answered: decoding, waiting for the batch to close, the engine, encoding;
    * `handback`: from answered to the exchange thread running again;
    * `write`: writing the answer batch;
    * `turnaround`: from an answer written to the next batch arriving on the same exchange: the
      answer's way out, the client, the next request's way in and the exchange thread waking (only
      for exchanges that carry several batches)."""

    PHASES = ("exchange_in", "queued", "batched", "handback", "write", "turnaround")

    def __init__(self):
        self._lock = threading.Lock()
        self._sums = dict.fromkeys(self.PHASES, 0.0)
        self.calls = self.turnarounds = 0

    def add(self, t: dict, written: float, previous_written: float | None) -> None:
        """One call's stamps (`t`: arrived, and the batcher's queued, taken, answered, woke)."""
        if "answered" not in t or "woke" not in t:
            return  # not through the batcher, or it failed
        phases = {"exchange_in": t["queued"] - t["arrived"], "queued": t["taken"] - t["queued"],
                  "batched": t["answered"] - t["taken"], "handback": t["woke"] - t["answered"],
                  "write": written - t["woke"]}
        with self._lock:
            self.calls += 1
            for name, value in phases.items():
                self._sums[name] += value
            if previous_written is not None:
                self.turnarounds += 1
                self._sums["turnaround"] += t["arrived"] - previous_written

    def snapshot(self) -> dict:
        with self._lock:
            per = {name: 1e3 * value / max(1, self.turnarounds if name == "turnaround" else self.calls)
                   for name, value in self._sums.items()}
            return {"calls": self.calls, "turnarounds": self.turnarounds, "ms_per_call": per}


# --- request and answer batches -----------------------------------------------------------------------


def request_text(request) -> str:
    """The `request` column's text for a `Request`, a JSON-ready dict or a JSON string (kept as is):
    compact JSON, signals as the shortest float32 text that reads back exactly. The request id
    travels in its own column only (one source), so it is left out of the text."""
    if isinstance(request, str):
        return request
    if isinstance(request, Request):
        from andromeda_nb.targeting import request_to_json

        return json.dumps(request_to_json(request, with_id=False), separators=(",", ":"))
    return json.dumps({k: v for k, v in request.items() if k != "request_id"}, separators=(",", ":"))


def _request_id(request) -> int:
    if isinstance(request, Request):
        return int(request.request_id)
    if isinstance(request, str):
        request = json.loads(request)
    return int(request["request_id"])


def request_batch(requests: Sequence, k: int | Sequence[int]) -> pa.RecordBatch:
    """A `REQUEST_SCHEMA` batch from `Request` objects, JSON-ready dicts or JSON strings (each with a
    `request_id`). `k` is one value for all or one per request."""
    ks = [int(k)] * len(requests) if np.isscalar(k) else [int(x) for x in k]
    return pa.record_batch(
        [
            pa.array([_request_id(r) for r in requests], pa.int64()),
            pa.array([request_text(r) for r in requests], pa.utf8()),
            pa.array(ks, pa.int32()),
        ],
        schema=REQUEST_SCHEMA,
    )


_INT64, _INT32, _UTF8 = pa.int64(), pa.int32(), pa.utf8()


def _column_as(batch: pa.RecordBatch, name: str, kind: pa.DataType):
    """A column of `batch` as `kind`, cast only when it is another type (a cast costs microseconds a
    call even when there is nothing to convert)."""
    column = batch.column(name)
    return column if column.type == kind else column.cast(kind)


def batch_bytes(batch: pa.RecordBatch) -> int:
    """The bytes of a record batch's buffers, for limits and stats (`RecordBatch.nbytes` walks the
    buffers' used ranges and costs microseconds a call; a batch read off the wire fills its buffers)."""
    return batch.get_total_buffer_size()


def check_batch_limits(batch: pa.RecordBatch, limits: ServiceLimits) -> None:
    """A client batch's size against `limits`, before anything in it is decoded."""
    if batch.num_rows > limits.max_batch_requests:
        raise limits.over("max_batch_requests", batch.num_rows, "batch of requests")
    size = batch_bytes(batch)
    if size > limits.max_request_bytes:
        raise limits.over("max_request_bytes", size, "request batch of bytes")


def decode_request_batches(batches: Sequence[pa.RecordBatch], *, seed: int, experts: int, width: int,
                           limits: ServiceLimits = DEFAULT_LIMITS) -> list:
    """`decode_request_batch` of the batches of many calls: one (requests, ks) or the exception per
    batch. Columnar batches of one schema are checked as one batch (a few array operations for all
    of them, instead of a few per call); when that finds a fault, each of them is checked alone, so
    only the call at fault gets its error."""
    kw = dict(seed=seed, experts=experts, width=width, limits=limits)
    out: list = [None] * len(batches)
    groups: list[tuple[pa.Schema, list[int]]] = []  # (schema, its batches); a schema's hash costs 14 us
    for i, batch in enumerate(batches):
        schema = batch.schema
        group = next((members for first, members in groups if first.equals(schema)), None)
        if group is None and not is_columnar(schema):
            out[i] = _decoded_or_error(batch, kw)
            continue
        try:
            check_batch_limits(batch, limits)
        except LimitExceeded as exc:
            out[i] = exc
            continue
        if group is None:
            groups.append((schema, [i]))
        else:
            group.append(i)
    for _, members in groups:
        if len(members) == 1:
            out[members[0]] = _decoded_or_error(batches[members[0]], kw)
            continue
        sizes = [batches[i].num_rows for i in members]
        try:
            table = pa.Table.from_batches([batches[i] for i in members]).combine_chunks()
            requests, ks = decode_columns(table, segments=sizes, **kw)
        except Exception:  # noqa: BLE001 - each call checked alone below, each fault to its own caller
            for i in members:
                out[i] = _decoded_or_error(batches[i], kw)
            continue
        at = 0
        for i, size in zip(members, sizes):
            out[i] = (requests[at : at + size], ks[at : at + size])
            at += size
    return out


def _decoded_or_error(batch: pa.RecordBatch, kw: dict):
    try:
        return decode_request_batch(batch, **kw)
    except Exception as exc:  # noqa: BLE001 - handed to the batch's caller
        return exc


def decode_request_batch(batch: pa.RecordBatch, *, seed: int, experts: int, width: int,
                         limits: ServiceLimits = DEFAULT_LIMITS) -> tuple[list[Request], list[int]]:
    """Parse and validate one client batch: (requests, ks). The batch's size is checked against
    `limits` before anything in it is decoded. Raises `InvalidInput` or `LimitExceeded` naming the
    offending request id and field, or the limit."""
    columnar = is_columnar(batch.schema)
    if not columnar:
        missing = [f.name for f in REQUEST_SCHEMA if f.name not in batch.schema.names]
        if missing:
            raise InvalidInput(f"batch lacks column(s) {', '.join(missing)}; expected {REQUEST_SCHEMA}, or the "
                               "columns of a columnar request batch (docs/PROTOCOL.md section 1)")
    check_batch_limits(batch, limits)
    if columnar:
        return decode_columns(batch, seed=seed, experts=experts, width=width, limits=limits)
    try:
        ids = _column_as(batch, "request_id", _INT64).to_pylist()
        ks = _column_as(batch, "k", _INT32).to_pylist()
        texts = _column_as(batch, "request", _UTF8).to_pylist()
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"batch columns have the wrong types or encoding ({clip(str(exc))}); expected "
                           f"{REQUEST_SCHEMA}") from None
    if len(set(ids)) != len(ids):
        seen: set = set()
        twice = next(r for r in ids if r in seen or seen.add(r))
        raise InvalidInput(f"request {twice}: request_id appears more than once in the batch (its answer rows "
                           "would be ambiguous)")
    requests = []
    for rid, text, k in zip(ids, texts, ks):
        if rid is None or text is None or k is None:
            raise InvalidInput(f"request {rid}: null request_id, request or k")
        check_k(k, rid, limits.max_k)
        try:
            obj = jsontext.loads(text, max_depth=limits.max_json_depth)
        except jsontext.JsonInputError as exc:
            if exc.path:
                raise InvalidInput(f"request {rid}: {exc.path}: {exc.message}") from None
            raise InvalidInput(f"request {rid}: request is {exc}" if exc.message.startswith("not valid")
                               else f"request {rid}: request: {exc}") from None
        if not isinstance(obj, dict):
            raise InvalidInput(f"request {rid}: request must be a JSON object")
        # the request_id column is the request's id; a request_id in the text must agree with it
        requests.append(parse_batch_request(obj, rid, seed=seed, experts=experts, width=width))
    return requests, ks


def answer_metadata(seq: int | None) -> pa.Buffer | None:
    """An answer batch's app_metadata: `{"seq": n}`, the last update the answers reflect."""
    return None if seq is None else pa.py_buffer(json.dumps({"seq": int(seq)}).encode())


def answer_seq(chunk) -> int | None:
    """The update sequence number an answer chunk (a `FlightStreamChunk`) was computed at, if sent."""
    meta = getattr(chunk, "app_metadata", None)
    if meta is None:
        return None
    try:
        return int(json.loads(meta.to_pybytes())["seq"])
    except (ValueError, KeyError, TypeError):
        return None


def request_ids(requests) -> Sequence[int]:
    """The ids of decoded requests: a `RequestColumns`'s array, or each `Request`'s."""
    ids = getattr(requests, "request_id", None)
    return ids if isinstance(ids, np.ndarray) else [r.request_id for r in requests]


def answer_batch(request_ids: Sequence[int], answers: Sequence[tuple[np.ndarray, np.ndarray]]) -> pa.RecordBatch:
    """One `ANSWER_SCHEMA` batch: each request's rows in the rank order given."""
    counts = [len(ids) for ids, _ in answers]
    rid = np.repeat(np.asarray(request_ids, np.int64), counts)
    ads = np.concatenate([np.asarray(a, np.int64) for a, _ in answers]) if answers else np.empty(0, np.int64)
    scores = np.concatenate([np.asarray(s, np.float32) for _, s in answers]) if answers else np.empty(0, np.float32)
    return pa.record_batch([pa.array(rid), pa.array(ads), pa.array(scores)], schema=ANSWER_SCHEMA)


def split_answers(batch: pa.RecordBatch | pa.Table, request_ids: Sequence[int]
                  ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Answer rows back to one (ad ids int64, scores float32) per request, in the order of
    `request_ids`. Rows come as one run per request in request order; a request with no eligible
    ad has no run and gets empty arrays."""
    rid = np.asarray(batch.column("request_id").to_numpy(), np.int64)
    ads = np.asarray(batch.column("ad_id").to_numpy(), np.int64)
    scores = np.asarray(batch.column("score").to_numpy(), np.float32)
    starts = np.flatnonzero(np.r_[True, rid[1:] != rid[:-1]]) if len(rid) else np.empty(0, np.int64)
    ends = np.r_[starts[1:], len(rid)] if len(rid) else starts
    out, run = [], 0
    for r in request_ids:
        if run < len(starts) and rid[starts[run]] == r:
            lo, hi = starts[run], ends[run]
            out.append((ads[lo:hi], scores[lo:hi]))
            run += 1
        else:
            out.append((np.empty(0, np.int64), np.empty(0, np.float32)))
    if run != len(starts):
        raise ValueError(f"answer holds rows for request id {int(rid[starts[run]])}, which was not asked "
                         "or not in this order")
    return out


# --- the server base ----------------------------------------------------------------------------------


def to_flight_error(exc: BaseException, what: str = "request") -> Exception:
    """Map a handler exception to the Flight error a client sees (`what`: "request" or "update", the
    word after "invalid"). Its message is at most `quoting.MESSAGE_LIMIT` characters: a longer one
    would not fit gRPC's metadata, and the client would get RESOURCE_EXHAUSTED instead of it."""
    if isinstance(exc, flight.FlightError):
        text = str(exc)
        return exc if len(text) <= MESSAGE_LIMIT else type(exc)(clip(text, MESSAGE_LIMIT))
    if isinstance(exc, (InvalidInput, TargetingError, LimitExceeded, jsontext.JsonInputError)):
        return flight.FlightServerError(clip(f"invalid {what}: {exc}", MESSAGE_LIMIT))
    if isinstance(exc, DeadlineExceeded):
        return flight.FlightTimedOutError(clip(str(exc), MESSAGE_LIMIT))
    if isinstance(exc, ServerStopping):
        return flight.FlightUnavailableError(clip(str(exc), MESSAGE_LIMIT))
    if isinstance(exc, LogError):
        return flight.FlightInternalError(clip(f"{exc.label}: {exc}", MESSAGE_LIMIT))
    return flight.FlightInternalError(clip(f"internal error: {type(exc).__name__}: {exc}", MESSAGE_LIMIT))


class RetrieveServer(flight.FlightServerBase):
    """Base of both retrieval servers: the `["retrieve"]` exchange and the actions of DESIGN section 5.

    `seed`, `experts` and `width` are what `parse_request` needs to fill in missing signals;
    `limits` bound each call (`serving.limits`), `guard` admits callers (`serving.guard`).
    Subclasses prepare everything they serve (load, replay their log, warm up) *before* calling this
    constructor, which starts listening. They implement `retrieve_at` (or `retrieve`), and may
    override `apply_updates`, `compact`, `health_info`, `health_state`, `handle_action` (for further
    actions; return None when the name is not theirs) and `action_role`.

    `exchange_clock` dates an exchange against the deadline (time.monotonic; a test sets a simulated
    one, so what is refused does not depend on how fast the machine answers).
    """

    name = "retrieve"
    exchange_clock: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(self, location: str = "grpc://127.0.0.1:0", *, seed: int, experts: int, width: int,
                 limits: ServiceLimits | None = None, guard: ServerGuard | None = None, **kwargs):
        self.seed, self.experts, self.width = seed, experts, width
        self.limits = limits or DEFAULT_LIMITS
        self.guard = guard or OPEN
        self.stats = ServiceStats()
        self.call_path = CallPath()  # where a batched call's time goes (stats: call_path)
        self.gate = getattr(self, "gate", None) or ReadGate()  # retrieval batches in flight
        self._stopping = threading.Event()
        self._actions_in_flight = 0  # update and compact calls from their start to their answer's end
        self._actions_lock = threading.Lock()
        journal = getattr(self, "journal", None)
        if journal is not None:  # SIGTERM ends a call not yet logged, and acknowledges a logged one sooner
            journal.stopping = self._stopping
        from .hostmem import request_give_back

        # a call refused for its token may have had its body read whole by gRPC (a DoAction's): its
        # memory is handed back once the call ends
        super().__init__(self.guard.server_location(location), **self.guard.server_kwargs(on_refused=request_give_back),
                         **kwargs)

    # --- what subclasses implement -------------------------------------------------------------------
    def retrieve(self, requests: list[Request], ks: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        raise NotImplementedError

    def retrieve_at(self, requests: list[Request], ks: list[int]) -> tuple[list, int | None]:
        """The answers and the sequence number of the last update they reflect (None: untracked)."""
        return self.retrieve(requests, ks), None

    def current_seq(self) -> int | None:
        """The sequence number of the last update applied (None: untracked)."""
        return None

    def decode(self, batch: pa.RecordBatch) -> tuple[list[Request], list[int]]:
        """A request batch of the exchange to requests and their k (`InvalidInput` naming what is wrong)."""
        return decode_request_batch(batch, seed=self.seed, experts=self.experts, width=self.width, limits=self.limits)

    def decode_many(self, batches: list[pa.RecordBatch]) -> list:
        """`decode` of many calls' batches at once: (requests, ks) or the exception, per batch."""
        return decode_request_batches(batches, seed=self.seed, experts=self.experts, width=self.width,
                                      limits=self.limits)

    def encode(self, requests: list[Request], answers: list, seq: int | None) -> tuple[pa.RecordBatch, pa.Buffer | None]:
        """Answers to the answer batch and its app_metadata; counted in the stats."""
        out = answer_batch(request_ids(requests), answers)
        self.stats.add(requests=len(requests), batches=1, bytes_out=out.nbytes)
        return out, answer_metadata(seq)

    def encode_many(self, parts: list, seq: int | None) -> list[tuple[pa.RecordBatch, pa.Buffer | None]]:
        """`encode` for the calls of one engine batch at once (`parts`: each call's requests and
        answers): one answer batch built for all, each call given its own rows as a slice of it
        (no copy), all with one app_metadata."""
        ids = np.concatenate([np.asarray(request_ids(reqs), np.int64) for reqs, _ in parts])
        answers = [a for _, ans in parts for a in ans]
        out = answer_batch(ids, answers)
        meta = answer_metadata(seq)
        self.stats.add(requests=len(ids), batches=len(parts), bytes_out=out.nbytes)
        result, row = [], 0
        for _, ans in parts:
            rows = sum(len(ad_ids) for ad_ids, _ in ans)
            result.append((out.slice(row, rows), meta))
            row += rows
        return result

    def serve_batch(self, batch: pa.RecordBatch, times: dict | None = None) -> tuple[pa.RecordBatch, pa.Buffer | None]:
        """One request batch of an exchange to its answer batch and app_metadata, on the exchange's
        thread (a server that gathers the batches of many exchanges overrides this, and fills
        `times` with the stamps `CallPath` reads)."""
        self.stats.add(bytes_in=batch_bytes(batch))
        requests, ks = self.decode(batch)
        answers, seq = self.retrieve_at(requests, ks) if requests else ([], self.current_seq())
        return self.encode(requests, answers, seq)

    def apply_updates(self, body: bytes, started: float) -> dict:
        raise InvalidInput("this server takes no updates")

    def compact(self) -> dict:
        raise InvalidInput("this server has no update log to compact")

    def health_info(self) -> dict:
        return {}

    def health_state(self) -> tuple[str, list[str]]:
        """("ok", []) or ("degraded", [reasons]): whether this server can answer correctly now."""
        return "ok", []

    def handle_action(self, name: str, body: bytes):
        """Further actions: return a JSON-ready object, or None when `name` is unknown here."""
        return None

    def action_role(self, name: str) -> str:
        """The token an action needs (`serving.guard`): READER or ADMIN."""
        return ACTION_ROLES.get(name, READER)

    @property
    def busy(self) -> bool:
        """Whether a batch, or an update or compact call, is being worked on (shutdown lets it
        finish): an update call counts from its start to the end of its answer, so a process that
        stops never ends between applying a call and acknowledging it."""
        return self.gate.busy or self._actions_in_flight > 0

    # --- Flight handlers -----------------------------------------------------------------------------
    def do_exchange(self, context, descriptor, reader, writer):
        started = self.exchange_clock()
        path = tuple(p.decode() if isinstance(p, bytes) else p for p in (descriptor.path or ())) \
            if descriptor.descriptor_type == flight.DescriptorType.PATH else None
        if path == UPDATE_PATH:
            with self._counted_action():
                try:
                    self._update_exchange(context, reader, writer, started)
                except Exception as exc:
                    self.stats.add(errors=1)
                    raise to_flight_error(exc, "update") from None
            return
        try:
            self.guard.require(context, READER, "retrieve")
            if path != RETRIEVE_PATH:
                raise InvalidInput(f"unknown exchange {clip(str(descriptor))}; this server serves paths "
                                   f"{list(RETRIEVE_PATH)} and {list(UPDATE_PATH)}")
            began, written = False, None
            for chunk in reader:
                times = {"arrived": time.perf_counter()}
                batch = chunk.data
                if batch is None:
                    continue
                if self._stopping.is_set():
                    raise flight.FlightUnavailableError("the server is shutting down; retry on another")
                if self.exchange_clock() - started > self.limits.deadline_s:
                    raise flight.FlightTimedOutError(
                        f"the exchange is older than the server's deadline of {self.limits.deadline_s:g} s "
                        "(--deadline); open a new one")
                with self.gate.reading():
                    out, meta = self.serve_batch(batch, times)
                    if not began:
                        writer.begin(ANSWER_SCHEMA)
                        began = True
                    if meta is None:
                        writer.write_batch(out)
                    else:
                        writer.write_with_metadata(out, meta)
                previous, written = written, time.perf_counter()
                self.call_path.add(times, written, previous)
            if not began:
                writer.begin(ANSWER_SCHEMA)
        except Exception as exc:  # every failure reaches the client as a Flight error
            self.stats.add(errors=1)
            raise to_flight_error(exc) from None

    @contextlib.contextmanager
    def _counted_action(self):
        """An update or compact call in flight (`busy`), until its answer is handed to gRPC."""
        with self._actions_lock:
            self._actions_in_flight += 1
        try:
            yield
        finally:
            with self._actions_lock:
                self._actions_in_flight -= 1

    def _update_exchange(self, context, reader, writer, started: float) -> None:
        """The streamed update call (`["update"]`): the caller's token is checked before any chunk is
        read (a stranger's body is never read), and the body's bytes are counted chunk by chunk, the
        call refused at the first chunk past `max_update_bytes`, before the rest is read; then the
        body is one `update` call (`apply_updates`), and its acknowledgement the exchange's one
        metadata message."""
        self.guard.require(context, ADMIN, "update")
        if self._stopping.is_set():
            raise flight.FlightUnavailableError("the server is shutting down; send the update again later")
        limit = self.limits.max_update_bytes
        body = ChunkedBody()  # the chunks as they came: never joined into one 100 MB step (serving.update_body)
        size = 0
        try:
            for chunk in reader:
                batch = chunk.data
                if batch is None:
                    continue
                if not batch.schema.equals(UPDATE_CHUNK_SCHEMA):
                    raise InvalidInput(f"an update chunk has the schema {clip(str(batch.schema))}; expected "
                                       f"{UPDATE_CHUNK_SCHEMA} (docs/PROTOCOL.md section 2)")
                column = batch.column(0)
                got = column.buffers()[2].size if column.buffers()[2] is not None else 0
                size += got
                self.stats.add(update_bytes=got)
                if size > limit:  # refused here: the rest of the body is never read
                    raise self.limits.over("max_update_bytes", f"{size:,} so far", "update body of bytes")
                for value in column.to_pylist():
                    body.append(value)
            result = self.apply_updates(body, started)
        finally:
            if size >= GIVE_BACK_BODY_BYTES:
                request_give_back()
        writer.write_metadata(pa.py_buffer(json.dumps(result).encode()))

    def do_action(self, context, action):
        if action.type not in ("update", "compact"):
            yield from self._do_action(context, action)
            return
        with self._counted_action():  # until the answer is handed to gRPC (the generator's end)
            yield from self._do_action(context, action)

    def _do_action(self, context, action):
        started = time.monotonic()
        name = action.type
        raw = action.body  # gRPC has read it whole already (pyarrow's Flight server reads a DoAction's body first)
        size = raw.size if raw is not None else 0
        what = "update" if name == "update" else "request"
        try:  # the caller and the declared size are checked before the body is copied or parsed
            self.guard.require(context, self.action_role(name), f"action {quote(name)}")
            if name == "update" and size > self.limits.max_update_bytes:
                raise self.limits.over("max_update_bytes", size, "update body of bytes")
            body = raw.to_pybytes() if raw is not None else b""
            if name == "health":
                status, reasons = self.health_state()
                result = {"status": status, **({"reasons": reasons} if reasons else {}), "server": self.name,
                          "seq": self.current_seq(), **self.health_info(), "guard": self.guard.describe()}
            elif name == "stats":
                result = {"server": self.name, **self.stats.snapshot(), "in_flight": self.gate.in_flight,
                          **self.extra_stats()}
            elif name == "update":
                if self._stopping.is_set():
                    raise flight.FlightUnavailableError("the server is shutting down; send the update again later")
                self.stats.add(update_bytes=size)
                result = self.apply_updates(body, started)
            elif name == "compact":
                result = self.compact()
            else:
                result = self.handle_action(name, body)
                if result is None:
                    raise InvalidInput(f"unknown action {quote(name)}; actions: {', '.join(self.action_names())}")
        except Exception as exc:
            self.stats.add(errors=1)
            raise to_flight_error(exc, what) from None
        finally:
            if size >= GIVE_BACK_BODY_BYTES:
                request_give_back()
        yield flight.Result(json.dumps(result).encode())

    def extra_stats(self) -> dict:
        return {}

    def retrieve_endpoints(self) -> list[str]:
        """Where else the `["retrieve"]` exchange is served, with the same answers (`get_flight_info`):
        none here, so a client asks this server."""
        return []

    def get_flight_info(self, context, descriptor):
        """GetFlightInfo of `["retrieve"]`: one endpoint a location that serves the exchange with this
        server's answers, the guard, limits and updates (docs/PROTOCOL.md section 1); none when only this
        server does. A client spreads its exchanges over them (`retrieve_endpoints`)."""
        self.guard.require(context, READER, "flight info")
        path = tuple(p.decode() if isinstance(p, bytes) else p for p in (descriptor.path or ())) \
            if descriptor.descriptor_type == flight.DescriptorType.PATH else None
        if path != RETRIEVE_PATH:
            raise flight.FlightServerError(f"no flight info for {clip(str(descriptor))}; this server describes "
                                           f"the path {list(RETRIEVE_PATH)}")
        endpoints = [flight.FlightEndpoint(b"", [loc]) for loc in self.retrieve_endpoints()]
        return flight.FlightInfo(ANSWER_SCHEMA, descriptor, endpoints, -1, -1)

    def action_names(self) -> list[str]:
        return list(ACTIONS)

    def list_actions(self, context):
        return [(name, ACTIONS.get(name, "")) for name in self.action_names()]

    # --- lifecycle -----------------------------------------------------------------------------------
    def serve_until_stopped(self, on_ready=None, *, deadline_s: float = 5.0, parent_pid: int | None = None) -> None:
        """Serve until SIGTERM or SIGINT (or `stop()`, or the end of `parent_pid`), then shut down
        within `deadline_s`: no new calls or batches, the ones in flight finish
        (`serving.process`). Must run in the main thread (signal handlers)."""
        clean = serve_until_stopped(self, self._stopping, on_ready, deadline_s=deadline_s, parent_pid=parent_pid,
                                    busy=lambda: self.busy, before_exit=self.release_for_exit)
        if clean:
            self.close_resources()

    def stop(self) -> None:
        self._stopping.set()

    def close_resources(self) -> None:
        """Release what the server holds (connections to other services, its log); after shutdown."""

    def release_for_exit(self) -> None:
        """What must happen before the process exits with calls still open (close the log)."""


# --- client side --------------------------------------------------------------------------------------


def location_of(address) -> str:
    """'host:port', 'grpc://host:port' or a port number -> a grpc location string."""
    if isinstance(address, int):
        return f"grpc://127.0.0.1:{address}"
    address = str(address)
    return address if "://" in address else f"grpc://{address}"


def _options(timeout: float | None) -> flight.FlightCallOptions:
    return flight.FlightCallOptions(timeout=timeout) if timeout else flight.FlightCallOptions()


def flight_action(location, name: str, body: bytes | str = b"", *, timeout: float | None = 10.0,
                  client: flight.FlightClient | None = None, credentials: ClientCredentials | None = None):
    """Run one DoAction and decode its JSON answer (`credentials`: token and TLS material, when the
    server asks for them; ignored with a `client` already connected)."""
    own = client is None
    client = client or connect(location_of(location), credentials)
    try:
        if isinstance(body, str):
            body = body.encode()
        results = list(client.do_action(flight.Action(name, body), options=_options(timeout)))
        return json.loads(results[0].body.to_pybytes()) if results else None
    finally:
        if own:
            client.close()


def retrieve_endpoints(location, *, timeout: float | None = 10.0, client: flight.FlightClient | None = None,
                       credentials: ClientCredentials | None = None) -> list[str]:
    """The locations a server lists for its `["retrieve"]` exchange (GetFlightInfo: `serve colocated
    --engines N --endpoints` lists its engine workers' own servers); [] when it lists none, or is a
    server that does not describe the exchange (ask the server itself)."""
    own = client is None
    client = client or connect(location_of(location), credentials)
    try:
        info = client.get_flight_info(flight.FlightDescriptor.for_path(*RETRIEVE_PATH), options=_options(timeout))
    except (flight.FlightServerError, pa.ArrowNotImplementedError):  # a server that does not describe it
        return []
    finally:
        if own:
            client.close()
    return [loc.uri.decode() if isinstance(loc.uri, bytes) else str(loc.uri)
            for endpoint in info.endpoints for loc in endpoint.locations]


def send_update_stream(client: flight.FlightClient, body: bytes | str, *, timeout: float | None = 60.0,
                       chunk_bytes: int = UPDATE_CHUNK_BYTES) -> dict:
    """One update call through the streamed `["update"]` exchange of a connected `client`: the body
    (JSON Lines of DESIGN section 6) in chunks of `chunk_bytes`; returns the acknowledgement. A
    refusal (no token, a limit passed while the body streams) raises the server's error, even when
    the server ends the call before the body is all sent."""
    if isinstance(body, str):
        body = body.encode()
    writer, reader = client.do_exchange(flight.FlightDescriptor.for_path(*UPDATE_PATH), options=_options(timeout))
    with writer:
        try:
            writer.begin(UPDATE_CHUNK_SCHEMA)
            view = memoryview(body)
            for lo in range(0, len(body), chunk_bytes):
                writer.write_batch(pa.record_batch([pa.array([view[lo : lo + chunk_bytes].tobytes()], pa.binary())],
                                                   schema=UPDATE_CHUNK_SCHEMA))
            writer.done_writing()
        except flight.FlightError:
            pass  # the server ended the call (refused it): its error comes with the answer below
        chunk = reader.read_chunk()
    meta = chunk.app_metadata
    if meta is None:
        raise flight.FlightInternalError("the server ended the update exchange without an acknowledgement")
    return json.loads(meta.to_pybytes())


def send_updates(location, body: bytes | str, *, timeout: float | None = 60.0,
                 client: flight.FlightClient | None = None, credentials: ClientCredentials | None = None) -> dict:
    """Send one update call to any server that takes updates, streamed (`send_update_stream`): its
    acknowledgement. How a client should send updates: the server checks the token before it reads
    any of the body, and its size limit while the body arrives."""
    own = client is None
    client = client or connect(location_of(location), credentials)
    try:
        return send_update_stream(client, body, timeout=timeout)
    finally:
        if own:
            client.close()


def wait_until_healthy(location, timeout: float = 30.0, process=None,
                       credentials: ClientCredentials | None = None) -> dict:
    """Poll `health` until it answers (ok or degraded: the server is up); raise RuntimeError after
    `timeout` seconds, or at once when `process` (a subprocess.Popen) has exited."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server process exited with code {process.returncode} before it was healthy")
        try:
            return flight_action(location, "health", timeout=2.0, credentials=credentials)
        except flight.FlightError as exc:
            last = exc
            time.sleep(0.05)
    raise RuntimeError(f"no healthy server at {location_of(location)} after {timeout:.0f} s ({last})")


def exchange_batches(client: flight.FlightClient, batches: Iterable[pa.RecordBatch], *,
                     timeout: float | None = None, seqs: list | None = None) -> list[pa.RecordBatch]:
    """Send request batches over one `["retrieve"]` exchange; one answer batch per request batch.
    `seqs`: a list to which each answer's update sequence number (`answer_seq`) is appended."""
    batches = list(batches)
    writer, reader = client.do_exchange(flight.FlightDescriptor.for_path(*RETRIEVE_PATH), options=_options(timeout))
    out = []
    with writer:
        writer.begin(batches[0].schema if batches else REQUEST_SCHEMA)  # a stream has one schema
        for batch in batches:
            writer.write_batch(batch)
            chunk = reader.read_chunk()
            out.append(chunk.data)
            if seqs is not None:
                seqs.append(answer_seq(chunk))
        writer.done_writing()
        for chunk in reader:  # drain the end of stream
            if chunk.data is not None:
                out.append(chunk.data)
    return out


def retrieve_over_flight(location, requests: Sequence, k: int, *, timeout: float | None = 60.0,
                         batch_size: int = DEFAULT_CLIENT_BATCH, client: flight.FlightClient | None = None,
                         credentials: ClientCredentials | None = None, seqs: list | None = None,
                         request_format: str = "json") -> list[tuple[np.ndarray, np.ndarray]]:
    """Top-K answers from any `["retrieve"]` server: one (ad ids int64, scores float32) per request, in
    rank order. `requests` are `Request` objects, JSON-ready dicts or JSON strings (`request_format`
    "json"), or `Request` objects ("columns": `serving.request_columns`). `seqs`: see
    `exchange_batches`."""
    encoded = encode_requests_for_exchange(requests, k, batch_size, request_format)
    own = client is None
    client = client or connect(location_of(location), credentials)
    try:
        return retrieve_encoded(client, encoded, timeout=timeout, seqs=seqs)
    finally:
        if own:
            client.close()


REQUEST_FORMATS = ("json", "columns")


def encode_requests_for_exchange(requests: Sequence, k: int, batch_size: int = DEFAULT_CLIENT_BATCH,
                                 request_format: str = "json") -> tuple[list[pa.RecordBatch], list[int]]:
    """The request batches of a `["retrieve"]` exchange and the request ids, encoded once: a router
    sends the same batches to every shard (`retrieve_encoded`). `request_format`: "json" (the
    `request` column) or "columns" (`serving.request_columns`)."""
    check_k(k)
    if request_format not in REQUEST_FORMATS:
        raise ValueError(f"request_format: expected one of {', '.join(REQUEST_FORMATS)}, got {request_format!r}")
    encode = request_columns if request_format == "columns" else request_batch
    requests = list(requests)
    batches = [encode(part, k) for part in in_batches(requests, batch_size)]
    return batches, [_request_id(r) for r in requests]


def retrieve_encoded(client: flight.FlightClient, encoded: tuple[list[pa.RecordBatch], list[int]], *,
                     timeout: float | None = 60.0, seqs: list | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """`retrieve_over_flight` of requests already encoded (`encode_requests_for_exchange`)."""
    batches, ids = encoded
    answers = exchange_batches(client, batches, timeout=timeout, seqs=seqs) if batches else []
    table = pa.Table.from_batches(answers, schema=ANSWER_SCHEMA)
    return split_answers(table.combine_chunks(), ids)


__all__ = [
    "ACTION_ROLES",
    "ANSWER_SCHEMA",
    "InvalidInput",
    "REQUEST_SCHEMA",
    "REQUEST_FORMATS",
    "RETRIEVE_PATH",
    "RetrieveServer",
    "ServiceStats",
    "answer_batch",
    "answer_metadata",
    "answer_seq",
    "check_k",
    "check_batch_limits",
    "decode_request_batch",
    "decode_request_batches",
    "parse_batch_request",
    "encode_requests_for_exchange",
    "exchange_batches",
    "flight_action",
    "send_update_stream",
    "send_updates",
    "UPDATE_CHUNK_BYTES",
    "UPDATE_CHUNK_SCHEMA",
    "UPDATE_PATH",
    "location_of",
    "request_batch",
    "request_ids",
    "request_text",
    "retrieve_encoded",
    "retrieve_endpoints",
    "retrieve_over_flight",
    "serve_until_stopped",
    "to_flight_error",
    "split_answers",
    "wait_until_healthy",
]
