"""Slot layout shared by the GPU index, the embedding table and the scoring kernel.

Every ad lives in one *slot*; eligibility, embeddings and formats are arrays indexed by slot, so the
scoring kernel reads the index's output with no id translation. Slots come in chunks of
`CHUNK_SLOTS`; every chunk holds ads of one format only, so a thread block that covers one chunk
reads one format's per-request tables (no shared-memory bank conflicts between formats).

Updates reuse slots: a retired ad's slot goes back to its format's free list; an upsert that changes
an ad's format moves it to a chunk of the new format. A caller may also name the free slot an ad
takes (`allocate(..., slot=)`: the GPU index places an upsert by its geography), helped by the count of
free slots of every chunk (`chunk_free`). Empty slots have ad id `EMPTY` (-1).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
from numba import njit

from . import jitcache

jitcache.install()  # cached code is recompiled when any project source changes

CHUNK_SLOTS = 256
EMPTY = -1


def _array(values, dtype) -> np.ndarray:
    """`values` (an array, or any iterable of numbers) as a numpy array of `dtype`."""
    return np.asarray(values if isinstance(values, np.ndarray) else list(values), dtype)


class SlotAllocator:
    def __init__(self, chunk_slots: int = CHUNK_SLOTS):
        self.chunk_slots = chunk_slots
        self.slot_ad_id = np.empty(0, np.int64)  # ad id per slot, EMPTY when free
        self.chunk_format = np.empty(0, np.int16)  # format per chunk
        self._slot_map: dict[int, int] | None = {}  # ad id -> slot; None: made from slot_ad_id on first use
        self._laid_out = 0  # ads of the layout, while _slot_map is None
        # format -> free slots (a stack; a slot taken by name stays in it until popped and passed over)
        self._free: dict[int, list[int]] = {}
        self.chunk_free = np.zeros(0, np.int32)  # free slots per chunk
        self._chunks_of: dict[int, np.ndarray] = {}  # format -> its chunks, made on demand

    # --- bulk layout -------------------------------------------------------------------------------
    @classmethod
    def from_ads(cls, ad_ids: Iterable[int], formats: Iterable[int], chunk_slots: int = CHUNK_SLOTS,
                 spare: float = 0.0, rank: np.ndarray | None = None) -> "SlotAllocator":
        """Lay ads out grouped by format: within a format in the order given, or by `rank` (one
        number per ad, lower first, ties in the order given; e.g. `geo_layout.clustered_order`).

        `spare` is the fraction of extra free slots reserved per format for later inserts.
        """
        return cls.layout(ad_ids, formats, chunk_slots, spare, rank)[0]

    @classmethod
    def layout(cls, ad_ids: Iterable[int], formats: Iterable[int], chunk_slots: int = CHUNK_SLOTS,
               spare: float = 0.0, rank: np.ndarray | None = None) -> tuple["SlotAllocator", np.ndarray]:
        """`from_ads`, and int64[N]: the position in `ad_ids` of the ad of every used slot, in slot
        order (what a caller gathers its per-ad arrays by, with no lookup by id)."""
        alloc = cls(chunk_slots)
        ad_ids = _array(ad_ids, np.int64)
        formats = _array(formats, np.int16)
        if rank is None:
            order = np.argsort(formats, kind="stable")
        else:
            rank = np.asarray(rank)
            if rank.shape != ad_ids.shape:
                raise ValueError(f"rank: one number per ad expected, got {rank.shape[0] if rank.ndim else 0} "
                                 f"for {len(ad_ids)} ads")
            order = _order_of_permutation(rank, formats)
            if order is None:
                order = np.lexsort((np.arange(len(ad_ids)), rank, formats))
        order = order.astype(np.int64, copy=False)
        ids, fmts = ad_ids[order], formats[order]  # by format, ascending
        kinds, starts, counts = _runs(fmts)
        n_chunks = np.asarray([-(-int(c * (1.0 + spare)) // chunk_slots) for c in counts.tolist()], np.int64)
        chunk_lo = np.cumsum(n_chunks) - n_chunks
        alloc.slot_ad_id = np.full(int(n_chunks.sum()) * chunk_slots, EMPTY, np.int64)
        slot = np.repeat(chunk_lo * chunk_slots - starts, counts) + np.arange(len(ids), dtype=np.int64)
        alloc.slot_ad_id[slot] = ids
        alloc.chunk_format = np.repeat(kinds, n_chunks).astype(np.int16)
        alloc._slot_map, alloc._laid_out = None, len(ids)  # the id -> slot dict is made on first use
        alloc.rebuild_free()
        return alloc, order

    def rebuild_free(self) -> None:
        """The free lists and `chunk_free` from `slot_ad_id` (after a layout was written directly);
        lower slots are taken first."""
        self._free = {}
        for s in np.flatnonzero(self.slot_ad_id == EMPTY)[::-1].tolist():
            self._free.setdefault(int(self.chunk_format[s // self.chunk_slots]), []).append(s)
        self.chunk_free = (self.slot_ad_id.reshape(-1, self.chunk_slots) == EMPTY).sum(1).astype(np.int32)
        self._chunks_of = {}

    # --- queries -----------------------------------------------------------------------------------
    @property
    def _slot_of(self):
        """ad id -> slot (a dict, or any mapping a caller set): made from `slot_ad_id` on first use after
        `layout`, so that laying out millions of ads builds no dict of them before a lookup needs it."""
        if self._slot_map is None:
            used = np.flatnonzero(self.slot_ad_id != EMPTY)
            self._slot_map = dict(zip(self.slot_ad_id[used].tolist(), used.tolist()))
        return self._slot_map

    @_slot_of.setter
    def _slot_of(self, mapping) -> None:
        self._slot_map = mapping

    @property
    def capacity(self) -> int:
        return len(self.slot_ad_id)

    def __len__(self) -> int:
        return self._laid_out if self._slot_map is None else len(self._slot_map)

    def __contains__(self, ad_id: int) -> bool:
        return ad_id in self._slot_of

    def slot_of(self, ad_id: int) -> int:
        return self._slot_of[ad_id]

    def format_of_slot(self, slot: int) -> int:
        return int(self.chunk_format[slot // self.chunk_slots])

    def chunks_of(self, fmt: int) -> np.ndarray:
        """int64: the chunks of format `fmt`, ascending."""
        chunks = self._chunks_of.get(fmt)
        if chunks is None:
            chunks = self._chunks_of[fmt] = np.flatnonzero(self.chunk_format == fmt)
        return chunks

    def slot_format(self) -> np.ndarray:
        """int16[capacity]: the format of every slot."""
        return np.repeat(self.chunk_format, self.chunk_slots)

    # --- updates -----------------------------------------------------------------------------------
    def allocate(self, ad_id: int, fmt: int, slot: int | None = None, new_chunk: bool = False) -> tuple[int, bool]:
        """Give `ad_id` a slot of format `fmt`: the free slot `slot` when given, else the first slot of a
        new chunk with `new_chunk`, else the top of the format's free list (a new chunk when it is
        empty). Returns (slot, grew): `grew` is True when capacity grew by one chunk, so that
        slot-indexed arrays must be extended to `capacity`."""
        if ad_id in self._slot_of:
            raise KeyError(f"ad {ad_id} already has slot {self._slot_of[ad_id]}")
        grew = False
        if slot is not None:
            if not 0 <= slot < self.capacity or self.slot_ad_id[slot] != EMPTY or self.format_of_slot(slot) != fmt:
                raise ValueError(f"slot {slot} is not a free slot of format {fmt}")
        else:
            free = self._free.setdefault(fmt, [])
            while free and self.slot_ad_id[free[-1]] != EMPTY:  # taken by name since it was pushed
                free.pop()
            if not free or new_chunk:
                start = self.capacity
                self.slot_ad_id = np.concatenate([self.slot_ad_id, np.full(self.chunk_slots, EMPTY, np.int64)])
                self.chunk_format = np.append(self.chunk_format, np.int16(fmt))
                self.chunk_free = np.append(self.chunk_free, np.int32(self.chunk_slots))
                self._chunks_of.pop(fmt, None)
                free.extend(range(start + self.chunk_slots - 1, start - 1, -1))
                grew = True
            slot = free.pop()
        self.slot_ad_id[slot] = ad_id
        self._slot_of[ad_id] = slot
        self.chunk_free[slot // self.chunk_slots] -= 1
        return slot, grew

    def release(self, ad_id: int) -> int:
        """Free the slot of `ad_id` and return it."""
        slot = self._slot_of.pop(ad_id)
        self.slot_ad_id[slot] = EMPTY
        self._free.setdefault(self.format_of_slot(slot), []).append(slot)
        self.chunk_free[slot // self.chunk_slots] += 1
        return slot


def _runs(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`np.unique(values, return_index=True, return_counts=True)` of sorted `values`, without the sort:
    (each run's value, its first index, its length)."""
    if not len(values):
        return values[:0], np.empty(0, np.intp), np.empty(0, np.intp)
    starts = np.concatenate([[0], np.flatnonzero(values[1:] != values[:-1]) + 1]).astype(np.intp)
    return values[starts], starts, np.diff(np.append(starts, len(values))).astype(np.intp)


def _order_of_permutation(rank: np.ndarray, formats: np.ndarray) -> np.ndarray | None:
    """`np.lexsort((arange(N), rank, formats))` when `rank` is a permutation of 0..N-1 that already
    keeps formats ascending (as `geo_layout.clustered_order` gives): the inverse permutation, made in
    one pass. None otherwise (the caller sorts)."""
    if rank.dtype.kind not in "iu":
        return None
    order = _inverse_permutation(np.ascontiguousarray(rank, np.int64))
    if order is None:
        return None
    fmts = formats[order]
    return order if not np.any(fmts[1:] < fmts[:-1]) else None


@njit(cache=True)
def _inverse_permutation(rank):
    """int64[N] order with order[rank[i]] = i, or None when rank (int64[N]) is not a permutation of 0..N-1."""
    n = rank.shape[0]
    order = np.full(n, -1, np.int64)
    for i in range(n):
        r = rank[i]
        if r < 0 or r >= n or order[r] != -1:
            return None
        order[r] = i
    return order
