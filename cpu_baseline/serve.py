"""Run the scoring service or the index host in the foreground (`andromeda serve scorer|remote`, and
`python -m cpu_baseline.serve scorer|remote ...` for the processes `RemoteRetriever` starts).

When a server listens it writes one JSON line to stdout, `{"service": ..., "location":
"grpc://127.0.0.1:PORT"}`, so a parent that asked for port 0 learns the port. SIGTERM or SIGINT
stops it cleanly (running calls finish, then the process exits 0).
"""

from __future__ import annotations

import argparse
import sys

from andromeda_nb.flight import location_of, serve_until_stopped
from andromeda_nb.services import DEFAULT_HOST, announce, load_dataset_for_service


def _announce(service: str, out=None):
    def on_ready(server):
        announce(service, f"grpc://{DEFAULT_HOST}:{server.port}", out)

    return on_ready


def run_scorer(dataset, *, host: str = DEFAULT_HOST, port: int = 0, threads: int | None = None,
               delay_s: float = 0.0, on_ready=None) -> None:
    from .scorer import set_threads
    from .scoring_service import ScoringServer

    set_threads(threads)
    server = ScoringServer(dataset, f"grpc://{host}:{port}", delay_s=delay_s)
    serve_until_stopped(server, server._stopping, on_ready or _announce("scorer"))


def run_index_host(dataset, scorer: str, *, host: str = DEFAULT_HOST, port: int = 0, threads: int | None = None,
                   scorer_timeout_s: float = 10.0, on_ready=None) -> None:
    from .index_host import IndexHostServer

    server = IndexHostServer(dataset, location_of(scorer), f"grpc://{host}:{port}",
                             scorer_timeout_s=scorer_timeout_s, threads=threads)
    server.serve_until_stopped(on_ready or _announce("remote"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cpu_baseline.serve", description=__doc__.split("\n")[0])
    parser.add_argument("service", choices=("scorer", "remote"))
    parser.add_argument("--data", help="corpus directory")
    parser.add_argument("--dataset-pickle", help="a pickled Dataset (written by RemoteRetriever)")
    parser.add_argument("--host", default=DEFAULT_HOST)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--scorer", help="scoring service address (remote only)")
    parser.add_argument("--scorer-timeout", type=float, default=10.0)
    parser.add_argument("--delay", type=float, default=0.0, help=argparse.SUPPRESS)  # test hook: slow scorer
    args = parser.parse_args(argv)
    dataset = load_dataset_for_service(args.data, args.dataset_pickle)
    if args.service == "scorer":
        run_scorer(dataset, host=args.host, port=args.port, threads=args.threads, delay_s=args.delay)
    else:
        if not args.scorer:
            parser.error("remote needs --scorer ADDRESS")
        run_index_host(dataset, args.scorer, host=args.host, port=args.port, threads=args.threads,
                       scorer_timeout_s=args.scorer_timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
