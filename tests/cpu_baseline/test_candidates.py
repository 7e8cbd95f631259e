"""The remote GPU scoring service's table (gpu/candidates.py): shipped candidate ids resolved to rows
on the device and scored by gathering, equal to the CPU scorer and the float64 reference, through
upserts, replacements and retirements; an id that is not live is named."""

import numpy as np
import pytest

from andromeda_nb.constants import SCORE_ATOL
from andromeda_nb.model import quantize
from andromeda_nb.scoring import fold_tables
from cpu_baseline.scorer import CpuScorer

from tests.gpu.test_score_kernels import random_user_side, reference64

D, E, F, TOP = 16, 3, 2, 2


def _table(rng, n, precision):
    return quantize((rng.standard_normal((n, D)) / np.sqrt(D)).astype(np.float32), precision)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_gpu_candidate_scores_equal_the_cpu_scorer_and_the_reference(precision):
    from gpu.candidates import GpuCandidateScorer

    rng = np.random.default_rng(7)
    n = 200
    table = _table(rng, n, precision)
    formats = rng.integers(0, F, n).astype(np.int16)
    ids = rng.permutation(10 * n)[:n].astype(np.int64)
    gpu = GpuCandidateScorer.from_table(table, formats, ids, TOP)
    cpu = CpuScorer.from_table(table, formats, TOP)
    rows_of = {int(a): i for i, a in enumerate(ids)}
    values = np.concatenate([table.values, np.zeros((8, D), table.values.dtype)])  # the truth, by row
    scale = np.concatenate([table.scale, np.ones(8, np.float32)])
    fmts = np.concatenate([formats, np.zeros(8, np.int16)])
    for step in range(3):
        side = random_user_side(rng, D=D, E=E, F=F, top=TOP)
        tab = fold_tables(side.U, side.Q, side.gamma, side.beta)
        live = np.array(sorted(rows_of), np.int64)
        cand = rng.choice(live, 60, replace=False)
        rows = np.array([rows_of[int(a)] for a in cand], np.int64)
        got = gpu.score_ids(cand, tab)
        want_cpu = cpu.score(rows, tab)
        assert np.allclose(got, want_cpu, atol=1e-5), f"{precision} step {step}"
        ref, tie = reference64(side, values[rows], scale[rows], fmts[rows])
        assert np.all((np.abs(got - ref) <= SCORE_ATOL) | tie), f"{precision} step {step}"
        # updates: a replacement, a new ad, a retirement
        new_vals = quantize((rng.standard_normal((2, D)) / np.sqrt(D)).astype(np.float32), precision)
        old = int(cand[0])
        fresh = int(ids.max()) + 1 + step
        row = n + step
        for ad, r, j, f in ((old, rows_of[old], 0, 1), (fresh, row, 1, 0)):
            gpu.upsert(ad, new_vals.values[j], float(new_vals.scale[j]), f)
            cpu.set_row(r, new_vals.values[j], float(new_vals.scale[j]), f)
            values[r], scale[r], fmts[r] = new_vals.values[j], new_vals.scale[j], f
        gone = int(cand[1])
        gpu.retire(gone)
        rows_of.pop(gone)
        rows_of[fresh] = row
    with pytest.raises(KeyError, match=f"ad {gone} is not live"):
        gpu.score_ids(np.array([fresh, gone]), tab)


def test_both_candidate_tables_answer_alike_through_the_same_interface():
    """The scoring service holds either table (`serve scorer --device`): the same calls give the same
    scores, sizes and errors on both."""
    from cpu_baseline.candidates import CpuCandidateTable
    from gpu.candidates import GpuCandidateScorer

    rng = np.random.default_rng(11)
    n = 120
    table = _table(rng, n, "int8")
    formats = rng.integers(0, F, n).astype(np.int16)
    ids = (rng.permutation(50 * n)[:n] + (1 << 40)).astype(np.int64)
    tables = {"cpu": CpuCandidateTable(table, formats, ids, top_k=TOP, experts=E, n_formats=F),
              "gpu": GpuCandidateScorer.from_table(table, formats, ids, TOP)}
    live = set(ids.tolist())
    for step in range(3):
        side = random_user_side(rng, D=D, E=E, F=F, top=TOP)
        cand = rng.choice(np.array(sorted(live), np.int64), 50, replace=False)
        cpu_scores, gpu_scores = (t.score_user_side(cand, side.U, side.Q, side.gamma, side.beta) for t in tables.values())
        assert len(cpu_scores) == 50 and np.abs(cpu_scores).max() > 0
        assert np.allclose(cpu_scores, gpu_scores, atol=1e-5), f"step {step}"
        new = quantize((rng.standard_normal((1, D)) / np.sqrt(D)).astype(np.float32), "int8")
        fresh, gone = int(max(live)) + 1, int(cand[0])
        for t in tables.values():
            t.upsert(fresh, new.values[0], float(new.scale[0]), 1)
            t.retire(gone)
        live = (live | {fresh}) - {gone}
        for t in tables.values():
            assert len(t) == len(live) and fresh in t and gone not in t and t.top_k == TOP
        for t in tables.values():
            with pytest.raises(KeyError, match=f"ad {gone} is not live"):
                t.score_user_side(np.array([fresh, gone], np.int64), side.U, side.Q, side.gamma, side.beta)
    assert tables["cpu"].n_rows == tables["gpu"].n_rows
