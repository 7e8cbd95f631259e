"""The plumbing every benchmark shares (DESIGN section 7), written once: progress lines on stderr,
timing as the median of repetitions after a warm-up, the copy-bandwidth arithmetic, the environment
stamp of a result, and writing the JSON result.

The benchmarks themselves live with what they measure (`cpu_baseline/bench.py`, `gpu/bench_match.py`,
`gpu/bench_score.py`); each times with the clock of its device (the host clock, CUDA events) and
reports through these functions, so every figure is made and written the same way.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from typing import Callable

import numpy as np


def log(progress: bool, *parts) -> None:
    """A progress line on stderr when `progress` is on (results go to stdout or a file)."""
    if progress:
        print(*parts, file=sys.stderr, flush=True)


def median_seconds(fn: Callable[[], object], repeat: int, *, clock=time.perf_counter, warmup: int = 0) -> float:
    """Median seconds of `repeat` calls of `fn` after `warmup` untimed ones, by `clock`: the wall clock
    by default, or `time.process_time`, the CPU time of this process (which other processes sharing
    the cores do not inflate)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t = clock()
        fn()
        times.append(clock() - t)
    return float(np.median(times))


def repeat_timed(timed_once: Callable[[], float], *, min_reps: int, max_reps: int, budget_s: float) -> dict:
    """Repeat `timed_once` (which runs the work once and returns its seconds) at least `min_reps`
    times and until `budget_s` seconds are spent or `max_reps` reached. Returns {"median_s", "min_s",
    "reps"}. A clock that reads zero (the CUDA simulator has none) stops after one repetition."""
    times: list[float] = []
    while len(times) < max_reps and (len(times) < min_reps or sum(times) < budget_s):
        times.append(timed_once())
        if times[-1] <= 0:
            break
    return {"median_s": statistics.median(times), "min_s": min(times), "reps": len(times)}


def copy_bandwidth(nbytes: int, seconds: float) -> float:
    """Bytes per second of a copy of `nbytes` that took `seconds`, counting read + write (DESIGN
    section 7: the ceiling every kernel's bytes are compared with)."""
    return 2 * nbytes / seconds


def software() -> dict:
    """The versions every result records: Python, numpy, numba."""
    import numba

    return {"python": platform.python_version(), "numpy": np.__version__, "numba": numba.__version__}


def package_version(name: str) -> str | None:
    """An installed distribution's version, None when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def write_json(result: dict, path) -> None:
    """A benchmark result as indented JSON (numpy scalars written as floats), newline-terminated."""
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=float)
        f.write("\n")


__all__ = ["copy_bandwidth", "log", "median_seconds", "package_version", "repeat_timed", "software", "write_json"]
