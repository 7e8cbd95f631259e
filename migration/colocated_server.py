"""Run the co-located server in the foreground (`andromeda serve colocated`, and
`python -m migration.colocated_server ...` for the process `migration.colocated.ColocatedRetriever` starts), on the
engine for its `--device` (`migration.architectures.build_engine`).

It keeps its update log by default beside its corpus (`DIR/updates.log`; `--log PATH`, or `--log
off` for none) and replays it before it listens. When it listens it writes one JSON line to stdout,
`{"service": "colocated", "location": "grpc://HOST:PORT"}`, so a parent that asked for port 0 learns
the port. SIGTERM or SIGINT stops it within `--stop-deadline` seconds (batches in flight finish;
`serving.process`); with `--parent-pid` it also stops when that process is gone.
"""

from __future__ import annotations

import argparse
import sys

from andromeda_nb.constants import LAYOUTS
from andromeda_nb.devices import DEVICES, resolve
from andromeda_nb.progress import to_stderr
from serving.process import (SWITCH_INTERVAL_MS, ServerSettings, add_server_arguments, listen, preflight,
                                  service_errors, set_switch_interval, settings_from_args)
from serving.services import announce, open_corpus


def run_colocated(data, settings: ServerSettings | None = None, *, device: str = "auto", version=None,
                  on_ready=None, out=None, batch_wait_s: float | None = None, decode_ahead: bool = False,
                  layout: str | None = None, say=None) -> None:
    """Serve the corpus directory `data` until SIGTERM or SIGINT; `version`: the GPU scoring kernel
    (a number of the kernel lab; default: the shipped one); `layout`: the GPU engine's slot order (None:
    its default); `say` (`andromeda_nb.progress.Say`): told each step of the start-up (the corpus's
    loading, the engine's construction) as it ends, with its seconds."""
    from .colocated import make_server

    settings = settings or ServerSettings()
    preflight(settings.host, settings.port, settings.guard)
    dataset, log = open_corpus(data, settings.log, say=say)
    try:
        server = listen(lambda location: make_server(dataset, location, device=device, version=version, log=log,
                                                     limits=settings.limits, guard=settings.guard,
                                                     batch_wait_s=batch_wait_s, decode_ahead=decode_ahead,
                                                     layout=layout, say=say),
                        settings.host, settings.port, settings.guard)
    except BaseException:
        if log is not None:
            log.close()
        raise

    def on_listening(srv):
        announce("colocated", settings.guard.location(settings.host, srv.port), out, device=srv.engine.device)

    server.serve_until_stopped(on_ready or on_listening, deadline_s=settings.stop_deadline_s,
                               parent_pid=settings.parent_pid)


def main(argv=None) -> int:
    from serving.hostmem import keep_freed_memory

    keep_freed_memory()  # batches' temporaries reuse the heap's pages (serving.hostmem)
    parser = argparse.ArgumentParser(prog="python -m migration.colocated_server", description=__doc__.split("\n")[0])
    parser.add_argument("--data", help="corpus directory")
    add_server_arguments(parser)
    parser.add_argument("--device", default="auto", choices=DEVICES)
    parser.add_argument("--version", type=int, default=None, help="scoring kernel version (a shipped one: gpu/kernels/score.py VERSIONS)")
    parser.add_argument("--layout", default=None, choices=LAYOUTS,
                        help="the GPU engine's slot order: the corpus's, or clustered by geography (default: geo)")
    parser.add_argument("--batch-wait-ms", type=float, default=None,
                        help="longest wait of a request for others to share its engine batch (default 0.2)")
    parser.add_argument("--decode-ahead", action="store_true",
                        help="decode requests on a thread a stage ahead of the engine, not between batches")
    parser.add_argument("--steps", action="store_true",
                        help="say each step of the start-up on stderr (the corpus's load, the engine's build)")
    parser.add_argument("--switch-interval-ms", type=float, default=SWITCH_INTERVAL_MS,
                        help=f"the interpreter's thread switch interval (default {SWITCH_INTERVAL_MS} ms; Python's: 5)")
    args = parser.parse_args(argv)
    set_switch_interval(args.switch_interval_ms)
    with service_errors("colocated"):
        settings = settings_from_args(args)
        resolve(args.device)  # before anything imports numba.cuda
        run_colocated(args.data, settings, device=args.device, version=args.version,
                      batch_wait_s=None if args.batch_wait_ms is None else args.batch_wait_ms / 1e3,
                      decode_ahead=args.decode_ahead, layout=args.layout,
                      say=to_stderr if args.steps else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
