"""The floor under the co-located server's served path: a bare pyarrow Flight server whose Python
`do_exchange` answers every request batch with a fixed 100-row answer batch (no decoding, no
batcher, no engine), against `--clients` client threads spread over `--client-processes` processes,
each sending one request batch (about the size of a real request) at a time, in an exchange of its
own (`--exchange call`) or as the next batch of one it keeps open (`stream`). Prints round trips a
second and the server process's CPU time a round trip.

`--check-reuseport` also tries to start a second Flight server on the first one's port, which is how
several server processes could share one port (`SO_REUSEPORT`), and says whether it could.

    PYTHONPATH=. python3 scripts/probe_flight_floor.py --clients 16 --client-processes 2 --exchange stream,call
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from andromeda_nb.provenance import script_command, write_result  # noqa: E402

REQUEST_TEXT_BYTES = 2_300  # about one generated request's JSON


def _server_class():
    import numpy as np
    import pyarrow as pa
    import pyarrow.flight as flight

    from serving.protocol import ANSWER_SCHEMA

    answer = pa.record_batch([pa.array(np.zeros(100, np.int64)), pa.array(np.arange(100, dtype=np.int64)),
                              pa.array(np.ones(100, np.float32))], schema=ANSWER_SCHEMA)

    class Floor(flight.FlightServerBase):
        def do_exchange(self, context, descriptor, reader, writer):
            began = False
            for chunk in reader:
                if chunk.data is None:
                    continue
                if not began:
                    writer.begin(ANSWER_SCHEMA)
                    began = True
                writer.write_batch(answer)
            if not began:
                writer.begin(ANSWER_SCHEMA)

    return Floor


def _client(port: int, calls: int, exchange: str) -> None:
    import pyarrow as pa
    import pyarrow.flight as flight

    from serving.protocol import REQUEST_SCHEMA, RETRIEVE_PATH

    conn = flight.connect(f"grpc://127.0.0.1:{port}")
    batch = pa.record_batch([pa.array([1]), pa.array(["x" * REQUEST_TEXT_BYTES]), pa.array([100], pa.int32())],
                            schema=REQUEST_SCHEMA)
    path = flight.FlightDescriptor.for_path(*RETRIEVE_PATH)
    if exchange == "stream":
        writer, reader = conn.do_exchange(path)
        writer.begin(REQUEST_SCHEMA)
        for _ in range(calls):
            writer.write_batch(batch)
            reader.read_chunk()
        writer.done_writing()
        writer.close()
    else:
        for _ in range(calls):
            writer, reader = conn.do_exchange(path)
            writer.begin(REQUEST_SCHEMA)
            writer.write_batch(batch)
            writer.done_writing()
            reader.read_chunk()
            writer.close()
    conn.close()


def _client_process(port: int, threads: int, calls: int, exchange: str) -> None:
    workers = [threading.Thread(target=_client, args=(port, calls, exchange)) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(port: int, clients: int, processes: int, calls: int, exchange: str) -> dict:
    ctx = mp.get_context("spawn")  # no fork of a process running gRPC threads
    per = clients // processes
    procs = [ctx.Process(target=_client_process, args=(port, per, calls, exchange)) for _ in range(processes)]
    c0, t0 = _cpu_s(), time.perf_counter()
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    seconds, cpu = time.perf_counter() - t0, _cpu_s() - c0
    n = per * processes * calls
    return {"exchange": exchange, "round_trips": n, "round_trips_per_s": round(n / seconds, 1),
            "server_cpu_ms_per_round_trip": round(1e3 * cpu / n, 4)}


def reuseport(port: int) -> dict:
    """Whether a second Flight server can listen on a port one already listens on."""
    try:
        second = _server_class()(f"grpc://127.0.0.1:{port}")
    except Exception as exc:  # noqa: BLE001 - the answer is whether it fails, and how
        return {"second_server_on_same_port": False, "error": str(exc).splitlines()[0]}
    second.shutdown()
    return {"second_server_on_same_port": True}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--client-processes", type=int, default=2)
    ap.add_argument("--calls", type=int, default=500, help="round trips per client thread")
    ap.add_argument("--exchange", default="stream,call")
    ap.add_argument("--check-reuseport", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.clients % args.client_processes:
        ap.error("--clients must be a multiple of --client-processes")
    server = _server_class()("grpc://127.0.0.1:0")
    try:
        out = {"clients": args.clients, "client_processes": args.client_processes, "calls_per_client": args.calls,
               "runs": [measure(server.port, args.clients, args.client_processes, args.calls, ex)
                        for ex in args.exchange.split(",")]}
        if args.check_reuseport:
            out["reuseport"] = reuseport(server.port)
    finally:
        server.shutdown()
    for run in out["runs"]:
        print(f"{run['exchange']}: {run['round_trips_per_s']:,.0f} round trips/s, server CPU "
              f"{run['server_cpu_ms_per_round_trip']:.3f} ms a round trip")
    if "reuseport" in out:
        print(f"a second server on the same port: {out['reuseport']}")
    if args.out:
        write_result(out, args.out, command=script_command("probe_flight_floor.py", argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
