"""Co-located architecture: GPU targeting index, fused scoring kernel, GPU top-K, Flight server."""

from . import _compat  # noqa: F401  (must run before numba.cuda compiles a kernel)
