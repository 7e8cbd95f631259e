"""The model of DESIGN section 3: context vector, user side, two-tower vector, model.npz, quantization.

Hand-computed cases use D=4, E=3, k=2, F=2, S=2 with weights whose products can be written down."""

import math

import numpy as np
import pytest

from andromeda_nb.constants import CONTEXT_WIDTH, DEVICE_PLATFORMS, PUBLISHER_PLATFORMS, USER_OS
from andromeda_nb.derive import ad_embeddings, request_signals
from andromeda_nb.model import (
    MODEL_ARRAYS,
    EmbeddingTable,
    ModelError,
    MoeModel,
    context_vector,
    context_vectors,
    hour_bucket,
    quantize,
    two_tower_vector,
    user_side,
    user_sides,
)
from andromeda_nb.types import Context, Request, User

SEED = 20260412


def tiny_model(**extra) -> MoeModel:
    """E=3, D=4, S=2, F=2, C=17 with simple weights (see the expected values in the tests)."""
    E, D, S, F, C = 3, 4, 2, 2, CONTEXT_WIDTH
    W = np.zeros((E, D, S), np.float32)
    for e in range(E):
        W[e, :, 0] = 0.1 * (e + 1)  # every output unit reads 0.1(e+1) * x_e[0]
        W[e, e, 1] = 0.5  # unit e also reads 0.5 * x_e[1]
    b = np.zeros((E, D), np.float32)
    b[:, 3] = -0.25
    K = np.zeros((E, D, D), np.float32)
    for e in range(E):
        K[e] = np.eye(D, dtype=np.float32) * (e + 1)  # q_e = (e+1) * u_e
    A = np.zeros((F, D, C), np.float32)
    A[1, 0, 0] = 0.5  # facebook
    A[1, 1, 13 + 2] = -1.0  # hour bucket 2
    B = np.zeros((F, D, C), np.float32)
    B[0, 2, 4] = 0.75  # mobile
    B[1, 3, 7 + 1] = -0.125  # Android
    return MoeModel(W, b, K, A, B, top_k=2, **extra)


def tiny_request(time=13 * 3600) -> Request:
    x = np.array([[1.0, 2.0], [-1.0, 0.5], [0.25, -2.0]], np.float32)
    ctx = Context("facebook", "mobile", "Android", time)
    return Request(7, User(age=30), ctx, x)


# --- context vector ---------------------------------------------------------------------------------


def test_context_vector_hand_computed():
    c = context_vector(Context("instagram", "connected_tv", "macOS", 1_700_000_000))
    expected = np.zeros(17)
    expected[1] = 1  # instagram is the 2nd publisher platform
    expected[4 + 2] = 1  # connected_tv is the 3rd device platform
    expected[7 + 3] = 1  # macOS is the 4th OS
    # 1_700_000_000 // 3600 = 472222; 472222 % 24 = 22; 22 // 6 = 3
    expected[13 + 3] = 1
    assert c.dtype == np.float64 and c.shape == (CONTEXT_WIDTH,)
    np.testing.assert_array_equal(c, expected)


def test_context_vector_every_value_lands_in_its_own_slot():
    seen = set()
    for i, p in enumerate(PUBLISHER_PLATFORMS):
        for j, d in enumerate(DEVICE_PLATFORMS):
            for k, o in enumerate(USER_OS):
                c = context_vector(Context(p, d, o, 0))
                assert c.sum() == 4
                hot = tuple(np.flatnonzero(c))
                assert hot == (i, 4 + j, 7 + k, 13)
                seen.add(hot)
    assert len(seen) == 4 * 3 * 6


@pytest.mark.parametrize("time,bucket", [(0, 0), (6 * 3600 - 1, 0), (6 * 3600, 1), (12 * 3600, 2),
                                         (18 * 3600 + 5, 3), (24 * 3600 - 1, 3), (24 * 3600, 0),
                                         (-1, 3), (5 * 86400 + 7 * 3600, 1)])
def test_hour_bucket(time, bucket):
    assert hour_bucket(time) == bucket
    assert context_vector(Context("facebook", "mobile", "iOS", time))[13 + bucket] == 1


def test_context_vector_rejects_unknown_values():
    with pytest.raises(ModelError, match="context.user_os.*'BeOS'"):
        context_vector(Context("facebook", "mobile", "BeOS", 0))
    with pytest.raises(ModelError, match="context.publisher_platform"):
        context_vector(Context("Facebook", "mobile", "iOS", 0))


# --- user side --------------------------------------------------------------------------------------


def test_user_side_hand_computed():
    model, req = tiny_model(), tiny_request()
    us = user_side(model, req)
    x = req.signals.astype(np.float64)
    # U[e][d] = tanh(0.1(e+1) x_e[0] + (d == e) 0.5 x_e[1] + (d == 3) (-0.25))
    for e in range(3):
        for d in range(4):
            pre = 0.1 * (e + 1) * x[e, 0] + (0.5 * x[e, 1] if d == e else 0.0) + (-0.25 if d == 3 else 0.0)
            assert us.U[e, d] == pytest.approx(math.tanh(pre), abs=1e-7)
    assert us.U[0, 0] == pytest.approx(math.tanh(0.1 + 1.0), abs=1e-7)
    # Q[e] = (e+1) U[e]
    np.testing.assert_allclose(us.Q, us.U * np.array([[1.0], [2.0], [3.0]]), rtol=0, atol=1e-15)
    # context: facebook, mobile, Android, 13h -> bucket 2
    # gamma[0] = 1; gamma[1] = 1 + tanh([0.5, -1.0, 0, 0])
    np.testing.assert_allclose(us.gamma[0], [1, 1, 1, 1], atol=0)
    np.testing.assert_allclose(us.gamma[1], [1 + math.tanh(0.5), 1 + math.tanh(-1.0), 1, 1], atol=1e-15)
    # beta[0] = [0, 0, 0.75, 0]; beta[1] = [0, 0, 0, -0.125]
    np.testing.assert_array_equal(us.beta, [[0, 0, 0.75, 0], [0, 0, 0, -0.125]])
    for arr in (us.U, us.Q, us.gamma, us.beta):
        assert arr.dtype == np.float64
    assert us.top_k == 2
    f32 = us.float32()
    assert set(f32) == {"U", "Q", "gamma", "beta"} and all(a.dtype == np.float32 for a in f32.values())


def test_user_side_film_follows_the_hour_bucket():
    model = tiny_model()
    late = user_side(model, tiny_request(time=19 * 3600))  # bucket 3: A[1, 1, bucket 2] inactive
    assert late.gamma[1, 1] == 1.0
    assert user_side(model, tiny_request()).gamma[1, 1] == pytest.approx(1 + math.tanh(-1.0))


def test_user_side_matches_a_plain_loop_on_random_weights():
    model = MoeModel.init(SEED, D=8, E=4, F=3, S=5)
    req = Request(3, User(age=40), Context("messenger", "desktop", "Linux", 123456789),
                  request_signals(3, SEED, 4, 5))
    us = user_side(model, req)
    c = context_vector(req.context)
    W, b, K = model.W.astype(float), model.b.astype(float), model.K.astype(float)
    A, B = model.A.astype(float), model.B.astype(float)
    x = req.signals.astype(float)
    for e in range(4):
        u = [math.tanh(sum(W[e, d, s] * x[e, s] for s in range(5)) + b[e, d]) for d in range(8)]
        assert us.U[e] == pytest.approx(u, abs=1e-12)
        q = [sum(K[e, d, j] * u[j] for j in range(8)) for d in range(8)]
        assert us.Q[e] == pytest.approx(q, abs=1e-12)
    for f in range(3):
        g = [1 + math.tanh(sum(A[f, d, i] * c[i] for i in range(17))) for d in range(8)]
        bt = [sum(B[f, d, i] * c[i] for i in range(17)) for d in range(8)]
        assert us.gamma[f] == pytest.approx(g, abs=1e-12)
        assert us.beta[f] == pytest.approx(bt, abs=1e-12)


class _Inputs(list):
    """Requests with their model inputs given whole, as the columnar request batch gives them."""

    def __init__(self, x, c):
        super().__init__(range(len(x)))
        self._x, self._c = x, c

    def model_inputs(self):
        return self._x, self._c


def test_film_looked_up_by_context_equals_the_formula_for_every_context():
    """FiLM depends on the context alone: `user_sides` looks gamma and beta up in a table of every
    one-hot context (4 x 3 x 6 x 4), made once per model. Every one of the 288 contexts, each in a
    batch of its own and all in one, gives the formula's values (the batch formula, and `user_side`'s
    for a sample); a model given a new A makes the table again; a context vector that is not one-hot
    in every group (two publishers) is computed by the formula instead of looked up."""
    from andromeda_nb import model as M

    model = MoeModel.init(SEED, D=8, E=4, F=3, S=5)
    rng = np.random.default_rng(SEED)
    codes = np.indices((len(PUBLISHER_PLATFORMS), len(DEVICE_PLATFORMS), len(USER_OS), 4)).reshape(4, -1)
    assert codes.shape[1] == M.N_CONTEXTS == 288
    c = context_vectors(codes[0], codes[1], codes[2], codes[3] * 6 * 3600 + 17)
    x = rng.standard_normal((len(c), 4, 5))
    A, B = np.asarray(model.A, np.float64), np.asarray(model.B, np.float64)
    want_gamma = 1.0 + np.tanh(np.einsum("fdc,rc->rfd", A, c))
    want_beta = np.einsum("fdc,rc->rfd", B, c)
    _, _, gamma, beta = user_sides(model, _Inputs(x, c))
    np.testing.assert_allclose(gamma, want_gamma, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(beta, want_beta, rtol=1e-13, atol=1e-14)
    for i in rng.choice(len(c), 5, replace=False):
        _, _, g1, b1 = user_sides(model, _Inputs(x[i : i + 1], c[i : i + 1]))
        assert np.array_equal(g1[0], gamma[i]) and np.array_equal(b1[0], beta[i])
        req = Request(int(i), User(age=30), Context(PUBLISHER_PLATFORMS[codes[0, i]], DEVICE_PLATFORMS[codes[1, i]],
                                                    USER_OS[codes[2, i]], int(codes[3, i]) * 6 * 3600 + 17),
                      x[i].astype(np.float32))
        np.testing.assert_allclose(user_side(model, req).gamma, gamma[i], rtol=1e-13, atol=1e-14)

    model.A = (np.asarray(model.A) * 2.0).astype(np.float32)  # new weights: a new table
    _, _, gamma2, _ = user_sides(model, _Inputs(x, c))
    np.testing.assert_allclose(gamma2, 1.0 + np.tanh(2.0 * np.einsum("fdc,rc->rfd", A, c)), rtol=1e-13, atol=1e-14)

    two = c[:2].copy()
    two[0, 1] = 1.0  # row 0 holds two publishers: not a context of the table
    assert M._context_numbers(two) is None and M._context_numbers(c[:2]) is not None
    _, _, g2, b2 = user_sides(model, _Inputs(x[:2], two))
    A2 = np.asarray(model.A, np.float64)
    np.testing.assert_allclose(g2, 1.0 + np.tanh(np.einsum("fdc,rc->rfd", A2, two)), rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(b2, np.einsum("fdc,rc->rfd", B, two), rtol=1e-13, atol=1e-14)


def test_user_sides_of_a_batch_equal_user_side_request_by_request():
    model = MoeModel.init(SEED, D=8, E=4, F=3, S=5)
    rng = np.random.default_rng(SEED)
    reqs = [Request(i, User(age=20 + i), Context(("facebook", "instagram", "messenger")[i % 3],
                                                ("mobile", "desktop")[i % 2], "Linux", int(rng.integers(0, 2**31))),
                    rng.standard_normal((4, 5)).astype(np.float32)) for i in range(7)]
    U, Q, gamma, beta = user_sides(model, reqs)
    assert U.shape == Q.shape == (7, 4, 8) and gamma.shape == beta.shape == (7, 3, 8)
    for i, req in enumerate(reqs):
        us = user_side(model, req)
        for got, want in ((U[i], us.U), (Q[i], us.Q), (gamma[i], us.gamma), (beta[i], us.beta)):
            np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-14)
    assert user_sides(model, [])[0].shape == (0, 4, 8)
    bad = Request(9, User(age=30), reqs[0].context, np.full((4, 5), np.inf, np.float32))
    with pytest.raises(ModelError, match="request 9: signals: contains NaN"):
        user_sides(model, [reqs[0], bad])


def test_user_side_rejects_bad_signals():
    model = tiny_model()
    req = tiny_request()
    bad = Request(req.request_id, req.user, req.context, np.zeros((3, 3), np.float32))
    with pytest.raises(ModelError, match=r"request 7: signals: expected shape \(3, 2\)"):
        user_side(model, bad)
    nan = Request(req.request_id, req.user, req.context, np.full((3, 2), np.nan, np.float32))
    with pytest.raises(ModelError, match="NaN"):
        user_side(model, nan)


def test_two_tower_vector_fallback_and_trained():
    model, req = tiny_model(), tiny_request()
    np.testing.assert_allclose(two_tower_vector(model, req), user_side(model, req).U.mean(axis=0), atol=0)
    T = np.arange(4 * 6, dtype=np.float32).reshape(4, 6) / 10
    t = np.array([1, -1, 0.5, 0], np.float32)
    trained = model.with_two_tower(T, t)
    x = req.signals.astype(np.float64).reshape(-1)  # x_0 ++ x_1 ++ x_2
    expected = [sum(float(T[d, j]) * x[j] for j in range(6)) + float(t[d]) for d in range(4)]
    assert two_tower_vector(trained, req) == pytest.approx(expected, abs=1e-12)
    with pytest.raises(ModelError, match=r"T: expected shape \(4, 6\)"):
        model.with_two_tower(T[:, :5], t)


# --- weights ----------------------------------------------------------------------------------------


def test_init_is_seeded_and_shaped():
    a, b = MoeModel.init(SEED), MoeModel.init(SEED)
    assert (a.E, a.D, a.S, a.F, a.C, a.top_k) == (6, 64, 16, 8, 17, 2)
    for name in ("W", "b", "K", "A", "B"):
        assert getattr(a, name).dtype == np.float32
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(MoeModel.init(SEED + 1).K, a.K)
    small = MoeModel.init(1, D=16, E=3, F=2, top_k=1)
    assert small.W.shape == (3, 16, 16) and small.A.shape == (2, 16, 17) and small.top_k == 1


def test_init_scales_give_spread_gates_and_unit_scores():
    """Scores O(1) and gate logits spread, so exact routing ties are rare (DESIGN section 4)."""
    model = MoeModel.init(SEED)
    emb = ad_embeddings(np.arange(4000), SEED, 64).astype(np.float64)
    f = np.arange(4000) % 8
    gate_std, score_std, near_ties = [], [], 0
    for rid in range(5):
        req = Request(rid, User(age=30), Context("facebook", "mobile", "iOS", rid * 7919),
                      request_signals(rid, SEED, 6, 16))
        us = user_side(model, req)
        r = us.gamma[f] * emb + us.beta[f]
        g = r @ us.Q.T / 8
        gate_std.append(g.std())
        score_std.append((r @ us.U.T).std())
        srt = -np.sort(-g, axis=1)
        near_ties += int((srt[:, 1] - srt[:, 2] <= 1e-4).sum())
    assert 0.3 < np.mean(gate_std) < 3
    assert 0.2 < np.mean(score_std) < 3
    assert near_ties < 0.002 * 5 * 4000


def test_model_rejects_bad_shapes_and_dtypes():
    m = tiny_model()
    with pytest.raises(ModelError, match=r"K: expected shape \(3, 4, 4\)"):
        MoeModel(m.W, m.b, m.K[:, :3], m.A, m.B)
    with pytest.raises(ModelError, match="b: dtype must be float32, got float64"):
        MoeModel(m.W, m.b.astype(np.float64), m.K, m.A, m.B)
    with pytest.raises(ModelError, match=r"A: expected shape \(2, 4, 17\)"):
        MoeModel(m.W, m.b, m.K, m.A[:, :, :16], m.B[:, :, :16])
    with pytest.raises(ModelError, match="top_k: must be between 1 and E=3"):
        MoeModel(m.W, m.b, m.K, m.A, m.B, top_k=4)
    with pytest.raises(ModelError, match="W: expected 3 dimensions"):
        MoeModel(m.W[0], m.b, m.K, m.A, m.B)
    W = m.W.copy()
    W[0, 0, 0] = np.inf
    with pytest.raises(ModelError, match="W: contains NaN or infinite"):
        MoeModel(W, m.b, m.K, m.A, m.B)
    with pytest.raises(ModelError, match="T and t must both be present"):
        MoeModel(m.W, m.b, m.K, m.A, m.B, T=np.zeros((4, 6), np.float32))


def test_npz_round_trip(tmp_path):
    m = MoeModel.init(SEED, D=8, E=3, F=2, top_k=1)
    path = tmp_path / "model.npz"
    m.save(path)
    back = MoeModel.load(path)
    assert back.top_k == 1 and not back.has_two_tower
    for name in ("W", "b", "K", "A", "B"):
        np.testing.assert_array_equal(getattr(back, name), getattr(m, name))
    trained = m.with_two_tower(np.full((8, 48), 0.5, np.float32), np.arange(8, dtype=np.float32))
    trained.save(tmp_path / "trained.npz")
    back = MoeModel.load(tmp_path / "trained.npz")
    np.testing.assert_array_equal(back.T, trained.T)
    np.testing.assert_array_equal(back.t, trained.t)


def test_npz_errors_name_file_and_array(tmp_path):
    m = tiny_model()
    arrays = {n: getattr(m, n) for n in ("W", "b", "K", "A", "B")}
    path = tmp_path / "no_top_k.npz"
    np.savez(path, **arrays)
    assert MoeModel.load(path).top_k == 2  # default when absent
    missing = tmp_path / "missing.npz"
    np.savez(missing, **{n: a for n, a in arrays.items() if n != "K"})
    with pytest.raises(ModelError, match=r"missing.npz: missing array\(s\) K"):
        MoeModel.load(missing)
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, **{**arrays, "B": arrays["B"][:, :3]})
    with pytest.raises(ModelError, match=r"wrong.npz: B: expected shape \(2, 4, 17\)"):
        MoeModel.load(wrong)
    f64 = tmp_path / "f64.npz"
    np.savez(f64, **{**arrays, "W": arrays["W"].astype(np.float64)})
    with pytest.raises(ModelError, match="f64.npz: W: dtype must be float32"):
        MoeModel.load(f64)
    with pytest.raises(ModelError, match="no such model file"):
        MoeModel.load(tmp_path / "absent.npz")
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip file")
    with pytest.raises(ModelError, match="junk.npz: not a model: it is not a zip archive; model.npz is a NumPy"):
        MoeModel.load(junk)


def test_a_file_that_is_not_a_model_is_named_for_what_it_is(tmp_path):
    """--model given the wrong file says what the file is and what a model is, never numpy's advice
    to programmers (allow_pickle=)."""
    jsonl = tmp_path / "ads.jsonl"
    jsonl.write_text('{"ad_id": 1, "targeting": {}}\n')
    with pytest.raises(ModelError, match=r"ads.jsonl: not a model: it is JSON text \(an ads or requests file\?\)"):
        MoeModel.load(jsonl)
    single = tmp_path / "one.npy"
    np.save(single, np.zeros(3, np.float32))
    with pytest.raises(ModelError, match=r"it is a single NumPy array \(.npy\)"):
        MoeModel.load(single)
    objects = tmp_path / "objects.npz"
    np.savez(objects, **{name: np.array([None, None], dtype=object) for name in MODEL_ARRAYS})
    with pytest.raises(ModelError, match="objects.npz: an array holds Python objects, not numbers") as caught:
        MoeModel.load(objects)
    assert "allow_pickle" not in str(caught.value)
    broken = tmp_path / "broken.npz"
    broken.write_bytes(b"PK\x03\x04 and then nothing a zip holds")
    with pytest.raises(ModelError, match=r"broken.npz: not a readable model.npz \(BadZipFile\)"):
        MoeModel.load(broken)


# --- stored embeddings ------------------------------------------------------------------------------


def random_embeddings(n=300, d=16, seed=SEED):
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal((n, d)) / math.sqrt(d)).astype(np.float32)
    a[5] *= 1000  # a row with large values
    a[6] *= 1e-6  # and one with tiny values
    return a


def test_quantize_fp32_is_exact():
    a = random_embeddings()
    t = quantize(a, "fp32")
    assert t.values.dtype == np.float32 and t.values is not a
    np.testing.assert_array_equal(t.scale, np.ones(len(a), np.float32))
    np.testing.assert_array_equal(t.dequantize(), a.astype(np.float64))
    assert t.nbytes == a.nbytes


def test_quantize_fp16_error_bound():
    a = random_embeddings()
    t = quantize(a, "fp16")
    assert t.values.dtype == np.float16
    err = np.abs(t.dequantize() - a.astype(np.float64))
    # round to nearest: half an ulp, 2^-11 relative for normal numbers, 2^-25 absolute below them
    assert np.all(err <= np.maximum(np.abs(a) * 2.0**-11, 2.0**-25))
    assert err.max() > 0  # fp16 is not fp32
    with pytest.raises(ModelError, match="row 0 has a value beyond the float16 range"):
        quantize(np.array([[1e6, 0.0]], np.float32), "fp16")


def test_quantize_int8_scale_rounding_and_error_bound():
    a = random_embeddings()
    a[7] = 0.0  # all-zero row
    t = quantize(a, "int8")
    assert t.values.dtype == np.int8 and t.scale.dtype == np.float32
    maxabs = np.abs(a.astype(np.float64)).max(axis=1)
    np.testing.assert_array_equal(t.scale, (maxabs / 127).astype(np.float32))
    assert t.scale[7] == 0 and np.all(t.values[7] == 0)
    q = t.values.astype(np.int64)
    assert q.min() >= -127 and q.max() <= 127
    nz = maxabs > 0
    assert np.all(np.abs(q[nz]).max(axis=1) == 127)  # the largest entry of every row maps to +-127
    # values = rint(a / scale), checked entry by entry for a few rows
    for i in (0, 5, 6, 99):
        s = float(t.scale[i])
        assert [int(v) for v in t.values[i]] == [int(np.clip(round(float(v) / s), -127, 127)) for v in a[i]]
    err = np.abs(t.dequantize() - a.astype(np.float64))
    assert np.all(err <= t.scale.astype(np.float64)[:, None] * (0.5 + 1e-6))
    assert t.nbytes == a.size + 4 * len(a)


def test_dequantize_is_exactly_scale_times_values():
    a = random_embeddings(64, 8)
    t = quantize(a, "int8")
    rows = np.array([3, 0, 63, 3])
    d = t.dequantize(rows)
    assert d.dtype == np.float64 and d.shape == (4, 8)
    for out_row, r in enumerate(rows):
        for j in range(8):
            assert d[out_row, j] == float(t.scale[r]) * float(t.values[r, j])
    np.testing.assert_array_equal(t.take(rows).dequantize(), d)


def test_embedding_table_validation():
    with pytest.raises(ModelError, match="precision: expected one of"):
        quantize(np.zeros((2, 4), np.float32), "bf16")
    with pytest.raises(ModelError, match="precision int8 stores int8, got float32"):
        EmbeddingTable(np.zeros((2, 4), np.float32), np.ones(2, np.float32), "int8")
    with pytest.raises(ModelError, match="all ones for fp16"):
        EmbeddingTable(np.zeros((2, 4), np.float16), np.full(2, 2, np.float32), "fp16")
    with pytest.raises(ModelError, match=r"scale: expected float32 \(2,\)"):
        EmbeddingTable(np.zeros((2, 4), np.int8), np.ones(3, np.float32), "int8")
    with pytest.raises(ModelError, match="row 1 contains NaN"):
        quantize(np.array([[0.0, 1.0], [np.nan, 0.0]], np.float32), "int8")
    empty = EmbeddingTable.empty(4, "int8")
    assert len(empty) == 0 and empty.dequantize().shape == (0, 4)
