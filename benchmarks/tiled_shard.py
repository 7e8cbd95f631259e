"""One shard over a tiled pool on the GPU, as a plain process (`python -m benchmarks.tiled_shard --tiled
COPIES --shard S --of N`): the shard holds its own copies of a tiled pool laid out on the device
(`benchmarks.tiled`: pools of 100M ads per GPU), checks its answers against the float64 reference,
says so when it announces, and listens as `cluster.shard_process` does. `benchmarks.cluster --tiled`
starts one per shard.
"""

from __future__ import annotations

import argparse
import sys

from cluster.shard_process import serve_replica, shard_parser, start_shard

TILED_CHECKS, TILED_CHECK_K = 4, 100  # a tiled shard's requests checked against the reference before it listens


def add_tiled_arguments(parser: argparse.ArgumentParser, what: str, *, required: bool = False) -> None:
    """--tiled COPIES (`what` it makes) and the recipe of the pool (`benchmarks.tiled.TiledPool`)."""
    parser.add_argument("--tiled", type=int, default=None, required=required, metavar="COPIES",
                        help=f"{what}; COPIES copies of a generated base corpus")
    parser.add_argument("--base-ads", type=int, default=8192, help="--tiled: ads of the generated base corpus")
    parser.add_argument("--seed", type=int, default=0, help="--tiled: the base corpus's and the model's seed")
    parser.add_argument("--dim", type=int, default=64, help="--tiled: the embedding width D")


def tiled_pool_of(args, **more):
    """The `benchmarks.tiled.TiledPool` that `add_tiled_arguments`' options describe."""
    from .tiled import TiledPool

    return TiledPool(args.base_ads, args.tiled, seed=args.seed, dim=args.dim, **more)


def main(argv=None) -> int:
    parser = shard_parser("python -m benchmarks.tiled_shard", __doc__.split("\n")[0])
    add_tiled_arguments(parser, "a tiled pool on the GPU for this shard (copies shard*COPIES onwards), checked "
                                "against the float64 reference before it listens", required=True)
    args = start_shard(parser, argv)
    if args.device == "cpu":
        parser.error("--tiled pools live on the GPU: --device gpu (or sim)")
    from cluster.replica import ShardReplica

    from .tiled import TiledEngine

    pool = tiled_pool_of(args).shard(args.shard, args.shards)
    engine = TiledEngine(pool, args.device)
    checks = engine.check(pool.requests[:TILED_CHECKS], TILED_CHECK_K)
    checked = {"requests": len(checks), "k": TILED_CHECK_K, "ok": all(c["ok"] for c in checks),
               "max_abs_err": max(c["max_abs_err"] for c in checks)}
    if not checked["ok"]:
        print(f"shard {args.shard}: answers differ from the float64 reference: {checks}", file=sys.stderr)
        return 1
    replica = ShardReplica(pool, args.shard, args.shards, 0, device=args.device, engine=engine)
    return serve_replica(replica, args, checked=checked)


if __name__ == "__main__":
    sys.exit(main())
