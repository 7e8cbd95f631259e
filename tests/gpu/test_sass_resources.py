"""scripts/sass_resources.py: reading `ptxas -v`, the occupancy arithmetic, and, where libNVVM and a
ptxas are installed (not in CI), the shipped scoring kernel assembled for sm_90 within its register
cap with no spills, where v11 (the same walk at 80 registers) spills: the local memory Nsight Compute
counted in v11's runs (docs/BENCHMARKS.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpu.lab import ptx as lab_ptx
from tests.support.ptx import needs_nvrtc

ROOT = Path(__file__).resolve().parents[2]
ON_GPU = os.environ.get("ANDROMEDA_TEST_GPU") == "1"

REPORT = """ptxas info    : Overriding maximum register limit 256 for '_Z4k' with  80 of maxrregcount option
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z4k' for 'sm_90'
ptxas info    : Function properties for _Z4k
    176 bytes stack frame, 324 bytes spill stores, 252 bytes spill loads
ptxas info    : Used 80 registers, used 1 barriers
ptxas info    : Compile time = 270.1 ms
"""


@pytest.fixture(scope="module")
def sr():
    spec = importlib.util.spec_from_file_location("sass_resources", ROOT / "scripts" / "sass_resources.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ptxas_report_is_read(sr):
    assert lab_ptx.parse_ptxas(REPORT) == {"registers": 80, "stack_frame_bytes": 176, "spill_store_bytes": 324,
                                      "spill_load_bytes": 252, "static_smem_bytes": 0}
    with pytest.raises(ValueError, match="no resource lines"):
        lab_ptx.parse_ptxas("ptxas fatal   : Unsupported .version 9.5")
    ptx = (".visible .shared .align 4 .b8 _cudapy_smem_1[16384];\n.shared .align 8 .b8 s2[100];\n"
           ".visible .global .align 4 .b8 g[4096];\n")
    assert lab_ptx.static_shared_bytes(ptx) == 16484  # the global array is not shared memory


def test_a_ptx_newer_than_the_ptxas_is_named(sr, tmp_path):
    fake = tmp_path / "ptxas"
    fake.write_text("#!/bin/sh\necho \"ptxas fatal   : Unsupported .version 9.5; current version is '9.0'\" >&2\nexit 255\n")
    fake.chmod(0o755)
    with pytest.raises(lab_ptx.PtxTooNew, match=r"reads PTX up to 9.0, libNVVM wrote 9.5"):
        lab_ptx.assemble(str(fake), ".version 9.5\n", 128, tmp_path)


def test_blocks_an_sm_holds(sr):
    # 65,536 registers an SM, 256 threads a block: 80 registers give 3 blocks, 96 and 128 give 2
    assert [sr.blocks_by_registers(r, 256) for r in (80, 96, 121, 128, 255)] == [3, 2, 2, 2, 1]
    assert sr.blocks_by_registers(17, 32) == 32  # capped by the SM's 32 blocks
    # 228 KB an SM, 1 KB reserved a block
    assert [sr.blocks_by_shared(b) for b in (66688, 75000, 0)] == [3, 3, 32]
    assert sr.blocks_by_shared(114 * 1024) == 1


@pytest.mark.skipif(ON_GPU, reason="compiled by the GPU run itself")
@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas, a CUDA toolkit's assembler")
@needs_nvrtc
def test_the_shipped_kernel_fits_its_register_cap_without_spilling(tmp_path):
    from gpu.kernels.score import SHIPPED, VERSIONS

    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}  # compiles, so not simulated
    env["PYTHONPATH"] = str(ROOT)
    out = tmp_path / "counts.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "sass_resources.py"), "--versions", f"{SHIPPED},11",
                           "--precisions", "int8", "--out", str(out)], capture_output=True, text=True, env=env,
                          timeout=600, check=False)
    if done.returncode == 3:  # sass_resources.PTX_TOO_NEW: libNVVM newer than this ptxas
        pytest.skip(done.stderr.strip().splitlines()[-1])
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row["version"]: row for row in json.loads(out.read_text())["kernels"]}
    cap = VERSIONS[SHIPPED].recipe.max_registers
    assert rows[SHIPPED]["max_registers"] == cap and rows[SHIPPED]["registers"] <= cap
    assert rows[SHIPPED]["spill_store_bytes"] == rows[SHIPPED]["spill_load_bytes"] == 0, rows[SHIPPED]
    assert rows[11]["registers"] <= 80 and rows[11]["spill_store_bytes"] > 0, rows[11]  # the control: v11 spills
