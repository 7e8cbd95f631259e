"""The remote scoring service's table on a GPU: shipped candidate lists scored on the device.

In the published 2024 design the index hosts matched targeting on CPUs and shipped every eligible
candidate to remote GPUs for scoring. `GpuCandidateScorer` is that remote GPU: the service keeps its
own row-major copy of the embeddings on the device, resolves each shipped ad id to its row there
(`gpu.kernels.gather.resolve_rows`: a binary search in a sorted id column), scores every candidate
by gathering its row (`gather.score_rows`, the shared per-ad formula), and hands the scores back in
candidate order. It has the candidate-table interface of `cpu_baseline.candidates.CpuCandidateTable`
(`score_user_side`, `upsert`, `retire`, `len`, `in`, `n_rows`, `top_k`, `device`), so the scoring
service serves either (`serve scorer --device`).

Updates: an upsert writes one row on the device (growing the table by doubling when the row is
new); the sorted id column is rebuilt from the host's `RowMap` before the next score after any
change to which ids are live.
"""

from __future__ import annotations

import threading

import numpy as np

from andromeda_nb.rows import FREE, RowMap
from andromeda_nb.scoring import fold_tables, table_experts

from . import runtime
from .kernels import gather

cuda = runtime.cuda()


class GpuCandidateScorer:
    def __init__(self, values: np.ndarray, scale: np.ndarray, formats: np.ndarray, ad_ids: np.ndarray, top_k: int):
        self.device = "sim" if runtime.simulator_enabled() else "gpu"
        self.top_k = int(top_k)
        self.dtype = np.dtype(values.dtype)
        self.D = values.shape[1]
        self.rows = RowMap(ad_ids)
        self._values = np.array(values, copy=True)
        self._scale = np.array(scale, np.float32, copy=True)
        self._formats = np.array(formats, np.int16, copy=True)
        self._lock = threading.RLock()
        self._upload()
        self._ids_dirty = True
        self._bufs: dict = {}
        self.clock = runtime.DeviceClock()  # device time of the copies in and the gather-score launches

    @property
    def device_seconds(self) -> float | None:
        """Device seconds spent scoring so far (None under the simulator)."""
        return self.clock.seconds

    @classmethod
    def from_table(cls, table, formats, ad_ids, top_k: int) -> "GpuCandidateScorer":
        """From an `andromeda_nb.model.EmbeddingTable` and the corpus's formats and ad ids."""
        return cls(table.values, table.scale, formats, ad_ids, top_k)

    @classmethod
    def for_dataset(cls, dataset) -> "GpuCandidateScorer":
        """Over a corpus's embeddings, formats and ad ids, with its model's top-k routing."""
        return cls.from_table(dataset.embeddings, dataset.formats, dataset.ad_ids, dataset.model.top_k)

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, ad_id) -> bool:
        return ad_id in self.rows

    @property
    def n_rows(self) -> int:
        return self.rows.n_rows

    @property
    def capacity(self) -> int:
        return len(self._values)

    # --- device state ----------------------------------------------------------------------------
    def _upload(self) -> None:
        self.d_values = cuda.to_device(self._values)
        self.d_scale = cuda.to_device(self._scale)
        self.d_formats = cuda.to_device(self._formats)

    def _refresh_ids(self) -> None:
        if not self._ids_dirty:
            return
        row_ad = self.rows.row_ad
        live = np.flatnonzero(row_ad != FREE).astype(np.int32)
        order = np.argsort(row_ad[live], kind="stable")
        self.d_sorted_ids = cuda.to_device(np.ascontiguousarray(row_ad[live][order], np.int64))
        self.d_sorted_rows = cuda.to_device(np.ascontiguousarray(live[order], np.int32))
        self._ids_dirty = False

    def _buffers(self, n: int):
        if self._bufs.get("n", 0) < n:
            n = max(n, 2 * self._bufs.get("n", 0), 1024)
            self._bufs = {"n": n, "ids": cuda.device_array(n, np.int64), "rows": cuda.device_array(n, np.int32),
                          "scores": cuda.device_array(n, np.float32)}
        return self._bufs

    # --- scoring ---------------------------------------------------------------------------------
    def score_ids(self, ad_ids: np.ndarray, tab: np.ndarray) -> np.ndarray:
        """float32 scores, in order, of the candidates `ad_ids` (int64) for one request's folded table
        `tab` (F, TW). KeyError names the first candidate that is not live here."""
        ad_ids = np.ascontiguousarray(ad_ids, np.int64)
        n = len(ad_ids)
        if n == 0:
            return np.empty(0, np.float32)
        tab = np.ascontiguousarray(tab, np.float32)
        E = table_experts(tab.shape[1], self.D)
        with self._lock:
            self._refresh_ids()
            b = self._buffers(n)
            ids, rows, scores = b["ids"][:n], b["rows"][:n], b["scores"][:n]
            self.clock.start()
            ids.copy_to_device(ad_ids)
            grid = gather.blocks(n)
            gather.resolve_rows[grid, gather.THREADS](self.d_sorted_ids, self.d_sorted_rows, ids, rows)
            gather.score_rows(E)[grid, gather.THREADS](self.d_values, self.d_scale, self.d_formats, rows,
                                                       cuda.to_device(tab), np.int32(self.top_k), scores)
            self.clock.stop()
            out = scores.copy_to_host()
            self.clock.settle()
        missing = np.flatnonzero(np.isnan(out))
        if len(missing):
            raise KeyError(f"ad {int(ad_ids[missing[0]])} is not live")
        return out

    def score_user_side(self, ad_ids: np.ndarray, U, Q, gamma, beta) -> np.ndarray:
        """Scores from the unfolded user side U, Q (E, D), gamma, beta (F, D)."""
        return self.score_ids(ad_ids, fold_tables(U, Q, gamma, beta))

    # --- updates ---------------------------------------------------------------------------------
    def upsert(self, ad_id: int, values: np.ndarray, scale: float, fmt: int) -> None:
        """Store one ad's stored values (this table's dtype) in its row (a new row for a new ad)."""
        with self._lock:
            row, new = self.rows.assign(ad_id)
            if row >= self.capacity:
                grow = max(row + 1, 2 * self.capacity, 16)
                self._values = np.concatenate([self._values, np.zeros((grow - self.capacity, self.D), self.dtype)])
                self._scale = np.concatenate([self._scale, np.ones(grow - len(self._scale), np.float32)])
                self._formats = np.concatenate([self._formats, np.zeros(grow - len(self._formats), np.int16)])
                grown = True
            else:
                grown = False
            self._values[row] = np.asarray(values, self.dtype)
            self._scale[row] = scale
            self._formats[row] = fmt
            if grown:
                self._upload()
            else:  # copies into views of the device arrays: no allocation, no kernel per upsert
                self.d_values[row : row + 1].copy_to_device(self._values[row : row + 1])
                self.d_scale[row : row + 1].copy_to_device(self._scale[row : row + 1])
                self.d_formats[row : row + 1].copy_to_device(self._formats[row : row + 1])
            self._ids_dirty |= new

    def retire(self, ad_id: int) -> None:
        with self._lock:
            self.rows.release(ad_id)
            self._ids_dirty = True


__all__ = ["GpuCandidateScorer"]
