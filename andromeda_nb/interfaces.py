"""The interfaces both architectures implement, so the CLI and the harness treat them alike.

Which class serves which `--arch` is listed in `MATCHERS` and `RETRIEVERS`; they are imported
lazily, so the CPU-only parts never import numba-cuda and a missing GPU costs nothing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol, Sequence

import numpy as np

from .types import Ad, Request, Update

if TYPE_CHECKING:  # pragma: no cover
    from .dataset import Dataset


class TargetingIndex(Protocol):
    """Targeting match: `andromeda_nb.oracle.OracleIndex`, `cpu_baseline.index.CpuTargetingIndex`,
    `gpu.index.GpuTargetingIndex`. The two indexes also offer `from_compiled(ct, **options)`, built
    from a `compiled.CompiledTargeting` (a stored corpus's `Dataset.compiled`) with no ad parsed;
    `andromeda_nb.reference.build_index` picks it where a class has it."""

    @classmethod
    def build(cls, ads: Sequence[Ad]) -> "TargetingIndex": ...

    def match(self, requests: Sequence[Request]) -> list[np.ndarray]:
        """Eligible ad ids per request: int64, ascending."""

    def apply(self, update: Update) -> None:
        """Apply one update of DESIGN section 6. The caller (`andromeda_nb.updates.UpdateLog`)
        has already checked it against the live ad set, so it is always applicable."""

    def __len__(self) -> int:
        """Number of live (not retired) ads."""


class Retriever(Protocol):
    """Top-K retrieval: `andromeda_nb.reference.ReferenceRetriever`,
    `cpu_baseline.remote.RemoteRetriever`, `gpu.colocated.ColocatedRetriever`."""

    @classmethod
    def build(cls, dataset: "Dataset", **options) -> "Retriever": ...

    def apply(self, update: Update) -> None: ...

    def retrieve(self, requests: Sequence[Request], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per request (ad ids int64, scores float32), in rank order: score descending, ties by
        ad id ascending; at most k rows."""

    def close(self) -> None: ...


MATCHERS = {
    "oracle": "andromeda_nb.oracle:OracleIndex",
    "cpu": "cpu_baseline.index:CpuTargetingIndex",
    "gpu": "gpu.index:GpuTargetingIndex",
}
RETRIEVERS = {
    "reference": "andromeda_nb.reference:ReferenceRetriever",
    "remote": "cpu_baseline.remote:RemoteRetriever",
    "colocated": "gpu.colocated:ColocatedRetriever",
}


def load_class(table: dict[str, str], name: str):
    if name not in table:
        raise KeyError(f"unknown architecture {name!r}; choose from {', '.join(table)}")
    module, _, attr = table[name].partition(":")
    return getattr(importlib.import_module(module), attr)
