"""What every co-located engine shares (`andromeda_nb.interfaces.Engine`): the corpus's model, seed and
storage precision, the checks and stored form of an upserted ad, and the description a server's
`health` action reports. The engines themselves are `cpu_baseline.engine.CpuEngine` and
`gpu.engine.GpuEngine`; `migration.colocated` picks one by device.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .model import ModelError, ad_embedding_of, quantize
from .types import Retire, SetStatus, Update, Upsert


class EngineBase:
    """The corpus-level state of an engine; a subclass sets `device` and `index` (its targeting index)
    and implements `retrieve` and `apply`."""

    device: str
    index: object

    def __init__(self, dataset):
        self.model = dataset.model
        self.seed = dataset.seed
        self.precision = dataset.precision
        self.E, self.D, self.F, self.top_e = self.model.E, self.model.D, self.model.F, self.model.top_k

    def stored_row(self, update: Update) -> tuple[np.ndarray, float] | None:
        """For an upsert, the ad's embedding as stored (values (D,) in the storage dtype, scale), after
        checking its format; None for a status change or a retire; TypeError for anything else."""
        if isinstance(update, Upsert):
            ad = update.ad
            if not 0 <= ad.format < self.F:
                raise ModelError(f"ad {ad.ad_id}: format {ad.format} is outside 0..{self.F - 1}")
            table = quantize(ad_embedding_of(ad, self.seed, self.D)[None, :], self.precision)
            return table.values[0], float(table.scale[0])
        if isinstance(update, (SetStatus, Retire)):
            return None
        raise TypeError(f"not an update: {update!r}")

    def stored_rows(self, upserts: Sequence[Upsert]) -> tuple[np.ndarray, np.ndarray] | None:
        """`stored_row` of each upsert at once: values (n, D) in the storage dtype and scale float32
        (n,), quantized in one call (row by row the same); None when an ad's format is out of range
        or one cannot be stored (the caller then applies them one by one, so the error comes where
        `stored_row` raises it)."""
        if not all(0 <= u.ad.format < self.F for u in upserts):
            return None
        try:
            table = quantize(np.stack([ad_embedding_of(u.ad, self.seed, self.D) for u in upserts]), self.precision)
        except ModelError:  # one by one, each error where it comes
            return None
        return table.values, table.scale

    def describe(self) -> dict:
        """What the engine holds and where it runs (merged into a server's `health` answer)."""
        return {"device": self.device, "ads": len(self), "precision": self.precision, "D": self.D, "E": self.E,
                "F": self.F, "top_k": self.top_e}

    def __len__(self) -> int:
        """Number of live ads."""
        return len(self.index)

    def __contains__(self, ad_id) -> bool:
        """Whether `ad_id` is live (so a server checks an update stream against the engine itself)."""
        return ad_id in self.index

    # --- a batch in steps (serving.overlap): here the whole batch runs at `fetch`, so an engine with no
    # device of its own overlaps nothing; `gpu.engine.GpuEngine` splits the host's work from the device's
    max_batch = 1 << 30  # the most requests `begin` takes

    def begin(self, requests, alone: bool = False):
        """The host's share of a batch (here: the requests kept for `fetch`)."""
        return requests if hasattr(requests, "encoded") else list(requests)

    def launch(self, begun, k: int):
        """A batch from `begin` started (here: nothing runs yet)."""
        return begun, k

    def ready(self, launched) -> bool:
        """Whether `fetch` would not wait for the device (here: always; the work is done at `fetch`)."""
        return True

    def fetch(self, launched) -> list:
        """The answers of a batch from `launch` (here: the whole batch, `retrieve`)."""
        requests, k = launched
        return self.retrieve(requests, k)

    def close(self) -> None:
        close = getattr(self.index, "close", None)
        if close is not None:
            close()


def stage_breakdown(engine, requests, k: int, repeat: int = 3) -> dict:
    """Where a co-located request's time goes on `engine`: its `stages(request, k)` (each engine names
    its own stages, in order: seconds, and `bytes` read or sent and `eligible` ads where they apply),
    for every request `repeat` times after one warm-up; per stage the median microseconds and the
    median bytes. {} when the engine has no `stages`."""
    stages = getattr(engine, "stages", None)
    requests = list(requests)
    if stages is None or not requests:
        return {}
    stages(requests[0], k)  # warm: kernels loaded, buffers allocated
    runs = [stages(r, k) for _ in range(repeat) for r in requests]
    runs = [run for run in runs if run]
    if not runs:
        return {}
    out = {}
    for name in runs[0]:
        row = {"us": float(np.median([run[name]["seconds"] for run in runs]) * 1e6)}
        for extra in ("bytes", "eligible"):
            if extra in runs[0][name]:
                row[extra] = float(np.median([run[name][extra] for run in runs]))
        out[name] = row
    return out


def warm_up(engine, requests, ks) -> None:
    """Run `engine` once on the first of `requests` at each k of `ks` before a server listens, so every
    kernel is compiled or loaded from its cache (the top-K paths of the smallest and the largest k
    differ) and the first client does not wait for it. Under the CUDA simulator nothing is compiled
    and a kernel launch takes seconds, so there it runs nothing."""
    if requests and getattr(engine, "device", None) != "sim":
        for k in sorted(set(ks)):
            engine.retrieve(requests[:1], k)


def no_answer() -> tuple[np.ndarray, np.ndarray]:
    """The answer to a request with no eligible ad: (ad ids int64, scores float32), both empty."""
    return np.empty(0, np.int64), np.empty(0, np.float32)


__all__ = ["EngineBase", "no_answer", "stage_breakdown", "warm_up"]
