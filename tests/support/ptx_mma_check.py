"""Compile tensor-core scoring kernels for sm_90 with numba.cuda.compile_ptx, with no GPU and without
the simulator (run as a subprocess by tests/gpu/test_score_mma.py). Arguments: PRECISION:D:MODE cases
(E = 6, top 2), a fourth part "compact" for the compacted walk, "wide" for the wide one (then "rm", "wc", "pool", "free", "floor": request-major, warp counts, pooled rounds, the free walk, the running floor). Prints one JSON line per kernel, and one for the fragment preparation kernel:
the number of mma.sync instructions and the number expected, float64 use and local memory."""

import json
import re
import sys

from numba import cuda, types

from gpu.lab.ptx import pretend_sm90

pretend_sm90()  # device functions ask the current device for its compute capability: there is none

from gpu.kernels import score_mma as sm  # noqa: E402

T = types
PREP_SIG = (T.float32[:, :, ::1], T.int32[:, ::1], T.int32, T.int32, T.uint32[::1], T.float32[:, ::1])


def row(name, ptx, expected):
    return {"kernel": name, "mma": ptx.count("mma.sync.aligned.m16n8k16"), "mma_expected": expected,
            "f64": bool(re.search(r"\.f64\b", ptx)), "local_memory": bool(re.search(r"\.local\b", ptx))}


def main(cases):
    for case in cases:
        precision, dim, mode, *walk = case.split(":")
        spec = sm.MmaSpec(precision, int(dim), 6, 2, mode, compact=bool(walk), wide=walk[:1] == ["wide"],
                          request_major="rm" in walk, warp_counts="wc" in walk, pooled="pool" in walk,
                          free_at=sm.LIST_CAP if "free" in walk else 0, floor="floor" in walk)
        ptx, _ = cuda.compile_ptx(sm.python_function(spec), sm.kernel_signature(spec.floor), cc=(9, 0))
        per_product = 1 if mode == "fast" else (3 if precision == "fp32" else 2)
        expected = 2 * (int(dim) // sm.K_STEP) * 2 * sm.n_gate_tiles(6) * per_product  # 2 m-tiles
        print(json.dumps(row(sm.kernel_source(spec).split("(")[0].split()[-1], ptx, expected)), flush=True)
    if cases and cases[0].startswith("fp16:64"):
        ptx, _ = cuda.compile_ptx(sm.prep_tables.py_func, PREP_SIG, cc=(9, 0))
        print(json.dumps(row("prep_tables", ptx, 0)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
