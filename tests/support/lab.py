"""Parameter sets of the kernel lab's versions that the default simulated run leaves out: a lab kernel
measured slower than the shipped one keeps one case of each check by default; the device run and
`pytest --slow` run every case."""

from __future__ import annotations

import os

import pytest

from andromeda_nb.testing import KERNEL_DEVICE

FULL = KERNEL_DEVICE == "gpu" or os.environ.get("ANDROMEDA_DRAW_SCALE", "1") != "1"  # the device, or --slow


def lab_case(*values):
    """A parameter set run on the device and with --slow only."""
    return pytest.param(*values, marks=pytest.mark.skipif(not FULL, reason="a further case of a lab kernel: "
                                                                             "with --slow or on the device"))
