"""The co-located engine on the GPU (or the CUDA simulator): `andromeda_nb.interfaces.Engine` over the
GPU targeting index and the fused scorer.

`gpu.index.GpuTargetingIndex` writes eligibility bits in slot order on the device; `gpu.fused.
FusedScorer` holds the embeddings in the same slot order and runs the fused scoring kernel (per-block
top-K inside) and the final top-K kernel. Per batch of at most MAX_BATCH requests: the user side of
every request on the host (float64, folded into per-format float32 tables; the whole batch in one
vectorized pass, `andromeda_nb.model.user_sides` and `andromeda_nb.scoring.fold_tables_batch`), one
match launch, one scoring launch, one top-K launch, all on the index's stream, and one
synchronization, when the answers come back; the batch's upload, kernels and answer copies are one
plan (`gpu.pipeline`), replayed from a CUDA graph (`gpu.graphs`: one driver call instead of a numba
launch's Python per kernel). The host's share of batch
i + 1 (user side, request encoding, group and circle tables, their upload) is done while the device
runs batch i: it is prepared before batch i's answers are fetched, into the second of the index's two
request buffers; the first batch of a call, with nothing ahead of it on the device, has its user side
computed while its match runs (`BatchPipeline.launch_split`). Updates (DESIGN section 6) go to the index and to the embedding table in the same slot.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from andromeda_nb.batching import BATCH_REQUESTS, in_batches
from andromeda_nb.compiled import encode_requests
from andromeda_nb.constants import DEFAULT_LAYOUT
from andromeda_nb.devices import resolve
from andromeda_nb.engine import EngineBase, no_answer
from andromeda_nb.geo_layout import LAYOUTS, world_buckets
from andromeda_nb.model import user_sides
from andromeda_nb.progress import Phases, Say
from andromeda_nb.rows import copy_rows
from andromeda_nb.scoring import fold_tables_batch, table_width
from andromeda_nb.types import Request, Update, Upsert

MAX_BATCH = BATCH_REQUESTS  # requests per device launch (andromeda_nb.batching)


class _Answered:
    """A batch in steps whose answers need no launch (`GpuEngine.begin`)."""

    def __init__(self, answers):
        self.answers = answers


class _Alone:
    """A batch in steps with nothing ahead of it on the device: its host work done at its launch."""

    def __init__(self, requests):
        self.requests = requests


class GpuEngine(EngineBase):
    """`device` 'gpu' or 'sim' ('auto': the GPU when usable, else `devices.NoKernelDevice`); `version`: the scoring
    kernel (a number of gpu.kernels.score's table or a `Version` of the kernel lab; default: shipped);
    `layout`: the slot order within each format, the corpus's ('format') or clustered by the places
    the ads' geo clauses name ('geo', `andromeda_nb.geo_layout.clustered_order`; the default,
    `andromeda_nb.constants.DEFAULT_LAYOUT`, measured faster: docs/BENCHMARKS.md). Either way the
    match skips blocks by the bits of the world of the dataset's seed (`geo_layout.world_buckets`)."""

    layout = "format"  # engines built another way (benchmarks.tiled) lay slots out by format

    def __init__(self, dataset, device: str = "auto", *, version=None, layout: str = DEFAULT_LAYOUT,
                 graphs: bool = True, say: Say | None = None, match_version=None):
        if layout not in LAYOUTS:
            raise ValueError(f"unknown slot layout {layout!r}; choose from {', '.join(LAYOUTS)}")
        super().__init__(dataset)
        phases = Phases(say)
        self.device = resolve(device, kernels=True, what="the GPU engine")
        from .fused import FusedScorer  # imports numba.cuda: only after the device choice
        from .index import GpuTargetingIndex

        self.layout = layout
        buckets = world_buckets(dataset.seed)  # the geographic bits of the match's block skip: the seed's world
        phases.done("GPU modules loaded, the world's geographic buckets made")
        self.index = GpuTargetingIndex.from_compiled(dataset.compiled, device=self.device, buckets=buckets,
                                                     rank="geo" if layout == "geo" else None, say=say,
                                                     version=match_version)  # no ad parsed
        phases = Phases(say)
        slots = self.index.slots
        values, scale = dataset.embeddings.values, dataset.embeddings.scale
        sv = np.zeros((slots.capacity, self.D), values.dtype)
        ss = np.ones(slots.capacity, np.float32)
        used = np.flatnonzero(slots.slot_ad_id >= 0)
        rows = self.index.built_rows  # the dataset's row of every used slot (its compiled targeting's)
        copy_rows(sv, used, values, rows)  # sv[used] = values[rows], without the gathered temporary
        ss[used] = scale[rows]
        phases.done("embeddings placed in slot order")
        self.scorer = FusedScorer(sv, ss, slots.chunk_format, slots.slot_ad_id.copy(), experts=self.E,
                                  top_e=self.top_e, version=version)
        phases.done("embeddings on the device")
        from .pipeline import BatchPipeline
        from .runtime import DeviceClock

        self.pipeline = BatchPipeline(self.index, self.scorer, graphs=graphs)
        self.clock = DeviceClock()  # device time of the match, scoring and top-K launches
        phases.done("batch pipeline ready")

    def tables(self, requests: Sequence[Request]) -> np.ndarray:
        """float32 (R, F, TW): the folded per-format tables of each request's user side (one vectorized
        pass over the batch)."""
        return fold_tables_batch(*user_sides(self.model, requests))

    def retrieve(self, requests: Sequence[Request], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        if not hasattr(requests, "encoded"):  # requests as arrays (RequestColumns) stay arrays, sliced below
            requests = list(requests)
        self._follow_slots()
        if self.index.capacity == 0:  # built from no ads, none created yet: nothing to launch over
            return [no_answer() for _ in requests]
        parts = list(in_batches(requests, MAX_BATCH))
        out: list[tuple[np.ndarray, np.ndarray]] = []
        if not parts:
            return out
        launched = self._launch_alone(parts[0], k)  # the first has nothing ahead of it on the device
        for i in range(len(parts)):
            prepared = self._prepare(parts[i + 1]) if i + 1 < len(parts) else None  # overlaps batch i on the device
            out.extend(self.pipeline.fetch(launched))  # the one synchronization
            self.clock.settle()
            if prepared is not None:
                launched = self._launch(prepared, k)
        return out

    # --- a batch in steps, for a server that overlaps its batches (serving.overlap) ---------------------
    max_batch = MAX_BATCH  # the most requests `begin` takes: one launch

    def begin(self, requests, alone: bool = False):
        """The host's share of one batch of at most `max_batch` requests (encoding, user side, staging
        buffer), what may run while the device answers the batch before it; `launch` puts it on the
        device, `fetch` waits for its answers. Between a batch's `begin` and its `fetch` only the batch
        before it may be fetched (two staging buffers), and no update may be applied. `alone`: nothing
        is on the device ahead of it, so the host work waits for `launch`, which enqueues the match
        first and computes the user side while the device matches (as `retrieve` runs a lone batch)."""
        if not hasattr(requests, "encoded"):
            requests = list(requests)
        if len(requests) > self.max_batch:
            raise ValueError(f"a batch in steps holds at most {self.max_batch} requests, got {len(requests)}")
        self._follow_slots()
        if self.index.capacity == 0 or len(requests) == 0:  # nothing to launch over, or nothing asked
            return _Answered([no_answer() for _ in range(len(requests))])
        return _Alone(requests) if alone else self._prepare(requests)

    def launch(self, begun, k: int):
        """A batch from `begin` onto the device (asynchronous)."""
        if isinstance(begun, _Answered):
            return begun
        if isinstance(begun, _Alone):
            return self._launch_alone(begun.requests, k)
        return self._launch(begun, k)

    def ready(self, launched) -> bool:
        """Whether a batch from `launch` has its answers on the host already (`fetch` would not wait)."""
        return isinstance(launched, _Answered) or self.clock.done()

    def fetch(self, launched) -> list[tuple[np.ndarray, np.ndarray]]:
        """The answers of a batch from `launch`, in request order (one synchronization)."""
        if isinstance(launched, _Answered):
            return launched.answers
        out = self.pipeline.fetch(launched)
        self.clock.settle()
        return out

    @property
    def table_shape(self) -> tuple[int, int]:
        """(F, TW) of a request's folded user-side tables (`tables`)."""
        return self.F, table_width(self.E, self.D)

    def _prepare(self, requests):
        """The host's share of a batch: the encoded requests and their folded user-side tables, written
        into the next of the index's two staging buffers (`gpu.pipeline.BatchPipeline.prepare`)."""
        return self.pipeline.prepare(encode_requests(requests), self.tables(requests))

    def _launch_alone(self, requests, k: int):
        """A batch with nothing ahead of it on the device, onto the device: its match enqueued first and
        its user side computed on the host while the device matches (`BatchPipeline.launch_split`)."""
        self.clock.start(self.index.stream)
        launched = self.pipeline.launch_split(encode_requests(requests), lambda: self.tables(requests),
                                              self.table_shape, k)
        self.clock.stop(self.index.stream)
        return launched

    def _launch(self, prepared, k: int):
        """Upload, match, scoring, top-K and the answers' copy of a prepared batch, enqueued on the
        index's stream (from a CUDA graph unless built with graphs=False)."""
        self.clock.start(self.index.stream)
        launched = self.pipeline.launch(prepared, k)
        self.clock.stop(self.index.stream)
        return launched

    def stages(self, request: Request, k: int) -> dict:
        """Where one request's time goes (`andromeda_nb.engine.stage_breakdown`): each stage run alone
        and waited for, in seconds, with the bytes the device reads for it. A request with nothing
        to launch over (no slots) has no stages."""
        import time

        self._follow_slots()
        if self.index.capacity == 0:
            return {}
        t0 = time.perf_counter()
        tabs = self.tables([request])
        t1 = time.perf_counter()
        batch = self.index.prepare(encode_requests([request]), reuse=True)
        self.index.stream.synchronize()
        t2 = time.perf_counter()
        elig = self.index.kept_output(1)
        self.index.run(batch, elig)
        self.index.stream.synchronize()
        t3 = time.perf_counter()
        launched = self.scorer.launch(elig, tabs, k, self.index.stream)
        self.index.stream.synchronize()
        t4 = time.perf_counter()
        self.scorer.fetch(launched, 1, self.index.stream)
        t5 = time.perf_counter()
        eligible = int(np.unpackbits(elig.copy_to_host().view(np.uint8)).sum())
        bits = self.index.capacity // 8  # the request's eligibility bits: the match writes them, scoring reads them
        return {"user_side": {"seconds": t1 - t0},
                "match_preparation": {"seconds": t2 - t1, "bytes": int(batch.host_bytes)},
                "match": {"seconds": t3 - t2, "bytes": int(sum(self.index.live_bytes().values()) + bits)},
                "scoring_and_topk": {"seconds": t4 - t3, "eligible": eligible,
                                     "bytes": int(eligible * self.scorer.bytes_per_row + bits)},
                "answers": {"seconds": t5 - t4}}

    @property
    def device_seconds(self) -> float | None:
        """Device seconds spent in this engine's match, scoring and top-K launches so far (None under
        the simulator)."""
        return self.clock.seconds

    def _follow_slots(self) -> None:
        """Grow the embedding table when updates grew the index's slots."""
        slots = self.index.slots
        if self.scorer.n_slots != slots.capacity:
            self.scorer.grow(slots.chunk_format, slots.slot_ad_id)

    def apply(self, update: Update) -> None:
        """Apply one update that `andromeda_nb.updates` already checked against the live ids."""
        stored = self.stored_row(update)
        self.index.apply(update)
        if isinstance(update, Upsert):
            self._follow_slots()
            self.scorer.set_slot(self.index.slots.slot_of(update.ad.ad_id), update.ad.ad_id, *stored)

    def apply_many(self, updates: Sequence[Update]) -> None:
        """Apply updates (already checked against the live ids) in order, with the index's changes in
        one upload and one synchronization for them all (`apply` pays those per update), then each
        upserted ad's embedding in its slot. Every upsert's format is checked before anything changes."""
        updates = list(updates)
        stored = [self.stored_row(u) for u in updates]
        self.index.apply_many(updates)
        self._follow_slots()
        slots = self.index.slots
        # in order, so a later upsert of the same ad writes last; an ad retired later in the same
        # call has no slot left to write; each changed tile goes to the device once
        self.scorer.set_slots([(slots.slot_of(update.ad.ad_id), update.ad.ad_id, *row)
                               for update, row in zip(updates, stored)
                               if isinstance(update, Upsert) and update.ad.ad_id in slots])

    def describe(self) -> dict:
        return {**super().describe(), "score_version": self.scorer.version, "match_version": self.index.version,
                "slots": self.scorer.n_slots, "layout": self.layout}


__all__ = ["GpuEngine", "LAYOUTS", "MAX_BATCH"]
