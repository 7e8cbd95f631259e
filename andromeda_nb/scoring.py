"""The per-ad half of DESIGN section 3 in float32, written once for every target.

The fused GPU kernels (`gpu/kernels/score.py`) and the CPU scorers compile the plain functions below
(`numba.njit` for the CPU, `numba.cuda.jit(device=True)` for the GPU); `andromeda_nb.reference` stays
the float64 reference they are all tested against.

Folded tables. The per-format FiLM is folded into per-request, per-format tables, so the per-ad work
has no FiLM step:

    dot(q_e, gamma_f * a + beta_f) / sqrt(D) = dot(q_e * gamma_f / sqrt(D), a) + dot(q_e, beta_f) / sqrt(D)
    dot(u_e, gamma_f * a + beta_f)           = dot(u_e * gamma_f, a)           + dot(u_e, beta_f)

`fold_tables` builds them (float64 math, stored float32) as one row of `table_width(E, D)` floats per
format, laid out as

    [0,        E*D)          QG[e, d] = Q[e, d] * gamma[f, d] / sqrt(D)     at e*D + d
    [E*D,      2*E*D)        UG[e, d] = U[e, d] * gamma[f, d]               at E*D + e*D + d
    [2*E*D,    2*E*D + E)    qb[e]    = dot(Q[e], beta[f]) / sqrt(D)
    [2*E*D+E,  2*E*D + 2*E)  ub[e]    = dot(U[e], beta[f])
    padding to a multiple of 4 floats (16-byte rows)

With `x = dequant(a)` = scale * stored values, an ad of format f then scores

    g_e   = scale * dot(QG[e], stored) + qb[e]                 (gate logits)
    route = top `top_e` experts by g, ties lower e first;  w = softmax(g[route])
    score = sum over routed e of w_e * (scale * dot(UG[e], stored) + ub[e])

The two-tower baseline table is the user vector `u` in the first D floats of row 0.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

TABLE_ALIGN = 4  # floats: table rows start on 16-byte boundaries


def table_width(experts: int, dim: int) -> int:
    """Floats per format row of a folded table."""
    raw = 2 * experts * dim + 2 * experts
    return -(-raw // TABLE_ALIGN) * TABLE_ALIGN


def table_experts(width: int, dim: int) -> int:
    """E of a folded table with rows of `width` floats at embedding dim `dim` (the inverse of
    `table_width`; unique since the padding is shorter than the 2 * (dim + 1) floats one expert adds)."""
    experts = int(width) // (2 * (int(dim) + 1))
    if experts < 1 or table_width(experts, dim) != width:
        raise ValueError(f"a folded table row of {width} floats fits no expert count at D={dim}")
    return experts


def fold_tables(U, Q, gamma, beta) -> np.ndarray:
    """float32 (F, table_width(E, D)) from the user side U, Q (E, D) and gamma, beta (F, D)."""
    return fold_tables_batch(*(np.asarray(a)[None] for a in (U, Q, gamma, beta)))[0]


def fold_tables_batch(U, Q, gamma, beta) -> np.ndarray:
    """float32 (R, F, table_width(E, D)): `fold_tables` of R requests at once, from U, Q (R, E, D)
    and gamma, beta (R, F, D) (`andromeda_nb.model.user_sides`)."""
    U, Q = np.asarray(U, np.float64), np.asarray(Q, np.float64)
    gamma, beta = np.asarray(gamma, np.float64), np.asarray(beta, np.float64)
    R, E, D = U.shape
    F = gamma.shape[1]
    inv = 1.0 / math.sqrt(D)
    out = np.empty((R, F, table_width(E, D)), np.float32)
    out[:, :, 2 * E * D + 2 * E :] = 0.0  # the row's padding
    _film_products(np.ascontiguousarray(U), np.ascontiguousarray(Q), np.ascontiguousarray(gamma), inv, out)
    # (R, F, D) @ (R, D, E): batched matrix products (BLAS), not einsum contractions
    out[:, :, 2 * E * D : 2 * E * D + E] = np.matmul(beta, Q.transpose(0, 2, 1)) * inv
    out[:, :, 2 * E * D + E : 2 * E * D + 2 * E] = np.matmul(beta, U.transpose(0, 2, 1))
    return out


@njit(cache=True, nogil=True)
def _film_products(U, Q, gamma, inv, out):
    """out[r, f, :E D] := Q[r] * gamma[r, f] * inv and out[r, f, E D:2 E D] := U[r] * gamma[r, f],
    expert by expert, in float64 rounded once to float32: numpy's broadcast products of the same
    order, without their (R, F, E, D) float64 temporaries (a batch of 64 folds in half the time)."""
    R, E, D = U.shape
    F = gamma.shape[1]
    for r in range(R):
        for f in range(F):
            for e in range(E):
                for d in range(D):
                    g = gamma[r, f, d]
                    out[r, f, e * D + d] = Q[r, e, d] * g * inv
                    out[r, f, (E + e) * D + d] = U[r, e, d] * g


def fold_user_side(us) -> np.ndarray:
    """`fold_tables` of an `andromeda_nb.model.UserSide`."""
    return fold_tables(us.U, us.Q, us.gamma, us.beta)


def dot_table(u, experts: int, formats: int = 1) -> np.ndarray:
    """float32 (formats, table_width(E, D)): the two-tower vector u (D,) in every row's first D floats."""
    u = np.asarray(u, np.float64)
    out = np.zeros((formats, table_width(experts, len(u))), np.float32)
    out[:, : len(u)] = u
    return out


# --- the per-ad formula: plain Python, compiled by numba for each target ------------------------------
# `emb` is (N, D) of float32, float16 or int8 values; `tab` is (F, width) float32 folded tables of one
# request; `g` is float32 scratch of at least E entries (the caller owns it: a local array on the GPU).
# Every product is cast to float32 explicitly, so that numba keeps float32 arithmetic on both targets.


def moe_score(emb, row, scale, tab, f, E, D, top_e, g):
    """Gated-MoE score of stored row `row` (format f, int8 scale `scale`, 1 otherwise), float32."""
    qb0 = 2 * E * D
    ub0 = qb0 + E
    for e in range(E):
        acc = np.float32(0.0)
        for d in range(D):
            acc += tab[f, e * D + d] * np.float32(emb[row, d])
        g[e] = acc * scale + tab[f, qb0 + e]
    chosen = 0
    gmax = np.float32(0.0)
    total = np.float32(0.0)
    wsum = np.float32(0.0)
    for j in range(top_e):
        best = -1
        best_g = np.float32(0.0)
        for e in range(E):
            if (chosen >> e) & 1 == 0 and (best < 0 or g[e] > best_g):
                best = e
                best_g = g[e]
        chosen |= 1 << best
        if j == 0:
            gmax = best_g
        w = np.float32(math.exp(best_g - gmax))
        acc = np.float32(0.0)
        base = (E + best) * D
        for d in range(D):
            acc += tab[f, base + d] * np.float32(emb[row, d])
        total += w * (acc * scale + tab[f, ub0 + best])
        wsum += w
    return total / wsum


def dot_score(emb, row, scale, tab, D):
    """Two-tower score scale * dot(u, stored row), u in tab[0, :D], float32."""
    acc = np.float32(0.0)
    for d in range(D):
        acc += tab[0, d] * np.float32(emb[row, d])
    return acc * scale


__all__ = ["TABLE_ALIGN", "dot_score", "dot_table", "fold_tables", "fold_tables_batch", "fold_user_side", "moe_score", "table_experts",
           "table_width"]
