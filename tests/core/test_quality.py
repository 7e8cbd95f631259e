"""Retrieval-quality experiment (andromeda_nb.quality): gradients against finite differences, the
trainers' forward pass against the serving reference, the synthetic truth, determinism, a short
training run that beats the untrained models, the kernel path under the simulator, and the CLI."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from click.testing import CliRunner

from andromeda_nb.model import MoeModel, context_vector, quantize, two_tower_vector, user_side
from andromeda_nb.quality import train as tr
from andromeda_nb.quality.experiment import (
    MODEL_NAMES,
    QualityConfig,
    evaluate,
    flops_per_ad,
    held_out_loss,
    run_quality,
    to_models,
)
from andromeda_nb.quality.truth import TruthConfig, World
from andromeda_nb.reference import reference_scores, two_tower_scores

SEED = 20261202


def _tiny_config(seed=SEED, **changes) -> QualityConfig:
    base = QualityConfig(seed=seed, truth=TruthConfig(ads=1_500), train_requests=600, impressions=24,
                         test_requests=30, dense_epochs=2, finetune_epochs=1)
    return dataclasses.replace(base, **changes)


@pytest.fixture(scope="module")
def tiny_run():
    return run_quality(_tiny_config())


# --- gradients ---------------------------------------------------------------------------------------


def _batch(rng, N=3, M=5, E=4, D=6, S=3, F=3, C=5):
    p = tr.init_moe(rng, dim=D, experts=E, width=S, formats=F, context=C, click_rate=0.3)
    # move every weight away from its special starting values so every term is exercised
    p["b"] = 0.3 * rng.standard_normal(p["b"].shape)
    p["A"] = 0.5 * rng.standard_normal(p["A"].shape)
    p["B"] = 0.5 * rng.standard_normal(p["B"].shape)
    p["log_scale"] = np.array(0.3)
    X = rng.standard_normal((N, E, S))
    Cx = (rng.random((N, C)) < 0.5).astype(np.float64)
    emb = rng.standard_normal((N, M, D)) / np.sqrt(D)
    fmt = rng.integers(0, F, (N, M))
    y = (rng.random((N, M)) < 0.4).astype(np.float64)
    return p, X, Cx, emb, fmt, y


def _finite_difference_error(loss_fn, params, grads, h=1e-6):
    """Largest relative difference between analytic and central-difference gradients."""
    worst = 0.0
    for name, value in params.items():
        flat = value.reshape(-1)
        for i in range(flat.size):
            old = flat[i]
            flat[i] = old + h
            up = loss_fn(params)
            flat[i] = old - h
            down = loss_fn(params)
            flat[i] = old
            fd = (up - down) / (2 * h)
            an = grads[name].reshape(-1)[i]
            worst = max(worst, abs(fd - an) / (abs(fd) + abs(an) + 1e-7))
    return worst


def _min_gate_gap(p, X, Cx, emb, fmt, k):
    us = tr.moe_user_side(p, X, Cx)
    fw = tr.moe_forward(p, us, emb, fmt, k)
    D = emb.shape[-1]
    g = np.sort(np.matmul(fw.r, us.Q.transpose(0, 2, 1)) / np.sqrt(D), axis=-1)[..., ::-1]
    return float((g[..., k - 1] - g[..., k]).min()) if k < g.shape[-1] else np.inf


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_moe_gradients_match_finite_differences(k):
    rng = np.random.default_rng([SEED, k])
    p, X, Cx, emb, fmt, y = _batch(rng)
    # the routed score is smooth only away from gate ties: a step of 1e-6 in one weight moves a
    # logit by about 1e-6, so no routing may change within the check
    assert _min_gate_gap(p, X, Cx, emb, fmt, k) > 1e-5, f"seed {SEED}, k {k}: a gate tie in the test data"
    l2 = 1e-2
    loss, grads = tr.moe_loss_and_grad(p, X, Cx, emb, fmt, y, k, l2)
    assert set(grads) == set(p)
    err = _finite_difference_error(lambda q: tr.moe_loss_and_grad(q, X, Cx, emb, fmt, y, k, l2)[0], p, grads)
    assert err < 1e-5, f"seed {SEED}, k {k}: relative gradient error {err}"


def test_two_tower_gradients_match_finite_differences():
    rng = np.random.default_rng([SEED, 99])
    _, X, _, emb, _, y = _batch(rng)
    p = tr.init_two_tower(rng, dim=6, experts=4, width=3, click_rate=0.3)
    p["t"] = 0.3 * rng.standard_normal(6)
    loss, grads = tr.two_tower_loss_and_grad(p, X, emb, y, 1e-2)
    err = _finite_difference_error(lambda q: tr.two_tower_loss_and_grad(q, X, emb, y, 1e-2)[0], p, grads)
    assert err < 1e-5, f"seed {SEED}: relative gradient error {err}"


def test_finite_difference_check_catches_a_wrong_gradient():
    rng = np.random.default_rng([SEED, 7])
    p, X, Cx, emb, fmt, y = _batch(rng)
    _, grads = tr.moe_loss_and_grad(p, X, Cx, emb, fmt, y, 2, 0.0)
    grads["K"] = grads["K"] * 1.01  # a 1% error in one term
    err = _finite_difference_error(lambda q: tr.moe_loss_and_grad(q, X, Cx, emb, fmt, y, 2, 0.0)[0], p, grads)
    assert err > 1e-3


def test_route_ties_lower_expert_first_and_softmax():
    g = np.array([[1.0, 3.0, 3.0, 0.5], [2.0, 2.0, 2.0, 2.0]])
    mask, w = tr.route(g, 2)
    assert mask.tolist() == [[False, True, True, False], [True, True, False, False]]
    assert np.allclose(w, [[0, 0.5, 0.5, 0], [0.5, 0.5, 0, 0]])
    mask, w = tr.route(np.array([0.0, np.log(3.0), -1.0]), 2)
    assert np.allclose(w, [0.25, 0.75, 0.0])
    with pytest.raises(ValueError):
        tr.route(g, 5)


# --- the trainers compute what the models serve --------------------------------------------------------


def test_training_forward_equals_the_serving_reference(tiny_run):
    cfg = tiny_run.config
    world = World(cfg.truth, cfg.seed)
    users = world.test_users(5)
    table = quantize(world.ads.embedding, "fp32")
    rows = np.random.default_rng(SEED).choice(len(world.ads), 200, replace=False)
    emb = table.dequantize(rows)
    fmt = world.ads.format[rows]
    for name in MODEL_NAMES:
        model = tiny_run.models[name]
        p = {key: np.asarray(getattr(model, key), np.float64) for key in ("W", "b", "K", "A", "B", "T", "t")}
        for i in range(len(users)):
            request = users.request(i)
            if name == "two_tower":
                want = two_tower_scores(two_tower_vector(model, request), table, rows)
                got = tr.two_tower_scores(p, users.signals[i : i + 1], emb[None])[0]
            else:
                want = reference_scores(model, user_side(model, request), table, rows, fmt).scores
                got = tr.moe_scores(p, users.signals[i : i + 1], users.context[i : i + 1], emb[None], fmt[None],
                                    model.top_k)[0]
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-10, err_msg=f"{name}, request {i}")


def test_saved_models_carry_both_architectures(tiny_run, tmp_path):
    from andromeda_nb.quality.report import MODEL_FILES, write_outputs

    written = write_outputs(tiny_run, tmp_path, make_plot=False)
    for name, filename in MODEL_FILES.items():
        model = MoeModel.load(tmp_path / filename)
        assert model.has_two_tower
        assert model.top_k == tiny_run.models[name].top_k
        np.testing.assert_array_equal(model.K, tiny_run.models[name].K)
    assert MoeModel.load(tmp_path / "model.npz").top_k == 2
    summary = json.loads((tmp_path / "quality.json").read_text())
    assert summary["recall"] == pytest.approx(tiny_run.recall)
    assert "plot" not in written


# --- ground truth ------------------------------------------------------------------------------------


def test_truth_world_is_what_its_docstring_says():
    cfg = TruthConfig(ads=2_000, cross_topic=0.0, cross_format=0.0)
    world = World(cfg, SEED)
    users = world.test_users(300)
    counts = users.interest_count
    assert counts.min() == 1 and counts.max() == cfg.max_interests
    assert (users.strength[~users.active] == 0).all() and (users.strength[users.active] >= cfg.strength_low).all()
    # groups without an interest carry noise only; groups with one carry signal_gain * strength
    norm = np.linalg.norm(users.signals, axis=2)
    assert norm[~users.active].mean() == pytest.approx(cfg.signal_noise * np.sqrt(cfg.width), rel=0.1)
    assert norm[users.active].mean() > 3 * norm[~users.active].mean()
    for i in range(5):
        np.testing.assert_array_equal(users.context[i], context_vector(users.contexts[i]))
    # one interest and no cross terms: relevance is strength * dot(interest, z)
    i = int(np.flatnonzero(counts == 1)[0])
    e = int(np.flatnonzero(users.active[i])[0])
    rows = np.arange(50)
    want = users.strength[i, e] * world.ads.z[rows] @ users.interests[i, e]
    np.testing.assert_allclose(world.relevance(users, i, rows), want, atol=1e-12)
    # batch and single forms agree
    idx = np.array([3, 7])
    many = world.relevance_batch(users, idx, np.stack([rows, rows[::-1]]))
    np.testing.assert_allclose(many[1], world.relevance(users, 7, rows[::-1]))


def test_logged_clicks_follow_relevance():
    world = World(TruthConfig(ads=2_000), SEED)
    log = world.sample_log(world.train_users(400), 32)
    shown = log.clicks[:, :16].mean()  # the production ranker's picks come first
    explored = log.clicks[:, 16:].mean()
    assert shown > 3 * explored, (shown, explored)
    # the logs are a function of the seed
    again = World(TruthConfig(ads=2_000), SEED).sample_log(World(TruthConfig(ads=2_000), SEED).train_users(400), 32)
    np.testing.assert_array_equal(log.ad_rows, again.ad_rows)
    np.testing.assert_array_equal(log.clicks, again.clicks)


def test_evaluate_scores_truth_as_perfect_and_reversed_truth_as_worst():
    cfg = _tiny_config()
    world = World(cfg.truth, cfg.seed)
    test = world.test_users(10)
    ev = evaluate(world, test, {
        "truth": lambda i, rows: world.relevance(test, i, rows),
        "reversed": lambda i, rows: -world.relevance(test, i, rows),
    }, cfg)
    assert ev.recall["truth"] == 1.0
    assert ev.recall["reversed"] == 0.0
    assert sum(ev.requests_by_interests.values()) == 10


def test_flops_per_ad_by_hand():
    # D = 64, E = 6: FiLM 128 + gates 768; k = 2: selection 12, softmax 6, expert dots 256, mix 4
    assert flops_per_ad("two_tower", 64, 6) == 128
    assert flops_per_ad("moe_k2", 64, 6) == 128 + 768 + 12 + 6 + 256 + 4
    assert flops_per_ad("dense", 64, 6) == 128 + 768 + 0 + 18 + 768 + 12
    assert flops_per_ad("moe_k1", 64, 6) < flops_per_ad("moe_k2", 64, 6) < flops_per_ad("moe_k4", 64, 6)


# --- training: determinism and progress -----------------------------------------------------------------


def test_run_is_deterministic(tiny_run):
    again = run_quality(_tiny_config())
    assert again.recall == tiny_run.recall
    assert again.test_loss == tiny_run.test_loss
    for name in MODEL_NAMES:
        np.testing.assert_array_equal(again.models[name].W, tiny_run.models[name].W)
        np.testing.assert_array_equal(again.models[name].T, tiny_run.models[name].T)
    other = run_quality(_tiny_config(seed=SEED + 1))
    assert other.recall != tiny_run.recall


def test_training_beats_the_untrained_models(tiny_run):
    cfg = tiny_run.config
    world = World(cfg.truth, cfg.seed)
    test = world.test_users(cfg.test_requests)
    rng = np.random.default_rng(SEED)
    sizes = dict(dim=cfg.truth.dim, experts=cfg.truth.experts, width=cfg.truth.width, click_rate=0.2)
    untrained_moe = tr.init_moe(rng, formats=cfg.truth.formats, context=17, **sizes)
    params = {"two_tower": tr.init_two_tower(rng, **sizes)} | {name: untrained_moe for name in MODEL_NAMES[1:]}
    untrained = to_models(params, cfg.truth.experts)
    from andromeda_nb.quality.experiment import served_scorers

    table = quantize(world.ads.embedding, cfg.precision)
    ev = evaluate(world, test, served_scorers(untrained, table, world.ads.format, test), cfg)
    log = world.sample_log(test, cfg.impressions)
    from andromeda_nb.quality.experiment import _train_data

    loss_before = held_out_loss(params, _train_data(world, log, np.float64), cfg.truth.experts)
    for name in MODEL_NAMES:
        assert tiny_run.recall[name] > ev.recall[name] + 0.05, (name, tiny_run.recall[name], ev.recall[name])
        assert tiny_run.test_loss[name] < loss_before[name], name
        assert tiny_run.train_loss[name][-1] < tiny_run.train_loss[name][0], name


def test_training_holds_blas_to_one_thread_and_restores_it(monkeypatch):
    from threadpoolctl import threadpool_info

    from andromeda_nb.quality import experiment

    def blas_threads() -> list[int]:
        return [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]

    before = blas_threads()
    if not before:
        pytest.skip("numpy links no BLAS that threadpoolctl can see here")
    seen = []
    monkeypatch.setattr(experiment, "_run_quality", lambda config, progress: seen.append(blas_threads()))
    experiment.run_quality(QualityConfig.small(0))
    assert seen == [[1] * len(before)]
    assert blas_threads() == before


# --- kernel path --------------------------------------------------------------------------------------


def test_kernel_throughput_skips_without_a_gpu(tiny_run):
    from migration.quality_kernel import kernel_throughput

    out = kernel_throughput(tiny_run.models, np.zeros((4, 64), np.float32), np.zeros(4, np.int64), [],
                            device="cpu")
    assert "skipped" in out


def test_kernel_path_under_the_simulator_matches_the_reference(tiny_run):
    """The fused kernel on the trained models, checked against the reference before timing (tiny)."""
    from gpu import runtime

    from migration.quality_kernel import kernel_throughput

    if not runtime.simulator_enabled():
        pytest.skip("needs the CUDA simulator (NUMBA_ENABLE_CUDASIM=1, set by conftest)")
    cfg = tiny_run.config
    world = World(cfg.truth, cfg.seed)
    rows = np.flatnonzero(world.ads.format < 2)[:300]
    test = world.test_users(1)
    models = {name: tiny_run.models[name] for name in ("two_tower", "moe_k2")}
    out = kernel_throughput(models, world.ads.embedding[rows], world.ads.format[rows], [test.request(0)],
                            k=20, slots=len(rows), repeats=1, device="sim")
    assert out["device"] == "CUDA simulator"
    assert out["live_slots"] == len(rows)
    assert set(out["ads_per_second"]) == set(models)
    assert all(v > 0 for v in out["ads_per_second"].values())


# --- command line --------------------------------------------------------------------------------------


def test_cli_quality_help():
    from cli import main

    result = CliRunner().invoke(main, ["quality", "--help"])
    assert result.exit_code == 0
    assert "recall@100" in result.output and "--json" in result.output


def test_cli_quality_json_and_outputs(tmp_path):
    from cli import main

    result = CliRunner().invoke(main, ["quality", "--small", "--json", "--quiet", "--no-kernel",
                                       "--out", str(tmp_path / "q")])
    assert result.exit_code == 0, result.output
    last = json.loads(result.output.strip().splitlines()[-1])
    for key in ("recall", "flops_per_ad"):
        assert set(last[key]) == {"two_tower", "moe_k1", "moe_k2", "moe_k4", "dense"}
    assert all(0.0 <= v <= 1.0 for v in last["recall"].values())
    assert last["recall"]["moe_k2"] > last["references"]["random"]
    assert MoeModel.load(tmp_path / "q" / "model_k1.npz").top_k == 1
    assert (tmp_path / "q" / "quality.json").exists()


def test_cli_quality_rejects_a_bad_precision():
    from cli import main

    result = CliRunner().invoke(main, ["quality", "--small", "--precision", "fp8"])
    assert result.exit_code != 0
    assert "fp8" in result.output
