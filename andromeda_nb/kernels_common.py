"""The per-ad scoring formula of DESIGN section 3, written once for every compiled target.

The per-request FiLM is folded into per-format tables, so an ad costs only dot products with its
stored (dequantized) embedding `a`:

    r        = gamma_f * a + beta_f
    g_e      = dot(q_e, r) / sqrt(D) = dot(q_e * gamma_f / sqrt(D), a) + dot(q_e, beta_f) / sqrt(D)
    s_e      = dot(u_e, r)           = dot(u_e * gamma_f, a)           + dot(u_e, beta_f)

`fold_user_side` builds, per request, `P` float32 (F, 2E, D) (rows 0..E-1 gate, E..2E-1 expert) and
`c0` float32 (F, 2E) (the constant terms), in float64 before one rounding. With `scale` the int8 row
scale (1 for fp32 / fp16), `dot(P[f, j], scale * a) = scale * dot(P[f, j], a)`.

`moe_score_row(a, scale, P, c0, f, E, top_k, g, s, sel)` is the whole per-ad formula on one row
`a` (float32, or any numeric dtype numba reads directly), computing the gate first and only the
routed experts' products. It uses only scalar arithmetic, indexing and `math.exp`, and calls no
other function, so the same source compiles with `numba.njit` (the CPU scorer,
`cpu_baseline.scorer`) and with `numba.cuda.jit(device=True)`. `g`, `s` (float32, length >= E) and
`sel` (integer, length >= top_k) are caller-provided scratch, so it never allocates.
"""

from __future__ import annotations

import math

import numpy as np


def fold_user_side(U, Q, gamma, beta) -> tuple[np.ndarray, np.ndarray]:
    """Per-request tables: P float32 (F, 2E, D), c0 float32 (F, 2E), from U, Q (E, D), gamma, beta
    (F, D) of any float dtype (computed in float64)."""
    U, Q, gamma, beta = (np.asarray(x, np.float64) for x in (U, Q, gamma, beta))
    E, D = U.shape
    inv = 1.0 / math.sqrt(D)
    keys = np.concatenate([Q * inv, U])  # (2E, D)
    P = keys[None, :, :] * gamma[:, None, :]  # (F, 2E, D)
    c0 = beta @ keys.T  # (F, 2E)
    return np.ascontiguousarray(P, np.float32), np.ascontiguousarray(c0, np.float32)


def moe_score_row(a, scale, P, c0, f, E, top_k, g, s, sel):
    """Score one ad: stored row a (D,), its scale, its format f, folded tables P float32 (F, 2E, D)
    and c0 float32 (F, 2E). Scratch: g, s float32 (>= E), sel int (>= top_k).

    Gate logits for all experts; routing = the top_k largest logits, ties to the lower expert;
    expert products for the routed experts only; softmax-weighted sum. float32 dot products."""
    D = a.shape[0]
    for e in range(E):
        acc = np.float32(0.0)
        for d in range(D):
            acc += P[f, e, d] * a[d]
        g[e] = acc * scale + c0[f, e]
    # route: repeated arg-max over the experts not yet taken (strict '>' keeps the lower e on ties)
    for j in range(top_k):
        best = -1
        for e in range(E):
            taken = False
            for i in range(j):
                if sel[i] == e:
                    taken = True
            if not taken and (best < 0 or g[e] > g[best]):
                best = e
        sel[j] = best
    top = g[sel[0]]
    den = 0.0
    num = 0.0
    for j in range(top_k):
        e = sel[j]
        acc = np.float32(0.0)
        for d in range(D):
            acc += P[f, E + e, d] * a[d]
        s[e] = acc * scale + c0[f, E + e]
        w = math.exp(g[e] - top)
        den += w
        num += w * s[e]
    return num / den


__all__ = ["fold_user_side", "moe_score_row"]
