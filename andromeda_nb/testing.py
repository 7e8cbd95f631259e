"""Test support, the way `numba.cuda.testing` is: the random data of `andromeda_nb.random_specs` under
the names the tests use, the device the tests' kernels run on, and how many examples the drawn tests
take. No product module imports this one (tests/test_layers.py keeps it so)."""

from __future__ import annotations

import os

from . import random_specs
from .random_specs import *  # noqa: F401,F403  (the tests' random ads, requests, updates and strategies)
from .random_specs import __all__ as _random_specs
from .updates import update_to_json

# the device the tests' kernels run on: the real GPU when the suite runs with ANDROMEDA_TEST_GPU=1,
# else the CUDA simulator (which tests/conftest.py chooses before numba.cuda is imported)
KERNEL_DEVICE = "gpu" if os.environ.get("ANDROMEDA_TEST_GPU") == "1" else "sim"


def draw_scale() -> int:
    """How many times CI's fixed draw the drawn tests take: ANDROMEDA_DRAW_SCALE (pytest `--slow` sets
    10); above 1 the examples are drawn at random instead of CI's fixed draw."""
    return max(1, int(os.environ.get("ANDROMEDA_DRAW_SCALE", "1")))


def __getattr__(name: str):
    """Everything else of `random_specs` (its vocabularies, its generator's parts) under this name too."""
    return getattr(random_specs, name)


__all__ = [*_random_specs, "KERNEL_DEVICE", "draw_scale", "update_to_json"]
