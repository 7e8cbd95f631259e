"""Large pools from a small generated corpus, for the benchmarks: a base corpus made by the project's
generator, *tiled* into a pool of many copies (generating 100M ads in Python is too slow).

Copy k of base ad i is an ad with id `base_id + k * stride` (`stride_of`) and the same targeting, so
the oracle's answer for a copy is the base ad's. `tile_compiled` repeats the compiled targeting
(every byte a scan reads is real); the GPU benchmark lays the same copies out on the device
directly (`gpu.bench_match.build_tiled_index`), the CPU one builds its index from `tile_compiled`.
"""

from __future__ import annotations

import dataclasses
import gzip
import pickle
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .bench import log
from .compiled import CompiledTargeting, compile_ads
from .types import Ad, Request


@dataclass
class BaseCorpus:
    ads: list[Ad]
    requests: list[Request]
    seed: int

    @cached_property
    def compiled(self) -> CompiledTargeting:
        return compile_ads(self.ads)

    @cached_property
    def by_id(self) -> dict[int, Ad]:
        return {a.ad_id: a for a in self.ads}

    def save(self, path: str) -> None:
        ads = [dataclasses.replace(a, embedding=None) for a in self.ads]  # targeting only
        with gzip.open(path, "wb", compresslevel=3) as f:
            pickle.dump({"ads": ads, "requests": self.requests, "seed": self.seed}, f, protocol=5)

    @classmethod
    def load(cls, path: str) -> "BaseCorpus":
        with gzip.open(path, "rb") as f:
            d = pickle.load(f)
        return cls(ads=d["ads"], requests=d["requests"], seed=d["seed"])


def generate_base(n_ads: int, n_requests: int, seed: int, progress: bool = False) -> BaseCorpus:
    """A base corpus from the project's generator (andromeda_nb.corpus), parsed like any import."""
    from .corpus import iter_ads, make_requests
    from .targeting import parse_ad, parse_request

    log(progress, f"generating {n_ads} base ads and {n_requests} requests (seed {seed})")
    ads = [parse_ad(c.ad_object(i, with_embedding=False), seed=seed, dim=4)
           for c in iter_ads(n_ads, seed, dim=4) for i in range(len(c))]
    ads = [dataclasses.replace(a, embedding=None) for a in ads]
    requests = [parse_request(o, seed=seed, experts=1, width=1) for o in make_requests(n_requests, seed, experts=1, width=1)]
    return BaseCorpus(ads=ads, requests=requests, seed=seed)


def load_or_generate_base(path: str | None, n_ads: int, n_requests: int, seed: int,
                          progress: bool = False) -> BaseCorpus:
    """The base corpus cached at `path` (a gzip pickle) when it is there, else generated (and written
    there when a path is given)."""
    if path:
        try:
            base = BaseCorpus.load(path)
            log(progress, f"base corpus from {path}: {len(base.ads)} ads, {len(base.requests)} requests")
            return base
        except FileNotFoundError:
            base = generate_base(n_ads, n_requests, seed, progress)
            base.save(path)
            return base
    return generate_base(n_ads, n_requests, seed, progress)


def stride_of(ct: CompiledTargeting) -> int:
    return int(ct.ad_id.max()) + 1 if len(ct) else 1


def tile_compiled(ct: CompiledTargeting, copies: int) -> CompiledTargeting:
    """The compiled form of `copies` copies of ct's ads (copy k: ids + k * stride)."""
    m, t, q = len(ct.clause_negative), len(ct.terms), len(ct.circles)
    k = np.arange(copies, dtype=np.int64)

    def ptr(p, step):
        return np.concatenate([(p[:-1][None, :] + (k * step)[:, None]).ravel(), [p[-1] + (copies - 1) * step]])

    def rep(a):
        return np.tile(a, (copies,) + (1,) * (a.ndim - 1))

    cols = {f.name: rep(getattr(ct, f.name)) for f in dataclasses.fields(ct)}
    cols["ad_id"] = (ct.ad_id[None, :] + (k * stride_of(ct))[:, None]).ravel()
    cols["clause_ptr"] = ptr(ct.clause_ptr, m)
    cols["term_ptr"] = ptr(ct.term_ptr, t)
    cols["circle_ptr"] = ptr(ct.circle_ptr, q)
    return CompiledTargeting(**cols)


__all__ = ["BaseCorpus", "generate_base", "load_or_generate_base", "stride_of", "tile_compiled"]
