"""Kernels of the remote GPU scoring service: candidate ad ids resolved to table rows on the device,
and each candidate scored by gathering its row (the 2024 picture: candidate lists shipped to a GPU).

    resolve_rows(sorted_ids, sorted_rows, cand_ids, out_rows)
        binary search of each candidate id in the device's sorted id column; out_rows[i] = its row,
        or -1 when the id is not live here. One thread per candidate.
        sorted_ids int64[N] ascending, sorted_rows int32[N], cand_ids int64[C], out_rows int32[C]
    score_rows_E{E}(emb, scale, formats, rows, tab, top_e, out)
        out[i] = the gated-MoE score of table row rows[i] (`andromeda_nb.scoring.moe_score`, the same
        per-ad formula and tie rules as every other scorer), NaN for a row of -1. One thread per
        candidate; the request's folded table is read through the L1 cache.
        emb (N, D) float32|float16|int8 row-major, scale float32[N], formats int16[N], rows int32[C],
        tab float32[F, TW], top_e int32, out float32[C]

Unlike the fused co-located kernel, this one cannot know a candidate's format or row before the
list arrives, so it gathers: each candidate costs a row read at a scattered address.
"""

from __future__ import annotations

from functools import lru_cache

from andromeda_nb.scoring import moe_score

from .. import runtime

cuda = runtime.cuda()
from numba import float32  # noqa: E402  (after the device choice)

THREADS = 128


@cuda.jit
def resolve_rows(sorted_ids, sorted_rows, cand_ids, out_rows):
    i = cuda.grid(1)
    if i >= cand_ids.shape[0]:
        return
    want = cand_ids[i]
    lo = 0
    hi = sorted_ids.shape[0]
    while lo < hi:
        mid = (lo + hi) >> 1
        if sorted_ids[mid] < want:
            lo = mid + 1
        else:
            hi = mid
    if lo < sorted_ids.shape[0] and sorted_ids[lo] == want:
        out_rows[i] = sorted_rows[lo]
    else:
        out_rows[i] = -1


_moe_device = cuda.jit(device=True)(moe_score)


@lru_cache(maxsize=None)
def score_rows(experts: int):
    """The gather-scoring kernel for `experts` experts (the gate logits live in a local array of that
    size, a compile-time constant)."""
    E = int(experts)

    @cuda.jit
    def kernel(emb, scale, formats, rows, tab, top_e, out):
        i = cuda.grid(1)
        if i >= rows.shape[0]:
            return
        row = rows[i]
        if row < 0:
            out[i] = float32(float("nan"))
            return
        g = cuda.local.array(E, float32)
        out[i] = _moe_device(emb, row, scale[row], tab, formats[row], E, emb.shape[1], top_e, g)

    return kernel


def blocks(n: int) -> int:
    return max(1, -(-n // THREADS))


__all__ = ["THREADS", "blocks", "resolve_rows", "score_rows"]
