"""CPU inverted targeting index: posting lists, clause counting, residual checks, live updates.

The index an ad server keeps on its CPUs. Built from `andromeda_nb.compiled` (the one compiled
form both indexes share), it stores:

* **posting lists**: a CSR map from term (namespace, id) to entries (slot, clause), where clause is
  the ad's local index of a positive clause (0..n_positive-1) or -1 for its negative clause. An ad
  unconstrained on a field has no clause for it and so no posting: absence costs nothing.
* **circle lists**: custom locations as (slot, clause, latitude, longitude, radius km) rows, checked
  with `andromeda_nb.geo.haversine_km` after a cheap latitude-band test.
* **residual columns** per slot: status, schedule, age range, gender and placement masks.

Match (conjunction counting, after Whang et al., "Indexing Boolean Expressions", VLDB 2009, with
each clause a disjunction): for every term the user holds, walk its postings and set the clause's
bit in the slot's word (bit 31 for the negative clause). A slot is eligible when bit 31 is clear,
the popcount of its word equals its positive clause count and the residuals pass.
Only slots reached through a posting are examined, plus the (rare) ads with no positive clause.

Updates (DESIGN section 6) never rebuild the index: a slot belongs to the *main* segment or the
*delta* segment (`segment` column); postings of a segment count only for slots currently in it, so
a retired or replaced ad's old postings are dead (tombstoned) at once and its slot can be reused;
while main holds no dead entries the walk skips the segment test.
Upserts go to the delta segment, whose small CSR is rebuilt lazily at the next match; when the delta
grows past `DELTA_MERGE_FRACTION` of the main segment the two are merged (sort of the live entries).
Status changes only touch the status column.

Matching one request is a numba `njit(nogil=True, cache=True)` function; `match` runs requests on a
thread pool of `threads` workers, each with its own scratch arrays.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numba
import numpy as np

from andromeda_nb import jitcache
from andromeda_nb.compiled import CompiledTargeting, EncodedRequest, compile_ads, encode_request
from andromeda_nb.constants import ACTIVE, EARTH_RADIUS_KM, STATUS_CODE
from andromeda_nb.geo import haversine_km
from andromeda_nb.types import Ad, Request, Retire, SetStatus, Upsert
from andromeda_nb.updates import upsert_runs

jitcache.install()  # cached code is recompiled when any project source changes

SEG_EMPTY, SEG_MAIN, SEG_DELTA = 0, 1, 2
NEGATIVE_CLAUSE = -1
MAX_POSITIVE_CLAUSES = 31  # one bit each in a uint32 word (validated specs have <= 28) ...
NEGATED_BIT = np.uint32(1 << 31)  # ... whose top bit records a hit on the negative clause
DELTA_MERGE_FRACTION = 0.05  # merge the delta into main when it holds this share of main's slots
DELTA_MERGE_MIN = 4096  # ... but never for fewer delta ads than this
KM_PER_DEGREE_LAT = float(np.pi * EARTH_RADIUS_KM / 180.0)
LAT_BAND_MARGIN_KM = 1e-3  # keeps the band test strictly looser than the haversine test
DENSE_TOUCH_RATIO = 8  # more than 1/8 of the slots reached: check them in one sequential pass

_haversine = numba.njit(cache=True, nogil=True)(haversine_km)


# --- compiled form -> posting entries ------------------------------------------------------------------


def _entries(ct: CompiledTargeting, slots: np.ndarray):
    """Flat posting and circle entries of compiled ads placed at `slots` (int32[N]).

    Returns (terms int64[T], slot int32[T], clause int8[T], circle rows float64[Q,3], circle slot
    int32[Q], circle clause int8[Q])."""
    n_clauses = np.diff(ct.clause_ptr)
    ad_of_clause = np.repeat(np.arange(len(ct), dtype=np.int64), n_clauses)
    local = np.arange(len(ct.clause_negative), dtype=np.int64) - ct.clause_ptr[:-1][ad_of_clause]
    local = np.where(ct.clause_negative.astype(bool), NEGATIVE_CLAUSE, local).astype(np.int8)
    if len(ct) and int(ct.n_positive.max(initial=0)) > MAX_POSITIVE_CLAUSES:
        raise ValueError(f"an ad has more than {MAX_POSITIVE_CLAUSES} positive clauses")
    clause_of_term = np.repeat(np.arange(len(local), dtype=np.int64), np.diff(ct.term_ptr))
    clause_of_circle = np.repeat(np.arange(len(local), dtype=np.int64), np.diff(ct.circle_ptr))
    slot_of_clause = slots[ad_of_clause].astype(np.int32)
    return (
        ct.terms.astype(np.int64),
        slot_of_clause[clause_of_term],
        local[clause_of_term],
        ct.circles.reshape(-1, 3).astype(np.float64),
        slot_of_clause[clause_of_circle],
        local[clause_of_circle],
    )


def _csr(terms: np.ndarray, slot: np.ndarray, clause: np.ndarray):
    """Group entries by term: (unique terms int64[U], ptr int64[U+1], slot int32[T], clause int8[T]);
    within a term, entries are in slot order (memory order for the counting pass)."""
    order = np.lexsort((slot, terms))
    terms, slot, clause = terms[order], slot[order], clause[order]
    if len(terms):
        starts = np.flatnonzero(np.r_[True, terms[1:] != terms[:-1]])
    else:
        starts = np.empty(0, np.int64)
    ptr = np.r_[starts, len(terms)].astype(np.int64)
    return terms[starts].copy(), ptr, np.ascontiguousarray(slot, np.int32), np.ascontiguousarray(clause, np.int8)


def _starts(terms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unique terms and CSR pointers of flat entries already in term order."""
    starts = np.flatnonzero(np.r_[True, terms[1:] != terms[:-1]]) if len(terms) else np.empty(0, np.int64)
    return terms[starts].copy(), np.r_[starts, len(terms)].astype(np.int64)


class _Postings:
    """One segment's posting lists and circle list."""

    def __init__(self, terms, slot, clause, circles, circle_slot, circle_clause):
        self.terms, self.ptr, self.slot, self.clause = _csr(terms, slot, clause)
        order = np.argsort(circle_slot, kind="stable")
        self.circles = np.ascontiguousarray(circles[order], np.float64).reshape(-1, 3)
        self.circle_slot = np.ascontiguousarray(circle_slot[order], np.int32)
        self.circle_clause = np.ascontiguousarray(circle_clause[order], np.int8)

    @classmethod
    def ordered(cls, terms, slot, clause, circles, circle_slot, circle_clause) -> "_Postings":
        """From flat entries already sorted by (term, slot) and circles already sorted by slot: no sort."""
        self = cls.__new__(cls)
        self.terms, self.ptr = _starts(terms)
        self.slot, self.clause = np.ascontiguousarray(slot, np.int32), np.ascontiguousarray(clause, np.int8)
        self.circles = np.ascontiguousarray(circles, np.float64).reshape(-1, 3)
        self.circle_slot = np.ascontiguousarray(circle_slot, np.int32)
        self.circle_clause = np.ascontiguousarray(circle_clause, np.int8)
        return self

    def updated(self, stale: np.ndarray, added) -> "_Postings":
        """These postings less every entry of the slots in `stale` (int32, sorted), plus the flat
        entries `added` (the six arrays of `_entries`, in any order): one linear merge in compiled
        code, no sort of the whole segment (a writer refreshes the delta after every slice)."""
        a_terms, a_slot, a_clause, a_circles, a_cslot, a_cclause = self.flat()
        b_terms, b_slot, b_clause, b_circles, b_cslot, b_cclause = added
        order = np.lexsort((b_slot, b_terms))  # the few added entries: sorted alone
        terms, slot, clause = _merge_entries(a_terms, a_slot, a_clause, b_terms[order], b_slot[order],
                                             b_clause[order], stale)
        corder = np.argsort(b_cslot, kind="stable")
        keep = _not_in_sorted(a_cslot, stale)
        c_slot = np.concatenate([a_cslot[keep], b_cslot[corder]])
        cpos = np.argsort(c_slot, kind="stable")  # circles are few: a sort of them is cheap
        circles = np.concatenate([a_circles[keep], np.asarray(b_circles, np.float64).reshape(-1, 3)[corder]])
        c_clause = np.concatenate([a_cclause[keep], b_cclause[corder]])
        return _Postings.ordered(terms, slot, clause, circles[cpos], c_slot[cpos], c_clause[cpos])

    @classmethod
    def empty(cls) -> "_Postings":
        z = np.empty(0, np.int64)
        return cls(z, z.astype(np.int32), z.astype(np.int8), np.empty((0, 3)), z.astype(np.int32), z.astype(np.int8))

    def flat(self):
        """Back to flat entries (for a merge)."""
        terms = np.repeat(self.terms, np.diff(self.ptr))
        return terms, self.slot, self.clause, self.circles, self.circle_slot, self.circle_clause

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.terms, self.ptr, self.slot, self.clause, self.circles,
                                      self.circle_slot, self.circle_clause))


@numba.njit(cache=True, nogil=True)
def _in_sorted(values, x) -> bool:
    lo, hi = 0, values.shape[0]
    while lo < hi:
        mid = (lo + hi) // 2
        if values[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo < values.shape[0] and values[lo] == x


@numba.njit(cache=True, nogil=True)
def _not_in_sorted(slots, stale):
    """bool[n]: slots[i] is not in `stale` (sorted)."""
    keep = np.empty(slots.shape[0], np.bool_)
    for i in range(slots.shape[0]):
        keep[i] = not _in_sorted(stale, slots[i])
    return keep


@numba.njit(cache=True, nogil=True)
def _merge_entries(a_terms, a_slot, a_clause, b_terms, b_slot, b_clause, stale):
    """Two runs of flat entries, each sorted by (term, slot), merged into one; entries of `a` whose
    slot is in `stale` (sorted) are dropped."""
    n = a_terms.shape[0] + b_terms.shape[0]
    terms = np.empty(n, np.int64)
    slot = np.empty(n, np.int32)
    clause = np.empty(n, np.int8)
    i = j = k = 0
    na, nb = a_terms.shape[0], b_terms.shape[0]
    check = stale.shape[0] > 0
    while i < na or j < nb:
        if i < na and check and _in_sorted(stale, a_slot[i]):
            i += 1
            continue
        take_b = j < nb and (i >= na or b_terms[j] < a_terms[i]
                             or (b_terms[j] == a_terms[i] and b_slot[j] < a_slot[i]))
        if take_b:
            terms[k], slot[k], clause[k] = b_terms[j], b_slot[j], b_clause[j]
            j += 1
        else:
            terms[k], slot[k], clause[k] = a_terms[i], a_slot[i], a_clause[i]
            i += 1
        k += 1
    return terms[:k], slot[:k], clause[:k]


# --- the numba match kernel ------------------------------------------------------------------------------


@numba.njit(cache=True, nogil=True, inline="always")
def _hit(s, c, word, touched, n_touched):
    """Record that slot s satisfies its clause c (c < 0: its negative clause). Branch-free first
    touch: the slot is always written at the end of `touched` (capacity + 1 entries) and the end
    advances only when the slot's word was still zero."""
    touched[n_touched] = s
    n_touched += word[s] == 0
    if c < 0:
        word[s] |= NEGATED_BIT
    else:
        word[s] |= np.uint32(1) << np.uint32(c)
    return n_touched


@numba.njit(cache=True, nogil=True)
def _walk_postings(user_terms, p_terms, p_ptr, p_slot, p_clause, check_segment, seg_id, segment, word, touched,
                   n_touched):
    """Mark the clauses hit by every user term (both arrays sorted): a merge-style walk with a
    binary-search skip. With `check_segment`, entries of slots no longer in this segment are skipped
    (tombstones); a segment without dead entries skips the check."""
    i = 0
    j = 0
    nu = user_terms.shape[0]
    npt = p_terms.shape[0]
    while i < nu and j < npt:
        t = user_terms[i]
        pt = p_terms[j]
        if t < pt:
            i += 1
        elif pt < t:
            lo = j + 1
            hi = npt
            while lo < hi:
                mid = (lo + hi) >> 1
                if p_terms[mid] < t:
                    lo = mid + 1
                else:
                    hi = mid
            j = lo
        else:
            if check_segment:
                for e in range(p_ptr[j], p_ptr[j + 1]):
                    s = p_slot[e]
                    if segment[s] == seg_id:
                        n_touched = _hit(s, p_clause[e], word, touched, n_touched)
            else:
                for e in range(p_ptr[j], p_ptr[j + 1]):
                    n_touched = _hit(p_slot[e], p_clause[e], word, touched, n_touched)
            i += 1
            j += 1
    return n_touched


@numba.njit(cache=True, nogil=True)
def _walk_circles(lat, lon, circles, c_slot, c_clause, seg_id, segment, word, touched, n_touched):
    for e in range(c_slot.shape[0]):
        s = c_slot[e]
        if segment[s] != seg_id:
            continue
        c = c_clause[e]
        bit = NEGATED_BIT if c < 0 else np.uint32(1) << np.uint32(c)
        if word[s] & bit:
            continue  # this clause is already satisfied
        radius = circles[e, 2]
        # latitude band first: the great-circle distance is at least |delta latitude| * km per degree
        if abs(circles[e, 0] - lat) * KM_PER_DEGREE_LAT > radius + LAT_BAND_MARGIN_KM:
            continue
        if _haversine(lat, lon, circles[e, 0], circles[e, 1]) <= radius:
            n_touched = _hit(s, c, word, touched, n_touched)
    return n_touched


@numba.njit(cache=True, nogil=True)
def _popcount32(x):
    """Set bits of a uint32 word, by shifts and adds only: numba widens `uint32 * uint32` to 64
    bits, so the usual `(x * 0x01010101) >> 24` byte sum does not wrap and counts wrongly from nine
    set bits on."""
    x = x - ((x >> np.uint32(1)) & np.uint32(0x55555555))
    x = (x & np.uint32(0x33333333)) + ((x >> np.uint32(2)) & np.uint32(0x33333333))
    x = (x + (x >> np.uint32(4))) & np.uint32(0x0F0F0F0F)
    x = x + (x >> np.uint32(8))
    x = x + (x >> np.uint32(16))
    return x & np.uint32(0x3F)


@numba.njit(cache=True, nogil=True)
def _clauses_met(w, n_positive):
    """Every positive clause hit and the negative one not: a hit on the negative clause must be
    tested on its own, since with one positive clause missed the count of set bits is right again."""
    return (w & NEGATED_BIT) == 0 and _popcount32(w) == n_positive


@numba.njit(cache=True, nogil=True)
def _residual_ok(s, age, gender, publisher, device, os_, now, status, start_time, end_time, age_min, age_max,
                 gender_mask, publisher_mask, device_mask, os_mask):
    if status[s] != ACTIVE or not (start_time[s] <= now < end_time[s]):
        return False
    if not (age_min[s] <= age <= age_max[s]):
        return False
    if ((gender_mask[s] >> gender) & 1) == 0 or ((publisher_mask[s] >> publisher) & 1) == 0:
        return False
    return ((device_mask[s] >> device) & 1) != 0 and ((os_mask[s] >> os_) & 1) != 0


@numba.njit(cache=True, nogil=True)
def match_one(user_terms, age, gender, lat, lon, publisher, device, os_, now,
              m_terms, m_ptr, m_slot, m_clause, m_circles, m_cslot, m_cclause, m_check,
              d_terms, d_ptr, d_slot, d_clause, d_circles, d_cslot, d_cclause,
              zero_slots, segment, ad_id, n_positive, status, start_time, end_time, age_min, age_max,
              gender_mask, publisher_mask, device_mask, os_mask, word, touched):
    """Eligible slots of one request, ordered by ad id ascending (int32[m]).

    user_terms int64[U] sorted; m_*/d_*: main/delta postings (terms int64, ptr int64, slot int32,
    clause int8) and circles (float64[Q,3], slot int32, clause int8); m_check: main has dead entries;
    per-slot columns (int8 segment, int64 ad_id, int8 n_positive, ...); scratch: word uint32[cap]
    (bit c: positive clause c satisfied; NEGATED_BIT: the negative clause hit), touched int32[cap + 1];
    word is zero on entry and left zero on return.
    """
    n = 0
    n = _walk_postings(user_terms, m_terms, m_ptr, m_slot, m_clause, m_check, 1, segment, word, touched, n)
    n = _walk_postings(user_terms, d_terms, d_ptr, d_slot, d_clause, False, 2, segment, word, touched, n)
    n = _walk_circles(lat, lon, m_circles, m_cslot, m_cclause, 1, segment, word, touched, n)
    n = _walk_circles(lat, lon, d_circles, d_cslot, d_cclause, 2, segment, word, touched, n)
    out = np.empty(n + zero_slots.shape[0], np.int32)
    m = 0
    if n * DENSE_TOUCH_RATIO > word.shape[0]:
        # most slots were reached: one pass in slot order reads memory sequentially
        for s in range(word.shape[0]):
            w = word[s]
            if w != 0:
                word[s] = 0
                if (_clauses_met(w, n_positive[s])
                        and _residual_ok(s, age, gender, publisher, device, os_, now, status, start_time,
                                         end_time, age_min, age_max, gender_mask, publisher_mask, device_mask,
                                         os_mask)):
                    out[m] = s
                    m += 1
    else:
        for i in range(n):
            s = touched[i]
            w = word[s]
            if (_clauses_met(w, n_positive[s])
                    and _residual_ok(s, age, gender, publisher, device, os_, now, status, start_time, end_time,
                                     age_min, age_max, gender_mask, publisher_mask, device_mask, os_mask)):
                out[m] = s
                m += 1
            word[s] = 0
    for i in range(zero_slots.shape[0]):
        s = zero_slots[i]
        if segment[s] != 0 and _residual_ok(s, age, gender, publisher, device, os_, now, status, start_time,
                                            end_time, age_min, age_max, gender_mask, publisher_mask,
                                            device_mask, os_mask):
            out[m] = s
            m += 1
    out = out[:m]
    keys = np.empty(m, np.int64)
    ordered = True
    for i in range(m):
        keys[i] = ad_id[out[i]]
        if i and keys[i] < keys[i - 1]:
            ordered = False
    if ordered:  # slots laid out in id order (a fresh build from a sorted corpus)
        return out
    return out[np.argsort(keys)]


# the per-ad tests of the match, for a scan of compiled targeting without an index (benchmarks.copies)
residual_ok, in_sorted, haversine = _residual_ok, _in_sorted, _haversine


# --- the index ------------------------------------------------------------------------------------------

_COLUMNS = {  # per-slot residual columns: name -> (dtype, value of an empty slot)
    "ad_id": (np.int64, -1),
    "segment": (np.int8, SEG_EMPTY),
    "n_positive": (np.int8, 0),
    "status": (np.int8, STATUS_CODE["DELETED"]),
    "start_time": (np.int64, 0),
    "end_time": (np.int64, 0),
    "age_min": (np.int8, 0),
    "age_max": (np.int8, 0),
    "gender_mask": (np.uint8, 0),
    "publisher_mask": (np.uint8, 0),
    "device_mask": (np.uint8, 0),
    "os_mask": (np.uint8, 0),
}
_RESIDUALS = ("status", "start_time", "end_time", "age_min", "age_max", "gender_mask", "publisher_mask",
              "device_mask", "os_mask")


def _default_threads() -> int:
    return max(1, min(os.cpu_count() or 1, numba.config.NUMBA_NUM_THREADS))


class CpuTargetingIndex:
    """Inverted targeting index on the CPU (interfaces.TargetingIndex)."""

    def __init__(self, compiled: CompiledTargeting, *, threads: int | None = None, spare: float = 0.0):
        n = len(compiled)
        capacity = max(16, int(n * (1.0 + spare)))
        self._cols = {name: np.full(capacity, empty, dtype) for name, (dtype, empty) in _COLUMNS.items()}
        slots = np.arange(n, dtype=np.int32)
        self._store_columns(compiled, slots, SEG_MAIN)
        self._main = _Postings(*_entries(compiled, slots))
        self._delta_entries: dict[int, tuple] = {}  # slot -> flat entries of its current delta ad
        self._delta = _Postings.empty()
        self._delta_dirty = False
        self._delta_added: list[int] = []  # slots given entries since the delta postings were built
        self._delta_stale: set[int] = set()  # slots whose entries in those postings are dead since
        self._main_dead = 0  # main-segment slots whose postings are dead (retired or replaced)
        self._slot_of: dict[int, int] = dict(zip(compiled.ad_id.tolist(), range(n)))
        if len(self._slot_of) != n:
            raise ValueError("duplicate ad ids in the corpus")
        self._free: list[int] = list(range(capacity - 1, n - 1, -1))  # a stack: lowest slot first
        self._zero = set(np.flatnonzero(compiled.n_positive == 0).tolist())
        self._zero_arr = np.asarray(sorted(self._zero), np.int32)
        self._lock = threading.RLock()
        self.threads = threads or _default_threads()
        self._scratch = threading.local()
        self._pool: ThreadPoolExecutor | None = None
        self.merges = 0

    # --- interface ---------------------------------------------------------------------------------------
    @classmethod
    def build(cls, ads: Sequence[Ad], **options) -> "CpuTargetingIndex":
        return cls(compile_ads(ads), **options)

    @classmethod
    def from_compiled(cls, ct: CompiledTargeting, **options) -> "CpuTargetingIndex":
        """Build from compiled targeting (row i = one ad, slot i), as a stored corpus holds it
        (`Dataset.compiled`), with no ad parsed; the mirror of `GpuTargetingIndex.from_compiled`."""
        return cls(ct, **options)

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, ad_id: int) -> bool:
        return int(ad_id) in self._slot_of

    @property
    def capacity(self) -> int:
        return len(self._cols["ad_id"])

    def slot_of(self, ad_id: int) -> int:
        return self._slot_of[int(ad_id)]

    def match(self, requests: Sequence[Request]) -> list[np.ndarray]:
        """Eligible ad ids per request: int64, ascending."""
        return [ids for ids, _ in self.match_slots(requests)]

    def match_slots(self, requests: Sequence[Request]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per request (eligible ad ids int64 ascending, their slots int32 in the same order)."""
        encoded = [encode_request(r) for r in requests]
        with self._lock:
            self._refresh_delta()
            if len(encoded) <= 1 or self.threads == 1:
                return [self._match_encoded(e) for e in encoded]
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="cpu-index")
            return list(self._pool.map(self._match_encoded, encoded))

    def apply(self, update) -> None:
        """Apply one already-checked update (DESIGN section 6) without a rebuild."""
        with self._lock:
            if isinstance(update, Upsert):
                self._upsert(update.ad)
            elif isinstance(update, SetStatus):
                self._cols["status"][self._slot_of[int(update.ad_id)]] = STATUS_CODE[update.status]
            elif isinstance(update, Retire):
                self._retire(int(update.ad_id))
            else:
                raise TypeError(f"not an update: {update!r}")

    def apply_many(self, updates) -> None:
        """Apply already-checked updates in order, each run of upserts of distinct ads compiled and
        stored at once (`andromeda_nb.updates.upsert_runs`): the same state as `apply` of each in turn,
        for a fraction of the per-update Python and numpy work."""
        with self._lock:
            for group in upsert_runs(updates):
                if len(group) > 1:
                    self._upsert_many([update.ad for update in group])
                else:
                    self.apply(group[0])

    def refresh(self) -> None:
        """Bring the delta segment's postings up to date now (a writer calls it after a batch of
        updates, so that the next match does not pay for it)."""
        with self._lock:
            self._refresh_delta()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    @property
    def nbytes(self) -> int:
        return (sum(c.nbytes for c in self._cols.values()) + self._main.nbytes + self._delta.nbytes)

    def describe(self) -> dict:
        return {
            "ads": len(self),
            "capacity": self.capacity,
            "main_terms": int(len(self._main.terms)),
            "main_postings": int(len(self._main.slot)),
            "main_circles": int(len(self._main.circle_slot)),
            "delta_ads": len(self._delta_entries),
            "dead_main_slots": self._main_dead,
            "merges": self.merges,
            "bytes": int(self.nbytes),
        }

    # --- matching ----------------------------------------------------------------------------------------
    def _scratch_arrays(self):
        cap = self.capacity
        sc = getattr(self._scratch, "arrays", None)
        if sc is None or len(sc[0]) != cap:
            sc = (np.zeros(cap, np.uint32), np.zeros(cap + 1, np.int32))
            self._scratch.arrays = sc
        return sc

    def _match_encoded(self, e: EncodedRequest) -> tuple[np.ndarray, np.ndarray]:
        word, touched = self._scratch_arrays()
        c, m, d = self._cols, self._main, self._delta
        slots = match_one(
            e.terms, e.age, e.gender, e.latitude, e.longitude, e.publisher, e.device, e.os, e.time,
            m.terms, m.ptr, m.slot, m.clause, m.circles, m.circle_slot, m.circle_clause, self._main_dead > 0,
            d.terms, d.ptr, d.slot, d.clause, d.circles, d.circle_slot, d.circle_clause,
            self._zero_arr, c["segment"], c["ad_id"], c["n_positive"], c["status"], c["start_time"],
            c["end_time"], c["age_min"], c["age_max"], c["gender_mask"], c["publisher_mask"],
            c["device_mask"], c["os_mask"], word, touched,
        )
        return c["ad_id"][slots], slots

    # --- updates -----------------------------------------------------------------------------------------
    def _store_columns(self, ct: CompiledTargeting, slots: np.ndarray, segment: int) -> None:
        c = self._cols
        c["ad_id"][slots] = ct.ad_id
        c["segment"][slots] = segment
        c["n_positive"][slots] = ct.n_positive
        for name in _RESIDUALS:
            c[name][slots] = getattr(ct, name)

    def _grow(self) -> None:
        old = self.capacity
        new = old * 2
        for name, (dtype, empty) in _COLUMNS.items():
            col = np.full(new, empty, dtype)
            col[:old] = self._cols[name]
            self._cols[name] = col
        self._free.extend(range(new - 1, old - 1, -1))

    def _slot_for(self, ad_id: int) -> int:
        """The slot of `ad_id`: its own, or a free one for a new ad (the columns grown when none is
        free); a slot whose main postings this upsert leaves dead is counted."""
        slot = self._slot_of.get(ad_id)
        if slot is None:
            if not self._free:
                self._grow()
            slot = self._free.pop()
            self._slot_of[ad_id] = slot
        if self._cols["segment"][slot] == SEG_MAIN:
            self._main_dead += 1
        return slot

    def _upsert(self, ad: Ad) -> None:
        slot = self._slot_for(int(ad.ad_id))
        ct = compile_ads([ad])
        slots = np.asarray([slot], np.int32)
        self._store_columns(ct, slots, SEG_DELTA)  # main postings of this slot are now dead
        if slot in self._delta_entries:
            self._delta_stale.add(slot)
        self._delta_entries[slot] = _entries(ct, slots)
        self._delta_added.append(slot)
        self._set_zero(slot, int(ct.n_positive[0]) == 0)
        self._delta_dirty = True

    def _upsert_many(self, ads: Sequence[Ad]) -> None:
        """`_upsert` of each of `ads` (distinct ad ids), in order, with one compile, one column store and
        one entry computation for all of them (each slot's entries are then its share of them)."""
        slots = [self._slot_for(int(ad.ad_id)) for ad in ads]
        ct = compile_ads(ads)
        at = np.asarray(slots, np.int32)
        self._store_columns(ct, at, SEG_DELTA)
        entries = _entries(ct, at)
        term_at = ct.term_ptr[ct.clause_ptr].tolist()  # each ad's first entry, and the end
        circle_at = ct.circle_ptr[ct.clause_ptr].tolist()
        zero = (ct.n_positive == 0).tolist()
        for i, slot in enumerate(slots):
            if slot in self._delta_entries:
                self._delta_stale.add(slot)
            t = slice(term_at[i], term_at[i + 1])
            c = slice(circle_at[i], circle_at[i + 1])
            self._delta_entries[slot] = (entries[0][t], entries[1][t], entries[2][t], entries[3][c], entries[4][c],
                                         entries[5][c])
            self._delta_added.append(slot)
            self._set_zero(slot, zero[i])
        self._delta_dirty = True

    def _retire(self, ad_id: int) -> None:
        slot = self._slot_of.pop(ad_id)
        if self._cols["segment"][slot] == SEG_MAIN:
            self._main_dead += 1
        for name, (dtype, empty) in _COLUMNS.items():
            self._cols[name][slot] = empty
        if self._delta_entries.pop(slot, None) is not None:
            self._delta_stale.add(slot)
            self._delta_dirty = True
        self._set_zero(slot, False)
        self._free.append(slot)

    def _set_zero(self, slot: int, is_zero: bool) -> None:
        if is_zero == (slot in self._zero):
            return
        (self._zero.add if is_zero else self._zero.discard)(slot)
        self._zero_arr = np.asarray(sorted(self._zero), np.int32)

    def _refresh_delta(self) -> None:
        if not self._delta_dirty:
            return
        self._delta_dirty = False
        live_main = int(np.count_nonzero(self._cols["segment"] == SEG_MAIN))
        if len(self._delta_entries) > max(DELTA_MERGE_MIN, DELTA_MERGE_FRACTION * live_main):
            self.merge()
            return
        # incremental: the postings built last time, less the entries of slots replaced or retired
        # since, plus the entries added since (rebuilding from every delta ad cost a slice of updates
        # more than applying it)
        stale = np.sort(np.fromiter(self._delta_stale, np.int32, len(self._delta_stale)))
        added = [self._delta_entries[s] for s in dict.fromkeys(self._delta_added) if s in self._delta_entries]
        empty = _Postings.empty().flat()
        added_flat = tuple(_concat([p[i] for p in [empty, *added]], i) for i in range(6))
        self._delta = self._delta.updated(stale, added_flat)  # a linear merge: no sort of the whole delta
        self._delta_added.clear()
        self._delta_stale.clear()

    def merge(self) -> None:
        """Fold the delta segment into main: drop dead entries, sort the live ones by term."""
        with self._lock:
            seg = self._cols["segment"]
            m_terms, m_slot, m_clause, m_circles, m_cslot, m_cclause = self._main.flat()
            keep = seg[m_slot] == SEG_MAIN
            keep_c = seg[m_cslot] == SEG_MAIN
            parts = [(m_terms[keep], m_slot[keep], m_clause[keep], m_circles[keep_c], m_cslot[keep_c],
                      m_cclause[keep_c])] + list(self._delta_entries.values())
            self._main = _Postings(*(_concat([p[i] for p in parts], i) for i in range(6)))
            for slot in self._delta_entries:
                seg[slot] = SEG_MAIN
            self._delta_entries.clear()
            self._delta = _Postings.empty()
            self._delta_dirty = False
            self._delta_added.clear()
            self._delta_stale.clear()
            self._main_dead = 0
            self.merges += 1


def _concat(arrays: list[np.ndarray], field: int) -> np.ndarray:
    if field == 3:
        return np.concatenate([a.reshape(-1, 3) for a in arrays]) if arrays else np.empty((0, 3))
    return np.concatenate(arrays)


__all__ = ["CpuTargetingIndex", "match_one"]
