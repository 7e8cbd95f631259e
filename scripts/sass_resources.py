"""What the tensor-core scoring kernels cost in registers, spills and shared memory on sm_90, without a
GPU: each version's generated kernel compiled to PTX by numba-cuda (`numba.cuda.compile_ptx`, libNVVM),
then assembled by the CUDA toolkit's `ptxas -v` for sm_90 with the register limit the product launches
it with (`max_registers`, which numba hands the driver's JIT as its register cap, as `-maxrregcount`
does here). Reports per kernel: registers a thread, spill stores and loads (bytes a thread), stack
frame, static shared memory, and so how many blocks of 256 threads an H100 SM holds by registers and
by shared memory (228 KB an SM, 1 KB of it reserved a block).

Counts, not speeds: a spill's cost depends on how often its code runs (Nsight Compute counts the local
memory requests of a run). The ptxas here may be older or newer than the GPU driver's JIT, so the
counts are the toolkit's that the JSON names. Needs the `ptxas` command and libNVVM (numba-cuda's
`cu12`/`cu13` extra, or a CUDA toolkit).

    PYTHONPATH=. python3 scripts/sass_resources.py --versions 11,14,15,16 --precisions fp16,int8 \\
        --out docs/results/probes/sass_resources_sm90.json
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from andromeda_nb.measure import log  # noqa: E402
from andromeda_nb.provenance import finish_probe  # noqa: E402
from gpu.lab.ptx import PtxTooNew, assemble, ptxas_version  # noqa: E402

PTX_TOO_NEW = 3  # the exit status when the PTX is newer than the ptxas reads
REGISTERS_PER_SM = 65536  # sm_90: 64K 32-bit registers an SM
MAX_BLOCKS_PER_SM = 32
SMEM_PER_SM = 233472  # sm_90: 228 KB of shared memory an SM
SMEM_RESERVED_PER_BLOCK = 1024


def blocks_by_shared(smem: int) -> int:
    """Blocks an SM holds by its shared memory alone (each block's static shared memory and the 1 KB
    the system reserves a block)."""
    return min(MAX_BLOCKS_PER_SM, SMEM_PER_SM // (smem + SMEM_RESERVED_PER_BLOCK))


def blocks_by_registers(registers: int, threads: int) -> int:
    """Blocks of `threads` an SM holds by its register file alone (allocation in warps of 256
    registers-units: registers rounded up to a multiple of 8 a thread)."""
    per_thread = -(-registers // 8) * 8
    return min(MAX_BLOCKS_PER_SM, REGISTERS_PER_SM // (per_thread * threads))


def mma_specs(versions: list[int], precisions: list[str], dim: int, experts: int, top_e: int):
    """(version, MmaSpec) for each tensor-core version of the lab's table."""
    from gpu.kernels.score import TensorCoreRecipe
    from gpu.kernels.score_mma import MmaSpec
    from gpu.lab.score import VERSIONS

    for v in versions:
        if v not in VERSIONS:
            raise SystemExit(f"--versions: no scoring version {v} (known: {', '.join(map(str, sorted(VERSIONS)))})")
        recipe = VERSIONS[v].recipe
        if not isinstance(recipe, TensorCoreRecipe):
            raise SystemExit(f"--versions: v{v} is not a tensor-core kernel (only those are counted here)")
        for precision in precisions:
            yield v, MmaSpec(precision, dim, experts, top_e, "exact", max_registers=recipe.max_registers,
                             compact=recipe.compact, wide=recipe.wide, chunks=recipe.chunks,
                             request_major=recipe.request_major, warp_counts=recipe.warp_counts,
                             pooled=recipe.pooled)


def compile_ptx(spec) -> str:
    """The kernel's PTX for sm_90, with no GPU (device functions are told they run on one)."""
    from numba import cuda

    from gpu.lab.ptx import SM90, pretend_sm90

    pretend_sm90()
    from gpu.kernels import score_mma as sm

    ptx, _ = cuda.compile_ptx(sm.python_function(spec), sm.kernel_signature(), cc=SM90)
    return ptx


def nvvm_package() -> str:
    """The version of the PyPI package that brought libNVVM (nvidia-nvvm, cu13; nvidia-cuda-nvcc-cu12)."""
    from importlib import metadata

    for name in ("nvidia-nvvm", "nvidia-cuda-nvcc-cu12"):
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return "a CUDA toolkit's (no PyPI package)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--versions", default="11,14,15,16", help="lab scoring versions (tensor-core ones)")
    parser.add_argument("--precisions", default="fp16,int8")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--experts", type=int, default=6)
    parser.add_argument("--top-e", type=int, default=2)
    parser.add_argument("--ptxas", default=shutil.which("ptxas"), help="the ptxas to run (default: the PATH's)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not args.ptxas:
        raise SystemExit("needs the ptxas command (a CUDA toolkit) on the PATH, or --ptxas")
    from gpu.kernels.score_mma import THREADS

    versions = [int(v) for v in args.versions.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="andromeda-sass-") as tmp:
        for v, spec in mma_specs(versions, args.precisions.split(","), args.dim, args.experts, args.top_e):
            try:
                counts = assemble(args.ptxas, compile_ptx(spec), spec.max_registers, Path(tmp))
            except PtxTooNew as exc:
                print(f"sass_resources: {exc}", file=sys.stderr)
                return PTX_TOO_NEW
            except RuntimeError as exc:  # ptxas refused the kernel: its message
                print(f"sass_resources: v{v} {spec.precision}: {exc}", file=sys.stderr)
                return 1
            row = {"version": v, "precision": spec.precision, "max_registers": spec.max_registers, **counts,
                   "blocks_per_sm_by_registers": blocks_by_registers(counts["registers"], THREADS),
                   "blocks_per_sm_by_shared": blocks_by_shared(counts["static_smem_bytes"])}
            rows.append(row)
            log(True, f"v{v:<3d} {spec.precision:5s} cap {spec.max_registers or '-':>4}: {counts['registers']} "
                      f"registers, spills {counts['spill_store_bytes']} B stored / {counts['spill_load_bytes']} B "
                      f"loaded, stack {counts['stack_frame_bytes']} B, smem {counts['static_smem_bytes']} B, "
                      f"blocks an SM: {row['blocks_per_sm_by_registers']} by registers, {row['blocks_per_sm_by_shared']} by smem")
    result = {"target": "sm_90", "threads_per_block": THREADS, "dim": args.dim, "experts": args.experts,
              "top_e": args.top_e, "ptxas": ptxas_version(args.ptxas), "libnvvm": nvvm_package(), "kernels": rows}
    finish_probe(result, "sass_resources.py", sys.argv[1:] if argv is None else argv, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
