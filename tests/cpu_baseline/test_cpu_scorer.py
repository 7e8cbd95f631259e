"""The CPU scorer (every version, every storage precision) against the float64 reference."""

import math

import numpy as np
import pytest

from andromeda_nb.constants import SCORE_ATOL
from andromeda_nb.model import MoeModel, quantize, user_side
from andromeda_nb.reference import reference_scores
from andromeda_nb.scoring import fold_user_side, moe_score, table_experts, table_width
from andromeda_nb.testing import random_requests
from cpu_baseline.lab.scorer import VERSIONS, _score_row
from cpu_baseline.scorer import SHIPPED, CpuScorer, storage_view


def _max_error(got, result):
    lo, hi = result.bounds()  # either routing is accepted where the gate is within the tie tolerance
    return float(np.max(np.maximum(lo - got, got - hi).clip(0), initial=0.0))


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("E,top_k", [(6, 2), (6, 1), (4, 3)])
def test_versions_match_reference(precision, E, top_k):
    seed = 100 + 7 * E + top_k
    rng = np.random.default_rng(seed)
    model = MoeModel.init(seed, D=64, E=E, top_k=top_k)
    n = 6000  # above PARALLEL_MIN_CANDIDATES, so the parallel kernels run
    emb = (rng.standard_normal((n, model.D)) / 8).astype(np.float32)
    formats = rng.integers(0, model.F, n).astype(np.int16)
    table = quantize(emb, precision)
    rows = rng.permutation(n)[:5000]
    for request in random_requests(rng, 2, experts=E):
        us = user_side(model, request)
        ref = reference_scores(model, us, table, rows, formats[rows])
        assert np.std(ref.scores) > 0.05  # scores spread: the comparison can fail
        tab = fold_user_side(us)
        # every version on fp32; the shipped one on every precision (bench cpu checks the rest)
        versions = VERSIONS if precision == "fp32" else [SHIPPED]
        for version in versions:
            scorer = CpuScorer.from_table(table, formats, model.top_k, version=VERSIONS[version])
            got = scorer.score(rows.astype(np.int32), tab)
            assert got.dtype == np.float32
            err = _max_error(got, ref)
            assert err <= SCORE_ATOL, (f"v{version} {precision} E={E} top_k={top_k} seed={seed} "
                                       f"request {request.request_id}: error {err}")
        small = rows[:50].astype(np.int32)  # the serial path of the shipped version
        got = CpuScorer.from_table(table, formats, model.top_k).score(small, tab)
        assert _max_error(got, ref.take(np.arange(50))) <= SCORE_ATOL


def _table(rows, consts):
    """A folded table (andromeda_nb.scoring layout) of one format from its 2E rows of D and its 2E
    constant terms (gates first, then experts)."""
    rows, consts = np.asarray(rows, np.float32), np.asarray(consts, np.float32)
    E, D = len(rows) // 2, rows.shape[1]
    tab = np.zeros((1, table_width(E, D)), np.float32)
    tab[0, : 2 * E * D] = rows.ravel()
    tab[0, 2 * E * D : 2 * E * D + 2 * E] = consts
    return tab


def test_per_ad_formula_by_hand():
    # E=2, D=2, one format, top_k=1: the score is the routed expert's product
    tab = _table([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [0.0, 3.0]], [0.0, 0.5, 0.1, 0.2])  # gate 0, gate 1, u0, u1
    a = np.array([[1.0, 1.0]], np.float32)
    g = np.zeros(2, np.float32)
    # gates: 1.0 and 1.5 -> expert 1; its product 3 + 0.2
    assert moe_score(a, 0, np.float32(1.0), tab, 0, 2, 2, 1, g) == pytest.approx(3.2)
    assert _score_row(a, 0, np.float32(1.0), tab, 0, 2, 2, 1, g) == pytest.approx(3.2, abs=1e-6)
    # top_k=2: softmax(1.0, 1.5) weights the two products 2.1 and 3.2
    w1 = math.exp(1.5) / (math.exp(1.0) + math.exp(1.5))
    want = w1 * 3.2 + (1 - w1) * 2.1
    assert _score_row(a, 0, np.float32(1.0), tab, 0, 2, 2, 2, g) == pytest.approx(want, abs=1e-6)
    # a tie between the gates routes to the lower expert
    tab_tie = _table([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [0.0, 3.0]], [0.5, 0.0, 0.1, 0.2])
    b = np.array([[1.0, 1.5]], np.float32)  # gates 1.5 and 1.5
    assert _score_row(b, 0, np.float32(1.0), tab_tie, 0, 2, 2, 1, g) == pytest.approx(2.1, abs=1e-6)
    # every version of the scorer on the same table, through the candidate-list entry point
    scorer = CpuScorer(np.array([[1.0, 1.0], [1.0, 1.5]], np.float32), np.ones(2, np.float32),
                       np.zeros(2, np.int16), 1)
    both, second = np.array([0, 1], np.int32), np.array([1], np.int32)
    for version, entry in VERSIONS.items():
        kernel = entry.recipe.parallel
        out = np.empty(2, np.float32)
        kernel(scorer._values, scorer._scale, scorer._formats, both, tab, 2, 1, out)  # 3.2; expert 1: 4.5 + 0.2
        assert out == pytest.approx([3.2, 4.7], abs=1e-6), f"v{version}"
        kernel(scorer._values, scorer._scale, scorer._formats, second, tab_tie, 2, 1, out)
        assert out[0] == pytest.approx(2.1, abs=1e-6), f"v{version}"


def test_fp16_bits_convert_exactly():
    values = np.array([[0.0, -0.0, 1.0, -2.5, 6.1e-5, 5.96e-8, 65504.0, -65504.0]], np.float16)
    scorer = CpuScorer(values, np.ones(1, np.float32), np.zeros(1, np.int16), 1)
    assert storage_view(values).dtype == np.uint16
    # one expert, its gate and product both read element j: the expert row picks element j
    for j in range(values.shape[1]):
        rows = np.zeros((2, 8), np.float32)
        rows[1, j] = 1.0
        got = scorer.score(np.array([0], np.int32), _table(rows, np.zeros(2)))
        assert got[0] == np.float32(values[0, j])


def test_set_row_grows_and_bad_rows_are_refused():
    rng = np.random.default_rng(5)
    model = MoeModel.init(5, D=16)
    table = quantize((rng.standard_normal((10, 16)) / 4).astype(np.float32), "int8")
    formats = rng.integers(0, model.F, 10)
    scorer = CpuScorer.from_table(table, formats, model.top_k)
    new = quantize((rng.standard_normal((1, 16)) / 4).astype(np.float32), "int8")
    scorer.set_row(25, new.values[0], float(new.scale[0]), 3)
    assert scorer.rows == 26 and scorer.capacity >= 26
    us = user_side(model, random_requests(rng, 1)[0])
    tab = fold_user_side(us)
    got = scorer.score(np.array([25]), tab)
    ref = reference_scores(model, us, new, [0], [3])
    assert _max_error(got, ref) <= SCORE_ATOL
    with pytest.raises(IndexError):
        scorer.score(np.array([26], np.int32), tab)


def test_read_only_tables_are_copied_so_rows_can_be_set():
    rng = np.random.default_rng(9)
    table = quantize((rng.standard_normal((4, 8)) / 4).astype(np.float32), "fp16")
    values = table.values.copy()
    values.setflags(write=False)  # as loaded from Arrow or a pickle
    scorer = CpuScorer(values, table.scale, np.zeros(4, np.int16), 2)
    scorer.set_row(1, np.ones(8, np.float16), 1.0, 0)
    assert np.array_equal(values, table.values)  # the caller's array is untouched


def test_table_width_inverts_and_bad_tables_are_refused():
    for E in (1, 2, 6, 9):
        for D in (1, 2, 3, 16, 64, 128):
            assert table_experts(table_width(E, D), D) == E
    with pytest.raises(ValueError, match="fits no expert count"):
        table_experts(table_width(6, 64) + 4, 64)
    scorer = CpuScorer(np.ones((2, 8), np.float32), np.ones(2, np.float32), np.zeros(2, np.int16), 2)
    with pytest.raises(ValueError, match="fits no expert count"):
        scorer.score(np.array([0], np.int32), np.zeros((1, table_width(6, 16)), np.float32))  # made for D=16
    with pytest.raises(ValueError, match="2-D"):
        scorer.score(np.array([0], np.int32), np.zeros(table_width(6, 8), np.float32))
