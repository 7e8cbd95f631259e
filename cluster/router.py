"""The cluster on Ray: shard replicas placed as actors, and the router that fans each request out to one
replica of every shard and merges their top-K exactly (`cluster.shards.merge_topk`).

* Placement: `Cluster.start` starts a local Ray instance (or joins the one at `address`), cuts the
  corpus into shards (`shard_dataset`, each slice put in Ray's object store once and shared by its
  replicas) and starts `shards x replicas` actors of `cluster.replica.ShardReplica`, spread over the
  nodes, restarted by Ray when they die (`max_restarts=-1`).
* Requests: the router calls one replica per shard (round robin over the live ones) with the shard
  log's sequence; a replica that dies or cannot be reached is marked down and the next replica of the
  shard is asked; a shard with no live replica is `ShardUnavailable`, and the whole request fails:
  an answer never leaves out a shard. A down replica is probed without waiting on later requests;
  once it answers, it is brought up to the log's end before it serves.
* Updates: routed to the owning shard (`route_updates`), appended to that shard's log, applied by
  every live replica; a replica that was down replays what it missed from the log (`ShardLog` in
  memory, or `DurableShardLog` on disk: then a front started again replays the log into its fresh
  replicas before it serves, `Router.catch_up`). Updates wait for running requests
  and requests for running updates, so an acknowledged update is visible to every later request.
* `ShardedRetriever`: `interfaces.Retriever` over a cluster started for one command
  (`retrieve --arch sharded`).
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Sequence

from andromeda_nb.progress import Say
from andromeda_nb.updates import Rejection, update_answer
from serving.durable import DeadlineExceeded, ServerStopping

from . import require_ray
from .shards import ShardLog, merge_topk, route_updates, shard_dataset

CALL_TIMEOUT_S = 120.0  # a replica that does not answer within this is treated as down
START_TIMEOUT_S = 900.0  # a replica loads its slice and builds its engine (minutes for millions of ads)
MAX_SYNC_ROUNDS = 8  # catch-up attempts before a replica that keeps falling behind is given up


class ShardUnavailable(RuntimeError):
    """No replica of a shard answers: the request fails rather than come back without the shard."""


class _ReplicaDown(Exception):
    pass


@dataclass
class ReplicaHandle:
    shard: int
    replica: int
    actor: object
    up: bool = True
    seq: int = 0  # the replica's sequence as last reported
    error: str | None = None
    probe: object = None  # a ping in flight to a down replica
    failures: int = 0


class _ReadWriteLock:
    """Many requests at once, or one update stream alone. A writer waiting keeps new readers out (the
    ones in flight finish), so a stream of requests cannot hold an update off past its deadline."""

    WAIT_STEP_S = 0.1  # how often a waiting writer looks at `stopping`

    def __init__(self, clock=time.monotonic):
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0
        self._clock = clock

    @contextmanager
    def read(self):
        with self._cond:
            while self._writing or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextmanager
    def write(self, deadline_s: float | None = None, stopping: threading.Event | None = None):
        """The lock alone; `deadline_s`: give up after waiting that long (`DeadlineExceeded`);
        `stopping`: give up when it is set (`ServerStopping`). Either way nothing was done under it."""
        since = self._clock()
        with self._cond:
            self._writers_waiting += 1
            try:
                while self._writing or self._readers:
                    if stopping is not None and stopping.is_set():
                        raise ServerStopping("the server is stopping: nothing of this update call was logged or "
                                             "applied; send it again once the server is back")
                    left = None if deadline_s is None else deadline_s - (self._clock() - since)
                    if left is not None and left <= 0:
                        raise DeadlineExceeded(f"the update call waited {self._clock() - since:.1f} s for its turn, "
                                               f"past the server's deadline of {deadline_s:g} s (--deadline); "
                                               "nothing was applied")
                    self._cond.wait(self.WAIT_STEP_S if left is None else min(left, self.WAIT_STEP_S))
                self._writing = True
            finally:
                self._writers_waiting -= 1
                self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


@dataclass
class Router:
    """Fan-out, merge, fail-over and catch-up over `replicas[shard][replica]` handles."""

    replicas: list[list[ReplicaHandle]]
    seed: int
    dim: int
    formats: int
    log: ShardLog = None
    timeout_s: float = CALL_TIMEOUT_S
    _next: list[int] = field(default_factory=list)
    _rw: _ReadWriteLock = field(default_factory=_ReadWriteLock)

    def __post_init__(self):
        self.ray = require_ray()
        self.log = self.log or ShardLog(len(self.replicas))
        self._next = [0] * len(self.replicas)
        self._pick_lock = threading.Lock()

    @property
    def n_shards(self) -> int:
        return len(self.replicas)

    # --- replica calls ---------------------------------------------------------------------------------
    def _get(self, handle: ReplicaHandle, ref):
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            return self.ray.get(ref, timeout=self.timeout_s)
        except (RayActorError, GetTimeoutError) as exc:
            self._mark_down(handle, exc)
            raise _ReplicaDown(str(exc)) from None

    def _mark_down(self, handle: ReplicaHandle, exc) -> None:
        handle.up, handle.probe, handle.failures = False, None, handle.failures + 1
        handle.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".strip(": ")

    def _refresh(self, shard: int) -> None:
        """Collect the probes of the shard's down replicas that have answered; start new ones."""
        for h in self.replicas[shard]:
            if h.up:
                continue
            if h.probe is None:
                h.probe = h.actor.ping.remote()
                continue
            ready, _ = self.ray.wait([h.probe], timeout=0)
            if not ready:
                continue
            try:
                h.seq = self.ray.get(h.probe)
                h.up, h.error = True, None
            except Exception as exc:  # still dead, or dead for good: try again next time
                h.error = f"{type(exc).__name__}"
            h.probe = None

    def _pick(self, shard: int, exclude: set[int]) -> ReplicaHandle:
        with self._pick_lock:
            self._refresh(shard)
            live = [h for h in self.replicas[shard] if h.up and h.replica not in exclude]
            if not live:
                raise ShardUnavailable(self._why_unavailable(shard))
            start = self._next[shard]
            self._next[shard] = (start + 1) % len(self.replicas[shard])
            return min(live, key=lambda h: (h.replica - start) % len(self.replicas[shard]))

    def _why_unavailable(self, shard: int) -> str:
        states = "; ".join(f"replica {h.replica}: {h.error or ('up' if h.up else 'down')}"
                           for h in self.replicas[shard])
        return f"shard {shard} of {self.n_shards} is unavailable: none of its {len(self.replicas[shard])} " \
               f"replicas answers ({states})"

    def _sync(self, h: ReplicaHandle, upto: int) -> None:
        """Bring replica `h` to sequence `upto` from the shard's log."""
        for _ in range(MAX_SYNC_ROUNDS):
            if h.seq == upto:
                return
            if h.seq > upto:
                raise RuntimeError(f"shard {h.shard} replica {h.replica} is at sequence {h.seq}, past the log's {upto}")
            entries = self.log.since(h.shard, h.seq)[: upto - h.seq]
            h.seq = self._get(h, h.actor.apply.remote(entries, h.seq))["seq"]
        self._mark_down(h, RuntimeError(f"did not reach sequence {upto} in {MAX_SYNC_ROUNDS} rounds"))
        raise _ReplicaDown(h.error)

    # --- requests --------------------------------------------------------------------------------------
    def retrieve(self, requests: Sequence, k: int) -> list:
        """Per request (ad ids int64, scores float32), the pool's top k in rank order; ShardUnavailable
        when a shard has no live replica."""
        requests = list(requests)
        if not requests:
            return []
        with self._rw.read():
            expected = [self.log.seq(s) for s in range(self.n_shards)]
            first = []
            for s in range(self.n_shards):
                h = self._pick(s, set())
                first.append((h, h.actor.retrieve.remote(requests, k, expected[s])))
            parts = [self._shard_answers(s, requests, k, expected[s], *first[s]) for s in range(self.n_shards)]
        return [merge_topk([p[i] for p in parts], k) for i in range(len(requests))]

    def _shard_answers(self, shard, requests, k, expected, h, ref):
        tried: set[int] = set()
        for _ in range(len(self.replicas[shard]) * (MAX_SYNC_ROUNDS + 1)):
            try:
                seq, answers = self._get(h, ref)
                h.seq = seq
                if answers is not None:
                    return answers
                self._sync(h, expected)  # a restarted or lagging replica: catch up, ask again
            except _ReplicaDown:
                tried.add(h.replica)
                h = self._pick(shard, tried)
            ref = h.actor.retrieve.remote(requests, k, expected)
        raise ShardUnavailable(self._why_unavailable(shard))

    # --- updates ---------------------------------------------------------------------------------------
    def update(self, text_or_lines, *, deadline_s: float | None = None, stopping: threading.Event | None = None
               ) -> dict:
        """Apply an update stream (JSON Lines): `{"applied": n, "rejected": [...]}` with the stream's
        line numbers. ShardUnavailable, before anything is applied, when an owning shard has no live
        replica. The stream is parsed and split before the call waits for its turn; `deadline_s`
        bounds the wait (DeadlineExceeded), and a server `stopping` (SIGTERM) ends a call not yet in
        the shards' logs (ServerStopping), nothing of it applied; once logged, it is applied and
        acknowledged."""
        per_shard, malformed = route_updates(text_or_lines, self.n_shards, seed=self.seed, dim=self.dim,
                                             formats=self.formats)
        with self._rw.write(deadline_s, stopping):
            if stopping is not None and stopping.is_set():
                raise ServerStopping("the server is stopping: nothing of this update call was logged or applied; "
                                     "send it again once the server is back")
            targets = [s for s in range(self.n_shards) if per_shard[s]]
            for s in targets:
                with self._pick_lock:
                    self._refresh(s)
                if not any(h.up for h in self.replicas[s]):
                    raise ShardUnavailable(self._why_unavailable(s) + "; no update of this stream was applied")
            applied, rejected = 0, [Rejection(r.line_no, r.ad_id, r.reason) for r in malformed]
            calls = []
            for s in targets:
                start = self.log.append(s, per_shard[s])
                calls += [(s, h, start, h.actor.apply.remote(per_shard[s], start)) for h in self.replicas[s] if h.up]
            acked: dict[int, dict] = {}
            for s, h, start, ref in calls:
                try:
                    ack = self._get(h, ref)
                    if ack["applied"] is None:  # it had fallen behind (a restart): catch up, then these lines
                        h.seq = ack["seq"]
                        self._sync(h, start)
                        ack = self._get(h, h.actor.apply.remote(per_shard[s], start))
                    h.seq = ack["seq"]
                    acked.setdefault(s, ack)
                except _ReplicaDown:
                    continue
            for s in targets:
                if s not in acked:
                    raise ShardUnavailable(self._why_unavailable(s) + "; its updates are in its log and apply "
                                           "when a replica is back")
                applied += acked[s]["applied"]
                rejected += [Rejection(r["line"], r["ad_id"], r["error"]) for r in acked[s]["rejected"]]
            return update_answer(applied, rejected)

    # --- state -----------------------------------------------------------------------------------------
    def health(self) -> dict:
        """Each shard's replicas (up, sequence, error) and the live ads over all shards."""
        shards, ads = [], 0
        for s in range(self.n_shards):
            with self._pick_lock:
                self._refresh(s)
            described = None
            for h in self.replicas[s]:
                if h.up and described is None:
                    try:
                        described = self._get(h, h.actor.describe.remote())
                    except _ReplicaDown:
                        pass
            ads += described["ads"] if described else 0
            shards.append({"shard": s, "log_seq": self.log.seq(s), "ads": described["ads"] if described else None,
                           "gpu": described.get("gpu") if described else None,  # the first live replica's
                           "replicas": [{"replica": h.replica, "up": h.up, "seq": h.seq, "error": h.error,
                                         "failures": h.failures} for h in self.replicas[s]]})
        return {"shards": len(shards), "ads": ads, "available": all(x["ads"] is not None for x in shards),
                "shard_state": shards}

    def catch_up(self, progress: Say | None = None) -> int:
        """Bring every live replica to its shard log's end (a front started on a durable log that
        holds updates: its replicas start from the corpus); returns the entries replayed per replica,
        summed over shards."""
        with self._rw.write():
            behind = sum(self.log.seq(s) for s in range(self.n_shards))
            if behind and progress:
                progress(f"replaying {behind:,} logged update(s) into {sum(map(len, self.replicas))} replica(s)")
            for hs in self.replicas:
                for h in hs:
                    if h.up:
                        try:
                            self._sync(h, self.log.seq(h.shard))
                        except _ReplicaDown:
                            pass  # marked down: it catches up when it answers again
            return behind

    def wait_all_up(self, timeout_s: float = 120.0) -> None:
        """Until every replica answers again (after a restart), or RuntimeError."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for s in range(self.n_shards):
                with self._pick_lock:
                    self._refresh(s)
            if all(h.up for hs in self.replicas for h in hs):
                return
            time.sleep(0.1)
        raise RuntimeError(f"replicas still down after {timeout_s:.0f} s")


class Cluster:
    """Shard replicas on Ray and the router over them. `close()` ends the actors, and Ray when this
    cluster started it."""

    def __init__(self, router: Router, actors: list, owns_ray: bool, device: str):
        self.router, self.actors, self.owns_ray, self.device = router, actors, owns_ray, device
        self.replayed = 0  # logged updates replayed into the replicas at start (a durable log)

    @classmethod
    def start(cls, dataset, *, shards: int, replicas: int = 1, device: str = "cpu", address: str | None = None,
              num_cpus: int | None = None, progress: Say | None = None, log=None) -> "Cluster":
        """`log`: the router's per-shard log (`ShardLog` in memory by default, or a `DurableShardLog`,
        whose entries are replayed into the replicas before this returns); closed with the cluster."""
        ray = require_ray()
        if shards < 1 or replicas < 1:
            raise ValueError(f"shards and replicas must be at least 1, got {shards} and {replicas}")
        if device not in ("cpu", "gpu"):
            raise ValueError(f"the cluster's shards run on gpu or cpu, not {device!r} (the simulator is for one "
                             "process: --arch colocated --device sim)")
        say = progress or (lambda message: None)
        owns = not ray.is_initialized()
        if owns:
            say(f"starting Ray{' (joining ' + address + ')' if address else ' locally'}")
            ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False,
                     **({} if address else {"num_cpus": num_cpus or os.cpu_count()}))
        from .replica import ShardReplica

        total = shards * replicas
        resources = {"num_cpus": 0}
        if device in ("gpu",):
            gpus = ray.cluster_resources().get("GPU", 0)
            if not gpus:
                raise RuntimeError("--device gpu: the Ray cluster has no GPU")
            resources["num_gpus"] = min(1.0, gpus / total)
        actor_class = ray.remote(ShardReplica).options(max_restarts=-1, max_task_retries=0,
                                                       scheduling_strategy="SPREAD", **resources)
        handles, actors = [], []
        try:
            for s in range(shards):
                part = ray.put(shard_dataset(dataset, s, shards))
                row = []
                for r in range(replicas):
                    actor = actor_class.remote(part, s, shards, r, device)
                    actors.append(actor)
                    row.append(ReplicaHandle(s, r, actor))
                handles.append(row)
            say(f"placing {shards} shard(s) x {replicas} replica(s) on {device}")
            pending = {a.ping.remote(): a for a in actors}
            while pending:
                ready, _ = ray.wait(list(pending), timeout=START_TIMEOUT_S)
                if not ready:
                    raise RuntimeError(f"{len(pending)} replica(s) did not start within {START_TIMEOUT_S:.0f} s")
                for ref in ready:
                    ray.get(ref)
                    pending.pop(ref)
                say(f"  {total - len(pending)} of {total} replicas ready")
            model = dataset.model
            router = Router(handles, seed=dataset.seed, dim=model.D, formats=model.F, log=log)
            replayed = router.catch_up(say)
        except BaseException:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            if owns:
                ray.shutdown()
            if log is not None:
                log.close()
            raise
        cluster = cls(router, actors, owns, device)
        cluster.replayed = replayed
        return cluster

    def replica(self, shard: int, replica: int):
        """The actor of one replica (the tests kill them)."""
        return self.router.replicas[shard][replica].actor

    def close(self) -> None:
        ray = self.router.ray
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        self.actors = []
        self.router.log.close()
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()


class ShardedRetriever:
    """`interfaces.Retriever` over a cluster started for one command (`retrieve --arch sharded`)."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.device = cluster.device

    @classmethod
    def build(cls, dataset, device: str = "auto", *, shards: int = 2, replicas: int = 1, address: str | None = None,
              progress=None, **options) -> "ShardedRetriever":
        if options:
            raise TypeError(f"unknown option(s) for the sharded retriever: {', '.join(options)}")
        from andromeda_nb.devices import resolve

        return cls(Cluster.start(dataset, shards=shards, replicas=replicas, device=resolve(device), address=address,
                                 progress=progress))

    def retrieve(self, requests, k: int):
        return self.cluster.router.retrieve(requests, k)

    def apply(self, update) -> None:
        import json

        from andromeda_nb.updates import update_to_json

        ack = self.apply_lines([json.dumps(update_to_json(update))])
        if ack["rejected"]:
            raise ValueError(f"update rejected by the cluster: {ack['rejected'][0]}")

    def apply_lines(self, lines) -> dict:
        return self.cluster.router.update(list(lines))

    def close(self) -> None:
        self.cluster.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["CALL_TIMEOUT_S", "START_TIMEOUT_S", "Cluster", "ReplicaHandle", "Router", "ShardUnavailable", "ShardedRetriever"]
