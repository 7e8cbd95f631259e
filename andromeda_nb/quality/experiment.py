"""The retrieval-quality experiment behind `andromeda quality`: build the synthetic world, log clicks,
train the two-tower baseline and the mixture of user experts with k = 1, 2, 4 of E and dense (k = E),
and measure recall@K against the ranking model's top K among each test request's eligible ads,
beside the arithmetic and bytes each model spends per ad.

The trained weights become `MoeModel`s (float32, the two-tower weights `T`, `t` carried in each), and
recall is measured through the serving reference itself (`model.user_side`,
`reference.reference_scores`, `model.two_tower_vector`, `reference.two_tower_scores`,
`reference.reference_topk`) on the stored embeddings at the configured precision: what is measured is
what `model.npz` serves.

Eligibility is a seeded random fraction of the corpus per test request (targeting is not what is
measured here); every model ranks exactly the same eligible set.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import numpy as np

from ..budget import stored_ad_bytes
from ..constants import CONTEXT_WIDTH, PRECISIONS
from ..model import MoeModel, quantize, two_tower_vector, user_side
from ..progress import Say
from ..reference import reference_scores, reference_topk, two_tower_scores
from . import train as tr
from .truth import TruthConfig, Users, World, eligible_rows

MODEL_NAMES = ("two_tower", "moe_k1", "moe_k2", "moe_k4", "dense")
ROUTED = {"moe_k1": 1, "moe_k2": 2, "moe_k4": 4}  # the routed MoE variants; "dense" is k = E
SERVED = "moe_k2"  # the variant written as model.npz (DESIGN's default k = 2)
REFERENCE_NAMES = ("context_blind_truth", "single_vector_truth", "random")
TRAIN_DTYPE = np.float32  # weights are trained in float32, what model.npz stores


@dataclass(frozen=True)
class QualityConfig:
    """Everything one run depends on; the defaults are `andromeda quality`'s default size."""

    seed: int = 0
    truth: TruthConfig = field(default_factory=TruthConfig)
    train_requests: int = 12_000
    impressions: int = 48  # logged impressions per training request
    test_requests: int = 400
    eligible_fraction: float = 0.3
    recall_k: int = 100
    precision: str = "fp32"  # stored embeddings the models are evaluated on
    dense_epochs: int = 6  # MoE phase 1: dense routing
    finetune_epochs: int = 4  # MoE phase 2: each variant with its own routing
    batch: int = 128  # requests a training step
    lr: float = 3e-3
    finetune_lr: float = 1e-3
    l2: float = 1e-5

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if max(ROUTED.values()) > self.truth.experts:
            raise ValueError(f"the routed variants need E >= {max(ROUTED.values())}, got {self.truth.experts}")
        for name in ("train_requests", "impressions", "test_requests", "recall_k", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0.0 < self.eligible_fraction <= 1.0:
            raise ValueError(f"eligible_fraction must be in (0, 1], got {self.eligible_fraction}")

    @classmethod
    def small(cls, seed: int = 0, **changes) -> "QualityConfig":
        """A size for tests and quick looks: seconds, not minutes."""
        base = cls(seed=seed, truth=TruthConfig(ads=3_000), train_requests=3_000, impressions=32,
                   test_requests=60, dense_epochs=8, finetune_epochs=4)
        return replace(base, **changes)

    def to_json(self) -> dict:
        return asdict(self)


# --- cost per ad -----------------------------------------------------------------------------------


def flops_per_ad(model: str, dim: int, experts: int) -> int:
    """Arithmetic per scored ad: a multiply-add is 2 FLOPs; each comparison of the top-k selection,
    exponential, sum and division of the routing softmax counts as one.

    two-tower: one dot product (2D). MoE with k of E: FiLM (2D), all E gate dots (2DE; the 1/sqrt(D)
    folds into the user side), top-k selection (E*k comparisons, none when k = E), softmax (3k), the
    k routed expert dots (2Dk) and their weighted sum (2k)."""
    if model == "two_tower":
        return 2 * dim
    k = experts if model == "dense" else ROUTED[model]
    select = 0 if k == experts else experts * k
    return 2 * dim + 2 * dim * experts + select + 3 * k + 2 * dim * k + 2 * k


def bytes_per_ad(dim: int) -> dict[str, int]:
    """Stored bytes one scored ad costs, per precision: the same for every model here (the MoE's extra
    work is arithmetic and the per-request user side, not per-ad bytes)."""
    return {p: stored_ad_bytes(p, dim) for p in PRECISIONS}


# --- trained weights as served models ----------------------------------------------------------------


def to_models(params: dict[str, dict], experts: int) -> dict[str, MoeModel]:
    """One `MoeModel` per MoE variant (top_k = its k), each carrying the two-tower weights too; the
    two-tower entry is the served variant's model (its scores use only T and t)."""
    f32 = {name: {k: np.asarray(v, np.float32) for k, v in p.items()} for name, p in params.items()}
    tt = f32["two_tower"]
    models = {}
    for name in MODEL_NAMES[1:]:
        p = f32[name]
        k = experts if name == "dense" else ROUTED[name]
        models[name] = MoeModel(p["W"], p["b"], p["K"], p["A"], p["B"], top_k=k, T=tt["T"], t=tt["t"],
                                source=f"quality {name}")
    models["two_tower"] = models[SERVED]
    return models


# --- evaluation --------------------------------------------------------------------------------------


def top_rows(rows: np.ndarray, scores: np.ndarray, k: int) -> np.ndarray:
    """The k rows with the largest scores, ties by row ascending (row i is ad id i)."""
    return reference_topk(rows, scores, k)[0]


@dataclass
class Evaluation:
    recall: dict[str, float]  # mean recall@K per scorer
    recall_by_interests: dict[str, dict[int, float]]  # per scorer, per user interest count
    requests_by_interests: dict[int, int]


def served_scorers(models: dict[str, MoeModel], table, formats: np.ndarray, test: Users) -> dict:
    """Scorers (request index, eligible rows) -> float64 scores through the serving reference."""

    def moe(model):
        def score(i, rows):
            return reference_scores(model, user_side(model, test.request(i)), table, rows, formats[rows]).scores

        return score

    def two_tower(model):
        def score(i, rows):
            return two_tower_scores(two_tower_vector(model, test.request(i)), table, rows)

        return score

    return {name: (two_tower(m) if name == "two_tower" else moe(m)) for name, m in models.items()}


def reference_scorers(world: World, test: Users, seed: int) -> dict:
    """Rankers built from the truth that bound what a trained model can reach:
    context_blind_truth: the ranking model without its context terms (what a perfect model that
        ignores the context would reach);
    single_vector_truth: one vector per user, the strength-weighted sum of its interests, dotted
        with the ad's latent vector (a perfect single-vector model, context-blind);
    random: chance."""
    blind = World(replace(world.config, cross_topic=0.0, cross_format=0.0), world.seed, ads=world.ads)
    z = world.ads.z

    def single_vector(i, rows):
        return z[rows] @ (test.interests[i] * test.strength[i][:, None]).sum(axis=0)

    return {
        "context_blind_truth": lambda i, rows: blind.relevance(test, i, rows),
        "single_vector_truth": single_vector,
        "random": lambda i, rows: np.random.default_rng([seed, 51, i]).random(len(rows)),
    }


def evaluate(world: World, test: Users, scorers: dict[str, Callable[[int, np.ndarray], np.ndarray]],
             config: QualityConfig, progress: Say | None = None) -> Evaluation:
    """recall@K of each scorer against the ranking model's top K among the eligible ads."""
    hits = {name: np.zeros(len(test)) for name in scorers}
    n_ads = len(world.ads)
    for i in range(len(test)):
        rows = eligible_rows(n_ads, config.eligible_fraction, config.seed, i)
        k = min(config.recall_k, len(rows))
        if k == 0:  # nothing eligible: the request does not count
            for h in hits.values():
                h[i] = np.nan
            continue
        truth_top = top_rows(rows, world.relevance(test, i, rows), k)
        for name, scorer in scorers.items():
            got = top_rows(rows, scorer(i, rows), k)
            hits[name][i] = len(np.intersect1d(truth_top, got, assume_unique=True)) / k
        if progress is not None and (i + 1) % 100 == 0:
            progress(f"evaluated {i + 1}/{len(test)} requests")
    counts = test.interest_count
    groups = np.unique(counts)
    return Evaluation(
        recall={name: float(np.nanmean(h)) for name, h in hits.items()},
        recall_by_interests={name: {int(c): float(np.nanmean(h[counts == c])) for c in groups}
                             for name, h in hits.items()},
        requests_by_interests={int(c): int((counts == c).sum()) for c in groups},
    )


# --- the run ---------------------------------------------------------------------------------------


@dataclass
class QualityResult:
    config: QualityConfig
    recall: dict[str, float]  # keyed MODEL_NAMES
    recall_by_interests: dict[str, dict[int, float]]
    requests_by_interests: dict[int, int]
    flops_per_ad: dict[str, int]
    bytes_per_ad: dict[str, int]
    references: dict[str, float]  # recall of the REFERENCE_NAMES rankers
    references_by_interests: dict[str, dict[int, float]]
    train_loss: dict[str, list[float]]  # per epoch
    test_loss: dict[str, float]  # click log-loss on held-out logs
    click_rate: float
    seconds: dict[str, float]
    models: dict[str, MoeModel] = field(repr=False)
    kernel: dict = field(default_factory=dict)

    def summary(self) -> dict:
        """JSON-ready figures (no weights)."""
        return {
            "recall": self.recall,
            "flops_per_ad": self.flops_per_ad,
            "bytes_per_ad": self.bytes_per_ad,
            "recall_by_interests": {m: {str(c): v for c, v in d.items()}
                                    for m, d in self.recall_by_interests.items()},
            "requests_by_interests": {str(c): n for c, n in self.requests_by_interests.items()},
            "references": self.references,
            "references_by_interests": {m: {str(c): v for c, v in d.items()}
                                        for m, d in self.references_by_interests.items()},
            "test_loss": self.test_loss,
            "train_loss": self.train_loss,
            "click_rate": self.click_rate,
            "seconds": self.seconds,
            "kernel": self.kernel,
            "config": self.config.to_json(),
        }


def _train_data(world: World, log, dtype) -> tr.TrainData:
    ads = world.ads
    return tr.TrainData(
        signals=log.users.signals.astype(dtype),
        context=log.users.context.astype(dtype),
        emb=ads.embedding[log.ad_rows].astype(dtype),
        fmt=ads.format[log.ad_rows],
        clicks=log.clicks.astype(dtype),
    )


def _as(params: dict, dtype) -> dict:
    return {name: np.asarray(v, dtype=dtype) for name, v in params.items()}


def train_all(config: QualityConfig, data: tr.TrainData, click_rate: float,
              progress: Say | None = None) -> tuple[dict, dict, dict]:
    """Train the two-tower model and every MoE variant on `data`. Returns (params by model name,
    per-epoch losses, seconds). Each model gets dense_epochs + finetune_epochs epochs; the MoE
    variants share the dense phase and then fine-tune with their own routing."""
    cfg, tcfg = config, config.truth
    E = tcfg.experts
    sizes = dict(dim=tcfg.dim, experts=E, width=tcfg.width, click_rate=click_rate)
    params, losses, seconds = {}, {}, {}
    base = tr.TrainSettings(epochs=cfg.dense_epochs + cfg.finetune_epochs, batch=cfg.batch, lr=cfg.lr, l2=cfg.l2)

    p2 = _as(tr.init_two_tower(np.random.default_rng([cfg.seed, 31]), **sizes), TRAIN_DTYPE)
    hist = tr.train_two_tower(p2, data, base, np.random.default_rng([cfg.seed, 32]), progress, "two_tower")
    params["two_tower"], losses["two_tower"], seconds["two_tower"] = p2, hist.losses, hist.seconds

    pm = _as(tr.init_moe(np.random.default_rng([cfg.seed, 41]), formats=tcfg.formats, context=CONTEXT_WIDTH,
                         **sizes), TRAIN_DTYPE)
    hist = tr.train_moe(pm, data, E, replace(base, epochs=cfg.dense_epochs),
                        np.random.default_rng([cfg.seed, 42]), progress, "moe dense phase")
    seconds["moe_dense_phase"] = hist.seconds
    shared = hist.losses
    finetune = replace(base, epochs=cfg.finetune_epochs, lr=cfg.finetune_lr)
    for name in MODEL_NAMES[1:]:
        k = E if name == "dense" else ROUTED[name]
        p = {key: v.copy() for key, v in pm.items()}
        hist = tr.train_moe(p, data, k, finetune, np.random.default_rng([cfg.seed, 43, k]), progress, name)
        params[name], losses[name], seconds[name] = p, shared + hist.losses, hist.seconds
    return params, losses, seconds


def held_out_loss(params: dict, data: tr.TrainData, experts: int) -> dict[str, float]:
    """Mean click log-loss of each model on held-out logs (float64 arithmetic)."""
    out = {}
    for name, p in params.items():
        p = _as(p, np.float64)
        if name == "two_tower":
            score = tr.two_tower_scores(p, data.signals, data.emb)
        else:
            k = experts if name == "dense" else ROUTED[name]
            score = tr.moe_scores(p, data.signals, data.context, data.emb, data.fmt, k)
        out[name] = tr.click_loss(p, score, data.clicks, (), 0.0)[0]
    return out


def run_quality(config: QualityConfig = QualityConfig(),
                progress: Say | None = None) -> QualityResult:
    """The whole experiment, seeded by `config.seed`; the same config on the same machine gives the
    same figures. numpy's BLAS is held to one thread while it runs (threadpoolctl): the trainers
    multiply many small matrices, where BLAS threads on a shared 2-core machine spin and wait (up to 10x
    slower per step), and one thread also fixes the summation order, so a run repeats bit for bit."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        return _run_quality(config, progress)


def _run_quality(config: QualityConfig, progress) -> QualityResult:
    say = progress or (lambda _msg: None)
    cfg, tcfg = config, config.truth
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    world = World(tcfg, cfg.seed)
    log = world.sample_log(world.train_users(cfg.train_requests), cfg.impressions)
    test = world.test_users(cfg.test_requests)
    test_log = world.sample_log(test, cfg.impressions)
    seconds["data"] = time.perf_counter() - t0
    say(f"world: {tcfg.ads} ads, {cfg.train_requests} logged requests x {cfg.impressions} impressions "
        f"(click rate {log.click_rate:.3f}), {cfg.test_requests} test requests ({seconds['data']:.1f}s)")

    params, losses, train_seconds = train_all(cfg, _train_data(world, log, TRAIN_DTYPE), log.click_rate, say)
    seconds |= train_seconds
    test_loss = held_out_loss(params, _train_data(world, test_log, np.float64), tcfg.experts)

    t1 = time.perf_counter()
    models = to_models(params, tcfg.experts)
    table = quantize(world.ads.embedding, cfg.precision)
    scorers = served_scorers(models, table, world.ads.format, test)
    scorers |= reference_scorers(world, test, cfg.seed)
    ev = evaluate(world, test, scorers, cfg, say)
    seconds["evaluate"] = time.perf_counter() - t1
    seconds["total"] = time.perf_counter() - t0
    say(f"evaluated {cfg.test_requests} requests in {seconds['evaluate']:.1f}s; total {seconds['total']:.1f}s")

    return QualityResult(
        config=cfg,
        recall={name: ev.recall[name] for name in MODEL_NAMES},
        recall_by_interests={name: ev.recall_by_interests[name] for name in MODEL_NAMES},
        requests_by_interests=ev.requests_by_interests,
        flops_per_ad={name: flops_per_ad(name, tcfg.dim, tcfg.experts) for name in MODEL_NAMES},
        bytes_per_ad=bytes_per_ad(tcfg.dim),
        references={name: ev.recall[name] for name in REFERENCE_NAMES},
        references_by_interests={name: ev.recall_by_interests[name] for name in REFERENCE_NAMES},
        train_loss=losses,
        test_loss=test_loss,
        click_rate=log.click_rate,
        seconds=seconds,
        models=models,
    )


__all__ = [
    "MODEL_NAMES",
    "QualityConfig",
    "QualityResult",
    "bytes_per_ad",
    "evaluate",
    "flops_per_ad",
    "held_out_loss",
    "run_quality",
    "to_models",
    "top_rows",
    "train_all",
]
