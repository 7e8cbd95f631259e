"""Host preparation of one match batch on this machine's CPU, as `andromeda bench match` counts it:
the requests encoded, then `GpuTargetingIndex.prepare` (term lookup, per-group tables, the circle
table's words of the table-reading kernels, the packed upload), on a pool tiled from the base corpus
of `bench match` (32,768 generated ads, seed 7, 256 requests) to about 10M slots, or on a corpus of
distinct ads and its own distinct requests (`--data DIR`, laid out by geography as the engine does).

The kernels run under the CUDA simulator here, so the upload is a host memory copy and no kernel is
timed: the figures are the host's share of a batch, the part that must stay below the kernel time.
Each figure is the median of repeated calls after a warm-up, by the wall clock and by this process's
CPU time (other processes on a busy machine inflate the first, not the second):

    PYTHONPATH=. python3 scripts/time_host_prepare.py --base out/bench_match_base.parquet \\
        --out docs/results/probes/host_prepare_cpu.json
    PYTHONPATH=. python3 scripts/time_host_prepare.py --data out/corpus_1m --versions 8
    PYTHONPATH=. python3 scripts/time_host_prepare.py --data DIR --batches 64 --versions 8 \\
        --search-threads 0,3 --rounds 2

`--search-threads` times a large custom-location search in one run (0) and split over threads
(`gpu.index.CircleLookup.entries`, `SEARCH_THREADS`) in turn, on the one built index.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")  # only host code is timed; no device needed
os.environ.setdefault("ANDROMEDA_SIM_POISON", "0")  # no simulator memory filled with garbage: not the host's cost


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default=None, help="base corpus cache of bench match (a Parquet file): read when "
                        "present, else generated and written there")
    parser.add_argument("--data", default=None, help="a corpus directory (andromeda generate/import): its ads and "
                        "requests in place of the tiled pool")
    parser.add_argument("--pool", type=int, default=10_000_000, help="pool size (ads) the base corpus is tiled to")
    parser.add_argument("--batches", default="64,256", help="requests per batch, comma-separated")
    parser.add_argument("--versions", default="6,8", help="match kernel versions whose preparation is timed")
    parser.add_argument("--repeat", type=int, default=20, help="timed calls per figure (after a warm-up)")
    parser.add_argument("--out", default=None, help="write the JSON result here too")
    parser.add_argument("--search-threads", default="0", help="threads beside the caller's for a large "
                        "custom-location search (gpu.index.SEARCH_THREADS, at most MAX_SEARCH_THREADS), "
                        "comma-separated, each timed in turn (0: one run, the default)")
    parser.add_argument("--rounds", type=int, default=1, help="times the --search-threads list is timed, in turn")
    args = parser.parse_args(argv)

    import numpy as np

    from andromeda_nb.measure import timed_runs
    from andromeda_nb.devices import resolve
    from andromeda_nb.provenance import report_probe
    from benchmarks.tiling import load_or_generate_base

    resolve("sim")
    from benchmarks.match import BASE_ADS, build_tiled_index, host_prepare
    from andromeda_nb.compiled import EncodedBatch, encode_requests
    from gpu.lab import match as lab

    t0 = time.perf_counter()
    if args.data:
        from andromeda_nb.geo_layout import world_buckets
        from andromeda_nb.store import load_dataset
        from gpu.index import GpuTargetingIndex

        base = load_dataset(args.data)
        index = GpuTargetingIndex.from_compiled(base.compiled, device="sim", buckets=world_buckets(base.seed),
                                                rank="geo")
    else:
        base = load_or_generate_base(args.base, BASE_ADS, 256, 7, progress=True)
        index = build_tiled_index(base.compiled, max(1, args.pool // len(base.ads)), device="sim")
    print(f"pool {len(index):,} ads built in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    import gpu.index as gi

    figures = []
    for rnd in range(args.rounds):
        for threads in (int(t) for t in args.search_threads.split(",")):
            gi.SEARCH_THREADS = threads  # read by CircleLookup.entries at each call
            for b in (int(x) for x in args.batches.split(",")):
                if args.data and b > len(base.requests):
                    raise SystemExit(f"--data {args.data}: {len(base.requests)} requests, fewer than a batch of {b}")
                requests = [base.requests[i % len(base.requests)] for i in range(b)]
                for v in (int(x) for x in args.versions.split(",")):
                    version = lab.VERSIONS[v]

                    def prepare():
                        return host_prepare(index, requests, version)

                    row = {"batch": b, "version": v, "search_threads": threads, "round": rnd}
                    for name, clock in (("wall", time.perf_counter), ("cpu", time.process_time)):
                        runs = np.asarray(timed_runs(prepare, args.repeat, clock=clock, warmup=2)) * 1e3
                        row[f"{name}_ms"] = {"median": float(np.median(runs)), "min": float(runs.min()),
                                             "max": float(runs.max())}
                    row["us_per_request"] = 1e3 * row["wall_ms"]["median"] / b
                    # the parts: the requests encoded, and the custom-location search alone (its entries: the
                    # (request group, circle) words the batch sends)
                    encoded = encode_requests(requests)
                    row["encode_ms"] = float(np.median(timed_runs(lambda: encode_requests(requests), args.repeat,
                                                                  warmup=2))) * 1e3
                    if version.recipe.circle_table:
                        batch = EncodedBatch.of(encoded)
                        lookup = index._circles()
                        width = max(1, lookup.count)
                        row["circle_search_ms"] = float(np.median(timed_runs(
                            lambda: lookup.entries(batch.latitude, batch.longitude, version.recipe.group, width),
                            args.repeat, warmup=2))) * 1e3
                        row["circle_entries"] = int(len(lookup.entries(batch.latitude, batch.longitude,
                                                                       version.recipe.group, width)[0]))
                    figures.append(row)
                    print(f"batch {b:4d} v{v} threads {threads}: {row['wall_ms']['median']:8.3f} ms wall, "
                          f"{row['cpu_ms']['median']:8.3f} ms cpu (encoding {row['encode_ms']:.3f} ms"
                          + (f", custom-location search {row['circle_search_ms']:.3f} ms for {row['circle_entries']:,} entries"
                             if "circle_search_ms" in row else "") + ")", file=sys.stderr)
    argv = sys.argv[1:] if argv is None else argv
    result = {"kind": "host_prepare", "pool_ads": len(index), "capacity": index.capacity,
              "data": args.data, "base_ads": None if args.data else len(base.ads), "circles": int(len(index.circles_h)), "vocabulary_terms": int(len(index.vocab)),
              "repeat": args.repeat, "load_average": os.getloadavg(),
              "figures": figures}
    report_probe(result, "time_host_prepare.py", argv, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
