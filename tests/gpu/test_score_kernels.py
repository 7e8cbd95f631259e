"""Fused scoring kernels (gpu/kernels/score.py) under the CUDA simulator at tiny sizes, against the
float64 reference (andromeda_nb.reference); the shared per-ad formula on its own; the tiled layout;
every kernel compiled for sm_90 with numba.cuda.compile_ptx (a subprocess without the simulator)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from andromeda_nb.constants import GATE_TIE_ATOL
from andromeda_nb.model import UserSide, quantize
from andromeda_nb.compare import compare_topk
from andromeda_nb.scoring import dot_score, dot_table, fold_tables, moe_score, table_width
from andromeda_nb.slots import CHUNK_SLOTS

from tests.support.ptx import needs_nvrtc

ROOT = Path(__file__).resolve().parents[2]
D, E, F, TOP = 16, 3, 2, 2


def random_user_side(rng, D=D, E=E, F=F, top=TOP):
    return UserSide(U=np.tanh(rng.standard_normal((E, D))), Q=2.0 * rng.standard_normal((E, D)),
                    gamma=1.0 + 0.3 * rng.standard_normal((F, D)), beta=0.05 * rng.standard_normal((F, D)),
                    c=np.zeros(17), top_k=top)


def reference64(us, values, scale, formats, *, alternative: bool = False):
    """The DESIGN section 3 formula in float64, literally; plus whether the gate's k-th and (k+1)-th
    logits tie within GATE_TIE_ATOL; with `alternative`, also the score under the other acceptable
    routing (the k-th and (k+1)-th experts exchanged; NaN where there is no tie)."""
    a = values.astype(np.float64) * scale.astype(np.float64)[:, None]
    r = us.gamma[formats] * a + us.beta[formats]
    g = r @ us.Q.T / math.sqrt(us.D)
    x = r @ us.U.T
    order = np.argsort(-g, axis=1, kind="stable")

    def routed(top):
        gt = np.take_along_axis(g, top, axis=1)
        w = np.exp(gt - gt.max(axis=1, keepdims=True))
        w /= w.sum(axis=1, keepdims=True)
        return (w * np.take_along_axis(x, top, axis=1)).sum(axis=1), gt

    s, gt = routed(order[:, : us.top_k])
    if us.top_k < us.E:
        nxt = np.take_along_axis(g, order[:, us.top_k : us.top_k + 1], axis=1)[:, 0]
        tie = (gt[:, -1] - nxt) <= GATE_TIE_ATOL
        swapped = np.concatenate([order[:, : us.top_k - 1], order[:, us.top_k : us.top_k + 1]], axis=1)
        alt = np.where(tie, routed(swapped)[0], np.nan)
    else:
        tie, alt = np.zeros(len(s), bool), np.full(len(s), np.nan)
    return (s, tie, alt) if alternative else (s, tie)


def test_per_ad_formula_hand_computed():
    # D = 2, E = 2, one format, top 1: gate picks expert 1, score = dot(UG[1], a) + ub[1]
    U = np.array([[1.0, 0.0], [0.5, -1.0]])
    Q = np.array([[0.0, 1.0], [1.0, 0.0]])
    gamma = np.array([[2.0, 1.0]])
    beta = np.array([[0.0, 0.5]])
    tab = fold_tables(U, Q, gamma, beta)
    assert tab.shape == (1, table_width(2, 2))
    emb = np.array([[1.0, -1.0]], np.float32)
    # r = (2, -0.5); g0 = -0.5/sqrt2, g1 = 2/sqrt2 -> expert 1; score = 0.5*2 + (-1)(-0.5) = 1.5
    got = moe_score(emb, 0, np.float32(1.0), tab, 0, 2, 2, 1, np.zeros(2, np.float32))
    assert got == pytest.approx(1.5, abs=1e-6)
    # top 2: w = softmax(g1, g0); score = w1 * 1.5 + w0 * dot(U0, r) = w1 * 1.5 + w0 * 2
    g = np.array([-0.5, 2.0]) / math.sqrt(2)
    w = np.exp(g - g.max()) / np.exp(g - g.max()).sum()
    got2 = moe_score(emb, 0, np.float32(1.0), tab, 0, 2, 2, 2, np.zeros(2, np.float32))
    assert got2 == pytest.approx(w[1] * 1.5 + w[0] * 2.0, abs=1e-6)
    assert dot_score(emb, 0, np.float32(2.0), dot_table(np.array([3.0, 1.0]), 2), 2) == pytest.approx(4.0)


def test_gate_ties_route_to_the_lower_expert():
    # equal logits for experts 0 and 1, top 1: expert 0 is chosen
    U = np.array([[1.0, 1.0], [-1.0, -1.0]])
    Q = np.array([[1.0, 0.0], [1.0, 0.0]])
    tab = fold_tables(U, Q, np.ones((1, 2)), np.zeros((1, 2)))
    emb = np.array([[1.0, 2.0]], np.float32)
    assert moe_score(emb, 0, np.float32(1.0), tab, 0, 2, 2, 1, np.zeros(2, np.float32)) == pytest.approx(3.0)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_tiles_round_trip(precision):
    rng = np.random.default_rng(3)
    from gpu.kernels.tiles import from_tiles, to_tiles

    values = quantize(rng.standard_normal((64, D)).astype(np.float32), precision).values
    tiles = to_tiles(values)
    assert tiles.dtype == np.uint32 and tiles.size * 4 == values.nbytes
    assert np.array_equal(from_tiles(tiles, values.dtype, D), values)
    # word 0 of slot 1 sits at lane 1 of the first quad
    assert tiles[4] == values[1].view(np.uint32)[0]


def _case(seed, precision, n_chunks=2, R=2):
    rng = np.random.default_rng(seed)
    S = n_chunks * CHUNK_SLOTS
    chunk_format = rng.integers(0, F, n_chunks).astype(np.int16)
    table = quantize((rng.standard_normal((S, D)) / math.sqrt(D)).astype(np.float32), precision)
    ids = rng.permutation(10 * S)[:S].astype(np.int64)
    sides = [random_user_side(rng) for _ in range(R)]
    elig = rng.integers(0, 2**32, (R, S // 32), dtype=np.uint64).astype(np.uint32)
    return rng, chunk_format, table, ids, sides, elig


def _check(answers, sides, table, fmt_slot, ids, elig, k, kind, u=None, context=""):
    """Every answer against the float64 formula: each score equal to the reference routing's, or on a
    gate-tie row to the other acceptable routing's (within SCORE_ATOL); the top-K the reference's,
    tied rows compared by the range of their acceptable scores (`andromeda_nb.compare.compare_topk`)."""
    for r, (got_ids, got_scores) in enumerate(answers):
        rows = np.flatnonzero(np.unpackbits(elig[r].view(np.uint8), bitorder="little"))
        if kind == "moe":
            ref, tie, alt = reference64(sides[r], table.values[rows], table.scale[rows], fmt_slot[rows],
                                        alternative=True)
        else:
            ref = table.dequantize(rows) @ u
            tie, alt = np.zeros(len(rows), bool), np.full(len(rows), np.nan)
        assert len(got_ids) == min(k, len(rows)), f"{context} request {r}"
        cmp = compare_topk(ids[rows], (ref, tie, alt), got_ids, got_scores, k)
        assert cmp.ok, f"{context} request {r} ({int(tie.sum())} gate ties): {cmp.message}"


def test_gate_tie_rows_must_take_an_acceptable_routing():
    """The check itself: on rows whose 2nd and 3rd gate logits tie (two equal gate keys), a score from
    either routing passes and a score from neither fails; an answer that drops a row fails."""
    rng = np.random.default_rng(9)
    us = random_user_side(rng, E=4, top=2)
    us = UserSide(U=us.U, Q=np.stack([3 * us.Q[0], us.Q[1], us.Q[1], -3 * np.abs(us.Q[0])]), gamma=us.gamma,
                  beta=us.beta, c=us.c, top_k=2)
    table = quantize((rng.standard_normal((64, D)) / math.sqrt(D)).astype(np.float32), "fp32")
    fmt = np.zeros(64, np.int64)
    ids = np.arange(64, dtype=np.int64)
    elig = np.full((1, 2), 0xFFFFFFFF, np.uint32)
    ref, tie, alt = reference64(us, table.values, table.scale, fmt, alternative=True)
    assert tie.sum() > 5  # the construction ties the routing on many rows
    k = 64  # every row answered: order decided by score, ties by id
    order = np.lexsort((ids, -ref))
    good = [(ids[order], ref[order].astype(np.float32))]
    _check(good, [us], table, fmt, ids, elig, k, "moe", context="reference routing")
    i = int(np.flatnonzero(tie[order] & (np.abs(alt - ref)[order] > 1e-2))[0])
    other = [(good[0][0], good[0][1].copy())]
    other[0][1][i] = np.float32(alt[order][i])
    scores = other[0][1].astype(np.float64)
    resorted = np.lexsort((good[0][0], -scores))
    _check([(good[0][0][resorted], other[0][1][resorted])], [us], table, fmt, ids, elig, k, "moe",
           context="other routing")
    neither = [(good[0][0][resorted], other[0][1][resorted].copy())]
    j = int(np.flatnonzero(good[0][0][resorted] == good[0][0][i])[0])
    neither[0][1][j] = np.float32((ref[order][i] + alt[order][i]) / 2)
    with pytest.raises(AssertionError):
        _check(neither, [us], table, fmt, ids, elig, k, "moe", context="neither routing")
    with pytest.raises(AssertionError):
        _check([(good[0][0][1:], good[0][1][1:])], [us], table, fmt, ids, elig, k, "moe", context="a row dropped")


@pytest.mark.parametrize("version,precision", [(1, "fp32"), (1, "int8"), (2, "fp32"), (2, "fp16"), (2, "int8"),
                                               (3, "fp32"), (3, "fp16"), (3, "int8"), (4, "fp16"), (4, "int8")])
def test_moe_kernels_equal_the_reference(precision, version):
    from gpu.fused import FusedScorer
    from gpu.lab import score as score_lab

    seed = 100 + version * 10 + ["fp32", "fp16", "int8"].index(precision)
    rng, chunk_format, table, ids, sides, elig = _case(seed, precision)
    fs = FusedScorer(table.values, table.scale, chunk_format, ids, experts=E, top_e=TOP,
                     version=score_lab.VERSIONS[version])
    tabs = np.stack([fold_tables(s.U, s.Q, s.gamma, s.beta) for s in sides])
    k = int(rng.choice([3, 40, 600]))  # selection inside blocks, and every eligible ad kept
    fmt_slot = np.repeat(chunk_format, CHUNK_SLOTS)
    _check(fs.topk(elig, tabs, k), sides, table, fmt_slot, ids, elig, k, "moe",
           context=f"seed {seed} v{version} {precision} k={k}")


@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_dot_kernels_equal_the_reference(version):
    from gpu.fused import FusedScorer
    from gpu.lab import score as score_lab

    precision = ["int8", "fp16", "fp32", "int8"][version - 1]
    seed = 200 + version
    rng, chunk_format, table, ids, sides, elig = _case(seed, precision, R=1)
    u = rng.standard_normal(D)
    fs = FusedScorer(table.values, table.scale, chunk_format, ids, experts=E, top_e=TOP,
                     version=score_lab.VERSIONS[version], kind="dot")
    k = 25
    _check(fs.topk(elig, dot_table(u, E, F)[None], k), sides, table, None, ids, elig, k, "dot", u=u,
           context=f"seed {seed} v{version} dot {precision}")


@needs_nvrtc
def test_kernels_compile_for_sm90_without_local_memory():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(ROOT)
    script = str(ROOT / "tests" / "support" / "ptx_check.py")
    # two processes side by side (the biggest kernels compile slowest)
    procs = [subprocess.Popen([sys.executable, script, "16", "2", "1", versions, *extra], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
             for versions, extra in (("1,2,3", []), ("4", ["no-topk"]))]
    rows = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(rows) == 4 * 2 * 3 + 4 + 1 + 3, rows  # scoring versions x kinds x precisions, top-K v2 and v3, gather
    assert not [r["kernel"] for r in rows if r["local_memory"]]
