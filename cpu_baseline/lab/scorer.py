"""The CPU scorer lab: every version of `cpu_baseline.scorer`, the superseded ones beside the shipped one,
so that `andromeda bench cpu` still times them and tests/cpu_baseline/test_cpu_scorer.py still checks them against
the float64 reference.

Versions (`VERSIONS`, every one; the scorer ships `cpu_baseline.scorer.SHIPPED`):
    1  serial loop over candidates, the shared per-ad function `andromeda_nb.scoring.moe_score`
       (gate first, routed experts only)
    2  numba `prange` over blocks of candidates, the shared per-ad function
    3  `prange` blocks; per ad all 2E dot products, one loop each, then routing (a fixed loop
       shape instead of the data-dependent expert choice of 1 and 2)
    4  `prange` blocks; for E = 6 the 12 dot products as 12 accumulators of one vectorized loop
       over the row, top-2 routing with one exp (other E fall back to 3)
    5  as 4, but the top-2 routing runs for blocks of 64 ads at once as branch-free selections
       vectorized over the ads (shipped; other E or top_k fall back to 4)

Each version is a per-ad loop run by the drivers of `cpu_baseline.scorer.candidate_drivers`; the
loops of 3 and 4 live in the shipped file (5 falls back to them), the one of 1 and 2 here.
"""

from __future__ import annotations

import numba
import numpy as np

from andromeda_nb.scoring import moe_score
from andromeda_nb.versions import Version, version_table

from .. import scorer as shipped
from ..scorer import CandidateDrivers, score_range_all_dots, score_range_unrolled, to_float32, candidate_drivers

# inlined into the cached callers below (compiled with their flags); no cache of its own
_score_row = numba.njit(inline="always")(moe_score)


@numba.njit(cache=True, nogil=True, fastmath=True, inline="always")
def _load_row(values, row, scale, buf):
    """buf[:] = stored row as float32; returns the row's dequantization scale."""
    for d in range(values.shape[1]):
        buf[d] = to_float32(values[row, d])
    return scale[row]


@numba.njit(cache=True, nogil=True, fastmath=True)
def _score_range(values, scale, formats, rows, tab, E, top_k, out, lo, hi):
    """The shared per-ad function on each candidate of rows[lo:hi]."""
    D = values.shape[1]
    buf = np.empty(D, np.float32)
    emb = buf.reshape((1, D))  # the converted row as the one-row table `moe_score` reads
    g = np.empty(E, np.float32)
    for i in range(lo, hi):
        row = rows[i]
        sc = _load_row(values, row, scale, buf)
        out[i] = _score_row(emb, 0, sc, tab, formats[row], E, D, top_k, g)


_SHARED_FUNCTION = candidate_drivers(_score_range, "")

VERSIONS = version_table(
    Version(1, "v1 serial", "serial loop, the shared per-ad function",
            CandidateDrivers(_SHARED_FUNCTION.serial, _SHARED_FUNCTION.serial)),
    Version(2, "v2 prange", "prange blocks, the shared per-ad function", _SHARED_FUNCTION),
    Version(3, "v3 all dots", "prange blocks; all 2E dot products, then routing",
            candidate_drivers(score_range_all_dots, "_all_dots")),
    Version(4, "v4 unrolled", "prange blocks; E = 6: 12 accumulators, top-2 with one exp",
            candidate_drivers(score_range_unrolled, "_unrolled")),
    *shipped.VERSIONS.values(),
)
SHIPPED = shipped.SHIPPED

__all__ = ["SHIPPED", "VERSIONS"]
