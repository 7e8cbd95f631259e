"""Run the co-located server in the foreground (`andromeda serve colocated`, and
`python -m migration.colocated_server ...` for the process `migration.colocated.ColocatedRetriever` starts), on the
engine for its `--device` (`migration.architectures.build_engine`); with `--engines N` (N > 1), on N
engines in worker processes of their own behind one front (`serving.engine_front`,
`migration.engine_worker`), which build at once: it listens once all are ready; with `--fronts M`,
M front processes beside them, each a Flight server of its own whose batches go to an engine worker
as one call (`serving.lane_engine`).

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
                  layout: str | None = None, say=None, engines: int = 1, gpu_turn: bool = False,
                  endpoints: bool = False, overlap: bool = False, fronts: int = 0) -> None:
    """Serve the corpus directory `data` until SIGTERM or SIGINT; `version`: the GPU scoring kernel
    (a number of the kernel lab; default: the shipped one); `layout`: the GPU engine's slot order (None:
    its default); `say` (`andromeda_nb.progress.Say`): told each step of the start-up (the corpus's
    loading, the engine's construction) as it ends, with its seconds; `engines`: engine worker
    processes behind one front (1: the engine in this process, as always); `gpu_turn`: with several, the
    engines take turns on the device (`serving.batcher.GpuTurn`) instead of sharing it by time slices;
    `endpoints`: with several, each also serves the retrieve exchange on a port of its own, listed by the
    front's GetFlightInfo; `overlap`: each engine prepares its next batch on the host while the device
    answers the one before (`serving.overlap`); `fronts`: front processes beside the engine workers, each
    serving the retrieve exchange on a port of its own, listed by the server's GetFlightInfo
    (`serving.lane_engine`)."""
    from .colocated import make_pooled_server, make_server

    check_engines(engines)
    if overlap and gpu_turn:
        from serving.process import ServeError

        raise ServeError("--overlap-batches and --gpu-turn: an engine holding the GPU's turn has no batch to overlap; give one")
    if gpu_turn and engines == 1:
        from serving.process import ServeError

        raise ServeError("--gpu-turn: the turn is shared by several engines; give --engines 2 or more")
    if endpoints and engines == 1:
        from serving.process import ServeError

        raise ServeError("--endpoints: the endpoints are the engine workers' own servers; give --engines 2 or more")
    if isinstance(fronts, bool) or not isinstance(fronts, int) or fronts < 0:
        from serving.process import ServeError

        raise ServeError(f"--fronts {fronts!r}: expected a whole number of front processes, at least 0")
    if fronts and endpoints:
        from serving.process import ServeError

        raise ServeError("--fronts and --endpoints: the fronts are the listed endpoints; give one")
    settings = settings or ServerSettings()
    preflight(settings.host, settings.port, settings.guard)
    dataset, log = open_corpus(data, settings.log, say=say)
    options = dict(device=device, version=version, log=log, limits=settings.limits, guard=settings.guard,
                   batch_wait_s=batch_wait_s, decode_ahead=decode_ahead, layout=layout, say=say, overlap=overlap)
    try:
        if engines == 1 and not fronts:
            server = listen(lambda location: make_server(dataset, location, **options), settings.host, settings.port,
                            settings.guard)
        else:
            server = listen(lambda location: make_pooled_server(dataset, location, engines=engines,
                                                                gpu_turn=gpu_turn, endpoints=endpoints, fronts=fronts,
                                                                **options),
                            settings.host, settings.port, settings.guard)
    except BaseException:
        if log is not None:
            log.close()
        raise

    def on_listening(srv):
        announce("colocated", settings.guard.location(settings.host, srv.port), out, device=srv.device)

    server.serve_until_stopped(on_ready or on_listening, deadline_s=settings.stop_deadline_s,
                               parent_pid=settings.parent_pid)


def check_engines(engines) -> None:
    """`--engines`: a whole number of engine workers, at least 1."""
    from serving.process import ServeError

    if isinstance(engines, bool) or not isinstance(engines, int) or engines < 1:
        raise ServeError(f"--engines {engines!r}: expected a whole number of engines, at least 1 (1: the engine "
                         "in the server's process)")


def _engines_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1 engine, got {value}")
    return value


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
    parser.add_argument("--overlap-batches", action="store_true",
                        help="prepare the next engine batch on the host while the GPU answers the one before "
                             "(no gain on the CPU engine, which runs a batch in one piece)")
    parser.add_argument("--engines", type=_engines_arg, default=1,
                        help="engine worker processes behind one front (default 1: the engine in this process)")
    parser.add_argument("--gpu-turn", action="store_true",
                        help="with --engines N: the engines take turns on the GPU, a batch gathered while the others "
                             "run (default: they share it by time slices)")
    parser.add_argument("--endpoints", action="store_true",
                        help="with --engines N: each engine worker also serves the retrieve exchange on a port of its "
                             "own, listed by the front's GetFlightInfo (clients that follow it skip the front)")
    parser.add_argument("--fronts", type=int, default=0,
                        help="front processes beside the engine workers, each serving the retrieve exchange on a "
                             "port of its own and sending its batches to an engine worker as one call each")
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
                      say=to_stderr if args.steps else None, engines=args.engines, gpu_turn=args.gpu_turn,
                      endpoints=args.endpoints, overlap=args.overlap_batches, fronts=args.fronts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
