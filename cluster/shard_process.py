"""One shard replica as a plain process (`python -m cluster.shard_process --data DIR --shard S --of N`):
the shard's slice of the corpus in a co-located engine, listening as a co-located Flight server on
127.0.0.1 (`ShardReplica.serve_flight`) until SIGTERM or SIGINT. With `--tiled COPIES` instead of
`--data`, the shard holds its own copies of a tiled pool laid out on the GPU (`gpu.tiled`: pools of
100M ads per GPU), checks its answers against the float64 reference, and says so when it announces.

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


TILED_CHECKS, TILED_CHECK_K = 4, 100  # a tiled shard's requests checked against the reference before it listens


def add_tiled_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """--tiled COPIES (`what` it makes) and the recipe of the pool (`gpu.tiled.TiledPool`)."""
    parser.add_argument("--tiled", type=int, default=None, metavar="COPIES",
                        help=f"instead of --data: {what}; COPIES copies of a generated base corpus")
    parser.add_argument("--base-ads", type=int, default=8192, help="--tiled: ads of the generated base corpus")
    parser.add_argument("--seed", type=int, default=0, help="--tiled: the base corpus's and the model's seed")
    parser.add_argument("--dim", type=int, default=64, help="--tiled: the embedding width D")


def tiled_pool_of(args, **more):
    """The `gpu.tiled.TiledPool` that `add_tiled_arguments`' options describe."""
    from gpu.tiled import TiledPool

    return TiledPool(args.base_ads, args.tiled, seed=args.seed, dim=args.dim, **more)


def main(argv=None) -> int:
    from andromeda_nb.hostmem import keep_freed_memory

    keep_freed_memory()  # batches' temporaries reuse the heap's pages (andromeda_nb.hostmem)
    parser = argparse.ArgumentParser(prog="python -m cluster.shard_process", description=__doc__.split("\n")[0])
    parser.add_argument("--data", help="corpus directory (the shard's slice is cut here)")
    add_tiled_arguments(parser, "a tiled pool on the GPU (gpu.tiled) for this shard (copies shard*COPIES onwards), "
                                "checked against the float64 reference before it listens")
    parser.add_argument("--shard", type=int, required=True)
    parser.add_argument("--of", dest="shards", type=int, required=True, help="number of shards")
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu", "sim"))
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="stop when this process is gone (the command that started the shard, even when killed)")
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="the interpreter's thread switch interval (default: a co-located server's, "
                             "andromeda_nb.serving.SWITCH_INTERVAL_MS)")
    args = parser.parse_args(argv)
    from andromeda_nb.serving import SWITCH_INTERVAL_MS, set_switch_interval

    set_switch_interval(SWITCH_INTERVAL_MS if args.switch_interval_ms is None else args.switch_interval_ms)
    if not 0 <= args.shard < args.shards:
        parser.error(f"--shard {args.shard} is outside 0..{args.shards - 1}")
    if (args.data is None) == (args.tiled is None):
        parser.error("give --data DIR (a corpus's slice) or --tiled COPIES (a tiled pool), one of them")
    if args.tiled is not None and args.device == "cpu":
        parser.error("--tiled pools live on the GPU: --device gpu (or sim)")
    from andromeda_nb.devices import resolve
    from andromeda_nb.services import announce

    resolve(args.device)  # before anything imports numba.cuda
    from .replica import ShardReplica

    checked = None
    if args.tiled is None:
        replica = ShardReplica(args.data, args.shard, args.shards, 0, device=args.device)
    else:
        from gpu.tiled import TiledEngine

        pool = tiled_pool_of(args).shard(args.shard, args.shards)
        engine = TiledEngine(pool, args.device)
        checks = engine.check(pool.requests[:TILED_CHECKS], TILED_CHECK_K)
        checked = {"requests": len(checks), "k": TILED_CHECK_K, "ok": all(c["ok"] for c in checks),
                   "max_abs_err": max(c["max_abs_err"] for c in checks)}
        if not checked["ok"]:
            print(f"shard {args.shard}: answers differ from the float64 reference: {checks}", file=sys.stderr)
            return 1
        replica = ShardReplica(pool, args.shard, args.shards, 0, device=args.device, engine=engine)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.parent_pid is not None:
        from andromeda_nb.serving import watch_parent

        watch_parent(args.parent_pid, stop)
    from .gpus import GPU_ENV

    # the GPU it was placed on (cluster.gpus), as its environment names it; None: not placed
    announce("shard", replica.serve_flight(), shard=args.shard, of=args.shards, ads=len(replica.engine),
             gpu=os.environ.get(GPU_ENV), **({"checked": checked} if checked else {}))
    stop.wait()
    replica.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
