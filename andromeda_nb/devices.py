"""Where a command's work runs: a real CUDA GPU, the CUDA simulator, or compiled CPU code. The one
place that decides it: every command, server and benchmark resolves its `--device` here, and each
device word means one thing everywhere:

    gpu    a real CUDA GPU; an error when none is usable
    cpu    the same per-ad formula compiled for the CPU by numba; work that exists only as CUDA
           kernels (the GPU index) has no CPU form and says so (`NoKernelDevice`)
    sim    the CUDA simulator (numba's Python interpretation of the kernels: slow, for tiny data)
    auto   the GPU when one is usable, else compiled CPU code, with the fallback said once on stderr;
           work that exists only as CUDA kernels stops with `NoKernelDevice` naming `--device sim`

    resolve("auto")                 'gpu', else 'cpu'
    resolve("auto", kernels=True)   'gpu', else NoKernelDevice

The simulator runs only when it is asked for: `--device sim`, or numba's own switch
NUMBA_ENABLE_CUDASIM=1 set before the process started (the test suite does; 'auto' then means the
simulator it asked for). A command never switches it on behind the user's back, and the services a
command starts get their device as an argument with the switch removed from their environment
(`child_environment`), so nothing leaks into them.

The simulator must be chosen before `numba.cuda` is first imported (numba reads
NUMBA_ENABLE_CUDASIM then), so `prepare` sets it as early as a command can, and GPU modules import
`numba.cuda` only after the choice (`gpu.runtime.cuda`). Without a CUDA driver installed, `auto`
decides without importing numba.cuda at all. numba and numba-cuda are dependencies of the project;
this module looks at them and at nothing of either architecture.
"""

from __future__ import annotations

import os
import sys

from .progress import Say, to_stderr

DEVICES = ("auto", "gpu", "sim", "cpu")
SIM_ENV = "NUMBA_ENABLE_CUDASIM"
CPU_FALLBACK = "no usable CUDA GPU: --device auto runs on the CPU (the same per-ad formula compiled by numba)"


class NoKernelDevice(RuntimeError):
    """Work that exists only as CUDA kernels was asked to run where there are none (no usable GPU,
    or --device cpu). The message says what to do instead."""


def simulator_enabled() -> bool:
    return os.environ.get(SIM_ENV, "0") == "1"


def cuda_imported() -> bool:
    return "numba.cuda" in sys.modules


def prepare(device: str) -> None:
    """Choose the simulator for `--device sim` while that is still possible (nothing has imported
    numba.cuda yet); a command calls this before it loads anything."""
    if device == "sim" and not cuda_imported():
        os.environ[SIM_ENV] = "1"


def child_environment(env: dict | None = None) -> dict:
    """The environment for a process a command starts: this one's, without the simulator switch
    (the child is told its device as an argument, `--device sim` included)."""
    env = dict(os.environ if env is None else env)
    env.pop(SIM_ENV, None)
    return env


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


def _driver_present() -> bool:
    """A CUDA driver library or device node exists (checked without importing numba.cuda)."""
    import ctypes.util

    return bool(ctypes.util.find_library("cuda")) or os.path.exists("/dev/nvidiactl")


def gpu_usable() -> bool:
    """True when a real CUDA GPU is present and the simulator is off. Without a CUDA driver the
    answer is False without importing numba.cuda (so the simulator can still be chosen later)."""
    if simulator_enabled():
        return False
    if not cuda_imported() and not _driver_present():
        return False
    try:
        from numba import cuda as _cuda

        return bool(_cuda.is_available())
    except Exception:  # driver missing or broken: not usable
        return False


# --- notices: each fallback said once per process, on stderr -----------------------------------------

_said: set[str] = set()


notice_sink: Say = to_stderr  # where notices go (a command may redirect them)


def notice(message: str) -> None:
    """Say `message` once per process (a fallback, a device that was skipped)."""
    if message not in _said:
        _said.add(message)
        notice_sink(message)


def kernels_unavailable(device: str, what: str = "this work") -> str:
    """Why `what`, which exists only as CUDA kernels, cannot run on `device`, and what to ask instead."""
    if device == "cpu":
        why = "--device cpu: it has no CPU form"
    else:
        why = "no usable CUDA GPU here"
    return (f"{what} runs only as CUDA kernels, and {why}; give --device sim to run it under the CUDA "
            "simulator (slow: tiny corpora only)")


def require_gpu(what: str) -> str:
    """'gpu' when a real CUDA GPU is usable; else RuntimeError saying that `what` (work with no CPU or
    simulator form, and no --device to choose one) needs one, why there is none, and what to do."""
    if gpu_usable():
        return "gpu"
    why = ("the CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1)" if simulator_enabled()
           else "this machine has no usable CUDA GPU (numba.cuda.is_available() is False)")
    raise RuntimeError(f"{what} needs a CUDA GPU, and {why}; it has no CPU or simulator form: run it on a "
                       "machine with an NVIDIA GPU and the cu12 or cu13 extra installed")


SIMULATOR_SECONDS_PER_AD_REQUEST = 1e-4  # the GPU index under the simulator: one Python thread per ad and request


def simulator_note(n_ads: int, n_requests: int) -> str:
    """What --device sim costs for matching `n_ads` ads against `n_requests` requests, said before it starts."""
    seconds = n_ads * n_requests * SIMULATOR_SECONDS_PER_AD_REQUEST
    when = f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"
    return (f"--device sim: the CUDA simulator runs each kernel thread in Python, about 0.1 ms per ad and request "
            f"({n_ads:,} ads x {n_requests:,} requests: roughly {when})")


def resolve(device: str = "auto", *, kernels: bool = False, what: str = "this work") -> str:
    """'gpu', 'sim' or 'cpu' for `device` (one of DEVICES), with numba prepared for it.

    With `kernels` the work exists only as CUDA kernels (`what` names it in the error): the answer
    is 'gpu' or 'sim', and 'cpu', or an 'auto' without a usable GPU, raise `NoKernelDevice`. Without
    it an 'auto' without a usable GPU is 'cpu', said once on stderr. 'auto' is the simulator only
    when NUMBA_ENABLE_CUDASIM=1 was set before the process started."""
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; choose from {', '.join(DEVICES)}")
    if device == "sim":
        return _enable_simulator()
    if device == "gpu":
        if not gpu_usable():
            raise RuntimeError("--device gpu: no usable CUDA GPU (numba.cuda.is_available() is False)")
        return "gpu"
    if device == "cpu":
        if kernels:
            raise NoKernelDevice(kernels_unavailable("cpu", what))
        return "cpu"
    if simulator_enabled():  # numba's own switch, set by whoever started this process
        return "sim"
    if gpu_usable():
        return "gpu"
    if kernels:
        raise NoKernelDevice(kernels_unavailable("auto", what))
    notice(CPU_FALLBACK)
    return "cpu"


__all__ = ["CPU_FALLBACK", "DEVICES", "NoKernelDevice", "SIM_ENV", "child_environment", "cuda_imported",
           "gpu_usable", "kernels_unavailable", "notice", "prepare", "require_gpu", "resolve", "simulator_enabled",
           "simulator_note"]
