"""The cluster's data path, decided by measurement (`python -m benchmarks.cluster`): per-request time of one
in-process co-located engine over the whole pool, against the same pool in shards on Ray asked two ways:

* `actor`: the router calls each shard's replica as a Ray actor method with the parsed requests and
  gets the shard's top-K arrays back (what `cluster.router` ships);
* `flight`: each replica also listens as a co-located Flight server (`ShardReplica.serve_flight`); the
  router writes the requests as a `["retrieve"]` exchange to every shard at once (one thread per
  shard) and merges the answer batches; `flight-columns` the same with columnar request batches
  (`serving.request_columns`), which each shard decodes in fewer steps.

All merge with `cluster.shards.merge_topk`, and all are checked to equal the in-process engine
before they are timed. Requests go one at a time (latency: what a request pays for the hops) and in
batches of 64 (throughput). The figures are medians of `--repeat` passes, with their range. Each
Flight row also says where a request's time went (encoding at the router, the fan-out and within it
the slowest shard's call, the merge), and `scaling` gives pool ads per second and the efficiency
against one shard. With `--placement processes --device gpu` the shard processes go round the
host's GPUs (`cluster.gpus`): one shard per GPU on a machine with several, all on the one GPU
otherwise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from andromeda_nb.batching import in_batches
from andromeda_nb.measure import software, write_json
from andromeda_nb.provenance import script_command, stamp, write_result
from cluster import require_ray
from cluster.router import Cluster
from cluster.shards import merge_topk

from .tiled_shard import add_tiled_arguments, tiled_pool_of


def _pass(fn, requests, batch: int, calls: list[float] | None = None) -> float:
    """Seconds per request of one pass of `fn(requests_batch)` over all requests; each call's seconds
    go to `calls` as well, when given."""
    t0 = time.perf_counter()
    for part in in_batches(requests, batch):
        started = time.perf_counter()
        fn(part)
        if calls is not None:
            calls.append(time.perf_counter() - started)
    return (time.perf_counter() - t0) / len(requests)


def _row(path: str, shards: int, batch: int, per_pass: list[float], calls: list[float] | None = None) -> dict:
    """A timing row: the median pass and its range (us per request); with the calls of one request
    each (batch 1), their p50 and p99 over every pass."""
    row = {"path": path, "shards": shards, "batch": batch, "median_us": round(statistics.median(per_pass) * 1e6, 1),
           "min_us": round(min(per_pass) * 1e6, 1), "max_us": round(max(per_pass) * 1e6, 1)}
    if batch == 1 and calls:
        row["p50_us"], row["p99_us"] = (round(float(np.percentile(calls, q)) * 1e6, 1) for q in (50, 99))
    return row


def _checked_then_timed(paths: dict, want, what: str, requests, shards: int, batches, repeat: int, say) -> list[dict]:
    """Every path's answers against `want` (AssertionError naming the path and `what` it was held
    to), then the timing rows (`_time_paths`)."""
    for name, fn in paths.items():
        if not _same(fn(requests), want):
            raise AssertionError(f"{name} path with {shards} shards differs from {what}")
    return _time_paths(paths, requests, shards, batches, repeat, say)


def _time_paths(paths: dict, requests, shards: int, batches, repeat: int, say) -> list[dict]:
    """Each path timed in turn within each repetition (drift in the machine's load falls on all
    alike), per batch size; Flight rows carry their split (`FlightFanOut.split`)."""
    rows = []
    for b in batches:
        say(f"timing {shards} shard(s), batches of {b}")
        times = {name: [] for name in paths}
        calls = {name: [] for name in paths}
        for fn in paths.values():
            if isinstance(fn, FlightFanOut):
                fn.reset()
        for _ in range(repeat):
            for name, fn in paths.items():
                times[name].append(_pass(fn, requests, b, calls[name]))
        base = statistics.median(times["in-process"]) if "in-process" in times else None
        for name, per_pass in times.items():
            row = _row(name, shards, b, per_pass, calls[name])
            if base is not None:
                row["overhead_us"] = round((statistics.median(per_pass) - base) * 1e6, 1)
            if isinstance(paths[name], FlightFanOut):
                row["split_us"] = paths[name].split()
            rows.append(row)
    return rows


def _same(got, want) -> bool:
    """Every request's answer (ad ids, scores) equal, and as many answers as requests."""
    return len(got) == len(want) and all(np.array_equal(a, c) and np.array_equal(b, d)
                                         for (a, b), (c, d) in zip(got, want))


class FlightFanOut:
    """A router over Flight: the requests encoded once (JSON or columnar request batches), each
    shard's `["retrieve"]` exchange on its own thread with those batches, the answers merged. Each
    call's time is split (`split()`): encoding, the fan-out (the first shard asked to the last
    answer read), within it the slowest shard's own call, and the merge."""

    PHASES = ("encode", "fan_out", "slowest_shard", "merge")

    def __init__(self, locations: list[str], k: int, request_format: str = "json"):
        import pyarrow.flight as flight

        self.k, self.request_format = k, request_format
        self.clients = [flight.connect(location) for location in locations]
        self.pool = ThreadPoolExecutor(len(locations))
        self.reset()

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self.requests = 0

    def _shard(self, client, encoded):
        from serving.protocol import retrieve_encoded

        started = time.perf_counter()
        answers = retrieve_encoded(client, encoded)
        return answers, time.perf_counter() - started

    def __call__(self, requests):
        from serving.protocol import encode_requests_for_exchange

        t0 = time.perf_counter()
        encoded = encode_requests_for_exchange(requests, self.k, request_format=self.request_format)
        t1 = time.perf_counter()
        parts = list(self.pool.map(lambda client: self._shard(client, encoded), self.clients))
        t2 = time.perf_counter()
        merged = [merge_topk([answers[i] for answers, _ in parts], self.k) for i in range(len(requests))]
        t3 = time.perf_counter()
        for phase, seconds in zip(self.PHASES, (t1 - t0, t2 - t1, max(took for _, took in parts), t3 - t2)):
            self.seconds[phase] += seconds
        self.requests += len(requests)
        return merged

    def split(self) -> dict:
        """Microseconds per request in each phase since `reset()`."""
        return {phase: round(seconds / max(self.requests, 1) * 1e6, 1) for phase, seconds in self.seconds.items()}

    def close(self) -> None:
        self.pool.shutdown()
        for client in self.clients:
            client.close()


class _ShardProcesses:
    """One `cluster.shard_process` (`benchmarks.tiled_shard` for a tiled pool) per shard (no Ray): their
    Flight locations, ended on `close()`.
    `source`: the corpus directory each shard cuts its slice from, or a `benchmarks.tiled.TiledPool` whose
    shard s holds its own copies; `gpus`: the GPUs the shards go round (`cluster.gpus`), None on the CPU."""

    def __init__(self, source, shards: int, device: str, say, gpus: list[str] | None = None):
        from cluster.gpus import shard_environment
        from serving.services import ServiceProcess, start_side_by_side

        if hasattr(source, "copies"):  # a tiled pool: each shard lays out its copies on its GPU
            module = "benchmarks.tiled_shard"
            given = ["--tiled", str(source.copies), "--base-ads", str(source.base_ads), "--seed", str(source.seed),
                     "--dim", str(source.dim)]
            what = f"each lays out {source.n_ads:,} ads of a tiled pool and checks them"
        else:
            module, given = "cluster.shard_process", ["--data", str(source)]
            what = "each loads the corpus and cuts its slice"

        def start(s: int):
            return ServiceProcess(module, [*given, "--shard", str(s), "--of", str(shards),
                                                            "--device", device, "--parent-pid", str(os.getpid())],
                                  name=f"shard {s} of {shards}", env=shard_environment(s, gpus))

        where = device if not gpus else f"{device} ({len(gpus)} GPU(s): {', '.join(gpus)})"
        say(f"  starting {shards} shard process(es) on {where}, all at once ({what})")
        self.procs = start_side_by_side([lambda s=s: start(s) for s in range(shards)], close=ServiceProcess.stop)
        self.locations = [p.location for p in self.procs]
        self.announced = [p.announced for p in self.procs]

    def close(self) -> None:
        for proc in self.procs:
            proc.stop()


def scaling(rows: list[dict], ads: int, *, per_shard: bool = False) -> list[dict]:
    """Per path and batch size: pool ads per second at each shard count, and the efficiency against
    one shard, rate(N) / (N rate(1)) (1.0: N shards do N times the work of one in the same time). The
    pool is `ads` whatever N (a corpus split N ways) or, `per_shard`, N x `ads` (each shard its own
    `ads`: a tiled pool): t(1) / (N t(N)) for the first, t(1) / t(N) for the second."""
    out = []
    rate = {(r["path"], r["batch"], r["shards"]): (ads * r["shards"] if per_shard else ads) / (r["median_us"] * 1e-6)
            for r in rows if r["path"] != "in-process"}
    for (path, batch, shards), pool_rate in rate.items():
        one = rate.get((path, batch, 1))
        out.append({"path": path, "batch": batch, "shards": shards, "pool_ads_per_s": round(pool_rate),
                    "efficiency": None if one is None else round(pool_rate / (shards * one), 3)})
    return out


def measure(dataset, shard_counts, *, k: int = 100, repeat: int = 3, batches=(1, 64), device: str = "cpu",
            placement: str = "ray", data_dir=None, gpus: int | None = None, say=print, partial=None) -> dict:
    """Per shard count: the in-process engine, the actor path and the Flight path timed in turn within
    each repetition (so drift in the machine's load falls on all three alike). `device` 'gpu': the
    in-process engine and every shard on the GPU(s) Ray sees (several shards share one GPU, each its
    1/N of it in Ray's accounting). `placement` 'processes': no Ray (where it is not installed): one
    `cluster.shard_process` per shard, cut from the corpus at `data_dir`, and the Flight paths only;
    on the GPU the shards go round the first `gpus` GPUs of the host (all by default; `cluster.gpus`).
    Each Flight row splits its time (`FlightFanOut.split`), and `scaling` compares each shard count
    with one shard. `partial(result)`: called with the result so far after each shard count (a long run cut short
    keeps what it measured)."""
    from migration.architectures import build_engine

    if placement not in ("ray", "processes"):
        raise ValueError(f"placement is 'ray' or 'processes', not {placement!r}")
    if placement == "processes" and data_dir is None:
        raise ValueError("placement 'processes' needs the corpus directory (data_dir) the shard processes load")
    if gpus is not None and (placement != "processes" or device != "gpu"):
        raise ValueError("gpus: the shard processes' GPUs are chosen with placement 'processes' on device 'gpu' "
                         "(Ray places its actors on GPUs itself)")
    placed = None
    if placement == "processes" and device == "gpu":
        from cluster.gpus import choose_gpus, host_gpus

        placed = choose_gpus(gpus, host_gpus())
    requests = list(dataset.requests)
    say(f"in-process engine over {dataset.n_ads:,} ads on {device}")
    engine = build_engine(dataset, device)
    want = engine.retrieve(requests, k)
    rows = []

    def result(done: bool) -> dict:
        return {"kind": "cluster_data_path", "ads": dataset.n_ads, "requests": len(requests), "k": k,
                "repeat": repeat, "device": device, "placement": placement, "gpus": placed, "rows": list(rows),
                "scaling": scaling(rows, dataset.n_ads), "complete": done,
                "checked": "every path's answers equal the in-process engine's",
                "software": {**software(), "ray": ray_version() if placement == "ray" else None}}

    for shards in shard_counts:
        cluster = (Cluster.start(dataset, shards=shards, replicas=1, device=device, progress=say) if placement == "ray"
                   else _ShardProcesses(data_dir, shards, device, say, placed))
        fans = []
        try:
            paths = {"in-process": lambda r: engine.retrieve(r, k)}
            if placement == "ray":
                router = cluster.router
                paths["actor"] = lambda r: router.retrieve(r, k)
                locations = router.ray.get([h.actor.serve_flight.remote() for hs in router.replicas for h in hs])
            else:
                locations = cluster.locations
            fans = [FlightFanOut(locations, k), FlightFanOut(locations, k, "columns")]  # columnar request batches
            paths["flight"], paths["flight-columns"] = fans
            rows += _checked_then_timed(paths, want, "the in-process engine", requests, shards, batches, repeat, say)
        finally:
            for fan in fans:
                fan.close()
            cluster.close()
        if partial is not None:
            partial(result(False))
    engine.close()
    return result(True)


def measure_tiled(pool, shard_counts, *, k: int = 100, repeat: int = 3, batches=(1, 64), device: str = "gpu",
                  gpus: int | None = None, say=print, partial=None) -> dict:
    """The same Flight paths over a tiled pool (`benchmarks.tiled.TiledPool`) of which every shard holds its
    own `pool.copies` copies: the pool grows with the shard count (N x `pool.n_ads`), as a cluster
    does that adds a GPU for every 100M ads. No engine holds the whole pool, so the checks are: each
    shard's answers against the float64 reference before it listens (`benchmarks.tiled_shard`), and every path's
    answers equal to the merge of the shards' answers asked one by one."""
    placed = None
    if device == "gpu":
        from cluster.gpus import choose_gpus, host_gpus

        placed = choose_gpus(gpus, host_gpus())
    elif gpus is not None:
        raise ValueError("gpus: a tiled pool's shards are placed on GPUs with device 'gpu'")
    requests = list(pool.requests)
    rows, checks = [], []

    def result(done: bool) -> dict:
        return {"kind": "cluster_tiled_scaling", "ads_per_shard": pool.n_ads, "base_ads": pool.base_ads,
                "copies_per_shard": pool.copies, "seed": pool.seed, "D": pool.dim, "precision": pool.precision,
                "requests": len(requests), "k": k, "repeat": repeat, "device": device, "gpus": placed,
                "rows": list(rows), "scaling": scaling(rows, pool.n_ads, per_shard=True), "shard_checks": list(checks),
                "complete": done, "checked": "each shard against the float64 reference; every path's answers equal "
                                             "the merge of the shards' own",
                "software": software()}

    for shards in shard_counts:
        procs = _ShardProcesses(pool, shards, device, say, placed)
        fans = []
        try:
            checks.append({"shards": shards, "shard_checks": [a.get("checked") for a in procs.announced],
                           "gpus": [a.get("gpu") for a in procs.announced]})
            fans = [FlightFanOut(procs.locations, k), FlightFanOut(procs.locations, k, "columns")]
            alone = [FlightFanOut([location], k) for location in procs.locations]
            fans += alone
            own = [fan(requests) for fan in alone]
            want = [merge_topk([answers[i] for answers in own], k) for i in range(len(requests))]
            paths = {"flight": fans[0], "flight-columns": fans[1]}
            rows += _checked_then_timed(paths, want, "the merge of the shards' answers", requests, shards, batches,
                                        repeat, say)
        finally:
            for fan in fans:
                fan.close()
            procs.close()
        if partial is not None:
            partial(result(False))
    return result(True)


def options_problem(data, tiled, device: str) -> str | None:
    """What is wrong with a command line's pool and device, for both front ends (`main`, `andromeda
    bench cluster`): a corpus (`data`) or a tiled pool (`tiled`), one of them; a tiled pool lives on
    the GPU (or the simulator); a corpus's shards run on the GPU or the CPU. None when nothing is."""
    if (data is None) == (tiled is None):
        return "give --data DIR (a corpus split into shards) or --tiled COPIES (a tiled pool per shard)"
    if tiled is not None and device == "cpu":
        return "--tiled pools live on the GPU: --device gpu (or sim)"
    if tiled is None and device == "sim":
        return "--device sim goes with --tiled (a corpus's shards run on gpu or cpu)"
    return None


def ray_version() -> str:
    return require_ray().__version__


def table(result: dict) -> str:
    gpus = f", shards round GPU(s) {', '.join(result['gpus'])}" if result.get("gpus") else ""
    ads = f"{result['ads']:,} ads" if "ads" in result else f"{result['ads_per_shard']:,} ads per shard (tiled)"
    lines = [f"{ads}, {result['requests']} requests, k = {result['k']}{gpus} (us per request, "
             f"median of {result['repeat']}; split: encode / fan-out (slowest shard) / merge, mean)",
             f"{'path':<15}{'shards':>7}{'batch':>7}{'median':>11}{'range':>21}{'overhead':>11}  split"]
    for r in result["rows"]:
        spread = f"{r['min_us']:,.0f}..{r['max_us']:,.0f}"
        split = r.get("split_us")
        parts = (f"  {split['encode']:,.0f} / {split['fan_out']:,.0f} ({split['slowest_shard']:,.0f}) / "
                 f"{split['merge']:,.0f}" if split else "")
        overhead = f"{r['overhead_us']:>11,.0f}" if "overhead_us" in r else f"{'-':>11}"
        tail = f"  p50 {r['p50_us']:,.0f} p99 {r['p99_us']:,.0f}" if "p99_us" in r else ""
        lines.append(f"{r['path']:<15}{r['shards']:>7}{r['batch']:>7}{r['median_us']:>11,.0f}{spread:>21}"
                     f"{overhead}{parts}{tail}")
    if any(row["shards"] != 1 for row in result.get("scaling", [])):
        lines.append("scaling against one shard (pool ads/s, efficiency t(1) / (N t(N))):")
        for row in result["scaling"]:
            if row["shards"] != 1 and row["efficiency"] is not None:
                lines.append(f"  {row['path']:<15}{row['shards']:>3} shards, batch {row['batch']:>3}: "
                             f"{row['pool_ads_per_s']:>16,} ads/s, efficiency {row['efficiency']:.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    from serving.hostmem import keep_freed_memory

    keep_freed_memory()  # batches' temporaries reuse the heap's pages (serving.hostmem)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cluster", description=__doc__.split("\n")[0])
    parser.add_argument("--data", help="corpus directory (or --tiled)")
    add_tiled_arguments(parser, "instead of --data: a tiled pool on the GPU for every shard (so the pool grows with the shards: "
                                "12,208 copies of 8,192 ads is 100M a shard), shards as processes, each checked "
                                "against the float64 reference")
    parser.add_argument("--requests", type=int, default=64, help="--tiled: requests of the generated base corpus")
    parser.add_argument("--batches", default="1,64", help="batch sizes to time, comma-separated")
    parser.add_argument("--shards", default="1,2,4", help="shard counts to time, comma-separated")
    parser.add_argument("--k", type=int, default=100, help="answers per request")
    parser.add_argument("--repeat", type=int, default=3, help="passes over the requests per timing")
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu", "sim"),
                        help="where the engine and every shard run (sim: --tiled only, tiny pools)")
    parser.add_argument("--placement", default="ray", choices=("ray", "processes"),
                        help="shards as Ray actors (actor and Flight paths), or as plain processes (Flight only, no Ray)")
    parser.add_argument("--gpus", type=int, default=None,
                        help="with --placement processes --device gpu: the shards go round the first N GPUs this "
                             "process may use (default: all; CUDA_VISIBLE_DEVICES narrows them)")
    parser.add_argument("--out", help="write the JSON result here")
    args = parser.parse_args(argv)
    problem = options_problem(args.data, args.tiled, args.device)
    if problem:
        parser.error(problem)
    if args.tiled is not None:
        args.placement = "processes"
    if args.gpus is not None and (args.placement != "processes" or args.device != "gpu"):
        parser.error("--gpus goes with --placement processes --device gpu (Ray places its actors on GPUs itself)")
    if args.placement == "ray":
        require_ray()
    from andromeda_nb.devices import resolve
    from andromeda_nb.store import load_dataset

    resolve(args.device)
    say = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    command = script_command("-m benchmarks.cluster", argv if argv is not None else sys.argv[1:])

    def keep(partial_result: dict) -> None:  # after each shard count: what is measured so far survives a cut
        print(table(partial_result), file=sys.stderr, flush=True)
        if args.out:
            write_result(dict(partial_result), args.out, command=command)

    counts = [int(s) for s in args.shards.split(",")]
    batches = tuple(int(b) for b in args.batches.split(","))
    if args.tiled is not None:
        result = measure_tiled(tiled_pool_of(args, n_requests=args.requests), counts, k=args.k, repeat=args.repeat,
                               batches=batches, device=args.device, gpus=args.gpus, say=say, partial=keep)
    else:
        result = measure(load_dataset(args.data), counts, k=args.k, repeat=args.repeat, batches=batches,
                         device=args.device, placement=args.placement, data_dir=args.data, gpus=args.gpus, say=say,
                         partial=keep)
    stamp(result, command=command)
    print(table(result))
    if args.out:
        write_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
