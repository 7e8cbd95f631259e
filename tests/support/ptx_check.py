"""Compile every scoring and top-K kernel for sm_90 with numba.cuda.compile_ptx, with no GPU and
without the simulator (run as a subprocess by tests/gpu/test_score_kernels.py). Prints one JSON line per
kernel: name, seconds, and whether the PTX uses local memory."""

import json
import re
import sys
import time

from numba import cuda, types

from gpu.lab.ptx import pretend_sm90

pretend_sm90()  # device functions ask the current device for its compute capability: there is none

from gpu.kernels import gather, score, topk  # noqa: E402
from gpu.lab import score as score_lab  # noqa: E402

DT = {"fp32": types.float32, "fp16": types.float16, "int8": types.int8}


def score_signature(layout, precision):
    emb = DT[precision][:, ::1] if layout == "rows" else types.uint32[::1]
    return (emb, types.float32[::1], types.int32[::1], types.uint32[:, ::1], types.float32[:, :, ::1], types.int32,
            types.uint32[:, :, ::1], types.int32[:, :, ::1])


def report(name, fn, sig):
    t = time.time()
    ptx, _ = cuda.compile_ptx(fn, sig, cc=(9, 0))
    print(json.dumps({"kernel": name, "seconds": round(time.time() - t, 2),
                      "local_memory": bool(re.search(r"\.local\b", ptx)), "ptx_lines": ptx.count("\n")}), flush=True)


def main(argv):
    dim, experts, top_e = (int(x) for x in argv[1:4])
    versions = [int(v) for v in argv[4].split(",")]
    for v in versions:
        for kind in score.KINDS:
            for prec in ("fp32", "fp16", "int8"):
                version = score_lab.VERSIONS[v]
                spec = score.KernelSpec(version, kind, prec, dim, experts, top_e)
                fn, _ = score.python_function(spec)
                report(f"score_v{v}_{kind}_{prec}_d{dim}", fn, score_signature(version.recipe.layout, prec))
    if len(argv) > 5 and argv[5] == "no-topk":
        return
    cand = (types.uint32[:, :, ::1], types.int32[:, :, ::1], types.int32)
    for final, segment in (("final_topk_v1", "segment_topk_v2"), ("final_topk_v3", "segment_topk_v3")):
        report(final, getattr(topk, final).py_func,
               cand + (types.int64[::1], types.int32, types.uint32[:, ::1], types.int32[:, ::1], types.int64[:, ::1],
                       types.int64[:, ::1], types.float32[:, ::1], types.int32[::1]))
        report(segment, getattr(topk, segment).py_func,
               cand + (types.int32, types.int32, types.uint32[:, :, ::1], types.int32[:, :, ::1]))
    # the remote GPU scorer's gather family: candidate ids to rows, then one candidate per thread
    report("gather_resolve_rows", gather.resolve_rows.py_func,
           (types.int64[::1], types.int32[::1], types.int64[::1], types.int32[::1]))
    for prec in ("fp32", "fp16", "int8"):
        report(f"gather_score_rows_{prec}_e{experts}", gather.score_rows(experts).py_func,
               (DT[prec][:, ::1], types.float32[::1], types.int16[::1], types.int32[::1], types.float32[:, ::1],
                types.int32, types.float32[::1]))


if __name__ == "__main__":
    main(sys.argv)
