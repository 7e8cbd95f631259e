"""The front of the cluster (`andromeda serve cluster`): the co-located server's protocol (the
`["retrieve"]` exchange, `health`, `stats`, `update`; docs/PROTOCOL.md) over the router, so a client of
`serve colocated` asks a cluster unchanged.

Requests are parsed and checked here once (`serving.protocol.RetrieveServer`) and go to the shards
as parsed requests; a shard with no live replica fails the exchange with `FlightUnavailableError`
("shard S of N is unavailable: ..."), never a partial answer.

The requests of exchanges that arrive together go to the shards as one batch (`serving.batcher`, as
the co-located server does): a replica on a GPU answers a batch in about the time of one request. A
front keeps as many batches in flight as a shard has replicas (one batcher each, the calls dealt to
them in turn), so every replica of a shard can be busy at once.
"""

from __future__ import annotations

import itertools

from serving.batcher import DEFAULT_MAX_WAIT_S, RequestBatcher
from serving.protocol import InvalidInput, RetrieveServer
from andromeda_nb.dataset import fingerprint

from .router import Cluster, ShardUnavailable


class ClusterServer(RetrieveServer):
    name = "cluster"

    def __init__(self, cluster: Cluster, dataset, location: str = "grpc://127.0.0.1:0", *, limits=None, guard=None,
                 batch_wait_s: float = DEFAULT_MAX_WAIT_S):
        model = dataset.model
        super().__init__(location, seed=dataset.seed, experts=model.E, width=model.S, limits=limits, guard=guard)
        self.cluster = cluster
        self.router = cluster.router
        self.describe = {"device": cluster.device, "precision": dataset.precision, "D": model.D, "E": model.E,
                         "F": model.F, "top_k": model.top_k}
        self.fingerprint = fingerprint(dataset.ad_ids)
        # one batch in flight per replica of a shard (the module docstring)
        self.batchers = [RequestBatcher(self._run_batch, max_wait_s=batch_wait_s,
                                        max_requests=self.limits.max_batch_requests, name=f"cluster-batcher-{i}")
                         for i in range(max(1, len(self.router.replicas[0])))]
        self._deal = itertools.count()  # calls dealt to the batchers in turn

    def _run_batch(self, requests, k):
        return self.router.retrieve(requests, k), None

    def retrieve(self, requests, ks):
        import pyarrow.flight as flight

        batcher = self.batchers[next(self._deal) % len(self.batchers)]
        try:
            answers, _ = batcher.submit(requests, ks)  # each cut to its own k
        except ShardUnavailable as exc:
            raise flight.FlightUnavailableError(str(exc)) from None
        return answers

    def apply_updates(self, body: bytes, started: float) -> dict:
        import pyarrow.flight as flight

        body = bytes(body)  # the streamed exchange's chunks (serving.update_body.ChunkedBody) joined
        if len(body) > self.limits.max_update_bytes:
            raise self.limits.over("max_update_bytes", len(body), "update body of bytes")
        try:
            text = body.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise InvalidInput(f"the update body is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        try:
            ack = self.router.update(text, deadline_s=self.limits.deadline_s, stopping=self._stopping)
        except ShardUnavailable as exc:
            raise flight.FlightUnavailableError(str(exc)) from None
        self.stats.add(updates=ack["applied"])
        return ack

    def health_info(self) -> dict:
        state = self.router.health()
        replicas = len(self.router.replicas[0])
        return {**self.describe, "ads": state["ads"], "shards": state["shards"], "replicas": replicas,
                "available": state["available"], "fingerprint": self.fingerprint, "shard_state": state["shard_state"],
                "log": self.router.log.describe(), "replayed": self.cluster.replayed}

    def extra_stats(self) -> dict:
        return {"batching": _summed([b.stats() for b in self.batchers]), "shards": self.router.n_shards,
                "replica_failures": sum(h.failures for hs in self.router.replicas for h in hs),
                "log_seq": [self.router.log.seq(s) for s in range(self.router.n_shards)]}

    def close_resources(self) -> None:
        for batcher in self.batchers:
            batcher.close()
        self.cluster.close()


def _summed(stats: list[dict]) -> dict:
    """The batchers' counters added up, and their per-batch times weighted by their batches."""
    batches = sum(s["batches"] for s in stats)
    per_batch = {key: sum(s["per_batch_ms"][key] * s["batches"] for s in stats) / max(1, batches)
                 for key in stats[0]["per_batch_ms"]}
    return {"batchers": len(stats), "batches": batches, "calls": sum(s["calls"] for s in stats),
            "requests": sum(s["requests"] for s in stats), "max_wait_ms": stats[0]["max_wait_ms"],
            "per_batch_ms": per_batch}


def cluster_log(dataset, shards: int, log: str | None, data_dir=None):
    """The front's per-shard log: `log` None for the default, one write-ahead log per shard in
    `DATA/cluster-log` (memory only when there is no corpus directory); 'off' for memory only; else
    the directory."""
    from pathlib import Path

    from .shards import DurableShardLog, ShardLog

    if log == "off" or (log is None and data_dir is None):
        return ShardLog(shards)
    return DurableShardLog(Path(data_dir) / CLUSTER_LOG_DIR if log is None else log, dataset, shards)


CLUSTER_LOG_DIR = "cluster-log"


def run_cluster(dataset, settings=None, *, shards: int, replicas: int = 1, device: str = "cpu",
                address: str | None = None, on_ready=None, progress=None, data_dir=None) -> None:
    """Start (or join) Ray, place the shards, replay the per-shard log into them, serve the front
    (`settings`: an `serving.process.ServerSettings`: address, tokens and TLS, limits, log, stop
    deadline) until SIGTERM or SIGINT, then end the replicas (and Ray, when it was started here)."""
    from serving.process import ServerSettings, listen

    settings = settings or ServerSettings()
    log = cluster_log(dataset, shards, settings.log, data_dir)  # its lock first: a second front is refused early
    cluster = Cluster.start(dataset, shards=shards, replicas=replicas, device=device, address=address,
                            progress=progress, log=log)
    try:
        server = listen(lambda location: ClusterServer(cluster, dataset, location, limits=settings.limits,
                                                       guard=settings.guard),
                        settings.host, settings.port, settings.guard)
    except BaseException:
        cluster.close()
        raise
    try:
        server.serve_until_stopped(on_ready, deadline_s=settings.stop_deadline_s, parent_pid=settings.parent_pid)
    finally:
        cluster.close()


__all__ = ["CLUSTER_LOG_DIR", "ClusterServer", "cluster_log", "run_cluster"]
