"""A loaded corpus: what `generate` and `import` write and every command reads.

On disk (a directory; `andromeda_nb.store` reads and writes it, checking `meta.json`'s schema_version):
    meta.json        schema_version, seed, sizes (D, E, k, F, S), precision, counts, generator settings,
                     and `targeting`: the compiled-targeting file, its format version and the
                     sha256 of it and of the ads.parquet it was compiled from
    ads.parquet      ad_id, status, start_time, end_time, format, targeting (JSON text),
                     embedding (fixed-size list of the stored dtype), scale (float32)
    targeting.npz    the ads' targeting compiled (`andromeda_nb.compiled.CompiledTargeting`, row i is
                     ad i), written when the ads are validated, so that loading needs no parsing
    requests.parquet request_id, request (JSON text: user, context, signals), as in the Flight protocol
    model.npz        W, b, K, A, B (float32), DESIGN section 3

A `Dataset` read from a directory holds the compiled targeting and the embeddings; its `ads` (the
parsed `Ad` objects, a few kB each) are parsed from ads.parquet on first access. Everything that
needs only ids, formats or the compiled columns (the indexes, the scorers, the services) reads
`compiled`, `ad_ids` and `formats` and never parses. A Dataset made in memory from a list of ads
compiles them on first use of `compiled`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

import numpy as np

from .types import Ad, Request


class Dataset:
    """ads (row i of `embeddings` and of `compiled` is ads[i]), requests, model and settings.

    Build it from `ads` (a list of `Ad`) or from `compiled` plus `ads_loader` (a picklable callable
    returning the list of ads, called once on first access of `.ads`; with a `chunks(rows)` method,
    `ad_chunks` streams over them instead); `source_dir` is the corpus
    directory it was read from, so that a service process can load that directory itself. The ads
    and the compiled targeting are read-only once made: a change means a new Dataset.
    """

    def __init__(self, ads: list[Ad] | None = None, embeddings: "EmbeddingTable" = None,
                 requests: list[Request] | None = None, model: "MoeModel" = None, seed: int = 0,
                 precision: str = "fp32", meta: dict | None = None, *, compiled: "CompiledTargeting" = None,
                 ads_loader: Callable[[], list[Ad]] | None = None, source_dir=None):
        if ads is None and (compiled is None or ads_loader is None):
            raise ValueError("a Dataset needs its ads, or their compiled targeting and a loader for them")
        self._ads = ads
        self._compiled = compiled
        self._ads_loader = ads_loader
        self.embeddings = embeddings
        self.requests = [] if requests is None else requests
        self.model = model
        self.seed = seed
        self.precision = precision
        self.meta = {} if meta is None else meta
        self.source_dir = None if source_dir is None else Path(source_dir)

    # --- the ads, parsed on demand ----------------------------------------------------------------
    @property
    def ads(self) -> list[Ad]:
        """Validated ads, in file order (parsed from the corpus directory on first access)."""
        if self._ads is None:
            ads = self._ads_loader()
            if len(ads) != len(self._compiled):
                raise ValueError(f"the ads loader gave {len(ads)} ads for {len(self._compiled)} compiled rows")
            self._ads = ads
        return self._ads

    @ads.setter
    def ads(self, ads: list[Ad]) -> None:
        self._ads, self._compiled, self._ads_loader = ads, None, None
        self.source_dir = None  # the directory no longer holds these ads

    @property
    def ads_loaded(self) -> bool:
        return self._ads is not None

    def ad_chunks(self, rows: int = 1 << 16):
        """The ads, `rows` at a time, in order. Parses a chunk at a time from the corpus directory
        when `.ads` has not been parsed (memory for one chunk, not for every ad)."""
        if self._ads is None and hasattr(self._ads_loader, "chunks"):
            yield from self._ads_loader.chunks(rows)
            return
        ads = self.ads
        for lo in range(0, len(ads), rows):
            yield ads[lo : lo + rows]

    @property
    def compiled(self) -> "CompiledTargeting":
        """The ads' compiled targeting (row i is ads[i]), the form every index is built from."""
        if self._compiled is None:
            self._compiled = compile_ads(self._ads)
        return self._compiled

    @property
    def n_ads(self) -> int:
        return len(self._compiled) if self._compiled is not None else len(self._ads)

    @property
    def formats(self) -> np.ndarray:
        """int16 (N,): format of ad i."""
        if self._compiled is not None or self._ads is None:
            return self.compiled.format.astype(np.int16)
        return np.fromiter((a.format for a in self._ads), np.int16, len(self._ads))

    @property
    def ad_ids(self) -> np.ndarray:
        """int64 (N,): id of ad i (a fresh array)."""
        if self._compiled is not None or self._ads is None:
            return self.compiled.ad_id.astype(np.int64)
        return np.fromiter((a.ad_id for a in self._ads), np.int64, len(self._ads))

    def __repr__(self) -> str:
        where = f", from {self.source_dir}" if self.source_dir else ""
        return (f"Dataset({self.n_ads} ads, {len(self.requests)} requests, {self.precision}, "
                f"seed {self.seed}{where})")


from .compiled import CompiledTargeting, compile_ads  # noqa: E402
from .model import EmbeddingTable, MoeModel  # noqa: E402  (type names for the annotations above)


def fingerprint(ad_ids) -> str:
    """Hash of the ad id in each row (int64): a corpus's identity as every service computes it."""
    return hashlib.sha256(np.ascontiguousarray(ad_ids, np.int64).tobytes()).hexdigest()[:16]
