"""One batch size, and one way to cut a sequence of requests into batches, for every path that sends
or runs requests in batches: a client's record batches, the GPU engine's launches, the CPU index's
match passes, the benchmarks' loops.

64 requests a batch: the shipped match kernels answer a group of 64 requests in one pass (a bit each
of a 64-bit mask, `gpu.kernels.match.WIDE_GROUP`), so a launch of 64 costs the pool's read once; a
client sending its requests 64 to a record batch fills one such launch.
"""

from __future__ import annotations

from typing import Iterator, Sequence, TypeVar

BATCH_REQUESTS = 64

T = TypeVar("T")


def in_batches(items: Sequence[T], size: int = BATCH_REQUESTS) -> Iterator[Sequence[T]]:
    """Consecutive slices of `items` of `size` (the last one shorter)."""
    if size < 1:
        raise ValueError(f"batch size must be at least 1, got {size}")
    for lo in range(0, len(items), size):
        yield items[lo : lo + size]


__all__ = ["BATCH_REQUESTS", "in_batches"]
