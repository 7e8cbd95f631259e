"""One batch of requests through the co-located device path: the upload, match, scoring, top-K and the
answers' copy back, on the index's stream, as `gpu.engine.GpuEngine` serves and `bench pipeline`
measures it.

    pipe = BatchPipeline(index, scorer)                  # graphs=True: replayed from CUDA graphs
    prepared = pipe.prepare(encode_requests(reqs), tables)
    launched = pipe.launch(prepared, k)                  # asynchronous
    answers = pipe.fetch(launched)                       # the one synchronization

`prepare` is the host's share: the request's match tables and its user-side tables (float32 (R, F,
TW)) written into one of the index's two pinned staging buffers. `launch` makes the batch's plan
(`gpu.graphs`): the copy of the match's part of that buffer, the match kernel, the copy of the
tables, the scoring kernels, the top-K kernels and the answers' three copies into pinned buffers,
and enqueues it: from a CUDA graph (`graphs=True`, the default; one driver call) or step by step.
`launch_split` serves a batch with nothing ahead of it on the device (a lone request): the match
part first, the user side computed on the host while the device matches, then the rest. Graphs and
steps enqueue the same steps on the same arrays, so they give the same answers bit for bit. Every array of a plan is one the index or the
scorer keeps per batch size, so a serving loop's batches replay a few graphs: one per batch size and
staging buffer, made again only when updates replace an array (`gpu.graphs.GraphCache`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .graphs import GraphCache, run_plan


@dataclass
class Prepared:
    n: int  # requests
    batch: object  # gpu.index.RequestBatch, its upload unsent, the tables under arrays["tabs"]


@dataclass
class BatchPlan:
    """A prepared batch's steps (`gpu.graphs`), in the order they are enqueued."""

    match: list | None  # the upload of the match's arrays, the group tables' words, the match and the
    # tables' clearing (None: a lab kernel with no plan)
    match_parts: tuple | None  # the same as (before the match kernel, the kernel, after it)
    tables: list  # the upload of the user-side tables
    score: list  # table preparation and scoring
    topk: list
    copies: list  # the answers into pinned host buffers
    buffers: dict  # the scorer's buffers of the batch (gpu.fused.FusedScorer.plan)


@dataclass
class Launched:
    n: int
    buffers: dict  # the scorer's buffers of the batch (gpu.fused.FusedScorer.plan)


def _no_stamp(_t) -> None:
    pass


class BatchPipeline:
    def __init__(self, index, scorer, *, graphs: bool = True, version=None):
        """`index`: a `gpu.index.GpuTargetingIndex`; `scorer`: a `gpu.fused.FusedScorer` over the same
        slots; `version`: the match kernel (default: the index's). `graphs`: replay each batch's plan
        from a CUDA graph (the simulator replays the plan itself, `gpu.graphs`)."""
        self.index, self.scorer, self.version = index, scorer, version
        self.graphs = GraphCache() if graphs else None

    @property
    def stream(self):
        return self.index.stream

    def prepare(self, encoded, tables: np.ndarray | None = None, *, table_shape: tuple | None = None) -> Prepared:
        """The host's share of a batch: `encoded` requests (`andromeda_nb.compiled.EncodedBatch`) and
        their folded user-side tables (float32 (R, F, TW)) into the next staging buffer of the index
        (it waits only for that buffer's copy of two batches before). Without `tables`, room for them
        (`table_shape`: (F, TW)), to be filled by `fill_tables` before the scoring is launched."""
        if tables is not None:
            extra = {"tabs": np.ascontiguousarray(tables, np.float32)}
        else:
            extra = {"tabs": ((len(encoded), *table_shape), np.float32)}
        batch = self.index.prepare(encoded, self.version, reuse=True, extra=extra, send_now=False)
        return Prepared(batch.n, batch)

    def fill_tables(self, prepared: Prepared, tables: np.ndarray) -> None:
        """Write the user-side tables of a batch prepared without them into its staging buffer."""
        prepared.batch.staged["tabs"][...] = tables

    def plan(self, prepared: Prepared, k: int, parts: tuple | None = None) -> BatchPlan:
        """The steps of a prepared batch (`BatchPlan`); `parts`: its match's, when already made
        (`GpuTargetingIndex.plan_parts` on the same output)."""
        batch = prepared.batch
        elig = self.index.kept_output(prepared.n)
        score, topk, b = self.scorer.plan(elig, batch.arrays["tabs"], k)
        if parts is None:
            parts = self.index.plan_parts(batch, elig, self.version)
        return BatchPlan(None if parts is None else parts[0] + parts[1] + parts[2], parts, list(batch.uploads[1:]),
                         score, topk, self.scorer.answer_plan(b), b)

    def launch(self, prepared: Prepared, k: int, marks=None) -> Launched:
        """Enqueue a prepared batch's plan on the stream (asynchronous). `marks`: four CUDA events
        recorded before the match, after it, after scoring and after top-K (the benchmark's stage
        timing): then the steps are enqueued one by one, as they are without graphs."""
        return self._launch(prepared, self.plan(prepared, k), marks)

    def _launch(self, prepared: Prepared, p: BatchPlan, marks=None) -> Launched:
        stream = self.stream
        if p.match is None:  # a lab kernel with no plan: its own launcher (which sends the whole upload)
            self.index.run(prepared.batch, self.index.kept_output(prepared.n), self.version)
            run_plan(p.score + p.topk + p.copies, stream)
        elif marks is not None:
            run_plan(p.match_parts[0], stream)
            marks[0].record(stream)
            run_plan(p.match_parts[1], stream)
            marks[1].record(stream)
            run_plan(p.match_parts[2], stream)
            run_plan(p.tables + p.score, stream)
            marks[2].record(stream)
            run_plan(p.topk, stream)
            marks[3].record(stream)
            run_plan(p.copies, stream)
        else:
            self._enqueue(p.match + p.tables + p.score + p.topk + p.copies)
        prepared.batch.mark_sent(stream)
        return Launched(prepared.n, p.buffers)

    def launch_split(self, encoded, tables_of: Callable[[], np.ndarray], table_shape: tuple, k: int,
                     stamps: list | None = None) -> Launched:
        """A batch with nothing ahead of it on the device (a lone request, the first batch of a call):
        its match is enqueued first, and its user-side tables (`tables_of()`, float32 (R, F, TW)) are
        computed on the host while the device matches; then the tables' upload, scoring, top-K and the
        answers' copies. Two plans (two graphs) instead of one, the same steps in the same order.
        `stamps`: a list the host's clock (`time.perf_counter`) is appended to after the preparation,
        the match's enqueueing, the user side and the rest's enqueueing (the benchmark's host calls)."""
        mark = stamps.append if stamps is not None else _no_stamp
        prepared = self.prepare(encoded, table_shape=table_shape)
        batch = prepared.batch
        parts = self.index.plan_parts(batch, self.index.kept_output(prepared.n), self.version)
        if parts is None:  # a lab kernel with no plan: no split
            self.fill_tables(prepared, tables_of())
            return self._launch(prepared, self.plan(prepared, k))
        mark(time.perf_counter())
        self._enqueue(parts[0] + parts[1] + parts[2])  # the match's part only is planned before it is enqueued
        mark(time.perf_counter())
        self.fill_tables(prepared, tables_of())
        p = self.plan(prepared, k, parts)  # the rest of the plan while the device matches
        mark(time.perf_counter())
        self._enqueue(p.tables + p.score + p.topk + p.copies)
        batch.mark_sent(self.stream)
        mark(time.perf_counter())
        return Launched(prepared.n, p.buffers)

    def _enqueue(self, plan: list) -> None:
        if self.graphs is not None:
            self.graphs.run(plan, self.stream)
        else:
            run_plan(plan, self.stream)

    def fetch(self, launched: Launched) -> list[tuple[np.ndarray, np.ndarray]]:
        """The batch's answers (ad ids, scores) per request: one synchronization of the stream."""
        self.stream.synchronize()
        return self.scorer.answers(launched.buffers, launched.n)


__all__ = ["BatchPipeline", "BatchPlan", "Launched", "Prepared"]
