"""numba.cuda for the GPU modules, imported only after the device choice.

The simulator must be chosen before `numba.cuda` is first imported (numba reads
NUMBA_ENABLE_CUDASIM then), so every GPU module imports `numba.cuda` only through `cuda()` below,
after `andromeda_nb.devices.resolve` has chosen where the work runs.
"""

from __future__ import annotations

import importlib

from andromeda_nb.devices import simulator_enabled  # the kernels ask it too: simulator or GPU code

from . import _compat  # noqa: F401


def cuda():
    """The numba.cuda module, imported after the device choice. On a real device the project's
    compile-cache locator is installed for CUDA kernels too (andromeda_nb.jitcache)."""
    module = importlib.import_module("numba.cuda")
    if not simulator_enabled():
        from andromeda_nb import jitcache

        jitcache.install(cuda=True)
    return module
