"""The interfaces both architectures implement, so the CLI and the harness treat them alike.

Which class serves which `--arch` and device is listed a layer up, in `migration.architectures`
(the contract names no implementation of either architecture).
"""

from __future__ import annotations

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
    `cpu_baseline.remote.RemoteRetriever`, `migration.colocated.ColocatedRetriever`."""

    @classmethod
    def build(cls, dataset: "Dataset", **options) -> "Retriever": ...

    def apply(self, update: Update) -> None: ...

    def retrieve(self, requests: Sequence[Request], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per request (ad ids int64, scores float32), in rank order: score descending, ties by
        ad id ascending; at most k rows."""

    def close(self) -> None: ...


class Engine(Protocol):
    """A co-located engine: one corpus matched, scored and cut to top-K next to the ads, on one
    device. `cpu_baseline.engine.CpuEngine` (the CPU index and the CPU scorer) and
    `gpu.engine.GpuEngine` (the GPU index and the fused scoring kernel); a co-located server
    (`serving.engine_server`) serves either. Both also offer `stages(request, k)`, where one
    request's time goes (`andromeda_nb.engine.stage_breakdown`, which does without it)."""

    device: str  # where it runs: 'cpu', 'gpu' or 'sim'

    def retrieve(self, requests: Sequence[Request], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per request (ad ids int64, scores float32) in rank order (DESIGN section 4), at most k rows."""

    def apply(self, update: Update) -> None:
        """Apply one update of DESIGN section 6, already checked against the live ad set."""

    def describe(self) -> dict:
        """What it holds and where it runs, for a server's `health` action."""

    def close(self) -> None: ...

    def __len__(self) -> int:
        """Number of live ads."""

    def __contains__(self, ad_id) -> bool:
        """Whether `ad_id` is live."""

