"""Where a command's work runs: a real CUDA GPU, the CUDA simulator, or the CPU. The one place that
decides it: every command, server and benchmark resolves its `--device` here.

    resolve("auto")                 'gpu' when one is usable, else 'cpu' ('sim' when the simulator is on)
    resolve("auto", kernels=True)   for work that only runs as CUDA kernels (the GPU index): 'gpu' when
                                    one is usable, else the simulator ('cpu' means the simulator there)

The simulator must be chosen before `numba.cuda` is first imported (numba reads
NUMBA_ENABLE_CUDASIM then), so `prepare` sets it as early as a command can, and GPU modules import
`numba.cuda` only after the choice (`gpu.runtime.cuda`). numba and numba-cuda are dependencies of
the project; this module looks at them and at nothing of either architecture.
"""

from __future__ import annotations

import os
import sys

DEVICES = ("auto", "gpu", "sim", "cpu")
SIM_ENV = "NUMBA_ENABLE_CUDASIM"


def simulator_enabled() -> bool:
    return os.environ.get(SIM_ENV, "0") == "1"


def cuda_imported() -> bool:
    return "numba.cuda" in sys.modules


def prepare(device: str) -> None:
    """Choose the simulator for `--device sim` while that is still possible (nothing has imported
    numba.cuda yet); a command calls this before it loads anything."""
    if device == "sim" and not cuda_imported():
        os.environ[SIM_ENV] = "1"


def _enable_simulator() -> str:
    if simulator_enabled():
        return "sim"
    if cuda_imported():
        raise RuntimeError(
            "the CUDA simulator must be chosen before numba.cuda is imported; "
            f"set {SIM_ENV}=1 in the environment instead"
        )
    os.environ[SIM_ENV] = "1"
    from numba.core import config

    config.reload_config()
    return "sim"


def gpu_usable() -> bool:
    """True when a real CUDA GPU is present and the simulator is off."""
    if simulator_enabled():
        return False
    try:
        from numba import cuda as _cuda

        return bool(_cuda.is_available())
    except Exception:  # driver missing or broken: not usable
        return False


def _driver_present() -> bool:
    """A CUDA driver library or device node exists (checked without importing numba.cuda)."""
    import ctypes.util

    return bool(ctypes.util.find_library("cuda")) or os.path.exists("/dev/nvidiactl")


def resolve(device: str = "auto", *, kernels: bool = False) -> str:
    """'gpu', 'sim' or 'cpu' for `device` (one of DEVICES), with numba prepared for it.

    With `kernels` the work runs only as CUDA kernels, so the answer is never 'cpu': 'cpu' and an
    'auto' without a usable GPU become the simulator, chosen without probing for a GPU when no
    driver is installed (probing imports numba.cuda, after which the simulator cannot start)."""
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; choose from {', '.join(DEVICES)}")
    if kernels and device in ("auto", "cpu") and not simulator_enabled() and not cuda_imported():
        if device == "cpu" or not _driver_present():
            return _enable_simulator()
    if device == "auto":
        where = "sim" if simulator_enabled() else ("gpu" if gpu_usable() else "cpu")
    elif device == "sim":
        where = _enable_simulator()
    elif device == "gpu":
        if not gpu_usable():
            raise RuntimeError("no usable CUDA GPU (numba.cuda.is_available() is False)")
        where = "gpu"
    else:
        where = "cpu"
    if kernels and where == "cpu":
        try:
            where = _enable_simulator()
        except RuntimeError as exc:
            raise RuntimeError(f"no usable CUDA GPU, and the simulator cannot start now: {exc}") from None
    return where


__all__ = ["DEVICES", "cuda_imported", "gpu_usable", "prepare", "resolve", "simulator_enabled"]
