"""How long work tells a person how far it is, written once.

* `Say`: one line of progress (`say("loading 1,000,000 ads")`). Everything that reports lines takes a
  `Say` (or None for silence); lines go to stderr, since stdout holds a command's data.
* `Advance`: items just done (`advance(4096)`), for a progress bar that counts.

`say_of(progress)` turns what a caller gave into a `Say`: a `Say` as it is, True for stderr, False
or None for nothing (so a function can take `progress: bool | Say | None`).
"""

from __future__ import annotations

import sys
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


__all__ = ["Advance", "Say", "nowhere", "say_of", "to_stderr"]
