"""Ground truth for the retrieval-quality experiment: a synthetic world where relevance is known.

The world has topics in a latent space of `latent` dimensions. Every ad belongs to one topic and has
a latent vector near its topic's centre; its stored embedding (what the serving model reads, D
floats) is a fixed linear image of that vector plus noise. Every user has 1..`max_interests` latent
interests, each near some topic's centre and each with a strength; interest `j` of a user sits in one
signal group (a random one of the E groups, at most one interest a group), where it is observed
through a fixed per-group linear map plus noise. Groups without an interest carry noise only. These
signals (E groups of S floats) are everything the serving models see of the user.

The ranking model that defines relevance is richer than the serving model: it is dense over all of
the user's interests (a softmax-weighted mix of every interest's match with the ad, no routing) and
adds a cross-feature term of the request context with the ad's topic vector and format:

    match_j   = strength_j * dot(interest_j, z_ad)
    interest  = sum_j softmax_j(match / tau) * match_j          (over the user's interests)
    cross     = cross_topic * dot(G @ c, z_ad) + cross_format * dot(H[format], c)
    relevance = interest + cross

Logged impressions are drawn per request, part from the production ranker's softmax over a random
candidate pool (shown ads) and part uniformly (exploration); a click is Bernoulli with probability
sigmoid(click_slope * (relevance - click_offset)). The trainers see only signals, context, the ad's
stored embedding and format, and the click bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..constants import (
    CONTEXT_WIDTH,
    DATA_EPOCH,
    DEFAULT_D,
    DEFAULT_E,
    DEFAULT_F,
    DEVICE_PLATFORMS,
    PUBLISHER_PLATFORMS,
    SECONDS_PER_DAY,
    SIGNAL_WIDTH,
    USER_OS,
)
from ..model import context_vector
from ..types import Context, Request, User

# independent random streams of one seed, so changing one size does not reshuffle the others
_STREAM_WORLD, _STREAM_ADS, _STREAM_TRAIN, _STREAM_TEST, _STREAM_LOG, _STREAM_ELIGIBLE = 11, 12, 13, 14, 15, 16
TIME_ORIGIN = DATA_EPOCH  # request times fall in the 28 days after it
_TIME_SPAN = 28 * SECONDS_PER_DAY
_LOG_BATCH = 64  # requests a vectorized pass while sampling logs


@dataclass(frozen=True)
class TruthConfig:
    """Sizes and knobs of the synthetic world (the defaults are what `andromeda quality` runs)."""

    ads: int = 20_000
    dim: int = DEFAULT_D  # D, the stored embedding width
    experts: int = DEFAULT_E  # E signal groups
    width: int = SIGNAL_WIDTH  # S floats a group
    formats: int = DEFAULT_F  # F
    latent: int = 16  # latent dimension of topics, interests and ads
    topics: int = 48
    topic_skew: float = 0.7  # topic popularity ~ 1 / (rank + 1) ** skew
    ad_spread: float = 0.6  # an ad's distance from its topic centre (before normalizing)
    interest_spread: float = 0.3  # an interest's distance from its topic centre
    embedding_noise: float = 0.1  # norm of the noise in the stored embedding (signal norm is 1)
    max_interests: int = 4  # users have 1..max_interests interests, uniformly
    strength_low: float = 0.6
    strength_high: float = 1.0
    signal_gain: float = 2.0  # an interest's signal has norm gain * strength
    signal_noise: float = 0.1  # per-float noise of every signal group
    tau: float = 0.1  # softmax temperature of the dense interest mix
    cross_topic: float = 0.08  # weight of the context x topic term (unit std before weighting)
    cross_format: float = 0.05  # weight of the format x context term (unit std before weighting)
    click_slope: float = 6.0
    click_offset: float = 0.8
    shown_fraction: float = 0.5  # of the logged impressions, the share the production ranker chose
    shown_pool: int = 2_000  # candidates the production ranker samples from per logged request
    shown_temperature: float = 0.1

    def __post_init__(self):
        if self.latent > self.width:
            raise ValueError(f"latent ({self.latent}) must not exceed the signal width ({self.width})")
        if not 1 <= self.max_interests <= self.experts:
            raise ValueError(f"max_interests must be in 1..experts ({self.experts}), got {self.max_interests}")
        if self.ads < 1 or self.topics < 1:
            raise ValueError("ads and topics must be positive")


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _orthonormal_columns(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    q, r = np.linalg.qr(rng.standard_normal((rows, cols)))
    return q * np.sign(np.diag(r))  # a fixed sign convention, so the result is determined by rng


@dataclass
class Ads:
    """The corpus: `z` float64 (N, latent) unit latent vectors, `topic` int64 (N,), `format` int64
    (N,), `embedding` float32 (N, D) the stored embeddings. Row i is ad id i."""

    z: np.ndarray
    topic: np.ndarray
    format: np.ndarray
    embedding: np.ndarray

    def __len__(self) -> int:
        return len(self.topic)


@dataclass
class Users:
    """A batch of requests, one user each: `interests` float64 (N, E, latent) (zero rows where a group
    carries no interest), `strength` float64 (N, E) (0 there), `active` bool (N, E), `signals` float32
    (N, E, S), `contexts` the request contexts and `context` float64 (N, C) their context vectors
    (`model.context_vector`)."""

    interests: np.ndarray
    strength: np.ndarray
    active: np.ndarray
    signals: np.ndarray
    contexts: list[Context]
    context: np.ndarray

    def __len__(self) -> int:
        return len(self.strength)

    @property
    def interest_count(self) -> np.ndarray:
        return self.active.sum(axis=1)

    def request(self, i: int) -> Request:
        """User `i` as a serving request (request_id i; the profile is a placeholder: targeting is
        not part of this experiment)."""
        return Request(request_id=int(i), user=User(age=30), context=self.contexts[i], signals=self.signals[i])


class World:
    """The fixed parts of the synthetic world, all drawn from `seed`: topic centres and popularity,
    the embedding map, the per-group signal maps and the cross-feature tables."""

    def __init__(self, config: TruthConfig, seed: int, ads: "Ads | None" = None):
        """`ads`: reuse an already built corpus of this seed (it depends on neither the cross weights
        nor anything about users)."""
        self.config = config
        self.seed = int(seed)
        cfg = config
        rng = np.random.default_rng([self.seed, _STREAM_WORLD])
        self.centres = _unit(rng.standard_normal((cfg.topics, cfg.latent)))
        weights = 1.0 / (np.arange(cfg.topics) + 1.0) ** cfg.topic_skew
        self.popularity = rng.permutation(weights / weights.sum())
        self.embed_map = _orthonormal_columns(rng, cfg.dim, cfg.latent)  # (D, latent)
        self.signal_maps = np.stack(  # (E, S, latent): group e observes an interest through map e
            [_orthonormal_columns(rng, cfg.width, cfg.latent) for _ in range(cfg.experts)]
        )
        # cross tables, scaled so each term has unit standard deviation over random pairs
        self.context_topic = rng.standard_normal((cfg.latent, CONTEXT_WIDTH)) * np.sqrt(cfg.latent / 4.0)
        self.format_context = rng.standard_normal((cfg.formats, CONTEXT_WIDTH)) / 2.0
        self._ads: Ads | None = ads

    # --- ads --------------------------------------------------------------------------------------
    @property
    def ads(self) -> Ads:
        if self._ads is None:
            self._ads = self._make_ads()
        return self._ads

    def _make_ads(self) -> Ads:
        cfg = self.config
        rng = np.random.default_rng([self.seed, _STREAM_ADS])
        topic = rng.choice(cfg.topics, size=cfg.ads, p=self.popularity)
        noise = rng.standard_normal((cfg.ads, cfg.latent)) / np.sqrt(cfg.latent)
        z = _unit(self.centres[topic] + cfg.ad_spread * noise)
        fmt = rng.integers(0, cfg.formats, size=cfg.ads)
        emb_noise = rng.standard_normal((cfg.ads, cfg.dim)) / np.sqrt(cfg.dim)
        emb = z @ self.embed_map.T + cfg.embedding_noise * emb_noise
        return Ads(z=z, topic=topic.astype(np.int64), format=fmt.astype(np.int64),
                   embedding=emb.astype(np.float32))

    # --- users ------------------------------------------------------------------------------------
    def users(self, n: int, stream: int) -> Users:
        """`n` fresh users with contexts, from one of the named streams (train or test)."""
        cfg = self.config
        rng = np.random.default_rng([self.seed, stream])
        E = cfg.experts
        count = rng.integers(1, cfg.max_interests + 1, size=n)
        # a random ranking of the groups per user; the `count` first-ranked groups hold the interests
        rank = np.argsort(np.argsort(rng.random((n, E)), axis=1), axis=1)
        active = rank < count[:, None]
        topic = rng.choice(cfg.topics, size=(n, E), p=self.popularity)
        noise = rng.standard_normal((n, E, cfg.latent)) / np.sqrt(cfg.latent)
        interests = _unit(self.centres[topic] + cfg.interest_spread * noise) * active[..., None]
        strength = rng.uniform(cfg.strength_low, cfg.strength_high, size=(n, E)) * active
        observed = np.einsum("esl,nel->nes", self.signal_maps, interests * strength[..., None])
        signals = cfg.signal_gain * observed + cfg.signal_noise * rng.standard_normal((n, E, cfg.width))
        contexts = [
            Context(publisher_platform=PUBLISHER_PLATFORMS[p], device_platform=DEVICE_PLATFORMS[d],
                    user_os=USER_OS[o], time=TIME_ORIGIN + t)
            for p, d, o, t in zip(rng.integers(0, len(PUBLISHER_PLATFORMS), n).tolist(),
                                  rng.integers(0, len(DEVICE_PLATFORMS), n).tolist(),
                                  rng.integers(0, len(USER_OS), n).tolist(),
                                  rng.integers(0, _TIME_SPAN, n).tolist())
        ]
        context = np.stack([context_vector(c) for c in contexts]) if n else np.zeros((0, CONTEXT_WIDTH))
        return Users(interests=interests, strength=strength, active=active,
                     signals=signals.astype(np.float32), contexts=contexts, context=context)

    def train_users(self, n: int) -> Users:
        return self.users(n, _STREAM_TRAIN)

    def test_users(self, n: int) -> Users:
        return self.users(n, _STREAM_TEST)

    # --- relevance --------------------------------------------------------------------------------
    def relevance(self, users: Users, user_index: int, ad_rows: np.ndarray) -> np.ndarray:
        """float64 (n,) relevance of ads `ad_rows` (int (n,)) for user `user_index` of `users`."""
        return self.relevance_batch(users, np.array([user_index]), np.asarray(ad_rows)[None])[0]

    def relevance_batch(self, users: Users, user_index: np.ndarray, ad_rows: np.ndarray) -> np.ndarray:
        """float64 (B, n) relevance of ads `ad_rows` (int (B, n)) for users `user_index` (int (B,))."""
        cfg = self.config
        ads = self.ads
        z = ads.z[ad_rows]  # (B, n, latent)
        act = users.active[user_index]  # (B, E)
        match = np.matmul(z, users.interests[user_index].transpose(0, 2, 1))  # (B, n, E)
        match *= users.strength[user_index][:, None, :]
        logits = np.where(act[:, None, :], match / cfg.tau, -np.inf)
        mix = np.exp(logits - logits.max(axis=2, keepdims=True))
        mix /= mix.sum(axis=2, keepdims=True)
        interest = (mix * match).sum(axis=2)
        c = users.context[user_index]  # (B, C)
        topic_dir = c @ self.context_topic.T  # (B, latent)
        cross = cfg.cross_topic * np.matmul(z, topic_dir[:, :, None])[..., 0] / np.sqrt(cfg.latent)
        fmt_ctx = self.format_context @ c.T  # (F, B)
        cross += cfg.cross_format * fmt_ctx[ads.format[ad_rows], np.arange(len(c))[:, None]]
        return interest + cross

    def click_probability(self, relevance: np.ndarray) -> np.ndarray:
        cfg = self.config
        return 1.0 / (1.0 + np.exp(-cfg.click_slope * (relevance - cfg.click_offset)))

    # --- logs -------------------------------------------------------------------------------------
    def sample_log(self, users: Users, impressions: int) -> "Log":
        """`impressions` logged (ad, click) pairs per user of `users`: shown_fraction of them drawn
        without replacement from the production ranker's softmax over a random pool, the rest
        uniformly from the corpus."""
        cfg = self.config
        rng = np.random.default_rng([self.seed, _STREAM_LOG, len(users), impressions])
        n_ads = len(self.ads)
        shown = int(round(impressions * cfg.shown_fraction))
        pool_size = min(cfg.shown_pool, n_ads)
        rows = np.empty((len(users), impressions), dtype=np.int64)
        clicks = np.empty((len(users), impressions), dtype=np.float64)
        for lo in range(0, len(users), _LOG_BATCH):
            idx = np.arange(lo, min(lo + _LOG_BATCH, len(users)))
            pools = np.stack([rng.choice(n_ads, size=pool_size, replace=False) for _ in idx])
            logits = self.relevance_batch(users, idx, pools) / cfg.shown_temperature
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            for j, i in enumerate(idx.tolist()):
                picked = rng.choice(pools[j], size=min(shown, pool_size), replace=False, p=p[j])
                explore = rng.integers(0, n_ads, size=impressions - len(picked))
                rows[i] = np.concatenate([picked, explore])
            rel = self.relevance_batch(users, idx, rows[idx])
            clicks[idx] = rng.random((len(idx), impressions)) < self.click_probability(rel)
        return Log(users=users, ad_rows=rows, clicks=clicks)


@dataclass
class Log:
    """Logged impressions: `ad_rows` int64 (N, M) rows into the corpus, `clicks` float64 (N, M) 0/1,
    for the N users of `users` (M impressions each)."""

    users: Users
    ad_rows: np.ndarray
    clicks: np.ndarray

    @property
    def click_rate(self) -> float:
        return float(self.clicks.mean())


def eligible_rows(n_ads: int, fraction: float, seed: int, request: int) -> np.ndarray:
    """The eligible ads of test request `request`: a seeded random `fraction` of the corpus, int64
    ascending (the quality experiment's stand-in for targeting)."""
    rng = np.random.default_rng([seed, _STREAM_ELIGIBLE, request])
    return np.flatnonzero(rng.random(n_ads) < fraction).astype(np.int64)


__all__ = ["Ads", "Log", "TruthConfig", "Users", "World", "eligible_rows"]
