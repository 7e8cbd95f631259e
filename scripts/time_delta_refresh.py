"""What a slice of updates costs the CPU engine: applying an upsert, and bringing the CPU index's delta
postings up to date after a slice (`CpuEngine.prepare`, which the co-located server runs after each
slice), with the delta holding `--delta` ads. A generated corpus of `--ads` ads; upserts replace every
field of existing ads, embeddings included, as `scripts/bench_update_stall.py` sends them. Medians of
`--rounds` slices of 1 and of 16 upserts.

    PYTHONPATH=. python3 scripts/time_delta_refresh.py --out FILE
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from andromeda_nb.measure import write_json  # noqa: E402
from andromeda_nb.provenance import script_command, stamp  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ads", type=int, default=20_000)
    ap.add_argument("--delta", type=int, default=2_000, help="ads upserted before timing (the delta's size)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from andromeda_nb.corpus import generate_corpus
    from andromeda_nb.store import load_dataset

    with tempfile.TemporaryDirectory(prefix="andromeda-refresh-") as tmp:
        generate_corpus(Path(tmp) / "c", args.ads, 16, args.seed)
        out = measure(load_dataset(Path(tmp) / "c"), args)
    stamp(out, command=script_command("time_delta_refresh.py", argv if argv is not None else sys.argv[1:]))
    print(json.dumps(out))
    if args.out:
        write_json(out, args.out)
    return 0


def measure(dataset, args) -> dict:
    from bench_update_stall import upsert_body

    from andromeda_nb.updates import parse_update
    from migration.architectures import build_engine

    m = dataset.model
    lines = upsert_body(dataset, args.delta + 17 * args.rounds, args.seed).split(b"\n")
    upserts = [parse_update(json.loads(line), seed=dataset.seed, dim=m.D, formats=m.F) for line in lines]
    engine = build_engine(dataset, "cpu")
    engine.retrieve(dataset.requests[:2], 100)  # compiled
    for update in upserts[: args.delta]:
        engine.apply(update)
    engine.prepare()
    out = {"ads": args.ads, "delta_ads": engine.index.describe()["delta_ads"], "rounds": args.rounds, "slices": {}}
    at = args.delta
    for size in (1, 16):
        apply_s, refresh_s = [], []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            for update in upserts[at : at + size]:
                engine.apply(update)
            t1 = time.perf_counter()
            engine.prepare()
            refresh_s.append(time.perf_counter() - t1)
            apply_s.append((t1 - t0) / size)
            at += size
        out["slices"][str(size)] = {"apply_ms_per_upsert": round(1e3 * statistics.median(apply_s), 4),
                                    "refresh_ms": round(1e3 * statistics.median(refresh_s), 4),
                                    "refresh_max_ms": round(1e3 * max(refresh_s), 4)}
    engine.close()
    return out


if __name__ == "__main__":
    raise SystemExit(main())
