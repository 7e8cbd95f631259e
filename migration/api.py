"""The Python entry point: load a corpus, build either architecture over it, ask it for top-K.

    from migration import build, load

    corpus = load("/tmp/corpus")                          # made by `andromeda generate` or `import`
    with build(corpus, arch="colocated") as index:        # "remote": real services; "reference": float64
        answers = index.retrieve(corpus.requests, k=10)   # [(ad ids int64, scores float32), ...] rank order

`build` takes `device` as every command's `--device` does (`andromeda_nb.devices`: 'auto' is the GPU
when usable, else compiled CPU code). `retrieve` takes the corpus's `Request`s or request objects as
in a requests file (DESIGN section 2; the id may be left out, signals too), validated with the
corpus's seed and model. What the commands print comes from the same calls (`andromeda retrieve`).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from andromeda_nb.answers import check_k
from andromeda_nb.dataset import Dataset
from andromeda_nb.types import Request

from .architectures import DEVICE_ARCHS, RETRIEVERS, build_retriever

ARCHS = tuple(RETRIEVERS)  # reference, remote, colocated, sharded (the cluster extra)


def load(path) -> Dataset:
    """The corpus in a directory made by `andromeda generate` or `andromeda import` (every check of
    `andromeda_nb.store.load_dataset`; a damaged or foreign directory raises `StoreError` saying why)."""
    from andromeda_nb.store import load_dataset

    return load_dataset(path)


class Index:
    """One architecture built over a corpus: `retrieve(requests, k)`, `apply_updates(lines)`,
    `close()` (also as a context manager). `arch` and `device` say what it is and where it runs."""

    def __init__(self, retriever, corpus: Dataset, arch: str, device: str):
        self.retriever, self.corpus, self.arch, self.device = retriever, corpus, arch, device
        self._live = None  # the live ad ids once updates apply (`updates.LiveAds`)

    def requests(self, items: Iterable[Request | dict]) -> list[Request]:
        """`Request`s as they are; request objects (dicts) parsed for this corpus, numbered from 0
        where they carry no `request_id`. A malformed one raises ValueError naming it and the path."""
        from andromeda_nb.targeting import parse_request
        from andromeda_nb.types import TargetingError

        model, out = self.corpus.model, []
        for i, item in enumerate(items):
            if isinstance(item, Request):
                out.append(item)
                continue
            try:
                out.append(parse_request(item, seed=self.corpus.seed, experts=model.E, width=model.S,
                                         request_id=None if isinstance(item, dict) and "request_id" in item else i))
            except TargetingError as exc:  # its place in the list, then its id and the path
                raise ValueError(f"requests[{i}]: {exc}") from None
        return out

    def retrieve(self, requests: Sequence[Request | dict], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Top-K eligible ads of each request by score (ties by ad id): (ad ids int64, scores float32)."""
        k = check_k(k)
        return [(np.asarray(ids, np.int64), np.asarray(scores, np.float32))
                for ids, scores in self.retriever.retrieve(self.requests(requests), k)]

    def apply_updates(self, lines_or_path) -> tuple[int, list]:
        """Apply an update stream (DESIGN section 6: a path, or JSON Lines) in order; the live ads carry
        over from one call to the next. Returns (applied, rejections by line)."""
        from andromeda_nb.updates import LiveAds, apply_updates, read_updates

        model = self.corpus.model
        if self._live is None:
            self._live = LiveAds(self.corpus.ad_ids.tolist())
        updates, malformed = read_updates(lines_or_path, seed=self.corpus.seed, dim=model.D, formats=model.F)
        not_live = apply_updates(updates, [self.retriever], self._live)
        return len(updates) - len(not_live), sorted(malformed + not_live, key=lambda r: r.line_no or 0)

    def close(self) -> None:
        """Stop what the build started (the remote services, a co-located server) and free the device."""
        self.retriever.close()

    def __enter__(self) -> "Index":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Index(arch={self.arch!r}, device={self.device!r}, {self.corpus.n_ads:,} ads)"


def build(corpus: Dataset, arch: str = "colocated", device: str = "auto") -> Index:
    """`arch` over `corpus`: 'colocated' (match, fused scoring and top-K in this process, on `device`),
    'remote' (the index host and its scoring service started on 127.0.0.1, talked to over Flight), or
    'reference' (the float64 reference every answer is checked against)."""
    from andromeda_nb.devices import resolve

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(ARCHS)}")
    where = resolve(device) if arch in DEVICE_ARCHS else "cpu"
    retriever = build_retriever(corpus, arch, where)
    return Index(retriever, corpus, arch, getattr(retriever, "device", None) or where)


__all__ = ["ARCHS", "Index", "build", "load"]
