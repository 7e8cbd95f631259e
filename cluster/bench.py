"""The cluster's data path, decided by measurement (`python -m cluster.bench`): per-request time of one
in-process co-located engine over the whole pool, against the same pool in shards on Ray asked two ways:

* `actor`: the router calls each shard's replica as a Ray actor method with the parsed requests and
  gets the shard's top-K arrays back (what `cluster.router` ships);
* `flight`: each replica also listens as a co-located Flight server (`ShardReplica.serve_flight`); the
  router writes the requests as a `["retrieve"]` exchange to every shard at once (one thread per
  shard) and merges the answer batches; `flight-columns` the same with columnar request batches
  (`andromeda_nb.request_columns`), which each shard decodes in fewer steps.

All merge with `cluster.shards.merge_topk`, and all are checked to equal the in-process engine
before they are timed. Requests go one at a time (latency: what a request pays for the hops) and in
batches of 64 (throughput). The figures are medians of `--repeat` passes, with their range.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from andromeda_nb.bench import software, write_json
from andromeda_nb.provenance import host_info

from . import require_ray
from .router import Cluster
from .shards import merge_topk


def _pass(fn, requests, batch: int) -> float:
    """Seconds per request of one pass of `fn(requests_batch)` over all requests."""
    t0 = time.perf_counter()
    for lo in range(0, len(requests), batch):
        fn(requests[lo : lo + batch])
    return (time.perf_counter() - t0) / len(requests)


def _row(path: str, shards: int, batch: int, per_pass: list[float]) -> dict:
    return {"path": path, "shards": shards, "batch": batch, "median_us": round(statistics.median(per_pass) * 1e6, 1),
            "min_us": round(min(per_pass) * 1e6, 1), "max_us": round(max(per_pass) * 1e6, 1)}


def _same(got, want) -> bool:
    return all(np.array_equal(a, c) and np.array_equal(b, d) for (a, b), (c, d) in zip(got, want))


def flight_fanout(locations: list[str], k: int, request_format: str = "json"):
    """A router over Flight: the requests encoded once (JSON or columnar request batches), each
    shard's `["retrieve"]` exchange on its own thread with those batches, the answers merged."""
    import pyarrow.flight as flight

    from andromeda_nb.flight import encode_requests_for_exchange, retrieve_encoded

    clients = [flight.connect(loc) for loc in locations]
    pool = ThreadPoolExecutor(len(locations))

    def retrieve(requests):
        encoded = encode_requests_for_exchange(requests, k, request_format=request_format)
        parts = list(pool.map(lambda client: retrieve_encoded(client, encoded), clients))
        return [merge_topk([p[i] for p in parts], k) for i in range(len(requests))]

    return retrieve


class _ShardProcesses:
    """One `cluster.shard_process` per shard (no Ray): their Flight locations, ended on `close()`."""

    def __init__(self, data_dir, shards: int, device: str, say):
        from andromeda_nb.services import ServiceProcess, start_side_by_side

        def start(s: int):
            return ServiceProcess("cluster.shard_process", ["--data", str(data_dir), "--shard", str(s), "--of",
                                                            str(shards), "--device", device], name=f"shard {s} of {shards}")

        say(f"  starting {shards} shard process(es) on {device}, all at once (each loads the corpus and cuts its slice)")
        self.procs = start_side_by_side([lambda s=s: start(s) for s in range(shards)], close=ServiceProcess.stop)
        self.locations = [p.location for p in self.procs]

    def close(self) -> None:
        for proc in self.procs:
            proc.stop()


def measure(dataset, shard_counts, *, k: int = 100, repeat: int = 3, batches=(1, 64), device: str = "cpu",
            placement: str = "ray", data_dir=None, say=print, partial=None) -> dict:
    """Per shard count: the in-process engine, the actor path and the Flight path timed in turn within
    each repetition (so drift in the machine's load falls on all three alike). `device` 'gpu': the
    in-process engine and every shard on the GPU(s) Ray sees (several shards share one GPU, each its
    1/N of it in Ray's accounting). `placement` 'processes': no Ray (where it is not installed): one
    `cluster.shard_process` per shard, cut from the corpus at `data_dir`, and the Flight paths only.
    `partial(result)`: called with the result so far after each shard count (a long run cut short
    keeps what it measured)."""
    from migration.architectures import build_engine

    if placement not in ("ray", "processes"):
        raise ValueError(f"placement is 'ray' or 'processes', not {placement!r}")
    if placement == "processes" and data_dir is None:
        raise ValueError("placement 'processes' needs the corpus directory (data_dir) the shard processes load")
    requests = list(dataset.requests)
    say(f"in-process engine over {dataset.n_ads:,} ads on {device}")
    engine = build_engine(dataset, device)
    want = engine.retrieve(requests, k)
    rows = []

    def result(done: bool) -> dict:
        return {"kind": "cluster_data_path", "ads": dataset.n_ads, "requests": len(requests), "k": k,
                "repeat": repeat, "device": device, "placement": placement, "rows": list(rows), "complete": done,
                "checked": "every path's answers equal the in-process engine's",
                "software": {**software(), "ray": ray_version() if placement == "ray" else None}}

    for shards in shard_counts:
        cluster = (Cluster.start(dataset, shards=shards, replicas=1, device=device, progress=say) if placement == "ray"
                   else _ShardProcesses(data_dir, shards, device, say))
        try:
            paths = {"in-process": lambda r: engine.retrieve(r, k)}
            if placement == "ray":
                router = cluster.router
                paths["actor"] = lambda r: router.retrieve(r, k)
                locations = router.ray.get([h.actor.serve_flight.remote() for hs in router.replicas for h in hs])
            else:
                locations = cluster.locations
            paths["flight"] = flight_fanout(locations, k)
            paths["flight-columns"] = flight_fanout(locations, k, "columns")  # columnar request batches
            for name, fn in paths.items():
                if not _same(fn(requests), want):
                    raise AssertionError(f"{name} path with {shards} shards differs from the in-process engine")
            for b in batches:
                say(f"timing {shards} shard(s), batches of {b}")
                times = {name: [] for name in paths}
                for _ in range(repeat):
                    for name, fn in paths.items():
                        times[name].append(_pass(fn, requests, b))
                base = statistics.median(times["in-process"])
                for name, per_pass in times.items():
                    rows.append({**_row(name, shards, b, per_pass),
                                 "overhead_us": round((statistics.median(per_pass) - base) * 1e6, 1)})
        finally:
            cluster.close()
        if partial is not None:
            partial(result(False))
    engine.close()
    return result(True)


def ray_version() -> str:
    return require_ray().__version__


def table(result: dict) -> str:
    lines = [f"{result['ads']:,} ads, {result['requests']} requests, k = {result['k']} (us per request, median of "
             f"{result['repeat']})", f"{'path':<15}{'shards':>7}{'batch':>7}{'median':>11}{'range':>21}{'overhead':>11}"]
    for r in result["rows"]:
        spread = f"{r['min_us']:,.0f}..{r['max_us']:,.0f}"
        lines.append(f"{r['path']:<15}{r['shards']:>7}{r['batch']:>7}{r['median_us']:>11,.0f}{spread:>21}"
                     f"{r['overhead_us']:>11,.0f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    from andromeda_nb.hostmem import keep_freed_memory

    keep_freed_memory()  # batches' temporaries reuse the heap's pages (andromeda_nb.hostmem)
    parser = argparse.ArgumentParser(prog="python -m cluster.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="corpus directory")
    parser.add_argument("--shards", default="1,2,4", help="shard counts to time, comma-separated")
    parser.add_argument("--k", type=int, default=100, help="answers per request")
    parser.add_argument("--repeat", type=int, default=3, help="passes over the requests per timing")
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu"), help="where the engine and every shard run")
    parser.add_argument("--placement", default="ray", choices=("ray", "processes"),
                        help="shards as Ray actors (actor and Flight paths), or as plain processes (Flight only, no Ray)")
    parser.add_argument("--out", help="write the JSON result here")
    args = parser.parse_args(argv)
    if args.placement == "ray":
        require_ray()
    from andromeda_nb.devices import resolve
    from andromeda_nb.store import load_dataset

    resolve(args.device)
    say = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    provenance = {"command": shlex.join(["python", "-m", "cluster.bench", *(argv or sys.argv[1:])]),
                  "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": host_info()}

    def keep(partial_result: dict) -> None:  # after each shard count: what is measured so far survives a cut
        print(table(partial_result), file=sys.stderr, flush=True)
        if args.out:
            write_json({**partial_result, "provenance": provenance}, args.out)

    result = measure(load_dataset(args.data), [int(s) for s in args.shards.split(",")], k=args.k,
                     repeat=args.repeat, device=args.device, placement=args.placement, data_dir=args.data, say=say,
                     partial=keep)
    result["provenance"] = provenance
    print(table(result))
    if args.out:
        write_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
