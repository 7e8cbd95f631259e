"""CPU scorer: the DESIGN section 3 formula over a candidate list, numba-parallel, fp32/fp16/int8.

Per request the user side is folded into the per-format tables the GPU kernels read too
(`andromeda_nb.scoring.fold_tables`: `tab` float32 (F, table_width(E, D)), one row per format with
the E gate rows, the E expert rows, then the E + E constant terms; that module's docstring has the
layout). Per candidate the kernel converts the stored row to float32 once (int8: sign-extend; fp16:
the F16C conversion through a small LLVM intrinsic, since numba has no float16 type on the CPU) and
runs the per-ad formula on it: E gate dot products, top-k routing, k expert dot products,
softmax-weighted sum. Arithmetic is float32 (DESIGN section 4's default mode).

Storage arrays: `values` (N, D) float32 | uint16 (fp16 bits) | int8, `scale` float32 (N,), `formats`
int16 (N,). Candidates are row numbers (int32 or int64) into them.

The scorer ships `SHIPPED`, version 5: numba `prange` over blocks of candidates; per block, for E = 6
the 12 dot products as 12 accumulators of one vectorized loop over the row, and the top-2 routing
for 64 ads at once as branch-free selections vectorized over the ads. Other E or top_k fall back to
the per-ad loops of versions 4 (the 12 accumulators, top-2 with one exp) and 3 (all 2E dot products,
then routing), which are kept here for that. Single-core CPU time per ad on the development machine
(AMD EPYC, AVX2), int8: v3 ~115 ns, v4 ~80 ns, v5 ~53 ns; the dot products alone take ~40 ns of it
(compute-bound: 768 FMAs per ad). Versions 1 to 4 as versions of their own (serial, and `prange`
drivers of each per-ad loop) are in the lab, `cpu_baseline/lab/scorer.py`; every version is checked
against `andromeda_nb.reference` in tests/cpu_baseline/test_cpu_scorer.py and timed by `andromeda bench cpu`.

A version runs one per-ad loop `score_range(values, scale, formats, rows, tab, E, top_k, out, lo, hi)`
through two drivers made from one template (`candidate_drivers`): a `prange` over blocks of
BLOCK_CANDIDATES candidates, and a serial one for short lists.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Sequence

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from andromeda_nb import jitcache
from andromeda_nb.budget import stored_ad_bytes
from andromeda_nb.constants import DEFAULT_E
from andromeda_nb.model import PRECISION_OF_DTYPE
from andromeda_nb.scoring import fold_tables, table_experts, table_width
from andromeda_nb.templates import specialize
from andromeda_nb.versions import Version, pick, version_table

jitcache.install()  # cached code is recompiled when any project source changes

UNROLLED_E = DEFAULT_E  # version 4 is written out for this many experts (12 accumulators)
ROUTE_BLOCK = 64  # version 5 routes this many ads together
PARALLEL_MIN_CANDIDATES = 4096  # below this, one thread is faster than waking the pool
BLOCK_CANDIDATES = 1024  # candidates per prange block


@intrinsic
def _half_bits_to_float(typingctx, bits):
    """uint16 IEEE half bits -> float32 (LLVM fpext; vcvtph2ps on x86 with F16C)."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


def to_float32(x):
    """A stored element as float32 (compiled through the overload below)."""
    return np.float32(x)


@overload(to_float32)
def _to_float32_overload(x):
    if x == types.uint16:  # fp16 storage, as its bits
        return lambda x: _half_bits_to_float(x)
    return lambda x: np.float32(x)


@numba.njit(cache=True, nogil=True, fastmath=True)
def score_range_all_dots(values, scale, formats, rows, tab, E, top_k, out, lo, hi):
    """The same formula with all 2E dot products in one pass over the row (no data-dependent
    row choice between the gate and the expert products), then routing on the results."""
    E2 = 2 * E
    D = values.shape[1]
    c = E2 * D  # the constant terms qb, ub follow the 2E rows of D
    buf = np.empty(D, np.float32)
    acc = np.empty(E2, np.float32)
    sel = np.empty(top_k, np.int64)
    for i in range(lo, hi):
        row = rows[i]
        f = formats[row]
        sc = scale[row]
        for d in range(D):
            buf[d] = to_float32(values[row, d])
        for j in range(E2):
            a = np.float32(0.0)
            base = j * D
            for d in range(D):
                a += tab[f, base + d] * buf[d]
            acc[j] = a * sc + tab[f, c + j]
        for j in range(top_k):  # top_k largest gate logits, ties to the lower expert
            best = -1
            for e in range(E):
                taken = False
                for t in range(j):
                    if sel[t] == e:
                        taken = True
                if not taken and (best < 0 or acc[e] > acc[best]):
                    best = e
            sel[j] = best
        top = acc[sel[0]]
        den = 0.0
        num = 0.0
        for j in range(top_k):
            w = math.exp(acc[sel[j]] - top)
            den += w
            num += w * acc[E + sel[j]]
        out[i] = num / den



@numba.njit(cache=True, nogil=True, fastmath=True)
def score_range_unrolled(values, scale, formats, rows, tab, E, top_k, out, lo, hi):
    """E == 6 (the default, `DEFAULT_E`): the 12 dot products as 12 scalar accumulators in one loop
    over the row, which LLVM vectorizes over d (12 vector FMAs per 8 elements, the row converted
    once per 8 elements); top-2 routing as two arg-max passes and one exp. Other E or top_k fall
    back to the all-dots loop."""
    if E != UNROLLED_E:
        score_range_all_dots(values, scale, formats, rows, tab, E, top_k, out, lo, hi)
        return
    E = UNROLLED_E  # a compile-time constant for the loops below
    D = values.shape[1]
    c = 2 * E * D  # the constant terms qb, ub follow the 2E rows of D
    buf = np.empty(D, np.float32)
    acc = np.empty(2 * E, np.float32)
    sel = np.empty(top_k, np.int64)
    for i in range(lo, hi):
        row = rows[i]
        f = formats[row]
        sc = scale[row]
        for d in range(D):
            buf[d] = to_float32(values[row, d])
        Tf = tab[f]
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = a8 = a9 = a10 = a11 = np.float32(0.0)
        for d in range(D):
            x = buf[d]
            a0 += Tf[d] * x
            a1 += Tf[D + d] * x
            a2 += Tf[2 * D + d] * x
            a3 += Tf[3 * D + d] * x
            a4 += Tf[4 * D + d] * x
            a5 += Tf[5 * D + d] * x
            a6 += Tf[6 * D + d] * x
            a7 += Tf[7 * D + d] * x
            a8 += Tf[8 * D + d] * x
            a9 += Tf[9 * D + d] * x
            a10 += Tf[10 * D + d] * x
            a11 += Tf[11 * D + d] * x
        acc[0], acc[1], acc[2], acc[3], acc[4], acc[5] = a0, a1, a2, a3, a4, a5
        acc[6], acc[7], acc[8], acc[9], acc[10], acc[11] = a6, a7, a8, a9, a10, a11
        for j in range(2 * E):
            acc[j] = acc[j] * sc + Tf[c + j]
        if top_k == 2:
            b0 = 0
            g0 = acc[0]
            for e in range(1, E):  # strict '>': ties keep the lower expert
                if acc[e] > g0:
                    g0 = acc[e]
                    b0 = e
            b1 = -1
            g1 = -np.inf
            for e in range(E):
                if e != b0 and acc[e] > g1:
                    g1 = acc[e]
                    b1 = e
            w = math.exp(g1 - g0)  # softmax of two logits: weights 1/(1+w), w/(1+w)
            out[i] = (acc[E + b0] + w * acc[E + b1]) / (1.0 + w)
            continue
        for j in range(top_k):
            best = -1
            for e in range(E):
                taken = False
                for t in range(j):
                    if sel[t] == e:
                        taken = True
                if not taken and (best < 0 or acc[e] > acc[best]):
                    best = e
            sel[j] = best
        top = acc[sel[0]]
        den = 0.0
        num = 0.0
        for j in range(top_k):
            w = math.exp(acc[sel[j]] - top)
            den += w
            num += w * acc[E + sel[j]]
        out[i] = num / den



@numba.njit(cache=True, nogil=True, fastmath=True)
def _score_range_blocked(values, scale, formats, rows, tab, E, top_k, out, lo, hi):
    """E == 6 and top_k == 2: version 4's dot products for a block of ROUTE_BLOCK ads into a
    (12, block) table, then the top-2 routing as branch-free running selections with the ads as
    the inner (vectorized) loop: no unpredictable branches per ad. Other sizes fall back to 4."""
    if E != UNROLLED_E or top_k != 2:
        score_range_unrolled(values, scale, formats, rows, tab, E, top_k, out, lo, hi)
        return
    E = UNROLLED_E  # a compile-time constant for the loops below
    D = values.shape[1]
    c = 2 * E * D  # the constant terms qb, ub follow the 2E rows of D
    buf = np.empty(D, np.float32)
    acc = np.empty((2 * E, ROUTE_BLOCK), np.float32)
    g0 = np.empty(ROUTE_BLOCK, np.float32)
    s0 = np.empty(ROUTE_BLOCK, np.float32)
    g1 = np.empty(ROUTE_BLOCK, np.float32)
    s1 = np.empty(ROUTE_BLOCK, np.float32)
    for start in range(lo, hi, ROUTE_BLOCK):
        n = min(ROUTE_BLOCK, hi - start)
        for t in range(n):
            row = rows[start + t]
            f = formats[row]
            sc = scale[row]
            for d in range(D):
                buf[d] = to_float32(values[row, d])
            Tf = tab[f]
            a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = a8 = a9 = a10 = a11 = np.float32(0.0)
            for d in range(D):
                x = buf[d]
                a0 += Tf[d] * x
                a1 += Tf[D + d] * x
                a2 += Tf[2 * D + d] * x
                a3 += Tf[3 * D + d] * x
                a4 += Tf[4 * D + d] * x
                a5 += Tf[5 * D + d] * x
                a6 += Tf[6 * D + d] * x
                a7 += Tf[7 * D + d] * x
                a8 += Tf[8 * D + d] * x
                a9 += Tf[9 * D + d] * x
                a10 += Tf[10 * D + d] * x
                a11 += Tf[11 * D + d] * x
            acc[0, t] = a0 * sc + Tf[c + 0]
            acc[1, t] = a1 * sc + Tf[c + 1]
            acc[2, t] = a2 * sc + Tf[c + 2]
            acc[3, t] = a3 * sc + Tf[c + 3]
            acc[4, t] = a4 * sc + Tf[c + 4]
            acc[5, t] = a5 * sc + Tf[c + 5]
            acc[6, t] = a6 * sc + Tf[c + 6]
            acc[7, t] = a7 * sc + Tf[c + 7]
            acc[8, t] = a8 * sc + Tf[c + 8]
            acc[9, t] = a9 * sc + Tf[c + 9]
            acc[10, t] = a10 * sc + Tf[c + 10]
            acc[11, t] = a11 * sc + Tf[c + 11]
        # running top-2 over experts in ascending order; strict '>' keeps the lower expert on ties
        for t in range(n):
            g0[t] = acc[0, t]
            s0[t] = acc[E, t]
            g1[t] = -np.inf
            s1[t] = 0.0
        for e in range(1, E):
            for t in range(n):
                g = acc[e, t]
                sv = acc[E + e, t]
                first = g > g0[t]
                second = g > g1[t]
                ng1 = g0[t] if first else (g if second else g1[t])
                ns1 = s0[t] if first else (sv if second else s1[t])
                g0[t] = g if first else g0[t]
                s0[t] = sv if first else s0[t]
                g1[t] = ng1
                s1[t] = ns1
        for t in range(n):
            w = math.exp(g1[t] - g0[t])  # softmax of two logits: weights 1/(1+w), w/(1+w)
            out[start + t] = (s0[t] + w * s1[t]) / (1.0 + w)




# --- the drivers: one template, two forms per per-ad loop -----------------------------------------------
score_range = None  # bound per version by `candidate_drivers`: the per-ad loop over rows[lo:hi]


def _parallel_template(values, scale, formats, rows, tab, E, top_k, out):
    """Blocks of BLOCK_CANDIDATES candidates spread over numba's threads; out[i] = score of stored row
    rows[i] (float32 out (C,))."""
    n = rows.shape[0]
    blocks = (n + BLOCK_CANDIDATES - 1) // BLOCK_CANDIDATES
    for b in numba.prange(blocks):
        lo = b * BLOCK_CANDIDATES
        hi = min(n, lo + BLOCK_CANDIDATES)
        score_range(values, scale, formats, rows, tab, E, top_k, out, lo, hi)


def _serial_template(values, scale, formats, rows, tab, E, top_k, out):
    """Every candidate on the calling thread; out[i] = score of stored row rows[i]."""
    score_range(values, scale, formats, rows, tab, E, top_k, out, 0, rows.shape[0])


@dataclass(frozen=True)
class CandidateDrivers:
    """How a version scores a candidate list: `parallel` for long lists, `serial` below
    PARALLEL_MIN_CANDIDATES (one thread is faster than waking the pool). Both take (values, scale,
    formats, rows, tab, E, top_k, out)."""

    parallel: object
    serial: object


def candidate_drivers(per_ad_loop, suffix: str) -> CandidateDrivers:
    """The drivers `score_parallel{suffix}` and `score_serial{suffix}` of a per-ad loop."""
    parallel = specialize(_parallel_template, f"score_parallel{suffix}", score_range=per_ad_loop)
    serial = specialize(_serial_template, f"score_serial{suffix}", score_range=per_ad_loop)
    return CandidateDrivers(numba.njit(cache=True, parallel=True)(parallel), numba.njit(cache=True, nogil=True)(serial))


VERSIONS = version_table(
    Version(5, "v5 blocked routing", "prange blocks; E = 6: 12 accumulators, top-2 routing of 64 ads at once as "
            "branch-free selections (other E or top_k: v4's, then v3's per-ad loop)",
            candidate_drivers(_score_range_blocked, "_blocked")),
)
SHIPPED = 5


def version(v=None) -> Version:
    """The Version `v` names (a number of `VERSIONS`, a Version from the lab, None: SHIPPED)."""
    return pick(VERSIONS, v, SHIPPED, "CPU scorer")


def storage_view(values: np.ndarray) -> np.ndarray:
    """The array the kernels read: float16 storage as its uint16 bits, others unchanged."""
    values = np.ascontiguousarray(values)
    return values.view(np.uint16) if values.dtype == np.float16 else values


class CpuScorer:
    """Stored embeddings plus formats; scores candidate rows for one request's user side.

    `values` (N, D) float32 | float16 | int8, `scale` float32 (N,), `formats` int (N,), `top_k`.
    Rows can be added or replaced (`set_row`) for updates; capacity grows by doubling.
    """

    def __init__(self, values: np.ndarray, scale: np.ndarray, formats: np.ndarray, top_k: int,
                 *, version=None):
        self.dtype = np.dtype(values.dtype)
        # own, writable copies: updates write rows (tables loaded from Arrow or a pickle are read-only)
        self._values = storage_view(np.array(values, copy=True))
        self._scale = np.array(scale, np.float32, copy=True)
        self._formats = np.array(formats, np.int16, copy=True)
        self.rows = len(self._values)
        self.top_k = int(top_k)
        self.kernel_version = pick(VERSIONS, version, SHIPPED, "CPU scorer")
        self.drivers: CandidateDrivers = self.kernel_version.recipe

    @classmethod
    def from_table(cls, table, formats, top_k: int, **options) -> "CpuScorer":
        """From an `andromeda_nb.model.EmbeddingTable`."""
        return cls(table.values, table.scale, formats, top_k, **options)

    @property
    def D(self) -> int:
        return self._values.shape[1]

    @property
    def capacity(self) -> int:
        return len(self._values)

    @property
    def version(self) -> int:
        """The number of the scorer version this scorer runs."""
        return self.kernel_version.number

    @property
    def bytes_per_row(self) -> int:
        return stored_ad_bytes(PRECISION_OF_DTYPE[self.dtype], self.D)

    def driver(self, n_candidates: int):
        """The driver that scores `n_candidates` candidates: serial below PARALLEL_MIN_CANDIDATES."""
        return self.drivers.serial if n_candidates < PARALLEL_MIN_CANDIDATES else self.drivers.parallel

    def _fit(self, row: int) -> None:
        """Grow the arrays (by doubling) when `row` is past the end."""
        if row >= self.capacity:
            new = max(row + 1, 2 * self.capacity, 16)
            for name in ("_values", "_scale", "_formats"):
                old = getattr(self, name)
                grown = np.zeros((new,) + old.shape[1:], old.dtype)
                grown[: len(old)] = old
                setattr(self, name, grown)

    def set_row(self, row: int, values: np.ndarray, scale: float, fmt: int) -> None:
        """Store one row (grows the arrays when `row` is past the end)."""
        self._fit(row)
        self._values[row] = storage_view(np.asarray(values, self.dtype).reshape(1, -1))[0]
        self._scale[row] = scale
        self._formats[row] = fmt
        self.rows = max(self.rows, row + 1)

    def set_rows(self, rows: Sequence[int], values: np.ndarray, scale: np.ndarray, fmt: Sequence[int]) -> None:
        """`set_row` of each of `rows` (distinct) at once: values (n, D) of the storage dtype, scale
        float32 (n,), formats (n,)."""
        for row in rows:  # grown as `set_row` in turn would grow them
            self._fit(row)
        at = np.asarray(rows, np.int64)
        self._values[at] = storage_view(np.asarray(values, self.dtype).reshape(len(at), -1))
        self._scale[at] = scale
        self._formats[at] = fmt
        self.rows = max(self.rows, int(at.max(initial=-1)) + 1)

    def score(self, rows: np.ndarray, tab: np.ndarray) -> np.ndarray:
        """float32 (C,) scores of the candidate rows (int32/int64 (C,)) for one request's folded table
        `tab` float32 (F, table_width(E, D)) (`andromeda_nb.scoring.fold_tables`)."""
        tab = np.ascontiguousarray(tab, np.float32)
        if tab.ndim != 2:
            raise ValueError(f"folded table must be 2-D (F, table_width(E, D)), got shape {tab.shape}")
        E = table_experts(tab.shape[1], self.D)
        rows = np.asarray(rows)
        if rows.dtype not in (np.int32, np.int64):
            rows = rows.astype(np.int64)
        if not (rows.flags.c_contiguous and rows.flags.writeable):  # e.g. Arrow buffers are read-only,
            rows = rows.copy()  # which numba would compile a second specialization for
        if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= self.rows):
            raise IndexError(f"candidate rows must lie in 0..{self.rows - 1}")
        out = np.empty(len(rows), np.float32)
        self.driver(len(rows))(self._values, self._scale, self._formats, rows, tab, E, self.top_k, out)
        return out

    def warm_up(self, E: int, F: int) -> None:
        """Compile (or load from numba's cache) the kernels this scorer calls, serial and parallel,
        for int64 candidate rows (what `RowMap.rows_of` gives), so the first real request does not
        pay for it."""
        if self.rows == 0:
            return
        tab = np.zeros((F, table_width(E, self.D)), np.float32)
        rows = np.zeros(1, np.int64)
        out = np.empty(1, np.float32)
        for driver in {self.drivers.parallel, self.drivers.serial}:
            driver(self._values, self._scale, self._formats, rows, tab, E, self.top_k, out)

    def score_user_side(self, rows: np.ndarray, U, Q, gamma, beta) -> np.ndarray:
        """Scores from the unfolded user-side tables U, Q (E, D), gamma, beta (F, D)."""
        return self.score(rows, fold_tables(U, Q, gamma, beta))


def threads() -> int:
    return numba.get_num_threads()


def set_threads(n: int | None) -> None:
    if n:
        numba.set_num_threads(max(1, min(int(n), numba.config.NUMBA_NUM_THREADS, os.cpu_count() or 1)))


__all__ = ["CandidateDrivers", "CpuScorer", "SHIPPED", "VERSIONS", "candidate_drivers", "storage_view", "version"]
