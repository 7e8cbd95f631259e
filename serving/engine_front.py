"""A co-located server with several engines behind one front (`serve colocated --engines N`).

One process keeps the Flight server, the guard, the limits, the update log (`serving.durable`,
`serving.wal`) and the protocol (`serving.protocol`); N worker processes each load the corpus, build
their own engine on the same device (on a GPU: one CUDA context each, one GPU shared) and batch,
decode, run and encode the requests they are given (`serving.engine_worker`). The front does as
little Python per request as it can: it hands each exchange's request batch, as Arrow IPC bytes, to
the worker with the fewest calls in hand, on a request lane of its own (`serving.engine_channel`),
waits on that lane, and writes the answer batch the worker made. So the host work of N batches runs
in N interpreters at once, instead of one interpreter lock shared with every exchange thread
(docs/BENCHMARKS.md, "The served path with many clients"), and a request's way through the front
wakes one thread of it, not two; pyarrow's Flight server cannot share one port between processes,
so the front stays one.

* Same answers, protocol and app_metadata (`{"seq": n}`, from the worker that answered) as one
  engine. A request's errors are the ones the one-engine server raises, made in the worker.
* Updates: the front checks, logs and syncs an update call as one engine's server does
  (`UpdateJournal`, against its own set of live ids), hands each slice to every worker on its
  channel (`serving.engine_channel`, read in order) and acknowledges the call once every worker has
  applied it: a request sent after the acknowledgement is read after the update by whichever worker
  gets it. On start the front replays its log into every worker before it listens.
* Health asks every worker; a worker that ended makes health `degraded`, naming it; the calls it had
  in hand fail with a `FlightUnavailableError` naming it, and later requests go to the workers left
  (each holds the whole corpus and every update), until none is left. A worker that does not answer
  within the call's deadline fails that call with `FlightTimedOutError` naming it: nothing hangs.
* Stopping (SIGTERM) stops the workers after the batches in flight; a worker ends by itself when
  the front is gone (its channel ends, and it watches its parent).
* With `endpoints` in the workers' configuration (`serve colocated --engines N --endpoints`), each
  worker also serves the `["retrieve"]` exchange on a Flight server of its own, with the front's
  guard and limits, on the front's host (`serving.engine_worker.WorkerEndpoint`), and the front's
  GetFlightInfo of `["retrieve"]` lists the live ones: a client that follows them
  (`serving.protocol.retrieve_endpoints`) sends its requests with no front in the way, and falls back
  to the front when its worker has ended. Updates, health and stats stay the front's.
* With `fronts` (`serve colocated --fronts M`), M front processes beside the workers
  (`serving.lane_engine`), each serving the `["retrieve"]` exchange on a Flight server of its own and
  sending its batches to a worker as one call each; GetFlightInfo lists them in place of the workers'
  endpoints, health and stats name them too, and they take no updates.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from andromeda_nb.dataset import fingerprint
from andromeda_nb.types import Retire, Upsert

from . import engine_channel as ch
from .durable import JournaledServer, ReadGate, UpdateJournal
from .limits import DEFAULT_LIMITS
from .process import ServeError
from .protocol import ANSWER_SCHEMA, RetrieveServer, answer_metadata, batch_bytes
from .wal import WriteAheadLog, corpus_lineage, snapshot_seq

UNIX_PATH_BYTES = 107  # the longest path a Unix socket binds to on Linux (sun_path less its NUL)
STOP_WAIT_S = 10.0  # how long a stopping front waits for a worker to finish its batches and exit
STATE_TIMEOUT_S = 5.0  # how long health and stats wait for a worker's state
LANE_BACKLOG = 256  # lanes a worker's socket holds before the worker accepts them
LANE_END_WAIT_S = 5.0  # how long a call whose lane ended waits to hear why the worker ended
ANSWER_ROW_BYTES = 20  # request id, ad id (int64), score (float32): an answer batch's `nbytes`, without its cost


class LiveIds:
    """The live ad ids at the log's end, as the front's update checks need them (`__contains__`), kept
    without numba (`andromeda_nb.rows.RowMap` compiles its dictionary operations in each process, seconds
    a front should not spend): the snapshot's ids sorted, and the ids updates added and removed since."""

    def __init__(self, ad_ids):
        self._snapshot = np.sort(np.asarray(ad_ids, np.int64))
        self._added: set[int] = set()
        self._removed: set[int] = set()

    def __contains__(self, ad_id) -> bool:
        ad_id = int(ad_id)
        if ad_id in self._added:
            return True
        return ad_id not in self._removed and self._in_snapshot(ad_id)

    def add(self, ad_id) -> None:
        ad_id = int(ad_id)
        self._removed.discard(ad_id)
        self._added.add(ad_id)

    def remove(self, ad_id) -> None:
        ad_id = int(ad_id)
        self._added.discard(ad_id)
        self._removed.add(ad_id)

    def __len__(self) -> int:
        in_snapshot = sum(1 for a in self._removed if self._in_snapshot(a))
        return len(self._snapshot) - in_snapshot + sum(1 for a in self._added if not self._in_snapshot(a))

    def _in_snapshot(self, ad_id: int) -> bool:
        at = int(np.searchsorted(self._snapshot, ad_id))
        return at < len(self._snapshot) and int(self._snapshot[at]) == ad_id


class _Waiter:
    """One call to a worker awaiting its answer: a lock held until the reader releases it."""

    __slots__ = ("lock", "msg", "error")

    def __init__(self):
        self.lock = threading.Lock()
        self.lock.acquire()
        self.msg = None
        self.error: Exception | None = None


def _how_it_ended(code: int | None) -> str:
    if code is None:
        return "its channel closed"
    if code < 0:
        try:
            return f"killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class EngineWorkerProcess:
    """One engine worker as the front sees it: the process (`python -m MODULE --channel-fd FD
    --lanes-fd FD`), its control channel and the calls awaiting an answer on it, and its request
    lanes (`request`). `module`: the worker's entry point (it builds the engine:
    `migration.engine_worker`); `config`: its `CONFIG` message; `lane_dir`: a directory only this
    user can enter (mode 0700), where its lane socket is made."""

    def __init__(self, module: str, config: dict, index: int, count: int, *, lane_dir: str, env: dict | None = None,
                 kind: str = "engine worker"):
        """`kind`: "engine worker", or "front" for a front process (`--fronts`: `serving.lane_engine`)."""
        self.index, self.count, self.kind = index, count, kind
        self.name = f"{kind} {index} of {count}"
        self.lane_path = os.path.join(lane_dir, f"{'worker' if kind == 'engine worker' else kind}-{index}.sock")
        front, child = socket.socketpair()
        lanes = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            lanes.bind(self.lane_path)
            lanes.listen(LANE_BACKLOG)
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module, "--channel-fd", str(child.fileno()), "--lanes-fd", str(lanes.fileno()),
                 "--parent-pid", str(os.getpid())],
                pass_fds=(child.fileno(), lanes.fileno()), stdin=subprocess.DEVNULL,
                stdout=2, env=env)  # stdout: the front's only
        except BaseException:
            front.close()
            self._remove_lane_socket()
            raise
        finally:
            child.close()
            lanes.close()  # the worker holds it; the front connects by its path
        self.pid = self.proc.pid
        self.name = f"{kind} {index} of {count} (pid {self.pid})"
        self.conn = Connection(front.detach())
        self._send_lock = threading.Lock()
        self._pending: dict[int, _Waiter] = {}
        self._ids = itertools.count(1)
        self.lanes = ch.Lanes(self.lane_path, self.name, self._lane_lost)
        self._gone = threading.Event()  # set once `ended` says why the worker is gone
        self.ready = threading.Event()
        self.info: dict | None = None  # what it said when ready
        self.failure: str | None = None  # what it said when it could not start
        self.ended: str | None = None  # why it is no longer serving
        self.send(ch.message(ch.CONFIG, body={**config, "name": f"{kind} {index} of {count}"}))
        self._reader = threading.Thread(target=self._read, name=f"{kind.replace(' ', '-')}-{index}-reader", daemon=True)
        self._reader.start()

    @property
    def in_hand(self) -> int:
        """Its calls not answered yet: requests on its lanes and control calls."""
        return self.lanes.busy + len(self._pending)

    @property
    def alive(self) -> bool:
        return self.ended is None

    # --- sending and waiting ---------------------------------------------------------------------------
    def send(self, msg: bytes) -> None:
        with self._send_lock:
            self.conn.send_bytes(msg)

    def ended_error(self) -> flight.FlightUnavailableError:
        return flight.FlightUnavailableError(f"{self.name} has ended ({self.ended}): the call was not answered; "
                                             "the server's health names it (restart the server to serve with it "
                                             "again)")

    def start(self, make) -> tuple[int, _Waiter]:
        """Send the message `make(call_id)` on the control channel; what `wait` takes (a call in two
        halves, so that one message can go to every worker before any answer is waited for)."""
        if self.ended is not None:
            raise self.ended_error()
        call_id = next(self._ids)
        waiter = self._pending[call_id] = _Waiter()
        if self.ended is not None:  # ended meanwhile: the reader's sweep may have missed this call
            self._pending.pop(call_id, None)
            raise self.ended_error()
        try:
            self.send(make(call_id))
        except OSError:
            self._pending.pop(call_id, None)
            self._end()
            raise self.ended_error() from None
        return call_id, waiter

    def wait(self, started: tuple[int, _Waiter], timeout_s: float | None, what: str = "call") -> bytes:
        call_id, waiter = started
        if not waiter.lock.acquire(timeout=-1 if timeout_s is None else timeout_s):
            self._pending.pop(call_id, None)
            raise flight.FlightTimedOutError(f"{self.name} did not answer the {what} within {timeout_s:g} s")
        if waiter.error is not None:
            raise waiter.error
        return waiter.msg

    # --- requests, on lanes ----------------------------------------------------------------------------
    def request(self, schema: bytes, body, timeout_s: float | None, what: str = "request batch") -> bytes:
        """One request batch (its schema's and its own IPC bytes) on a free lane, and the `ANSWER`
        message that came back on it; the Flight error the worker reported; FlightUnavailableError
        when the worker has ended; FlightTimedOutError after `timeout_s` (None: as long as the
        worker lives), the lane then closed."""
        if self.ended is not None:
            raise self.ended_error()
        return self.lanes.request(next(self._ids), schema, body, timeout_s, what)

    def _lane_lost(self) -> flight.FlightError:
        """The error of a call whose lane ended: the worker's end, once the control channel's reader
        says why (a lane ends with its process), else a lane that ended alone."""
        self._gone.wait(LANE_END_WAIT_S)
        if self.ended is not None:
            return self.ended_error()
        return flight.FlightUnavailableError(f"{self.name} closed the request lane before answering; the call was "
                                             "not answered")

    # --- the reader ------------------------------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv_bytes()
            except (EOFError, OSError):
                break
            kind = msg[:1]
            if kind in (ch.REPLY, ch.ERROR):  # answers to requests come on their lanes
                waiter = self._pending.pop(ch.call_id_of(msg), None)
                if waiter is None:
                    continue  # its caller gave up (deadline)
                if kind == ch.ERROR:
                    waiter.error = ch.flight_error(ch.json_body(msg))
                waiter.msg = msg
                waiter.lock.release()
            elif kind == ch.READY:
                self.info = ch.json_body(msg, with_id=False)
                self.ready.set()
            elif kind == ch.FAILED:
                self.failure = str(ch.json_body(msg, with_id=False).get("message"))
        self._end()

    def _end(self) -> None:
        """The worker is gone: say why, and fail every call it had in hand."""
        if self.ended is not None:
            return
        try:
            code = self.proc.wait(2.0)
        except subprocess.TimeoutExpired:
            code = None
        self.ended = _how_it_ended(code) + (f": {self.failure}" if self.failure else "")
        self._gone.set()
        self.ready.set()
        self.lanes.close()
        self._remove_lane_socket()
        for call_id in list(self._pending):
            waiter = self._pending.pop(call_id, None)
            if waiter is not None:
                waiter.error = self.ended_error()
                waiter.lock.release()
        try:
            self.conn.close()
        except OSError:
            pass

    # --- the end ---------------------------------------------------------------------------------------
    def stop(self, wait_s: float = STOP_WAIT_S) -> int | None:
        """Ask the worker to finish its batches and exit; SIGKILL after `wait_s`. Its exit code."""
        if self.proc.poll() is None:
            try:
                self.send(ch.STOP)
            except OSError:
                pass
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5.0)
        self._remove_lane_socket()
        return self.proc.returncode

    def _remove_lane_socket(self) -> None:
        try:
            os.unlink(self.lane_path)
        except OSError:
            pass

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()


def lane_directory(count: int, fallback: str = "/tmp") -> str:
    """A new directory, mode 0700 (this user's processes only), for the lane sockets of `count`
    workers: under the temporary directory (TMPDIR), or under `fallback` where that one's path is too
    long for a Unix socket; ServeError saying so where neither will do."""
    name = f"worker-{count}.sock"
    tried = []
    for base in (None, fallback):
        if base is not None and (not os.path.isdir(base) or os.path.realpath(base) == os.path.realpath(tempfile.gettempdir())):
            continue
        path = tempfile.mkdtemp(prefix="andromeda-lanes-", dir=base)
        if len(os.fsencode(os.path.join(path, name))) <= UNIX_PATH_BYTES:
            return path
        os.rmdir(path)
        tried.append(path)
    raise ServeError(f"engine workers: no directory for their request sockets ({', '.join(tried)}: longer than the "
                     f"{UNIX_PATH_BYTES} bytes a Unix socket path may take); set TMPDIR to a shorter directory")


class EnginePool:
    """N engine workers started side by side (`EngineWorkerProcess`), each with the same `config`;
    requests go to the live one with the fewest calls in hand, updates to every live one. With
    `fronts` > 0, that many front processes beside them (`serving.lane_engine`), front i sending its
    batches to engine worker i mod N, each serving the retrieve exchange on its own Flight server
    (`front_endpoint`: its host and guard, as `config["endpoint"]`)."""

    def __init__(self, module: str, config: dict, count: int, *, env: dict | None = None, say=None, fronts: int = 0,
                 front_endpoint: dict | None = None):
        if not isinstance(count, int) or count < 1:
            raise ServeError(f"engines: expected at least 1 engine worker, got {count!r}")
        if isinstance(fronts, bool) or not isinstance(fronts, int) or fronts < 0:
            raise ServeError(f"fronts: expected a whole number of front processes, at least 0, got {fronts!r}")
        if fronts and front_endpoint is None:
            raise ServeError("fronts: each front serves on a Flight server of its own; give its host and guard")
        from .services import PROJECT_ROOT
        from andromeda_nb.devices import child_environment

        env = {**child_environment(), **(env or {})}
        env["PYTHONPATH"] = os.pathsep.join([str(PROJECT_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self.say = say
        self.device = config.get("device")
        self.workers: list[EngineWorkerProcess] = []
        self.fronts: list[EngineWorkerProcess] = []
        self._turn = itertools.count()
        self._started = time.perf_counter()
        self.lane_dir = lane_directory(max(count, fronts))
        try:
            for i in range(count):
                self.workers.append(EngineWorkerProcess(module, {**config, "steps": say is not None}, i + 1, count,
                                                        lane_dir=self.lane_dir, env=env))
            for i in range(fronts):
                target = self.workers[i % count]
                front = {**config, "steps": say is not None, "endpoint": front_endpoint, "overlap": False,
                         "lanes_to": {"path": target.lane_path, "name": target.name}}
                self.fronts.append(EngineWorkerProcess(module, front, i + 1, fronts, lane_dir=self.lane_dir, env=env,
                                                       kind="front"))
        except BaseException:
            self.close(wait_s=1.0)
            raise

    def __len__(self) -> int:
        return len(self.workers)

    def wait_ready(self) -> None:
        """Wait until every worker has built its engine (they build at once); ServeError naming the
        first that ended instead (the others are stopped)."""
        for worker in self.workers + self.fronts:
            worker.ready.wait()
            if worker.ended is not None:
                self.close(wait_s=1.0)
                raise ServeError(f"{worker.name} ended while starting ({worker.ended}); see its lines above")
        if self.say is not None:
            fronts = f" and {len(self.fronts)} front(s)" if self.fronts else ""
            self.say(f"{len(self.workers)} engine worker(s){fronts} ready: {time.perf_counter() - self._started:.1f} s")

    def live(self) -> list[EngineWorkerProcess]:
        return [w for w in self.workers if w.ended is None]

    def pick(self) -> EngineWorkerProcess:
        """The live worker with the fewest calls in hand (taking turns among equals)."""
        workers = self.workers
        n = len(workers)
        start = next(self._turn) % n
        best, least = None, None
        for j in range(n):
            worker = workers[(start + j) % n]
            if worker.ended is None and (least is None or worker.lanes.busy < least):
                best, least = worker, worker.lanes.busy
        if best is None:
            raise flight.FlightUnavailableError(f"every engine worker of this server has ended ({self.why_ended()}); "
                                                "restart the server")
        return best

    def why_ended(self) -> str:
        return "; ".join(f"{w.name}: {w.ended}" for w in self.workers if w.ended is not None)

    def apply(self, records: list, timeout_s: float | None = None) -> None:
        """Every live worker applies the logged `records` ([seq, update object] pairs, in order), sent to
        all before any is waited for; returns once all have. RuntimeError when none is left, or when one
        failed to apply them or did not within `timeout_s` (None: as long as it lives; the journal then
        refuses later calls until a restart)."""
        workers = self.live()
        if not workers:
            raise RuntimeError(f"every engine worker of this server has ended ({self.why_ended()}): the updates "
                               "are logged; restart the server (it replays its log)")
        body = json.dumps(records).encode()
        make = lambda call_id: ch.message(ch.UPDATE, call_id, body)  # noqa: E731
        started, failures = [], []
        for worker in workers:  # sent to every worker before any is waited for: they apply it at once
            try:
                started.append((worker, worker.start(make)))
            except flight.FlightError as exc:
                started.append((worker, exc))
        for worker, call in started:
            try:
                if isinstance(call, Exception):
                    raise call
                worker.wait(call, timeout_s, "updates")
            except Exception as exc:  # noqa: BLE001 - a worker that ended meanwhile is no longer served
                if worker.ended is None:
                    failures.append(f"{worker.name}: {exc}")
        if failures:
            raise RuntimeError("applying logged updates failed in " + "; ".join(failures))

    def states(self, timeout_s: float = STATE_TIMEOUT_S, fronts: bool = False) -> list[dict]:
        """Each worker's state (`EngineWorker.state`), asked of all at once, with its name and whether it
        is alive; an `error` for one that has ended or did not answer within `timeout_s`. `fronts`: the
        front processes' instead."""
        make = lambda call_id: ch.message(ch.CONTROL, call_id, {"op": "state"})  # noqa: E731
        started = []
        for worker in self.fronts if fronts else self.workers:  # asked of all before any answer is waited for
            try:
                started.append((worker, worker.start(make)))
            except flight.FlightError as exc:
                started.append((worker, exc))
        deadline = time.monotonic() + timeout_s
        out = []
        for worker, call in started:
            entry = {"worker": worker.index, "name": worker.name, "pid": worker.pid}
            try:
                if isinstance(call, Exception):
                    raise call
                entry.update(ch.json_body(worker.wait(call, max(0.001, deadline - time.monotonic()), "state")))
            except flight.FlightError as exc:
                entry["error"] = str(exc)
            entry["alive"] = worker.ended is None
            out.append(entry)
        return out

    def close(self, wait_s: float = STOP_WAIT_S) -> None:
        """Stop every front, then every worker (after the batches in hand), each group all at once."""
        for group in (self.fronts, self.workers):
            threads = [threading.Thread(target=w.stop, args=(wait_s,), daemon=True) for w in group]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        shutil.rmtree(self.lane_dir, ignore_errors=True)

    def kill(self) -> None:
        for worker in self.fronts + self.workers:
            worker.kill()


class PooledEngineServer(JournaledServer, RetrieveServer):
    """The co-located server over an `EnginePool` (module docstring): the same `["retrieve"]`
    exchange, `health`, `stats`, `update` and `compact` as `serving.engine_server.EngineServer`."""

    name = "colocated"

    def __init__(self, pool: EnginePool, dataset, location: str = "grpc://127.0.0.1:0", *,
                 log: WriteAheadLog | None = None, limits=None, guard=None, data_dir=None):
        model = dataset.model
        limits = limits or DEFAULT_LIMITS
        self.engines = pool
        self.dim, self.formats = model.D, model.F
        self.fingerprint = fingerprint(dataset.ad_ids)
        self.lineage = corpus_lineage(dataset)
        self.data_dir = data_dir if data_dir is not None else getattr(dataset, "source_dir", None)
        self.gate = ReadGate()
        self.log = log if log is not None else WriteAheadLog.memory(self.lineage, snapshot_seq(dataset))
        self.seq = snapshot_seq(dataset)
        self.live_ids = LiveIds(dataset.ad_ids)  # the live ads at the log's end, which update calls are checked against
        self.journal = UpdateJournal(self.log, seed=dataset.seed, dim=model.D, formats=model.F, limits=limits,
                                     gate=self.gate)
        self._apply_timeout_s: float | None = None  # the replay waits for workers still building
        self.replayed = self.journal.replay(self._apply, self.live_ids.__contains__)  # into every worker
        pool.wait_ready()
        self._apply_timeout_s = limits.deadline_s  # from here a worker that does not apply in time is a failure
        self._schema_bytes: tuple[pa.Schema, bytes] | None = None  # the last request schema, serialized
        self._meta: tuple[int | None, object] = (None, None)  # the last answer metadata, by seq
        super().__init__(location, seed=dataset.seed, experts=model.E, width=model.S, limits=limits, guard=guard)

    @property
    def device(self) -> str | None:
        return self.engines.device

    # --- updates ---------------------------------------------------------------------------------------
    def _apply(self, items) -> int:
        """A slice of logged (record, update) pairs to every worker, whole; then the front's live ids."""
        self.engines.apply([[record.seq, record.update] for record, _ in items], self._apply_timeout_s)
        for _, update in items:
            if isinstance(update, Upsert):
                self.live_ids.add(update.ad.ad_id)
            elif isinstance(update, Retire):
                self.live_ids.remove(update.ad_id)
        self.seq = items[-1][0].seq
        return len(items)

    def apply_updates(self, body: bytes, started: float) -> dict:
        ack = self.journal.submit(body, live=self.live_ids.__contains__, apply=self._apply)
        self.stats.add(updates=ack["applied"])
        return ack

    def current_seq(self) -> int:
        return self.seq

    def retrieve_endpoints(self) -> list[str]:
        """The live fronts' servers (`--fronts`), or else the live workers' own (`--endpoints`), in order;
        none without them."""
        pool = self.engines
        listed = [w for w in pool.fronts if w.ended is None] if pool.fronts else pool.live()
        return [w.info["endpoint"] for w in listed if w.info and w.info.get("endpoint")]

    # --- requests --------------------------------------------------------------------------------------
    def _schema_of(self, batch: pa.RecordBatch) -> bytes:
        schema = batch.schema
        cached = self._schema_bytes
        if cached is not None and (cached[0] is schema or cached[0].equals(schema)):
            return cached[1]
        data = schema.serialize().to_pybytes()
        self._schema_bytes = (schema, data)
        return data

    def serve_batch(self, batch, times=None):
        """Hand the batch as it came to a worker, and its answer batch back: the whole of the front's
        Python for a request (the worker decodes, runs and encodes)."""
        size = batch_bytes(batch)
        try:
            schema = self._schema_of(batch)
            body = batch.serialize()
            worker = self.engines.pick()
            if times is not None:
                times["queued"] = time.perf_counter()
            msg = worker.request(schema, body, self.limits.deadline_s,
                                 "request batch (the server's deadline, --deadline)")
        except BaseException:
            self.stats.add(bytes_in=size)
            raise
        _, seq, taken, answered, data = ch.split_answer(msg)
        out = pa.ipc.read_record_batch(pa.py_buffer(data), ANSWER_SCHEMA)
        if times is not None:
            times["taken"], times["answered"], times["woke"] = taken, answered, time.perf_counter()
        self.stats.add(bytes_in=size, requests=batch.num_rows, batches=1, bytes_out=out.num_rows * ANSWER_ROW_BYTES)
        meta = self._meta
        if meta[0] != seq:  # one metadata buffer per update state, not one per answer
            meta = self._meta = (seq, answer_metadata(seq))
        return out, meta[1]

    # --- health and stats ------------------------------------------------------------------------------
    def health_state(self) -> tuple[str, list[str]]:
        reasons = []
        if self.journal.failed is not None:
            reasons.append(f"update calls are refused: {self.journal.failed}")
        for state in self.engines.states():
            if not state["alive"]:
                reasons.append(f"{state['name']} has ended ({self._ended(state)}): requests go to the "
                               f"{len(self.engines.live())} engine worker(s) left; restart the server to serve "
                               "with all")
            elif "error" in state:
                reasons.append(f"{state['name']}: {state['error']}")
        for state in self.engines.states(fronts=True):
            if not state["alive"]:
                reasons.append(f"{state['name']} has ended ({self._ended(state)}): its clients turn to this "
                               "server; restart the server to serve with it")
            elif "error" in state:
                reasons.append(f"{state['name']}: {state['error']}")
        return ("degraded", reasons) if reasons else ("ok", [])

    def _ended(self, state: dict) -> str:
        worker = next((w for w in self.engines.workers + self.engines.fronts if w.name == state["name"]), None)
        return worker.ended if worker is not None else "ended"

    def health_info(self) -> dict:
        states = self.engines.states()
        first = next((s for s in states if "engine" in s), {})
        engines = [{k: v for k, v in s.items() if k != "batching"} for s in states]
        fronts = [{k: v for k, v in s.items() if k != "batching"} for s in self.engines.states(fronts=True)]
        return {**first.get("engine", {"device": self.device}), "engines": engines,
                **({"fronts": fronts} if fronts else {}), "fingerprint": self.fingerprint,
                "lineage": self.lineage, "log": self.log.describe(), "replayed": self.replayed}

    def extra_stats(self) -> dict:
        states = self.engines.states()
        batching = [s.get("batching") or {} for s in states]
        device = [s.get("device_seconds") for s in states]
        summed = {key: sum(b.get(key, 0) for b in batching) for key in ("batches", "calls", "requests")}
        front_states = self.engines.states(fronts=True) if self.engines.fronts else []
        fronts = [s.get("batching") or {} for s in front_states]
        return {"engines": len(self.engines), "batching": {**summed, "per_engine": batching},
                # the CPU seconds of the engine workers' processes, and of the fronts', so far
                "engine_cpu_s": sum(s.get("cpu_s", 0.0) for s in states),
                **({"fronts": len(fronts), "front_batching": fronts,
                    "front_cpu_s": sum(s.get("cpu_s", 0.0) for s in front_states)} if fronts else {}),
                "call_path": self.call_path.snapshot(),
                "device_seconds": None if all(d is None for d in device) else sum(d or 0.0 for d in device)}

    # --- the end ---------------------------------------------------------------------------------------
    def close_resources(self) -> None:
        self.engines.close()
        self.log.close()

    def release_for_exit(self) -> None:
        self.engines.kill()


def start_pooled_server(dataset, location: str, *, module: str, config: dict, engines: int, log=None, limits=None,
                        guard=None, say=None, fronts: int = 0, front_endpoint: dict | None = None
                        ) -> PooledEngineServer:
    """The workers started (each loads `config["data"]` and builds its engine, all at once), and the
    `fronts` front processes beside them (`EnginePool`), the log replayed into the workers, and the
    front listening at `location`; the workers are stopped if it fails."""
    pool = EnginePool(module, {**config, "limits": (limits or DEFAULT_LIMITS).to_json()}, engines, say=say,
                      fronts=fronts, front_endpoint=front_endpoint)
    try:
        return PooledEngineServer(pool, dataset, location, log=log, limits=limits, guard=guard)
    except BaseException:
        pool.close(wait_s=1.0)
        raise


__all__ = ["EnginePool", "LiveIds", "EngineWorkerProcess", "PooledEngineServer", "start_pooled_server"]
