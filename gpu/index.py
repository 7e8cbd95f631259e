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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
from numba import njit

from andromeda_nb.compiled import (
    NULL_END,
    NULL_START,
    CompiledTargeting,
    EncodedRequest,
    compile_ads,
    encode_request,
)
from andromeda_nb.constants import ACTIVE, EARTH_RADIUS_KM, STATUS_CODE
from andromeda_nb.devices import notice, resolve
from andromeda_nb.geo import haversine_km
from andromeda_nb.slots import CHUNK_SLOTS, EMPTY, SlotAllocator
from andromeda_nb import jitcache
from andromeda_nb.types import Ad, Request, Retire, SetStatus, Update, Upsert

from . import runtime

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
    Returns (prog uint32[P], start int64[len(rows)], length int64[len(rows)]).
    """
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
        self._dirty = False

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

    def _refresh(self) -> None:
        if self._dirty:
            keys = np.fromiter(self._dense_of.keys(), np.int64, len(self._dense_of))
            vals = np.fromiter(self._dense_of.values(), np.int64, len(self._dense_of))
            order = np.argsort(keys)
            self._sorted, self._sorted_dense = keys[order], vals[order]
            self._dirty = False


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


@dataclass
class RequestBatch:
    """Device arrays of a batch of encoded requests, in the form the match kernels read (shapes in
    gpu/kernels/match.py). Built once, it can be matched many times (the benchmark does)."""

    n: int
    arrays: dict
    host_bytes: int

    @classmethod
    def build(cls, encoded: Sequence[EncodedRequest], vocab: Vocabulary, cuda, group: int,
              buffers: dict | None = None, extra: dict | None = None) -> "RequestBatch":
        """`group`: requests per group of the kernel (32 or 64), 0 for the per-request form of v1.
        `buffers`: device arrays kept from an earlier batch (name -> array), refilled in place when
        shape and dtype fit and replaced otherwise, so a serving loop allocates and frees nothing per
        request; the batch is then valid only until the next one built on the same buffers."""
        n = len(encoded)
        dense = [vocab.lookup(e.terms) for e in encoded]
        host: dict[str, np.ndarray] = {}
        if group:
            word = np.uint32 if group <= 32 else np.uint64
            groups = max(1, -(-n // group))
            rtab = np.zeros((groups, max(1, len(vocab))), word)
            ftab = np.zeros((groups, _ftab_words()), word)
            rtime = np.zeros((groups, group), np.int64)
            rpos = np.full((groups, group, 2), np.nan, np.float64)
            nreq = np.zeros(groups, np.int32)
            for g in range(groups):
                part = encoded[g * group:(g + 1) * group]
                nreq[g] = len(part)
                if not part:
                    continue
                ftab[g] = residual_tables(part).astype(word)
                for r, e in enumerate(part):
                    rtab[g, dense[g * group + r]] |= word(1 << r)
                    rtime[g, r] = e.time
                    rpos[g, r] = (e.latitude, e.longitude)
            host = {"rtab": rtab, "ftab": ftab, "rtime": rtime, "rpos": rpos, "nreq": nreq}
        else:
            lengths = np.asarray([len(d) for d in dense], np.int64)
            host = {
                "rscal": np.asarray([[e.age, e.gender, e.publisher, e.device, e.os, e.time] for e in encoded],
                                    np.int64).reshape(n, 6),
                "rpos1": np.asarray([[e.latitude, e.longitude] for e in encoded], np.float64).reshape(n, 2),
                "rterm_ptr": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                "rterms": (np.concatenate(dense) if n else np.empty(0)).astype(np.uint32),
            }
            if len(host["rterms"]) == 0:
                host["rterms"] = np.zeros(1, np.uint32)
        host.update(extra or {})
        arrays = _upload_packed(host, cuda, buffers if buffers is not None else {})
        return cls(n=n, arrays=arrays, host_bytes=sum(v.nbytes for v in host.values()))


_haversine_host = njit(cache=True)(haversine_km)


def _unit_vectors(lat, lon) -> np.ndarray:
    """float64 (N, 3) unit vectors of points given in degrees (NaN rows for NaN points)."""
    p, l = np.radians(np.asarray(lat, np.float64)), np.radians(np.asarray(lon, np.float64))
    return np.ascontiguousarray(np.stack([np.cos(p) * np.cos(l), np.cos(p) * np.sin(l), np.sin(p)], axis=1))


@njit(cache=True)
def _fill_circle_table(circles, order, sorted_lat, sorted_vec, band, chord2, lat, lon, vec, group, table):
    """Set bit r % group of table[r // group, q] for every request r inside circle q. circles
    float64[Q, 3] (lat, lon, radius km); order int64[Q] sorts them by latitude; sorted_lat,
    sorted_vec (Q, 3) their latitudes and unit vectors in that order; lat, lon float64[R] and their
    unit vectors vec (R, 3) (NaN: no location, inside no circle). The exact test is the oracle's."""
    for r in range(lat.shape[0]):
        la = lat[r]
        lo = lon[r]
        if la != la or lo != lo:
            continue
        g = r // group
        bit = np.uint64(1) << np.uint64(r % group)
        first = np.searchsorted(sorted_lat, la - band)
        last = np.searchsorted(sorted_lat, la + band, side="right")
        for i in range(first, last):
            dx = vec[r, 0] - sorted_vec[i, 0]
            dy = vec[r, 1] - sorted_vec[i, 1]
            dz = vec[r, 2] - sorted_vec[i, 2]
            if dx * dx + dy * dy + dz * dz > chord2:
                continue
            q = order[i]
            if _haversine_host(la, lo, circles[q, 0], circles[q, 1]) <= circles[q, 2]:
                table[g, q] |= bit


UPLOAD_ALIGN = 16  # bytes: every array of a packed upload starts at a multiple of this


def _upload_packed(host: dict[str, np.ndarray], cuda, buffers: dict) -> dict:
    """Copy the arrays `host` (name -> array) to the device in one transfer: they are packed into one
    pinned staging buffer at 16-byte aligned offsets, copied with one host-to-device copy, and
    returned as typed views of one device buffer. `buffers` keeps the staging and device buffers
    ("host", "device") for the next call, which reuses them when they are large enough: a serving
    loop then allocates nothing per request (allocations and frees synchronize the device)."""
    layout, end = {}, 0
    for name, value in host.items():
        value = np.ascontiguousarray(value)
        layout[name] = (end, value)
        end += -(-value.nbytes // UPLOAD_ALIGN) * UPLOAD_ALIGN
    size = max(end, UPLOAD_ALIGN)
    if buffers.get("host") is None or buffers["host"].size < size:
        buffers["host"] = cuda.pinned_array(size, np.uint8)
        buffers["device"] = cuda.device_array(size, np.uint8)
        buffers["views"] = None
    staging, device = buffers["host"], buffers["device"]
    for offset, value in layout.values():
        staging[offset:offset + value.nbytes] = value.reshape(-1).view(np.uint8)
    # typed views of the device buffer: the same for every batch of the same layout (a serving loop's
    # batches mostly are), and made only when the layout changes
    key = (size, tuple((name, offset, value.shape, value.dtype.str) for name, (offset, value) in layout.items()))
    if buffers.get("views") is None or buffers["views"][0] != key:
        views = {name: device[offset:offset + value.nbytes].view(value.dtype).reshape(value.shape)
                 for name, (offset, value) in layout.items()}
        buffers["views"] = (key, device[:size], views)
    _, used, views = buffers["views"]
    used.copy_to_device(staging[:size])  # stream-ordered after any kernel still reading it
    return dict(views)


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
        self._request_buffers: dict = {}  # staging, device buffer and views of prepare(..., reuse=True)
        self._outputs: dict[int, object] = {}  # requests -> output array (kept_output)
        self.updates_applied = 0
        self.compactions = 0

    # --- construction --------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The number of the match kernel this index runs."""
        return self.kernel_version.number

    def _kernel(self, version=None):
        return self.kernel_version if version is None else self._k.version(version)

    @classmethod
    def build(cls, ads: Sequence[Ad], *, device: str = "auto", version=None,
              spare: float = 0.0, chunk_slots: int = CHUNK_SLOTS) -> "GpuTargetingIndex":
        ads = list(ads)
        ids = [a.ad_id for a in ads]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate ad ids in the corpus")
        return cls.from_compiled(compile_ads(ads), device=device, version=version, spare=spare,
                                 chunk_slots=chunk_slots)

    @classmethod
    def from_compiled(cls, ct: CompiledTargeting, *, device: str = "auto", version=None,
                      spare: float = 0.0, chunk_slots: int = CHUNK_SLOTS) -> "GpuTargetingIndex":
        """Build from compiled targeting (row i = one ad); slot order groups the ads by format.
        `spare`: fraction of free slots kept per format for inserts; `chunk_slots` (a multiple of
        32): slots per format chunk (smaller than CHUNK_SLOTS only for tiny simulator pools)."""
        if chunk_slots % 32:
            raise ValueError(f"chunk_slots must be a multiple of 32, got {chunk_slots}")
        if len(np.unique(ct.ad_id)) != len(ct):
            raise ValueError("duplicate ad ids in the corpus")
        index = cls(device=device, version=version)
        slots = SlotAllocator.from_ads(ct.ad_id, ct.format, chunk_slots=chunk_slots, spare=spare)
        index.vocab = Vocabulary(ct.terms)
        dense_terms = index.vocab.dense_bulk(ct.terms)
        used = np.flatnonzero(slots.slot_ad_id != EMPTY)
        by_id = np.argsort(ct.ad_id, kind="stable")
        rows = by_id[np.searchsorted(ct.ad_id, slots.slot_ad_id[used], sorter=by_id)].astype(np.int64)
        prog, start, length = clause_programs(ct, rows, dense_terms)
        index._install(slots, used, resid_words(ct, rows), start, length, prog,
                       ct.start_time[rows], ct.end_time[rows], ct.circles)
        return index

    def _install(self, slots: SlotAllocator, used: np.ndarray, resid: np.ndarray, start: np.ndarray,
                 length: np.ndarray, prog: np.ndarray, start_time: np.ndarray, end_time: np.ndarray,
                 circles: np.ndarray) -> None:
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
        cuda = self._cuda
        self.d_resid = cuda.to_device(self.resid_h)
        self.d_ptr = cuda.to_device(self.ptr_h)
        self.d_sched = cuda.to_device(self.sched_h)
        self.prog_used = len(prog)
        self.prog_garbage = 0
        self.d_prog = cuda.to_device(np.concatenate([prog, np.zeros(max(1, len(prog) // 8), np.uint32)]))
        self.circles_used = len(circles)
        room = np.zeros((max(1, len(circles) // 8 + 1), 3), np.float64)
        self.circles_h = np.ascontiguousarray(np.asarray(circles, np.float64).reshape(-1, 3))
        self._circle_lookup = None  # (order by latitude, sorted latitudes, band in degrees), made on demand
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
        arrays = (self.d_resid, self.d_ptr, self.d_sched, self.d_prog, self.d_circles)
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
        }

    def _index_arrays(self):
        cap = self.capacity
        return (self.d_resid[:cap], self.d_ptr[:cap], self.d_prog, self.d_sched[:cap], self.d_circles)

    # --- matching ------------------------------------------------------------------------------------
    def prepare(self, encoded: Sequence[EncodedRequest], version=None, *, reuse: bool = False) -> RequestBatch:
        """Upload a batch of encoded requests in the form kernel `version` reads. With `reuse` the
        upload goes into device buffers this index keeps from the last such call (no allocation), and
        the batch is valid until the next `prepare(..., reuse=True)`."""
        recipe = self._kernel(version).recipe
        encoded = list(encoded)
        group = recipe.group
        extra = {"ctab": self.circle_table(encoded, group)} if recipe.circle_table else None
        return RequestBatch.build(encoded, self.vocab, self._cuda, group,
                                  self._request_buffers if reuse else None, extra)

    def circle_table(self, encoded: Sequence[EncodedRequest], group: int) -> np.ndarray:
        """uint64[G, max(1, Q)]: bit r of [g, q] = request group * g + r is inside custom location q
        (every circle of the device table, live or not). Decided on the host with the float64
        great-circle distance the oracle and the CPU index use, so kernels that read this table
        need no trigonometry; only circles in a latitude band around each user are tested."""
        if self._circle_lookup is None:
            circles = self.circles_h
            order = np.argsort(circles[:, 0], kind="stable").astype(np.int64)
            max_angle = min(float(circles[:, 2].max()) / EARTH_RADIUS_KM, np.pi) if len(circles) else 0.0
            # Two filters that can only let too much through, widened far past float64 rounding: the
            # great-circle distance is at least the latitude difference along a meridian (the band),
            # and a circle holds the user only if the chord between the unit vectors of user and centre
            # is at most the chord of the largest radius. What passes both gets the exact distance.
            band = np.degrees(max_angle) * (1.0 + 1e-6) + 1e-9
            chord2 = (2.0 * np.sin(max_angle / 2.0)) ** 2 * (1.0 + 1e-6) + 1e-12
            sorted_vec = _unit_vectors(circles[order, 0], circles[order, 1])
            self._circle_lookup = (order, np.ascontiguousarray(circles[order, 0]), sorted_vec, band, chord2)
        order, sorted_lat, sorted_vec, band, chord2 = self._circle_lookup
        n = len(encoded)
        table = np.zeros((max(1, -(-n // group)), max(1, len(self.circles_h))), np.uint64)
        if n and len(self.circles_h):
            lat = np.asarray([e.latitude for e in encoded], np.float64)
            lon = np.asarray([e.longitude for e in encoded], np.float64)
            _fill_circle_table(self.circles_h, order, sorted_lat, sorted_vec, band, chord2,
                               lat, lon, _unit_vectors(lat, lon), group, table)
        return table

    def new_output(self, n_requests: int):
        """A device array for match output: uint32[n_requests, capacity // 32]."""
        return self._cuda.device_array((n_requests, self.capacity // 32), np.uint32)

    def kept_output(self, n_requests: int):
        """An output array for `n_requests` that the index keeps and hands out again (remade when the
        capacity grows): for a serving loop, which uses up one answer before asking the next."""
        out = self._outputs.get(n_requests)
        if out is None or tuple(out.shape) != (n_requests, self.capacity // 32):
            out = self._outputs[n_requests] = self.new_output(n_requests)
        return out

    def run(self, batch: RequestBatch, out, version=None) -> None:
        """Launch the match kernel on a prepared batch (asynchronous, like any kernel launch)."""
        self._k.launch(self._kernel(version), self._index_arrays(), batch.arrays, out)

    def match_slots(self, encoded: Sequence[EncodedRequest], version=None, *, out=None):
        """Eligibility of every slot for each request: a device array uint32[B, capacity // 32]
        in the layout at the top of this module; written into `out` when given (a device array of
        that shape, e.g. `kept_output`), else into a new one. The request upload reuses the
        index's device buffers (`prepare(..., reuse=True)`)."""
        encoded = list(encoded)
        want = (len(encoded), self.capacity // 32)
        if out is None:
            out = self.new_output(len(encoded))
        elif tuple(out.shape) != want or out.dtype != np.uint32:
            raise ValueError(f"out: expected a uint32 device array of shape {want}, got {out.dtype} {tuple(out.shape)}")
        if encoded and self.capacity:  # no slots (built from no ads): nothing to launch over
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
        for i in range(0, len(requests), batch):
            encoded = [encode_request(r) for r in requests[i:i + batch]]
            words = self.match_slots(encoded).copy_to_host()
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
                if ad.ad_id in slots and slots.format_of_slot(slots.slot_of(ad.ad_id)) == ad.format:
                    slot = slots.slot_of(ad.ad_id)
                else:
                    if ad.ad_id in slots:
                        changed.add(self._clear_slot(slots.release(ad.ad_id)))
                    slot, grew = slots.allocate(ad.ad_id, ad.format)
                    if grew:
                        self._grow_host(slots.capacity)
                self.prog_garbage += int(self.len_h[slot])
                ct = compile_ads([ad])
                prog, _, length = clause_programs(ct, np.zeros(1, np.int64), self.vocab.dense(ct.terms), circle_end)
                new_words.append(prog)
                new_circles.append(ct.circles)
                self.resid_h[slot] = resid_words(ct)[0]
                self.ptr_h[slot] = word_end
                self.len_h[slot] = length[0]
                self.sched_h[slot] = (ct.start_time[0], ct.end_time[0])
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
        return slot

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
