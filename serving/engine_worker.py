"""One engine of a co-located server with several (`serve colocated --engines N`), in a process of its
own: one thread reads its control channel from the front (`serving.engine_channel`) in order, and
its request lanes as requests arrive on them, and

* hands each request batch, as it arrived, to its own `serving.batcher.RequestBatcher` (without
  waiting: `submit_payload_async`), which gathers the requests of the calls that arrive together,
  decodes them, runs the engine and encodes the answers, as the one-engine server does
  (`serving.engine_server`); each call's answer batch goes back, on the lane the request came on, as
  Arrow IPC bytes with the sequence number of the last update it reflects;
* applies each slice of logged updates before it reads the next message, under the engine's lock
  (between two batches), and answers with its sequence number: the front acknowledges an update call
  once every worker holds it, so a request the front sends afterwards is read after it here and
  sees it;
* answers the front's questions (its state: what its engine holds, its batching counters);
* ends when the front says so (`STOP`, after the batches in hand) or when the channel ends (the
  front is gone).

With `--endpoints` it also serves the `["retrieve"]` exchange on a Flight server of its own
(`WorkerEndpoint`, the front's guard and limits, on the front's host): the front lists these
servers in GetFlightInfo, so clients that follow them reach a worker with no front in the way (no
interpreter lock shared with every other client's exchange). Their requests join the same batcher
as the lanes'; updates, compaction and the log stay the front's, which acknowledges an update only
once every worker applied it, so what a client reads from a worker after the acknowledgement
includes it.

The process itself (loading the corpus, building the engine for the device, the parent watch) is
`migration.engine_worker`'s; this module knows only an engine.
"""

from __future__ import annotations

import threading
import time

import pyarrow as pa

from andromeda_nb import rows
from andromeda_nb.engine import warm_up

from . import engine_channel as ch
from .batcher import DEFAULT_MAX_WAIT_S, RequestBatcher
from .limits import DEFAULT_LIMITS, ServiceLimits
from .overlap import OverlappedBatches, UpdatesLock
from .protocol import (ANSWER_SCHEMA, RetrieveServer, answer_batch, answer_metadata, batch_bytes, decode_request_batch,
                       decode_request_batches, request_ids)
from .wal import snapshot_seq


def _columnar_rows(batch) -> int | None:
    from .request_columns import is_columnar

    return batch.num_rows if is_columnar(batch.schema) else None


def limits_of(config: dict) -> ServiceLimits:
    """The front's limits, as its `CONFIG` message carries them."""
    return ServiceLimits(**config["limits"]) if config.get("limits") else DEFAULT_LIMITS


class EngineWorker:
    """Serves one engine over one channel (`conn`: a `multiprocessing.connection.Connection`); see the
    module docstring. `name` ("engine worker 2 of 4") is how errors and messages call it."""

    def __init__(self, engine, dataset, conn, *, lanes=None, limits: ServiceLimits = DEFAULT_LIMITS,
                 batch_wait_s: float = DEFAULT_MAX_WAIT_S, decode_ahead: bool = False, name: str = "engine worker",
                 turn=None, overlap: bool = False):
        """`lanes`: the listening socket the front connects its request lanes to (None: none)."""
        model = dataset.model
        self.engine, self.conn, self.lanes, self.name = engine, conn, lanes, name
        self.limits = limits
        self.seed, self.experts, self.width = dataset.seed, model.E, model.S
        self.dim, self.formats = model.D, model.F
        self.seq = snapshot_seq(dataset)
        self.endpoint: WorkerEndpoint | None = None  # its own Flight server, with --endpoints (set by its process)
        self._lock = threading.Lock()  # one batch or one slice of updates on the engine at a time
        # `overlap`: as EngineServer's (serving.overlap)
        self.overlap = OverlappedBatches(engine, self._lock, lambda: self.seq) if overlap else None
        self._updates_lock = UpdatesLock(self._lock, self.overlap)
        self._send_lock = threading.Lock()  # the receiver and the batcher's thread both send
        self._schemas: dict[bytes, pa.Schema] = {}
        self._warm_up(dataset)
        self.batcher = RequestBatcher(self._run_batch, max_wait_s=batch_wait_s, max_requests=limits.max_batch_requests,
                                      name=f"{name} batcher", decode=self.decode, encode=self.encode,
                                      encode_many=self.encode_many, decode_many=self.decode_many,
                                      decode_ahead=decode_ahead, count=_columnar_rows, turn=turn,
                                      overlap=self.overlap)

    def _warm_up(self, dataset) -> None:
        """Before it says READY: every kernel compiled or loaded (as EngineServer), and the update path's
        compiled row map."""
        warm_up(self.engine, dataset.requests, (1, self.limits.max_k))
        rows.warm_up()

    # --- what the batcher runs ---------------------------------------------------------------------
    def _run_batch(self, requests, k):
        with self._lock:
            return self.engine.retrieve(requests, k), self.seq

    def decode(self, batch):
        return decode_request_batch(batch, seed=self.seed, experts=self.experts, width=self.width, limits=self.limits)

    def decode_many(self, batches):
        return decode_request_batches(batches, seed=self.seed, experts=self.experts, width=self.width,
                                      limits=self.limits)

    def encode(self, requests, answers, seq):
        """One call's answers as the bytes of an answer batch, and the seq they reflect."""
        out = answer_batch(request_ids(requests), answers)
        return out.serialize(), self.seq if seq is None else seq

    def encode_many(self, parts, seq):
        """`encode` of the calls of one engine batch: one answer batch built for all, each call's rows
        a slice of it."""
        import numpy as np

        ids = np.concatenate([np.asarray(request_ids(reqs), np.int64) for reqs, _ in parts])
        out = answer_batch(ids, [a for _, ans in parts for a in ans])
        result, row = [], 0
        for _, ans in parts:
            n = sum(len(ad_ids) for ad_ids, _ in ans)
            result.append((out.slice(row, n).serialize(), seq))
            row += n
        return result

    # --- the channel -------------------------------------------------------------------------------
    def send(self, msg: bytes) -> None:
        with self._send_lock:
            self.conn.send_bytes(msg)

    def serve(self) -> None:
        """Say READY, then serve the control channel's messages in order, and each lane's requests as
        they come, until STOP or the channel's end."""
        import selectors

        self.send(ch.message(ch.READY, body={"name": self.name, **self.state()}))
        events = selectors.DefaultSelector()
        events.register(self.conn.fileno(), selectors.EVENT_READ, None)
        if self.lanes is not None:
            events.register(self.lanes, selectors.EVENT_READ, self.lanes)
        try:
            while True:
                for key, _ in events.select():
                    if key.data is None:
                        if not self._control():
                            return
                    elif key.data is self.lanes:
                        try:
                            lane, _ = self.lanes.accept()
                        except OSError:
                            continue
                        lane.setblocking(True)
                        events.register(lane, selectors.EVENT_READ, lane)
                    elif not self._lane(key.data):
                        events.unregister(key.data)
                        key.data.close()
        finally:
            events.close()
            self.close_endpoint()  # its calls in flight finish on the batcher, which still runs
            self.batcher.close()  # the batch in hand finishes; calls still queued hear the server is stopping

    def _control(self) -> bool:
        """The control channel's next message, served; False at STOP or the channel's end."""
        try:
            msg = self.conn.recv_bytes()
        except (EOFError, OSError):  # the front is gone
            return False
        kind = msg[:1]
        if kind == ch.UPDATE:
            self._update(msg)
        elif kind == ch.CONTROL:
            self._reply(ch.call_id_of(msg), self.state)
        elif kind == ch.STOP:
            return False
        elif kind == ch.REQUEST:  # requests come on lanes: this one hears so rather than waiting
            self._error(ch.call_id_of(msg), RuntimeError("a request batch came on the control channel; "
                                                         "requests come on a lane"))
        return True

    def _lane(self, lane) -> bool:
        """A request that came on `lane`, handed to the batcher; False when the front closed the lane."""
        try:
            msg = ch.recv_frame(lane)
        except (EOFError, OSError):
            return False
        if msg is None:
            return False
        send = lambda out: ch.send_frame(lane, out)  # noqa: E731 - one request in flight on a lane
        if msg[:1] != ch.REQUEST:
            self._error(ch.call_id_of(msg) if len(msg) >= 9 else 0,
                        RuntimeError(f"a lane carries request batches, not {bytes(msg[:1])!r}"), send)
            return True
        self._request(msg, send)
        return True

    def _reply(self, call_id: int, work) -> None:
        try:
            body = work()
        except Exception as exc:  # noqa: BLE001 - the front's call hears of it
            self._error(call_id, exc)
            return
        self.send(ch.message(ch.REPLY, call_id, body))

    def _error(self, call_id: int, exc: BaseException, send=None) -> None:
        try:
            (send or self.send)(ch.message(ch.ERROR, call_id, ch.error_body(exc)))
        except OSError:
            pass  # the front is gone, or gave up on this call

    def _request(self, msg: bytes, send) -> None:
        """One request batch: answered with `send` (its lane's), at once when it holds no request,
        else once the batcher has run it."""
        call_id, schema_bytes, body = ch.split_request(msg)
        try:
            schema = self._schemas.get(schema_bytes)
            if schema is None:
                schema = self._schemas[schema_bytes] = pa.ipc.read_schema(pa.py_buffer(schema_bytes))
            batch = pa.ipc.read_record_batch(pa.py_buffer(body), schema)
            if batch.num_rows == 0:  # nothing for the engine: checked and answered here, at the current seq
                self.decode(batch)
                out, seq = self.encode([], [], None)
                now = time.perf_counter()
                send(ch.answer_message(call_id, seq, now, now, out))
                return
            times: dict = {}

            def done(answers, error):
                if error is not None:
                    self._error(call_id, error, send)
                    return
                out, seq = answers
                try:
                    send(ch.answer_message(call_id, seq, times.get("taken", 0.0), times.get("answered", 0.0), out))
                except OSError:
                    pass  # the front gave up on this call (its lane is closed), or is gone

            self.batcher.submit_payload_async(batch, done, times)
        except OSError:
            pass  # the lane closed while answering at once
        except Exception as exc:  # noqa: BLE001 - this call's caller hears of it
            self._error(call_id, exc, send)

    def _update(self, msg: bytes) -> None:
        """Apply a slice of logged updates, whole, between two batches; reply with the seq held."""
        call_id = ch.call_id_of(msg)
        self._reply(call_id, lambda: self.apply_records(ch.json_body(msg)))

    def apply_records(self, records) -> dict:
        from andromeda_nb.updates import parse_update

        items = [(int(seq), parse_update(obj, seed=self.seed, dim=self.dim, formats=self.formats))
                 for seq, obj in records]
        if not items:
            return {"seq": self.seq}
        apply_many = getattr(self.engine, "apply_many", None)
        with self._updates_lock:
            done = 0
            try:
                if apply_many is not None:  # the slice in one piece (GPU: one upload; CPU: runs of upserts)
                    apply_many([update for _, update in items])
                    done = len(items)
                for _, update in items[done:]:
                    self.engine.apply(update)
                    done += 1
                prepare = getattr(self.engine, "prepare", None)
                if prepare is not None:
                    prepare()
            finally:  # answers name the last update the engine holds, also when one failed to apply
                if done:
                    self.seq = items[done - 1][0]
        return {"seq": self.seq}

    def state(self) -> dict:
        """What the front's health and stats read: the engine's description, the seq it holds, its
        batching counters and device seconds, the CPU seconds of its process, and its own endpoint's
        location (when it has one)."""
        import os

        endpoint = self.endpoint
        return {"pid": os.getpid(), "seq": self.seq, "engine": self.engine.describe(), "cpu_s": time.process_time(),
                "batching": self.batcher.stats() if hasattr(self, "batcher") else None,
                "device_seconds": getattr(self.engine, "device_seconds", None),
                **({} if endpoint is None else {"endpoint": endpoint.advertised,
                                                "endpoint_requests": endpoint.stats.snapshot().get("requests", 0)})}

    def close_endpoint(self) -> None:
        """Stop the worker's own Flight server, after the calls on it finish (the batcher still runs)."""
        endpoint = self.endpoint
        if endpoint is not None:
            endpoint.stop()
            endpoint.shutdown()
            self.endpoint = None


class WorkerEndpoint(RetrieveServer):
    """An engine worker's own `["retrieve"]` exchange (module docstring): each request batch goes to
    the worker's batcher, as a lane's does, and comes back with the seq of the last update it
    reflects. Health answers for this worker; updates and compaction are refused: the front takes
    them. `advertised`: the location the front lists (`host`, the port bound)."""

    name = "colocated engine worker"

    def __init__(self, worker: EngineWorker, host: str, *, guard=None):
        self.worker = worker
        bind = f"[{host}]" if ":" in host and not host.startswith("[") else host  # an IPv6 address
        super().__init__(f"grpc://{bind}:0", seed=worker.seed, experts=worker.experts, width=worker.width,
                         limits=worker.limits, guard=guard)
        self.advertised = self.guard.location(advertised_host(host), self.port)

    def current_seq(self) -> int:
        return self.worker.seq

    def serve_batch(self, batch, times=None):
        size = batch_bytes(batch)
        if batch.num_rows == 0:  # nothing for the engine: checked and answered here, at the current seq
            self.worker.decode(batch)
            self.stats.add(bytes_in=size, batches=1)
            return answer_batch([], []), answer_metadata(self.worker.seq)
        try:
            data, seq = self.worker.batcher.submit_payload(batch, times)
        finally:
            self.stats.add(bytes_in=size)
        out = pa.ipc.read_record_batch(pa.py_buffer(data), ANSWER_SCHEMA)
        self.stats.add(requests=batch.num_rows, batches=1, bytes_out=out.nbytes)
        return out, answer_metadata(seq)

    def apply_updates(self, body: bytes, started: float) -> dict:
        from .inputs import InvalidInput

        raise InvalidInput(f"{self.worker.name} answers requests only: send updates to the server that listed it "
                           "(its front, where GetFlightInfo was asked)")

    def compact(self) -> dict:
        from .inputs import InvalidInput

        raise InvalidInput(f"{self.worker.name} answers requests only: ask the server that listed it to compact")

    def health_info(self) -> dict:
        return {"worker": self.worker.name, "engine": self.worker.engine.describe()}

    def extra_stats(self) -> dict:
        return {"batching": self.worker.batcher.stats()}


def advertised_host(host: str) -> str:
    """The host a client is told to reach a server bound to `host` at: itself, or for a wildcard
    address (all interfaces) this machine's name."""
    import socket

    return socket.getfqdn() if host in ("", "0.0.0.0", "::", "[::]") else host


__all__ = ["EngineWorker", "WorkerEndpoint", "advertised_host", "limits_of"]
