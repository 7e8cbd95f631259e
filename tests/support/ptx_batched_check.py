"""Compile the batched tensor-core scoring kernel (gpu/lab/score_batched.py) for sm_90 with
numba.cuda.compile_ptx, with no GPU and without the simulator (run as a subprocess by
tests/gpu/test_score_batched.py). Arguments: PRECISION:D:MODE[:MAX_REGISTERS[:SELECT]] cases (E = 6, top 2; MAX_REGISTERS 0: unlimited,
SELECT warp or block). Prints one JSON
line per kernel: the number of mma.sync instructions and the number expected, float64 use, local
memory, and, where `ptxas` is on PATH, what it reports for sm_90 (registers, spill bytes, shared
memory). An older ptxas than the PTX ISA numba's NVVM writes refuses the `.version` line alone; the
kernels use no instruction newer than PTX 8.0, so the line is lowered to what that ptxas names
(`gpu.lab.ptx.assemble`, which assembles relocatable code: a whole program is refused past 48 KiB of
static shared memory, which the driver's JIT of the same PTX loads, the shipped wide walk's 65 KiB on
the H100 and H200 runs)."""

import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

from numba import cuda, types

from gpu.lab.ptx import assemble, pretend_sm90, static_shared_bytes

pretend_sm90()  # device functions ask the current device for its compute capability: there is none

from gpu.kernels import score_mma as sm  # noqa: E402
from gpu.lab import score_batched as sb  # noqa: E402

T = types
KERNEL_SIG = (T.uint32[::1], T.float32[::1], T.int32[::1], T.uint32[:, ::1], T.float32[:, :, ::1], T.uint32[::1],
              T.float32[:, ::1], T.int32, T.int32, T.uint32[:, :, ::1], T.int32[:, :, ::1])


def ptxas_report(ptx: str, max_registers: int | None = None) -> dict | None:
    """ptxas -v for sm_90 on `ptx` (`gpu.lab.ptx.assemble`, its `.version` lowered to what the ptxas
    reads): {registers, spill_bytes, shared_bytes, errors}; None without ptxas."""
    exe = shutil.which("ptxas")
    if exe is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            got = assemble(exe, ptx, max_registers, Path(tmp), lower_version=True)
        except RuntimeError as exc:
            return {"registers": None, "spill_bytes": 0, "shared_bytes": static_shared_bytes(ptx),
                    "errors": [str(exc)[-160:]]}
    return {"registers": got["registers"], "spill_bytes": got["spill_store_bytes"] + got["spill_load_bytes"],
            "shared_bytes": got["static_smem_bytes"], "errors": []}


def main(cases):
    for case in cases:
        precision, dim, mode, *rest = case.split(":")
        regs = int(rest[0]) if rest and int(rest[0]) else None
        spec = sb.BatchedSpec(precision, int(dim), 6, 2, mode, max_registers=regs,
                              select=rest[1] if len(rest) > 1 else "block")
        ptx, _ = cuda.compile_ptx(sb.python_function(spec), KERNEL_SIG, cc=(9, 0))
        per_product = 1 if mode == "fast" else (3 if precision == "fp32" else 2)
        expected = 2 * (int(dim) // sm.K_STEP) * 2 * sm.n_gate_tiles(6) * per_product  # 2 m-tiles, one request
        print(json.dumps({"kernel": sb.kernel_source(spec).split("(")[0].split()[-1],
                          "mma": ptx.count("mma.sync.aligned.m16n8k16"), "mma_expected": expected,
                          "f64": bool(re.search(r"\.f64\b", ptx)), "local_memory": bool(re.search(r"\.local\b", ptx)),
                          "ptxas": ptxas_report(ptx, spec.max_registers)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
