"""How long work tells a person how far it is, written once.

* `Say`: one line of progress (`say("loading 1,000,000 ads")`). Everything that reports lines takes a
  `Say` (or None for silence); lines go to stderr, since stdout holds a command's data.
* `Advance`: items just done (`advance(4096)`), for a progress bar that counts.

`say_of(progress)` turns what a caller gave into a `Say`: a `Say` as it is, True for stderr, False
or None for nothing (so a function can take `progress: bool | Say | None`). `Phases` says each step
of long work as it ends, with its seconds ("targeting.npz read and checked: 3.1 s").
"""

from __future__ import annotations

import sys
import time
from typing import Callable

Say = Callable[[str], None]
Advance = Callable[[int], None]


def to_stderr(message: str) -> None:
    """A `Say` that writes the line to stderr at once."""
    print(message, file=sys.stderr, flush=True)


def nowhere(message: str) -> None:
    """A `Say` that drops the line."""


def say_of(progress: bool | Say | None) -> Say:
    """The `Say` that `progress` stands for: itself when callable, else stderr when true, else nowhere."""
    if callable(progress):
        return progress
    return to_stderr if progress else nowhere


class Phases:
    """The steps of long work (loading a corpus, building an engine), each said as it ends with the
    seconds since the step before: `phases = Phases(say)`, then `phases.done("what was done")`."""

    def __init__(self, progress: "bool | Say | None"):
        self.say = say_of(progress)
        self._t = time.perf_counter()

    def done(self, what: str) -> None:
        now = time.perf_counter()
        self.say(f"{what}: {now - self._t:.1f} s")
        self._t = now


__all__ = ["Advance", "Phases", "Say", "nowhere", "say_of", "to_stderr"]
