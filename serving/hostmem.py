"""The C allocator of a process that serves or measures: freed memory kept, not handed back.

A batch's host work (the user side and its folded tables, the match encoding, the answers) makes
numpy temporaries of a few megabytes and frees them. glibc's malloc gives freed memory at the top of
its heap back to the system once more than `M_TRIM_THRESHOLD` is free there, and serves large blocks
with their own mmap; so every batch took its pages from the system again, a page fault for every
4 KiB touched. On a 2-core host the GPU engine's host side of 64 requests took 2.2 to 2.7 ms that
way and 0.7 to 1.2 ms with the memory kept (docs/BENCHMARKS.md, "The served path"); how much a
process pays depends on what its heap held before (a process that loaded a whole corpus first may
not pay at all), which made figures move between processes doing the same work.

`keep_freed_memory()` raises both thresholds with `mallopt`, once per process: the serving entry
points, every `andromeda` command and the measuring scripts call it, so that a ratio of two figures
never compares two allocators. It does nothing where the C library is not glibc, and nothing when
the environment sets either threshold (`MALLOC_TRIM_THRESHOLD_`, `MALLOC_MMAP_THRESHOLD_`), which
then rules.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD = 256 << 20  # free memory kept at the heap's top before any is handed back
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks below it come from the heap
ENV_KEYS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")

_state: dict[str, object] = {}


def keep_freed_memory() -> bool:
    """Keep freed memory in the process (module docstring). True when the thresholds are set (now or
    by an earlier call), False where they cannot be or the environment sets them."""
    if "kept" in _state:
        return bool(_state["kept"])
    _state["kept"] = kept = _set()
    return kept


def _set() -> bool:
    if not sys.platform.startswith("linux") or any(os.environ.get(key) for key in ENV_KEYS):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1


__all__ = ["keep_freed_memory"]
