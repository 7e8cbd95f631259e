"""Many callers at once, for the tests of what serves concurrent calls."""

from __future__ import annotations

import threading


def run_in_threads(target, n: int, timeout_s: float = 30.0) -> None:
    """`target(i)` for i in 0..n-1, each on a thread of its own, all started, then each joined (at most
    `timeout_s` each)."""
    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
