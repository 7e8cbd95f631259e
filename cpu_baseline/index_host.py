"""The index host of the remote-scoring architecture: match on the CPU, score remotely, top-K on the CPU.

It serves the same `["retrieve"]` exchange as the co-located server (`serving.protocol`), so
clients cannot tell the two apart except by speed. Per batch of client requests:

1. match every request on the `CpuTargetingIndex` (a thread per core);
2. compute each request's user side (U, Q, gamma, beta; `andromeda_nb.model.user_side`) and ship
   it with the candidate ad ids to the scoring service in one `["score", SEQ]` exchange (one record
   batch per request, lock-step), with a deadline of `scorer_timeout_s`; SEQ is the update the
   index is at, and the scoring service refuses to score at any other;
3. top-K of the returned float32 scores on the CPU (score descending, ties by ad id ascending;
   `andromeda_nb.reference.reference_topk`).

**Only this host updates its scoring service**: every record it delivers names its log's lineage
and the call is signed with the pair's secret (`scorer_secret`; `serving.guard.sign_records`), or
presents the admin token (`scorer_credentials`); the scoring service refuses anything else, and
this host's `health` repeats what it refused (`scorer_refused`).

**One order of updates for both services.** The index host owns the update stream and its
write-ahead log (`serving.durable`, `serving.wal`): an `update` call is checked against
the live ads, its accepted updates are numbered and logged on disk, and the call is acknowledged.
Each slice of them is then delivered to the scoring service (its `update` action takes the log's
records and skips any it already holds) and only after that applied to the index, both under the
write side of a readers-writer lock: no retrieval sees one service updated and not the other, and
the two apply the same sequence. When the scoring service cannot take a slice (down, too slow) the
updates stay logged and *pending*: `health` says degraded, every retrieval first tries to deliver
them and fails (unavailable) while it cannot, and a monitor thread delivers them as soon as the
service answers again. So a retrieval that succeeds after an acknowledgement always reflects it.

**Catching up.** A scoring service that restarted comes back at its snapshot's sequence number; the
monitor (and any retrieval, through the `stale:` refusal) sees it behind and re-delivers every
record after its number from the log before scoring resumes. A restarted index host replays its
log into the index and brings the scoring service up to the same number before it listens.
`health` reports `degraded` with the reasons while the scoring service is unreachable, behind,
ahead, or holds another corpus.
"""

from __future__ import annotations

import threading

import numpy as np
import pyarrow.flight as flight

from andromeda_nb.model import user_side
from andromeda_nb.reference import reference_topk
from serving.durable import JournaledServer, ReadGate, UpdateJournal
from serving.limits import DEFAULT_LIMITS
from serving.protocol import RetrieveServer
from serving.wal import LogError, WriteAheadLog, corpus_lineage, snapshot_seq

from .index import CpuTargetingIndex
from .scoring_service import ScorerBehind, ScorerClient, fingerprint, user_side_bytes

DEFAULT_SCORER_TIMEOUT_S = 10.0
MONITOR_INTERVAL_S = 0.5  # how often the index host looks at its scoring service


class ReadWriteLock:
    """Many readers or one writer; a waiting writer blocks new readers."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._waiting_writers = 0

    def acquire_read(self):
        with self._cond:
            while self._writer or self._waiting_writers:
                self._cond.wait()
            self._readers += 1

    def release_read(self):
        with self._cond:
            self._readers -= 1
            if not self._readers:
                self._cond.notify_all()

    def acquire_write(self):
        with self._cond:
            self._waiting_writers += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._waiting_writers -= 1
            self._writer = True

    def release_write(self):
        with self._cond:
            self._writer = False
            self._cond.notify_all()


top_k = reference_topk  # the k best, score descending, ties by ad id ascending: one rule for every path


class IndexHostServer(JournaledServer, RetrieveServer):
    name = "index-host"

    def __init__(self, dataset, scorer_location: str, location: str = "grpc://127.0.0.1:0", *,
                 scorer_timeout_s: float = DEFAULT_SCORER_TIMEOUT_S, threads: int | None = None,
                 check_scorer: bool = True, log: WriteAheadLog | None = None, limits=None, guard=None,
                 scorer_credentials=None, data_dir=None, monitor_s: float = MONITOR_INTERVAL_S,
                 scorer_secret: str | None = None, **kwargs):
        model = dataset.model
        limits = self.limits = limits or DEFAULT_LIMITS  # catching the scorer up below reads them
        self.model = model
        self.dim, self.formats = model.D, model.F
        self.index = CpuTargetingIndex.from_compiled(dataset.compiled, threads=threads)  # no ad parsed
        if dataset.requests:
            self.index.match(dataset.requests[:1])  # compile / load the match kernel now
        self.corpus_fingerprint = fingerprint(dataset.ad_ids)
        self.lineage = corpus_lineage(dataset)
        self.data_dir = data_dir if data_dir is not None else getattr(dataset, "source_dir", None)
        self.scorer = ScorerClient(scorer_location, timeout_s=scorer_timeout_s, credentials=scorer_credentials,
                                   pair_secret=scorer_secret, lineage=self.lineage)
        self.scorer_location = scorer_location
        self._rw = ReadWriteLock()
        self._count_lock = threading.Lock()
        self.candidates = 0
        self.gate = ReadGate()
        self.log = log if log is not None else WriteAheadLog.memory(self.lineage, snapshot_seq(dataset))
        self.journal = UpdateJournal(self.log, seed=dataset.seed, dim=model.D, formats=model.F, limits=limits,
                                     gate=self.gate)
        self.index_seq = snapshot_seq(dataset)  # the last update applied to the index
        self._pending: list = []  # (record, update) logged but not yet applied to the index, in order
        self._scorer_seq: int | None = None  # the scoring service's, as last seen (None: unknown)
        self._scorer_problem: str | None = None  # why the scoring service cannot be used now
        self._scorer_refused: dict | None = None  # update calls the scoring service refused, as its health says
        self.replayed = self.journal.replay(self._apply_to_index, self.index.__contains__)
        self.scorer_health = None
        if check_scorer:  # the same corpus, and brought up to the log before anyone is served
            self.scorer_health = self.scorer.action("health")
            self._check_scorer(self.scorer_health)
            self._scorer_seq = int(self.scorer_health.get("seq", 0))
            self._rw.acquire_write()
            try:
                self._catch_up()
            except LogError as exc:
                raise RuntimeError(f"scoring service at {scorer_location}: {exc}") from None
            finally:
                self._rw.release_write()
        super().__init__(location, seed=dataset.seed, experts=model.E, width=model.S, limits=limits, guard=guard,
                         **kwargs)
        self._monitor_stop = threading.Event()
        self._monitor = None
        if check_scorer and monitor_s > 0:
            self._monitor = threading.Thread(target=self._watch_scorer, args=(monitor_s,), name="scorer-monitor",
                                             daemon=True)
            self._monitor.start()

    def _check_scorer(self, health: dict) -> None:
        want = {"D": self.model.D, "E": self.model.E, "F": self.model.F, "top_k": self.model.top_k}
        got = {k: health.get(k) for k in want}
        if got != want:
            raise RuntimeError(f"scoring service at {self.scorer_location} has model sizes {got}, "
                               f"this index host {want}")
        if health.get("lineage", health.get("fingerprint")) != self.lineage:
            raise RuntimeError(f"scoring service at {self.scorer_location} holds a different corpus "
                               f"(lineage {health.get('lineage')}, fingerprint {health.get('fingerprint')}; "
                               f"expected lineage {self.lineage}, fingerprint {self.corpus_fingerprint})")
        if isinstance(health.get("max_request_bytes"), int):  # longer candidate lists go in pieces within it
            self.scorer.max_batch_bytes = health["max_request_bytes"]

    # --- keeping both services on one sequence ------------------------------------------------------
    def _apply_to_index(self, items) -> None:
        apply_many = getattr(self.index, "apply_many", None)
        if apply_many is not None:  # a run of upserts compiled and stored at once
            apply_many([update for _, update in items])
        else:
            for record, update in items:
                self.index.apply(update)
        self.index.refresh()  # the slice's cost is paid here, not by the next request
        self.index_seq = items[-1][0].seq

    def _target(self) -> int:
        return self._pending[-1][0].seq if self._pending else self.index_seq

    def _deliver(self, target: int) -> None:
        """Bring the scoring service to `target` (caller holds the write lock)."""
        for attempt in (0, 1):
            try:
                if self._scorer_seq is None:
                    self._scorer_seq = int(self.scorer.action("health").get("seq", 0))
                have = self._scorer_seq
                if have > self.log.last_seq:
                    raise RuntimeError(f"the scoring service is at update {have}, past this index host's log "
                                       f"({self.log.last_seq}): it holds updates this host never logged")
                if have >= target:
                    return
                if self._pending and self.index_seq <= have and self._pending[0][0].seq <= have + 1:
                    records = [r for r, _ in self._pending if r.seq > have]  # the usual case: what was just logged
                else:
                    records = [r for r in self.log.records_after(have) if r.seq <= target]
                step = self.limits.update_slice
                for lo in range(0, len(records), step):
                    self._scorer_seq = None  # unknown until the service answers
                    self._scorer_seq = self.scorer.deliver(records[lo : lo + step])
                return
            except flight.FlightInternalError:
                self._scorer_seq = None  # refused (it restarted meanwhile): ask again, once
                if attempt:
                    raise

    def _catch_up(self) -> None:
        """Both services at the log's last delivered-or-pending update (caller holds the write lock).
        Raises a Flight error when the scoring service cannot be reached; pending updates stay."""
        try:
            self._deliver(self._target())
        except (flight.FlightError, RuntimeError, LogError) as exc:
            text = str(exc).split(". Detail:")[0]
            self._scorer_problem = text if "scoring service at" in text else \
                f"scoring service at {self.scorer_location}: {text}"
            raise
        if self._pending:
            self._apply_to_index(self._pending)
            self._pending = []
        self._scorer_problem = None

    def _apply(self, items) -> None:
        """The journal's apply: a logged slice goes to the scoring service, then to the index."""
        self._rw.acquire_write()
        try:
            self._pending.extend(items)
            try:
                self._catch_up()
            except (flight.FlightError, RuntimeError, LogError):
                pass  # logged and acknowledged; delivered when the service answers (health says degraded)
        finally:
            self._rw.release_write()

    def _ensure_caught_up(self, recheck: bool = False) -> None:
        """Bring both services to the log's end before a retrieval. `recheck` (the monitor saw the
        scoring service at another number): forget its number and ask again here, under the write
        lock, where no delivery is under way; the monitor's own health call may be older than a
        delivery made since, and its number is never published."""
        self._rw.acquire_write()
        try:
            if recheck:
                self._scorer_seq = None
            if self._pending or self._scorer_problem or self._scorer_seq != self.index_seq:
                try:
                    self._catch_up()
                except (flight.FlightError, RuntimeError, LogError) as exc:
                    waiting = f"; {len(self._pending)} logged updates wait for it" if self._pending else ""
                    raise flight.FlightUnavailableError(f"{self._scorer_problem or exc}{waiting}") from None
        finally:
            self._rw.release_write()

    def _watch_scorer(self, interval_s: float) -> None:
        while not self._monitor_stop.wait(interval_s):
            try:
                health = self.scorer.action("health", timeout_s=min(2.0, self.scorer.timeout_s))
            except Exception as exc:  # whatever it is, the monitor goes on (it is what catches the scorer up)
                self._scorer_problem = (f"scoring service at {self.scorer_location} is unreachable "
                                        f"({str(exc).split('. Detail:')[0]})")
                self._scorer_seq = None
                continue
            self._scorer_refused = health.get("refused")  # records not from this host, or of another log
            try:
                self._check_scorer(health)
            except RuntimeError as exc:
                self._scorer_problem = str(exc)
                continue
            seq = int(health.get("seq", 0))
            if seq != self.index_seq or self._pending or self._scorer_problem:
                try:
                    self._ensure_caught_up(recheck=True)
                except Exception:  # said by health (`_scorer_problem`); the next round tries again
                    pass

    # --- retrieval -------------------------------------------------------------------------------------
    def retrieve_at(self, requests, ks):
        if self._pending or self._scorer_problem:
            self._ensure_caught_up()
        for attempt in (0, 1):
            behind = False
            self._rw.acquire_read()
            try:
                seq = self.index_seq
                matched = self.index.match(requests)
                work, positions = [], []
                for i, (request, ids) in enumerate(zip(requests, matched)):
                    if len(ids):
                        side = user_side(self.model, request).float32()
                        work.append((ids, user_side_bytes(side["U"], side["Q"], side["gamma"], side["beta"])))
                        positions.append(i)
                try:
                    scores = self.scorer.score(work, seq=seq)
                except ScorerBehind:  # it restarted, or took updates the index has not: catch up, once
                    behind = True
                    self._scorer_seq = None
                except (flight.FlightUnavailableError, flight.FlightTimedOutError) as exc:
                    self._scorer_problem = str(exc).split(". Detail:")[0]  # health says so at once
                    self._scorer_seq = None
                    raise
            finally:
                self._rw.release_read()
            if not behind:
                break
            if attempt:
                raise flight.FlightUnavailableError(
                    f"scoring service at {self.scorer_location} keeps disagreeing on the update sequence")
            self._ensure_caught_up()
        answers = [(np.empty(0, np.int64), np.empty(0, np.float32))] * len(requests)
        n_candidates = 0
        for i, s in zip(positions, scores):
            ids = matched[i]
            answers[i] = top_k(ids, s, ks[i])
            n_candidates += len(ids)
        with self._count_lock:
            self.candidates += n_candidates
        return answers, seq

    def retrieve(self, requests, ks):
        return self.retrieve_at(requests, ks)[0]

    def current_seq(self) -> int:
        return self.index_seq

    # --- updates ---------------------------------------------------------------------------------------
    def _live(self, ad_id: int) -> bool:
        """Live at the log's end: the last pending update of the ad decides, else the index."""
        for record, update in reversed(self._pending):
            touched = getattr(update, "ad", None)
            if (touched.ad_id if touched is not None else update.ad_id) == ad_id:
                return type(update).__name__ != "Retire"
        return ad_id in self.index

    def apply_updates(self, body: bytes, started: float) -> dict:
        ack = self.journal.submit(body, live=self._live, apply=self._apply)
        self.stats.add(updates=ack["applied"])
        if self._pending:
            ack["pending"] = len(self._pending)
            ack["warning"] = (f"{self._scorer_problem or 'the scoring service has not taken them yet'}: the updates "
                              "are logged and will be applied before the next retrieval is answered")
        return ack

    # --- reporting -------------------------------------------------------------------------------------
    def health_state(self) -> tuple[str, list[str]]:
        reasons = []
        if self.journal.failed is not None:
            reasons.append(f"update calls are refused: {self.journal.failed}")
        if self._scorer_problem:
            reasons.append(self._scorer_problem)
        if self._pending:
            reasons.append(f"{len(self._pending)} logged updates wait for the scoring service")
        elif self._scorer_seq is not None and self._scorer_seq != self.index_seq:
            reasons.append(f"the scoring service is at update {self._scorer_seq}, the index at {self.index_seq}")
        return ("degraded" if reasons else "ok"), reasons

    def health_info(self) -> dict:
        return {"ads": len(self.index), "scorer": self.scorer_location, "fingerprint": self.corpus_fingerprint,
                "lineage": self.lineage, "scorer_seq": self._scorer_seq, "pending": len(self._pending),
                "log": self.log.describe(), "replayed": self.replayed,
                **({"scorer_refused": self._scorer_refused} if self._scorer_refused else {})}

    def extra_stats(self) -> dict:
        return {"candidates": self.candidates, "scorer_calls": self.scorer.calls, "index": self.index.describe()}

    def handle_action(self, name: str, body: bytes):
        if name == "scorer-stats":
            return self.scorer.action("stats")
        return None

    def action_names(self) -> list[str]:
        return super().action_names() + ["scorer-stats"]

    def close_resources(self) -> None:
        self._monitor_stop.set()
        if self._monitor is not None:
            self._monitor.join(5.0)
        self.index.close()
        self.scorer.close()
        self.log.close()

    def shutdown(self) -> None:
        self._monitor_stop.set()
        super().shutdown()


__all__ = ["IndexHostServer", "ReadWriteLock", "top_k"]
