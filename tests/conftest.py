"""Test setup: GPU kernels run under the CUDA simulator unless ANDROMEDA_TEST_GPU=1 asks for the
real device (the H200 runs). Must run before anything imports numba.cuda."""

import os

if os.environ.get("ANDROMEDA_TEST_GPU") != "1":
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import gpu._compat  # noqa: E402,F401
