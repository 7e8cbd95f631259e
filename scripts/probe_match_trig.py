"""Probe: what the float64 great-circle test costs the GPU match kernel (registers, local memory, time).

An experiment for docs/GPU_INDEX.md's first lead, not a product path. It times match kernel v5 (the
lab's; shipped when the probe was made, hence the variant's name) on a tiled pool in separate processes: as shipped ("shipped"); with
`andromeda_nb.geo.haversine_km` replaced before the kernels compile by a trig-free stand-in, an
equirectangular distance ("stub": wrong answers for ads with custom locations, so that run is timed
but not checked); and as shipped but compiled with at most 64 registers per thread ("maxreg64":
the same code, so the same answers). The point is registers per thread, occupancy and kernel time.
Run on a GPU machine from the repository root:

    PYTHONPATH=. python3 scripts/probe_match_trig.py [--pool 10000000] [--out probe.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile


def _stand_in_km(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    dy = lat2 - lat1
    dx = lon2 - lon1
    return 111.195 * (dx * dx + dy * dy) ** 0.5


def measure(pool: int, base_ads: int, batches: list[int], variant: str) -> dict:
    stub = variant == "stub"
    if stub:
        import andromeda_nb.geo as geo

        geo.haversine_km = _stand_in_km  # before gpu.kernels.match builds its device function
    import numpy as np

    from andromeda_nb.devices import resolve

    resolve("gpu")
    from andromeda_nb.compiled import encode_request
    from benchmarks.tiling import generate_base
    from andromeda_nb.versions import Version
    from gpu import runtime
    from benchmarks.match import build_tiled_index, time_kernel
    from gpu.lab import match as K

    cuda = runtime.cuda()
    version = K.VERSIONS[5]  # the great-circle kernel the probe was made for
    if variant == "maxreg64":  # its recipe, compiled again with the register cap
        version = Version(5, "maxreg64", "v5 with at most 64 registers",
                          K.batched_kernel("match_probe_maxreg64", K.WIDE, "shuffle", max_registers=64), gpu_only=True)
    base = generate_base(base_ads, 256, 7)
    index = build_tiled_index(base.compiled, max(1, pool // len(base.ads)), version=version)
    out = {"variant": variant, "ads": len(index), "version": index.version, "timings": []}
    for b in batches:
        enc = [encode_request(base.requests[i % len(base.requests)]) for i in range(b)]
        batch = index.prepare(enc, version)
        words = index.new_output(b)
        t = time_kernel(cuda, lambda: index.run(batch, words, version))
        host = words.copy_to_host()
        out["timings"].append({"batch": b, "ms": t["median_s"] * 1e3,
                               "pool_ads_per_s": b * len(index) / t["median_s"],
                               "eligible_bits": int(np.unpackbits(host.view(np.uint8)).sum()),
                               "answer_sha256": hashlib.sha256(host.tobytes()).hexdigest()[:16]})
    kernel = index.kernel_version.recipe.kernel
    out["regs"] = kernel.get_regs_per_thread()
    out["local_bytes"] = kernel.get_local_mem_per_thread()
    out["regs"] = list(out["regs"].values()) if isinstance(out["regs"], dict) else out["regs"]
    out["local_bytes"] = list(out["local_bytes"].values()) if isinstance(out["local_bytes"], dict) else out["local_bytes"]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pool", type=int, default=10_000_000)
    parser.add_argument("--base-ads", type=int, default=8192)
    parser.add_argument("--batches", default="1,256")
    parser.add_argument("--out", default=None)
    parser.add_argument("--variants", default="shipped,stub,maxreg64")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # child process: one variant
    args = parser.parse_args(argv)
    batches = [int(x) for x in args.batches.split(",")]
    if args.one:
        print(json.dumps(measure(args.pool, args.base_ads, batches, args.one)))
        return 0
    results = []
    for which in args.variants.split(","):
        with tempfile.TemporaryDirectory() as cache:  # numba's cache must not hand one run's code to the other
            env = {**os.environ, "NUMBA_CACHE_DIR": cache}
            done = subprocess.run([sys.executable, __file__, "--one", which, "--pool", str(args.pool),
                                   "--base-ads", str(args.base_ads), "--batches", args.batches],
                                  env=env, capture_output=True, text=True)
            if done.returncode:
                print(done.stderr[-3000:], file=sys.stderr)
                return done.returncode
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), flush=True)
    if args.out:
        from andromeda_nb.provenance import script_command, write_result

        write_result({"probe": "match kernel: as shipped, with a trig-free circle stand-in, with at most 64 registers",
                      "runs": results}, args.out, command=script_command("probe_match_trig.py", argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
