"""How long the GPU targeting index takes to build on the host from a compiled corpus: a corpus tiled
`--copies` times (`benchmarks.tiling.tile_compiled`), then `GpuTargetingIndex.from_compiled` with
the device under the simulator (so the figure is the host's layout work: term vocabulary, clause
programs, slots; the device upload is a copy in memory), with the five functions that took longest.

    PYTHONPATH=. python3 scripts/time_index_build.py --data DIR --copies 50 --out FILE
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from andromeda_nb.measure import software, write_json  # noqa: E402
from andromeda_nb.provenance import script_command, stamp  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="corpus directory (the base that is tiled)")
    ap.add_argument("--copies", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from andromeda_nb.devices import resolve

    resolve("sim")  # before numba.cuda is imported: the host's work alone is timed
    from andromeda_nb.store import load_dataset
    from benchmarks.tiling import tile_compiled
    from gpu.index import GpuTargetingIndex

    base = load_dataset(args.data).compiled
    t = time.perf_counter()
    pool = tile_compiled(base, args.copies)
    tile_s = time.perf_counter() - t
    profile = cProfile.Profile()
    t = time.perf_counter()
    profile.enable()
    index = GpuTargetingIndex.from_compiled(pool, device="sim")
    profile.disable()
    build_s = time.perf_counter() - t
    stats = pstats.Stats(profile)
    top = sorted(((v[2], f"{Path(k[0]).name}:{k[1]}({k[2]})") for k, v in stats.stats.items()), reverse=True)[:5]
    result = {"kind": "index_build_host", "base_ads": len(base), "copies": args.copies, "ads": len(index),
              "tile_s": round(tile_s, 3), "build_s": round(build_s, 3),
              "us_per_ad": round(build_s / len(index) * 1e6, 3),
              "top_self_seconds": [{"function": name, "seconds": round(sec, 3)} for sec, name in top],
              "software": software()}
    stamp(result, command=script_command("time_index_build.py", argv if argv is not None else sys.argv[1:]))
    print(json.dumps({k: result[k] for k in ("ads", "tile_s", "build_s", "us_per_ad")}))
    if args.out:
        write_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
