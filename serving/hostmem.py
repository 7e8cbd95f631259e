"""The C allocator of a process that serves or measures: freed memory kept, not handed back.

A batch's host work (the user side and its folded tables, the match encoding, the answers) makes
numpy temporaries of a few megabytes and frees them. glibc's malloc gives freed memory at the top of
its heap back to the system once more than `M_TRIM_THRESHOLD` is free there, and serves large blocks
with their own mmap; so every batch took its pages from the system again, a page fault for every
4 KiB touched. On a 2-core host the GPU engine's host side of 64 requests took 2.2 to 2.7 ms that
way and 0.7 to 1.2 ms with the memory kept (docs/BENCHMARKS.md, "The served path"); how much a
process pays depends on what its heap held before (a process that loaded a whole corpus first may
not pay at all), which made figures move between processes doing the same work.

`give_back_freed_memory()` undoes that once, after a large body (an update call of tens of
megabytes, or a call refused before it was served, whose body gRPC had already read whole): glibc's
`malloc_trim(0)` hands every free page back, so memory after a burst of large calls returns near
where it was instead of staying at the burst's peak (it stayed at 2.8 GB after four 400 MB calls).
`request_give_back()` asks for it from any thread: a thread of its own does it a moment later (the
call's buffers are freed when gRPC ends the call), at most once per `GIVE_BACK_EVERY_S`.

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
import threading
import time

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


GIVE_BACK_AFTER_S = 0.25  # how long after a request the free pages are handed back (the call's end frees them)
GIVE_BACK_EVERY_S = 1.0  # at most this often
GIVE_BACK_BODY_BYTES = 16 << 20  # an update body this large asks for it once its call is done


def give_back_freed_memory() -> bool:
    """Hand the free pages of every heap back to the system now (glibc's `malloc_trim(0)`); False
    where there is no glibc."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


class _GiveBack:
    """The thread that gives freed memory back a moment after it is asked, at most once a second."""

    def __init__(self):
        self.asked = threading.Event()
        self.count = 0  # times memory was given back (tests read it)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def request(self) -> None:
        self.asked.set()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="give-back-memory", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            self.asked.wait()
            time.sleep(GIVE_BACK_AFTER_S)
            self.asked.clear()
            give_back_freed_memory()
            self.count += 1
            time.sleep(GIVE_BACK_EVERY_S)


_give_back = _GiveBack()


def request_give_back() -> None:
    """Ask for the freed memory to be handed back shortly (module docstring); cheap, from any thread."""
    _give_back.request()


__all__ = ["GIVE_BACK_BODY_BYTES", "give_back_freed_memory", "keep_freed_memory", "request_give_back"]
