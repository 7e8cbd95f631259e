"""Updates a server acknowledges only once they are on disk, applied without stalling retrieval.

`UpdateJournal.submit(body, live=..., apply=...)` is what both servers that take updates from
clients (the co-located server, the remote index host) run for an `update` call:

1. check the call against the limits (bytes, lines) before anything is decoded;
2. parse every line (`andromeda_nb.jsontext`, then DESIGN section 6's checks): a malformed line is
   rejected with its number and reason;
3. check each update against the live ads as the log's end describes them (`live`) plus the
   updates before it in the call: a status or retire for an ad that is not live is rejected;
4. append the accepted updates to the write-ahead log, numbered, and sync it once (group commit):
   from here the updates are durable, and the call will be acknowledged;
5. hand them to the server's `apply` in slices of `limits.update_slice` (a server may stop a slice
   early when a request is waiting); between two slices the journal waits (a bounded time) for the
   retrieval batches in flight (`ReadGate`), and while parsing and logging it steps aside for them
   at every line, so a large call never holds the server for long; while retrievals keep arriving
   (one within the last `ACTIVE_S`), it also pauses between slices, and every `PACE_EVERY` lines
   while parsing and logging, so that the call works at most `limits.update_cpu_share` of its time
   (`_keep_share`), leaving the cores to retrieval for the rest (docs/RELIABILITY.md has the
   figures);
6. acknowledge: `{"applied": n, "rejected": [...], "seq": last sequence number, "seconds": {"parse":
   ..., "log": ..., "apply": ...}}` (where the call's time went).

The cyclic garbage collector is paused during a call (`store.paused_gc`): the tens of thousands of
parsed objects of a large call hold no cycles, and a full collection over them stalled every request
for most of a second.

Calls from any number of clients parse at once (bodies of LARGE_BODY_BYTES or more one at a time:
parsing holds the interpreter, so taking turns costs no time in all and leaves a retrieval one
parser to compete with), each pacing itself in its own share window
(`_ShareWindow`: a window shared by every call could be reset by one call while another used it,
failing calls after their records were logged). Steps 3 to 5 run in one turn (the journal's lock)
that concurrent calls share (`_advance`): whichever call holds it takes every parsed call waiting,
checks and logs each in arrival order (each call's records one unit in the log), and applies the
logged updates in log order, slice by slice, taking the calls that arrive meanwhile between two
slices; each call is acknowledged once its own updates are applied, and the turn passes to a call
still unacknowledged. So no call waits for another's turn to end (three concurrent 50 MB calls, a
turn of 60 to 90 s each, refused the later ones), calls are checked, logged and applied in log
order, and a call is checked against the live ads at the log's end (the applied state, changed by
the logged calls not yet applied). A call that waited to be taken past the server's deadline
(counted from the end of its parse: the deadline measures waiting, and a large call's parse,
outside the turn, is not waiting; a call waits only for a slice, another call's logging, or a
compaction) fails before step 4, changing nothing. When the
server stops (`stopping`, set on SIGTERM), a call not yet logged ends at once with nothing logged
or applied (`ServerStopping`), and every logged one is acknowledged at the next slice (`"stopped"`
in the acknowledgement: the rest of it is applied by the replay of the next start): a call in
flight is either acknowledged or not applied. Should
applying a logged call fail, the journal refuses every later call (`failed`, which health reports)
instead of logging after a live state it no longer knows; a restart replays the log. `replay(apply,
live)` applies the records a
starting server finds in its log after the snapshot; `compact(data_dir)` folds the log into a new
snapshot (`serving.compaction`) and restarts the log from it.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Callable, Sequence

from andromeda_nb import jsontext
from andromeda_nb.quoting import clip
from andromeda_nb.types import Retire, TargetingError, Update, Upsert
from andromeda_nb.updates import LiveAds, Rejection, _reason, parse_update, update_answer

from .limits import DEFAULT_LIMITS, LimitExceeded, ServiceLimits
from .update_body import ChunkedBody, body_lines
from .wal import LogError, LogRecord, WriteAheadLog, corpus_writer

DEFAULT_YIELD_S = 0.05  # the longest an update call waits for retrieval batches between two slices
ACTIVE_S = 0.1  # retrievals count as arriving while one began or ended within this many seconds
MIN_PAUSE_S = 0.002  # an update call pauses for its CPU share once it owes at least this much
SHARE_WINDOW_S = 0.25  # the span over which an update call's CPU share is kept
PACE_EVERY = 16  # lines parsed or records encoded between two looks at the share
# a call's body of at least this many bytes parses only while no other such body does (`_parse_gate`):
# parsing is interpreter-bound, so large calls parsed one at a time finish in the same total time as
# all at once, and a retrieval competes for the interpreter with one parser, not one per call; a
# smaller body parses at once, so a small update never waits behind a large one's parse
LARGE_BODY_BYTES = 4 << 20
GATE_POLL_S = 0.05  # how often a large call waiting to parse looks whether the server is stopping
TURN_POLL_S = 0.02  # how often a call waiting for the turn looks whether its holder has left it


class DeadlineExceeded(TimeoutError):
    """A call that could not start its work within the server's per-call deadline."""


class ServerStopping(RuntimeError):
    """An update call the server, stopping, ended before any of it was logged (so none of it applies)."""


class ReadGate:
    """Counts the retrieval batches in flight, so that writers can step aside for them. `clock`:
    seconds, time.monotonic by default (a test passes its own to check pacing without the machine's
    speed entering)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._n = 0
        self._cond = threading.Condition()
        self._clock = clock
        self.last_read = float("-inf")  # clock() when a batch last began or ended

    @contextlib.contextmanager
    def reading(self):
        with self._cond:
            self._n += 1
            self.last_read = self._clock()
        try:
            yield
        finally:
            with self._cond:
                self._n -= 1
                self.last_read = self._clock()
                if not self._n:
                    self._cond.notify_all()

    @property
    def busy(self) -> bool:
        return self._n > 0

    @property
    def in_flight(self) -> int:
        """How many retrieval batches are being worked on now."""
        return self._n

    def active(self, within_s: float = ACTIVE_S) -> bool:
        """Whether retrieval is going on: a batch in flight, or one within the last `within_s`."""
        return self._n > 0 or self._clock() - self.last_read < within_s

    def wait_idle(self, max_wait_s: float) -> bool:
        """Wait until no batch is in flight, at most `max_wait_s`; True when idle."""
        with self._cond:
            return self._cond.wait_for(lambda: self._n == 0, timeout=max_wait_s)


class _ShareWindow:
    """One update call's window for its CPU share (`UpdateJournal._keep_share`): when it began and
    the seconds worked in it. Each call has its own: calls parse (outside the journal's lock) while
    another applies, and a window shared between them was reset by one call under another's feet."""

    __slots__ = ("start", "worked")

    def __init__(self):
        self.start: float | None = None
        self.worked = 0.0

    def close(self) -> None:
        self.start, self.worked = None, 0.0


class _Overlay:
    """Live ids as `live(ad_id)` says, changed by the updates accepted so far in one call."""

    def __init__(self, live: Callable[[int], bool]):
        self.live = live
        self.touched: dict[int, bool] = {}

    def __contains__(self, ad_id) -> bool:
        ad_id = int(ad_id)
        return self.touched[ad_id] if ad_id in self.touched else bool(self.live(ad_id))


class _CallLive(LiveAds):
    """`LiveAds` over an overlay (the same checks and messages as every other stream)."""

    def __init__(self, overlay: _Overlay):
        self.ids = overlay

    def record(self, update: Update) -> None:
        if isinstance(update, Upsert):
            self.ids.touched[update.ad.ad_id] = True
        elif isinstance(update, Retire):
            self.ids.touched[update.ad_id] = False


class _Call:
    """One update call from its parse to its acknowledgement: what the call's thread hands to the turn
    (`UpdateJournal._advance`), and what the turn hands back (`ack` or `error`, then `done`)."""

    def __init__(self, parsed, rejections, live, apply, window: _ShareWindow, t_parse: float):
        self.parsed, self.rejections = parsed, rejections
        self.live, self.apply, self.window = live, apply, window
        self.t_parse = t_parse
        self.waiting_since = t_parse
        self.state = "pending"  # -> "taken" (into the turn, to be logged) -> "logged"; or "withdrawn" (deadline)
        self.t_log = self.t_apply = None
        self.items: list = []  # (record, update) pairs, logged; None once applied
        self.n_items = self.applied = 0
        self.seq = None
        self.ack: dict | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def answer(self, now: float) -> dict:
        """The acknowledgement, once the call's updates are applied, or logged when the server stops."""
        # where the call's time went: parsing and checking, the log (written and synced), applying (from
        # its records' logging to the last of them applied, after the calls logged before it)
        seconds = {"parse": round(self.t_log - self.t_parse, 4), "log": round(self.t_apply - self.t_log, 4),
                   "apply": round(now - self.t_apply, 4)}
        ack = {**update_answer(self.n_items, self.rejections), "seq": self.seq, "seconds": seconds}
        if self.applied < self.n_items:  # the server is stopping: acknowledged as logged, the rest applied at its next start
            ack["stopped"] = (f"the server is stopping: all {self.n_items} updates are logged (durable, acknowledged); "
                              f"{self.applied} were applied before it stopped, the other {self.n_items - self.applied} "
                              "are applied when it starts again (it replays its log)")
        self.items = []
        return ack

    def finish(self, *, ack: dict | None = None, error: BaseException | None = None) -> None:
        self.ack, self.error = ack, error
        self.parsed = None
        self.done.set()


# applies a slice of (record, update) pairs in order; may return how many it applied when it stopped
# early (a request was waiting), None meaning all
Applier = Callable[[Sequence[tuple[LogRecord, Update]]], "int | None"]


class UpdateJournal:
    """The update path of one server over its `WriteAheadLog` (see the module docstring). `clock`
    and `sleep` measure and take the pauses that keep a call to its share, and `clock` the wait
    the deadline bounds (time.monotonic and time.sleep; a test passes a simulated pair, so the
    pacing and the deadline are checked exactly on any machine)."""

    def __init__(self, log: WriteAheadLog, *, seed: int, dim: int, formats: int,
                 limits: ServiceLimits = DEFAULT_LIMITS, gate: ReadGate | None = None,
                 yield_s: float = DEFAULT_YIELD_S, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.log = log
        self.seed, self.dim, self.formats = seed, dim, formats
        self.limits = limits
        self.gate = gate
        self.yield_s = yield_s
        self._clock, self._sleep = clock, sleep
        self.lock = threading.Lock()  # the turn: held by the call (or compaction) that checks, logs and applies
        self._calls_lock = threading.Lock()  # guards `_pending` and the calls' states
        self._pending: list[_Call] = []  # parsed calls waiting to be taken into the turn, in arrival order
        self._taken: collections.deque[_Call] = collections.deque()  # taken into the turn, not yet logged
        self._backlog: collections.deque[_Call] = collections.deque()  # logged, not yet applied (log order)
        self._overlay: _Overlay | None = None  # live ads at the log's end while the backlog is not empty
        self._apply_window = _ShareWindow()  # the turn's CPU share window while it applies
        self._parse_gate = threading.Lock()  # held by the one large body being parsed (LARGE_BODY_BYTES)
        # set when the server stops (SIGTERM): a call not yet logged ends with nothing applied, a logged
        # one is acknowledged at its next slice, the rest of it applied by the replay of the next start
        self.stopping = threading.Event()
        self.slices = 0  # slices applied so far (stats)
        self.paused_s = 0.0  # seconds update calls paused to keep to their share while retrievals arrived
        self._stats_lock = threading.Lock()  # paused_s is added to by calls parsing at once
        # why update calls are refused: applying logged records failed, so this process no longer
        # knows how far its live state follows its log (None: all is well)
        self.failed: str | None = None

    # --- parsing --------------------------------------------------------------------------------------
    def parse_update(self, obj) -> Update:
        return parse_update(obj, seed=self.seed, dim=self.dim, formats=self.formats)

    def _step_aside(self) -> None:
        """Between two slices of a long call: let the retrieval batches in flight finish first."""
        if self.gate is not None and self.gate.busy:
            self.gate.wait_idle(self.yield_s)
        else:
            time.sleep(0)  # let any other thread that wants the interpreter have it

    def _keep_share(self, window: "_ShareWindow", slice_s: float) -> None:
        """After a slice that took `slice_s`: while retrievals arrive, pause so that the call's time
        working stays within `limits.update_cpu_share` of the time since its share window began.
        Pauses are taken once at least MIN_PAUSE_S is owed (each one hands the interpreter over,
        which costs more than a few microseconds), and a window lasts SHARE_WINDOW_S. `window` is
        the call's own (calls parse at once, outside the lock, while another applies)."""
        share = self.limits.update_cpu_share
        if share >= 1 or self.gate is None or not self.gate.active():
            window.close()
            return
        now = self._clock()
        if window.start is None:
            window.start = now - slice_s  # began with this slice
        window.worked += slice_s
        owed = window.worked / share - (now - window.start)
        if owed >= MIN_PAUSE_S:
            pause = min(owed, self.yield_s)
            self._sleep(pause)
            with self._stats_lock:
                self.paused_s += pause
        if self._clock() - window.start >= SHARE_WINDOW_S:
            window.close()

    def _yield_to_readers(self) -> None:
        """Inside a long parse or encode loop (called per line: one attribute read when idle): a
        retrieval batch in flight gets the interpreter to itself until it is answered."""
        if self.gate is not None and self.gate.busy:
            self.gate.wait_idle(self.yield_s)

    def _pacer(self, window: "_ShareWindow", every: int = PACE_EVERY):
        """A callable for a long loop over lines or records (parsing, encoding the log's records),
        called once per item: it yields to a batch in flight at every item, and every `every` items
        keeps the call's share of the time (`_keep_share`, in the call's own `window`) as the apply
        loop does between slices, so the whole call, not only its applying, leaves the cores to
        retrieval."""
        state = {"n": 0, "t": self._clock()}

        def pace() -> None:
            self._refuse_if_stopping()
            self._yield_to_readers()
            state["n"] += 1
            if state["n"] % every == 0:
                now = self._clock()
                self._keep_share(window, now - state["t"])
                state["t"] = self._clock()  # a pause is not work

        return pace

    def _parse(self, body: "bytes | ChunkedBody", window: "_ShareWindow") -> tuple[list[tuple[int, dict, Update]], list[Rejection]]:
        limits = self.limits
        if len(body) > limits.max_update_bytes:
            raise limits.over("max_update_bytes", len(body), "update body of bytes")
        lines = list(body_lines(body))  # piece by piece: no step holds the interpreter for the whole body
        n_lines = sum(1 for raw in lines if raw.strip())
        if n_lines > limits.max_updates:
            raise limits.over("max_updates", n_lines, "update call of lines")
        parsed: list[tuple[int, dict, Update]] = []
        rejections: list[Rejection] = []
        pace = self._pacer(window)
        for line_no, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            pace()
            try:
                obj = jsontext.loads(raw, max_depth=limits.max_json_depth)
            except jsontext.JsonInputError as err:
                rejections.append(Rejection(line_no, None, f"malformed JSON: {err}"))
                continue
            try:
                parsed.append((line_no, obj, parse_update(obj, seed=self.seed, dim=self.dim, formats=self.formats,
                                                          line=line_no)))
            except TargetingError as err:
                rejections.append(Rejection(line_no, err.ad_id, _reason(err)))
        return parsed, rejections

    # --- the update call -------------------------------------------------------------------------------
    def submit(self, body: "bytes | ChunkedBody", *, live: Callable[[int], bool], apply: Applier) -> dict:
        """Run one `update` call (module docstring, steps 1-6). `live(ad_id)`: whether an ad is live
        at the log's end; `apply(items)`: apply a slice of (record, update) pairs, in order.
        The deadline counts the call's wait for its turn only: the body arrived whole before the
        call began, and its parsing (outside the turn, at once with other calls) is work, not
        waiting."""
        from andromeda_nb.store import paused_gc

        with paused_gc():  # parsed updates hold no cycles; a full collection over them would stall requests
            return self._submit(body if isinstance(body, (bytes, ChunkedBody)) else bytes(body), live, apply)

    def _submit(self, body: "bytes | ChunkedBody", live, apply: Applier) -> dict:
        window = _ShareWindow()  # this call's alone: calls parse at once, outside the lock
        t_parse = self._clock()  # the phases on the journal's clock; the deadline on time.monotonic
        self._refuse_if_failed()
        with self._parsing(len(body)):
            parsed, rejections = self._parse(body, window)
        call = _Call(parsed, rejections, live, apply, window, t_parse)
        parse_s = self._clock() - t_parse
        call.waiting_since = self._clock()  # the deadline counts from here: the wait for the turn, not the parse
        with self._calls_lock:
            self._pending.append(call)
        if not self._take_turn(call):
            waited = self._clock() - call.waiting_since
            raise DeadlineExceeded(f"the update call waited {waited:.1f} s for its turn (after {parse_s:.1f} s parsing "
                                   f"it, which does not count), past the server's deadline of "
                                   f"{self.limits.deadline_s:g} s (--deadline); nothing was applied")
        if call.error is not None:
            raise call.error
        return call.ack

    @contextlib.contextmanager
    def _parsing(self, size: int):
        """Around a call's parse: a body of LARGE_BODY_BYTES or more waits until no other such body is
        being parsed (a stopping server ends the wait, nothing logged); a smaller one goes at once. The
        wait is part of the parse, not of the deadline (which counts the wait for the turn)."""
        if size < LARGE_BODY_BYTES:
            yield
            return
        while not self._parse_gate.acquire(timeout=GATE_POLL_S):
            self._refuse_if_stopping()
        try:
            yield
        finally:
            self._parse_gate.release()

    def _take_turn(self, call: "_Call") -> bool:
        """Wait until `call` is done: taken into the turn (checked and logged) by whichever call holds
        it, or by this one once it gets the journal's lock, then applied in log order. Returns False
        when the call was still waiting to be taken at the deadline (counted from
        `call.waiting_since` on the journal's clock; it is then withdrawn, nothing of it logged), and
        raises ServerStopping when the server stops before it is taken."""
        while not call.done.is_set():
            if call.state == "pending":
                remaining = self.limits.deadline_s - (self._clock() - call.waiting_since)
                if remaining <= 0 or self.stopping.is_set():
                    with self._calls_lock:
                        if call.state == "pending":  # not taken meanwhile: withdrawn, nothing logged
                            self._pending.remove(call)
                            call.state = "withdrawn"
                    if call.state == "withdrawn":
                        self._refuse_if_stopping()
                        return False
                    continue
                wait_s = min(remaining, TURN_POLL_S)
            else:
                wait_s = TURN_POLL_S  # logged: applied in log order by whichever call holds the turn
            if self.lock.acquire(blocking=False):
                try:
                    self._advance(until=call)
                finally:
                    self.lock.release()
            else:  # the holder takes, applies and acknowledges the call meanwhile, or leaves the turn
                call.done.wait(wait_s)
        return True

    # --- the shared turn (the holder of the journal's lock runs it) ------------------------------------
    def _advance(self, until: "_Call | None") -> None:
        """With the journal's lock held: take every call waiting for the turn (check and log each, in
        the order they arrived), and apply the logged calls' updates in log order, slice by slice,
        taking calls that arrive meanwhile between two slices, until `until` is done (None: until
        nothing is waiting or logged and unapplied). So concurrent calls share one turn: none waits
        for another's to end, and each is acknowledged once its own updates are applied. When the
        server stops, every logged call is acknowledged with what was applied of it (`"stopped"`: the
        rest is applied by the replay of the next start) and every call not yet logged is ended with
        nothing of it logged."""
        while until is None or not until.done.is_set():
            self._log_waiting()
            if not self._backlog:
                return
            if self.stopping.is_set():
                self._stop_backlog()
                return
            t0 = self._clock()
            self._apply_slice()
            if self._backlog and not self.stopping.is_set():
                self._keep_share(self._apply_window, self._clock() - t0)
                self._step_aside()
            else:
                self._apply_window.close()

    def _take_waiting(self) -> None:
        """Take every call waiting for the turn into it (`_taken`, in arrival order): from here it no
        longer waits for the turn (the deadline), and it is logged after the calls taken before it."""
        if self._pending:
            with self._calls_lock:
                for call in self._pending:
                    call.state = "taken"
                self._taken.extend(self._pending)
                self._pending.clear()

    def _log_waiting(self) -> None:
        """Check and log each call waiting for the turn, in arrival order, against the live ads at the
        log's end: the applied state, changed by the logged calls not yet applied (`self._overlay`).
        Calls that arrive meanwhile are taken in as each record is logged (`_log_call`'s pacer), so
        none waits for the turn while other calls are logged."""
        while True:
            self._take_waiting()
            if not self._taken:
                return
            call = self._taken.popleft()
            try:
                self._refuse_if_stopping()
                self._refuse_if_failed()  # a call before this one may have failed while this one parsed
                if not self._backlog:  # every logged update is applied: the live ads are the applied ones
                    self._overlay = _Overlay(call.live)
                self._log_call(call)
            except BaseException as exc:
                call.finish(error=exc)

    def _log_call(self, call: "_Call") -> None:
        overlay = _Overlay(self._overlay.__contains__)  # this call's changes, kept once it is logged
        checker = _CallLive(overlay)
        accepted: list[tuple[dict, Update]] = []
        for line_no, obj, update in call.parsed:
            reason = checker.accept(update)
            if reason is not None:
                call.rejections.append(Rejection(line_no, _ad_id(update), reason))
            else:
                accepted.append((obj, update))
        call.parsed = None
        call.t_log = self._clock()
        call.window.close()
        pace = self._pacer(call.window)

        def pause():  # between two records: calls that arrive meanwhile are taken into the turn
            pace()
            self._take_waiting()

        records = self.log.append([obj for obj, _ in accepted], pause=pause)  # durable
        self._overlay.touched.update(overlay.touched)
        call.t_apply = self._clock()
        call.items = [(record, update) for record, (_, update) in zip(records, accepted)]
        call.n_items = len(call.items)
        call.seq = records[-1].seq if records else self.log.last_seq
        call.state = "logged"
        self._backlog.append(call)

    def _apply_slice(self) -> None:
        """Apply the next slice of the first logged call (a server may cut it short for a waiting
        request); a call whose updates are all applied is acknowledged. Should `apply` raise, the
        records are in the log but this process cannot say how many of them its live state holds: the
        journal refuses every later call (`failed`) rather than log records after a state it does not
        know, and every logged call not yet acknowledged fails with it; a restart replays the log and
        agrees with it again."""
        call = self._backlog[0]
        if call.applied < call.n_items:
            was = call.applied
            piece = call.items[was : was + self.limits.update_slice]
            try:
                applied = call.apply(piece)  # may stop early for a waiting request: the rest comes next
            except BaseException as exc:
                first, last = call.items[was][0].seq, self._backlog[-1].seq
                self.failed = (f"applying logged updates {first}..{last} failed ({type(exc).__name__}: "
                               f"{clip(str(exc))}); restart the server: it replays its log")
                while self._backlog:  # each logged call not yet acknowledged fails with it (an error of its own)
                    error = LogError(f"the updates were logged up to {last}, but {self.failed}")
                    error.__cause__ = exc
                    self._backlog.popleft().finish(error=error)
                return
            piece = None
            call.applied = was + (len(call.items[was : was + self.limits.update_slice]) if applied is None
                                  else max(1, applied))
            call.items[was : call.applied] = [None] * (call.applied - was)  # applied: freed a slice at a time
            self.slices += 1
        if call.applied >= call.n_items:
            self._backlog.popleft()
            call.finish(ack=call.answer(self._clock()))

    def _stop_backlog(self) -> None:
        """The server is stopping: each logged call is acknowledged as logged, with what was applied."""
        now = self._clock()
        while self._backlog:
            call = self._backlog.popleft()
            call.finish(ack=call.answer(now))

    def _refuse_if_stopping(self) -> None:
        """Before a call is logged: a stopping server ends it, nothing of it logged or applied."""
        if self.stopping.is_set():
            raise ServerStopping("the server is stopping: nothing of this update call was logged or applied; send "
                                 "it again once the server is back")

    def _refuse_if_failed(self) -> None:
        if self.failed is not None:
            raise LogError(f"update calls are refused: {self.failed}")

    # --- start and compaction --------------------------------------------------------------------------
    def replay(self, apply: Applier, live: Callable[[int], bool]) -> int:
        """Apply the log's records after the snapshot (a starting server, before it serves); each
        is checked to apply to the state before it, so a log that does not belong to the snapshot
        is refused. Returns the number replayed."""
        checker = _CallLive(_Overlay(live))
        items = []
        for record in self.log.replay():
            try:
                update = self.parse_update(record.update)
            except TargetingError as exc:
                raise LogError(f"{self.log.path}: record {record.seq} does not parse ({exc})") from None
            reason = checker.accept(update)
            if reason is not None:
                raise LogError(f"{self.log.path}: record {record.seq} cannot apply to the snapshot ({reason}); "
                               "the log does not belong to this corpus directory")
            items.append((record, update))
        step, done = max(self.limits.update_slice, 4096), 0
        while done < len(items):
            piece = items[done : done + step]
            applied = apply(piece)
            done += len(piece) if applied is None else max(1, applied)
        return len(items)

    def compact(self, data_dir) -> dict:
        """Fold the log into a new snapshot of `data_dir` and restart the log from it (updates wait
        meanwhile; retrieval goes on)."""
        from .compaction import compact

        if not self.log.durable:
            raise LogError("this server keeps its updates in memory only (--log off): there is no log to compact")
        if data_dir is None:
            raise LogError("this server's corpus was not read from a directory: there is no snapshot to write")
        with self.lock, corpus_writer(data_dir, self.log.path):  # one writer per corpus, whatever its log
            self._advance(until=None)  # the calls logged (and waiting) are applied first
            result = compact(data_dir, self.log.records_after(self.log.base_seq), lineage=self.log.lineage)
            self.log.reset(result["seq"])
        return result


def _ad_id(update: Update):
    return update.ad.ad_id if isinstance(update, Upsert) else getattr(update, "ad_id", None)


class JournaledServer:
    """What a server that takes updates through an `UpdateJournal` (`self.journal`, logging beside the
    corpus at `self.data_dir`) adds to `RetrieveServer`: the `compact` action, and a server busy while
    the journal's lock is held (shutdown lets the call finish). The co-located server and the index
    host mix it in before `RetrieveServer`."""

    def compact(self) -> dict:
        return self.journal.compact(self.data_dir)

    @property
    def busy(self) -> bool:
        return super().busy or self.journal.lock.locked()

__all__ = ["JournaledServer", "ACTIVE_S", "DEFAULT_YIELD_S", "MIN_PAUSE_S", "SHARE_WINDOW_S", "DeadlineExceeded", "LimitExceeded", "ReadGate",
           "ServerStopping", "UpdateJournal"]
