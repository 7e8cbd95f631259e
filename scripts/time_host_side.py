"""Host-side costs of a request on this machine's CPU, for the figures docs/ quote beside the GPU runs:

* the scoring service's candidate lookup (`RowMap.rows_of`) of one request's eligible ad ids;
* encoding a request (`encode_request`, and `encode_requests` as the GPU engine encodes a batch, of
  one request and of 64), and preparing it for the shipped match kernel (`GpuTargetingIndex.prepare`
  with reused buffers: the request arrays built and packed; under the CUDA simulator, which this
  script runs on, the "upload" is a host memory copy);
* the circle table of the circle-table match kernels (`GpuTargetingIndex.circle_table`), for one
  request and for a group of 64;
* a server decoding one Flight batch of 16 requests (`flight.decode_request_batch`: JSON, checks,
  the request objects), per request;
* the user side of one request and of 64, folded into the scorer's per-format tables
  (`model.user_sides` and `scoring.fold_tables_batch`, float64 numpy: small matrix products, which
  a multithreaded BLAS may hand to its threads).

The result also names the BLAS numpy uses and its thread pools (`numpy.show_config`; threadpoolctl's
view where it is installed), and the thread-count variables of the environment, so that a run with
`OPENBLAS_NUM_THREADS=1` (or OMP_/MKL_) can be told apart.

Each figure is the median of repeated calls after a warm-up, on a corpus made by `andromeda generate`:

    PYTHONPATH=. python3 scripts/time_host_side.py --data /tmp/c1m --out host_side.json
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")  # only host code is timed; no device needed


def median_ms(fn, repeat: int) -> float:
    from andromeda_nb.measure import median_ms as median

    return median(fn, repeat)


def blas_info() -> dict:
    """numpy's BLAS as its build config names it, the thread pools threadpoolctl finds (when
    installed), and the thread-count variables set in the environment."""
    import numpy as np

    info: dict = {"env": {k: os.environ[k] for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
                          if k in os.environ}}
    try:
        config = np.show_config(mode="dicts")
        blas = config.get("Build Dependencies", {}).get("blas", {})
        info["numpy_blas"] = {k: blas.get(k) for k in ("name", "version", "openblas configuration") if k in blas}
    except (TypeError, ValueError):  # an older numpy without mode="dicts"
        info["numpy_blas"] = None
    try:
        from threadpoolctl import threadpool_info

        info["threadpools"] = [{k: p.get(k) for k in ("internal_api", "num_threads", "threading_layer", "version")}
                               for p in threadpool_info()]
    except ImportError:
        info["threadpools"] = None
    return info


def main(argv=None) -> int:
    from serving.hostmem import keep_freed_memory

    keep_freed_memory()  # as the servers do (serving.hostmem)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="corpus directory (andromeda generate)")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from andromeda_nb.compiled import encode_request, encode_requests
    from andromeda_nb.model import user_sides
    from andromeda_nb.scoring import fold_tables_batch
    from serving.protocol import decode_request_batch, request_batch
    from andromeda_nb.devices import resolve
    from andromeda_nb.provenance import report_probe
    from andromeda_nb.rows import RowMap
    from andromeda_nb.store import load_dataset
    from cpu_baseline.index import CpuTargetingIndex

    resolve("sim")
    from gpu.index import GpuTargetingIndex

    ds = load_dataset(args.data)
    requests = ds.requests
    encoded = [encode_request(r) for r in requests]
    cpu = CpuTargetingIndex.from_compiled(ds.compiled)
    eligible = cpu.match(requests[:1])[0]
    cpu.close()
    rows = RowMap(ds.ad_ids)
    index = GpuTargetingIndex.from_compiled(ds.compiled, device="sim")
    batch64 = (encoded * (64 // len(encoded) + 1))[:64]
    wire16 = request_batch(requests[:16], 100)
    m = ds.model
    decode = lambda: decode_request_batch(wire16, seed=ds.seed, experts=m.E, width=m.S)  # noqa: E731
    requests64 = (list(requests) * (64 // len(requests) + 1))[:64]
    out = {
        "ads": ds.n_ads,
        "eligible_first_request": int(len(eligible)),
        "circles": int(len(index.circles_h)),
        "vocabulary_terms": int(len(index.vocab)),
        "ms": {
            "rowmap_lookup_first_request": median_ms(lambda: rows.rows_of(eligible), args.repeat),
            "encode_request": median_ms(lambda: encode_request(requests[0]), args.repeat),
            "encode_requests_one": median_ms(lambda: encode_requests(requests[:1]), args.repeat),
            "encode_requests_64": median_ms(lambda: encode_requests(requests64), args.repeat),
            "prepare_one_request": median_ms(lambda: index.prepare(encoded[:1], reuse=True), args.repeat),
            "circle_table_one_request": median_ms(lambda: index.circle_table(encoded[:1], 64), args.repeat),
            "circle_table_64_requests": median_ms(lambda: index.circle_table(batch64, 64), args.repeat),
            "decode_per_request_in_16": median_ms(decode, args.repeat) / wire16.num_rows,
            "user_side_one_request": median_ms(lambda: fold_tables_batch(*user_sides(m, requests[:1])), args.repeat),
            "user_side_64_requests": median_ms(lambda: fold_tables_batch(*user_sides(m, requests64)), args.repeat),
        },
        "blas": blas_info(),
    }
    argv = sys.argv[1:] if argv is None else argv
    result = dict(out)
    report_probe(result, "time_host_side.py", argv, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
