"""Which table row holds which ad: the id <-> row map every embedding store keeps.

A store of per-ad arrays (embeddings, scales, formats) keeps ads in rows; updates create, replace
and retire ads while it serves, so rows are reused and the table grows. `RowMap` is that
bookkeeping, written once for the reference retriever, the co-located CPU path and the remote
scoring service:

* rows start as the corpus order (row i holds `ad_ids[i]`);
* `assign(ad_id)` gives an ad its existing row, else a freed one (last freed first), else a new one
  at the end (`n_rows` grows: the caller grows its arrays to match);
* `release(ad_id)` frees the row of a retired ad;
* `rows_of(ad_ids)` turns a whole candidate list into rows at once. The lookup is a numba typed
  dict walked in compiled code, so a service that is sent ad ids pays for the indirection but not
  for a Python loop: about 8 ms for 59,496 ids in a map of a million on the 2-core development
  machine (`scripts/time_host_side.py`, docs/results/probes/host_side_cpu.json).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.typed import Dict

from . import jitcache

jitcache.install()  # cached code is recompiled when any project source changes

FREE = -1  # ad id of a row that holds no ad


@njit(cache=True)
def _fill(table, ad_ids, first_row):
    """Insert ad_ids[i] -> first_row + i; returns the index of the first id already present, or -1."""
    for i in range(ad_ids.shape[0]):
        if ad_ids[i] in table:
            return i
        table[ad_ids[i]] = first_row + i
    return -1


@njit(cache=True)
def _lookup(table, ad_ids, out):
    """out[i] = row of ad_ids[i]; returns the index of the first unknown id, or -1."""
    for i in range(ad_ids.shape[0]):
        row = table.get(ad_ids[i], -1)
        if row < 0:
            return i
        out[i] = row
    return -1


def fit_rows(array: np.ndarray, n_rows: int, fill=0) -> np.ndarray:
    """`array` (rows first) with at least `n_rows` rows: itself when long enough, else a copy grown
    to twice its length or more (amortized O(1) per new row), the new rows set to `fill`."""
    if len(array) >= n_rows:
        return array
    grown = np.full((max(n_rows, 2 * len(array), 16), *array.shape[1:]), fill, array.dtype)
    grown[: len(array)] = array
    return grown


class RowMap:
    """Ad id <-> row of a per-ad table, with reuse of freed rows. `ad_ids`: int64 (N,), row i's ad."""

    def __init__(self, ad_ids):
        ad_ids = np.ascontiguousarray(ad_ids, np.int64)
        self._table = Dict.empty(types.int64, types.int64)
        dup = _fill(self._table, ad_ids, 0)
        if dup >= 0:
            raise ValueError(f"duplicate ad id {int(ad_ids[dup])} (rows {int(self._table[ad_ids[dup]])} "
                             f"and {dup})")
        self._row_ad = ad_ids.copy()
        self._n_rows = len(ad_ids)
        self._free: list[int] = []

    # --- reading -----------------------------------------------------------------------------------
    @property
    def n_rows(self) -> int:
        """Rows in use or freed: the length a caller's per-row arrays must have at least."""
        return self._n_rows

    @property
    def row_ad(self) -> np.ndarray:
        """int64 (n_rows,): the ad id of each row, FREE (-1) where the row holds none (a view)."""
        return self._row_ad[: self._n_rows]

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, ad_id) -> bool:
        return int(ad_id) in self._table

    def row_of(self, ad_id) -> int | None:
        """The row of a live ad, or None."""
        row = self._table.get(int(ad_id), -1)
        return None if row < 0 else int(row)

    def rows_of(self, ad_ids) -> np.ndarray:
        """int64 rows of live ad ids, in the order given; KeyError names the first id that is not live."""
        ad_ids = np.ascontiguousarray(ad_ids, np.int64)
        if not ad_ids.flags.writeable:  # e.g. a zero-copy Arrow column: one compiled lookup for all
            ad_ids = ad_ids.copy()
        out = np.empty(len(ad_ids), np.int64)
        missing = _lookup(self._table, ad_ids, out)
        if missing >= 0:
            raise KeyError(f"ad {int(ad_ids[missing])} is not live")
        return out

    # --- changing ----------------------------------------------------------------------------------
    def assign(self, ad_id) -> tuple[int, bool]:
        """(row, new): the ad's row, taking a freed row or a new one at the end when it has none.
        `new` says the row was not the ad's before (its old contents belong to nobody)."""
        ad_id = int(ad_id)
        if ad_id < 0:
            raise ValueError(f"ad id {ad_id} is negative")
        if ad_id in self._table:
            return int(self._table[ad_id]), False
        if self._free:
            row = self._free.pop()
        else:
            row = self._n_rows
            self._n_rows += 1
            self._row_ad = fit_rows(self._row_ad, self._n_rows, FREE)
        self._table[ad_id] = row
        self._row_ad[row] = ad_id
        return row, True

    def release(self, ad_id) -> int:
        """Free the row of a live ad and return it; KeyError when the ad is not live."""
        ad_id = int(ad_id)
        if ad_id not in self._table:
            raise KeyError(f"ad {ad_id} is not live")
        row = int(self._table.pop(ad_id))
        self._row_ad[row] = FREE
        self._free.append(row)
        return row


def copy_rows(dst: np.ndarray, dst_rows: np.ndarray, src: np.ndarray, src_rows: np.ndarray) -> None:
    """dst[dst_rows] = src[src_rows] for 2-D arrays of one dtype, byte for byte, without the gathered
    temporary numpy makes (a gigabyte of embeddings for 10M ads) and over every core (`prange`).
    `dst_rows` must be distinct (as slots are): rows are written in no set order."""
    if (dst.dtype != src.dtype or dst.ndim != 2 or src.ndim != 2 or dst.shape[1] != src.shape[1]
            or not dst.flags.c_contiguous or not src.flags.c_contiguous or len(dst_rows) != len(src_rows)):
        dst[dst_rows] = src[src_rows]
        return
    dst_rows, src_rows = np.asarray(dst_rows, np.int64), np.asarray(src_rows, np.int64)
    for at, n in ((dst_rows, len(dst)), (src_rows, len(src))):
        if len(at) and (at.min() < -n or at.max() >= n):
            raise IndexError(f"row {int(at.min()) if at.min() < -n else int(at.max())} of {n} rows")
    width = dst.shape[1] * dst.dtype.itemsize
    _copy_rows(dst.view(np.uint8).reshape(len(dst), width), np.where(dst_rows < 0, dst_rows + len(dst), dst_rows),
               src.view(np.uint8).reshape(len(src), width), np.where(src_rows < 0, src_rows + len(src), src_rows))


@njit(cache=True, parallel=True)
def _copy_rows(dst, dst_rows, src, src_rows):
    """dst[dst_rows[j]] = src[src_rows[j]] for every j (uint8 matrices of one width; rows in range)."""
    for j in prange(dst_rows.shape[0]):
        d, s = dst_rows[j], src_rows[j]
        for b in range(dst.shape[1]):
            dst[d, b] = src[s, b]


def warm_up() -> None:
    """Compile now the typed-dict operations `RowMap` calls from Python (membership, lookup, insert,
    removal): numba compiles each on its first use in a process, about half a second apiece, and
    caches none of them. A server calls this before it listens, so that its first update does not
    stall every request behind it."""
    scratch = RowMap(np.array([1], np.int64))
    row, _ = scratch.assign(2)
    assert 2 in scratch and scratch.row_of(2) == row and scratch.row_of(5) is None
    scratch.release(2)
    scratch.assign(3)


__all__ = ["FREE", "RowMap", "copy_rows", "fit_rows", "warm_up"]
