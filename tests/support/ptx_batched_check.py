"""Compile the batched tensor-core scoring kernel (gpu/lab/score_batched.py) for sm_90 with
numba.cuda.compile_ptx, with no GPU and without the simulator (run as a subprocess by
tests/gpu/test_score_batched.py). Arguments: PRECISION:D:MODE[:MAX_REGISTERS[:SELECT]] cases (E = 6, top 2; MAX_REGISTERS 0: unlimited,
SELECT warp or block). Prints one JSON
line per kernel: the number of mma.sync instructions and the number expected, float64 use, local
memory, and, where `ptxas` is on PATH, what it reports for sm_90 (registers, spill bytes, shared
memory). An older ptxas than the PTX ISA numba's NVVM writes refuses the `.version` line alone; the
kernels use no instruction newer than PTX 8.0, so the line is lowered to what that ptxas names.
ptxas refuses static shared memory past 48 KiB ("too much shared data", its errors are listed) where
the driver's JIT of the same PTX has loaded the shipped wide walk's 65 KiB on the H100 and H200 runs:
the registers and spills it reports are read either way."""

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from numba import cuda, types

from gpu.lab.ptx import pretend_sm90

pretend_sm90()  # device functions ask the current device for its compute capability: there is none

from gpu.kernels import score_mma as sm  # noqa: E402
from gpu.lab import score_batched as sb  # noqa: E402

T = types
KERNEL_SIG = (T.uint32[::1], T.float32[::1], T.int32[::1], T.uint32[:, ::1], T.float32[:, :, ::1], T.uint32[::1],
              T.float32[:, ::1], T.int32, T.int32, T.uint32[:, :, ::1], T.int32[:, :, ::1])


def ptxas_report(ptx: str, max_registers: int | None = None) -> dict | None:
    """ptxas -v for sm_90 on `ptx` (with -maxrregcount as the kernel's `max_registers` option asks):
    {registers, spill_bytes, shared_bytes, errors}; None without ptxas."""
    exe = shutil.which("ptxas")
    if exe is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.ptx"
        path.write_text(ptx)
        cmd = [exe, "-arch=sm_90", "-v", str(path), "-o", str(Path(tmp) / "k.cubin")]
        if max_registers:
            cmd[1:1] = ["-maxrregcount", str(max_registers)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        newest = re.search(r"current version is '(\d+\.\d+)'", proc.stderr)
        if proc.returncode and newest:
            path.write_text(re.sub(r"^\.version \S+", f".version {newest.group(1)}", ptx, count=1, flags=re.M))
            proc = subprocess.run(cmd, capture_output=True, text=True)
    text = proc.stderr
    regs = re.search(r"Used (\d+) registers", text)
    smem = re.search(r"(\d+) bytes smem", text)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", text)]
    errors = [ln.split(":", 1)[1].strip()[-160:] for ln in text.splitlines() if ln.startswith("ptxas error")]
    return {"registers": int(regs.group(1)) if regs else None, "spill_bytes": sum(spills),
            "shared_bytes": int(smem.group(1)) if smem else 0, "errors": errors}


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
