"""The co-located GPU engine over a *tiled* pool laid out on the device: scale runs whose pools are too
large to generate and compile on the host (100M ads per GPU), served like any engine.

A tiled pool is `copies` copies of a generated base corpus (`benchmarks.tiling`): copy c of base ad
i has id `base_id + c * stride` and the base ad's targeting, laid out by `benchmarks.match.
build_tiled_index` (the index's layout, built by repetition instead of compiled ad by ad). The
embedding of every slot is a fresh normal draw made on the device (`benchmarks.score.make_pool`: CuPy
where it is installed, numpy under the simulator), stored at the pool's precision. `first_copy`
numbers the copies, so shard s of a tiled cluster holds copies s * copies .. (s + 1) * copies - 1
and the shards' ads are disjoint. `TiledPool` describes such a pool the way a `Dataset` describes a
corpus, for the servers (`serving.engine_server.EngineServer`, `cluster.shard_process
--tiled`).

Everything after the build is `gpu.engine.GpuEngine`'s: batches of at most 64 requests, the user side
on the host, match, fused scoring and top-K on the index's stream, the host's share of batch i + 1
while the device runs batch i. `check()` compares answers with the float64 reference over the
eligible slots the match reported (DESIGN section 4's tolerances). The pool takes no updates.
"""

from __future__ import annotations

import dataclasses
from functools import cached_property
from typing import Sequence

import numpy as np

from andromeda_nb.devices import resolve
from andromeda_nb.geo_layout import world_buckets
from andromeda_nb.model import MoeModel
from andromeda_nb.types import Request

from gpu.engine import GpuEngine


@dataclasses.dataclass
class TiledPool:
    """A tiled pool's recipe: `copies` copies (numbered from `first_copy`) of the base corpus that
    `generate_base(base_ads, n_requests, seed)` makes, the model `MoeModel.init(seed, D=dim)`, and the
    base's requests with their signals. Every process that follows the same recipe holds the same
    ads and sends the same requests."""

    base_ads: int
    copies: int
    first_copy: int = 0
    seed: int = 0
    dim: int = 64
    precision: str = "fp16"
    n_requests: int = 64

    def __post_init__(self):
        if self.base_ads < 1 or self.copies < 1 or self.first_copy < 0 or self.n_requests < 1:
            raise ValueError(f"a tiled pool needs base ads, copies and requests (at least 1) and a first copy of at "
                             f"least 0, got {self.base_ads}, {self.copies}, {self.n_requests} and {self.first_copy}")

    @cached_property
    def base(self):
        from .tiling import generate_base

        return generate_base(self.base_ads, self.n_requests, self.seed)

    @cached_property
    def model(self) -> MoeModel:
        return MoeModel.init(self.seed, D=self.dim)

    @cached_property
    def requests(self) -> list[Request]:
        from andromeda_nb.derive import request_signals

        model = self.model
        return [dataclasses.replace(r, signals=request_signals(r.request_id, self.seed, model.E, model.S))
                for r in self.base.requests]

    @property
    def stride(self) -> int:
        from .tiling import stride_of

        return stride_of(self.base.compiled)

    @property
    def n_ads(self) -> int:
        return len(self.base.compiled) * self.copies

    @property
    def ad_ids(self) -> np.ndarray:
        """int64: every ad of the pool, copy by copy."""
        copies = np.arange(self.first_copy, self.first_copy + self.copies, dtype=np.int64)
        return (self.base.compiled.ad_id[None, :] + (copies * self.stride)[:, None]).ravel()

    @property
    def meta(self) -> dict:
        return {"lineage": f"tiled-{self.seed}-{self.base_ads}-{self.first_copy}-{self.copies}",
                "tiled": dataclasses.asdict(self)}

    source_dir = None

    def shard(self, shard: int, n_shards: int) -> "TiledPool":
        """Shard `shard` of `n_shards` pools like this one: the same recipe, its own copies."""
        if not 0 <= shard < n_shards:
            raise ValueError(f"shard {shard} is outside 0..{n_shards - 1}")
        return dataclasses.replace(self, first_copy=self.first_copy + shard * self.copies)


class TiledEngine(GpuEngine):
    """`GpuEngine` over a `TiledPool` laid out on the device ('gpu' or 'sim')."""

    def __init__(self, pool: TiledPool, device: str = "auto", *, version=None):
        self.device = resolve(device, kernels=True, what="the tiled engine")
        from .match import build_tiled_index
        from .score import slot_pool
        from gpu.runtime import DeviceClock

        self.pool = pool
        self.model, self.seed, self.precision = pool.model, pool.seed, pool.precision
        self.E, self.D, self.F, self.top_e = self.model.E, self.model.D, self.model.F, self.model.top_k
        self.index = build_tiled_index(pool.base.compiled, pool.copies, first_copy=pool.first_copy, device=self.device,
                                       buckets=world_buckets(pool.seed))
        self.xp = _array_module(self.device)
        # a fresh draw for every slot, its own seed per range of copies (so shards differ)
        self.stored, self.scorer = slot_pool(self.xp, self.index.slots, self.model, pool.precision,
                                             pool.seed + 1 + pool.first_copy, version=version)
        from gpu.pipeline import BatchPipeline

        self.pipeline = BatchPipeline(self.index, self.scorer)
        self.clock = DeviceClock()

    def apply(self, update) -> None:
        raise ValueError("a tiled pool takes no updates (its embeddings live on the device only)")

    def apply_many(self, updates) -> None:
        raise ValueError("a tiled pool takes no updates (its embeddings live on the device only)")

    def check(self, requests: Sequence[Request], k: int) -> list[dict]:
        """Each request's answer against the float64 reference over the eligible slots the match
        reported (`benchmarks.score.check_answer`: scores within SCORE_ATOL but for gate ties, no
        eligible ad left out that beats the lowest answer by more than TOPK_TIE_ATOL, rank order)."""
        from andromeda_nb.compiled import encode_requests

        from .score import check_pool_answers

        requests = list(requests)
        answers = self.retrieve(requests, k)
        words = self.index.match_slots(encode_requests(requests)).copy_to_host()
        return check_pool_answers(self.xp, self.stored, self.index.slots, self.model, requests, answers, words, k)

    def describe(self) -> dict:
        return {**super().describe(), "tiled": dataclasses.asdict(self.pool)}


def _array_module(device: str):
    """CuPy on a real GPU where it is installed (the draw stays on the device), else numpy."""
    if device == "gpu":
        try:
            import cupy

            return cupy
        except ImportError:
            pass
    return np


__all__ = ["TiledEngine", "TiledPool"]
