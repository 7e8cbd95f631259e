"""Where the co-located path runs: a real GPU, the CUDA simulator, or the CPU.

The simulator must be chosen before `numba.cuda` is first imported (numba reads
NUMBA_ENABLE_CUDASIM then), so every GPU module imports `numba.cuda` only through `cuda()` below,
after `select()` has run.
"""

from __future__ import annotations

import importlib
import os
import sys

from . import _compat  # noqa: F401

DEVICES = ("auto", "gpu", "sim", "cpu")


def simulator_enabled() -> bool:
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


def _enable_simulator() -> None:
    if simulator_enabled():
        return
    if "numba.cuda" in sys.modules:
        raise RuntimeError(
            "the CUDA simulator must be chosen before numba.cuda is imported; "
            "set NUMBA_ENABLE_CUDASIM=1 in the environment instead"
        )
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    from numba.core import config

    config.reload_config()


def gpu_usable() -> bool:
    """True when a real CUDA GPU is present and the simulator is off."""
    if simulator_enabled():
        return False
    try:
        from numba import cuda as _cuda

        return bool(_cuda.is_available())
    except Exception:  # driver missing or broken: not usable
        return False


def select(device: str = "auto") -> str:
    """Resolve `device` to 'gpu', 'sim' or 'cpu' and prepare numba for it."""
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; choose from {', '.join(DEVICES)}")
    if device == "auto":
        if simulator_enabled():
            return "sim"
        return "gpu" if gpu_usable() else "cpu"
    if device == "sim":
        _enable_simulator()
        return "sim"
    if device == "gpu":
        if not gpu_usable():
            raise RuntimeError("no usable CUDA GPU (numba.cuda.is_available() is False)")
        return "gpu"
    return "cpu"


def cuda():
    """The numba.cuda module, imported after the device choice."""
    return importlib.import_module("numba.cuda")
