"""One shard replica as a plain process (`python -m cluster.shard_process --data DIR --shard S --of N`):
the shard's slice of the corpus in a co-located engine, listening as a co-located Flight server on
127.0.0.1 (`ShardReplica.serve_flight`) until SIGTERM or SIGINT.

`cluster.bench --placement processes` starts one per shard to time the Flight fan-out where Ray is
not installed (the GPU machine): the same shard engines and the same exchange Ray's actors host,
without Ray's placement, health checks and restarts.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading


def main(argv=None) -> int:
    from andromeda_nb.hostmem import keep_freed_memory

    keep_freed_memory()  # batches' temporaries reuse the heap's pages (andromeda_nb.hostmem)
    parser = argparse.ArgumentParser(prog="python -m cluster.shard_process", description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="corpus directory (the shard's slice is cut here)")
    parser.add_argument("--shard", type=int, required=True)
    parser.add_argument("--of", dest="shards", type=int, required=True, help="number of shards")
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="the interpreter's thread switch interval (default: a co-located server's, "
                             "andromeda_nb.serving.SWITCH_INTERVAL_MS)")
    args = parser.parse_args(argv)
    from andromeda_nb.serving import SWITCH_INTERVAL_MS, set_switch_interval

    set_switch_interval(SWITCH_INTERVAL_MS if args.switch_interval_ms is None else args.switch_interval_ms)
    if not 0 <= args.shard < args.shards:
        parser.error(f"--shard {args.shard} is outside 0..{args.shards - 1}")
    from andromeda_nb.devices import resolve
    from andromeda_nb.services import announce

    resolve(args.device)  # before anything imports numba.cuda
    from .replica import ShardReplica

    replica = ShardReplica(args.data, args.shard, args.shards, 0, device=args.device)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    from .gpus import GPU_ENV

    # the GPU it was placed on (cluster.gpus), as its environment names it; None: not placed
    announce("shard", replica.serve_flight(), shard=args.shard, of=args.shards, ads=len(replica.engine),
             gpu=os.environ.get(GPU_ENV))
    stop.wait()
    replica.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
