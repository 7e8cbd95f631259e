"""Test setup: GPU kernels run under the CUDA simulator unless ANDROMEDA_TEST_GPU=1 asks for the
real device (the H200 runs). Must run before anything imports numba.cuda.

`--slow` draws ten times the examples and steps of the drawn tests (ANDROMEDA_DRAW_SCALE=10), drawn
at random instead of CI's fixed draw; ANDROMEDA_DRAW_SCALE=N sets any multiple."""

import os

if os.environ.get("ANDROMEDA_TEST_GPU") != "1":
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import gpu._compat  # noqa: E402,F401


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="ten times the drawn examples and steps, drawn at random (ANDROMEDA_DRAW_SCALE=10)")


def pytest_configure(config):
    if config.getoption("--slow"):
        os.environ["ANDROMEDA_DRAW_SCALE"] = "10"

