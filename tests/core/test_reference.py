"""The float64 reference scorer, the reference top-K and the reference retriever.

`loop_score` below is an independent, plain-Python evaluation of DESIGN section 3's per-ad formula
(no numpy linear algebra, routing by sorting (logit, expert) pairs); the vectorized reference must match
it on seeded random data for every precision."""

import dataclasses
import math

import numpy as np
import pytest

from andromeda_nb.compare import compare_topk
from andromeda_nb.constants import MAX_K
from andromeda_nb.dataset import Dataset
from andromeda_nb.derive import ad_embeddings, request_signals
from andromeda_nb.model import EmbeddingTable, MoeModel, UserSide, quantize, two_tower_vector, user_side
from andromeda_nb.reference import (
    ReferenceRetriever,
    acceptable_routings,
    check_k,
    reference_candidates,
    reference_scores,
    reference_topk,
    two_tower_scores,
)
from andromeda_nb.types import Ad, Context, GeoSpec, Request, Retire, SetStatus, TargetingSpec, Upsert, User

SEED = 777


# --- the independent per-ad implementation -----------------------------------------------------------


def loop_routing_score(us: UserSide, a, f: int, experts) -> float:
    D = len(a)
    r = [us.gamma[f][d] * a[d] + us.beta[f][d] for d in range(D)]
    g = {e: sum(us.Q[e][d] * r[d] for d in range(D)) / math.sqrt(D) for e in experts}
    top = max(g.values())
    z = {e: math.exp(g[e] - top) for e in experts}
    total = sum(z.values())
    return sum(z[e] / total * sum(us.U[e][d] * r[d] for d in range(D)) for e in experts)


def loop_score(us: UserSide, a, f: int, k: int):
    """(score, routed experts, logits) for one ad with dequantized embedding `a` and format `f`."""
    D, E = len(a), len(us.U)
    r = [us.gamma[f][d] * a[d] + us.beta[f][d] for d in range(D)]
    g = [sum(us.Q[e][d] * r[d] for d in range(D)) / math.sqrt(D) for e in range(E)]
    routed = [e for _, e in sorted((-g[e], e) for e in range(E))[:k]]
    return loop_routing_score(us, a, f, routed), routed, g


def make_request(rid, seed, E, S, *, country="US", age=30, ctx=None):
    ctx = ctx or Context("facebook", "mobile", "iOS", 1_700_000_000 + 3600 * rid)
    return Request(rid, User(age=age, country=country), ctx, request_signals(rid, seed, E, S))


# --- hand-computed cases (D=4, E=3, k=2) ---------------------------------------------------------------


def hand_side(q, u, gamma1=(1, 1, 1, 1), beta1=(0, 0, 0, 0)) -> UserSide:
    """r = [2, 0, 0, 0] for format 0 and a = e0 * 2: g_e = q_e * 2 / sqrt(4) = q_e, dot(U_e, r) = 2 u_e."""
    Q = np.zeros((3, 4))
    Q[:, 0] = q
    U = np.zeros((3, 4))
    U[:, 0] = u
    U[:, 1] = 9.0  # never read when r[1] = 0
    gamma = np.array([[1.0, 1, 1, 1], gamma1])
    beta = np.array([[0.0, 0, 0, 0], beta1])
    return UserSide(U=U, Q=Q, gamma=gamma, beta=beta, c=np.zeros(17), top_k=2)


def hand_model() -> MoeModel:
    z = np.zeros
    return MoeModel(z((3, 4, 2), np.float32), z((3, 4), np.float32), z((3, 4, 4), np.float32),
                    z((2, 4, 17), np.float32), z((2, 4, 17), np.float32), top_k=2)


A2 = quantize(np.array([[2.0, 0, 0, 0]], np.float32), "fp32")


def test_gate_routing_softmax_and_score_by_hand():
    us = hand_side(q=[0.5, 1.5, 1.0], u=[0.3, -0.2, 0.7])
    res = reference_scores(hand_model(), us, A2, [0], [0])
    # routed: e1 (1.5) and e2 (1.0); w = softmax(1.5, 1.0)
    w1 = 1 / (1 + math.exp(-0.5))
    expected = w1 * 2 * -0.2 + (1 - w1) * 2 * 0.7
    assert res.scores[0] == pytest.approx(expected, abs=1e-15)
    assert not res.ambiguous[0] and np.isnan(res.alt_scores[0])


def test_film_by_hand():
    # format 1: r = 0.5 * [2, 0, 0, 0] + [0.25, 0, 0, 0] = [1.25, 0, 0, 0]
    us = hand_side(q=[0.5, 1.5, 1.0], u=[0.3, -0.2, 0.7], gamma1=(0.5, 1, 1, 1), beta1=(0.25, 0, 0, 0))
    res = reference_scores(hand_model(), us, A2, [0], [1])
    g = [0.5 * 1.25 / 2, 1.5 * 1.25 / 2, 1.0 * 1.25 / 2]
    w1 = 1 / (1 + math.exp(-(g[1] - g[2])))
    assert res.scores[0] == pytest.approx(w1 * 1.25 * -0.2 + (1 - w1) * 1.25 * 0.7, abs=1e-15)


def test_exact_tie_routes_lower_expert_first_and_offers_every_tied_routing():
    us = hand_side(q=[1.0, 1.0, 1.0], u=[0.1, 0.2, 0.4])
    res = reference_scores(hand_model(), us, A2, [0], [0])
    # reference routing {0, 1}, equal weights: 0.5 * 0.2 + 0.5 * 0.4
    assert res.scores[0] == pytest.approx(0.3, abs=1e-15)
    assert res.ambiguous[0]
    assert res.alt_scores[0] == pytest.approx(0.5 * 0.2 + 0.5 * 0.8, abs=1e-15)  # {0, 2}
    assert res.extra[0] == pytest.approx([0.5 * 0.4 + 0.5 * 0.8])  # {1, 2}
    assert sorted(res.accepted(0)) == pytest.approx([0.3, 0.5, 0.6])
    lo, hi = res.bounds()
    assert lo[0] == pytest.approx(0.3) and hi[0] == pytest.approx(0.6)


def test_tie_between_kth_and_next_only():
    us = hand_side(q=[2.0, 1.0, 1.0], u=[0.1, 0.2, 0.4])
    res = reference_scores(hand_model(), us, A2, [0], [0])
    w0 = 1 / (1 + math.exp(-1.0))
    assert res.scores[0] == pytest.approx(w0 * 0.2 + (1 - w0) * 0.4, abs=1e-15)  # {0, 1}
    assert res.alt_scores[0] == pytest.approx(w0 * 0.2 + (1 - w0) * 0.8, abs=1e-15)  # {0, 2}
    assert res.extra == {}


@pytest.mark.parametrize("gap,ambiguous", [(0.5e-4, True), (0.99e-4, True), (2e-4, False), (1e-2, False)])
def test_ambiguity_threshold(gap, ambiguous):
    us = hand_side(q=[2.0, 1.0, 1.0 - gap], u=[0.1, 0.2, 0.4])
    res = reference_scores(hand_model(), us, A2, [0], [0])
    assert bool(res.ambiguous[0]) is ambiguous
    want = [(0, 1), (0, 2)] if ambiguous else [(0, 1)]
    assert acceptable_routings(np.array([2.0, 1.0, 1.0 - gap]), 2) == want


# --- vectorized vs loop on random data ------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("D,E,F,k", [(8, 4, 3, 2), (16, 6, 8, 3), (4, 3, 2, 1)])
def test_vectorized_reference_matches_loop(precision, D, E, F, k):
    model = MoeModel.init(SEED, D=D, E=E, F=F, top_k=k, S=5)
    n = 150
    table = quantize(ad_embeddings(np.arange(n), SEED, D), precision)
    rng = np.random.default_rng(SEED)
    rows = rng.permutation(n)[:120]
    formats = rng.integers(0, F, len(rows))
    for rid in range(2):
        us = user_side(model, make_request(rid, SEED, E, 5))
        res = reference_scores(model, us, table, rows, formats, batch_rows=17)  # several batches
        deq = table.dequantize()
        for i, (row, f) in enumerate(zip(rows, formats)):
            a = [float(v) for v in deq[row]]
            score, routed, g = loop_score(us, a, int(f), k)
            assert res.scores[i] == pytest.approx(score, abs=1e-12), (precision, D, E, k, rid, i)
            srt = sorted(g, reverse=True)
            assert bool(res.ambiguous[i]) == (k < E and srt[k - 1] - srt[k] <= 1e-4)


def test_all_tied_gates_every_row_ambiguous_and_alternatives_match_loop():
    model = MoeModel.init(SEED, D=8, E=4, F=2, top_k=2)
    us0 = user_side(model, make_request(1, SEED, 4, 16))
    Q = us0.Q.copy()
    Q[2] = Q[1] = Q[0]  # experts 0, 1, 2 have identical logits for every ad
    us = dataclasses.replace(us0, Q=Q)
    table = quantize(ad_embeddings(np.arange(40), SEED, 8), "fp32")
    rows, formats = np.arange(40), np.arange(40) % 2
    res = reference_scores(model, us, table, rows, formats)
    deq = table.dequantize()
    n_ambiguous = 0
    for i in range(40):
        a = [float(v) for v in deq[i]]
        score, routed, g = loop_score(us, a, int(formats[i]), 2)
        assert res.scores[i] == pytest.approx(score, abs=1e-12)
        routings = acceptable_routings(np.array(g), 2)
        expected = sorted(loop_routing_score(us, a, int(formats[i]), R) for R in routings)
        assert sorted(res.accepted(i)) == pytest.approx(expected, abs=1e-12)
        n_ambiguous += bool(res.ambiguous[i])
        if g[0] - g[3] > 1e-4:  # the three tied experts lead: routing {0, 1}, every pair of them accepted
            assert routed == [0, 1] and len(routings) == 3
    assert n_ambiguous >= 10


def test_reference_scores_input_checks():
    model = hand_model()
    us = hand_side(q=[0.5, 1.5, 1.0], u=[0.3, -0.2, 0.7])
    with pytest.raises(ValueError, match="formats: 2 is outside 0..1"):
        reference_scores(model, us, A2, [0], [2])
    with pytest.raises(ValueError, match="rows: out of range"):
        reference_scores(model, us, A2, [1], [0])
    empty = reference_scores(model, us, A2, np.array([], np.int64), np.array([], np.int64))
    assert len(empty) == 0


def test_two_tower_scores_match_loop():
    model = MoeModel.init(SEED, D=8, E=3, F=2, S=4)
    table = quantize(ad_embeddings(np.arange(50), SEED, 8), "int8")
    u = two_tower_vector(model, make_request(4, SEED, 3, 4))
    rows = np.array([49, 0, 7, 7, 20])
    got = two_tower_scores(u, table, rows, batch_rows=2)
    deq = table.dequantize()
    for i, r in enumerate(rows):
        assert got[i] == pytest.approx(sum(float(u[d]) * float(deq[r, d]) for d in range(8)), abs=1e-14)


# --- reference top-K -----------------------------------------------------------------------------------


def brute_topk(ids, scores, k):
    pairs = sorted(zip((-s for s in scores), ids))[:k]
    return [i for _, i in pairs], [-s for s, _ in pairs]


def test_reference_topk_ties_by_id_ascending():
    ids = np.array([40, 10, 30, 20, 50])
    scores = np.array([1.0, 2.0, 1.0, 1.0, 0.5])
    got_ids, got_scores = reference_topk(ids, scores, 3)
    assert got_ids.tolist() == [10, 20, 30] and got_scores.tolist() == [2.0, 1.0, 1.0]
    assert reference_topk(ids, scores, 10)[0].tolist() == [10, 20, 30, 40, 50]
    assert reference_topk(ids, scores, 0)[0].tolist() == []
    assert reference_topk(ids[:0], scores[:0], 5)[0].dtype == np.int64


def test_reference_topk_matches_brute_force_with_many_ties():
    rng = np.random.default_rng(SEED)
    for trial in range(20):
        n = int(rng.integers(1, 400))
        ids = rng.permutation(10 * n)[:n]
        scores = rng.integers(0, 12, n) / 4.0  # many exact ties
        k = int(rng.integers(1, n + 5))
        got_ids, got_scores = reference_topk(ids, scores, k)
        want_ids, want_scores = brute_topk(ids.tolist(), scores.tolist(), k)
        assert got_ids.tolist() == want_ids, (trial, n, k)
        assert got_scores.tolist() == want_scores


def test_reference_topk_rejects_nan_and_check_k():
    with pytest.raises(ValueError, match="NaN.*ad 2"):
        reference_topk(np.array([1, 2]), np.array([0.0, np.nan]), 1)
    assert check_k(1) == 1 and check_k(MAX_K) == MAX_K
    for bad in (0, MAX_K + 1, 2.5, True):
        with pytest.raises(ValueError, match="k:"):
            check_k(bad)


def test_reference_candidates_keep_the_boundary_ties():
    ids = np.arange(10) * 10
    scores = np.array([5.0, 4.0, 3.0, 3.00005, 2.99995, 1.0, 0.9, 3.0, 0.1, 2.0])
    from andromeda_nb.compare import _as_result

    cid, cres = reference_candidates(ids, _as_result(scores), 3, 1e-4)
    # top-3: 50 (5.0), 10 (4.0), 30 (3.00005); within 1e-4 of 3.00005: 20, 70 (3.0) and 40 (2.99995)
    assert cid.tolist() == [0, 10, 30, 20, 70, 40]
    assert cres.scores.tolist() == [5.0, 4.0, 3.00005, 3.0, 3.0, 2.99995]


# --- the reference retriever -----------------------------------------------------------------------------

COUNTRIES = ("US", "FR", "BR")


def make_ads(n, seed, D, F, rng):
    ads = []
    for i in range(n):
        countries = frozenset(rng.choice(COUNTRIES, size=int(rng.integers(1, 3)), replace=False).tolist())
        spec = TargetingSpec(age_min=int(rng.integers(18, 40)), geo_locations=GeoSpec(countries=countries))
        status = "PAUSED" if rng.random() < 0.1 else "ACTIVE"
        ad_id = 1000 + 7 * i
        ads.append(Ad(ad_id, spec, status=status, format=int(rng.integers(0, F)),
                      embedding=ad_embeddings([ad_id], seed, D)[0]))
    return ads


def brute_answer(model, ads, precision, request, k):
    """Oracle eligibility + loop scores + brute-force order, on float32-rounded scores."""
    from andromeda_nb.oracle import eligible

    us = user_side(model, request)
    ids, scores = [], []
    for ad in ads:
        if not eligible(ad, request):
            continue
        a = quantize(ad.embedding[None, :], precision).dequantize()[0]
        score, _, _ = loop_score(us, [float(v) for v in a], ad.format, model.top_k)
        ids.append(ad.ad_id)
        scores.append(float(np.float32(score)))
    return brute_topk(ids, scores, k)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_reference_retriever_matches_brute_force_through_updates(precision):
    pytest.importorskip("andromeda_nb.oracle")
    D, E, F, S = 8, 4, 3, 16
    rng = np.random.default_rng(SEED)
    model = MoeModel.init(SEED, D=D, E=E, F=F)
    ads = make_ads(120, SEED, D, F, rng)
    table = quantize(np.stack([a.embedding for a in ads]), precision)
    requests = [make_request(r, SEED, E, S, country=COUNTRIES[r % 3], age=20 + 5 * r) for r in range(4)]
    ds = Dataset(ads=ads, embeddings=table, requests=requests, model=model, seed=SEED, precision=precision)
    retriever = ReferenceRetriever.build(ds)
    k = 15

    def check(live_ads):
        answers = retriever.retrieve(requests, k)
        for req, (got_ids, got_scores) in zip(requests, answers):
            want_ids, want_scores = brute_answer(model, live_ads, precision, req, k)
            assert got_ids.dtype == np.int64 and got_scores.dtype == np.float32
            assert got_ids.tolist() == want_ids, (precision, req.request_id)
            np.testing.assert_allclose(got_scores, want_scores, atol=1e-6)
            ids, res = retriever.score_eligible(req)
            assert compare_topk(ids, res, got_ids, got_scores, k).ok

    check(ads)
    live = {a.ad_id: a for a in ads}
    best = retriever.retrieve(requests[:1], 1)[0][0][0]
    # updates: retire the best ad, replace another's embedding and format, pause, add new ads
    updates = [Retire(int(best))]
    del live[int(best)]
    target = ads[3] if ads[3].ad_id != best else ads[4]
    changed = dataclasses.replace(target, format=(target.format + 1) % F,
                                  embedding=(target.embedding * -3).astype(np.float32))
    updates.append(Upsert(changed))
    live[changed.ad_id] = changed
    paused = next(a for a in ads if a.status == "ACTIVE" and a.ad_id in live and a.ad_id != changed.ad_id)
    updates.append(SetStatus(paused.ad_id, "PAUSED"))
    live[paused.ad_id] = dataclasses.replace(paused, status="PAUSED")
    for new_ad in make_ads(25, SEED + 1, D, F, rng):
        new_ad = dataclasses.replace(new_ad, ad_id=new_ad.ad_id + 5000)
        updates.append(Upsert(new_ad))
        live[new_ad.ad_id] = new_ad
    revived = dataclasses.replace(next(a for a in ads if a.ad_id == int(best)), status="ACTIVE",
                                  embedding=np.full(D, 0.5, np.float32))
    updates += [Upsert(revived)]  # a retired id comes back through an upsert
    live[revived.ad_id] = revived
    for u in updates:
        retriever.apply(u)
    assert len(retriever) == len(live)
    check(list(live.values()))


def test_reference_retriever_rejects_unknown_options_and_bad_k():
    pytest.importorskip("andromeda_nb.oracle")
    model = MoeModel.init(SEED, D=8, E=3, F=2)
    ds = Dataset(ads=[], embeddings=EmbeddingTable.empty(8, "fp32"), requests=[], model=model, seed=1,
                 precision="fp32")
    with pytest.raises(TypeError, match="unknown option"):
        ReferenceRetriever.build(ds, device="gpu")
    r = ReferenceRetriever.build(ds)
    with pytest.raises(ValueError, match="k: must be between 1"):
        r.retrieve([], 0)
    req = make_request(0, SEED, 3, 16)
    ids, scores = r.retrieve([req], 5)[0]
    assert len(ids) == 0 and len(scores) == 0


def test_reference_retriever_two_tower_scorer():
    pytest.importorskip("andromeda_nb.oracle")
    rng = np.random.default_rng(SEED)
    model = MoeModel.init(SEED, D=8, E=3, F=2)
    ads = make_ads(40, SEED, 8, 2, rng)
    table = quantize(np.stack([a.embedding for a in ads]), "fp16")
    ds = Dataset(ads=ads, embeddings=table, requests=[], model=model, seed=SEED, precision="fp16")
    req = make_request(2, SEED, 3, 16, country="FR", age=45)
    ids, scores = ReferenceRetriever.build(ds, scorer="two_tower").retrieve([req], 40)[0]
    u = two_tower_vector(model, req)
    from andromeda_nb.oracle import eligible

    want = [(a.ad_id, float(np.float32(u @ table.dequantize([i])[0]))) for i, a in enumerate(ads)
            if eligible(a, req)]
    assert len(want) > 3
    want_ids, want_scores = brute_topk([w[0] for w in want], [w[1] for w in want], 40)
    assert ids.tolist() == want_ids
    np.testing.assert_allclose(scores, want_scores, atol=1e-6)
