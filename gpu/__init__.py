"""The co-located architecture on the device: GPU targeting index, fused scoring kernel, GPU top-K, the GPU
engine; `lab/` holds every kernel version."""

from . import _compat  # noqa: F401  (must run before numba.cuda compiles a kernel)
