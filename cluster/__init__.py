"""Scale-out of the co-located design on Ray: the pool split into shards by a stable hash of the ad
id, each shard a co-located engine (`migration.architectures.build_engine`, GPU or CPU) with
replicas, a router that fans every request out to one replica of each shard and merges the shards'
top-K exactly by DESIGN section 4's rule, updates sent to the owning shard's replicas and kept in a
per-shard log a restarted replica catches up from.

    shards    what needs no Ray: ownership (`shard_of`), a shard's slice of a corpus, the exact
              merge, the per-shard update log, routing an update stream to its owners
    replica   one replica of one shard (the class Ray hosts as an actor)
    router    the cluster: Ray start or join, placement, fan-out, fail-over, catch-up;
              `ShardedRetriever` (`retrieve --arch sharded`)
    serve     the front Flight server (`andromeda serve cluster`): the co-located server's protocol
    gpus      which GPU each shard process of one host uses (shard s on GPU s mod G)
    bench     the data-path measurement (Ray actor calls against Flight to shard endpoints) and the
              fan-out overhead against one in-process engine

Ray is an optional dependency (`pip install -e ".[cluster]"`); `require_ray` says so when it is
missing. This package sits above `migration` (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

INSTALL_HINT = 'pip install -e ".[cluster]"'


class RayMissing(RuntimeError):
    """Ray is not installed: the cluster commands need the `cluster` extra."""


def require_ray():
    """The `ray` module, or RayMissing naming the install command."""
    try:
        import ray
    except ImportError:
        raise RayMissing(f"the cluster needs Ray, which is not installed here; install it with {INSTALL_HINT}") from None
    return ray


__all__ = ["INSTALL_HINT", "RayMissing", "require_ray"]
