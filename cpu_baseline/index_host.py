"""The index host of the remote-scoring architecture: match on the CPU, score remotely, top-K on the CPU.

It serves the same `["retrieve"]` exchange as the co-located server (`andromeda_nb.flight`), so
clients cannot tell the two apart except by speed. Per batch of client requests:

1. match every request on the `CpuTargetingIndex` (a thread per core);
2. compute each request's user side (U, Q, gamma, beta; `andromeda_nb.model.user_side`) and ship
   it with the candidate ad ids to the scoring service in one `["score"]` exchange (one record batch
   per request, lock-step), with a deadline of `scorer_timeout_s`;
3. top-K of the returned float32 scores on the CPU (score descending, ties by ad id ascending;
   `andromeda_nb.reference.reference_topk`).

Updates (`DoAction("update")`, JSON Lines of DESIGN section 6): the index host owns the stream. It
parses it, checks each update against its live ids (rejections are reported with their line and
change nothing), applies the accepted ones to its index and forwards them to the scoring service. Updates take the write side of a readers-writer lock,
retrievals the read side, so an update acknowledged before a request starts is visible to it and
no request sees half an update.

A scoring service that is down or slower than the deadline makes the exchange fail with
`FlightUnavailableError` / `FlightTimedOutError` naming the scoring service; the index host keeps
serving.
"""

from __future__ import annotations

import threading

import numpy as np

from andromeda_nb.flight import RetrieveServer
from andromeda_nb.model import user_side
from andromeda_nb.reference import reference_topk

from .index import CpuTargetingIndex
from .scoring_service import ScorerClient, fingerprint, user_side_bytes

DEFAULT_SCORER_TIMEOUT_S = 10.0


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


class IndexHostServer(RetrieveServer):
    name = "index-host"

    def __init__(self, dataset, scorer_location: str, location: str = "grpc://127.0.0.1:0", *,
                 scorer_timeout_s: float = DEFAULT_SCORER_TIMEOUT_S, threads: int | None = None,
                 check_scorer: bool = True, **kwargs):
        model = dataset.model
        super().__init__(location, seed=dataset.seed, experts=model.E, width=model.S, **kwargs)
        self.model = model
        self.dim, self.formats = model.D, model.F
        self.index = CpuTargetingIndex.from_compiled(dataset.compiled, threads=threads)  # no ad parsed
        if dataset.requests:
            self.index.match(dataset.requests[:1])  # compile / load the match kernel now
        self.corpus_fingerprint = fingerprint(dataset.ad_ids)
        self.scorer = ScorerClient(scorer_location, timeout_s=scorer_timeout_s)
        self.scorer_location = scorer_location
        self._rw = ReadWriteLock()
        self._count_lock = threading.Lock()
        self.candidates = 0
        self.scorer_health = self.scorer.action("health") if check_scorer else None
        if self.scorer_health is not None:
            self._check_scorer(self.scorer_health)

    def _check_scorer(self, health: dict) -> None:
        want = {"D": self.model.D, "E": self.model.E, "F": self.model.F, "top_k": self.model.top_k}
        got = {k: health.get(k) for k in want}
        if got != want:
            raise RuntimeError(f"scoring service at {self.scorer_location} has model sizes {got}, "
                               f"this index host {want}")
        if health.get("fingerprint") != self.corpus_fingerprint:
            raise RuntimeError(f"scoring service at {self.scorer_location} holds a different corpus "
                               f"(fingerprint {health.get('fingerprint')}, expected {self.corpus_fingerprint})")

    # --- retrieval -------------------------------------------------------------------------------------
    def retrieve(self, requests, ks):
        self._rw.acquire_read()
        try:
            matched = self.index.match(requests)
            work, positions = [], []
            for i, (request, ids) in enumerate(zip(requests, matched)):
                if len(ids):
                    side = user_side(self.model, request).float32()
                    work.append((ids, user_side_bytes(side["U"], side["Q"], side["gamma"], side["beta"])))
                    positions.append(i)
            scores = self.scorer.score(work)
        finally:
            self._rw.release_read()
        answers = [(np.empty(0, np.int64), np.empty(0, np.float32))] * len(requests)
        n_candidates = 0
        for i, s in zip(positions, scores):
            ids = matched[i]
            answers[i] = top_k(ids, s, ks[i])
            n_candidates += len(ids)
        with self._count_lock:
            self.candidates += n_candidates
        return answers

    # --- updates ---------------------------------------------------------------------------------------
    def apply_updates(self, text: str) -> dict:
        from andromeda_nb.updates import IndexLiveIds, apply_updates, read_updates, update_answer

        lines = text.splitlines()
        updates, rejections = read_updates(lines, seed=self.seed, dim=self.dim, formats=self.formats)
        self._rw.acquire_write()
        try:
            not_live = apply_updates(updates, [self.index], IndexLiveIds(self.index))
            refused = {r.line_no for r in not_live}
            accepted = [line_no for line_no, _ in updates if line_no not in refused]
            rejections += not_live
            if accepted:  # forward the accepted lines as given (both services derive the same defaults)
                body = "\n".join(lines[n - 1].strip() for n in accepted)
                self.scorer.action("update", body.encode())
            self.stats.add(updates=len(accepted))
        finally:
            self._rw.release_write()
        return update_answer(len(accepted), rejections)

    # --- reporting -------------------------------------------------------------------------------------
    def health_info(self) -> dict:
        return {"ads": len(self.index), "scorer": self.scorer_location, "fingerprint": self.corpus_fingerprint}

    def extra_stats(self) -> dict:
        return {"candidates": self.candidates, "scorer_calls": self.scorer.calls, "index": self.index.describe()}

    def handle_action(self, name: str, body: bytes):
        if name == "scorer-stats":
            return self.scorer.action("stats")
        return None

    def action_names(self) -> list[str]:
        return super().action_names() + ["scorer-stats"]

    def close_resources(self) -> None:
        self.index.close()
        self.scorer.close()


__all__ = ["IndexHostServer", "ReadWriteLock", "top_k"]
