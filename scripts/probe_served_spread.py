"""What the co-located design serves with no front at all: `--servers` one-engine servers (`serve
colocated`, each a process of its own with its own engine on `--device`, one GPU shared, each on its
own port) and the clients spread evenly over them, so no request shares an interpreter lock with
another server's. It bounds what a front that hands its clients the workers' own addresses (Flight's
`GetFlightInfo` endpoints) could serve, against `andromeda bench served --engines N`, where one front
process relays every request. First the engine in process (`benchmarks.served.in_process`, as `bench
served` measures it): its answers checked against the float64 reference, its rate in batches of
`--batch`; then every server's answers to the corpus's requests are checked equal to the in-process
ones, and during the timing each client's first pass against them. The result carries
`served_over_in_process`, the ratio `bench served`'s target reads.

    PYTHONPATH=. python3 scripts/probe_served_spread.py --data DIR --device gpu --servers 4 \\
        --clients 32 --client-processes 8 --seconds 8 --out FILE
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="corpus directory (made by `andromeda generate`)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--client-processes", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--exchange", default="stream", choices=("call", "stream"))
    ap.add_argument("--batch", type=int, default=64, help="requests per in-process batch (the rate compared with)")
    ap.add_argument("--repeat", type=int, default=2, help="in-process passes")
    ap.add_argument("--checks", type=int, default=16, help="in-process answers checked against the float64 reference")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.servers < 1:
        ap.error("--servers must be at least 1")
    if args.clients % args.client_processes or args.clients < args.servers:
        ap.error("--clients must be a multiple of --client-processes and at least --servers")

    import numpy as np

    from andromeda_nb.devices import resolve
    from andromeda_nb.measure import log
    from andromeda_nb.provenance import finish_probe
    from andromeda_nb.store import load_dataset
    from benchmarks.clients import drive
    from benchmarks.served import check_against_reference, in_process
    from serving import protocol as fl
    from serving.services import ServiceProcess

    dataset = load_dataset(args.data)
    want, runs = in_process(dataset, resolve(args.device), args.k, [args.batch], args.repeat)
    checked = check_against_reference(dataset, want, args.k, args.checks)
    log(True, f"in process, batches of {args.batch}: {runs[0]['requests_per_s']:,.0f} requests/s; answers against "
              f"the float64 reference: {'ok' if checked['ok'] else 'FAILED'} ({checked['requests']} requests)")
    if not checked["ok"]:
        raise SystemExit(f"the in-process answers differ from the float64 reference: {checked['failures']}; nothing timed")
    started = time.perf_counter()
    servers = []
    try:
        for i in range(args.servers):  # started together: they load and build at once
            servers.append(ServiceProcess("migration.colocated_server",
                                          ["--data", args.data, "--device", args.device, "--port", "0", "--log", "off"],
                                          name=f"server {i + 1}"))
        log(True, f"{args.servers} servers ready: {time.perf_counter() - started:.1f} s")
        requests = dataset.requests
        for i, server in enumerate(servers, 1):
            got = fl.retrieve_over_flight(server.location, requests, args.k)
            for r, (ids, scores), (want_ids, want_scores) in zip(requests, got, want):
                if not (np.array_equal(ids, want_ids) and np.array_equal(scores, want_scores)):
                    raise SystemExit(f"server {i} answers request {r.request_id} unlike the engine in process: "
                                     "nothing timed")
        result = drive([s.location for s in servers], args.data, k=args.k, clients=args.clients,
                       processes=args.client_processes, seconds=args.seconds, want=want,
                       exchange=args.exchange)
        stats = [fl.flight_action(s.location, "stats") for s in servers]
    finally:
        for server in servers:
            server.stop()
    out = {"kind": "served_spread", "servers": args.servers, "device": args.device, "k": args.k,
           "requests_checked": len(requests), "reference_check": checked, "in_process": runs[0], **result,
           "served_over_in_process": result["requests_per_s"] / runs[0]["requests_per_s"],
           "per_server": [{"requests": s.get("requests"), "batches": s.get("batches"),
                           "batching": s.get("batching"), "call_path": s.get("call_path")} for s in stats]}
    log(True, f"{args.servers} servers, {args.clients} clients in {args.client_processes} processes: "
              f"{out['requests_per_s']:,.0f} requests/s ({out['served_over_in_process']:.0%} of in process), "
              f"p50 {out['latency_ms']['p50']:.2f} ms, "
              f"p99 {out['latency_ms']['p99']:.2f} ms, wrong answers {out['n_wrong']}")
    finish_probe(out, "probe_served_spread.py", sys.argv[1:] if argv is None else argv, args.out)
    return 0 if out["n_wrong"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
