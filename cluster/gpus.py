"""Which GPU each shard process of one host uses.

A shard process sees one GPU: its `CUDA_VISIBLE_DEVICES` names one of the host's GPUs, so its engine
allocates and launches there as device 0. Shard s of a cluster on G GPUs gets GPU s mod G: one shard
per GPU when N = G, several shards sharing a GPU when N > G (the single-GPU machine's case). The GPUs
handed out are the ones this process may use: its own `CUDA_VISIBLE_DEVICES` entries when that is
set (so `CUDA_VISIBLE_DEVICES=2,3 python -m benchmarks.cluster ...` keeps to GPUs 2 and 3), else every
device the driver counts. Ray's placement (`cluster.router`) does the same through `num_gpus`.
"""

from __future__ import annotations

import os
from typing import Callable, Mapping, Sequence

GPU_ENV = "CUDA_VISIBLE_DEVICES"


def _driver_count() -> int:
    from numba import cuda

    return len(cuda.gpus)


def host_gpus(env: Mapping[str, str] | None = None, count: Callable[[], int] = _driver_count) -> list[str]:
    """The GPUs this process may hand to shard processes, as `CUDA_VISIBLE_DEVICES` names them."""
    env = os.environ if env is None else env
    given = env.get(GPU_ENV)
    if given is not None:
        return [name.strip() for name in given.split(",") if name.strip()]
    return [str(i) for i in range(count())]


def choose_gpus(requested: int | None, available: Sequence[str]) -> list[str]:
    """The first `requested` of the `available` GPUs (all of them when None)."""
    if not available:
        raise RuntimeError(f"no GPU to place shards on ({GPU_ENV} names none, or the driver counts none)")
    if requested is None:
        return list(available)
    if not 1 <= requested <= len(available):
        raise ValueError(f"--gpus {requested}: this process may use {len(available)} GPU(s) "
                         f"({', '.join(available)}); ask for 1 to {len(available)}")
    return list(available[:requested])


def gpu_of_shard(shard: int, gpus: Sequence[str]) -> str:
    """The GPU shard `shard` runs on: the shards go round the GPUs in order."""
    if shard < 0:
        raise ValueError(f"a shard number is at least 0, got {shard}")
    return gpus[shard % len(gpus)]


def shard_environment(shard: int, gpus: Sequence[str] | None) -> dict:
    """The environment variables that place shard `shard`'s process (none without GPUs)."""
    return {} if not gpus else {GPU_ENV: gpu_of_shard(shard, gpus)}


__all__ = ["GPU_ENV", "choose_gpus", "gpu_of_shard", "host_gpus", "shard_environment"]
