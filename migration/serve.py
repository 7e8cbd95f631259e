"""Run the co-located server in the foreground (`andromeda serve colocated`, and
`python -m migration.serve ...` for the process `migration.colocated.ColocatedRetriever` starts), on the
engine for its `--device` (`migration.architectures.build_engine`).

When it listens it writes one JSON line to stdout, `{"service": "colocated", "location":
"grpc://HOST:PORT"}`, so a parent that asked for port 0 learns the port. SIGTERM or SIGINT stops it
cleanly (running calls finish, then the process exits 0).
"""

from __future__ import annotations

import argparse
import sys

from andromeda_nb.devices import DEVICES, resolve
from andromeda_nb.services import DEFAULT_HOST, announce, load_dataset_for_service


def run_colocated(dataset, *, host: str = DEFAULT_HOST, port: int = 0, device: str = "auto",
                  version=None, on_ready=None, out=None) -> None:
    """Serve until SIGTERM or SIGINT; `version`: the GPU scoring kernel (a number of the kernel lab;
    default: the shipped one)."""
    from .colocated import make_server

    server = make_server(dataset, f"grpc://{host}:{port}", device=device, version=version)

    def on_listening(srv):
        announce("colocated", f"grpc://{host}:{srv.port}", out, device=srv.engine.device)

    server.serve_until_stopped(on_ready or on_listening)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m migration.serve", description=__doc__.split("\n")[0])
    parser.add_argument("--data", help="corpus directory")
    parser.add_argument("--dataset-pickle", help="a pickled Dataset (written by ColocatedRetriever)")
    parser.add_argument("--host", default=DEFAULT_HOST)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--device", default="auto", choices=DEVICES)
    parser.add_argument("--version", type=int, default=None, help="scoring kernel version (of the kernel lab)")
    args = parser.parse_args(argv)
    resolve(args.device)  # before anything imports numba.cuda
    dataset = load_dataset_for_service(args.data, args.dataset_pickle)
    run_colocated(dataset, host=args.host, port=args.port, device=args.device, version=args.version)
    return 0


if __name__ == "__main__":
    sys.exit(main())
