"""The unfused pipeline (andromeda_nb/unfused.py) on NumPy: routing by repeated argmax gives the
float64 formula's scores and gate-tie marks, ties to the lower expert, at every top-k."""

import numpy as np
import pytest

from andromeda_nb.model import UserSide
from andromeda_nb.unfused import unfused_scores

from tests.gpu.test_score_kernels import random_user_side, reference64


@pytest.mark.parametrize("top", [1, 2, 3, 6])
def test_unfused_equals_the_formula(top):
    rng = np.random.default_rng(top)
    us = random_user_side(rng, D=16, E=6, F=3, top=top)
    values = rng.standard_normal((4000, 16)).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, 4000).astype(np.float32)
    formats = rng.integers(0, 3, 4000)
    got, tie = unfused_scores(np, values, scale, formats, us, top)
    want, want_tie = reference64(us, values, scale, formats)
    assert np.allclose(got, want, rtol=0, atol=1e-12)
    if top < 6:
        assert np.array_equal(tie, want_tie)
    got32, _ = unfused_scores(np, values, scale, formats, us, top, dtype=np.float32)
    assert got32.dtype == np.float32 and np.allclose(got32, want, atol=1e-4)


def test_exact_gate_ties_route_to_the_lower_expert():
    rng = np.random.default_rng(5)
    base = random_user_side(rng, D=8, E=4, F=1, top=1)
    us = UserSide(U=base.U, Q=np.stack([base.Q[0], base.Q[0], -base.Q[0], -base.Q[0]]), gamma=base.gamma,
                  beta=base.beta, c=base.c, top_k=1)
    values = rng.standard_normal((50, 8)).astype(np.float32)
    got, tie = unfused_scores(np, values, np.ones(50, np.float32), np.zeros(50, np.int64), us, 1)
    r = us.gamma[0] * values.astype(np.float64) + us.beta[0]
    g0 = r @ us.Q[0]
    expect = np.where(g0 >= 0, r @ us.U[0], r @ us.U[2])  # experts 0 = 1 and 2 = 3: the lower wins
    assert np.allclose(got, expect) and tie.all()
