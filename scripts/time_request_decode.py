"""What a server pays to decode requests: the JSON request batch against the columnar one
(`serving.request_columns`), at several batch sizes, and the one-request calls of many clients
decoded one by one against together (`flight.decode_request_batches`); then the GPU engine's host
side of the largest batch (`compiled.encode_requests` and the folded user-side tables) from the
`Request` objects JSON decodes to, and from the arrays columns decode to. Both kinds are decoded and
checked equal to the corpus's requests, and both host sides checked equal, before anything is timed.

    PYTHONPATH=. python3 scripts/time_request_decode.py --data DIR --out decode.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from andromeda_nb.measure import median_ms, write_json  # noqa: E402
from andromeda_nb.provenance import script_command, stamp  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="corpus directory (its requests are decoded)")
    ap.add_argument("--sizes", default="1,8,32,64", help="requests per batch, comma-separated")
    ap.add_argument("--calls", type=int, default=32, help="one-request calls decoded together")
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--allocator", default="kept", choices=("kept", "default"),
                    help="'kept': freed memory kept, as the servers do (serving.hostmem); 'default': glibc's own")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from serving.hostmem import keep_freed_memory

    kept = keep_freed_memory() if args.allocator == "kept" else False

    from serving import protocol as fl
    from serving.request_columns import request_columns
    from andromeda_nb.store import load_requests, request_settings

    kw = request_settings(args.data)
    base = load_requests(args.data)
    need = max([int(s) for s in args.sizes.split(",")] + [args.calls])
    requests = [dataclasses.replace(base[i % len(base)], request_id=i) for i in range(need)]

    def check(batch, want):
        got, ks = fl.decode_request_batch(batch, **kw)
        assert list(got) == want and ks == [100] * len(want)
        assert all(np.array_equal(a.signals, b.signals) for a, b in zip(got, want))

    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        as_json, as_columns = fl.request_batch(requests[:n], 100), request_columns(requests[:n], 100)
        check(as_json, requests[:n])
        check(as_columns, requests[:n])
        rows.append({"requests": n,
                     "bytes": {"json": fl.batch_bytes(as_json), "columns": fl.batch_bytes(as_columns)},
                     "decode_ms": {"json": median_ms(lambda: fl.decode_request_batch(as_json, **kw), args.repeat),
                                   "columns": median_ms(lambda: fl.decode_request_batch(as_columns, **kw),
                                                        args.repeat)},
                     "encode_ms": {"json": median_ms(lambda: fl.request_batch(requests[:n], 100), args.repeat),
                                   "columns": median_ms(lambda: request_columns(requests[:n], 100), args.repeat)}})
    calls = {}
    for kind, encode in (("json", fl.request_batch), ("columns", request_columns)):
        singles = [encode([r], 100) for r in requests[: args.calls]]
        together = fl.decode_request_batches(singles, **kw)
        assert [list(reqs)[0] for reqs, _ in together] == requests[: args.calls]
        calls[kind] = {"one_by_one_ms": median_ms(lambda: [fl.decode_request_batch(b, **kw) for b in singles],
                                                  args.repeat),
                       "together_ms": median_ms(lambda: fl.decode_request_batches(singles, **kw), args.repeat)}
    from andromeda_nb.compiled import encode_requests
    from andromeda_nb.model import MoeModel, user_sides
    from andromeda_nb.scoring import fold_tables_batch
    from andromeda_nb.store import MODEL_FILE

    model = MoeModel.load(Path(args.data) / MODEL_FILE)
    n = max(int(s) for s in args.sizes.split(","))
    objects = fl.decode_request_batch(fl.request_batch(requests[:n], 100), **kw)[0]
    arrays = fl.decode_request_batch(request_columns(requests[:n], 100), **kw)[0]

    def host_side(reqs):
        return encode_requests(reqs), fold_tables_batch(*user_sides(model, reqs))

    (eo, to), (ea, ta) = host_side(objects), host_side(arrays)
    assert np.array_equal(eo.terms, ea.terms) and np.array_equal(eo.term_ptr, ea.term_ptr)
    assert np.allclose(to, ta, rtol=1e-6, atol=1e-6)
    engine_host = {"requests": n, "objects_ms": median_ms(lambda: host_side(objects), args.repeat),
                   "arrays_ms": median_ms(lambda: host_side(arrays), args.repeat)}
    out = {"what": "request decoding on the server: JSON against columnar request batches (medians)",
           "requests_of": args.data, "batches": rows, f"calls_of_one_request_x{args.calls}": calls,
           "engine_host_side": engine_host, "allocator": {"asked": args.allocator, "freed_memory_kept": kept}}
    stamp(out, command=script_command("time_request_decode.py", argv if argv is not None else sys.argv[1:]))
    for row in rows:
        print(f"{row['requests']:>3} requests: decode {row['decode_ms']['json']:.3f} ms as JSON, "
              f"{row['decode_ms']['columns']:.3f} ms as columns; {row['bytes']['json']:,} against "
              f"{row['bytes']['columns']:,} bytes")
    for kind, c in calls.items():
        print(f"{args.calls} one-request calls as {kind}: {c['one_by_one_ms']:.3f} ms one by one, "
              f"{c['together_ms']:.3f} ms together")
    print(f"the engine's host side of {n} requests: {engine_host['objects_ms']:.3f} ms from Request objects, "
          f"{engine_host['arrays_ms']:.3f} ms from arrays")
    if args.out:
        write_json(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
