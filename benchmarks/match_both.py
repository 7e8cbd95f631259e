"""Benchmarks that set one architecture beside the other: `andromeda bench match` times the GPU index
(`benchmarks.match`, every kernel version of the lab) and the CPU inverted index on a pool tiled from
the same base corpus (`benchmarks.cpu.bench_tiled_match`), in one result.
"""

from __future__ import annotations

from andromeda_nb.provenance import write_result
from andromeda_nb.devices import resolve
from .tiling import load_or_generate_base


def bench_match(*, cpu_pool: int = 1_000_000, base_path: str | None = None, base_ads: int | None = None,
                requests: int = 256, seed: int = 7, device: str = "auto", progress: bool = True, **gpu_options) -> dict:
    """`benchmarks.match.run` (pools, versions, batches, updates, chunk_slots, out: its options) on a
    base corpus loaded from `base_path` or generated, then, with `cpu_pool`, the CPU index on a pool of
    that many ads of the same base under "cpu_index". Returns the JSON-ready result (also written to
    `out` when given)."""
    resolve(device, kernels=True, what="the GPU index")  # before anything imports numba.cuda
    from . import match as gpu_bench

    base = load_or_generate_base(base_path, base_ads or gpu_bench.BASE_ADS, requests, seed, progress)
    result = gpu_bench.run(base=base, seed=seed, device=device, progress=progress, **gpu_options)
    if cpu_pool:
        from .cpu import bench_tiled_match

        result["cpu_index"] = bench_tiled_match(base, cpu_pool, progress)
        result["checks"][f"cpu_index/{result['cpu_index']['ads']}"] = result["cpu_index"]["check"]
        result["checks_ok"] = result["checks_ok"] and result["cpu_index"]["check"]["ok"]
        if gpu_options.get("out"):
            write_result(result, gpu_options["out"], "match")
    return result


__all__ = ["bench_match"]
