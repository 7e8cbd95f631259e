"""Whether kernels can be compiled to PTX here without a GPU: numba-cuda's compile_ptx needs NVRTC, the
CUDA compiler, which the cu12 and cu13 extras install. The test extra does not (the simulator needs
numba-cuda alone), so on a machine without them the compile checks are skipped, saying why."""

from __future__ import annotations

import functools

import pytest


@functools.cache
def nvrtc_missing() -> str | None:
    """None when NVRTC loads, else why not (numba-cuda finds it the same way, through cuda.bindings)."""
    try:
        from cuda.bindings import nvrtc

        nvrtc.nvrtcVersion()
    except Exception as exc:  # not installed, or a library that does not load
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


needs_nvrtc = pytest.mark.skipif(
    nvrtc_missing() is not None,
    reason='compiles kernels to PTX with NVRTC, the CUDA compiler, not installed here: pip install -e ".[cu12]" '
           '(or ".[cu13]") brings it')
