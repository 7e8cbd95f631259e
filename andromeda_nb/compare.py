"""The comparison rules of DESIGN section 4, as a library: each function checks one answer of an
implementation against the reference and returns a `Comparison` whose `.ok` says whether it passes and
whose `.message` describes the first disagreement (ids and values), with counts for a report.

* `compare_eligible`: exact set equality of eligible ad ids (ids listed in `excused` may be on either
  side; `boundary_excused(ads, request)` lists the ads whose eligibility turns on a custom location
  whose radius the user lies within BOUNDARY_SLACK_KM of).
* `compare_scores`: every score within SCORE_ATOL of the float64 reference; where the gate's k-th and
  (k+1)-th logits tie (the reference marks those rows ambiguous), the score under any acceptable
  routing is accepted.
* `compare_topk`: tie-aware top-K. Each ad's reference score is an interval [lo, hi] (one point unless
  its routing is ambiguous). An ad definitely outranks another when lo(a) > hi(b) + TOPK_TIE_ATOL.
  The answer must have min(K, candidates) distinct ids, each with a score within SCORE_ATOL of an
  acceptable reference score; no ad may be listed after an ad it definitely outranks; and no ad left
  out may definitely outrank an ad in the answer (so a tie group at the K boundary may be cut
  differently). The answer must also follow its own order: scores descending, ties by id ascending.
* `compare_reduced`: the looser rule for named reduced-precision modes: scores within
  REDUCED_SCORE_RTOL times the reference's score spread, and at least REDUCED_MIN_RECALL of the
  reference top-K recovered.

The reference side of `compare_topk` and `compare_reduced` is the reference score of every eligible
ad, or at least of the rows `reference.reference_candidates` keeps; either a `ScoreResult` aligned with
`ref_ids` or a plain float array (no routing ambiguity).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from .constants import (
    BOUNDARY_SLACK_KM,
    REDUCED_MIN_RECALL,
    REDUCED_SCORE_RTOL,
    SCORE_ATOL,
    TOPK_TIE_ATOL,
)
from .geo import haversine_km
from .reference import ScoreResult, reference_topk
from .types import Ad, GeoSpec, Request


@dataclass
class Comparison:
    """Outcome of one comparison: `ok`, the first disagreement in `message` (empty when ok), and
    counts (what was compared, how many disagreed)."""

    what: str
    ok: bool
    message: str = ""
    counts: dict = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        return f"{self.what}: {'ok' if self.ok else 'MISMATCH: ' + self.message}"


def _fail(what: str, message: str, counts: dict) -> Comparison:
    return Comparison(what, False, message, counts)


def _as_result(reference) -> ScoreResult:
    if isinstance(reference, ScoreResult):
        return reference
    if isinstance(reference, tuple):
        scores, ambiguous, alt = reference
        scores = np.asarray(scores, np.float64)
        return ScoreResult(scores, np.asarray(ambiguous, bool), np.asarray(alt, np.float64))
    scores = np.asarray(reference, np.float64)
    return ScoreResult(scores, np.zeros(len(scores), bool), np.full(len(scores), np.nan))


def _ids(values, name: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array of ad ids, got shape {arr.shape}")
    if len(arr) and arr.dtype.kind not in "iu":
        raise ValueError(f"{name}: expected integer ad ids, got {arr.dtype}")
    return arr.astype(np.int64)


def _num(x) -> str:
    return f"{float(x):.9g}"


def _first_ids(values: np.ndarray, limit: int = 5) -> str:
    head = ", ".join(str(int(v)) for v in values[:limit])
    return head + (f", ... ({len(values)} in all)" if len(values) > limit else "")


# --- eligibility ------------------------------------------------------------------------------------


def compare_eligible(expected_ids, got_ids, *, excused=(), require_sorted: bool = True) -> Comparison:
    """Exact set equality. `got_ids` must also be free of duplicates and, with `require_sorted`,
    ascending (the `TargetingIndex.match` contract). Ids in `excused` may be on either side."""
    expected, got = _ids(expected_ids, "expected_ids"), _ids(got_ids, "got_ids")
    excused_arr = _ids(list(excused), "excused")
    missing = np.setdiff1d(np.setdiff1d(expected, got), excused_arr)
    extra = np.setdiff1d(np.setdiff1d(got, expected), excused_arr)
    uniq, counts_ = np.unique(got, return_counts=True)
    dups = uniq[counts_ > 1]
    counts = {"expected": len(expected), "got": len(got), "missing": len(missing), "extra": len(extra),
              "duplicates": len(dups), "excused": len(excused_arr)}
    if len(missing):
        return _fail("eligible", f"{len(missing)} eligible ad(s) missing: {_first_ids(missing)}", counts)
    if len(extra):
        return _fail("eligible", f"{len(extra)} ad(s) not eligible but returned: {_first_ids(extra)}", counts)
    if len(dups):
        return _fail("eligible", f"duplicate ad id(s): {_first_ids(dups)}", counts)
    if require_sorted and len(got) > 1:
        bad = np.flatnonzero(np.diff(got) <= 0)
        if len(bad):
            i = int(bad[0])
            return _fail("eligible", f"ids not ascending at position {i + 1}: {int(got[i])} then "
                         f"{int(got[i + 1])}", counts)
    return Comparison("eligible", True, "", counts)


def _moved_circles(geo: GeoSpec | None, user, delta_km: float) -> tuple[GeoSpec | None, bool]:
    """`geo` with every custom location whose radius lies within BOUNDARY_SLACK_KM of the user's
    distance grown by `delta_km` (negative: shrunk), and whether there was any."""
    if geo is None or not geo.custom_locations:
        return geo, False
    moved, any_near = [], False
    for c in geo.custom_locations:
        near = abs(haversine_km(user.latitude, user.longitude, c.latitude, c.longitude) - c.radius_km) \
            <= BOUNDARY_SLACK_KM
        any_near |= near
        moved.append(dataclasses.replace(c, radius_km=c.radius_km + delta_km) if near else c)
    return dataclasses.replace(geo, custom_locations=tuple(moved)), any_near


def boundary_excused(ads: Iterable[Ad], request: Request) -> np.ndarray:
    """Ad ids (int64, ascending) whose eligibility for this request depends on which side of a
    custom-location boundary the user is put, among points within BOUNDARY_SLACK_KM of a radius
    (DESIGN section 2 lets implementations disagree there and only there)."""
    from .oracle import eligible  # imported here: the targeting module stands apart

    user, out = request.user, []
    step = 4 * BOUNDARY_SLACK_KM
    for ad in ads:
        spec = ad.targeting
        grown_in, near_in = _moved_circles(spec.geo_locations, user, step)
        shrunk_in, _ = _moved_circles(spec.geo_locations, user, -step)
        grown_ex, near_ex = _moved_circles(spec.excluded_geo_locations, user, step)
        shrunk_ex, _ = _moved_circles(spec.excluded_geo_locations, user, -step)
        if not (near_in or near_ex):
            continue
        most = dataclasses.replace(ad, targeting=dataclasses.replace(
            spec, geo_locations=grown_in, excluded_geo_locations=shrunk_ex))
        least = dataclasses.replace(ad, targeting=dataclasses.replace(
            spec, geo_locations=shrunk_in, excluded_geo_locations=grown_ex))
        if eligible(most, request) != eligible(least, request):
            out.append(ad.ad_id)
    return np.asarray(sorted(out), np.int64)


# --- scores -----------------------------------------------------------------------------------------


def _accepted_error(result: ScoreResult, i: int, value: float) -> float:
    return float(np.min(np.abs(result.accepted(i) - value)))


def compare_scores(reference, got, *, ids=None, atol: float = SCORE_ATOL) -> Comparison:
    """Scores of the same ads in the same order: `reference` is a ScoreResult, a tuple
    (scores, ambiguous, alt_scores), or plain float64 scores; `got` the implementation's scores."""
    ref = _as_result(reference)
    got = np.asarray(got)
    if got.shape != ref.scores.shape:
        return _fail("scores", f"expected {len(ref)} scores, got shape {got.shape}",
                     {"expected": len(ref), "got": int(got.size)})
    got64 = got.astype(np.float64)
    err = np.abs(got64 - ref.scores)
    err[np.isnan(got64)] = np.inf
    suspect = np.flatnonzero(~(err <= atol))
    bad = []
    used_alt = 0
    for i in suspect.tolist():
        if ref.ambiguous[i] and _accepted_error(ref, i, got64[i]) <= atol:
            used_alt += 1
        else:
            bad.append(i)
    ok_rows = np.ones(len(err), bool)
    ok_rows[bad] = False
    counts = {"compared": len(ref), "ambiguous": int(ref.ambiguous.sum()), "other_routing": used_alt,
              "bad": len(bad), "max_abs_err": float(err[ok_rows & (err <= atol)].max(initial=0.0))}
    if bad:
        i = bad[0]
        who = f"ad {int(np.asarray(ids)[i])}" if ids is not None else f"row {i}"
        detail = (f"{who}: got {_num(got64[i])}, reference {_num(ref.scores[i])} "
                  f"(|diff| {err[i]:.3g} > {atol:g})")
        if ref.ambiguous[i]:
            detail += f"; acceptable under a routing tie: {', '.join(map(_num, ref.accepted(i)))}"
        return _fail("scores", f"{len(bad)} score(s) off; first: {detail}", counts)
    return Comparison("scores", True, "", counts)


# --- top-K ------------------------------------------------------------------------------------------


def _reference_lookup(ref_ids, ref_scores):
    ids = _ids(ref_ids, "ref_ids")
    res = _as_result(ref_scores)
    if len(res) != len(ids):
        raise ValueError(f"ref_ids ({len(ids)}) and ref_scores ({len(res)}) differ in length")
    if len(np.unique(ids)) != len(ids):
        raise ValueError("ref_ids: duplicate ad ids")
    order = np.argsort(ids, kind="stable")
    return ids, res, ids[order], order


def _positions(sorted_ids, order, wanted):
    """Positions in the reference of `wanted` ids, and a found mask."""
    if not len(sorted_ids):
        return np.zeros(len(wanted), np.int64), np.zeros(len(wanted), bool)
    pos = np.minimum(np.searchsorted(sorted_ids, wanted), len(sorted_ids) - 1)
    found = sorted_ids[pos] == wanted
    return order[pos], found


def _check_answer_shape(what, ids, got_scores, expected_len, counts):
    if got_scores.shape != ids.shape:
        return _fail(what, f"{len(ids)} ids but {got_scores.shape} scores", counts)
    uniq, n = np.unique(ids, return_counts=True)
    if (n > 1).any():
        return _fail(what, f"duplicate ad id(s) in the answer: {_first_ids(uniq[n > 1])}", counts)
    if len(ids) != expected_len:
        return _fail(what, f"expected {expected_len} rows (min(K, candidates)), got {len(ids)}", counts)
    return None


def compare_topk(ref_ids, ref_scores, got_ids, got_scores, k: int, *, tie_atol: float = TOPK_TIE_ATOL,
                 score_atol: float = SCORE_ATOL, check_order: bool = True) -> Comparison:
    """Tie-aware comparison of one top-K answer (see the module docstring)."""
    what = "top-K"
    ids, res, sorted_ids, order = _reference_lookup(ref_ids, ref_scores)
    got_ids = _ids(got_ids, "got_ids")
    got_scores = np.asarray(got_scores)
    expected_len = min(int(k), len(ids))
    counts = {"k": int(k), "candidates": len(ids), "expected": expected_len, "got": len(got_ids)}
    failed = _check_answer_shape(what, got_ids, got_scores, expected_len, counts)
    if failed is not None:
        return failed
    pos, found = _positions(sorted_ids, order, got_ids)
    if not found.all():
        j = int(np.flatnonzero(~found)[0])
        return _fail(what, f"rank {j}: ad {int(got_ids[j])} is not among the reference candidates "
                     f"(not eligible, or far below the K-th score)", counts)
    # scores
    sc = compare_scores(res.take(pos), got_scores, ids=got_ids, atol=score_atol)
    counts["score_errors"] = sc.counts.get("bad", 0)
    if not sc.ok:
        return _fail(what, sc.message, counts)
    lo, hi = res.bounds()
    got_lo, got_hi = lo[pos], hi[pos]
    # order: no ad after one it definitely outranks
    if len(got_ids) > 1:
        prefix_min = np.minimum.accumulate(got_hi)[:-1]  # lowest hi among ranks 0..j-1
        viol = np.flatnonzero(got_lo[1:] > prefix_min + tie_atol)
        counts["order_violations"] = len(viol)
        if len(viol):
            j = int(viol[0]) + 1
            i = int(np.argmin(got_hi[:j]))
            return _fail(what, f"rank {j}: ad {int(got_ids[j])} (reference {_num(res.scores[pos[j]])}) "
                         f"is ranked below ad {int(got_ids[i])} at rank {i} "
                         f"(reference {_num(res.scores[pos[i]])}); "
                         f"they differ by more than {tie_atol:g}", counts)
    # membership: nothing left out that definitely outranks an ad in the answer
    if len(got_ids):
        left_out = np.ones(len(ids), bool)
        left_out[pos] = False
        floor = float(got_hi.min())
        missed = np.flatnonzero(left_out & (lo > floor + tie_atol))
        counts["missed"] = len(missed)
        if len(missed):
            m = missed[np.argmax(lo[missed])]
            j = int(np.argmin(got_hi))
            return _fail(what, f"ad {int(ids[m])} (reference {_num(res.scores[m])}) is missing, but ad "
                         f"{int(got_ids[j])} (reference {_num(res.scores[pos[j]])}) is in the answer at rank "
                         f"{j}; {len(missed)} ad(s) missed", counts)
    # the answer's own order: scores descending, ties by id ascending
    if check_order and len(got_ids) > 1:
        s = got_scores
        bad = np.flatnonzero((s[1:] > s[:-1]) | ((s[1:] == s[:-1]) & (got_ids[1:] <= got_ids[:-1])))
        if len(bad):
            j = int(bad[0]) + 1
            return _fail(what, f"answer out of its own order at rank {j}: ad {int(got_ids[j - 1])} "
                         f"score {_num(s[j - 1])}, then ad {int(got_ids[j])} score {_num(s[j])} (scores must "
                         f"descend, ties by id ascending)", counts)
    return Comparison(what, True, "", counts)


def compare_reduced(ref_ids, ref_scores, got_ids, got_scores, k: int, *,
                    rtol: float = REDUCED_SCORE_RTOL, min_recall: float = REDUCED_MIN_RECALL,
                    tie_atol: float = TOPK_TIE_ATOL, spread: float | None = None) -> Comparison:
    """The reduced-precision rule of DESIGN section 4 for one top-K answer. `spread` defaults to the
    range of the reference scores given (pass it when `ref_scores` is not every eligible ad)."""
    what = "top-K (reduced precision)"
    ids, res, sorted_ids, order = _reference_lookup(ref_ids, ref_scores)
    got_ids = _ids(got_ids, "got_ids")
    got_scores = np.asarray(got_scores)
    expected_len = min(int(k), len(ids))
    lo, hi = res.bounds()
    if spread is None:
        spread = float(hi.max() - lo.min()) if len(ids) else 0.0
    atol = rtol * spread
    counts = {"k": int(k), "candidates": len(ids), "expected": expected_len, "got": len(got_ids),
              "spread": spread, "score_atol": atol}
    if got_scores.shape != got_ids.shape:
        return _fail(what, f"{len(got_ids)} ids but {got_scores.shape} scores", counts)
    uniq, n = np.unique(got_ids, return_counts=True)
    if (n > 1).any():
        return _fail(what, f"duplicate ad id(s) in the answer: {_first_ids(uniq[n > 1])}", counts)
    if len(got_ids) > expected_len:
        return _fail(what, f"expected at most {expected_len} rows, got {len(got_ids)}", counts)
    pos, found = _positions(sorted_ids, order, got_ids)
    if not found.all():
        j = int(np.flatnonzero(~found)[0])
        return _fail(what, f"rank {j}: ad {int(got_ids[j])} is not among the reference candidates", counts)
    sc = compare_scores(res.take(pos), got_scores, ids=got_ids, atol=atol)
    counts["score_errors"] = sc.counts.get("bad", 0)
    if not sc.ok:
        return _fail(what, sc.message + f" (tolerance {rtol:g} x spread {spread:.6g})", counts)
    top_ids, _ = reference_topk(ids, res.scores, expected_len)
    if expected_len:
        kth = float(np.sort(lo)[-expected_len])
        # an answer id tied with the K-th reference score counts as recovered
        recovered = np.isin(got_ids, top_ids) | (hi[pos] >= kth - tie_atol)
        recall = min(1.0, float(recovered.sum()) / expected_len)
    else:
        recall = 1.0
    counts["recall"] = recall
    if recall < min_recall:
        missing = np.setdiff1d(top_ids, got_ids)
        return _fail(what, f"recall {recall:.4f} < {min_recall:g}; reference top-K ads missing: "
                     f"{_first_ids(missing)}", counts)
    return Comparison(what, True, "", counts)


__all__ = [
    "Comparison",
    "boundary_excused",
    "compare_eligible",
    "compare_reduced",
    "compare_scores",
    "compare_topk",
]
