"""The scoring service's table on the CPU: shipped candidate lists scored by the numba scorer.

`CpuCandidateTable` keeps the service's own ad id -> row map (`andromeda_nb.rows.RowMap`) beside
`CpuScorer`'s row-major embeddings, so the scoring service sees one object with the candidate-table
interface that `gpu.candidates.GpuCandidateScorer` has too: `score_user_side(ad_ids, U, Q, gamma,
beta)` (KeyError names the first candidate that is not live), `upsert(ad_id, values, scale, fmt)`,
`retire(ad_id)`, `len()`, `in`, `n_rows`, `top_k` and `device`. Which of the two a service holds
is its `--device`.
"""

from __future__ import annotations

import numpy as np

from andromeda_nb.rows import RowMap
from andromeda_nb.rows import warm_up as warm_rows

from .scorer import CpuScorer


class CpuCandidateTable:
    device = "cpu"

    def __init__(self, table, formats, ad_ids, *, top_k: int, experts: int, n_formats: int):
        self.scorer = CpuScorer.from_table(table, formats, top_k)
        self.scorer.warm_up(experts, n_formats)
        self.rows = RowMap(ad_ids)
        warm_rows()  # the first delivered update must not compile anything
        if len(self.rows):  # compile the lookup now, not in the first request (rows are int64, as warmed)
            self.rows.rows_of(np.asarray(ad_ids[:1], np.int64))

    @classmethod
    def for_dataset(cls, dataset) -> "CpuCandidateTable":
        model = dataset.model
        return cls(dataset.embeddings, dataset.formats, dataset.ad_ids, top_k=model.top_k, experts=model.E,
                   n_formats=model.F)

    @property
    def top_k(self) -> int:
        return self.scorer.top_k

    @property
    def n_rows(self) -> int:
        return self.rows.n_rows

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, ad_id) -> bool:
        return ad_id in self.rows

    def score_user_side(self, ad_ids: np.ndarray, U, Q, gamma, beta) -> np.ndarray:
        """float32 scores, in candidate order, from the unfolded user side."""
        return self.scorer.score_user_side(self.rows.rows_of(ad_ids), U, Q, gamma, beta)

    def upsert(self, ad_id: int, values: np.ndarray, scale: float, fmt: int) -> None:
        row, _ = self.rows.assign(ad_id)
        self.scorer.set_row(row, values, scale, fmt)

    def retire(self, ad_id: int) -> None:
        self.rows.release(ad_id)


__all__ = ["CpuCandidateTable"]
