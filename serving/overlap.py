"""An engine's batches in steps, for a batcher that overlaps them (`serving.batcher.RequestBatcher`'s
`overlap`): the host's share of the next batch runs while the device answers the one before.

A served engine on a GPU runs its batches one after another: the batcher decodes a batch, the engine
prepares it on the host (encoding, the user side, the staging buffer), launches it and waits for its
answers, and the batcher encodes them; the device is idle while the host works, and the host waits
while the device works. An engine that can run a batch in steps (`begin(requests)` the host's share,
`launch(begun, k)` onto the device, `ready(launched)` whether its answers are in without waiting,
`fetch(launched)` its answers: `gpu.engine.GpuEngine`) lets the
batcher prepare batch i + 1 while batch i is on the device, as the engine itself does with the parts
of one long call.

`OverlappedBatches` holds the server's engine lock from the first step of a batch until no batch is
in flight (`release`), so an update (which takes the same lock) never lands between a batch's
preparation and its answers: the answers name the update sequence of their launch (`seq_of()` read
under the lock). An update that waits for the lock says so (`UpdatesLock`: `wanted()` meanwhile), and
the batcher then lands the batch in flight before the next, so updates wait for one batch at most.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager


def can_overlap(engine) -> bool:
    """Whether `engine` runs a batch in steps (`begin`, `launch`, `ready`, `fetch`, `max_batch`)."""
    return all(callable(getattr(engine, name, None)) for name in ("begin", "launch", "ready", "fetch")) and \
        hasattr(engine, "max_batch")


class OverlappedBatches:
    """The steps of `engine`'s batches under `lock` (module docstring). `seq_of()`: the update
    sequence the engine holds, read at each launch."""

    def __init__(self, engine, lock: threading.Lock, seq_of):
        if not can_overlap(engine):
            raise TypeError(f"{type(engine).__name__} does not run a batch in steps (begin, launch, ready, fetch)")
        self.engine, self.lock, self.seq_of = engine, lock, seq_of
        self._held = False  # by the batcher's thread, from a batch's first step until none is in flight
        self._waiting = 0  # updates waiting for the lock
        self._waiting_lock = threading.Lock()

    # --- the batcher's side (one thread) -------------------------------------------------------------
    def takes(self, n: int) -> bool:
        """Whether a batch of n requests is one launch (more: the engine's own call, in one piece)."""
        return n <= self.engine.max_batch

    def wanted(self) -> bool:
        """An update waits for the engine: land the batch in flight before the next."""
        return self._waiting > 0

    def prepare(self, requests, alone: bool = False):
        """The host's share of a batch (the engine's `begin`), the lock taken if not held. `alone`: no
        batch in flight ahead of it (the engine may then do its host work at the launch, beside its
        device work)."""
        if not self._held:
            self.lock.acquire()
            self._held = True
        return self.engine.begin(requests, alone=alone)

    def launch(self, begun, k: int):
        """(launched, seq): the prepared batch onto the device, and the update sequence it reflects."""
        return self.engine.launch(begun, k), self.seq_of()

    def ready(self, launched) -> bool:
        """Whether a launched batch's answers are ready (the engine's `ready`, no wait)."""
        return self.engine.ready(launched)

    def fetch(self, launched):
        """The answers of a launched batch, waited for."""
        return self.engine.fetch(launched)

    def release(self) -> None:
        """No batch in flight: the lock goes back (a no-op when not held)."""
        if self._held:
            self._held = False
            self.lock.release()

    # --- the updates' side -----------------------------------------------------------------------------
    @contextmanager
    def waiting(self):
        """Around an update's wait for the lock: meanwhile `wanted()`."""
        with self._waiting_lock:
            self._waiting += 1
        try:
            yield
        finally:
            with self._waiting_lock:
                self._waiting -= 1


class UpdatesLock:
    """`lock` as an update takes it: with `overlap` (an `OverlappedBatches`), counted as waiting until
    it holds the lock, so the batcher lands its batch in flight and lets go."""

    def __init__(self, lock: threading.Lock, overlap: OverlappedBatches | None = None):
        self.lock, self.overlap = lock, overlap

    def __enter__(self):
        if self.overlap is None:
            self.lock.acquire()
        else:
            with self.overlap.waiting():
                self.lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.lock.release()


__all__ = ["OverlappedBatches", "UpdatesLock", "can_overlap"]
