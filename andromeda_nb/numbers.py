"""How figures are written in every table and report, so that the same quantity reads the same way
wherever it appears (`andromeda compare`, the demo, the benchmark tables):

    rate(9.24e6, "ads/s")  '9.24 M ads/s'  per-second rates with an SI prefix, three significant digits
    duration(0.0037)     '3.70 ms'     seconds in s, ms or µs
    duration(0)          'below the clock's resolution'   never a zero or negative time
    spread([...])        '185 (147 to 201 over 5 runs)'    a median and the range around it

A time that is not above zero is not a measurement: `duration` says so, and `andromeda_nb.measure`
refuses to turn one into a figure.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

UNRESOLVED = "below the clock's resolution"
_PREFIXES = (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3))


def _three(x: float) -> str:
    """Three significant digits without an exponent: 9.24, 92.4, 924."""
    if x == 0:
        return "0"
    digits = max(0, 2 - int(math.floor(math.log10(abs(x)))))
    return f"{x:.{digits}f}"


def rate(per_second: float, unit: str = "") -> str:
    """A rate with an SI prefix, then the unit if given: rate(9.24e6, "ads/s") is '9.24 M ads/s',
    rate(9.24e6) is '9.24 M', rate(185.0) is '185'."""
    text = "n/a"
    if math.isfinite(per_second):
        text = _three(per_second)
        for prefix, scale in _PREFIXES:
            if abs(per_second) >= scale:
                text = f"{_three(per_second / scale)} {prefix}"
                break
    return f"{text} {unit}".replace("  ", " ") if unit else text


def duration(seconds: float | None) -> str:
    """Seconds in s, ms or µs with three significant digits; a time not above zero (a clock that
    cannot resolve the work, or none at all) is said in words."""
    if seconds is None or not math.isfinite(seconds) or seconds <= 0:
        return UNRESOLVED
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{_three(seconds / scale)} {unit}"
    return f"{_three(seconds / 1e-9)} ns"


def spread(values: Sequence[float], show: Callable[[float], str] = _three) -> str:
    """The median of repeated figures and their range: '185 (147 to 201 over 5 runs)'."""
    ordered = sorted(values)
    if not ordered:
        return "n/a"
    n = len(ordered)
    median = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    return spread_summary({"median": median, "min": ordered[0], "max": ordered[-1], "runs": n}, show)


def spread_summary(summary: dict, show: Callable[[float], str] = _three) -> str:
    """`spread`'s text from a summary {"median", "min", "max", "runs"} (`andromeda_nb.measure.spread_of`)."""
    if summary["runs"] < 2:
        return f"{show(summary['median'])} (one run)"
    return f"{show(summary['median'])} ({show(summary['min'])} to {show(summary['max'])} over {summary['runs']} runs)"


__all__ = ["UNRESOLVED", "duration", "rate", "spread", "spread_summary"]
