"""Pin numpy's OpenBLAS to one thread while training.

The trainers multiply many small matrices; on a 2-core machine shared with other work, OpenBLAS's
threads spin and wait and make each step up to 10x slower, and a fixed thread count also fixes the
summation order, so a run repeats bit for bit. numpy's wheels ship OpenBLAS under a prefixed name
(`scipy_openblas_set_num_threads64_`); other builds are left as they are.
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
from pathlib import Path

import numpy as np

_SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads")
_GETTERS = ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads", "openblas_get_num_threads")


def _openblas():
    root = Path(np.__file__).resolve().parent
    for lib in sorted([*root.parent.glob("numpy.libs/*openblas*"), *root.glob(".libs/*openblas*")]):
        try:
            handle = ctypes.CDLL(str(lib))
        except OSError:
            continue
        setter = next((getattr(handle, s) for s in _SETTERS if hasattr(handle, s)), None)
        getter = next((getattr(handle, g) for g in _GETTERS if hasattr(handle, g)), None)
        if setter is not None and getter is not None:
            setter.argtypes = [ctypes.c_int]
            getter.restype = ctypes.c_int
            return setter, getter
    return None


@contextmanager
def blas_threads(count: int = 1):
    """Run the block with numpy's OpenBLAS limited to `count` threads (no-op where not found)."""
    found = _openblas()
    if found is None:
        yield
        return
    setter, getter = found
    before = getter()
    setter(count)
    try:
        yield
    finally:
        setter(before)
