"""What one request costs on the wire path itself, with no engine time: encoding it for a `["retrieve"]`
exchange, and a round trip to a co-located server around an answer table (`benchmarks.clients.
AnswerTable`), sent in an exchange of its own or as the next batch of one exchange kept open. One
client in the server's process sends requests back to back, so the process's CPU time per call is
what both ends spend on it (the interpreter, Arrow and gRPC alike).

    PYTHONPATH=. python3 scripts/probe_exchange_cost.py --data DIR --calls 1000 --out cost.json
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from andromeda_nb.provenance import script_command, write_result  # noqa: E402


def _timed(fn, calls: int) -> dict:
    """Wall and process-CPU milliseconds a call of `fn(i)`, over `calls` calls after a warm-up."""
    for i in range(min(20, calls)):
        fn(i)
    t, c = time.perf_counter(), time.process_time()
    for i in range(calls):
        fn(i)
    return {"wall_ms": 1e3 * (time.perf_counter() - t) / calls, "cpu_ms": 1e3 * (time.process_time() - c) / calls}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="corpus directory (made by `andromeda generate`)")
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import pyarrow.flight as flight

    from serving import protocol as fl
    from serving.engine_server import EngineServer
    from andromeda_nb.store import load_dataset
    from benchmarks.clients import AnswerTable, KeptExchange

    dataset = load_dataset(args.data)
    requests = dataset.requests
    table = AnswerTable.computed(dataset, args.k)
    batch = [requests[i % len(requests)] for i in range(64)]  # a client batch of 64 (encoding needs no distinct ids)
    out = {"encode_batch_of_64": _timed(lambda i: fl.request_batch(batch, args.k), max(1, args.calls // 20))}
    out["encode_per_request_us"] = 1e3 * out["encode_batch_of_64"]["wall_ms"] / len(batch)
    server = EngineServer(table, dataset)
    threading.Thread(target=server.serve, daemon=True).start()
    client = flight.connect(f"grpc://127.0.0.1:{server.port}")
    stream = KeptExchange(client)
    encoded = [fl.encode_requests_for_exchange([r], args.k) for r in requests]
    try:
        out["exchange_per_call"] = _timed(lambda i: fl.retrieve_encoded(client, encoded[i % len(encoded)]), args.calls)
        out["one_exchange"] = _timed(lambda i: stream.retrieve(encoded[i % len(encoded)]), args.calls)
    finally:
        stream.close()
        client.close()
        server.shutdown()
    out.update(ads=dataset.n_ads, calls=args.calls, k=args.k)
    print(f"encode: {out['encode_per_request_us']:.0f} us a request (batches of 64); round trip, exchange per call: "
          f"{out['exchange_per_call']['wall_ms']:.3f} ms, {out['exchange_per_call']['cpu_ms']:.3f} ms CPU; "
          f"one exchange kept: {out['one_exchange']['wall_ms']:.3f} ms, {out['one_exchange']['cpu_ms']:.3f} ms CPU")
    if args.out:
        write_result(out, args.out, command=script_command("probe_exchange_cost.py", argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
