"""Compatibility shims applied before numba-cuda compiles anything.

numba-cuda 0.30.x still refers to `numpy.row_stack`, which numpy 2.5 removed; every kernel compile
then fails with `AttributeError: module 'numpy' has no attribute 'row_stack'` (NVIDIA/numba-cuda
issue 907). `numpy.vstack` is the function `row_stack` always was an alias of, so restoring the alias
is exact. Installs of this project pin numpy below 2.5; the shim is for machines whose numpy is given.
"""

import numpy as np

if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack
