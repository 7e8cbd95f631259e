"""How long a co-located engine takes from nothing to its first answer on a corpus, step by step: the
corpus's loading (`andromeda_nb.store.load_dataset`) and the engine's construction
(`migration.architectures.build_engine`), each step timed as the library says it ends (their `say`),
then the first batch of the corpus's requests answered (none with --requests 0: the simulator would
take hours over a large corpus). In one process, no server: what `serve
colocated` does before it listens, less its log replay and the Flight server. Steps go to stderr as
they end, the result as JSON to stdout (and `--out`).

    PYTHONPATH=. python3 scripts/time_startup.py --data DIR --device gpu --out FILE
    PYTHONPATH=. python3 scripts/time_startup.py --data DIR --device sim --requests 0
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from andromeda_nb.measure import write_json  # noqa: E402
from andromeda_nb.progress import to_stderr  # noqa: E402
from andromeda_nb.provenance import script_command, stamp  # noqa: E402


class Steps:
    """A `Say` that keeps every line with the seconds since the line before it (or since `start`)."""

    def __init__(self, stage: str, steps: list):
        self.stage, self.steps, self.t = stage, steps, time.perf_counter()

    def __call__(self, message: str) -> None:
        now = time.perf_counter()
        to_stderr(f"[{self.stage}] {message}")
        self.steps.append({"stage": self.stage, "step": message, "seconds": round(now - self.t, 3)})
        self.t = now


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="corpus directory")
    ap.add_argument("--device", default="gpu", help="the engine's device (gpu, sim, cpu, auto)")
    ap.add_argument("--layout", default=None, help="the GPU engine's slot order (default: its default)")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--requests", type=int, default=None,
                    help="requests of the first batch (default: a whole batch; 0: none, e.g. under the simulator)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from andromeda_nb.devices import resolve

    t0 = time.perf_counter()
    where = resolve(args.device)  # before anything imports numba.cuda
    from andromeda_nb.batching import BATCH_REQUESTS
    from andromeda_nb.store import load_dataset
    from migration.architectures import build_engine

    steps: list = []
    imports_s = time.perf_counter() - t0
    t = time.perf_counter()
    dataset = load_dataset(args.data, say=Steps("load", steps))
    load_s = time.perf_counter() - t
    t = time.perf_counter()
    engine = build_engine(dataset, where, layout=args.layout, say=Steps("build", steps))
    build_s = time.perf_counter() - t
    t = time.perf_counter()
    requests = dataset.requests[:BATCH_REQUESTS if args.requests is None else args.requests]
    answers = engine.retrieve(requests, args.k) if requests else []
    first_s = time.perf_counter() - t
    total_s = time.perf_counter() - t0
    to_stderr(f"imports {imports_s:.1f} s, load {load_s:.1f} s, build {build_s:.1f} s, first answer "
              f"({len(requests)} requests) {first_s:.1f} s: {total_s:.1f} s in all")
    out = {"kind": "startup_steps", "ads": dataset.n_ads, "device": engine.device,
           "imports_s": round(imports_s, 3), "load_s": round(load_s, 3), "build_s": round(build_s, 3),
           "first_answer_s": round(first_s, 3), "first_answer_requests": len(requests),
           "answered": sum(len(ids) > 0 for ids, _ in answers), "total_s": round(total_s, 3), "steps": steps}
    stamp(out, command=script_command("time_startup.py", argv if argv is not None else sys.argv[1:]))
    print(json.dumps(out))
    if args.out:
        write_json(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
