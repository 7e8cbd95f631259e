"""The remote scoring service: its own process holding the ad embeddings, scoring candidate lists.

Protocol (Arrow Flight; docs/PROTOCOL.md has the full text):

* `DoExchange`, descriptor path `["score"]`. The caller (the index host) writes one record batch per
  request: column `ad_id` int64, the candidates, with the request's user side as the batch's
  `app_metadata`: float32 little-endian U (E, D), Q (E, D), gamma (F, D), beta (F, D), concatenated
  (`user_side_bytes`). For every batch the service writes one batch back: column `score` float32,
  one per candidate, same order. A batch may hold at most the service's `max_request_bytes`
  (candidates and user side together; `health` says the figure): a longer candidate list goes as
  several batches in a row, each with the request's user side, and its scores are theirs in order.
  With the path `["score", "SEQ"]` the caller says which update it expects the service to be at;
  a service at another sequence number refuses the exchange (`stale:`), so a scorer that restarted
  and lost updates can never score against the wrong embeddings: the index host catches it up and
  asks again.
* `DoAction("health")`: sizes (ads, rows, D, E, F, top_k, precision), `fingerprint` (a hash of the
  ad ids of the snapshot it loaded), `lineage` (the corpus's name through compactions) and `seq`
  (the last update applied), so an index host can check that both hold the same corpus and see
  how far behind the service is.
* `DoAction("stats")`: requests, candidates, batches, bytes_in, bytes_out, errors, updates, and
  device_seconds (the GPU table's device time so far; null on the CPU or the simulator).
* `DoAction("update")`: the index host's log records, JSON Lines `{"seq": n, "lineage": L, "update":
  {...}}` of DESIGN section 6, in order and already checked against the live ids. Records the
  service already holds (seq at or below its own) are skipped, so re-delivery is harmless; a gap is
  refused. Upserts store the ad's embedding (quantized to the table's precision) and format;
  retires forget the ad; status changes need nothing here. Answer: `{"applied": n, "seq": s}`.
  **Only the index host may send them**: the body opens with a line holding its HMAC-SHA256 under
  the pair's secret (`serving.guard.sign_records`; the secret is `pair_secret`, made at start
  when not given, and never travels), or the caller holds the admin token; and every record names
  the lineage of the log it belongs to, which must be this service's corpus's. Anything else is
  refused whole (a record with a sequence number alone had made this service skip the index host's
  real record of that number), counted in `health` (`refused`: how many calls, and the last
  reason). An update without a sequence number is refused: updates reach this service only through
  its index host's log, so a stray `update` sent here alone cannot make the two services disagree.
* Tokens and TLS as every server (`serving.guard`): scoring needs the reader token, updates
  the admin token.

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

from andromeda_nb import jsontext
from andromeda_nb.dataset import fingerprint
from andromeda_nb.model import quantize
from andromeda_nb.quoting import clip, quote
from serving.durable import ReadGate
from serving.guard import OPEN, READER, ClientCredentials, connect, new_pair_secret, sign_records, verify_records
from serving.limits import DEFAULT_LIMITS
from serving.protocol import InvalidInput, ServiceStats, to_flight_error
from serving.wal import LogRecord, corpus_lineage, snapshot_seq

from .candidates import CpuCandidateTable

SCORE_PATH = ("score",)
CANDIDATE_SCHEMA = pa.schema([("ad_id", pa.int64())])
SCORE_SCHEMA = pa.schema([("score", pa.float32())])
ACTIONS = {
    "health": "liveness, sizes, corpus fingerprint and lineage, seq (JSON)",
    "stats": "counters: requests, candidates, batches, bytes_in, bytes_out, errors, updates, device_seconds (JSON)",
    "update": "body: the index host's log records, JSON Lines {seq, update}; answer: {\"applied\": n, \"seq\": s}",
}
CANDIDATE_BYTES = 8  # an int64 ad id on the wire
STALE = "stale:"  # starts the error of a score exchange sent for another sequence number


class ScorerBehind(RuntimeError):
    """The scoring service is not at the sequence number the index host expected."""


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
    """Holds a candidate table (ad id -> row, and the scorer: `cpu_baseline.candidates.CpuCandidateTable`
    by default, or `table=` any object with its interface, such as `gpu.candidates.GpuCandidateScorer`
    for a scoring service on a GPU); serves `["score"]` and the actions above."""

    name = "scorer"

    def __init__(self, dataset, location: str = "grpc://127.0.0.1:0", *, delay_s: float = 0.0, limits=None,
                 guard=None, table=None, pair_secret: str | None = None, **kwargs):
        self.precision = dataset.embeddings.precision
        self.E, self.D, self.F = dataset.model.E, dataset.model.D, dataset.model.F
        self.table = table if table is not None else CpuCandidateTable.for_dataset(dataset)
        self.device = getattr(self.table, "device", "cpu")
        self.fingerprint = fingerprint(dataset.ad_ids)
        self.delay_s = delay_s  # test hook: a slow scorer
        self.stats = ServiceStats()
        self.candidates = 0
        self.seed = dataset.seed
        self.seq = snapshot_seq(dataset)  # the last update applied: the snapshot's, until the index host delivers more
        self.lineage = corpus_lineage(dataset)
        self.limits = limits or DEFAULT_LIMITS
        self.guard = guard or OPEN
        self.gate = ReadGate()
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        # what signs the index host's records (made here when not given: then only this process knows it,
        # and only a caller with the admin token, or one handed `pair_secret`, can send records)
        self.pair_secret = pair_secret or new_pair_secret()
        self.refused = 0  # update calls refused as not from the index host, or of another log
        self.last_refused: str | None = None
        super().__init__(self.guard.server_location(location), **self.guard.server_kwargs(), **kwargs)  # listening

    @property
    def busy(self) -> bool:
        return self.gate.busy

    # --- scoring -------------------------------------------------------------------------------------
    def do_exchange(self, context, descriptor, reader, writer):
        try:
            self.guard.require(context, READER, "scoring")
            path = tuple(p.decode() if isinstance(p, bytes) else p for p in (descriptor.path or ()))
            want = _expected_seq(path)
            writer.begin(SCORE_SCHEMA)
            for chunk in reader:
                if chunk.data is None:
                    continue
                if self._stopping.is_set():
                    raise flight.FlightUnavailableError("the scoring service is shutting down")
                if chunk.data.schema != CANDIDATE_SCHEMA:
                    raise InvalidInput(f"candidate batch must have the one column 'ad_id' int64, got {chunk.data.schema}")
                if chunk.app_metadata is None:
                    raise InvalidInput("candidate batch carries no user side (app_metadata)")
                size = chunk.data.nbytes + chunk.app_metadata.size
                if size > self.limits.max_request_bytes:
                    raise self.limits.over("max_request_bytes", size, "candidate batch of bytes")
                with self.gate.reading():
                    U, Q, gamma, beta = split_user_side(chunk.app_metadata.to_pybytes(), self.E, self.D, self.F)
                    ad_ids = chunk.data.column(0).to_numpy(zero_copy_only=False)
                    if self.delay_s:
                        time.sleep(self.delay_s)
                    with self._lock:
                        if want is not None and want != self.seq:
                            raise flight.FlightServerError(f"{STALE} the scoring service is at update {self.seq}, "
                                                           f"the caller expects {want}")
                        try:
                            scores = self.table.score_user_side(ad_ids, U, Q, gamma, beta)
                        except KeyError as exc:
                            raise InvalidInput(f"candidate {exc.args[0]} here") from None
                    out = pa.record_batch([pa.array(scores)], schema=SCORE_SCHEMA)
                    writer.write_batch(out)
                self.stats.add(requests=1, batches=1, bytes_in=size, bytes_out=out.nbytes)
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
        what = "update" if action.type == "update" else "request"
        try:
            if action.type != "update":
                self.guard.require(context, READER, f"action {quote(action.type)}")
            if action.type == "health":
                result = self.health()
            elif action.type == "stats":
                with self._lock:
                    result = {"server": self.name, **self.stats.snapshot(), "candidates": self.candidates,
                              "device_seconds": getattr(self.table, "device_seconds", None)}
            elif action.type == "update":
                result = self.apply_records(self.authorized_records(context, body))
            else:
                raise InvalidInput(f"unknown action {quote(action.type)}; actions: {', '.join(ACTIONS)}")
        except Exception as exc:
            self.stats.add(errors=1)
            raise to_flight_error(exc, what) from None
        yield flight.Result(json.dumps(result).encode())

    def list_actions(self, context):
        return list(ACTIONS.items())

    def health(self) -> dict:
        with self._lock:
            return {"status": "ok", "server": self.name, "ads": len(self.table), "rows": self.table.n_rows,
                    "device": self.device, "D": self.D, "E": self.E, "F": self.F, "top_k": self.table.top_k,
                    "precision": self.precision, "fingerprint": self.fingerprint, "lineage": self.lineage,
                    "seq": self.seq, "max_request_bytes": self.limits.max_request_bytes,
                    "guard": self.guard.describe(),
                    **({"refused": {"updates": self.refused, "last": self.last_refused}} if self.refused else {})}

    def _refuse(self, exc: Exception) -> Exception:
        """Count an update call refused as not its index host's (health says so) and return `exc`."""
        with self._lock:
            self.refused += 1
            self.last_refused = clip(str(exc))
        return exc

    def authorized_records(self, context, body: bytes) -> bytes:
        """The records of an `update` call that its index host sent: signed with the pair's secret,
        or from a caller with the admin token; refused otherwise (module docstring)."""
        if len(body) > self.limits.max_update_bytes:
            raise self.limits.over("max_update_bytes", len(body), "update body of bytes")
        signed, records = verify_records(self.pair_secret, body)
        if signed or self.guard.caller_is_admin(context):
            return records
        raise self._refuse(flight.FlightUnauthorizedError(
            "update records are taken from this scoring service's index host only: signed with the pair's secret "
            f"({'no signature' if records is body else 'a signature that does not hold'}), or sent with the admin "
            "token; this call needs the admin token or the pair's secret"))

    def apply_records(self, body: bytes) -> dict:
        """Apply the index host's log records after this service's sequence number (module
        docstring); the caller checked who sent them (`authorized_records`). The whole body is
        checked before any record is applied: a record of another log's lineage is refused."""
        if len(body) > self.limits.max_update_bytes:
            raise self.limits.over("max_update_bytes", len(body), "update body of bytes")
        records = []
        for n, raw in enumerate(body.split(b"\n"), start=1):
            if not raw.strip():
                continue
            obj = jsontext.loads(raw, max_depth=self.limits.max_json_depth)
            if not isinstance(obj, dict) or not isinstance(obj.get("seq"), int) or "update" not in obj:
                raise InvalidInput(f"line {n}: the scoring service takes its index host's log records "
                                   '({"seq": n, "lineage": L, "update": {...}}) only; send updates to the index host')
            if obj.get("lineage") != self.lineage:
                raise self._refuse(InvalidInput(
                    f"line {n}: record {quote(obj['seq'])} belongs to the log of lineage {quote(obj.get('lineage'))}, "
                    f"this service holds lineage {self.lineage}: records of another log are refused"))
            if records and obj["seq"] != records[-1][0] + 1:
                raise InvalidInput(f"line {n}: record {quote(obj['seq'])} follows {records[-1][0]}: records must be "
                                   "consecutive")
            records.append((obj["seq"], scoring_fields(obj["update"], dim=self.D, formats=self.F, seed=self.seed,
                                                       line=n)))
        with self._lock:
            if records and records[0][0] > self.seq + 1:
                raise InvalidInput(f"records start at {records[0][0]}, but this service is at update {self.seq}: "
                                   f"send it every record after {self.seq}")
            applied = 0
            for seq, (op, ad_id, fmt, embedding) in records:
                if seq <= self.seq:  # already here: re-delivery after a lost answer
                    continue
                if op == "upsert":
                    self._store(ad_id, fmt, embedding)
                elif op == "retire" and ad_id in self.table:
                    self.table.retire(ad_id)
                self.seq = seq
                applied += 1
            self.stats.add(updates=applied)
            return {"applied": applied, "seq": self.seq}

    def _store(self, ad_id: int, fmt: int, embedding: np.ndarray) -> None:
        stored = quantize(embedding.reshape(1, -1), self.precision)
        self.table.upsert(ad_id, stored.values[0], float(stored.scale[0]), fmt)

    # --- lifecycle -----------------------------------------------------------------------------------
    def stop(self) -> None:
        self._stopping.set()


def scoring_fields(update, *, dim: int, formats: int, seed: int, line: int | None = None) -> tuple:
    """What the scoring service needs of one update its index host checked in full: (op, ad id,
    format, embedding float32 (dim,)) for an upsert (the embedding derived from id and seed when the
    line has none, as everywhere), (op, ad id, None, None) for a status or retire. Parsing only these
    fields keeps delivery cheap; each is still checked, so no record can reach past a table.
    InvalidInput names the line and the field."""
    from andromeda_nb.derive import ad_embedding
    from andromeda_nb.targeting import MAX_AD_ID

    where = f"line {line}: " if line is not None else ""

    def ad_id_of(obj, path):
        value = obj.get("ad_id") if isinstance(obj, dict) else None
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_AD_ID:
            raise InvalidInput(f"{where}{path}: expected an ad id in 0..2**63-1, got {quote(value)}")
        return value

    op = update.get("op") if isinstance(update, dict) else None
    if op in ("status", "retire"):
        return op, ad_id_of(update, "ad_id"), None, None
    if op != "upsert" or not isinstance(update.get("ad"), dict):
        raise InvalidInput(f"{where}op: expected upsert (with an ad), status or retire, got {quote(op)}")
    ad = update["ad"]
    ad_id = ad_id_of(ad, "ad.ad_id")
    fmt = ad.get("format", 0)
    if not isinstance(fmt, int) or isinstance(fmt, bool) or not 0 <= fmt < formats:
        raise InvalidInput(f"{where}ad.format: expected 0..{formats - 1}, got {quote(fmt)}")
    values = ad.get("embedding")
    if values is None:
        return op, ad_id, fmt, ad_embedding(ad_id, seed, dim)
    if not isinstance(values, list) or len(values) != dim or \
            any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
        raise InvalidInput(f"{where}ad.embedding: expected {dim} numbers")
    embedding = np.asarray(values, np.float32)
    if not np.all(np.isfinite(embedding)):
        raise InvalidInput(f"{where}ad.embedding: expected finite float32 values")
    return op, ad_id, fmt, embedding


def _expected_seq(path: tuple) -> int | None:
    if path == SCORE_PATH:
        return None
    if len(path) == 2 and path[0] == SCORE_PATH[0]:
        try:
            return int(path[1])
        except ValueError:
            pass
    raise InvalidInput(f"unknown exchange {clip(str(list(path)))}; this service serves {list(SCORE_PATH)} or "
                       f"{list(SCORE_PATH) + ['SEQ']}")


class ScorerClient:
    """The index host's side of the `["score"]` hop: one exchange per group of requests, and the
    delivery of its log's records."""

    def __init__(self, location: str, *, timeout_s: float = 10.0, credentials: ClientCredentials | None = None,
                 max_batch_bytes: int = DEFAULT_LIMITS.max_request_bytes, pair_secret: str | None = None,
                 lineage: str | None = None):
        self.location = location
        self.pair_secret = pair_secret  # signs the records it delivers (`serving.guard.sign_records`)
        self.lineage = lineage  # the log's, named in every record it delivers
        self.timeout_s = timeout_s
        self.max_batch_bytes = int(max_batch_bytes)  # the service's request limit (its `health` says it)
        self.credentials = credentials
        self.client = connect(location, credentials)
        self.calls = 0
        self._lock = threading.Lock()

    def _reconnect(self, failed: flight.FlightClient) -> None:
        """A fresh channel in place of `failed`: gRPC backs a failed channel off for up to two minutes,
        while a service that restarted on the same address is usually back within a second. Other
        threads may still be in calls on the old client (the retrievals and the monitor share it): it
        is closed only once their deadline has passed, and only the first thread to see it fail
        replaces it."""
        with self._lock:
            if self.client is not failed:
                return
            self.client = connect(self.location, self.credentials)
        closer = threading.Timer(self.timeout_s + 1.0, _close_quietly, args=(failed,))
        closer.daemon = True
        closer.start()

    def _error(self, exc: Exception, what: str, client: flight.FlightClient) -> Exception:
        if isinstance(exc, pa.ArrowInvalid) and "closed" in str(exc):  # closed by close(): stopping
            exc = flight.FlightUnavailableError(str(exc))
        if isinstance(exc, (flight.FlightUnavailableError, flight.FlightTimedOutError)):
            self._reconnect(client)
        if isinstance(exc, flight.FlightTimedOutError):
            return flight.FlightTimedOutError(
                f"scoring service at {self.location} did not answer {what} within {self.timeout_s:g} s")
        if isinstance(exc, flight.FlightUnavailableError):
            return flight.FlightUnavailableError(f"scoring service at {self.location} is unavailable: {exc}")
        if isinstance(exc, (flight.FlightUnauthenticatedError, flight.FlightUnauthorizedError)):
            return type(exc)(f"scoring service at {self.location} refused the index host ({str(exc).split('. Detail:')[0]}); "
                             "give the index host the pair's secret ($ANDROMEDA_PAIR_SECRET or --pair-secret-file, by "
                             "default pair.secret beside the scoring service's corpus) or its token "
                             "($ANDROMEDA_SCORER_TOKEN or --scorer-token-file)")
        if isinstance(exc, flight.FlightError):
            return flight.FlightInternalError(f"scoring service at {self.location} failed: {exc}")
        return exc

    def action(self, name: str, body: bytes = b"", timeout_s: float | None = None) -> dict:
        client = self.client
        try:
            results = list(client.do_action(flight.Action(name, body),
                                            options=flight.FlightCallOptions(timeout=timeout_s or self.timeout_s)))
        except Exception as exc:
            raise self._error(exc, f"action {name!r}", client) from None
        return json.loads(results[0].body.to_pybytes())

    def deliver(self, records: list[LogRecord]) -> int:
        """Send log records (in order), each naming the log's lineage, signed with the pair's secret;
        returns the service's sequence number afterwards."""
        body = "\n".join(json.dumps({"seq": r.seq, "lineage": self.lineage, "update": r.update}, separators=(",", ":"))
                         for r in records)
        return int(self.action("update", sign_records(self.pair_secret, body.encode()))["seq"])

    def score(self, work: list[tuple[np.ndarray, bytes]], seq: int | None = None) -> list[np.ndarray]:
        """`work`: per request (candidate ad ids int64, user-side bytes); returns float32 scores each.
        `seq`: the update the service must be at (else `ScorerBehind`)."""
        if not work:
            return []
        self.calls += 1
        pieces = []  # per request: its candidate list in batches within the service's request limit
        for ad_ids, side in work:
            per_batch = (self.max_batch_bytes - len(side)) // CANDIDATE_BYTES
            if per_batch < 1:
                raise ValueError(f"a user side of {len(side)} bytes leaves no room for candidates in the scoring "
                                 f"service's request limit of {self.max_batch_bytes} bytes (--max-request-bytes)")
            ad_ids = np.asarray(ad_ids, np.int64)
            pieces.append([ad_ids[lo : lo + per_batch] for lo in range(0, max(1, len(ad_ids)), per_batch)])
        got: list[list[np.ndarray]] = [[] for _ in work]
        path = SCORE_PATH if seq is None else (*SCORE_PATH, str(seq))
        client = self.client
        try:
            writer, reader = client.do_exchange(flight.FlightDescriptor.for_path(*path),
                                                     options=flight.FlightCallOptions(timeout=self.timeout_s))
            with writer:
                writer.begin(CANDIDATE_SCHEMA)
                for i, (parts, (_, side)) in enumerate(zip(pieces, work)):
                    meta = pa.py_buffer(side)
                    for part in parts:  # lock-step: one answer read per batch written (no flow-control stall)
                        writer.write_with_metadata(pa.record_batch([pa.array(part)], schema=CANDIDATE_SCHEMA), meta)
                        got[i].append(reader.read_chunk().data.column(0).to_numpy(zero_copy_only=False))
                writer.done_writing()
                for chunk in reader:  # end of stream
                    if chunk.data is not None:
                        raise flight.FlightInternalError(f"scoring service at {self.location} answered more "
                                                         "batches than it was sent")
        except Exception as exc:
            if isinstance(exc, flight.FlightServerError) and STALE in str(exc):
                raise ScorerBehind(str(exc).split(". Detail")[0]) from None
            raise self._error(exc, f"{len(work)} candidate lists", client) from None
        out = [np.concatenate(parts) if len(parts) != 1 else parts[0] for parts in got]
        bad = [i for i, (s, (r, _)) in enumerate(zip(out, work)) if len(s) != len(r)]
        if bad:
            raise flight.FlightInternalError(f"scoring service at {self.location} answered {len(out[bad[0]])} "
                                             f"scores for {len(work[bad[0]][0])} candidates")
        return out

    def close(self) -> None:
        with self._lock:
            _close_quietly(self.client)


def _close_quietly(client: flight.FlightClient) -> None:
    try:
        client.close()
    except Exception:
        pass


__all__ = ["CANDIDATE_SCHEMA", "SCORE_PATH", "SCORE_SCHEMA", "STALE", "ScorerBehind", "ScorerClient", "ScoringServer",
           "fingerprint", "split_user_side", "user_side_bytes"]
