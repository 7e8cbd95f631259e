"""The co-located engine on the CPU: `andromeda_nb.interfaces.Engine` over the CPU inverted index and
the CPU scorer, the same parts the remote-scoring design runs on two hosts, here in one process.

Per request: the eligible ad ids from `cpu_baseline.index.CpuTargetingIndex`, their table rows
(`andromeda_nb.rows.RowMap`), the shipped `cpu_baseline.scorer.CpuScorer` on the request's folded
user side, top-K by the reference rule (score descending, ties by ad id ascending). Updates (DESIGN
section 6) go to the index and to the scorer's table row of the ad.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from andromeda_nb.engine import EngineBase, no_answer
from andromeda_nb.model import user_side
from andromeda_nb.reference import reference_topk
from andromeda_nb.rows import RowMap
from andromeda_nb.scoring import fold_user_side
from andromeda_nb.types import Request, Retire, Update, Upsert
from andromeda_nb.updates import upsert_runs

from .index import CpuTargetingIndex
from .scorer import CpuScorer


class CpuEngine(EngineBase):
    device = "cpu"
    # updates `apply_many` is handed at a time by a server that cuts a slice short for a waiting
    # request (serving.engine_server): a run of 4 upserts takes a fraction of a millisecond, 16 took
    # two to three on the 2-core machine, which a request arriving meanwhile waited for
    apply_run = 4

    def __init__(self, dataset, device: str = "cpu"):
        if device != "cpu":
            raise ValueError(f"the CPU engine runs on the CPU, not on {device!r}")
        super().__init__(dataset)
        self.index = CpuTargetingIndex.from_compiled(dataset.compiled)  # no ad parsed
        self.scorer = CpuScorer.from_table(dataset.embeddings, dataset.formats, self.top_e)
        self.rows = RowMap(dataset.ad_ids)

    def retrieve(self, requests: Sequence[Request], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        requests = list(requests)
        return [self._answer(request, ids, k) for request, ids in zip(requests, self.index.match(requests))]

    def _answer(self, request: Request, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        if not len(ids):
            return no_answer()
        tab = fold_user_side(user_side(self.model, request))
        return reference_topk(ids, self.scorer.score(self.rows.rows_of(ids), tab), k)

    def stages(self, request: Request, k: int) -> dict:
        """Where one request's time goes (`andromeda_nb.engine.stage_breakdown`): each stage run
        alone, in seconds, with the bytes of stored embeddings that scoring reads."""
        import time

        t0 = time.perf_counter()
        ids = self.index.match([request])[0]
        t1 = time.perf_counter()
        tab = fold_user_side(user_side(self.model, request))
        t2 = time.perf_counter()
        rows = self.rows.rows_of(ids)
        scores = self.scorer.score(rows, tab) if len(ids) else np.zeros(0, np.float32)
        t3 = time.perf_counter()
        reference_topk(ids, scores, k)
        t4 = time.perf_counter()
        per_ad = self.scorer.bytes_per_row
        return {"match": {"seconds": t1 - t0}, "user_side": {"seconds": t2 - t1},
                "scoring": {"seconds": t3 - t2, "eligible": int(len(ids)), "bytes": int(len(ids) * per_ad)},
                "topk": {"seconds": t4 - t3}}

    def prepare(self) -> None:
        """After a batch of updates: rebuild what matching needs now rather than in the next request."""
        self.index.refresh()

    def apply(self, update: Update) -> None:
        """Apply one update that `andromeda_nb.updates` already checked against the live ids."""
        stored = self.stored_row(update)
        self.index.apply(update)
        if isinstance(update, Upsert):
            row, _ = self.rows.assign(update.ad.ad_id)
            self.scorer.set_row(row, *stored, update.ad.format)
        elif isinstance(update, Retire):
            self.rows.release(update.ad_id)

    def apply_many(self, updates: Sequence[Update]) -> None:
        """Apply a slice of checked updates in order (what a server hands it between batches): each run
        of upserts of distinct ads (`andromeda_nb.updates.upsert_runs`) quantized, indexed and stored
        at once, the rest one by one; the same state as `apply` of each in turn."""
        for group in upsert_runs(updates):
            stored = self.stored_rows(group) if len(group) > 1 else None
            if stored is None:
                for update in group:
                    self.apply(update)
                continue
            self.index.apply_many(group)
            rows = [self.rows.assign(update.ad.ad_id)[0] for update in group]
            self.scorer.set_rows(rows, *stored, [update.ad.format for update in group])


__all__ = ["CpuEngine"]
