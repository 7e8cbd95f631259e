"""GPU targeting index: every targeting rule of DESIGN section 2, evaluated for every ad in parallel.

Output layout (the contract with the fused scoring kernel, `gpu/kernels/score.py`)
-----------------------------------------------------------------------------------
`GpuTargetingIndex.match_slots(encoded_requests)` returns a numba device array

    eligible   uint32[B, W]   B = number of requests given, W = capacity // 32
                              bit (s % 32) of eligible[r, s // 32] is 1 when slot s holds an ad that
                              request r may be shown; 0 for ineligible ads and for empty slots.

Slots are the ones of `andromeda_nb.slots.SlotAllocator` (`index.slots`): format-grouped chunks of
CHUNK_SLOTS (256) slots, so W is a multiple of 8 and every aligned group of 8 words belongs to one
format. The embedding table of the co-located path is laid out in the same slot order
(`index.slots.slot_ad_id[s]` is the ad id of slot s, EMPTY (-1) when free), so the scoring kernel
reads bit s and row s with no id translation. `capacity` grows by whole chunks when an upsert needs a
slot of a format with no free slot left; `index.capacity` and `index.slots.capacity` tell the current
value, and slot-indexed arrays of other parts must be extended to it (new slots start empty).

Requests are evaluated in groups (64 in the shipped kernel): one pass over the per-ad columns serves a
whole group (bit r of a per-ad mask is request r of the group). The output is written once per request
and slot word.

Host preparation of a batch (`prepare`): the shipped kernel (v8) reads per-group tables (terms,
residual fields, request times) and the circle table (which request of the group lies in which custom
location, decided here with the float64 `haversine_km` every index uses). The term table (groups x
vocabulary) and the circle table (groups x custom locations) are mostly zero and as wide as the
corpus's vocabulary and circles, so they stay on the device (`KeptTable`, zero between batches): a
batch sends only its nonzero words (one per known term of a request, one per request inside a
circle, found through `CircleLookup`'s grid), a small kernel ORs them in before the match and another
zeroes them after it. The host's work and the bytes sent grow with the batch, not with the corpus.
All of it is compiled (numba, cached through `andromeda_nb.jitcache`, whose key covers the inlined geo
function): no Python step per term or per circle, and the compiled steps release the interpreter lock
(`nogil`), so a server's other threads (its exchanges) run while a batch is prepared. It is written straight into a pinned staging buffer and sent with
one asynchronous copy on the index's stream (`index.stream`), where the match kernel runs too; two
sets of buffers are used in turn, so batch i + 1 can be prepared while the device still runs batch i.
Launch shapes depend only on the capacity and the number of groups.

Geography first (`andromeda_nb.geo_layout`): every ad has a 64-bit geographic mask (the bits of its geo
clause's terms, every bit without one) and every block of SUMMARY_SLOTS (256) slots the OR of its ads'
masks, kept on the device (`summary`); a request group's mask is the OR of the bits of the geo terms its
requests hold. A block whose summary shares no bit with the group's mask holds no ad any of them can
match, and the batched kernels skip it before reading a slot. The bits come from `index.geo` (a
`GeoBuckets`: hashed term ids by default, a corpus world's hierarchy when given), exact for any bucket
function; the skip pays where the slot order clusters ads by geography (`rank`, the geo layout).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Sequence

import numpy as np
from numba import njit, prange

from andromeda_nb import jitcache
from andromeda_nb.batching import in_batches
from andromeda_nb.compiled import (
    NULL_END,
    NULL_START,
    CompiledTargeting,
    EncodedBatch,
    EncodedRequest,
    compile_ads,
    encode_requests,
    has_duplicates,
)
from andromeda_nb.constants import ACTIVE, EARTH_RADIUS_KM, STATUS_CODE
from andromeda_nb.devices import notice, resolve
from andromeda_nb.geo import haversine_km
from andromeda_nb.geo_layout import ALL as GEO_ALL
from andromeda_nb.hashing import HASH_MULTIPLIER, first_seen_ids
from andromeda_nb.geo_layout import GeoBuckets, block_summaries, clustered_order
from andromeda_nb.progress import Phases, Say
from andromeda_nb.slots import CHUNK_SLOTS, EMPTY, SlotAllocator
from andromeda_nb.types import Ad, Request, Retire, SetStatus, Update, Upsert

from . import runtime
from .graphs import Copy, run_plan

jitcache.install()  # cached host code is recompiled when any project source changes

COMPACT_MIN_WORDS = 1 << 20  # garbage program words tolerated before compaction (and ...)
COMPACT_RATIO = 1.0  # ... as a fraction of the live words


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + c) for every (s, c), as int64."""
    counts = np.asarray(counts, np.int64)
    total = int(counts.sum())
    if total == 0:
        return np.empty(0, np.int64)
    offsets = np.cumsum(counts) - counts
    return np.repeat(np.asarray(starts, np.int64) - offsets, counts) + np.arange(total, dtype=np.int64)


def resid_words(ct: CompiledTargeting, rows: np.ndarray | None = None) -> np.ndarray:
    """uint32 packed residual word per ad (layout in gpu/kernels/match.py)."""
    from .kernels import match as K

    sel = slice(None) if rows is None else rows
    w = ct.age_min[sel].astype(np.uint32) << K.AGE_MIN_SHIFT
    w |= ct.age_max[sel].astype(np.uint32) << K.AGE_MAX_SHIFT
    w |= ct.gender_mask[sel].astype(np.uint32) << K.GENDER_SHIFT
    w |= ct.publisher_mask[sel].astype(np.uint32) << K.PUBLISHER_SHIFT
    w |= ct.device_mask[sel].astype(np.uint32) << K.DEVICE_SHIFT
    w |= ct.os_mask[sel].astype(np.uint32) << K.OS_SHIFT
    w |= np.where(ct.status[sel] == ACTIVE, np.uint32(K.ACTIVE_BIT), np.uint32(0))
    scheduled = (ct.start_time[sel] != NULL_START) | (ct.end_time[sel] != NULL_END)
    w |= np.where(scheduled, np.uint32(K.SCHEDULE_BIT), np.uint32(0))
    return w.astype(np.uint32)


def clause_programs(ct: CompiledTargeting, rows: np.ndarray, dense_terms: np.ndarray,
                    circle_base: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Clause programs (format in gpu/kernels/match.py) of ct's `rows`, laid out one after another.

    `dense_terms` int64[T] gives the dense vocabulary id of every entry of `ct.terms`; circle indices
    are `circle_base + ct.circle_ptr[...]` (the device circle table holds ct.circles at circle_base).
    Returns (prog uint32[P], start int64[len(rows)], length int64[len(rows)]). Compiled: two passes
    over the rows' clauses and terms (`clause_programs_plain` is the same in numpy, the reference it
    is tested against; at 10M ads its temporaries of one int64 per term ran to gigabytes).
    """
    from .kernels import match as K

    return _clause_programs(np.asarray(ct.clause_ptr, np.int64), np.asarray(ct.term_ptr, np.int64),
                            np.asarray(ct.circle_ptr, np.int64), np.asarray(ct.clause_negative, np.uint8),
                            np.ascontiguousarray(rows, np.int64), np.asarray(dense_terms, np.int64),
                            np.int64(circle_base), np.int64(K.CIRCLES_BIT), np.int64(K.NEGATIVE_BIT))


_WORD = 0xFFFF_FFFF  # a program word: the low 32 bits, as numpy's cast to uint32 keeps them


@njit(cache=True, parallel=True)
def _clause_programs(clause_ptr, term_ptr, circle_ptr, clause_negative, rows, dense_terms, circle_base,
                     circles_bit, negative_bit):
    """`clause_programs` on ct's arrays: clause_ptr, term_ptr, circle_ptr int64 (N+1 / M+1),
    clause_negative uint8[M], rows int64[R], dense_terms int64[T]; the flag bits of the header word.
    The rows' lengths and then their words in parallel (`prange`: each row writes its own words)."""
    n = rows.shape[0]
    length = np.empty(n, np.int64)
    for r in prange(n):
        i = rows[r]
        size = 1 + (clause_ptr[i + 1] - clause_ptr[i]) + (term_ptr[clause_ptr[i + 1]] - term_ptr[clause_ptr[i]])
        for c in range(clause_ptr[i], clause_ptr[i + 1]):
            if circle_ptr[c + 1] > circle_ptr[c]:
                size += 2
        length[r] = size
    start = np.empty(n, np.int64)
    total = 0
    for r in range(n):
        start[r] = total
        total += length[r]
    prog = np.empty(total, np.uint32)  # every word is written below
    for r in prange(n):
        i = rows[r]
        p = start[r]
        prog[p] = np.uint32((clause_ptr[i + 1] - clause_ptr[i]) & _WORD)
        p += 1
        for c in range(clause_ptr[i], clause_ptr[i + 1]):
            lo, hi = term_ptr[c], term_ptr[c + 1]
            header = hi - lo
            has_c = circle_ptr[c + 1] > circle_ptr[c]
            if has_c:
                header |= circles_bit
            if clause_negative[c] != 0:
                header |= negative_bit
            prog[p] = np.uint32(header & _WORD)
            p += 1
            if has_c:
                prog[p] = np.uint32((circle_base + circle_ptr[c]) & _WORD)
                prog[p + 1] = np.uint32((circle_ptr[c + 1] - circle_ptr[c]) & _WORD)
                p += 2
            for t in range(lo, hi):
                prog[p] = np.uint32(dense_terms[t] & _WORD)
                p += 1
    return prog, start, length


def clause_programs_plain(ct: CompiledTargeting, rows: np.ndarray, dense_terms: np.ndarray,
                          circle_base: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`clause_programs` in numpy: the plain reference the compiled one is tested against."""
    from .kernels import match as K

    rows = np.asarray(rows, np.int64)
    n_cl = ct.clause_ptr[rows + 1] - ct.clause_ptr[rows]
    cl = _ranges(ct.clause_ptr[rows], n_cl)
    row_of_cl = np.repeat(np.arange(len(rows), dtype=np.int64), n_cl)
    nt = ct.term_ptr[cl + 1] - ct.term_ptr[cl]
    nc = ct.circle_ptr[cl + 1] - ct.circle_ptr[cl]
    has_c = nc > 0
    size_cl = 1 + 2 * has_c.astype(np.int64) + nt
    row_len = 1 + np.bincount(row_of_cl, weights=size_cl, minlength=len(rows)).astype(np.int64)
    start = np.cumsum(row_len) - row_len
    prog = np.zeros(int(row_len.sum()), np.uint32)
    prog[start] = n_cl.astype(np.uint32)
    pos = np.cumsum(size_cl) - size_cl + row_of_cl + 1
    header = nt.astype(np.uint64)
    header |= np.where(has_c, np.uint64(K.CIRCLES_BIT), np.uint64(0))
    header |= np.where(ct.clause_negative[cl] != 0, np.uint64(K.NEGATIVE_BIT), np.uint64(0))
    prog[pos] = header.astype(np.uint32)
    prog[pos[has_c] + 1] = (circle_base + ct.circle_ptr[cl[has_c]]).astype(np.uint32)
    prog[pos[has_c] + 2] = nc[has_c].astype(np.uint32)
    term_src = _ranges(ct.term_ptr[cl], nt)
    term_dst = _ranges(pos + 1 + 2 * has_c, nt)
    prog[term_dst] = dense_terms[term_src].astype(np.uint32)
    return prog, start, row_len


class Vocabulary:
    """Dense ids (0..V-1) for every term some ad has used; ids never change once given."""

    def __init__(self, terms: np.ndarray | None = None):
        terms = np.unique(np.asarray([] if terms is None else terms, np.int64))
        self._dense_of = dict(zip(terms.tolist(), range(len(terms))))
        self._sorted = terms
        self._sorted_dense = np.arange(len(terms), dtype=np.int64)
        self._hashed = None  # (_hash_table of the vocabulary), made on demand
        self._dirty = False

    @classmethod
    def of_terms(cls, terms: np.ndarray) -> tuple["Vocabulary", np.ndarray]:
        """(the vocabulary of `terms`, their dense ids int64[T]): `Vocabulary(terms)` and its
        `dense_bulk(terms)` in one compiled pass over the terms (each looked up in a hash table of the
        distinct ones, which stays small: tens of thousands for 10M ads), then a sort of the distinct
        terms alone; where the plain pair sorted every term (np.unique) and searched each."""
        terms = np.ascontiguousarray(terms, np.int64)
        distinct, ids = first_seen_ids(terms)
        order = np.argsort(distinct)
        rank = np.empty(len(distinct), np.int64)
        rank[order] = np.arange(len(distinct), dtype=np.int64)
        _renumber(ids, rank)
        return cls(distinct[order]), ids

    def __len__(self) -> int:
        return len(self._dense_of)

    def dense(self, terms: np.ndarray) -> np.ndarray:
        """Dense ids of `terms` (int64), adding the new ones."""
        out = np.empty(len(terms), np.int64)
        for i, t in enumerate(np.asarray(terms, np.int64).tolist()):
            d = self._dense_of.get(t)
            if d is None:
                d = self._dense_of[t] = len(self._dense_of)
                self._dirty = True
            out[i] = d
        return out

    def terms(self) -> np.ndarray:
        """int64[V]: the term of every dense id."""
        self._refresh()
        out = np.empty(len(self._sorted), np.int64)
        out[self._sorted_dense] = self._sorted
        return out

    def dense_bulk(self, terms: np.ndarray) -> np.ndarray:
        """Dense ids of terms all known to the vocabulary (vectorized)."""
        self._refresh()
        return self._sorted_dense[np.searchsorted(self._sorted, terms)]

    def lookup(self, terms: np.ndarray) -> np.ndarray:
        """Dense ids of those `terms` the vocabulary knows (the others can match no ad)."""
        self._refresh()
        terms = np.asarray(terms, np.int64)
        if len(self._sorted) == 0 or len(terms) == 0:
            return np.empty(0, np.int64)
        idx = np.minimum(np.searchsorted(self._sorted, terms), len(self._sorted) - 1)
        known = self._sorted[idx] == terms
        return np.sort(self._sorted_dense[idx[known]])

    def lookup_flat(self, terms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dense int64[T], known bool[T]) for a flat array of terms: the dense id of each term the
        vocabulary knows (`known`; the others can match no ad and their `dense` is meaningless)."""
        self._refresh()
        terms = np.asarray(terms, np.int64)
        if len(self._sorted) == 0 or len(terms) == 0:
            return np.zeros(len(terms), np.int64), np.zeros(len(terms), bool)
        if self._hashed is None:
            self._hashed = _hash_table(self._sorted, self._sorted_dense)
        return _dense_ids(*self._hashed, terms)

    def _refresh(self) -> None:
        if self._dirty:
            keys = np.fromiter(self._dense_of.keys(), np.int64, len(self._dense_of))
            vals = np.fromiter(self._dense_of.values(), np.int64, len(self._dense_of))
            order = np.argsort(keys)
            self._sorted, self._sorted_dense = keys[order], vals[order]
            self._hashed = None
            self._dirty = False


@njit(cache=True, nogil=True)
def _hash_table(keys, values):
    """An open-addressing table (linear probing, at most half full) of int64 keys >= 0 to int64 values:
    (slot keys int64[2^b], slot values int64[2^b], b); empty slots hold key -1."""
    bits = 4
    while (1 << bits) < 2 * len(keys):
        bits += 1
    size = 1 << bits
    tk = np.full(size, -1, np.int64)
    tv = np.zeros(size, np.int64)
    for i in range(len(keys)):
        h = (np.uint64(keys[i]) * np.uint64(HASH_MULTIPLIER)) >> np.uint64(64 - bits)
        j = np.int64(h)
        while tk[j] != -1:
            j = (j + 1) & (size - 1)
        tk[j] = keys[i]
        tv[j] = values[i]
    return tk, tv, bits


@njit(cache=True, parallel=True)
def _renumber(ids, new_id):
    """ids[t] = new_id[ids[t]] in place (int64 arrays)."""
    for t in prange(len(ids)):
        ids[t] = new_id[ids[t]]


@njit(cache=True, nogil=True)
def _dense_ids(tk, tv, bits, terms):
    """(dense int64[T], known bool[T]) of `terms` in a `_hash_table` of the vocabulary: one probe
    sequence per term, usually one cache line (a binary search over a 32,000-term vocabulary took
    about 54 ns per term on the development machine, mostly mispredicted branches)."""
    mask = (1 << bits) - 1
    dense = np.zeros(len(terms), np.int64)
    known = np.zeros(len(terms), np.bool_)
    for t in range(len(terms)):
        x = terms[t]
        j = np.int64((np.uint64(x) * np.uint64(HASH_MULTIPLIER)) >> np.uint64(64 - bits))
        while tk[j] != -1:
            if tk[j] == x:
                dense[t] = tv[j]
                known[t] = True
                break
            j = (j + 1) & mask
    return dense, known


def _bits_by_row(cond: np.ndarray) -> np.ndarray:
    """cond bool[K, n] (n <= 64) -> uint64[K], bit r set where cond[:, r]."""
    weights = np.left_shift(np.uint64(1), np.arange(cond.shape[1], dtype=np.uint64))
    return np.bitwise_or.reduce(np.where(cond, weights, np.uint64(0)), axis=1).astype(np.uint64)


def residual_tables(encoded: Sequence[EncodedRequest]) -> np.ndarray:
    """uint64[FTAB_WORDS]: the request masks per residual value for one group of <= 64 requests."""
    from .kernels import match as K

    age = np.asarray([e.age for e in encoded], np.int64)
    gender = np.asarray([e.gender for e in encoded], np.int64)
    pub = np.asarray([e.publisher for e in encoded], np.int64)
    dev = np.asarray([e.device for e in encoded], np.int64)
    os_ = np.asarray([e.os for e in encoded], np.int64)
    ft = np.zeros(K.FTAB_WORDS, np.uint64)
    m8, m16, m64, a128 = (np.arange(n, dtype=np.int64)[:, None] for n in (8, 16, 64, 128))
    ft[K.GENDER_OFF:K.GENDER_OFF + 8] = _bits_by_row((((m8 >> gender) & 1) == 1) | (m8 == 7))
    ft[K.PUBLISHER_OFF:K.PUBLISHER_OFF + 16] = _bits_by_row(((m16 >> pub) & 1) == 1)
    ft[K.DEVICE_OFF:K.DEVICE_OFF + 8] = _bits_by_row(((m8 >> dev) & 1) == 1)
    ft[K.OS_OFF:K.OS_OFF + 64] = _bits_by_row(((m64 >> os_) & 1) == 1)
    ft[K.AMIN_OFF:K.AMIN_OFF + 128] = _bits_by_row(age[None, :] >= a128)
    ft[K.AMAX_OFF:K.AMAX_OFF + 128] = _bits_by_row((age[None, :] <= a128) | (a128 == K.AGE_UNBOUNDED))
    return ft


# --- request batches: compiled host preparation -------------------------------------------------------
# Everything below runs once per batch of requests. The per-term and per-circle work is compiled
# (numba, cached through andromeda_nb.jitcache, whose key covers the inlined `haversine_km` of
# andromeda_nb.geo); Python touches each request a constant number of times and each term never.

RESIDUAL_OFFSETS_ORDER = ("GENDER_OFF", "PUBLISHER_OFF", "DEVICE_OFF", "OS_OFF", "AMIN_OFF", "AMAX_OFF",
                          "AGE_UNBOUNDED")


@lru_cache(maxsize=1)
def _residual_offsets() -> np.ndarray:
    """int64[7]: where each residual table starts in `ftab` (and AGE_UNBOUNDED), from the kernels' layout
    (made once: read-only)."""
    from .kernels import match as K

    offsets = np.asarray([getattr(K, name) for name in RESIDUAL_OFFSETS_ORDER], np.int64)
    offsets.flags.writeable = False
    return offsets


@njit(cache=True, nogil=True)
def _fill_request_tables(term_req, dense, known, age, gender, pub, dev, os_, time, lat, lon, group, offsets,
                         width, ridx, rbits, ftab, rtime, rpos, nreq, geo_bits, gmask):
    """The group tables of a batch (shapes in gpu/kernels/match.py), written in place over whatever
    they held; the term table `rtab` (groups x vocabulary, mostly zero) as its nonzero words: for
    every known term t of request r, word (r // group) * width + dense[t] of a table `width` words
    wide and bit 1 << (r % group), into ridx / rbits (room for every known term; returns how many).
    term_req int64[T] (the request of each term), dense int64[T] and known bool[T] (its dense
    vocabulary id, where the vocabulary knows it); the request columns int64[B] / float64[B];
    `offsets` int64[7] as `_residual_offsets`. The groups' geographic masks into `gmask`, as
    `group_masks` makes them (geo_bits int8 per dense term; an empty array: every bit)."""
    ftab[:] = 0
    rtime[:] = 0
    rpos[:] = np.nan
    nreq[:] = 0
    gender_off, pub_off, dev_off, os_off, amin_off, amax_off, unbounded = (
        offsets[0], offsets[1], offsets[2], offsets[3], offsets[4], offsets[5], offsets[6])
    k = 0
    gmask[:] = 0
    for t in range(term_req.shape[0]):
        if known[t]:
            r = term_req[t]
            ridx[k] = (r // group) * width + dense[t]
            rbits[k] = np.uint64(1) << np.uint64(r % group)
            k += 1
            if geo_bits.shape[0] and geo_bits[dense[t]] >= 0:
                gmask[r // group] |= np.uint64(1) << np.uint64(geo_bits[dense[t]])
    for g in range(gmask.shape[0]):
        if geo_bits.shape[0] == 0:
            gmask[g] = GEO_ALL
        elif gmask[g] == 0:
            gmask[g] = NO_GEO_MASK
    for r in range(age.shape[0]):
        g = r // group
        lane = r % group
        bit = np.uint64(1) << np.uint64(lane)
        nreq[g] += 1
        rtime[g, lane] = time[r]
        rpos[g, lane, 0] = lat[r]
        rpos[g, lane, 1] = lon[r]
        for m in range(8):
            if ((m >> gender[r]) & 1) == 1 or m == 7:
                ftab[g, gender_off + m] |= bit
            if ((m >> dev[r]) & 1) == 1:
                ftab[g, dev_off + m] |= bit
        for m in range(16):
            if ((m >> pub[r]) & 1) == 1:
                ftab[g, pub_off + m] |= bit
        for m in range(64):
            if ((m >> os_[r]) & 1) == 1:
                ftab[g, os_off + m] |= bit
        for a in range(128):
            if age[r] >= a:
                ftab[g, amin_off + a] |= bit
            if age[r] <= a or a == unbounded:
                ftab[g, amax_off + a] |= bit
    return k


@njit(cache=True, nogil=True)
def _sorted_per_request(term_req, dense, known, n):
    """(ptr int64[n + 1], terms uint32[K]): each request's known dense terms, ascending (v1 searches them)."""
    keep = np.flatnonzero(known)
    req = term_req[keep]
    d = dense[keep]
    order = np.argsort(req * (np.int64(1) << np.int64(32)) + d)
    ptr = np.zeros(n + 1, np.int64)
    for r in req:
        ptr[r + 1] += 1
    for r in range(n):
        ptr[r + 1] += ptr[r]
    return ptr, d[order].astype(np.uint32)


def _layout(spec: dict) -> tuple[dict, int]:
    """name -> (byte offset, shape, dtype, bytes) of arrays packed at UPLOAD_ALIGN-byte boundaries, and
    the size. Worked out once per distinct spec (a serving loop's batches mostly share a few)."""
    return _layout_of(tuple((name, shape, dtype) for name, (shape, dtype) in spec.items()))


@lru_cache(maxsize=256)
def _layout_of(spec: tuple) -> tuple[dict, int]:
    layout, end = {}, 0
    for name, shape, dtype in spec:
        shape, dtype = tuple(int(n) for n in shape), np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        layout[name] = (end, shape, dtype, nbytes)
        end += -(-nbytes // UPLOAD_ALIGN) * UPLOAD_ALIGN
    return layout, max(end, UPLOAD_ALIGN)


NEW_CHUNK = -1  # `GpuTargetingIndex._place`: open a new chunk of the format for the ad
# how upserts take slots (`GpuTargetingIndex.placement`): by geography, an ad of every bit in a chunk of
# its own when no block has every bit ('geo', shipped); the same, but widening a block for it ('widen');
# the top of the allocator's free list ('free-list'). The last two are kept to measure against.
PLACEMENTS = ("geo", "widen", "free-list")
NO_GEO_MASK = np.uint64(1 << 63)  # a group holding no geo term: one bit, which every ad without a geo clause has


def group_masks(group_of_term: np.ndarray, dense: np.ndarray, geo_bits: np.ndarray | None, out: np.ndarray) -> None:
    """out[g] = the OR of the geographic bits of the (known, dense) terms of group g's requests, given
    each term's group; NO_GEO_MASK where that is 0; every bit without `geo_bits`."""
    if geo_bits is None:
        out[:] = GEO_ALL
        return
    out[:] = 0
    bits = geo_bits[dense] if len(dense) else np.zeros(0, np.int8)
    geo = bits >= 0
    np.bitwise_or.at(out, group_of_term[geo], np.left_shift(np.uint64(1), bits[geo].astype(np.uint64)))
    out[out == 0] = NO_GEO_MASK


_NO_GEO_BITS = np.zeros(0, np.int8)  # `_fill_request_tables` without geographic bits: every group's mask all ones


def _popcount(x: np.ndarray) -> np.ndarray:
    """Set bits of each uint64."""
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(x).astype(np.int64)
    return np.unpackbits(np.ascontiguousarray(x, np.uint64).view(np.uint8).reshape(-1, 8), axis=1).sum(1)


@dataclass
class KeptTable:
    """A group table kept on the device (`RequestBatch.build`): `flat` holds rows of `width` words for up
    to `groups` groups, all zero outside a batch's match; `view(g)` the first g rows as the match
    reads them (made once per g: a plan of the same views is the same CUDA graph)."""

    flat: object
    width: int
    groups: int
    views: dict

    def view(self, groups: int):
        v = self.views.get(groups)
        if v is None:
            v = self.views[groups] = self.flat[:groups * self.width].reshape(groups, self.width)
        return v


def _kept_table(buffers: dict, name: str, groups: int, width: int, dtype, cuda) -> KeptTable:
    """The kept table `name` of a set of buffers, at least `groups` rows of `width` words: made anew
    (zero, with room to grow: a vocabulary or circle set gains a few entries per update) only when
    it is too small."""
    tables = buffers.setdefault("tables", {})
    have = tables.get(name)
    if have is None or have.width < width or have.groups < groups or have.flat.dtype != np.dtype(dtype):
        width = width + width // 8 + 64 if width > 1 else 1
        rows = 1 << max(0, (groups - 1).bit_length())
        have = tables[name] = KeptTable(cuda.to_device(np.zeros(rows * width, dtype)), width, rows, {})
    return have


def _entry_room(buffers: dict, key: tuple, n: int) -> int:
    """Room for n table words in a batch's upload: the most a set of buffers gave for `key` (what and
    how many groups), grown to a power of two (at least 256, twice n) when n does not fit, so that a
    serving loop's batches settle on one staging layout per batch size (and one CUDA graph)."""
    rooms = buffers.setdefault("rooms", {})
    room = rooms.get(key, 256)
    if n > room:  # with room to spare: the next batches of this size are seldom much larger
        room = rooms[key] = 1 << (2 * n - 1).bit_length()
    return room


@dataclass
class RequestBatch:
    """Device arrays of a batch of encoded requests, in the form the match kernels read (shapes in
    gpu/kernels/match.py). Built once, it can be matched many times (the benchmark does)."""

    n: int
    arrays: dict
    host_bytes: int
    # built unsent (`send_now=False`): the upload as plan steps, the match's arrays first and the extra
    # arrays second (when there are any), for launch plans to enqueue
    uploads: tuple = ()
    buffers: dict | None = None  # the staging buffers it was built on (to mark the upload sent)
    staged: dict | None = None  # the staging buffer's typed views, under the arrays' names
    group: int = 0  # requests per group (0: the per-request form)
    widths: tuple | None = None  # words per row of the kept term and circle tables (batched forms)

    def mark_sent(self, stream) -> None:
        """After the unsent upload was enqueued on `stream` (in a plan): the buffers' next fill waits
        for it."""
        if self.buffers is not None:
            mark_sent(self.buffers, stream)

    @classmethod
    def build(cls, encoded: EncodedBatch | Sequence[EncodedRequest], vocab: "Vocabulary", cuda, group: int,
              buffers: dict | None = None, circles: "CircleLookup | None" = None, stream=0,
              geo_bits: np.ndarray | None = None, extra: dict | None = None, send_now: bool = True
              ) -> "RequestBatch":
        """`group`: requests per group of the kernel (32 or 64), 0 for the per-request form of v1.
        `circles`: also the circle table of the table-reading kernels (`ctab`), decided on the host.
        `geo_bits` (int8 per dense term id: its geographic bit, -1 for none): the groups' masks
        (`gmask`) are made of them; without it every group's mask has every bit (no block skipped).
        Every array is written straight into one pinned staging buffer and sent with one host-to-device
        copy on `stream` (asynchronous on a real stream). `buffers`: staging and device buffers kept from
        an earlier batch, refilled in place when large enough and replaced otherwise, so a serving loop
        allocates and frees nothing per request; the batch is then valid only until the next one built
        on the same buffers. `extra` (name -> a host array, or (shape, dtype) for room to fill later
        through `staged`): more arrays sent in the same upload, in `arrays` under their names (the
        scorer's request tables). Nothing is copied yet with `send_now=False`: the upload is the
        batch's `uploads` steps, for launch plans to enqueue."""
        batch = EncodedBatch.of(encoded)
        extra = extra or {}
        n = len(batch)
        ptr = batch.term_ptr
        term_req = np.zeros(len(batch.terms), np.int64) if n == 1 else np.repeat(np.arange(n, dtype=np.int64),
                                                                                  ptr[1:] - ptr[:-1])
        dense, known = vocab.lookup_flat(batch.terms)
        if group:
            word = np.uint32 if group <= 32 else np.uint64
            groups = max(1, -(-n // group))
            buffers = buffers if buffers is not None else {}
            rtab = _kept_table(buffers, "rtab", groups, max(1, len(vocab)), word, cuda)
            if circles is not None:
                ctab = _kept_table(buffers, "ctab", groups, max(1, circles.count), np.uint64, cuda)
                cword, cbits = circles.entries(batch.latitude, batch.longitude, group, ctab.width)
            else:  # a kernel reading no circle table: an empty one for the table launches
                ctab = _kept_table(buffers, "ctab", 1, 1, np.uint64, cuda)
                cword, cbits = np.empty(0, np.int64), np.empty(0, np.uint64)
            terms_room = _entry_room(buffers, ("terms", groups), int(np.count_nonzero(known)))
            circles_room = _entry_room(buffers, ("circles", groups), len(cword))
            spec = {"counts": ((2,), np.int32), "ridx": ((terms_room,), np.int64), "rbits": ((terms_room,), word),
                    "cidx": ((circles_room,), np.int64), "cbits": ((circles_room,), np.uint64),
                    "ftab": ((groups, _ftab_words()), word), "rtime": ((groups, group), np.int64),
                    "rpos": ((groups, group, 2), np.float64), "nreq": ((groups,), np.int32),
                    "gmask": ((groups,), np.uint64)}
            spec.update(_extra_spec(extra))
            host, send = _staging(spec, cuda, buffers, split=next(iter(extra), None))
            n_terms = _fill_request_tables(term_req, dense, known, batch.age, batch.gender, batch.publisher,
                                           batch.device, batch.os, batch.time, batch.latitude, batch.longitude,
                                           group, _residual_offsets(), rtab.width, host["ridx"], host["rbits"],
                                           host["ftab"], host["rtime"], host["rpos"], host["nreq"],
                                           _NO_GEO_BITS if geo_bits is None else geo_bits, host["gmask"])
            host["cidx"][:len(cword)] = cword
            host["cbits"][:len(cword)] = cbits
            host["counts"][:] = (n_terms, len(cword))
            kept = {"rtab": rtab.view(groups), "rtab_flat": rtab.flat, "ctab": ctab.view(groups if circles is not None else 1),
                    "ctab_flat": ctab.flat}
            widths = (rtab.width, ctab.width)
        else:
            ptr, rterms = _sorted_per_request(term_req, dense, known, n)
            spec = {"rscal": ((n, 6), np.int64), "rpos1": ((n, 2), np.float64), "rterm_ptr": ((n + 1,), np.int64),
                    "rterms": ((max(1, len(rterms)),), np.uint32)}
            spec.update(_extra_spec(extra))
            buffers = buffers if buffers is not None else {}
            host, send = _staging(spec, cuda, buffers, split=next(iter(extra), None))
            host["rscal"][:] = np.stack([batch.age, batch.gender, batch.publisher, batch.device, batch.os,
                                         batch.time], axis=1).reshape(n, 6)
            host["rpos1"][:, 0], host["rpos1"][:, 1] = batch.latitude, batch.longitude
            host["rterm_ptr"][:] = ptr
            host["rterms"][:] = 0
            host["rterms"][:len(rterms)] = rterms
            kept, widths = {}, None
        for name, a in extra.items():
            if isinstance(a, np.ndarray):
                host[name][...] = a
        arrays, uploads = send(stream, copy=send_now)
        arrays.update(kept)
        return cls(n=n, arrays=arrays, host_bytes=sum(v.nbytes for v in host.values()), uploads=uploads,
                   buffers=buffers, staged=host, group=group, widths=widths)

    def dense_tables(self) -> dict:
        """The batch's term and circle tables as the match reads them (`rtab` uint[G, V], `ctab`
        uint64[G, Q], V and Q as wide as the index's vocabulary and circles when built), made on the
        host from the words the batch sends: for tests and probes (a batched form has them; v1's has
        none)."""
        host = self.staged
        groups = host["nreq"].shape[0]
        out = {}
        for name, idx, bits, count, width in (("rtab", "ridx", "rbits", 0, self.widths[0]),
                                              ("ctab", "cidx", "cbits", 1, self.widths[1])):
            table = np.zeros(groups * width, host[bits].dtype)
            n = int(host["counts"][count])
            np.bitwise_or.at(table, host[idx][:n], host[bits][:n])
            out[name] = table.reshape(groups, width)
        return out


RADIUS_CLASSES_KM = (10.0, 100.0, 1000.0)  # custom locations are searched in classes of radius (km): up to
# each bound, and past the last; a class's grid is as fine as its largest circle allows, so one
# continent-wide circle does not widen the search for the city-sized ones
LON_FULL_ROW = 0.99  # sin(radius) / cos(latitude) past this: the whole latitude row is searched
CHORD_MARGIN = 1e-9  # relative band around a circle's squared chord where the exact distance decides


class CircleLookup:
    """The custom locations of an index, arranged for finding which requests each one holds (made once
    per set of circles). Circles are split by radius (RADIUS_CLASSES_KM); within a class they sit in
    rows of latitude as high as the class's largest angular radius, sorted by longitude in each row.
    A user is tested against the circles of the rows and the longitude range a circle of the class
    holding them could have its centre in (the spherical cap's bounding box, widened far past float64
    rounding; the whole row near the poles), then by the squared chord between unit vectors against
    each circle's own (inside or outside when clearly so), and by `haversine_km` in float64, as every
    index decides it, within a relative CHORD_MARGIN of the boundary. The work per user grows with
    the circles near them, not with all circles."""

    def __init__(self, circles: np.ndarray):
        self.circles = np.ascontiguousarray(circles, np.float64).reshape(-1, 3)
        self.count = len(self.circles)
        self.grid = _circle_grid(self.circles)
        self._room = 4096  # entries a part of the next search expects (grows to the largest seen)
        self._per_request = 0.0  # entries a request found in the last search

    def entries(self, lat: np.ndarray, lon: np.ndarray, group: int, width: int) -> tuple[np.ndarray, np.ndarray]:
        """(word int64[E], bits uint64[E]): for every request r (at lat[r], lon[r], degrees; NaN:
        nowhere) inside circle q, the word (r // group) * width + q of a circle table `width` words
        wide and the bit 1 << (r % group), in request order. A word may be named by several entries
        (OR them). With SEARCH_THREADS above 0, a batch whose search is large (as many entries as the last
        batch's requests found each, times its requests, past SEARCH_PART_ENTRIES) is split into runs of
        requests searched at once on that many threads beside the caller's (the compiled search lets go
        of the interpreter lock)."""
        lat = np.ascontiguousarray(lat, np.float64)
        lon = np.ascontiguousarray(lon, np.float64)
        n = len(lat)
        if self.count == 0 or n == 0:
            return np.empty(0, np.int64), np.empty(0, np.uint64)
        threads = max(0, min(SEARCH_THREADS, MAX_SEARCH_THREADS))
        parts = min(n, threads + 1, max(1, int(n * self._per_request // SEARCH_PART_ENTRIES)))
        if parts == 1:
            word, bits = self._search(lat, lon, 0, group, width)
        else:
            cuts = np.linspace(0, n, parts + 1).astype(np.int64)
            pool = _search_pool()
            later = [pool.submit(self._search, lat[a:b], lon[a:b], int(a), group, width)
                     for a, b in zip(cuts[1:-1], cuts[2:])]
            found = [self._search(lat[:cuts[1]], lon[:cuts[1]], 0, group, width)] + [f.result() for f in later]
            word = np.concatenate([w for w, _ in found])
            bits = np.concatenate([b for _, b in found])
        self._per_request = len(word) / n
        return word, bits

    def _search(self, lat, lon, first: int, group: int, width: int) -> tuple[np.ndarray, np.ndarray]:
        """`entries` of the requests first, first + 1, ... at lat, lon (one run of a batch)."""
        while True:
            room = self._room
            word = np.empty(room, np.int64)
            bits = np.empty(room, np.uint64)
            n = _circle_entries(*self.grid, self.circles, lat, lon, first, group, width, word, bits)
            if n <= room:
                return word[:n], bits[:n]
            self._room = max(self._room, 2 * n)

    def fill(self, lat: np.ndarray, lon: np.ndarray, group: int, table: np.ndarray) -> None:
        """table uint64[G, max(1, Q)] := bit r % group of [r // group, q] set when request r is inside
        circle q (`entries`, dense)."""
        table[:] = 0
        word, bits = self.entries(lat, lon, group, table.shape[1])
        np.bitwise_or.at(table.reshape(-1), word, bits)


SEARCH_PART_ENTRIES = 6000  # entries (about 0.1 ms of search) below which a batch is searched in one run
MAX_SEARCH_THREADS = 3  # threads beside the caller's that may search runs of a large batch
# Threads beside the caller's for a large batch's custom-location search (0: always one run, the
# default). On the 2-core development machine splitting the 10M corpus's batch of 64 over two threads
# made the search 0.51 -> 0.32 to 0.47 ms but the whole preparation no faster (the hand-over costs what
# it saves); on the H100's 16-core host (f27486f) no clear gain either: the batch 3.05 and 2.77 ms over
# three threads against 3.08 and 3.01 in one run (docs/BENCHMARKS.md; `scripts/time_host_prepare.py
# --search-threads 0,3`).
SEARCH_THREADS = 0


@lru_cache(maxsize=None)
def _search_pool():
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_workers=MAX_SEARCH_THREADS, thread_name_prefix="circle-search")


def _circle_grid(circles: np.ndarray) -> tuple:
    """The arrays `_circle_entries` searches (see CircleLookup): per class its widened angular radius
    (degrees), the sine of it, its row height (degrees), first row and row count; per row the range of
    its circles; per circle in search order its index, longitude, unit vector and the squared-chord
    band (below `lo`: inside; above `hi`: outside; between: the exact distance decides)."""
    q = len(circles)
    lat, lon, radius = circles[:, 0], circles[:, 1], circles[:, 2]
    cls = np.searchsorted(np.asarray(RADIUS_CLASSES_KM), radius, side="left") if q else np.zeros(0, np.int64)
    n_cls = len(RADIUS_CLASSES_KM) + 1
    delta = np.zeros(n_cls)
    sin_delta = np.zeros(n_cls)
    height = np.ones(n_cls)
    nrows = np.ones(n_cls, np.int64)
    for c in range(n_cls):
        mine = cls == c
        if not mine.any():
            continue
        angle = min(float(radius[mine].max()) / EARTH_RADIUS_KM, np.pi)
        delta[c] = np.degrees(angle) * (1.0 + 1e-6) + 1e-9
        sin_delta[c] = np.sin(min(np.radians(delta[c]), np.pi / 2))
        height[c] = max(delta[c], 180.0 / 8192)
        nrows[c] = int(180.0 // height[c]) + 1
    first_row = np.concatenate([[0], np.cumsum(nrows)[:-1]]).astype(np.int64)
    row = first_row[cls] + np.minimum(np.floor((lat + 90.0) / height[cls]).astype(np.int64), nrows[cls] - 1) \
        if q else np.zeros(0, np.int64)
    order = np.lexsort((lon, row)).astype(np.int64)
    row_ptr = np.zeros(int(nrows.sum()) + 1, np.int64)
    np.add.at(row_ptr, row + 1, 1)
    row_ptr = np.cumsum(row_ptr)
    angle = np.minimum(radius[order] / EARTH_RADIUS_KM, np.pi)
    chord2 = (2.0 * np.sin(angle / 2.0)) ** 2
    margin = CHORD_MARGIN * chord2 + 1e-14 * np.sqrt(chord2) + 1e-30
    lo, hi = chord2 - margin, chord2 + margin
    near_half = angle > np.pi - 1e-6  # a circle over most of the sphere: always the exact distance
    lo[near_half], hi[near_half] = -1.0, np.inf
    return (delta, sin_delta, height, first_row, nrows, row_ptr, order, np.ascontiguousarray(lon[order]),
            _unit_vectors(lat[order], lon[order]), lo, hi)


_haversine_host = njit(cache=True)(haversine_km)


def _unit_vectors(lat, lon) -> np.ndarray:
    """float64 (N, 3) unit vectors of points given in degrees (NaN rows for NaN points)."""
    p, l = np.radians(np.asarray(lat, np.float64)), np.radians(np.asarray(lon, np.float64))
    return np.ascontiguousarray(np.stack([np.cos(p) * np.cos(l), np.cos(p) * np.sin(l), np.sin(p)], axis=1))


@njit(cache=True, nogil=True)
def _row_range(row_lon, a, b):
    """(first, last) positions of the longitudes in [a, b] of one row's sorted longitudes."""
    return np.searchsorted(row_lon, a, side="left"), np.searchsorted(row_lon, b, side="right")


@njit(cache=True, nogil=True)
def _circle_entries(delta, sin_delta, height, first_row, nrows, row_ptr, order, s_lon, s_vec, lo, hi, circles,
                    lat, lon, first, group, width, word, bits):
    """`CircleLookup.entries` on `_circle_grid`'s arrays for requests first, first + 1, ... at lat,
    lon: writes up to len(word) entries and returns how many there are (more than len(word): call
    again with room for them). Serial on purpose, and without the interpreter lock: on the 2-core
    development machine a numba parallel region cost milliseconds of CPU where a batch's search takes
    tens of microseconds (docs/results/probes/host_prepare_cpu.json); a large batch may be split into
    runs of requests on Python threads instead (`CircleLookup.entries`, SEARCH_THREADS)."""
    n = 0
    room = word.shape[0]
    for r in range(lat.shape[0]):
        la = lat[r]
        lo_r = lon[r]
        if la != la or lo_r != lo_r:
            continue
        g = (first + r) // group
        bit = np.uint64(1) << np.uint64((first + r) % group)
        cos_lat = math.cos(math.radians(la))
        # the user's unit vector (libm here, numpy's for the circles: an ulp apart at most, far inside
        # the chord band's margin)
        ux = cos_lat * math.cos(math.radians(lo_r))
        uy = cos_lat * math.sin(math.radians(lo_r))
        uz = math.sin(math.radians(la))
        for c in range(delta.shape[0]):
            if delta[c] == 0.0:
                continue
            h = height[c]
            top = nrows[c] - 1
            r0 = min(max(int(math.floor((la - delta[c] + 90.0) / h)), 0), top)
            r1 = min(max(int(math.floor((la + delta[c] + 90.0) / h)), 0), top)
            whole = cos_lat <= 0.0 or sin_delta[c] >= LON_FULL_ROW * cos_lat
            dl = 360.0
            if not whole:
                dl = math.degrees(math.asin(sin_delta[c] / cos_lat)) * (1.0 + 1e-6) + 1e-9
            for row in range(first_row[c] + r0, first_row[c] + r1 + 1):
                start = row_ptr[row]
                row_lon = s_lon[start:row_ptr[row + 1]]
                # up to three longitude ranges: the user's, and its wrap across the antimeridian
                for part in range(3):
                    if whole:
                        if part:
                            break
                        a, b = 0, row_lon.shape[0]
                    elif part == 0:
                        a, b = _row_range(row_lon, lo_r - dl, lo_r + dl)
                    elif part == 1:
                        if lo_r - dl >= -180.0:
                            continue
                        a, b = _row_range(row_lon, lo_r - dl + 360.0, 180.0)
                    else:
                        if lo_r + dl <= 180.0:
                            continue
                        a, b = _row_range(row_lon, -180.0, lo_r + dl - 360.0)
                    for i in range(start + a, start + b):
                        dx = ux - s_vec[i, 0]
                        dy = uy - s_vec[i, 1]
                        dz = uz - s_vec[i, 2]
                        d2 = dx * dx + dy * dy + dz * dz
                        if d2 > hi[i]:
                            continue
                        q = order[i]
                        if d2 >= lo[i] and _haversine_host(la, lo_r, circles[q, 0], circles[q, 1]) > circles[q, 2]:
                            continue
                        if n < room:
                            word[n] = g * width + q
                            bits[n] = bit
                        n += 1
    return n


UPLOAD_ALIGN = 16  # bytes: every array of a packed upload starts at a multiple of this


MAX_KEPT_LAYOUTS = 128  # staging layouts whose views a set of buffers keeps (past that all are made again)


def _extra_spec(extra: dict) -> dict:
    """name -> (shape, dtype) of `RequestBatch.build`'s extra arrays (arrays, or their shape and dtype)."""
    return {name: (a.shape, a.dtype) if isinstance(a, np.ndarray) else (tuple(a[0]), np.dtype(a[1]))
            for name, a in extra.items()}


def _staging(spec: dict, cuda, buffers: dict, split: str | None = None):
    """Host arrays to fill in place for an upload of the arrays `spec` (name -> (shape, dtype)): typed
    views of one pinned staging buffer at 16-byte aligned offsets. Returns (host views, send), where
    `send(stream)` copies the used part to the device with one host-to-device copy (asynchronous on a
    real stream) and returns (typed views of one device buffer, ()); `send(stream, copy=False)`
    returns the views and the copy as `gpu.graphs.Copy` steps for the caller to enqueue (in launch
    plans): one, or two where `split` names an array (the part before it, then the rest), and the
    caller marks it sent (`RequestBatch.mark_sent`) once all are enqueued. `buffers` keeps the
    staging and device buffers ("host", "device") for the next call, which reuses them when they are
    large enough: a serving loop then allocates nothing per request (allocations and frees
    synchronize the device). Before the staging buffer is written again, the copy last sent from it
    is waited for (an event: normally long done, so no wait)."""
    layout, size = _layout(spec)
    if buffers.get("host") is None or buffers["host"].size < size:
        buffers["host"] = cuda.pinned_array(size, np.uint8)
        buffers["device"] = cuda.device_array(size, np.uint8)
        buffers["views"] = {}
        buffers["sent"] = None
    if buffers.get("sent") is not None:
        buffers["sent"].synchronize()
    staging, device = buffers["host"], buffers["device"]
    # typed views of the staging and device buffers, and the copy between their used parts: made once
    # per layout (a serving loop's batches have a few: one per batch size) and kept with the buffers,
    # so a batch of a size seen before is given the very same arrays (the same CUDA graph: gpu.graphs)
    kept = buffers["views"].get(id(layout))
    if kept is None or kept[0] is not layout:
        def views_of(buffer):
            return {name: buffer[offset:offset + nbytes].view(dtype).reshape(shape)
                    for name, (offset, shape, dtype, nbytes) in layout.items()}

        if len(buffers["views"]) >= MAX_KEPT_LAYOUTS:
            buffers["views"].clear()
        cuts = [0, layout[split][0], size] if split is not None else [0, size]
        uploads = tuple(Copy(device[a:b], staging[a:b], to_host=False) for a, b in zip(cuts, cuts[1:]))
        kept = buffers["views"][id(layout)] = (layout, uploads, views_of(device), views_of(staging))
    host = dict(kept[3])

    def send(stream=0, copy: bool = True):
        _, uploads, views, _ = kept
        if not copy:
            return dict(views), uploads
        for upload in uploads:
            upload.run(stream)  # stream-ordered after any kernel still reading the device buffer
        mark_sent(buffers, stream)
        return dict(views), ()

    return host, send


def mark_sent(buffers: dict, stream) -> None:
    """Record that the staging buffer's copy is enqueued on `stream`: the next fill waits for it."""
    if stream:
        event = buffers.get("event") or runtime.cuda().event()
        buffers["event"] = event
        event.record(stream)
        buffers["sent"] = event
    else:
        buffers["sent"] = None  # a copy on the default stream has returned when it is done


@lru_cache(maxsize=1)
def _ftab_words() -> int:
    from .kernels import match as K

    return K.FTAB_WORDS


class GpuTargetingIndex:
    """`interfaces.TargetingIndex` on the device, plus the slot-order API of the co-located path.

    Device memory: per slot `resid` (uint32), `prog_ptr` (int64), `sched` (int64 x 2); the clause
    programs (uint32 words) and custom locations (float64 x 3), each with spare room for updates.
    `device` is 'gpu', 'sim' or 'auto' (the GPU when usable; without one `devices.NoKernelDevice`
    says to ask for 'sim'); `version`
    picks the match kernel: a number of gpu/kernels/match.py's table or a `Version` of the kernel lab
    (gpu/lab/match.py); default: the shipped one. Under the simulator a GPU-only version gives way
    to the simulator fallback, which computes the same bits.
    """

    def __init__(self, *, device: str = "auto", version=None):
        where = resolve(device, kernels=True, what="the GPU index")
        self.device = where
        self._cuda = runtime.cuda()
        from .kernels import match as kernels

        self._k = kernels
        chosen = kernels.version(version)
        if where == "sim" and chosen.gpu_only:
            fallback = kernels.VERSIONS[kernels.SIMULATOR_FALLBACK]
            notice(f"the CUDA simulator runs match kernel v{fallback.number} in place of v{chosen.number}, which it "
                   "cannot run (the same bits)")
            chosen = fallback
        self.kernel_version = chosen
        self.slots = SlotAllocator()
        self.vocab = Vocabulary()
        rooms: dict = {}  # the upload's room for table words, by kind and groups: shared by both sets
        self._request_buffers = ({"rooms": rooms}, {"rooms": rooms})  # two sets of staging, device buffer and
        # views: prepare(..., reuse=True)
        self._arrays_kept = None  # the match kernels' views of the device arrays (_index_arrays)
        self._next_buffers = 0
        self.stream = self._cuda.stream()  # uploads and match launches: ordered, off the host's critical path
        self._outputs: dict = {}  # 'full' -> the kept output array, requests -> its first rows (kept_output)
        self.updates_applied = 0
        self.compactions = 0
        self.geo = GeoBuckets()  # geographic bits of terms (hashed unless a hierarchy is given)
        self._geo_bits = np.zeros(0, np.int8)  # per dense term id, extended as the vocabulary grows
        self._summary_changed: set[int] = set()  # blocks whose summary the device does not hold yet
        # from_compiled: int64, the row of the compiled targeting held by every used slot in slot order,
        # as built (before any update); a caller with per-row arrays (embeddings) gathers by it
        self.built_rows: np.ndarray | None = None

    # --- construction --------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The number of the match kernel this index runs."""
        return self.kernel_version.number

    def _kernel(self, version=None):
        return self.kernel_version if version is None else self._k.version(version)

    @classmethod
    def build(cls, ads: Sequence[Ad], *, device: str = "auto", version=None,
              spare: float = 0.0, chunk_slots: int = CHUNK_SLOTS, buckets: GeoBuckets | None = None
              ) -> "GpuTargetingIndex":
        ads = list(ads)
        ids = [a.ad_id for a in ads]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate ad ids in the corpus")
        return cls.from_compiled(compile_ads(ads), device=device, version=version, spare=spare,
                                 chunk_slots=chunk_slots, buckets=buckets)

    @classmethod
    def from_compiled(cls, ct: CompiledTargeting, *, device: str = "auto", version=None,
                      spare: float = 0.0, chunk_slots: int = CHUNK_SLOTS,
                      rank: np.ndarray | str | None = None, buckets: GeoBuckets | None = None,
                      say: Say | None = None) -> "GpuTargetingIndex":
        """Build from compiled targeting (row i = one ad); slot order groups the ads by format, and
        within a format follows `rank` (one number per row) when given, else the rows' order; rank
        'geo' is `andromeda_nb.geo_layout.clustered_order` of the ads' geographic masks.
        `spare`: fraction of free slots kept per format for inserts; `chunk_slots` (a multiple of
        32): slots per format chunk (smaller than CHUNK_SLOTS only for tiny simulator pools);
        `buckets`: the geographic bits of terms (default hashed; see the module's "Geography first");
        `say` (`andromeda_nb.progress`) is told each step as it ends, with its seconds."""
        if chunk_slots % 32:
            raise ValueError(f"chunk_slots must be a multiple of 32, got {chunk_slots}")
        if isinstance(rank, str) and rank != "geo":
            raise ValueError(f"unknown rank {rank!r}: 'geo' or one number per ad")
        phases = Phases(say)
        if has_duplicates(ct.ad_id):
            raise ValueError("duplicate ad ids in the corpus")
        index = cls(device=device, version=version)
        if buckets is not None:
            index.geo = buckets
        index.vocab, dense_terms = Vocabulary.of_terms(ct.terms)
        phases.done(f"term vocabulary: {len(index.vocab):,} terms of {len(ct.terms):,}")
        geo_bits = index.geo_bits()
        masks = index.geo.ad_masks_dense(ct, dense_terms, geo_bits)  # each distinct term looked up once
        if isinstance(rank, str):
            rank = clustered_order(ct.format, masks)
        slots, rows = SlotAllocator.layout(ct.ad_id, ct.format, chunk_slots=chunk_slots, spare=spare, rank=rank)
        used = np.flatnonzero(slots.slot_ad_id != EMPTY)
        phases.done(f"geographic masks and {slots.capacity:,} slots laid out")
        prog, start, length = clause_programs(ct, rows, dense_terms)
        phases.done(f"clause programs: {len(prog):,} words")
        index._install(slots, used, resid_words(ct, rows), start, length, prog,
                       ct.start_time[rows], ct.end_time[rows], ct.circles, masks[rows])
        index.built_rows = rows
        phases.done("index on the device")
        return index

    def _install(self, slots: SlotAllocator, used: np.ndarray, resid: np.ndarray, start: np.ndarray,
                 length: np.ndarray, prog: np.ndarray, start_time: np.ndarray, end_time: np.ndarray,
                 circles: np.ndarray, geo_masks: np.ndarray) -> None:
        """Upload a complete layout: `used` slots get the given per-ad values (in the same order)."""
        cap = slots.capacity
        self.slots = slots
        self.resid_h = np.zeros(cap, np.uint32)
        self.ptr_h = np.zeros(cap, np.int64)
        self.len_h = np.zeros(cap, np.int64)
        self.sched_h = np.empty((cap, 2), np.int64)
        self.sched_h[:, 0], self.sched_h[:, 1] = NULL_START, NULL_END
        self.resid_h[used] = resid
        self.ptr_h[used] = start
        self.len_h[used] = length
        self.sched_h[used, 0] = start_time
        self.sched_h[used, 1] = end_time
        self.geo_h = np.zeros(cap, np.uint64)
        self.geo_h[used] = geo_masks
        self.summary_h = block_summaries(self.geo_h, self._k.SUMMARY_SLOTS)
        cuda = self._cuda
        self.d_summary = cuda.to_device(np.concatenate([self.summary_h, np.zeros(1, np.uint64)]))
        self.d_resid = cuda.to_device(self.resid_h)
        self.d_ptr = cuda.to_device(self.ptr_h)
        self.d_sched = cuda.to_device(self.sched_h)
        self.prog_used = len(prog)
        self.prog_garbage = 0
        self.d_prog = cuda.to_device(np.concatenate([prog, np.zeros(max(1, len(prog) // 8), np.uint32)]))
        self.circles_used = len(circles)
        room = np.zeros((max(1, len(circles) // 8 + 1), 3), np.float64)
        self.circles_h = np.ascontiguousarray(np.asarray(circles, np.float64).reshape(-1, 3))
        self._circle_lookup = None  # CircleLookup of circles_h, made on demand
        self.d_circles = cuda.to_device(np.concatenate([self.circles_h, room]))

    # --- sizes ---------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.slots)

    def __contains__(self, ad_id: int) -> bool:
        """Whether `ad_id` is live (mirror of `CpuTargetingIndex.__contains__`)."""
        return int(ad_id) in self.slots

    @property
    def capacity(self) -> int:
        return self.slots.capacity

    def device_bytes(self) -> int:
        """Bytes of device memory the index holds (columns, programs and custom locations, including
        the spare room kept for updates)."""
        arrays = (self.d_resid, self.d_ptr, self.d_sched, self.d_prog, self.d_circles, self.d_summary)
        return int(sum(a.size * a.dtype.itemsize for a in arrays))

    def live_bytes(self) -> dict:
        """Bytes in use per part (no spare room): what a scan reads at most."""
        cap = self.capacity
        return {
            "resid": cap * 4,
            "prog_ptr": cap * 8,
            "sched": cap * 16,
            "programs": (self.prog_used - self.prog_garbage) * 4,
            "circles": self.circles_used * 24,
            "summary": len(self.summary_h) * 8,
        }

    def _index_arrays(self):
        """(resid, prog_ptr, prog, sched, circles, summary) as the match kernels read them: views made
        once per set of device arrays and capacity (a launch plan of the same views is the same CUDA
        graph: `gpu.graphs`). The key holds the arrays themselves, so an array replaced since cannot
        hand its identity to a new one while the views are kept."""
        cap, blocks = self.capacity, len(self.summary_h)
        arrays = (self.d_resid, self.d_ptr, self.d_prog, self.d_sched, self.d_circles, self.d_summary)
        kept = self._arrays_kept
        if kept is None or kept[1] != (cap, blocks) or any(a is not b for a, b in zip(kept[0], arrays)):
            kept = self._arrays_kept = (arrays, (cap, blocks), (self.d_resid[:cap], self.d_ptr[:cap], self.d_prog,
                                                                self.d_sched[:cap], self.d_circles,
                                                                self.d_summary[:blocks]))
        return kept[2]

    # --- matching ------------------------------------------------------------------------------------
    def prepare(self, encoded: EncodedBatch | Sequence[EncodedRequest], version=None, *,
                reuse: bool = False, extra: dict | None = None, send_now: bool = True) -> RequestBatch:
        """Upload a batch of encoded requests (an `EncodedBatch`, or encoded requests) in the form kernel
        `version` reads, on the index's stream, with the circle table when the kernel reads one. With
        `reuse` the upload goes into one of two sets of buffers this index keeps (used in turn: no
        allocation, and a batch may be prepared while the one before it is still being matched), and
        the batch is valid until the second `prepare(..., reuse=True)` after it. `extra` and `send_now`:
        as `RequestBatch.build` (more arrays in the same upload; the upload left to a launch plan)."""
        recipe = self._kernel(version).recipe
        buffers = None
        if reuse:
            buffers = self._request_buffers[self._next_buffers]
            self._next_buffers ^= 1
        circles = self._circles() if recipe.circle_table else None
        return RequestBatch.build(encoded, self.vocab, self._cuda, recipe.group, buffers, circles, self.stream,
                                  self.geo_bits(), extra, send_now)

    def group_masks_of(self, encoded: EncodedBatch | Sequence[EncodedRequest], group: int = 1) -> np.ndarray:
        """uint64[G]: the mask `prepare` gives each group of `group` requests of the batch."""
        batch = EncodedBatch.of(encoded)
        term_req = np.repeat(np.arange(len(batch), dtype=np.int64), np.diff(batch.term_ptr))
        dense, known = self.vocab.lookup_flat(batch.terms)
        masks = np.empty(max(1, -(-len(batch) // group)), np.uint64)
        group_masks(term_req[known] // group, dense[known], self.geo_bits(), masks)
        return masks

    def skipped_blocks(self, encoded: EncodedBatch | Sequence[EncodedRequest], group: int = 1) -> np.ndarray:
        """bool[G, blocks]: the blocks of SUMMARY_SLOTS slots the batched kernels skip for each group of
        `group` requests of the batch (the host's view of the same masks: nothing launched)."""
        return (self.summary_h[None, :] & self.group_masks_of(encoded, group)[:, None]) == 0

    def geo_bits(self) -> np.ndarray:
        """int8 per dense term id of the vocabulary: its geographic bit (`index.geo`), -1 for none."""
        if len(self._geo_bits) < len(self.vocab):
            new = self.vocab.terms()[len(self._geo_bits):]
            self._geo_bits = np.concatenate([self._geo_bits, self.geo.term_bits(new)])
        return self._geo_bits

    def _circles(self) -> CircleLookup:
        if self._circle_lookup is None:
            self._circle_lookup = CircleLookup(self.circles_h)
        return self._circle_lookup

    def circle_table(self, encoded: EncodedBatch | Sequence[EncodedRequest], group: int) -> np.ndarray:
        """uint64[G, max(1, Q)]: bit r of [g, q] = request group * g + r is inside custom location q
        (every circle of the device table, live or not). Decided on the host, compiled, with the float64
        great-circle distance the CPU index and the device's v6 use (`haversine_km`, tested equal to the
        oracle's), so kernels that read this table need no trigonometry; only circles in a latitude band
        around each user are tested."""
        batch = EncodedBatch.of(encoded)
        table = np.empty((max(1, -(-len(batch) // group)), max(1, len(self.circles_h))), np.uint64)
        self._circles().fill(batch.latitude, batch.longitude, group, table)
        return table

    def new_output(self, n_requests: int):
        """A device array for match output: uint32[n_requests, capacity // 32]."""
        return self._cuda.device_array((n_requests, self.capacity // 32), np.uint32)

    def kept_output(self, n_requests: int):
        """An output array for `n_requests` that the index keeps and hands out again: for a serving
        loop, which uses up one answer before asking the next. The first rows of one array sized for
        the largest batch seen (a power of two), remade only when that grows or the capacity does:
        batches of changing sizes allocate nothing."""
        words = self.capacity // 32
        full = self._outputs.get("full")
        if full is None or full.shape[1] != words or full.shape[0] < n_requests:
            full = self.new_output(runtime.kept_rows(n_requests, full.shape[0] if full is not None and
                                                     full.shape[1] == words else 0))
            self._outputs = {"full": full}
        out = self._outputs.get(n_requests)
        if out is None:
            out = self._outputs[n_requests] = full[:n_requests]
        return out

    def run(self, batch: RequestBatch, out, version=None) -> None:
        """Launch the match kernel on a prepared batch, on the index's stream (asynchronous, like any
        kernel launch: work on the legacy default stream, such as a plain `copy_to_host`, waits for it).
        A batch prepared unsent is uploaded first."""
        if batch.uploads:
            for upload in batch.uploads:
                upload.run(self.stream)
            batch.mark_sent(self.stream)
        before, after = self._k.table_steps(batch.arrays)
        run_plan(before, self.stream)
        self._k.launch(self._kernel(version), self._index_arrays(), batch.arrays, out, self.stream)
        run_plan(after, self.stream)

    def plan(self, batch: RequestBatch, out, version=None) -> list | None:
        """`run` as a `gpu.graphs` plan, with the upload of the match's arrays first when `prepare` left
        it unsent (the rest of the upload, the extra arrays, is the caller's to enqueue); None for a
        kernel whose recipe makes no plan (the lab's v1)."""
        parts = self.plan_parts(batch, out, version)
        return None if parts is None else parts[0] + parts[1] + parts[2]

    def plan_parts(self, batch: RequestBatch, out, version=None) -> tuple[list, list, list] | None:
        """`plan` in three parts: the upload and the writing of the batch's words into the kept group
        tables; the match kernel; the tables' clearing (the benchmark times the middle one alone)."""
        steps = self._k.plan(self._kernel(version), self._index_arrays(), batch.arrays, out)
        if steps is None:
            return None
        before, after = self._k.table_steps(batch.arrays) if steps else ([], [])
        return list(batch.uploads[:1]) + before, steps, after

    def match_slots(self, encoded: EncodedBatch | Sequence[EncodedRequest], version=None, *, out=None):
        """Eligibility of every slot for each request: a device array uint32[B, capacity // 32]
        in the layout at the top of this module; written into `out` when given (a device array of
        that shape, e.g. `kept_output`), else into a new one. The request upload reuses the
        index's device buffers (`prepare(..., reuse=True)`)."""
        encoded = EncodedBatch.of(encoded)
        want = (len(encoded), self.capacity // 32)
        if out is None:
            out = self.new_output(len(encoded))
        elif tuple(out.shape) != want or out.dtype != np.uint32:
            raise ValueError(f"out: expected a uint32 device array of shape {want}, got {out.dtype} {tuple(out.shape)}")
        if len(encoded) and self.capacity:  # no slots (built from no ads): nothing to launch over
            self.run(self.prepare(encoded, version, reuse=True), out, version)
        return out

    def slot_masks_to_ids(self, words: np.ndarray) -> list[np.ndarray]:
        """Host bit words uint32[B, capacity // 32] -> eligible ad ids per request, ascending."""
        bits = np.unpackbits(np.ascontiguousarray(words).view(np.uint8), axis=1, bitorder="little")
        slot_ids = self.slots.slot_ad_id
        return [np.sort(slot_ids[np.flatnonzero(row)]) for row in bits]

    def match(self, requests: Sequence[Request], *, batch: int = 1024) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        requests = list(requests)
        for part in in_batches(requests, batch):
            words = self.match_slots(encode_requests(part)).copy_to_host()
            out.extend(self.slot_masks_to_ids(words))
        return out

    # --- updates -------------------------------------------------------------------------------------
    def apply(self, update: Update) -> None:
        self.apply_many([update])

    def apply_many(self, updates: Iterable[Update]) -> None:
        """Apply updates in order, then write every changed slot to the device in one launch. When this
        returns, the device holds the new state: a request launched afterwards sees it."""
        K = self._k
        changed: set[int] = set()
        new_words: list[np.ndarray] = []
        new_circles: list[np.ndarray] = []
        word_end = self.prog_used
        circle_end = self.circles_used
        slots = self.slots
        for update in updates:
            if isinstance(update, Upsert):
                ad = update.ad
                ct = compile_ads([ad])
                mask = self.geo.ad_mask(ct)
                slot = slots.slot_of(ad.ad_id) if ad.ad_id in slots else None
                if slot is None or slots.format_of_slot(slot) != ad.format or (
                        self.placement != "free-list" and not self._covers(slot, mask)):
                    # a new ad, a new format, or a place its block's ads do not have: a slot chosen
                    # by geography (`_place`), so the block summaries stay as narrow as they are
                    if slot is not None:
                        changed.add(self._clear_slot(slots.release(ad.ad_id)))
                    place = self._place(ad.format, mask)
                    slot, grew = slots.allocate(ad.ad_id, ad.format, None if place in (None, NEW_CHUNK) else place,
                                                new_chunk=place == NEW_CHUNK)
                    if grew:
                        self._grow_host(slots.capacity)
                self.prog_garbage += int(self.len_h[slot])
                prog, _, length = clause_programs(ct, np.zeros(1, np.int64), self.vocab.dense(ct.terms), circle_end)
                new_words.append(prog)
                new_circles.append(ct.circles)
                self.resid_h[slot] = resid_words(ct)[0]
                self.ptr_h[slot] = word_end
                self.len_h[slot] = length[0]
                self.sched_h[slot] = (ct.start_time[0], ct.end_time[0])
                self._set_geo(slot, mask)
                word_end += len(prog)
                circle_end += len(ct.circles)
                changed.add(slot)
            elif isinstance(update, SetStatus):
                slot = slots.slot_of(update.ad_id)
                w = int(self.resid_h[slot]) & ~K.ACTIVE_BIT
                if STATUS_CODE[update.status] == ACTIVE:
                    w |= K.ACTIVE_BIT
                self.resid_h[slot] = w
                changed.add(slot)
            elif isinstance(update, Retire):
                changed.add(self._clear_slot(slots.release(update.ad_id)))
            else:
                raise TypeError(f"not an update: {update!r}")
            self.updates_applied += 1
        self._upload_changes(sorted(changed), new_words, new_circles)
        live = int(self.len_h.sum())
        if self.prog_garbage > max(COMPACT_MIN_WORDS, COMPACT_RATIO * live):
            self.compact()

    def _clear_slot(self, slot: int) -> int:
        self.prog_garbage += int(self.len_h[slot])
        self.resid_h[slot] = 0
        self.len_h[slot] = 0
        self.ptr_h[slot] = 0
        self.sched_h[slot] = (NULL_START, NULL_END)
        self.geo_h[slot] = 0
        self._summary_changed.add(slot // self._k.SUMMARY_SLOTS)  # made again from its ads' masks
        return slot

    def _set_geo(self, slot: int, mask) -> None:
        self.geo_h[slot] = mask
        block = slot // self._k.SUMMARY_SLOTS
        self.summary_h[block] |= np.uint64(mask)
        self._summary_changed.add(block)

    def _covers(self, slot: int, mask) -> bool:
        """Whether the summary of `slot`'s block already has every bit of `mask`."""
        have = self.summary_h[slot // self._k.SUMMARY_SLOTS]
        return (have | np.uint64(mask)) == have

    placement = "geo"  # how upserts take slots: PLACEMENTS

    def _place(self, fmt: int, mask) -> int | None:
        """A free slot of format `fmt` for an ad of geographic `mask`: in a block whose summary already
        has every bit of it (no block widened), else in a block with no ad, else where the fewest
        bits are added (the emptiest chunk among those); but an ad of every bit (no geo clause, custom locations) widens no block:
        NEW_CHUNK, a chunk of its own. None when the format has no free slot (the allocator grows).
        What each rule keeps of the skip under updates: docs/BENCHMARKS.md, "Under real-time updates"
        (`scripts/probe_geo_churn.py`)."""
        if self.placement == "free-list":
            return None
        slots = self.slots
        chunks = slots.chunks_of(fmt)
        chunks = chunks[slots.chunk_free[chunks] > 0]
        if not len(chunks):
            return None
        have = self.summary_h[chunks * slots.chunk_slots // self._k.SUMMARY_SLOTS]
        mask = np.uint64(mask)
        pick = np.flatnonzero((have | mask) == have)
        if not len(pick):
            pick = np.flatnonzero(have == 0)
        if not len(pick):
            if mask == GEO_ALL and self.placement == "geo":
                return NEW_CHUNK  # every bit would make the block one every request reads
            # the fewest bits added, and among those the emptiest chunk: the fewest ads read for them
            pick = np.lexsort((-slots.chunk_free[chunks], _popcount(have | mask) - _popcount(have)))[:1]
        lo = int(chunks[pick[0]]) * slots.chunk_slots
        return lo + int(np.flatnonzero(slots.slot_ad_id[lo:lo + slots.chunk_slots] == EMPTY)[0])

    def _grow_host(self, cap: int) -> None:
        extra = cap - len(self.resid_h)
        if extra <= 0:
            return
        self.resid_h = np.concatenate([self.resid_h, np.zeros(extra, np.uint32)])
        self.ptr_h = np.concatenate([self.ptr_h, np.zeros(extra, np.int64)])
        self.len_h = np.concatenate([self.len_h, np.zeros(extra, np.int64)])
        room = np.empty((extra, 2), np.int64)
        room[:, 0], room[:, 1] = NULL_START, NULL_END
        self.sched_h = np.concatenate([self.sched_h, room])
        self.geo_h = np.concatenate([self.geo_h, np.zeros(extra, np.uint64)])
        blocks = -(-cap // self._k.SUMMARY_SLOTS)
        self.summary_h = np.concatenate([self.summary_h, np.zeros(blocks - len(self.summary_h), np.uint64)])

    def _device_room(self, d_arr, needed: int, fill_host: np.ndarray | None = None):
        """`d_arr` if it has `needed` rows, else a device array with twice the rows holding its data
        (a device-to-device copy) and, for slot columns, the host mirror's values beyond."""
        rows = d_arr.shape[0]
        if needed <= rows:
            return d_arr
        new_rows = max(needed, 2 * rows)
        if fill_host is not None:  # slot columns: the host mirror is complete up to `needed`
            host = np.zeros((new_rows,) + fill_host.shape[1:], fill_host.dtype)
            host[:needed] = fill_host[:needed]
            fresh = self._cuda.to_device(host)
        else:
            fresh = self._cuda.device_array((new_rows,) + d_arr.shape[1:], d_arr.dtype)
        if rows:  # an index built from no ads has empty slot columns (the simulator rejects empty copies)
            fresh[:rows].copy_to_device(d_arr)
        return fresh

    def _upload_changes(self, changed: list[int], new_words: list[np.ndarray], new_circles: list[np.ndarray]) -> None:
        cuda = self._cuda
        cap = self.capacity
        if cap > self.d_resid.shape[0]:
            self.d_resid = self._device_room(self.d_resid, cap, self.resid_h)
            self.d_ptr = self._device_room(self.d_ptr, cap, self.ptr_h)
            self.d_sched = self._device_room(self.d_sched, cap, self.sched_h)
        if new_words:
            words = np.concatenate(new_words)
            end = self.prog_used + len(words)
            self.d_prog = self._device_room(self.d_prog, end)
            if len(words):
                self.d_prog[self.prog_used:end].copy_to_device(words)
            self.prog_used = end
        circles = np.concatenate(new_circles).reshape(-1, 3) if new_circles else np.empty((0, 3))
        if len(circles):
            end = self.circles_used + len(circles)
            self.d_circles = self._device_room(self.d_circles, end)
            self.d_circles[self.circles_used:end].copy_to_device(np.ascontiguousarray(circles))
            self.circles_h = np.concatenate([self.circles_h, np.asarray(circles, np.float64)])
            self._circle_lookup = None
            self.circles_used = end
        if len(self.summary_h) > self.d_summary.shape[0]:
            self.d_summary = self._device_room(self.d_summary, len(self.summary_h), self.summary_h)
        if self._summary_changed:  # made again from their ads' masks, exact; then one copy of their span
            blocks = np.fromiter(self._summary_changed, np.int64, len(self._summary_changed))
            at = blocks[:, None] * self._k.SUMMARY_SLOTS + np.arange(self._k.SUMMARY_SLOTS)
            inside = at < len(self.geo_h)
            masks = np.where(inside, self.geo_h[np.where(inside, at, 0)], np.uint64(0))
            self.summary_h[blocks] = np.bitwise_or.reduce(masks, axis=1)
            lo, hi = int(blocks.min()), int(blocks.max()) + 1
            self.d_summary[lo:hi].copy_to_device(self.summary_h[lo:hi])
            self._summary_changed.clear()
        if changed:
            s = np.asarray(changed, np.int64)
            self._k.launch_scatter(cuda.to_device(s), cuda.to_device(self.resid_h[s]), cuda.to_device(self.ptr_h[s]),
                                   cuda.to_device(np.ascontiguousarray(self.sched_h[s])),
                                   self.d_resid, self.d_ptr, self.d_sched)
        cuda.synchronize()

    def compact(self) -> None:
        """Rewrite the program area without the programs of replaced and retired ads (on the device)."""
        cuda = self._cuda
        cap = self.capacity
        lengths = self.len_h[:cap]
        new_ptr = np.cumsum(lengths) - lengths
        total = int(lengths.sum())
        new_prog = cuda.device_array(max(1, total + total // 8), np.uint32)
        self._k.launch_compact(self.d_prog, self.d_ptr[:cap], cuda.to_device(lengths.astype(np.uint32)),
                               cuda.to_device(new_ptr.astype(np.int64)), new_prog)
        self.ptr_h[:cap] = np.where(lengths > 0, new_ptr, 0)
        self.d_ptr[:cap].copy_to_device(self.ptr_h[:cap])
        cuda.synchronize()
        self.d_prog = new_prog
        self.prog_used = total
        self.prog_garbage = 0
        self.compactions += 1
