"""The plumbing every benchmark shares (DESIGN section 7), written once: progress lines on stderr,
timing as the median of repetitions after a warm-up (never a reading that is not above zero:
`UnresolvedTiming`), the spread of repeated figures, the copy-bandwidth arithmetic, the environment
stamp of a result, and writing the JSON result.

The benchmarks themselves live with what they measure (`benchmarks/cpu.py`, `benchmarks/match.py`,
`benchmarks/score.py`); each times with the clock of its device (the host clock, CUDA events) and
reports through these functions, so every figure is made and written the same way.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from typing import Callable

import numpy as np

from .progress import Say, say_of


def log(progress: "bool | Say | None", *parts) -> None:
    """One progress line (`andromeda_nb.progress`): on stderr when `progress` is true, to `progress`
    itself when it is a `Say`, nowhere when it is false (results go to stdout or a file)."""
    say_of(progress)(" ".join(map(str, parts)))


class UnresolvedTiming(RuntimeError):
    """A clock read zero or less for one run: it cannot resolve the work (the CUDA simulator's event
    timer reads -1 ms for everything). No figure is made from such a reading."""


def _checked(seconds: float, clock_name: str) -> float:
    if not seconds > 0:
        raise UnresolvedTiming(f"the {clock_name} read {seconds * 1e3:.3f} ms for one run: it cannot resolve this "
                               "work, so no figure is made from it (time more work per run, or another clock)")
    return seconds


def timed_runs(fn: Callable[[], object], repeat: int, *, clock=time.perf_counter, warmup: int = 0) -> list[float]:
    """Seconds of each of `repeat` calls of `fn` after `warmup` untimed ones, by `clock` (the wall
    clock by default, or `time.process_time`, the CPU time of this process, which other processes
    sharing the cores do not inflate). Raises `UnresolvedTiming` for a reading not above zero."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t = clock()
        fn()
        times.append(_checked(clock() - t, getattr(clock, "__name__", "clock")))
    return times


def median_seconds(fn: Callable[[], object], repeat: int, *, clock=time.perf_counter, warmup: int = 0) -> float:
    """Median seconds of `timed_runs`."""
    return float(np.median(timed_runs(fn, repeat, clock=clock, warmup=warmup)))


def median_ms(fn: Callable[[], object], repeat: int, *, warmup: int = 1) -> float:
    """Median milliseconds of `timed_runs` (one untimed call first, by default)."""
    return 1e3 * median_seconds(fn, repeat, warmup=warmup)


def spread_of(values) -> dict:
    """{"median", "min", "max", "runs"} of repeated figures (a timing, a rate), for JSON beside the
    median every table prints."""
    values = [float(v) for v in values]
    return {"median": float(np.median(values)), "min": min(values), "max": max(values), "runs": len(values)}


def repeat_timed(timed_once: Callable[[], float], *, min_reps: int, max_reps: int, budget_s: float,
                 clock_name: str = "clock") -> dict:
    """Repeat `timed_once` (which runs the work once and returns its seconds) at least `min_reps`
    times and until `budget_s` seconds are spent or `max_reps` reached. Returns {"median_s", "min_s",
    "reps"}. A reading not above zero raises `UnresolvedTiming` (never a zero or negative figure)."""
    times: list[float] = []
    while len(times) < max_reps and (len(times) < min_reps or sum(times) < budget_s):
        times.append(_checked(timed_once(), clock_name))
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


def json_line(result: dict) -> str:
    """A result as one line of JSON (numpy scalars written as floats): what `--json` prints."""
    return json.dumps(result, default=float)


def write_json(result: dict, path) -> None:
    """A benchmark result as indented JSON (numpy scalars written as floats), newline-terminated: the
    file `--out` writes for `andromeda bench report`; stdout gets `json_line`. Missing folders above
    `path` are created."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=float)
        f.write("\n")


__all__ = ["UnresolvedTiming", "copy_bandwidth", "json_line", "log", "median_ms", "median_seconds",
           "package_version", "repeat_timed", "software", "spread_of", "timed_runs", "write_json"]
