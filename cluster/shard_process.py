"""One shard replica as a plain process (`python -m cluster.shard_process --data DIR --shard S --of N`):
the shard's slice of the corpus in a co-located engine, listening as a co-located Flight server on
127.0.0.1 (`ShardReplica.serve_flight`) until SIGTERM or SIGINT.

`benchmarks.cluster --placement processes` starts one per shard to time the Flight fan-out where Ray is
not installed (the GPU machine): the same shard engines and the same exchange Ray's actors host,
without Ray's placement, health checks and restarts. A shard over a tiled pool on the GPU is the
benchmarks' own entry, `benchmarks.tiled_shard`, which serves through `serve_replica` here.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading


def shard_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The options every shard process takes: which shard, of how many, where it runs, whom it outlives."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--shard", type=int, required=True)
    parser.add_argument("--of", dest="shards", type=int, required=True, help="number of shards")
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu", "sim"))
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="stop when this process is gone (the command that started the shard, even when killed)")
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="the interpreter's thread switch interval (default: a co-located server's, "
                             "serving.process.SWITCH_INTERVAL_MS)")
    return parser


def start_shard(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Parse, then set the process up as a serving one (heap kept, switch interval, device chosen
    before anything imports numba.cuda)."""
    from andromeda_nb.devices import resolve
    from serving.hostmem import keep_freed_memory
    from serving.process import SWITCH_INTERVAL_MS, set_switch_interval

    keep_freed_memory()  # batches' temporaries reuse the heap's pages (serving.hostmem)
    args = parser.parse_args(argv)
    set_switch_interval(SWITCH_INTERVAL_MS if args.switch_interval_ms is None else args.switch_interval_ms)
    if not 0 <= args.shard < args.shards:
        parser.error(f"--shard {args.shard} is outside 0..{args.shards - 1}")
    resolve(args.device)
    return args


def serve_replica(replica, args: argparse.Namespace, **announced) -> int:
    """Serve `replica` over Flight, announce it (with `announced`), and wait for SIGTERM, SIGINT or the
    end of the parent process."""
    from serving.process import StopSignals, watch_parent
    from serving.services import announce

    from .gpus import GPU_ENV

    stop = threading.Event()
    signals = StopSignals()  # handlers that take no lock (a handler calling stop.set() could wait on stop's own)
    if args.parent_pid is not None:
        watch_parent(args.parent_pid, stop)
    # the GPU it was placed on (cluster.gpus), as its environment names it; None: not placed
    announce("shard", replica.serve_flight(), shard=args.shard, of=args.shards, ads=len(replica.engine),
             gpu=os.environ.get(GPU_ENV), **announced)
    signals.wait(stop)
    replica.close()
    return 0


def main(argv=None) -> int:
    parser = shard_parser("python -m cluster.shard_process", __doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="corpus directory (the shard's slice is cut here)")
    args = start_shard(parser, argv)
    from .replica import ShardReplica

    return serve_replica(ShardReplica(args.data, args.shard, args.shards, 0, device=args.device), args)


if __name__ == "__main__":
    sys.exit(main())
