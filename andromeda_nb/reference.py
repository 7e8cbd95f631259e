"""The float64 reference of DESIGN section 3's per-ad formula, the reference top-K, and the reference
retriever (`--arch reference`). Every fast path is checked against these.

For one request (its `UserSide`) and ads with stored embeddings `a` and formats `f`:

    r     = gamma[f] * dequant(a) + beta[f]                  context-aware ad representation
    g_e   = dot(Q[e], r) / sqrt(D)                           gate logits, e = 0..E-1
    route = the top_k experts by g (ties: lower e first)     w = softmax(g[route])
    score = sum over e in route of w_e * dot(U[e], r)

`reference_scores` evaluates this in float64, vectorized in batches of `BATCH_ROWS` ads (memory stays
bounded; a million ads take about a second). Rows where the k-th and (k+1)-th largest logits lie within
`GATE_TIE_ATOL` are flagged *ambiguous*: DESIGN section 4 accepts the score under either routing there,
so the result also carries the score under the other routing (`alt_scores`) and, for the rare rows where
more than two experts tie, every further acceptable routing (`extra`). A routing (a set R of top_k
experts) is acceptable when min g[R] >= max g[not R] - GATE_TIE_ATOL, i.e. it is the exact top_k of
logits moved by at most half the tolerance.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .answers import check_k
from .constants import GATE_TIE_ATOL
from .model import (EmbeddingTable, ModelError, MoeModel, UserSide, ad_embedding_of, quantize, two_tower_vector,
                    user_side)
from .rows import RowMap, fit_rows
from .types import Request, Retire, SetStatus, Update, Upsert

BATCH_ROWS = 32768  # ads per vectorized pass: about 20 MB of float64 temporaries at D = 64


# --- scores ------------------------------------------------------------------------------------------


@dataclass
class ScoreResult:
    """Reference scores of N ads for one request.

    scores     float64 (N,): the score under the reference routing
    ambiguous  bool (N,): the k-th and (k+1)-th gate logits lie within GATE_TIE_ATOL
    alt_scores float64 (N,): for ambiguous rows, the score with the k-th and (k+1)-th experts
               exchanged; NaN elsewhere
    extra      row -> float64 array of the scores under further acceptable routings (rows where
               three or more logits tie); empty in almost every request
    """

    scores: np.ndarray
    ambiguous: np.ndarray
    alt_scores: np.ndarray
    extra: dict[int, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.scores)

    def accepted(self, i: int) -> np.ndarray:
        """Every acceptable score of row i (the reference one first)."""
        out = [self.scores[i]]
        if self.ambiguous[i]:
            out.append(self.alt_scores[i])
            out.extend(self.extra.get(int(i), ()))
        return np.asarray(out, np.float64)

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """(lowest, highest) acceptable score per row, float64 (N,)."""
        lo, hi = self.scores.copy(), self.scores.copy()
        amb = self.ambiguous
        lo[amb] = np.minimum(lo[amb], self.alt_scores[amb])
        hi[amb] = np.maximum(hi[amb], self.alt_scores[amb])
        for i, values in self.extra.items():
            lo[i] = min(lo[i], float(np.min(values)))
            hi[i] = max(hi[i], float(np.max(values)))
        return lo, hi

    def take(self, positions) -> "ScoreResult":
        """The rows at the given positions, in that order."""
        positions = np.asarray(positions, np.int64)
        back = {int(p): j for j, p in enumerate(positions.tolist())}
        extra = {back[i]: v for i, v in self.extra.items() if i in back}
        return ScoreResult(self.scores[positions], self.ambiguous[positions],
                           self.alt_scores[positions], extra)

    @classmethod
    def empty(cls) -> "ScoreResult":
        return cls(np.empty(0), np.empty(0, bool), np.empty(0))


def _routed_score(g: np.ndarray, x: np.ndarray, experts) -> float:
    """Score of one ad under a given routing: softmax of g over `experts`, weighting x."""
    sel = np.asarray(experts)
    z = np.exp(g[sel] - g[sel].max())
    return float(np.dot(z / z.sum(), x[sel]))


def acceptable_routings(g: np.ndarray, k: int, atol: float = GATE_TIE_ATOL) -> list[tuple[int, ...]]:
    """All k-subsets R of experts (sorted tuples) with min g[R] >= max g[not R] - atol."""
    E = len(g)
    out = []
    for subset in itertools.combinations(range(E), k):
        rest = [e for e in range(E) if e not in subset]
        if not rest or min(g[list(subset)]) >= max(g[rest]) - atol:
            out.append(subset)
    return out


def _check_rows(table: EmbeddingTable, rows, formats, F: int) -> tuple[np.ndarray, np.ndarray]:
    rows = np.asarray(rows)
    formats = np.asarray(formats)
    if rows.ndim != 1 or formats.shape != rows.shape:
        raise ValueError(f"rows and formats must be 1-D arrays of one length, got {rows.shape} and "
                         f"{formats.shape}")
    if rows.dtype.kind not in "iu" or formats.dtype.kind not in "iu":
        raise ValueError(f"rows and formats must be integer arrays, got {rows.dtype} and {formats.dtype}")
    if len(rows) and (rows.min() < 0 or rows.max() >= len(table)):
        raise ValueError(f"rows: out of range for a table of {len(table)} ads")
    if len(formats) and (formats.min() < 0 or formats.max() >= F):
        bad = int(formats[(formats < 0) | (formats >= F)][0])
        raise ValueError(f"formats: {bad} is outside 0..{F - 1}")
    return rows.astype(np.int64), formats.astype(np.int64)


def reference_scores(model: MoeModel, us: UserSide, table: EmbeddingTable, rows, formats, *,
                     batch_rows: int = BATCH_ROWS) -> ScoreResult:
    """Float64 scores of the ads at table rows `rows` (int (N,)) with formats `formats` (int (N,)),
    for one request's user side `us`. See the module docstring for the formula and ambiguity rule."""
    if table.D != us.D or us.D != model.D:
        raise ModelError(f"embedding dim {table.D} does not match the model's D = {model.D}")
    rows, formats = _check_rows(table, rows, formats, us.F)
    n, k, E = len(rows), model.top_k, model.E
    scores = np.empty(n, np.float64)
    ambiguous = np.zeros(n, bool)
    alt = np.full(n, np.nan)
    extra: dict[int, np.ndarray] = {}
    inv_sqrt_d = 1.0 / math.sqrt(us.D)
    QU = np.concatenate([us.Q, us.U])  # (2E, D): gate keys, then expert outputs
    for lo in range(0, n, batch_rows):
        f = formats[lo : lo + batch_rows]
        r = table.dequantize(rows[lo : lo + batch_rows])  # (B, D)
        r *= us.gamma[f]
        r += us.beta[f]  # r = gamma_f * dequant(a) + beta_f
        gx = np.einsum("bd,jd->bj", r, QU)  # (B, 2E)
        g = gx[:, :E] * inv_sqrt_d  # gate logits
        x = gx[:, E:]  # expert products dot(U[e], r)
        order = np.argsort(-g, axis=1, kind="stable")  # descending; equal logits keep lower e first
        top = order[:, :k]
        g_top = np.take_along_axis(g, top, axis=1)
        w = np.exp(g_top - g_top[:, :1])  # g_top[:, 0] is the row maximum
        w /= w.sum(axis=1, keepdims=True)
        scores[lo : lo + len(f)] = np.einsum("bk,bk->b", w, np.take_along_axis(x, top, axis=1))
        if k == E:
            continue
        srt = np.take_along_axis(g, order, axis=1)  # logits, descending
        tied = np.flatnonzero(srt[:, k - 1] - srt[:, k] <= GATE_TIE_ATOL)
        if not len(tied):
            continue
        ambiguous[lo + tied] = True
        # the other routing: the k-th expert exchanged for the (k+1)-th
        swapped = np.concatenate([order[tied, : k - 1], order[tied, k : k + 1]], axis=1)
        g_sw = np.take_along_axis(g[tied], swapped, axis=1)
        w_sw = np.exp(g_sw - g_sw.max(axis=1, keepdims=True))
        w_sw /= w_sw.sum(axis=1, keepdims=True)
        alt[lo + tied] = np.einsum("bk,bk->b", w_sw, np.take_along_axis(x[tied], swapped, axis=1))
        # more routings are acceptable only where a third logit joins the tie band
        wide = np.zeros(len(tied), bool)
        if k >= 2:
            wide |= srt[tied, k - 2] - srt[tied, k] <= GATE_TIE_ATOL
        if k + 1 < E:
            wide |= srt[tied, k - 1] - srt[tied, k + 1] <= GATE_TIE_ATOL
        for t in np.flatnonzero(wide).tolist():
            j = int(tied[t])
            known = {frozenset(top[j].tolist()), frozenset(swapped[t].tolist())}
            more = [_routed_score(g[j], x[j], R) for R in acceptable_routings(g[j], k)
                    if frozenset(R) not in known]
            if more:
                extra[lo + j] = np.asarray(more, np.float64)
    return ScoreResult(scores, ambiguous, alt, extra)


def two_tower_scores(u: np.ndarray, table: EmbeddingTable, rows, *,
                     batch_rows: int = BATCH_ROWS) -> np.ndarray:
    """float64 (N,): dot(u, dequant(a)) for the ads at table rows `rows` (DESIGN section 3 baseline)."""
    u = np.asarray(u, np.float64)
    if u.shape != (table.D,):
        raise ModelError(f"two-tower user vector: expected shape ({table.D},), got {u.shape}")
    rows = np.asarray(rows, np.int64)
    out = np.empty(len(rows), np.float64)
    for lo in range(0, len(rows), batch_rows):
        out[lo : lo + batch_rows] = table.dequantize(rows[lo : lo + batch_rows]) @ u
    return out


# --- top-K -------------------------------------------------------------------------------------------


def reference_topk(ids, scores, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best (ids int64, scores) by score descending, ties by id ascending (DESIGN section 4).
    Scores keep their dtype. Fewer than k rows come back when fewer are given."""
    ids = np.asarray(ids, np.int64)
    scores = np.asarray(scores)
    if ids.shape != scores.shape or ids.ndim != 1:
        raise ValueError(f"ids and scores must be 1-D arrays of one length, got {ids.shape} and "
                         f"{scores.shape}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if np.isnan(scores).any():
        raise ValueError(f"scores contain NaN (ad {int(ids[np.flatnonzero(np.isnan(scores))[0]])})")
    if len(ids) > k > 0:
        # every row tied with the k-th best score stays a candidate, so the id order decides
        threshold = scores[np.argpartition(-scores, k - 1)[:k]].min()
        cand = np.flatnonzero(scores >= threshold)
    else:
        cand = np.arange(len(ids))
    order = np.lexsort((ids[cand], -scores[cand]))[:k]
    return ids[cand[order]], scores[cand[order]]


def reference_candidates(ids, result: ScoreResult, k: int, margin: float) -> tuple[np.ndarray, ScoreResult]:
    """The rows a tie-aware top-K comparison needs, in reference rank order: the reference top-K plus
    every row whose highest acceptable score reaches the k-th best lowest acceptable score minus
    `margin`. Lets a harness keep a small reference instead of every eligible ad."""
    ids = np.asarray(ids, np.int64)
    if len(ids) <= k:
        order = np.lexsort((ids, -result.scores))
        return ids[order], result.take(order)
    lo, hi = result.bounds()
    kth = np.sort(lo)[-k]
    keep = np.flatnonzero(hi >= kth - margin)
    order = keep[np.lexsort((ids[keep], -result.scores[keep]))]
    return ids[order], result.take(order)


# --- the reference retriever --------------------------------------------------------------------------


def build_index(matcher, dataset, **options):
    """A `matcher` (a TargetingIndex class) over the dataset's ads: from the compiled targeting when
    the class takes it (`from_compiled`, no ad parsed), else from the parsed ads (the oracle)."""
    from_compiled = getattr(matcher, "from_compiled", None)
    if from_compiled is not None:
        return from_compiled(dataset.compiled, **options)
    return matcher.build(dataset.ads, **options)



class ReferenceRetriever:
    """`interfaces.Retriever` in plain numpy: eligibility from a targeting index (the oracle unless
    `matcher=` names another TargetingIndex class), every eligible ad scored by `reference_scores`
    (or `two_tower_scores` with `scorer="two_tower"`), top-K by `reference_topk` on the float32 scores
    it returns (so its answer is ordered by exactly the scores it reports, ties by id ascending)."""

    SCORERS = ("moe", "two_tower")

    def __init__(self, model: MoeModel, index, table: EmbeddingTable, ad_ids, formats, *, seed: int,
                 scorer: str = "moe"):
        if scorer not in self.SCORERS:
            raise ValueError(f"scorer: expected one of {', '.join(self.SCORERS)}, got {scorer!r}")
        ad_ids = np.asarray(ad_ids, np.int64)
        if len(ad_ids) != len(table) or len(formats) != len(table):
            raise ValueError("ad ids, formats and embedding rows must have one length")
        self.model, self.index, self.seed, self.scorer = model, index, seed, scorer
        self.precision = table.precision
        self._values = table.values.copy()
        self._scale = table.scale.copy()
        self._formats = np.asarray(formats, np.int64).copy()
        self._rows = RowMap(ad_ids)  # raises on duplicate ids

    @classmethod
    def build(cls, dataset, *, matcher=None, scorer: str = "moe", **options) -> "ReferenceRetriever":
        if options:
            raise TypeError(f"unknown option(s) for the reference retriever: {', '.join(options)}")
        if matcher is None:
            from .oracle import OracleIndex  # imported here: the targeting module stands apart

            matcher = OracleIndex
        index = build_index(matcher, dataset)
        return cls(dataset.model, index, dataset.embeddings, dataset.ad_ids, dataset.formats,
                   seed=dataset.seed, scorer=scorer)

    # --- updates -----------------------------------------------------------------------------------
    def apply(self, update: Update) -> None:
        if isinstance(update, Upsert):
            ad = update.ad
            if not 0 <= ad.format < self.model.F:
                raise ModelError(f"ad {ad.ad_id}: format {ad.format} is outside 0..{self.model.F - 1}")
            stored = quantize(ad_embedding_of(ad, self.seed, self.model.D)[None, :], self.precision)
            self.index.apply(update)
            row, _ = self._rows.assign(ad.ad_id)
            n = self._rows.n_rows
            self._values = fit_rows(self._values, n)
            self._scale = fit_rows(self._scale, n, 1.0)
            self._formats = fit_rows(self._formats, n)
            self._values[row] = stored.values[0]
            self._scale[row] = stored.scale[0]
            self._formats[row] = ad.format
        elif isinstance(update, Retire):
            self.index.apply(update)
            self._rows.release(update.ad_id)
        elif isinstance(update, SetStatus):
            self.index.apply(update)
        else:
            raise TypeError(f"not an update: {update!r}")

    # --- answers -----------------------------------------------------------------------------------
    @property
    def table(self) -> EmbeddingTable:
        n = self._rows.n_rows
        return EmbeddingTable(self._values[:n], self._scale[:n], self.precision)

    def rows_of(self, ad_ids) -> np.ndarray:
        """Table rows of live ad ids (int64); raises KeyError for an unknown id."""
        return self._rows.rows_of(ad_ids)

    def score_eligible(self, request: Request) -> tuple[np.ndarray, ScoreResult]:
        """(eligible ad ids ascending, their reference ScoreResult) for one request: what the
        comparison rules of DESIGN section 4 are checked against."""
        return self.score_ids(request, self.index.match([request])[0])

    def score_ids(self, request: Request, ids) -> tuple[np.ndarray, ScoreResult]:
        """`score_eligible` for eligible ids found elsewhere (int64 ascending): the harness scores the
        oracle's sets of a corpus too large to hold parsed."""
        ids = np.asarray(ids, np.int64)
        rows = self.rows_of(ids)
        if self.scorer == "two_tower":
            s = two_tower_scores(two_tower_vector(self.model, request), self.table, rows)
            return ids, ScoreResult(s, np.zeros(len(s), bool), np.full(len(s), np.nan))
        us = user_side(self.model, request)
        return ids, reference_scores(self.model, us, self.table, rows, self._formats[rows])

    def retrieve(self, requests: Sequence[Request], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        k = check_k(k)
        out = []
        for request in requests:
            ids, result = self.score_eligible(request)
            out.append(reference_topk(ids, result.scores.astype(np.float32), k))
        return out

    def __len__(self) -> int:
        return len(self._rows)

    def close(self) -> None:
        pass


__all__ = [
    "BATCH_ROWS",
    "ReferenceRetriever",
    "build_index",
    "ScoreResult",
    "acceptable_routings",
    "check_k",
    "reference_candidates",
    "reference_scores",
    "reference_topk",
    "two_tower_scores",
]
