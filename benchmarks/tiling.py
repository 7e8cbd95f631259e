"""Large pools from a small generated corpus, for the benchmarks: a base corpus made by the project's
generator, *tiled* into a pool of many copies (generating 100M ads in Python is too slow).

Copy k of base ad i is an ad with id `base_id + k * stride` (`stride_of`) and the same targeting, so
the oracle's answer for a copy is the base ad's. `tile_compiled` repeats the compiled targeting
(every byte a scan reads is real); the GPU benchmark lays the same copies out on the device
directly (`benchmarks.match.build_tiled_index`), the CPU one builds its index from `tile_compiled`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from andromeda_nb.measure import log
from andromeda_nb.compiled import CompiledTargeting, compile_ads
from andromeda_nb.types import Ad, Request


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
        """A Parquet cache: one row per ad and per request (kind, id, JSON text), the seed in the
        file's metadata. Data only: reading it back parses and validates every row, runs no code."""
        from andromeda_nb.targeting import ad_to_json, request_to_json

        encode = json.JSONEncoder(separators=(",", ":")).encode
        texts = [encode({**ad_to_json(a), "embedding": None}) for a in self.ads]
        texts += [encode(request_to_json(r)) for r in self.requests]
        table = pa.table({"kind": pa.array(["ad"] * len(self.ads) + ["request"] * len(self.requests), pa.string()),
                          "id": pa.array([a.ad_id for a in self.ads] + [r.request_id for r in self.requests], pa.int64()),
                          "json": pa.array(texts, pa.string())})
        table = table.replace_schema_metadata({BASE_MARK: str(BASE_FORMAT), "seed": str(self.seed)})
        pq.write_table(table, path, compression="zstd")

    @classmethod
    def load(cls, path: str) -> "BaseCorpus":
        """Read a cache `save` wrote; BaseCorpusError naming the file and the problem otherwise."""
        from andromeda_nb.jsontext import JsonInputError, loads
        from andromeda_nb.targeting import parse_ad, parse_request
        from andromeda_nb.types import TargetingError

        try:
            table = pq.read_table(path)
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise BaseCorpusError(f"{path}: not a base corpus cache ({exc}); delete it to generate it again") from None
        meta = table.schema.metadata or {}
        if meta.get(BASE_MARK.encode()) != str(BASE_FORMAT).encode() or table.schema.names != ["kind", "id", "json"]:
            raise BaseCorpusError(f"{path}: not a base corpus cache of format {BASE_FORMAT}; delete it to generate "
                                  "it again")
        try:
            seed = int(meta[b"seed"])
            ads, requests = [], []
            for kind, text in zip(table.column("kind").to_pylist(), table.column("json").to_pylist()):
                obj = loads(text)
                if kind == "ad":
                    obj.pop("embedding", None)
                    ads.append(dataclasses.replace(parse_ad(obj, seed=seed, dim=4), embedding=None))
                else:
                    requests.append(parse_request(obj, seed=seed, experts=1, width=1))
        except (KeyError, ValueError, TypeError, JsonInputError, TargetingError) as exc:
            raise BaseCorpusError(f"{path}: a row does not read back ({exc}); delete it to generate it again") from None
        return cls(ads=ads, requests=requests, seed=seed)


BASE_MARK = "andromeda-base-corpus"
BASE_FORMAT = 1


class BaseCorpusError(ValueError):
    """A base corpus cache that cannot be read."""


def generate_base(n_ads: int, n_requests: int, seed: int, progress: bool = False) -> BaseCorpus:
    """A base corpus from the project's generator (andromeda_nb.corpus), parsed like any import."""
    from andromeda_nb.corpus import iter_ads, make_requests
    from andromeda_nb.targeting import parse_ad, parse_request

    log(progress, f"generating {n_ads} base ads and {n_requests} requests (seed {seed})")
    ads = [parse_ad(c.ad_object(i, with_embedding=False), seed=seed, dim=4)
           for c in iter_ads(n_ads, seed, dim=4) for i in range(len(c))]
    ads = [dataclasses.replace(a, embedding=None) for a in ads]
    requests = [parse_request(o, seed=seed, experts=1, width=1) for o in make_requests(n_requests, seed, experts=1, width=1)]
    return BaseCorpus(ads=ads, requests=requests, seed=seed)


def load_or_generate_base(path: str | None, n_ads: int, n_requests: int, seed: int,
                          progress: bool = False) -> BaseCorpus:
    """The base corpus cached at `path` (a Parquet file, `BaseCorpus.save`) when it is there, else
    generated (and written there when a path is given)."""
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


__all__ = ["BaseCorpus", "BaseCorpusError", "generate_base", "load_or_generate_base", "stride_of", "tile_compiled"]
