"""Requests of concurrent calls gathered into one engine batch.

A co-located server answers every Flight exchange on its own thread, and a client usually sends a
few requests per call; an engine on a GPU costs about the same for one request as for sixty-four
(the pool is read once per launch either way). `RequestBatcher` puts the calls that arrive together
into one batch: a caller hands over its requests and waits; one worker thread takes the first call
waiting, keeps taking calls until `max_wait_s` has passed since that first one or `max_requests` are
gathered, runs them as one batch (`run(requests, k)` at the largest k asked), and hands every caller
its own answers cut to its own k. A call alone waits at most `max_wait_s` (default 0.2 ms) longer
than it would have; with `max_wait_s=0` calls are still served one batch at a time but never wait
for company.

An error of a batch goes to every caller of that batch; the worker carries on with the next.

A server with many callers should hand over what arrived as it is (`submit_payload`): the payloads
are decoded into requests (`decode`, or `decode_many` for all the calls waiting at once; an error
there goes to that caller alone) and the worker encodes each caller's answers (`encode`, or
`encode_many` for all the calls of a batch at once), so the callers' threads only pass bytes and
wait. Every step in Python wants the interpreter lock: done on thirty-two callers' threads, each step
of each call queues for it behind the others, and the lock changes hands many times per request;
done on one thread, it is that thread's uninterrupted work (docs/BENCHMARKS.md, "The served path").

Without `decode_ahead`, a batcher given `decode_many` and `count` (a payload's number of requests,
or None for a payload to decode as it is taken) decodes the counted calls of a batch together when
the batch closes, on the worker: columnar request batches are then checked as one
(`serving.protocol.decode_request_batches`), however many calls they came in. With `decode_ahead` the payloads are decoded on a thread of their own, a stage ahead of the worker:
while a batch is on the device (the worker waits for it without the interpreter lock), the calls
that arrive meanwhile are decoded, and the next batch starts with its requests in hand. Without it
(the default) the worker decodes each call as it takes it, between batches. Around an engine with no
wait of its own the extra thread costs: the server's ceiling on a 2-core host fell by about a tenth
with it (docs/BENCHMARKS.md, "The served path").

With `overlap` (an engine that runs a batch in steps: `serving.overlap.OverlappedBatches`), a batch's
host work runs while the device answers the batch before it. While batch i is on the device the
worker waits until the device has about as much left as the host's share of a batch takes (running
estimates of both); then a call that comes starts batch i + 1 (gathered, decoded and prepared on the
host: encoding, the user side, the staging buffer), the worker waits for batch i's answers, launches
batch i + 1 and encodes batch i's answers while the device works on it. The calls that come before
then wait in the queue, so batch i + 1 holds them all: started at once, the next batch would hold
whatever came first, and small batches cost the device about what large ones do. With no call by
the end of its estimated device time a batch lands (its callers wait for nothing that has not
arrived). The worker sleeps between those points (two waits a batch, without the interpreter lock)
rather than looking at the device every few microseconds: on a 2-core host such a poll cost the
server a sixth more CPU a request. A batch the engine cannot take in steps (more requests than one
launch holds), or one that comes while the engine is wanted elsewhere (an update waiting), runs after
the one in flight has landed, as without `overlap`.

With a `turn` (an object with `acquire()` and `release()`, such as `GpuTurn`, shared by the batchers
of several engine processes on one GPU), the worker takes the turn as soon as a batch's first call
is in hand and before it gathers the rest, and gives it back as soon as the engine has answered,
before the answers are encoded: while one engine holds the GPU the others' calls wait, their
requests pile up into larger batches, and their decoding and encoding go on meanwhile in their own
processes. Without a turn, several engines' small batches share the GPU by time slices.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

DEFAULT_MAX_WAIT_S = 0.0002
DEFAULT_MAX_REQUESTS = 1024
FLIGHT_POLL_S = 0.0001  # with overlap: the shortest wait for a call while a batch is in flight


@dataclass
class _Call:
    requests: list | None
    ks: list | None
    payload: object = None
    done: threading.Event = field(default_factory=threading.Event)
    answers: list | None = None
    tag: object = None
    error: BaseException | None = None
    times: dict | None = None  # perf_counter stamps a caller asked for: queued, taken, answered, woke
    size: int | None = None  # requests in a payload left to decode when its batch closes
    on_done: Callable | None = None  # `submit_payload_async`: told (answers, error) once the call is done

    def finish(self) -> None:
        """The call is done: its caller is woken, or its `on_done` told (on the batcher's thread; an error
        there is the callback's own, reported on stderr, so the batch's other callers still hear)."""
        self.done.set()
        if self.on_done is not None:
            try:
                self.on_done(self.answers, self.error)
            except Exception as exc:  # noqa: BLE001 - the batcher goes on for everyone else
                print(f"batcher: a call's completion failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


def _kept(requests):
    """A call's requests as they are when they join with others' (`concat`: requests as arrays,
    `serving.request_columns.RequestColumns`), else as a list."""
    return requests if hasattr(requests, "concat") else list(requests)


def _joined(parts: list):
    """The requests of several calls as one sequence: joined as arrays when every call's are arrays of
    one kind (an engine takes them whole), else one list."""
    first = parts[0]
    if hasattr(first, "concat") and all(type(p) is type(first) for p in parts):
        return type(first).concat(parts)
    return [r for p in parts for r in p]


class BatcherClosed(RuntimeError):
    """The batcher was closed: no more calls are taken."""


class RequestBatcher:
    """`run(requests, k) -> (answers, tag)`: one batch on the engine, answers in request order, each
    (ids, scores) at least k long where that many are eligible; `tag` (for example the sequence number
    of the last update the batch reflects) goes back to every caller of the batch."""

    def __init__(self, run, *, max_wait_s: float = DEFAULT_MAX_WAIT_S, max_requests: int = DEFAULT_MAX_REQUESTS,
                 name: str = "request-batcher", decode=None, encode=None, encode_many=None, decode_many=None,
                 decode_ahead: bool = False, count=None, turn=None, overlap=None):
        if overlap is not None and turn is not None:
            raise ValueError("a batcher takes a GPU turn or overlaps its batches, not both")
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must not be negative, got {max_wait_s}")
        if max_requests < 1:
            raise ValueError(f"max_requests must be at least 1, got {max_requests}")
        self.run = run
        # `submit_payload`: decode(payload) -> (requests, ks); encode(requests, answers, tag) -> what the
        # caller gets back (both run on the worker)
        self.decode, self.encode = decode, encode
        # encode_many([(requests, answers), ...], tag) -> one output per call: a batch's answers encoded
        # together (optional; on an error each call is encoded alone, so only its own caller hears of it)
        self.encode_many = encode_many
        # decode_many([payload, ...]) -> one (requests, ks) or exception per payload (optional)
        self.decode_many = decode_many
        # count(payload) -> its number of requests, read without decoding it, or None: with decode_many,
        # the worker decodes a batch's counted calls together when the batch closes
        self.count = count
        # turn.acquire() / turn.release(): held from a batch's first call to the engine's answer (docstring)
        self.turn, self._holding = turn, False
        # overlap: prepare(requests, alone) -> begun, launch(begun, k) -> (launched, tag), fetch(launched) ->
        # answers, release(), takes(n) and wanted() (serving.overlap.OverlappedBatches; docstring)
        self.overlap = overlap
        self._flight = None  # with overlap: (calls, launched, tag, requests) of the batch on the device
        # with overlap, running estimates (seconds) of a batch's device time and of the host's share of the
        # next: the next batch's calls are taken once the device has about that much left (docstring)
        self._device_est = self._host_est = 0.0
        self._launched_at = 0.0
        self.turn_wait_s = 0.0  # waiting for the turn
        self.max_wait_s = float(max_wait_s)
        self.max_requests = int(max_requests)
        # queue.Queue, not SimpleQueue: the worker waits for company with a timed get, and CPython's
        # SimpleQueue.get(timeout=t) can wait past t until the next put (its C loop recomputes the
        # wait after taking a free lock with nothing queued, and a deadline passed by a microsecond
        # or more, say while the OS ran another thread, becomes a negative wait: no timeout at all).
        # A batch would then be held until another request arrived, or forever.
        self._queue: queue.Queue[_Call | None] = queue.Queue()
        self._closed = threading.Event()
        self._stats_lock = threading.Lock()
        self.batches = 0
        self.calls = 0
        self.requests = 0
        # where the worker's time goes: inside `run` (wall clock, and this thread's CPU time: the
        # difference is waiting, for a device or for the interpreter lock), gathering company for a
        # batch, and idle with nothing queued
        self.run_s = self.run_cpu_s = self.gather_s = self.idle_s = 0.0
        self.decode_s = 0.0  # decoding payloads, wherever it runs
        # payloads wait here for the decoding thread, decoded calls in `_queue` for the worker
        self._inbox: queue.Queue[_Call | None] | None = None
        self._decoder = None
        if decode is not None and decode_ahead:
            self._inbox = queue.Queue()
            self._decoder = threading.Thread(target=self._decode_ahead, name=f"{name}-decode", daemon=True)
            self._decoder.start()
        self._in_hand: list[_Call] = []  # the calls the worker has taken and not answered yet
        self._worker = threading.Thread(target=self._serve, name=name, daemon=True)
        self._worker.start()

    def submit(self, requests, ks) -> tuple[list, object]:
        """Answers for `requests` (each cut to its k of `ks`) and the tag of the batch they ran in."""
        if len(requests) != len(ks):
            raise ValueError(f"{len(requests)} requests but {len(ks)} values of k")
        if self._closed.is_set():
            raise BatcherClosed("the server is shutting down")
        if not requests:
            return [], None
        call = _Call(_kept(requests), list(ks))
        self._queue.put(call)
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.answers, call.tag

    def submit_payload(self, payload, times: dict | None = None):
        """What `encode` makes of the answers to the requests `decode` finds in `payload`, both run
        on the worker (module docstring). An error decoding `payload` is raised here, to this
        caller alone. `times`: a dict that gets the call's `time.perf_counter()` stamps: 'queued'
        (handed over), 'taken' (the worker took it), 'answered' (its answer made), 'woke' (this
        caller running again)."""
        if self.decode is None or self.encode is None:
            raise TypeError("this batcher was made without decode and encode: use submit(requests, ks)")
        if self._closed.is_set():
            raise BatcherClosed("the server is shutting down")
        call = _Call(None, None, payload, times=times)
        if times is not None:
            times["queued"] = time.perf_counter()
        (self._inbox if self._inbox is not None else self._queue).put(call)
        call.done.wait()
        if times is not None:
            times["woke"] = time.perf_counter()
        if call.error is not None:
            raise call.error
        return call.answers

    def submit_payload_async(self, payload, on_done, times: dict | None = None) -> None:
        """`submit_payload` without waiting: `on_done(answers, error)` is called once the call is done
        (on the batcher's thread; answers None when error is not), so one thread can hand over the
        calls of many callers in the order they came (`serving.engine_worker`). `times`: as
        `submit_payload`'s, without 'woke'."""
        if self.decode is None or self.encode is None:
            raise TypeError("this batcher was made without decode and encode")
        if self._closed.is_set():
            raise BatcherClosed("the server is shutting down")
        call = _Call(None, None, payload, times=times, on_done=on_done)
        if times is not None:
            times["queued"] = time.perf_counter()
        (self._inbox if self._inbox is not None else self._queue).put(call)

    def stats(self) -> dict:
        """Counts, and per batch the milliseconds the worker spent in the engine's `run` (wall clock and
        the worker thread's CPU time), gathering requests, and idle."""
        with self._stats_lock:
            per = 1e3 / max(1, self.batches)
            return {"batches": self.batches, "calls": self.calls, "requests": self.requests,
                    "max_wait_ms": self.max_wait_s * 1e3, "decode_ahead": self._decoder is not None,
                    "turn": self.turn is not None, "overlap": self.overlap is not None,
                    "per_batch_ms": {"run": self.run_s * per, "run_cpu": self.run_cpu_s * per,
                                     "gather": self.gather_s * per, "idle": self.idle_s * per,
                                     "decode": self.decode_s * per, "turn_wait": self.turn_wait_s * per}}

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop taking calls; the batch in hand finishes, calls still queued get BatcherClosed."""
        self._closed.set()
        if self._inbox is not None:  # the decoding thread passes the end on to the worker
            self._inbox.put(None)
            self._decoder.join(timeout_s)
        else:
            self._queue.put(None)
        self._worker.join(timeout_s)

    # --- the decoding thread -----------------------------------------------------------------------------
    def _decode_ahead(self) -> None:
        while True:
            calls = [self._inbox.get()]
            while True:  # everything that arrived meanwhile is decoded together
                try:
                    calls.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            ending = None in calls
            for call in self._decode_calls([c for c in calls if c is not None]):
                self._queue.put(call)
            if ending:
                break
        _refuse_waiting(self._inbox)
        self._queue.put(None)

    def _decode_calls(self, calls: list[_Call]) -> list[_Call]:
        """Decode the payloads of `calls` (together when `decode_many` is given); a call that does not
        decode, or holds no request, is answered here. Returns the calls with requests."""
        if not calls:
            return []
        t0 = time.perf_counter()
        for call in calls:
            if call.times is not None:
                call.times.setdefault("taken", t0)
        results = None
        if self.decode_many is not None and len(calls) > 1:
            try:
                results = self.decode_many([c.payload for c in calls])
            except Exception:  # noqa: BLE001 - decoded one call at a time below, each error to its caller
                results = None
        if results is None:
            results = []
            for call in calls:
                try:
                    results.append(self.decode(call.payload))
                except BaseException as exc:  # this caller's input: only this caller hears of it
                    results.append(exc)
        with self._stats_lock:
            self.decode_s += time.perf_counter() - t0
        ready = []
        for call, result in zip(calls, results):
            if isinstance(result, BaseException):
                call.error = result
                call.finish()
                continue
            call.requests, call.ks = _kept(result[0]), list(result[1])
            if not call.requests:
                call.answers = self.encode([], [], None)
                call.finish()
                continue
            ready.append(call)
        return ready

    # --- the worker ------------------------------------------------------------------------------------
    def _take(self, call: _Call) -> bool:
        """Decode a call that came as a payload (unless decoded ahead, or left for the batch's close);
        False (the caller told) when it does not decode or holds no request."""
        if call.requests is not None:
            return True
        if self._decoder is None and self.decode_many is not None and self.count is not None:
            call.size = self.count(call.payload)
            if call.size is not None:  # decoded with the batch's other calls when it closes
                if call.times is not None:
                    call.times["taken"] = time.perf_counter()
                return True
        return bool(self._decode_calls([call]))

    def _take_turn(self) -> None:
        if self.turn is not None and not self._holding:
            t = time.perf_counter()
            self.turn.acquire()
            self._holding = True
            with self._stats_lock:
                self.turn_wait_s += time.perf_counter() - t

    def _give_turn(self) -> None:
        if self._holding:
            self._holding = False
            self.turn.release()

    @staticmethod
    def _size(call: _Call) -> int:
        return len(call.requests) if call.requests is not None else call.size

    def _gather(self, first: _Call) -> list[_Call]:
        if not self._take(first):
            return []
        calls, n = [first], self._size(first)
        deadline = time.perf_counter() + self.max_wait_s
        while n < self.max_requests:
            try:
                left = deadline - time.perf_counter()
                call = self._queue.get_nowait() if left <= 0 else self._queue.get(timeout=left)
            except queue.Empty:
                break
            if call is None:  # closing: serve what is in hand, then stop
                self._queue.put(None)
                break
            self._in_hand.append(call)
            if not self._take(call):
                continue
            size = self._size(call)
            if n + size > self.max_requests and n:
                self._run([*calls])
                calls, n = [], 0
                deadline = time.perf_counter() + self.max_wait_s
            calls.append(call)
            n += size
        return calls

    def _run(self, calls: list[_Call]) -> None:
        pending = [c for c in calls if c.requests is None]
        if pending:  # decoded together now that the batch is closed; a call at fault is answered there
            self._decode_calls(pending)
            calls = [c for c in calls if not c.done.is_set()]
            if not calls:
                return
        requests = _joined([c.requests for c in calls])
        k = max(k for c in calls for k in c.ks)
        if self.overlap is not None:
            if self.overlap.takes(len(requests)) and not self.overlap.wanted():
                self._run_overlapped(calls, requests, k)
                return
            self._land()  # the engine in one piece: the batch in flight first
        self._take_turn()  # a batch run inside the gathering, after the turn was given back
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            try:
                answers, tag = self.run(requests, k)
            finally:
                self._give_turn()  # the engine has answered: the next engine may use the GPU while this encodes
                self._count_run(t0, c0)
            if len(answers) != len(requests):
                raise RuntimeError(f"the engine answered {len(answers)} of {len(requests)} requests")
        except BaseException as exc:  # every caller of the batch hears of it
            self._fail(calls, exc)
            return
        self._answer(calls, answers, tag)

    def _run_overlapped(self, calls: list[_Call], requests, k: int) -> None:
        """Batch i + 1 (`calls`) prepared on the host, then batch i (in flight) fetched, then batch i + 1
        launched, then batch i's answers encoded while the device works on batch i + 1."""
        ov = self.overlap
        t0, c0 = time.perf_counter(), time.thread_time()
        alone = self._flight is None
        try:
            begun = ov.prepare(requests, alone=alone)
        except BaseException as exc:  # this batch's callers hear of it; the batch in flight goes on
            self._count_run(t0, c0)
            self._fail(calls, exc)
            if self._flight is None:
                ov.release()
            return
        if not alone:
            self._host_est = _estimate(self._host_est, time.perf_counter() - t0)
        landed = self._fetch_flight()
        try:
            launched, tag = ov.launch(begun, k)
            self._flight = (calls, launched, tag, len(requests))
            self._launched_at = time.perf_counter()
        except BaseException as exc:
            self._fail(calls, exc)
        finally:
            self._count_run(t0, c0)
        if self._flight is None:
            ov.release()
        if landed is not None:
            self._answer(*landed)

    def _fetch_flight(self):
        """The batch in flight's (calls, answers, tag), waited for; None when there is none or it failed
        (its callers told)."""
        if self._flight is None:
            return None
        calls, launched, tag, n = self._flight
        self._flight = None
        try:
            waited = not self.overlap.ready(launched)
            answers = self.overlap.fetch(launched)
            seen = time.perf_counter() - self._launched_at  # the batch's device time, or more when done before
            if waited or seen < self._device_est:
                self._device_est = _estimate(self._device_est, seen)
            if len(answers) != n:
                raise RuntimeError(f"the engine answered {len(answers)} of {n} requests")
        except BaseException as exc:
            self._fail(calls, exc)
            return None
        return calls, answers, tag

    def _land(self) -> None:
        """The batch in flight answered, and the engine let go (with overlap; else nothing)."""
        if self.overlap is None:
            return
        t0, c0 = time.perf_counter(), time.thread_time()
        landed = self._fetch_flight()
        self.overlap.release()
        if landed is not None:
            self._count_run(t0, c0)
            self._answer(*landed)

    def _count_run(self, t0: float, c0: float) -> None:
        with self._stats_lock:
            self.run_s += time.perf_counter() - t0
            self.run_cpu_s += time.thread_time() - c0

    @staticmethod
    def _fail(calls: list[_Call], exc: BaseException) -> None:
        for c in calls:
            c.error = exc
            c.finish()

    def _answer(self, calls: list[_Call], answers, tag) -> None:
        """Every call its own answers cut to its k, encoded when it came as a payload, and woken."""
        at, cuts = 0, []
        for c in calls:
            part = answers[at : at + len(c.requests)]
            at += len(c.requests)
            cuts.append([(ids[:k], scores[:k]) for (ids, scores), k in zip(part, c.ks)])
        payload_calls = [(c, cut) for c, cut in zip(calls, cuts) if c.payload is not None]
        if self.encode_many is not None and len(payload_calls) > 1:
            try:
                outs = self.encode_many([(c.requests, cut) for c, cut in payload_calls], tag)
            except Exception:  # noqa: BLE001 - encoded one call at a time below, each error to its caller
                outs = [None] * len(payload_calls)
            for (c, _), out in zip(payload_calls, outs):
                c.answers = out
        for c, cut in zip(calls, cuts):
            if c.payload is None:
                c.answers, c.tag = cut, tag
            else:
                if c.answers is None:  # not encoded with the batch
                    try:
                        c.answers = self.encode(c.requests, cut, tag)
                    except BaseException as exc:
                        c.error = exc
                if c.times is not None:
                    c.times["answered"] = time.perf_counter()
            c.finish()
        with self._stats_lock:
            self.batches += 1
            self.calls += len(calls)
            self.requests += sum(len(c.requests) for c in calls)

    def _serve(self) -> None:
        while True:
            t0 = time.perf_counter()
            if self._flight is not None:  # a batch on the device: the next batch's host work starts beside
                # it once the device has about that much left (calls that come before then wait in the
                # queue for that batch), or it lands when its device time is up with no call waiting
                early = self._launched_at + self._device_est - self._host_est - time.perf_counter()
                if early > 0:
                    time.sleep(early)
                left = self._launched_at + self._device_est - time.perf_counter()
                try:
                    first = self._queue.get(timeout=max(FLIGHT_POLL_S, left))
                except queue.Empty:
                    self._land()
                    continue
            else:
                first = self._queue.get()
            t1 = time.perf_counter()
            if first is None:
                self._land()
                break
            ran = self.run_s
            self._in_hand = [first]
            try:
                self._take_turn()  # before gathering: the calls that come while it waits join this batch
                calls = self._gather(first)
                with self._stats_lock:
                    self.idle_s += t1 - t0
                    self.gather_s += time.perf_counter() - t1 - (self.run_s - ran)  # a full batch may run inside
                if calls:
                    self._run(calls)
            except BaseException as exc:  # a fault of the batcher's own: the callers in hand (and in flight)
                # hear of it, and the worker goes on (a dead worker would leave every caller waiting)
                flight, self._flight = self._flight, None
                for call in self._in_hand + (flight[0] if flight else []):
                    if not call.done.is_set():
                        call.error = exc
                        call.finish()
                if self.overlap is not None:
                    self.overlap.release()
            finally:
                self._give_turn()  # a batch whose calls all failed to decode never ran
            self._in_hand = []
            if self._closed.is_set():
                break
        _refuse_waiting(self._queue)


class GpuTurn:
    """A turn on the GPU shared by the processes that open the same `path`: an exclusive `flock` on
    it, taken by `acquire` (waiting without the interpreter lock) and given back by `release`. The
    file holds nothing; the first to open it makes it."""

    def __init__(self, path):
        import fcntl  # POSIX

        self.path, self._flock, self._ex, self._un = str(path), fcntl.flock, fcntl.LOCK_EX, fcntl.LOCK_UN
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)

    def acquire(self) -> None:
        self._flock(self._fd, self._ex)

    def release(self) -> None:
        self._flock(self._fd, self._un)

    def close(self) -> None:
        os.close(self._fd)


def _estimate(old: float, seen: float, weight: float = 0.2) -> float:
    """A running estimate moved `weight` of the way to what was just seen (the first sight taken whole)."""
    return seen if old == 0.0 else old + weight * (seen - old)


def _refuse_waiting(calls: queue.Queue) -> None:
    """Every call still waiting in `calls` after the close hears that the server is shutting down."""
    while True:
        try:
            call = calls.get_nowait()
        except queue.Empty:
            return
        if call is not None:
            call.error = BatcherClosed("the server is shutting down")
            call.finish()


__all__ = ["BatcherClosed", "DEFAULT_MAX_REQUESTS", "DEFAULT_MAX_WAIT_S", "GpuTurn", "RequestBatcher"]
