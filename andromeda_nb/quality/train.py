"""Trainers for the retrieval models on logged clicks: the mixture of user experts of DESIGN section 3
(exactly the serving formula, top-k routing included) and the two-tower baseline with the linear
user tower `model.two_tower_vector` serves (u = T @ concat(signal groups) + t, score dot(u, a)).

Plain numpy with hand-written gradients (tests check them against finite differences). Shapes:
N requests in a batch, M logged impressions each, E experts, D embedding width, S signal width,
F formats, C context width.

Model of a click: logit = exp(log_scale) * score + offset, where `score` is the served score and the
two calibration scalars are trained with it but never served (a positive scale and an offset do not
change any ranking). Loss: mean binary cross-entropy over impressions plus `l2` / 2 times the sum of
squared weights.

Routing during training. The MoE is trained in two phases: dense (all E experts, softmax over all
gate logits), then fine-tuning with the served top-k routing. The top-k score is piecewise smooth in
the weights (the chosen set changes only where two gate logits cross), so its gradient is exact
wherever the k-th and (k+1)-th logits differ; the dense phase is what teaches the gate keys `K`
for every k (with k = 1 the routed softmax weight is always 1 and no gradient reaches `K`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..progress import Say

# --- parameter sets --------------------------------------------------------------------------------

MOE_WEIGHTS = ("W", "b", "K", "A", "B")
TWO_TOWER_WEIGHTS = ("T", "t")
CALIBRATION = ("log_scale", "offset")


def init_moe(rng: np.random.Generator, *, dim: int, experts: int, width: int, formats: int,
             context: int, click_rate: float = 0.1) -> dict[str, np.ndarray]:
    """float64 starting weights of the MoE: random expert and gate maps, FiLM near identity."""
    return {
        "W": rng.standard_normal((experts, dim, width)) / np.sqrt(width),
        "b": np.zeros((experts, dim)),
        "K": rng.standard_normal((experts, dim, dim)) / np.sqrt(dim),
        "A": 0.01 * rng.standard_normal((formats, dim, context)),
        "B": 0.01 * rng.standard_normal((formats, dim, context)),
        "log_scale": np.zeros(()),
        "offset": np.array(np.log(click_rate / (1.0 - click_rate))),
    }


def init_two_tower(rng: np.random.Generator, *, dim: int, experts: int, width: int,
                   click_rate: float = 0.1) -> dict[str, np.ndarray]:
    """float64 starting weights of the linear two-tower user tower (T (D, E*S), t (D,))."""
    return {
        "T": rng.standard_normal((dim, experts * width)) / np.sqrt(experts * width),
        "t": np.zeros(dim),
        "log_scale": np.zeros(()),
        "offset": np.array(np.log(click_rate / (1.0 - click_rate))),
    }


# --- routing -------------------------------------------------------------------------------------------


def route(gates: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k routing of DESIGN section 3 over the last axis of `gates` (..., E): the k largest logits
    (ties: lower e first) and the softmax of those. Returns (mask bool, weights float64), weights 0
    outside the mask."""
    E = gates.shape[-1]
    if not 1 <= k <= E:
        raise ValueError(f"k must be in 1..{E}, got {k}")
    if k == E:
        mask = np.ones(gates.shape, dtype=bool)
    else:
        order = np.argsort(-gates, axis=-1, kind="stable")[..., :k]
        mask = np.zeros(gates.shape, dtype=bool)
        np.put_along_axis(mask, order, True, axis=-1)
    masked = np.where(mask, gates, -np.inf)
    w = np.exp(masked - masked.max(axis=-1, keepdims=True))
    w /= w.sum(axis=-1, keepdims=True)
    return mask, w


# --- MoE forward and backward ---------------------------------------------------------------------------


@dataclass
class MoeUserSide:
    """Per request: U, Q (N, E, D); gamma, beta (N, F, D); plus what the backward pass needs."""

    U: np.ndarray
    Q: np.ndarray
    gamma: np.ndarray
    beta: np.ndarray
    tanh_a: np.ndarray  # (N, F, D) tanh(A[f] @ c)
    signals: np.ndarray  # (N, E, S)
    context: np.ndarray  # (N, C)


def moe_user_side(p: dict, signals: np.ndarray, context: np.ndarray) -> MoeUserSide:
    dtype = p["W"].dtype
    X = np.asarray(signals, dtype=dtype)
    Cx = np.asarray(context, dtype=dtype)
    F, D, C = p["A"].shape
    # batched over experts: (E, N, S) @ (E, S, D) -> (E, N, D)
    Ue = np.tanh(np.matmul(X.transpose(1, 0, 2), p["W"].transpose(0, 2, 1)) + p["b"][:, None, :])
    Qe = np.matmul(Ue, p["K"].transpose(0, 2, 1))
    tanh_a = np.tanh(Cx @ p["A"].reshape(F * D, C).T).reshape(-1, F, D)
    beta = (Cx @ p["B"].reshape(F * D, C).T).reshape(-1, F, D)
    return MoeUserSide(U=Ue.transpose(1, 0, 2), Q=Qe.transpose(1, 0, 2), gamma=1.0 + tanh_a, beta=beta,
                       tanh_a=tanh_a, signals=X, context=Cx)


@dataclass
class MoeForward:
    score: np.ndarray  # (N, M)
    r: np.ndarray  # (N, M, D)
    s: np.ndarray  # (N, M, E) expert scores dot(u_e, r)
    w: np.ndarray  # (N, M, E) routing weights (0 where not routed)
    emb: np.ndarray  # (N, M, D)
    fmt: np.ndarray  # (N, M)


def moe_forward(p: dict, us: MoeUserSide, emb: np.ndarray, fmt: np.ndarray, k: int) -> MoeForward:
    """Scores of ads `emb` (N, M, D) float with formats `fmt` (N, M) int for the N requests of `us`."""
    emb = np.asarray(emb, dtype=us.U.dtype)
    n = np.arange(emb.shape[0])[:, None]
    r = us.gamma[n, fmt] * emb + us.beta[n, fmt]
    D = emb.shape[-1]
    g = np.matmul(r, us.Q.transpose(0, 2, 1)) / math.sqrt(D)
    s = np.matmul(r, us.U.transpose(0, 2, 1))
    _, w = route(g, k)
    return MoeForward(score=(w * s).sum(axis=-1), r=r, s=s, w=w, emb=emb, fmt=np.asarray(fmt))


def moe_backward(p: dict, us: MoeUserSide, fw: MoeForward, dscore: np.ndarray) -> dict[str, np.ndarray]:
    """Gradients of sum(dscore * score) with respect to W, b, K, A, B."""
    D = fw.r.shape[-1]
    ds = dscore[..., None] * fw.w  # (N, M, E)
    dw = dscore[..., None] * fw.s
    dg = fw.w * (dw - (fw.w * dw).sum(axis=-1, keepdims=True)) / math.sqrt(D)
    dU = np.matmul(ds.transpose(0, 2, 1), fw.r)  # (N, E, D)
    dQ = np.matmul(dg.transpose(0, 2, 1), fw.r)
    dr = np.matmul(ds, us.U) + np.matmul(dg, us.Q)  # (N, M, D)
    N, F, D = us.gamma.shape
    C = us.context.shape[1]
    onehot = (fw.fmt[..., None] == np.arange(F)).astype(dr.dtype)  # (N, M, F)
    ot = onehot.transpose(0, 2, 1)
    dgamma = np.matmul(ot, dr * fw.emb)  # (N, F, D)
    dbeta = np.matmul(ot, dr)
    dA = ((dgamma * (1.0 - us.tanh_a**2)).reshape(N, F * D).T @ us.context).reshape(F, D, C)
    dB = (dbeta.reshape(N, F * D).T @ us.context).reshape(F, D, C)
    dQe = dQ.transpose(1, 0, 2)  # (E, N, D)
    Ue = us.U.transpose(1, 0, 2)
    dK = np.matmul(dQe.transpose(0, 2, 1), Ue)  # (E, D, D)
    dHe = (dU.transpose(1, 0, 2) + np.matmul(dQe, p["K"])) * (1.0 - Ue**2)  # (E, N, D)
    dW = np.matmul(dHe.transpose(0, 2, 1), us.signals.transpose(1, 0, 2))  # (E, D, S)
    return {"W": dW, "b": dHe.sum(axis=1), "K": dK, "A": dA, "B": dB}


def moe_scores(p: dict, signals: np.ndarray, context: np.ndarray, emb: np.ndarray, fmt: np.ndarray,
               k: int) -> np.ndarray:
    """Served scores (N, M) of ads emb (N, M, D) for requests (signals (N, E, S), context (N, C))."""
    return moe_forward(p, moe_user_side(p, signals, context), emb, fmt, k).score


# --- two-tower forward and backward ---------------------------------------------------------------------


def two_tower_vector(p: dict, signals: np.ndarray) -> np.ndarray:
    """User vectors (N, D): T @ concat(signal groups) + t, the linear tower `model.two_tower_vector`
    serves."""
    x = np.asarray(signals, dtype=p["T"].dtype).reshape(len(signals), -1)
    return x @ p["T"].T + p["t"]


def two_tower_scores(p: dict, signals: np.ndarray, emb: np.ndarray) -> np.ndarray:
    """Scores (N, M) = dot(u_n, a) of ads emb (N, M, D) for requests with signals (N, E, S)."""
    u = two_tower_vector(p, signals)
    return np.matmul(np.asarray(emb, dtype=u.dtype), u[:, :, None])[..., 0]


def two_tower_backward(p: dict, signals: np.ndarray, emb: np.ndarray, dscore: np.ndarray) -> dict:
    """Gradients of sum(dscore * score) with respect to T and t."""
    x = np.asarray(signals, dtype=p["T"].dtype).reshape(len(signals), -1)
    du = np.matmul(dscore[:, None, :], np.asarray(emb, dtype=x.dtype))[:, 0, :]  # (N, D)
    return {"T": du.T @ x, "t": du.sum(axis=0)}


# --- loss ------------------------------------------------------------------------------------------------


def _softplus(z: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, z)


def click_loss(p: dict, score: np.ndarray, clicks: np.ndarray, weights: tuple[str, ...],
               l2: float) -> tuple[float, np.ndarray, dict]:
    """Mean BCE of logit = exp(log_scale) * score + offset, plus l2/2 * |weights|^2.
    Returns (loss, dloss/dscore, gradients of the calibration scalars and of the l2 term)."""
    scale = np.exp(p["log_scale"])
    z = scale * score + p["offset"]
    count = z.size
    loss = float((_softplus(z) - clicks * z).sum() / count)
    loss += 0.5 * l2 * sum(float((p[name] ** 2).sum()) for name in weights)
    dz = (1.0 / (1.0 + np.exp(-z)) - clicks) / count
    grads = {
        "log_scale": np.array((dz * score).sum() * scale),
        "offset": np.array(dz.sum()),
    }
    for name in weights:
        grads[name] = l2 * p[name]
    return loss, dz * scale, grads


def moe_loss_and_grad(p: dict, signals, context, emb, fmt, clicks, k: int, l2: float):
    us = moe_user_side(p, signals, context)
    fw = moe_forward(p, us, emb, fmt, k)
    loss, dscore, grads = click_loss(p, fw.score, clicks, MOE_WEIGHTS, l2)
    for name, g in moe_backward(p, us, fw, dscore).items():
        grads[name] = grads[name] + g
    return loss, grads


def two_tower_loss_and_grad(p: dict, signals, emb, clicks, l2: float):
    score = two_tower_scores(p, signals, emb)
    loss, dscore, grads = click_loss(p, score, clicks, TWO_TOWER_WEIGHTS, l2)
    for name, g in two_tower_backward(p, signals, emb, dscore).items():
        grads[name] = grads[name] + g
    return loss, grads


# --- optimizer and loop ----------------------------------------------------------------------------------


class Adam:
    """Adam (Kingma and Ba, 2015) over a dict of float64 arrays, updated in place."""

    def __init__(self, params: dict, lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8):
        self.lr, self.beta1, self.beta2, self.eps = lr, beta1, beta2, eps
        self.m = {k: np.zeros_like(v) for k, v in params.items()}
        self.v = {k: np.zeros_like(v) for k, v in params.items()}
        self.steps = 0

    def step(self, params: dict, grads: dict) -> None:
        self.steps += 1
        c1 = 1.0 - self.beta1**self.steps
        c2 = 1.0 - self.beta2**self.steps
        for name, g in grads.items():
            m, v = self.m[name], self.v[name]
            m *= self.beta1
            m += (1.0 - self.beta1) * g
            v *= self.beta2
            v += (1.0 - self.beta2) * g * g
            params[name] -= self.lr * (m / c1) / (np.sqrt(v / c2) + self.eps)


@dataclass
class TrainData:
    """Logged impressions as arrays: signals (N, E, S), context (N, C), emb (N, M, D) float,
    fmt (N, M) int, clicks (N, M) float 0/1."""

    signals: np.ndarray
    context: np.ndarray
    emb: np.ndarray
    fmt: np.ndarray
    clicks: np.ndarray

    def __len__(self) -> int:
        return len(self.signals)

    def batch(self, idx: np.ndarray) -> "TrainData":
        return TrainData(self.signals[idx], self.context[idx], self.emb[idx], self.fmt[idx], self.clicks[idx])


@dataclass
class TrainSettings:
    epochs: int = 8
    batch: int = 128  # requests a step
    lr: float = 3e-3
    l2: float = 1e-5


@dataclass
class History:
    losses: list[float] = field(default_factory=list)  # mean training loss per epoch
    seconds: float = 0.0


def train(loss_and_grad: Callable[[dict, TrainData], tuple[float, dict]], params: dict, data: TrainData,
          settings: TrainSettings, rng: np.random.Generator,
          progress: Say | None = None, label: str = "") -> History:
    """Minibatch Adam over `data` for `settings.epochs` epochs; updates `params` in place."""
    opt = Adam(params, settings.lr)
    hist = History()
    start = time.perf_counter()
    for epoch in range(settings.epochs):
        order = rng.permutation(len(data))
        total, count = 0.0, 0
        for lo in range(0, len(order), settings.batch):
            idx = order[lo : lo + settings.batch]
            loss, grads = loss_and_grad(params, data.batch(idx))
            opt.step(params, grads)
            total += loss * len(idx)
            count += len(idx)
        hist.losses.append(total / count)
        if progress is not None:
            progress(f"{label} epoch {epoch + 1}/{settings.epochs}: loss {hist.losses[-1]:.4f}")
    hist.seconds = time.perf_counter() - start
    return hist


def train_moe(params: dict, data: TrainData, k: int, settings: TrainSettings, rng: np.random.Generator,
              progress=None, label: str = "") -> History:
    def loss_and_grad(p, d):
        return moe_loss_and_grad(p, d.signals, d.context, d.emb, d.fmt, d.clicks, k, settings.l2)

    return train(loss_and_grad, params, data, settings, rng, progress, label)


def train_two_tower(params: dict, data: TrainData, settings: TrainSettings, rng: np.random.Generator,
                    progress=None, label: str = "") -> History:
    def loss_and_grad(p, d):
        return two_tower_loss_and_grad(p, d.signals, d.emb, d.clicks, settings.l2)

    return train(loss_and_grad, params, data, settings, rng, progress, label)


__all__ = [
    "Adam",
    "History",
    "MoeUserSide",
    "TrainData",
    "TrainSettings",
    "init_moe",
    "init_two_tower",
    "moe_backward",
    "moe_forward",
    "moe_loss_and_grad",
    "moe_scores",
    "moe_user_side",
    "route",
    "train",
    "train_moe",
    "train_two_tower",
    "two_tower_backward",
    "two_tower_loss_and_grad",
    "two_tower_scores",
    "two_tower_vector",
]
