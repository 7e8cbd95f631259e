"""Host-side costs of a request on this machine's CPU, for the figures docs/ quote beside the GPU runs:

* the scoring service's candidate lookup (`RowMap.rows_of`) of one request's eligible ad ids;
* encoding a request, and preparing it for the shipped match kernel (`GpuTargetingIndex.prepare`
  with reused buffers: the request arrays built and packed; under the CUDA simulator, which this
  script runs on, the "upload" is a host memory copy);
* the circle table of the circle-table match kernels (`GpuTargetingIndex.circle_table`), for one
  request and for a group of 64;
* a server decoding one Flight batch of 16 requests (`flight.decode_request_batch`: JSON, checks,
  the request objects), per request.

Each figure is the median of repeated calls after a warm-up, on a corpus made by `andromeda generate`:

    PYTHONPATH=. python3 scripts/time_host_side.py --data /tmp/c1m --out host_side.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")  # only host code is timed; no device needed


def median_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="corpus directory (andromeda generate)")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from andromeda_nb.compiled import encode_request
    from andromeda_nb.flight import decode_request_batch, request_batch
    from andromeda_nb.devices import resolve
    from andromeda_nb.provenance import host_info
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
    out = {
        "ads": ds.n_ads,
        "eligible_first_request": int(len(eligible)),
        "circles": int(len(index.circles_h)),
        "vocabulary_terms": int(len(index.vocab)),
        "ms": {
            "rowmap_lookup_first_request": median_ms(lambda: rows.rows_of(eligible), args.repeat),
            "encode_request": median_ms(lambda: encode_request(requests[0]), args.repeat),
            "prepare_one_request": median_ms(lambda: index.prepare(encoded[:1], reuse=True), args.repeat),
            "circle_table_one_request": median_ms(lambda: index.circle_table(encoded[:1], 64), args.repeat),
            "circle_table_64_requests": median_ms(lambda: index.circle_table(batch64, 64), args.repeat),
            "decode_per_request_in_16": median_ms(decode, args.repeat) / wire16.num_rows,
        },
    }
    argv = sys.argv[1:] if argv is None else argv
    result = {**out, "command": shlex.join(["python3", "scripts/time_host_side.py", *argv]), "host": host_info()}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
