"""A batch's device work as data (a plan), launched step by step or replayed from a CUDA graph.

A numba kernel launch costs tens to hundreds of microseconds of Python on the host (argument typing
and marshalling), and a lone request's batch makes five of them and four copies: at a millisecond's
budget that is the host, not the device, setting the pace (docs/BENCHMARKS.md, "One request at the
speed of its kernels"). So the shipped launchers also describe their work as a plan, a list of steps:

  `Launch(kernel, grid, block, args)`   one kernel launch
  `Copy(dst, src)`                      one asynchronous copy between a device array and a pinned
                                        host array (either way)

`run_plan(plan, stream)` enqueues the steps one by one, as the launchers always did. A `GraphCache`
instead captures a plan's steps once into a CUDA graph (stream capture through `cuda.bindings`, the
driver bindings numba-cuda itself runs on) and replays it with one `cuGraphLaunch`. A graph binds the
addresses, shapes and scalar values its steps had when captured, so the cache keys it by exactly
those: each kernel and launch shape, and each argument, a device or pinned array by identity and
anything else by value (`plan_key`). The cache holds every argument of the plans it keeps, so an
array a graph binds stays allocated, and no new array can take its identity, while the graph lives.
Callers make plans of arrays they keep (views made once per batch shape): a plan of fresh arrays
would be a new key every time, captured and never replayed (`GraphCache.captures` tells).

Under the CUDA simulator there are no graphs: a captured "graph" is the plan itself, run again on
replay, with the arrays it was captured with. Like a real graph it ignores an array made since, so
a key that missed a change shows in the simulator's tests as a wrong answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from andromeda_nb.devices import simulator_enabled

_VALUES = (int, float, bool, np.generic)


@dataclass(frozen=True)
class Launch:
    """One kernel launch: `kernel[grid, block, stream](*args)`."""

    kernel: object
    grid: tuple
    block: int | tuple
    args: tuple

    def run(self, stream) -> None:
        self.kernel[self.grid, self.block, stream](*self.args)

    def key(self) -> tuple:
        return (id(self.kernel), self.grid, self.block, tuple(_arg_key(a) for a in self.args))


@dataclass(frozen=True)
class Copy:
    """One asynchronous copy on the stream: device array `src` into pinned host array `dst`
    (`to_host`), or pinned host array `src` into device array `dst`. Same shapes and dtypes."""

    dst: object
    src: object
    to_host: bool

    def run(self, stream) -> None:
        if self.to_host:
            self.src.copy_to_host(self.dst, stream=stream)
        else:
            self.dst.copy_to_device(self.src, stream=stream)

    def key(self) -> tuple:
        return ("copy", self.to_host, id(self.dst), id(self.src))


def _arg_key(a):
    return (type(a), a) if isinstance(a, _VALUES) else id(a)


def plan_key(plan: Sequence) -> tuple:
    """What a graph of `plan` binds: each step's kernel, launch shape and arguments (arrays by identity,
    scalars by type and value)."""
    return tuple(step.key() for step in plan)


def run_plan(plan: Sequence, stream=0) -> None:
    """Enqueue a plan's steps on `stream`, one by one."""
    for step in plan:
        step.run(stream)


class _DeviceGraph:
    """A plan captured into an instantiated CUDA graph."""

    def __init__(self, plan: Sequence, stream):
        from cuda.bindings import driver

        self._driver = driver
        handle = driver.CUstream(int(stream.handle))
        _ok(driver.cuStreamBeginCapture(handle, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
        try:
            run_plan(plan, stream)
        finally:
            graph = _ok(driver.cuStreamEndCapture(handle))  # ends the capture even when a step failed
        self._graph = graph
        self._exec = _ok(driver.cuGraphInstantiate(graph, 0))
        self._stream = (stream, handle)

    def launch(self, stream) -> None:
        kept = self._stream
        if kept[0] is not stream:  # the driver's handle of the stream, made once per stream
            kept = self._stream = (stream, self._driver.CUstream(int(stream.handle)))
        _ok(self._driver.cuGraphLaunch(self._exec, kept[1]))

    def __del__(self):
        try:
            self._driver.cuGraphExecDestroy(self._exec)
            self._driver.cuGraphDestroy(self._graph)
        except Exception:  # at interpreter exit the driver may be gone before us: nothing left to free
            pass


class _SimulatedGraph:
    """The simulator's graph: the plan, run again with the arrays it was captured with."""

    def __init__(self, plan: Sequence, stream):
        self._plan = tuple(plan)

    def launch(self, stream) -> None:
        run_plan(self._plan, stream)


def _ok(result):
    """The value of a `cuda.bindings` call's (error, value) result; raises on an error."""
    from cuda.bindings import driver

    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        name = driver.cuGetErrorName(err)[1]
        raise RuntimeError(f"CUDA graph call failed: {name.decode() if isinstance(name, bytes) else name}")
    return rest[0] if len(rest) == 1 else tuple(rest)


class GraphCache:
    """CUDA graphs of plans, by `plan_key`, at most `limit` of them (past that all are dropped, and with
    them the arrays they held). `run(plan, stream)` replays the plan's graph; a plan seen for the first
    time is run step by step (its kernels compile and load then, outside any capture, and a plan seen
    once only costs no capture), and captured the second time."""

    def __init__(self, limit: int = 1024):
        # a server's batches come in every size up to the engine's batch, through two staging buffers,
        # as one plan or two (`gpu.pipeline`): some hundreds of plans, each kept
        self.limit = limit
        self._graphs: dict = {}
        self._seen: set = set()
        self.captures = 0
        self.replays = 0

    def run(self, plan: Sequence, stream) -> None:
        key = plan_key(plan)
        entry = self._graphs.get(key)
        if entry is None:
            if key not in self._seen:
                if len(self._seen) >= self.limit:
                    self._seen.clear()
                self._seen.add(key)  # the key holds ids only: the plan's arrays are not kept for it
                run_plan(plan, stream)
                return
            if len(self._graphs) >= self.limit:
                self._graphs.clear()
            kind = _SimulatedGraph if simulator_enabled() else _DeviceGraph
            # the plan is kept beside its graph: it holds every array the graph binds
            entry = self._graphs[key] = (kind(plan, stream), tuple(plan))
            self.captures += 1
        entry[0].launch(stream)
        self.replays += 1

    def clear(self) -> None:
        self._graphs.clear()
        self._seen.clear()

    def __len__(self) -> int:
        return len(self._graphs)


__all__ = ["Copy", "GraphCache", "Launch", "plan_key", "run_plan"]
