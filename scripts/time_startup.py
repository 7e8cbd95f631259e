"""How long a co-located engine takes from nothing to its first answer on a corpus, step by step: the
corpus's loading (`andromeda_nb.store.load_dataset`) and the engine's construction
(`migration.architectures.build_engine`), each step timed as the library says it ends (their `say`),
then the first batch of the corpus's requests answered (none with --requests 0: the simulator would
take hours over a large corpus), in parts: the requests encoded and their user-side tables folded
(each a first call of host code), the first `retrieve` (its kernels compiled or loaded from the
cache, its first launches), and a second `retrieve` of the same batch (warm: what remains is the
answer itself). Every step also says the seconds spent compiling (or loading from numba's on-disk
cache) host functions and CUDA kernels, and how many. In one process, no server: what `serve
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


class CompileTimes:
    """Seconds and calls of numba's `compile` (a compilation, or a load from the on-disk cache) of host
    functions and of CUDA kernels, outermost calls only (a kernel's device functions compile inside
    it), counted by wrapping the dispatchers' method: measurement only, no change to what runs."""

    def __init__(self):
        self.seconds = {"host": 0.0, "cuda": 0.0}
        self.calls = {"host": 0, "cuda": 0}
        self._depth = 0
        from numba.core.dispatcher import Dispatcher

        self._wrap(Dispatcher, "host")

    def wrap_cuda(self) -> None:
        """Also count CUDA kernels (after the device choice; nothing under the simulator)."""
        from andromeda_nb.devices import simulator_enabled

        if not simulator_enabled():
            from numba.cuda.dispatcher import CUDADispatcher

            self._wrap(CUDADispatcher, "cuda")

    def _wrap(self, cls, kind: str) -> None:
        original = cls.compile
        times = self

        def compile(dispatcher, sig):
            if times._depth:
                return original(dispatcher, sig)
            times._depth += 1
            t = time.perf_counter()
            try:
                return original(dispatcher, sig)
            finally:
                times._depth -= 1
                times.seconds[kind] += time.perf_counter() - t
                times.calls[kind] += 1

        cls.compile = compile

    def snapshot(self) -> tuple:
        return dict(self.seconds), dict(self.calls)

    def since(self, before: tuple) -> dict:
        seconds, calls = before
        return {f"{kind}_compile_s": round(self.seconds[kind] - seconds[kind], 3) for kind in seconds} | {
            f"{kind}_compiles": self.calls[kind] - calls[kind] for kind in calls}


class Steps:
    """A `Say` that keeps every line with the seconds since the line before it (or since `start`), and
    the compile seconds among them (`CompileTimes`)."""

    def __init__(self, stage: str, steps: list, compiles: CompileTimes):
        self.stage, self.steps, self.compiles = stage, steps, compiles
        self.t, self.before = time.perf_counter(), compiles.snapshot()

    def __call__(self, message: str) -> None:
        now = time.perf_counter()
        compiled = self.compiles.since(self.before)
        to_stderr(f"[{self.stage}] {message} (compiling: host {compiled['host_compile_s']:.1f} s, "
                  f"CUDA {compiled['cuda_compile_s']:.1f} s)")
        self.steps.append({"stage": self.stage, "step": message, "seconds": round(now - self.t, 3), **compiled})
        self.t, self.before = now, self.compiles.snapshot()


def first_answer(engine, requests: list, k: int, say: Steps) -> list:
    """The first batch answered in parts (see the module's doc); the answers of the first `retrieve`."""
    from andromeda_nb.compiled import encode_requests

    if hasattr(engine, "tables"):  # the GPU engine: its host steps first, each its first call
        encode_requests(requests)
        say(f"{len(requests)} requests encoded")
        engine.tables(requests)
        say("user-side tables folded")
    answers = engine.retrieve(requests, k)
    say("first retrieve")
    engine.retrieve(requests, k)
    say("second retrieve (warm)")
    return answers


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
    where = resolve(args.device)  # before anything imports numba
    compiles = CompileTimes()
    from andromeda_nb.batching import BATCH_REQUESTS
    from andromeda_nb.store import load_dataset
    from migration.architectures import build_engine

    steps: list = []
    imports_s = time.perf_counter() - t0
    t = time.perf_counter()
    dataset = load_dataset(args.data, say=Steps("load", steps, compiles))
    load_s = time.perf_counter() - t
    t = time.perf_counter()
    build_say = Steps("build", steps, compiles)
    if where != "cpu":
        compiles.wrap_cuda()  # numba.cuda may be imported now
    engine = build_engine(dataset, where, layout=args.layout, say=build_say)
    build_s = time.perf_counter() - t
    requests = dataset.requests[:BATCH_REQUESTS if args.requests is None else args.requests]
    t = time.perf_counter()
    answers = first_answer(engine, requests, args.k, Steps("first answer", steps, compiles)) if requests else []
    warm_s = steps[-1]["seconds"] if requests else 0.0  # the second retrieve: not part of the start-up
    first_s = time.perf_counter() - t - warm_s
    total_s = time.perf_counter() - t0 - warm_s
    to_stderr(f"imports {imports_s:.1f} s, load {load_s:.1f} s, build {build_s:.1f} s, first answer "
              f"({len(requests)} requests) {first_s:.1f} s: {total_s:.1f} s in all (compiling: host "
              f"{compiles.seconds['host']:.1f} s, CUDA {compiles.seconds['cuda']:.1f} s; a warm answer "
              f"{warm_s:.2f} s)")
    out = {"kind": "startup_steps", "ads": dataset.n_ads, "device": engine.device,
           "imports_s": round(imports_s, 3), "load_s": round(load_s, 3), "build_s": round(build_s, 3),
           "first_answer_s": round(first_s, 3), "warm_answer_s": round(warm_s, 3),
           "first_answer_requests": len(requests), "compile_s": {k: round(v, 3) for k, v in compiles.seconds.items()},
           "compiles": compiles.calls,
           "answered": sum(len(ids) > 0 for ids, _ in answers), "total_s": round(total_s, 3), "steps": steps}
    stamp(out, command=script_command("time_startup.py", argv if argv is not None else sys.argv[1:]))
    print(json.dumps(out))
    if args.out:
        write_json(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
