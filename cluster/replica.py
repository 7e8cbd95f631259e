"""One replica of one shard: the co-located engine for its device over the shard's slice of the pool
(`cluster.shards.shard_dataset`), and the sequence of update-log entries it has consumed.

Ray hosts it as an actor (`cluster.router`); it is a plain class, so it also runs in process. Every
answer carries the replica's sequence and is given only when that is the sequence the router expects:
a replica that Ray restarted (fresh from the corpus, sequence 0) answers nothing until it has caught
up from the shard's log, so a restart never shows as a stale answer.

With `serve_flight()` the replica also listens as a co-located server on 127.0.0.1 (the same
`["retrieve"]` exchange as `andromeda serve colocated`), which `benchmarks.cluster` times against the
actor calls.
"""

from __future__ import annotations

import os
import threading
import time

from andromeda_nb.engine import warm_up
from andromeda_nb.updates import IndexLiveIds, apply_updates, read_updates


class ShardReplica:
    """`dataset`: the shard's `Dataset` (or a corpus directory, sliced here); `device`: where its engine
    runs; `engine`: one built already over `dataset` (a tiled pool's, `benchmarks.tiled`), instead of
    `build_engine`'s."""

    def __init__(self, dataset, shard: int, n_shards: int, replica: int, device: str = "cpu", *, engine=None):
        from serving.hostmem import keep_freed_memory
        from migration.architectures import build_engine

        keep_freed_memory()  # a replica's process serves batches as any server's (serving.hostmem)

        if isinstance(dataset, (str, os.PathLike)):
            from andromeda_nb.store import load_dataset

            from .shards import shard_dataset

            dataset = shard_dataset(load_dataset(dataset), shard, n_shards)
        self.shard, self.n_shards, self.replica = shard, n_shards, replica
        self.model = dataset.model
        self.seed = dataset.seed
        self.engine = engine if engine is not None else build_engine(dataset, device)
        self.dataset = dataset
        self.applied = 0  # update-log entries consumed (applied or rejected)
        self.requests = 0
        self.started = time.time()
        self._lock = threading.Lock()
        self._server = None
        warm_up(self.engine, dataset.requests, (1,))  # every kernel before the first request

    def ping(self) -> int:
        """The replica's sequence (and proof that it is alive)."""
        return self.applied

    def retrieve(self, requests, k: int, expected: int):
        """(sequence, answers): answers [(ad ids int64, scores float32)] when the sequence is
        `expected`, else None (the caller brings the replica up to date first)."""
        with self._lock:
            if self.applied != expected:
                return self.applied, None
            self.requests += len(requests)
            return self.applied, self.engine.retrieve(requests, k)

    def apply(self, entries, start: int) -> dict:
        """Consume log entries [(line number, JSON line)] that begin at sequence `start`: `{"seq",
        "applied", "rejected": [Rejection.to_json()...]}` with the stream's own line numbers. Entries
        that do not begin at the replica's sequence change nothing (`"applied": None`)."""
        with self._lock:
            if start != self.applied:
                return {"seq": self.applied, "applied": None, "rejected": []}
            line_nos = [n for n, _ in entries]
            updates, malformed = read_updates([line for _, line in entries], seed=self.seed, dim=self.model.D,
                                              formats=self.model.F)
            not_live = apply_updates(updates, [self.engine], IndexLiveIds(self.engine))
            self.applied += len(entries)
            rejected = [{**r.to_json(), "line": line_nos[r.line_no - 1]} for r in malformed + not_live]
            return {"seq": self.applied, "applied": len(updates) - len(not_live), "rejected": rejected}

    def describe(self) -> dict:
        return {"shard": self.shard, "replica": self.replica, "seq": self.applied, "requests": self.requests,
                "uptime_s": round(time.time() - self.started, 3), "pid": os.getpid(),
                "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"),  # where Ray or cluster.gpus placed it; None: not placed
                **self.engine.describe()}

    def serve_flight(self, host: str = "127.0.0.1") -> str:
        """Listen as a co-located server on `host` (a free port) beside the actor calls; its location."""
        if self._server is None:
            from serving.engine_server import EngineServer

            self._server = EngineServer(self.engine, self.dataset, f"grpc://{host}:0")
            self._server._lock = self._lock  # one batch on the engine at a time, whichever path it came by
            threading.Thread(target=self._server.serve, daemon=True).start()
        return f"grpc://{host}:{self._server.port}"

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
        self.engine.close()


__all__ = ["ShardReplica"]
