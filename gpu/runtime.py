"""numba.cuda for the GPU modules, imported only after the device choice.

The simulator must be chosen before `numba.cuda` is first imported (numba reads
NUMBA_ENABLE_CUDASIM then), so every GPU module imports `numba.cuda` only through `cuda()` below,
after `andromeda_nb.devices.resolve` has chosen where the work runs.
"""

from __future__ import annotations

import importlib
import os

from andromeda_nb.devices import simulator_enabled  # the kernels ask it too: simulator or GPU code

from . import _compat  # noqa: F401


def cuda():
    """The numba.cuda module, imported after the device choice. On a real device the project's
    compile-cache locator is installed for CUDA kernels too (andromeda_nb.jitcache); under the
    simulator, `gpu.simulator`'s repairs are."""
    module = importlib.import_module("numba.cuda")
    quiet_launch_heuristics()
    if simulator_enabled():
        from . import simulator

        simulator.install()  # one shared array per block, and fresh memory full of garbage
    else:
        from andromeda_nb import jitcache

        jitcache.install(cuda=True)
    return module


LOW_OCCUPANCY_ENV = "NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS"


def quiet_launch_heuristics() -> bool:
    """Turn off numba's "Grid size N will likely result in GPU under-utilization" warning, unless the
    user set NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS: the project's small grids are chosen (one request's
    final top-K, a batch's table preparation), and a demo's or a server's terminal is for its own
    lines. Returns whether the warning is now off."""
    if LOW_OCCUPANCY_ENV in os.environ:
        return False
    from numba.cuda.core import config

    config.CUDA_LOW_OCCUPANCY_WARNINGS = 0
    return True


def kept_rows(need: int, have: int = 0) -> int:
    """Rows for buffers a serving loop keeps across batches of changing sizes: `have` while it holds
    `need`, else the power of two at or above `need`, so a few sizes ever get allocated and every
    batch uses the first rows of what is kept."""
    need = max(1, need)
    return have if have >= need else 1 << (need - 1).bit_length()


def has_tensor_cores() -> bool:
    """Whether the kernels run where `mma.sync` m16n8k16 with fp16 inputs exists: a device of compute
    capability 8.0 or newer, or the simulator (where `gpu.kernels.mma` emulates it)."""
    if simulator_enabled():
        return True
    try:
        return tuple(cuda().get_current_device().compute_capability) >= (8, 0)
    except Exception:  # no usable device: nothing to run on, so no tensor cores either
        return False


class DeviceClock:
    """Device seconds between marks on a stream, summed over a service's launches: its GPU busy time.

    `start(stream)` and `stop(stream)` record CUDA events around a group of launches; `settle()`, once
    the stream has been synchronized, adds their elapsed time. Under the simulator nothing is timed
    (`seconds` stays None): its kernels run on the host and their time says nothing of a device."""

    def __init__(self):
        self.seconds: float | None = None if simulator_enabled() else 0.0
        self._events = None
        self._open = False

    def start(self, stream=0) -> None:
        if self.seconds is None:
            return
        if self._events is None:
            self._events = (cuda().event(timing=True), cuda().event(timing=True))
        self._events[0].record(stream)
        self._open = True

    def stop(self, stream=0) -> None:
        if self._open:
            self._events[1].record(stream)

    def done(self) -> bool:
        """Whether the device has passed the last stop mark, without waiting (True with no span open, and
        under the simulator, whose launches have run when they return)."""
        return not self._open or self._events[1].query()

    def settle(self) -> None:
        """Add the last start-stop span (the stream it was recorded on must have been synchronized)."""
        if self._open:
            self._events[1].synchronize()
            self.seconds += cuda().event_elapsed_time(*self._events) / 1e3
            self._open = False
