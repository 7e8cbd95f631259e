"""The unfused pipeline: DESIGN section 3's per-ad formula as separate array operations on NumPy or
CuPy arrays (`xp`), each stage materialized (gather and dequantize, FiLM, gate logits, every expert
product, routing by repeated argmax, softmax, weighted sum), written as a competent array
programmer would.

It is what array libraries do without a fused kernel, so the benchmarks time it beside the fused
kernels (`andromeda_nb.budget.unfused_stages` counts its bytes); in float64 it is also the reference
that runs on the device (`benchmarks/score.py`), the same formula as `andromeda_nb.reference`.
"""

from __future__ import annotations

import math

from .constants import GATE_TIE_ATOL


def unfused_scores(xp, values, scale, formats, us, top_e: int, kind: str = "moe", u=None, dtype=None):
    """Scores of ads with stored `values` (N, D), `scale` (N,) and formats `formats` (N,) for one
    request's user side `us` (`andromeda_nb.model.UserSide`), computed in `dtype` (float64 by default:
    the reference; float32: the unfused pipeline). `kind` "dot" scores the two-tower vector `u` (D,)
    instead. Returns (scores (N,), gate-tie mask bool (N,) or None): the mask marks ads whose k-th
    and (k+1)-th gate logits lie within GATE_TIE_ATOL (DESIGN section 4)."""
    dtype = dtype or xp.float64
    a = values.astype(dtype) * scale.astype(dtype)[:, None]  # gather + dequantize
    if kind == "dot":
        return a @ xp.asarray(u, dtype), None
    D = a.shape[1]
    gamma, beta = xp.asarray(us.gamma, dtype), xp.asarray(us.beta, dtype)
    r = gamma[formats] * a + beta[formats]  # FiLM
    g = (r @ xp.asarray(us.Q, dtype).T) / dtype(math.sqrt(D))  # gate logits
    x = r @ xp.asarray(us.U, dtype).T  # expert products (all E; the routed ones are taken below)
    E = g.shape[1]
    # routing: the top_e largest logits by repeated argmax (the first maximum: ties to the lower
    # expert), each chosen logit masked before the next; one more argmax finds the (k+1)-th for ties
    rows = xp.arange(g.shape[0])
    masked = g.copy()
    chosen = []
    for _ in range(min(top_e + 1, E)):
        e = xp.argmax(masked, axis=1)
        chosen.append(e)
        masked[rows, e] = -xp.inf
    top = xp.stack(chosen[:top_e], axis=1)
    gt = xp.take_along_axis(g, top, axis=1)
    w = xp.exp(gt - gt[:, :1])
    w = w / w.sum(axis=1, keepdims=True)
    s = (w * xp.take_along_axis(x, top, axis=1)).sum(axis=1)
    tie = None
    if top_e < E:
        nxt = g[rows, chosen[top_e]]
        tie = (gt[:, -1] - nxt) <= GATE_TIE_ATOL
    return s, tie


__all__ = ["unfused_scores"]
