"""Compiling kernels for sm_90 where there is no GPU (`numba.cuda.compile_ptx`, with libNVVM), and
reading what the CUDA toolkit's assembler makes of them. A device function called from a kernel is
compiled for the current device's compute capability, and without a device numba cannot name one, so
`pretend_sm90()` names the H100's for it. `assemble` runs `ptxas -v` for sm_90 on a kernel's PTX
and reads its registers, spills, stack and static shared memory. Used by the PTX checks
(tests/support/ptx_*check.py) and scripts/sass_resources.py, each in a process of its own that runs
neither on a GPU nor under the simulator."""

from __future__ import annotations

import re
import subprocess
import types
from pathlib import Path

SM90 = (9, 0)


def pretend_sm90() -> None:
    """Make numba's compiler answer (9, 0) when it asks the current device's compute capability."""
    import numba.cuda.dispatcher as dispatcher  # (importing `gpu` applied its numpy shim already)

    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=SM90)


_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_SHARED = re.compile(r"\.shared\s+\.align\s+\d+\s+\.b8\s+\S+\[(\d+)\]")
_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?")
_NEWER = re.compile(r"Unsupported \.version ([\d.]+); current version is '([\d.]+)'")


class PtxTooNew(Exception):
    """libNVVM wrote a PTX version this ptxas does not read."""


def parse_ptxas(text: str) -> dict:
    """The figures of one entry function from `ptxas -v`'s report (its only entry)."""
    props, used = _PROPS.search(text), _USED.search(text)
    if props is None or used is None:
        raise ValueError(f"ptxas -v printed no resource lines: {text.strip()[:300]!r}")
    return {"registers": int(used.group(1)), "stack_frame_bytes": int(props.group(1)),
            "spill_store_bytes": int(props.group(2)), "spill_load_bytes": int(props.group(3)),
            "static_smem_bytes": int(used.group(3) or 0)}


def static_shared_bytes(ptx: str) -> int:
    """The bytes of the PTX's `.shared` arrays (numba declares each `cuda.shared.array` as one)."""
    return sum(int(n) for n in _SHARED.findall(ptx))


def ptxas_version(ptxas: str) -> str:
    out = subprocess.run([ptxas, "--version"], capture_output=True, text=True, check=False).stdout
    found = re.search(r"release ([\d.]+), V([\d.]+)", out)
    return found.group(2) if found else out.strip().splitlines()[-1]


def assemble(ptxas: str, ptx: str, max_registers: int | None, work: Path, *, lower_version: bool = False) -> dict:
    """`ptxas -v` for sm_90 on `ptx` (in the folder `work`), at `-maxrregcount` as the kernel's
    `max_registers` asks: `parse_ptxas`'s figures, the static shared memory counted from the PTX. A PTX
    newer than the ptxas reads raises PtxTooNew, or with `lower_version` has its `.version` line
    lowered to the ptxas's (for kernels that use no instruction newer than that)."""
    src = Path(work) / "kernel.ptx"
    # -c (relocatable): a whole program is refused by this ptxas past 48 KB of static shared memory,
    # which the kernels take and the driver's JIT accepts; the shared memory is counted from the PTX
    cmd = [ptxas, "-arch=sm_90", "-c", "-v", str(src), "-o", str(Path(work) / "kernel.o")]
    if max_registers:
        cmd[1:1] = [f"-maxrregcount={max_registers}"]
    src.write_text(ptx)
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    newer = _NEWER.search(done.stderr)
    if newer and lower_version:
        src.write_text(re.sub(r"^\.version \S+", f".version {newer.group(2)}", ptx, count=1, flags=re.M))
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    elif newer:
        raise PtxTooNew(f"this ptxas reads PTX up to {newer.group(2)}, libNVVM wrote {newer.group(1)}: install the "
                        "libNVVM of the ptxas's CUDA release (e.g. nvidia-nvvm==13.0.* for ptxas 13.0), or a newer ptxas")
    if done.returncode != 0:
        raise RuntimeError(f"ptxas failed: {done.stderr.strip()[-600:]}")
    return {**parse_ptxas(done.stdout + done.stderr), "static_smem_bytes": static_shared_bytes(ptx)}
