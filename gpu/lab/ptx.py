"""Compiling kernels for sm_90 where there is no GPU (`numba.cuda.compile_ptx`, with libNVVM): a device
function called from a kernel is compiled for the current device's compute capability, and without a
device numba cannot name one, so `pretend_sm90()` names the H100's for it. Used by the PTX checks
(tests/support/ptx_*check.py) and scripts/sass_resources.py, each in a process of its own that runs
neither on a GPU nor under the simulator."""

from __future__ import annotations

import types

SM90 = (9, 0)


def pretend_sm90() -> None:
    """Make numba's compiler answer (9, 0) when it asks the current device's compute capability."""
    import numba.cuda.dispatcher as dispatcher  # (importing `gpu` applied its numpy shim already)

    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=SM90)
