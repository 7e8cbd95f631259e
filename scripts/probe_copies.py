"""What making a pool of distinct copies of a corpus costs on this machine's CPU, and how the copies
answer (`benchmarks.copies`, the pool of `bench pipeline --data DIR --copies N`):

* seconds to load the corpus and to make the copies (targeting, then embeddings), and the process's
  peak resident memory after each (`resource.getrusage`);
* the copies' bytes (compiled targeting, embeddings) and their circles and distinct terms;
* the share of the pool eligible for the corpus's requests (the first `--requests` of them), from the
  scan of the copies' compiled targeting the checks of `bench pipeline` use (`CompiledScan`, its
  seconds a request): of copy 0 (the corpus) against copies 1 on; with `--cpu-index`, also the CPU
  index's build time and the memory it takes;
* the share of the corpus's term uses that keep their value in copy 1.

    PYTHONPATH=. python3 scripts/probe_copies.py --data /tmp/c1m --copies 10 --out copies.json
"""

from __future__ import annotations

import argparse
import resource
import sys
import time


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="corpus directory (andromeda generate or import)")
    parser.add_argument("--copies", type=int, default=10)
    parser.add_argument("--requests", type=int, default=16, help="requests whose eligible shares are measured")
    parser.add_argument("--cpu-index", action="store_true", help="also build the CPU index over the copies")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import numpy as np

    from andromeda_nb.provenance import report_probe
    from andromeda_nb.store import load_dataset
    from benchmarks.copies import CompiledScan, CopyPlan, copy_compiled, copy_embeddings
    from cpu_baseline.index import CpuTargetingIndex

    t0 = time.time()
    base = load_dataset(args.data)
    load_s, load_peak = time.time() - t0, peak_gb()
    t1 = time.time()
    plan = CopyPlan.of(base.compiled, args.copies, base.seed)
    plan_s = time.time() - t1
    compiled = copy_compiled(plan, progress=True)
    targeting_s = time.time() - t1
    t2 = time.time()
    embeddings = copy_embeddings(plan, base.embeddings, base.seed, progress=True)
    embeddings_s = time.time() - t2
    made_peak = peak_gb()
    requests = base.requests[: args.requests]
    scan = CompiledScan(compiled)
    scan.match(requests[:1])  # compiled (or loaded from the cache) before it is timed
    t3 = time.time()
    eligible = scan.match(requests)
    scan_s = (time.time() - t3) / max(1, len(requests))
    n = len(base.compiled)
    counts = np.array([np.bincount(plan.copy_of_ids(ids), minlength=args.copies) for ids in eligible],
                      np.float64) / n
    index_s = None
    if args.cpu_index:
        t4 = time.time()
        index = CpuTargetingIndex.from_compiled(compiled)
        index_s = round(time.time() - t4, 2)
        assert all(np.array_equal(a, b) for a, b in zip(index.match(requests), eligible)), "scan != CPU index"
        index.close()
    result = {
        "corpus": args.data, "base_ads": n, "copies": args.copies, "pool_ads": len(compiled),
        "seconds": {"load": round(load_s, 2), "plan": round(plan_s, 2), "targeting": round(targeting_s, 2),
                    "embeddings": round(embeddings_s, 2), "scan_per_request": round(scan_s, 3),
                    "cpu_index_build": index_s},
        "peak_rss_gb": {"after_load": round(load_peak, 2), "after_copies": round(made_peak, 2),
                        "at_the_end": round(peak_gb(), 2)},
        "bytes": {"targeting": compiled.nbytes, "embeddings": embeddings.values.nbytes + embeddings.scale.nbytes},
        "circles": int(len(compiled.circles)), "distinct_terms": int(len(plan.keys)),
        "terms_kept_in_copy_1": round(plan.fixed_share(), 4),
        "eligible_share": {"requests": len(requests), "base": float(counts[:, 0].mean()),
                           "copies": float(counts[:, 1:].mean()) if args.copies > 1 else None,
                           "per_copy": [round(float(x), 5) for x in counts.mean(axis=0)]},
        "cpus": __import__("os").cpu_count(),
    }
    report_probe(result, "probe_copies.py", sys.argv[1:] if argv is None else argv, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
