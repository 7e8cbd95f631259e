"""The cluster (`cluster/`): ownership by a stable hash, the exact merge, routing updates; then on one
Ray instance shared by the module (2 CPUs, no dashboard, shut down at the end), CPU shards with
replicas (3 x 2, 2 x 2, and 4 through the command line) answer exactly as one engine over the whole
pool through update streams, a killed replica is failed over and, once Ray has restarted it, caught
up from the shard's log, a killed shard is a clear error and never a partial answer, and a plain
pyarrow.flight client asks the front. Each test starts one cluster (a replica is a process). Servers bind
127.0.0.1 and are started and stopped here."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest
from click.testing import CliRunner

from serving import protocol as fl
from andromeda_nb.dataset import Dataset
from andromeda_nb.model import MoeModel, quantize
from andromeda_nb.targeting import request_to_json
from andromeda_nb.testing import random_ads, random_requests, random_updates, update_to_json
from andromeda_nb.types import Upsert
from cluster.shards import ShardLog, merge_topk, mix64, owner, route_updates, shard_dataset, shard_of

pytestmark = pytest.mark.e2e  # starts servers or processes, or runs whole commands

SEED = 5
K = 20


def make_dataset(seed=SEED, n_ads=400, n_requests=6, D=16, F=2):
    rng = np.random.default_rng(seed)
    ads = [a.__class__(**{**a.__dict__, "format": a.format % F}) for a in random_ads(rng, n_ads, dim=D)]
    model = MoeModel.init(seed, D=D, F=F)
    table = quantize(np.stack([a.embedding for a in ads]), "fp32")
    return Dataset(ads=ads, embeddings=table, requests=random_requests(rng, n_requests), model=model, seed=seed,
                   precision="fp32"), rng


def update_stream(rng, dataset, n):
    """`n` valid updates (formats kept inside the model's F), as JSON lines."""
    out = []
    for u in random_updates(rng, dataset.ads, n, dim=dataset.model.D):
        if isinstance(u, Upsert) and u.ad.format >= dataset.model.F:
            u = Upsert(u.ad.__class__(**{**u.ad.__dict__, "format": u.ad.format % dataset.model.F}))
        out.append(json.dumps(update_to_json(u)))
    return out


def single_engine(dataset, lines=()):
    from cpu_baseline.engine import CpuEngine
    from andromeda_nb.updates import IndexLiveIds, apply_updates, read_updates

    engine = CpuEngine(dataset)
    updates, bad = read_updates(list(lines), seed=dataset.seed, dim=dataset.model.D, formats=dataset.model.F)
    assert not bad and not apply_updates(updates, [engine], IndexLiveIds(engine))
    return engine


def assert_same_answers(got, want, context):
    assert len(got) == len(want), context
    for i, ((gi, gs), (wi, ws)) in enumerate(zip(got, want)):
        assert np.array_equal(gi, wi), f"{context}, request {i}: ids {gi[:8]} vs {wi[:8]} (seed {SEED})"
        assert np.array_equal(np.asarray(gs, np.float32), np.asarray(ws, np.float32)), f"{context}, request {i}: scores"


# --- without Ray ------------------------------------------------------------------------------------

PINNED_OWNERS = [3, 1, 2, 1, 3, 3]  # shards of ids 0, 1, 2, 3, 2**62, 2**63-1 among 4


def test_ownership_is_a_stable_hash_that_spreads_the_pool():
    ids = np.arange(20_000, dtype=np.int64) * 7 + 3
    for n in (1, 2, 3, 4, 7):
        shards = shard_of(ids, n)
        assert shards.min() >= 0 and shards.max() < n
        counts = np.bincount(shards, minlength=n)
        assert counts.min() > 0.9 * len(ids) / n, (n, counts)
    # pinned values: the same on every machine and in every process (not Python's salted hash)
    assert shard_of(np.array([0, 1, 2, 3, 2**62, 2**63 - 1], np.int64), 4).tolist() == PINNED_OWNERS
    assert int(mix64([0])[0]) == 0xE220A8397B1DCDAF  # splitmix64's published first output for seed 0
    assert owner(12345, 3) == int(shard_of([12345], 3)[0])
    with pytest.raises(ValueError):
        shard_of(ids, 0)


def test_merge_orders_by_score_then_ad_id_across_shards():
    parts = [(np.array([9, 4], np.int64), np.array([2.0, 1.0], np.float32)),
             (np.array([3, 8, 1], np.int64), np.array([2.0, 1.0, 0.5], np.float32)),
             (np.empty(0, np.int64), np.empty(0, np.float32))]
    ids, scores = merge_topk(parts, 4)
    assert ids.tolist() == [3, 9, 4, 8] and scores.tolist() == [2.0, 2.0, 1.0, 1.0]
    assert merge_topk(parts, 100)[0].tolist() == [3, 9, 4, 8, 1]


def test_shards_split_the_corpus_and_updates_reach_their_owner():
    dataset, rng = make_dataset()
    parts = [shard_dataset(dataset, s, 3) for s in range(3)]
    assert sorted(np.concatenate([p.ad_ids for p in parts]).tolist()) == sorted(dataset.ad_ids.tolist())
    for s, p in enumerate(parts):
        assert (shard_of(p.ad_ids, 3) == s).all() and len(p.embeddings) == p.n_ads
        assert [a.ad_id for a in p.ads] == p.ad_ids.tolist()
    lines = update_stream(rng, dataset, 30) + ["{not json", json.dumps({"op": "retire"})]
    per_shard, malformed = route_updates(lines, 3, seed=dataset.seed, dim=dataset.model.D, formats=dataset.model.F)
    assert [r.line_no for r in malformed] == [31, 32]
    assert sum(map(len, per_shard)) == 30
    for s, entries in enumerate(per_shard):
        assert [n for n, _ in entries] == sorted(n for n, _ in entries)
        for line_no, line in entries:
            obj = json.loads(line)
            assert line == lines[line_no - 1]
            assert owner(obj["ad"]["ad_id"] if obj["op"] == "upsert" else obj["ad_id"], 3) == s
    log = ShardLog(2)
    assert log.append(1, [(1, "a"), (2, "b")]) == 0 and log.append(1, [(5, "c")]) == 2
    assert log.seq(1) == 3 and log.seq(0) == 0 and log.since(1, 1) == [(2, "b"), (5, "c")]


def test_a_replica_answers_only_at_the_sequence_it_is_asked_for():
    from cluster.replica import ShardReplica

    dataset, rng = make_dataset(n_ads=150)
    replica = ShardReplica(shard_dataset(dataset, 0, 1), 0, 1, 0, "cpu")
    lines = update_stream(rng, dataset, 10)
    entries = list(enumerate(lines, start=1))
    assert replica.retrieve(dataset.requests, K, 0)[1] is not None
    assert replica.apply(entries[3:], 3)["applied"] is None and replica.ping() == 0  # not at its sequence
    ack = replica.apply(entries, 0)
    assert ack["seq"] == 10 and ack["applied"] == 10 and not ack["rejected"]
    assert replica.retrieve(dataset.requests, K, 4) == (10, None)  # asked for another sequence: no answer
    assert_same_answers(replica.retrieve(dataset.requests, K, 10)[1],
                        single_engine(dataset, lines).retrieve(dataset.requests, K), "one replica")
    retire_gone = json.dumps({"op": "retire", "ad_id": 10**12})
    ack = replica.apply([(7, retire_gone)], 10)
    assert ack["applied"] == 0 and ack["rejected"][0]["line"] == 7 and "does not exist" in ack["rejected"][0]["error"]


def test_without_ray_the_commands_name_the_install(monkeypatch):
    import sys

    import cli

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as when it is not installed
    for args in (["retrieve", "--data", "data/sample", "--arch", "sharded", "--shards", "2"],
                 ["serve", "cluster", "--data", "data/sample", "--shards", "2", "--port", "0"]):
        result = CliRunner().invoke(cli.main, args)
        assert result.exit_code == 1, result.output
        assert 'pip install -e ".[cluster]"' in result.output


def test_the_durable_shard_log_keeps_its_entries_and_refuses_another_corpus(tmp_path):
    """DurableShardLog: the same sequences and lines as ShardLog, read back after a reopen; a log
    written for one corpus (or one shard count) is not replayed onto another; one front at a time."""
    from serving.wal import LogError
    from cluster.shards import DurableShardLog

    dataset, rng = make_dataset()
    lines = update_stream(rng, dataset, 12)
    memory, disk = ShardLog(3), DurableShardLog(tmp_path / "log", dataset, 3)
    try:
        per_shard, bad = route_updates(lines, 3, seed=dataset.seed, dim=dataset.model.D, formats=dataset.model.F)
        assert not bad
        for s, entries in enumerate(per_shard):
            for half in (entries[: len(entries) // 2], entries[len(entries) // 2 :]):
                if half:
                    assert disk.append(s, half) == memory.append(s, half)
        with pytest.raises(LogError, match="holds this update log"):
            DurableShardLog(tmp_path / "log", dataset, 3)
    finally:
        disk.close()
    again = DurableShardLog(tmp_path / "log", dataset, 3)
    try:
        for s in range(3):
            assert again.seq(s) == memory.seq(s) == len(per_shard[s])
            for start in (0, 1):
                got, want = again.since(s, start), memory.since(s, start)
                assert [json.loads(line) for _, line in got] == [json.loads(line) for _, line in want]
        assert again.describe()["seq"] == [len(e) for e in per_shard] and sum(again.describe()["seq"]) == 12
    finally:
        again.close()
    other, _ = make_dataset(seed=SEED + 1)
    with pytest.raises(LogError, match="belongs to another corpus"):
        DurableShardLog(tmp_path / "log", other, 3)


def test_shards_as_plain_processes_answer_as_one_engine_through_the_flight_fan_out(tmp_path):
    """`benchmarks.cluster --placement processes` (where Ray is not installed): one `cluster.shard_process`
    per shard, each its slice of the corpus behind Flight; the bench refuses to time a path whose
    answers differ from the in-process engine's, so rows mean the fan-out answered exactly."""
    import cli
    from andromeda_nb.store import load_dataset
    from benchmarks.cluster import measure, table

    data = tmp_path / "corpus"
    made = CliRunner().invoke(cli.main, ["generate", "--ads", "400", "--requests", "3", "--seed", "4", "--out",
                                         str(data), "-q"])
    assert made.exit_code == 0, made.output
    partials = []
    result = measure(load_dataset(str(data)), [1, 2], k=K, repeat=1, batches=(1,), placement="processes",
                     data_dir=data, say=lambda message: None, partial=partials.append)
    assert result["placement"] == "processes" and result["software"]["ray"] is None and result["complete"]
    assert {(r["path"], r["shards"], r["batch"]) for r in result["rows"]} == {
        (path, shards, 1) for path in ("in-process", "flight", "flight-columns") for shards in (1, 2)}
    assert all(r["median_us"] > 0 for r in result["rows"])
    # what was measured so far is handed over after each shard count, so a run cut short keeps it
    assert [len(p["rows"]) for p in partials] == [3, 6] and not any(p["complete"] for p in partials)
    # each Flight row says where its time went: the parts lie within the call, the slowest shard
    # within the fan-out; the in-process engine has no split
    for r in result["rows"]:
        split = r.get("split_us")
        assert (split is None) == (r["path"] == "in-process")
        if split is not None:
            assert 0 < split["slowest_shard"] <= split["fan_out"]
            assert split["encode"] > 0 and split["merge"] > 0
            assert split["encode"] + split["fan_out"] + split["merge"] <= r["max_us"] * 1.05
    by = {(r["path"], r["shards"]): r for r in result["scaling"]}
    assert set(by) == {(path, shards) for path in ("flight", "flight-columns") for shards in (1, 2)}
    for (path, shards), row in by.items():
        t1, tn = (next(r["median_us"] for r in result["rows"] if (r["path"], r["shards"]) == (path, n))
                  for n in (1, shards))
        assert row["efficiency"] == pytest.approx(t1 / (shards * tn), abs=1e-3)
        assert row["pool_ads_per_s"] == round(400 / (tn * 1e-6))
    assert "scaling against one shard" in table(result) and "efficiency" in table(result)


def test_shard_processes_go_round_the_gpus_they_are_given(tmp_path):
    """Shard s's process gets GPU s mod G in its CUDA_VISIBLE_DEVICES (it announces what it got); no
    GPUs, no variable. The shards run on the CPU here: the placement is in their environment."""
    import cli
    from benchmarks.cluster import _ShardProcesses

    data = tmp_path / "corpus"
    made = CliRunner().invoke(cli.main, ["generate", "--ads", "60", "--requests", "2", "--seed", "6", "--out",
                                         str(data), "-q"])
    assert made.exit_code == 0, made.output
    said = []
    procs = _ShardProcesses(data, 3, "cpu", said.append, gpus=["4", "7"])
    try:
        assert [p.announced["gpu"] for p in procs.procs] == ["4", "7", "4"]
        assert [p.announced["shard"] for p in procs.procs] == [0, 1, 2]
        assert "2 GPU(s): 4, 7" in said[0]
    finally:
        procs.close()


def test_gpus_for_shards_come_from_the_process_own_view():
    from cluster.gpus import GPU_ENV, choose_gpus, gpu_of_shard, host_gpus, shard_environment

    assert host_gpus({GPU_ENV: "2, 3"}, count=lambda: 8) == ["2", "3"]  # narrowed by the caller
    assert host_gpus({}, count=lambda: 4) == ["0", "1", "2", "3"]  # else every device the driver counts
    assert host_gpus({GPU_ENV: ""}, count=lambda: 4) == []
    assert choose_gpus(None, ["0", "1"]) == ["0", "1"] and choose_gpus(1, ["5", "6"]) == ["5"]
    with pytest.raises(ValueError, match="--gpus 3: this process may use 2 GPU"):
        choose_gpus(3, ["0", "1"])
    with pytest.raises(RuntimeError, match="no GPU to place shards on"):
        choose_gpus(None, [])
    assert [gpu_of_shard(s, ["a", "b", "c"]) for s in range(7)] == ["a", "b", "c", "a", "b", "c", "a"]
    assert shard_environment(1, ["0", "1"]) == {GPU_ENV: "1"} and shard_environment(1, None) == {}


def test_cluster_bench_takes_gpus_only_where_it_places_the_shards(tmp_path):
    from benchmarks.cluster import main, measure

    with pytest.raises(SystemExit):
        main(["--data", str(tmp_path), "--placement", "processes", "--device", "cpu", "--gpus", "2"])
    with pytest.raises(ValueError, match="Ray places its actors on GPUs itself"):
        measure(make_dataset()[0], [1], placement="ray", device="gpu", gpus=2)


# --- on Ray -----------------------------------------------------------------------------------------


class _HeldRouter:
    """A router whose first `hold` batches wait for `release`, answering each request with the batch's
    size as its one id, so a test sees which requests shared a batch."""

    def __init__(self, replicas, hold):
        import threading
        from types import SimpleNamespace

        self.replicas = [[SimpleNamespace(failures=0)] * replicas]
        self.log = SimpleNamespace(seq=lambda shard: 0)
        self.n_shards = 1
        self.release, self.hold = threading.Event(), hold
        self.batches = []
        self.lock = threading.Lock()

    def retrieve(self, requests, k):
        with self.lock:
            self.batches.append(len(requests))
            held = len(self.batches) <= self.hold
        if held:
            assert self.release.wait(10)
        return [(np.array([len(requests), r], np.int64), np.array([1.0, 0.5], np.float32)) for r in requests]


def test_the_front_batches_concurrent_exchanges_with_one_batch_in_flight_per_replica():
    """Calls that arrive while every replica is busy wait and go out together: with 2 replicas and
    both batches held, the next six calls leave as two batches of three; each caller gets its own
    answers cut to its own k."""
    import threading
    import time
    from types import SimpleNamespace

    from cluster.front import ClusterServer

    dataset, _ = make_dataset(n_ads=40, n_requests=1)
    router = _HeldRouter(replicas=2, hold=2)
    server = ClusterServer(SimpleNamespace(router=router, device="cpu", close=lambda: None), dataset,
                           "grpc://127.0.0.1:0", batch_wait_s=0.0)
    got = {}

    def ask(i):
        got[i] = server.retrieve([i], [1 + i % 2])

    try:
        first = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in first:
            t.start()
        def wait_for(condition, what):
            deadline = time.monotonic() + 10
            while not condition():
                assert time.monotonic() < deadline, f"{what}: batches so far {router.batches}"
                time.sleep(0.001)

        wait_for(lambda: len(router.batches) == 2, "both replicas busy")
        rest = [threading.Thread(target=ask, args=(i,)) for i in range(2, 8)]
        for t in rest:
            t.start()
        wait_for(lambda: sum(b._queue.qsize() for b in server.batchers) == 6, "six calls queued behind them")
        router.release.set()
        for t in first + rest:
            t.join(10)
        assert router.batches == [1, 1, 3, 3], router.batches
        for i in range(8):
            (ids, scores), = got[i]
            assert ids.tolist() == [1 if i < 2 else 3, i][: 1 + i % 2] and len(scores) == 1 + i % 2
        stats = server.extra_stats()["batching"]
        assert stats["batchers"] == 2 and stats["batches"] == 4 and stats["calls"] == 8 and stats["requests"] == 8
    finally:
        server.close_resources()
        server.shutdown()


@pytest.fixture(scope="module")
def ray_instance():
    ray = pytest.importorskip("ray", reason='the cluster tests need Ray: pip install -e ".[test,cluster]"')
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def corpus():
    return make_dataset()


def start(dataset, shards, replicas):
    from cluster.router import Cluster

    return Cluster.start(dataset, shards=shards, replicas=replicas, device="cpu")


def live_ads(dataset, lines):
    """The ads live after `lines` (JSON updates) applied to the dataset, for a further stream."""
    from andromeda_nb.oracle import OracleIndex
    from andromeda_nb.updates import apply_update_file

    index = OracleIndex.build(dataset.ads)
    apply_update_file(lines, [index], dataset.ad_ids.tolist(), seed=dataset.seed, dim=dataset.model.D,
                      formats=dataset.model.F)
    return Dataset(ads=list(index.ads.values()), embeddings=dataset.embeddings, model=dataset.model,
                   seed=dataset.seed)


def test_shards_with_replicas_equal_one_engine_through_updates_and_a_killed_replica(ray_instance, corpus):
    """3 shards x 2 replicas: equal to one engine over the pool (ids and float32 scores) through three
    update streams at k 1, 20, 500; a replica killed (Ray restarts it fresh from the corpus) is
    failed over, misses a stream, catches up from its shard's log, and then answers alone."""
    dataset, _ = corpus
    rng = np.random.default_rng([SEED, 3, 2])
    cluster = start(dataset, 3, 2)
    try:
        router = cluster.router
        assert_same_answers(router.retrieve(dataset.requests, K), single_engine(dataset).retrieve(dataset.requests, K),
                            "3 x 2, no update")
        applied = []
        for round_ in range(3):
            lines = update_stream(rng, live_ads(dataset, applied), 25)
            ack = router.update(lines + [json.dumps({"op": "retire", "ad_id": 10**15})])
            assert ack["applied"] == 25 and [r["line"] for r in ack["rejected"]] == [26], ack
            applied += lines
            want = single_engine(dataset, applied)
            for k in (1, K, 500):
                assert_same_answers(router.retrieve(dataset.requests, k), want.retrieve(dataset.requests, k),
                                    f"3 x 2, after {len(applied)} updates, k={k}")
        assert router.health()["ads"] == len(want)

        ray_instance.kill(cluster.replica(0, 0), no_restart=False)  # Ray restarts it: fresh from the corpus
        want = single_engine(dataset, applied).retrieve(dataset.requests, K)
        for _ in range(4):  # round robin reaches the killed replica: the other one answers for it
            assert_same_answers(router.retrieve(dataset.requests, K), want, "replica 0/0 killed")
        more = update_stream(rng, live_ads(dataset, applied), 20)
        assert router.update(more)["applied"] == 20  # 0/0 may still be down: kept in shard 0's log
        applied += more
        router.wait_all_up()
        ray_instance.kill(cluster.replica(0, 1), no_restart=True)  # only the restarted replica serves shard 0
        assert_same_answers(router.retrieve(dataset.requests, K),
                            single_engine(dataset, applied).retrieve(dataset.requests, K), "restarted 0/0 alone")
        state = router.health()["shard_state"][0]
        assert state["replicas"][0]["seq"] == state["log_seq"] > 0 and not state["replicas"][1]["up"]
    finally:
        cluster.close()


def test_a_plain_flight_client_asks_the_front(ray_instance, corpus):
    import threading

    from cluster.front import ClusterServer

    dataset, rng = corpus
    cluster = start(dataset, 2, 2)
    server = ClusterServer(cluster, dataset, "grpc://127.0.0.1:0")
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    client = flight.connect(f"grpc://127.0.0.1:{server.port}")
    try:
        requests = dataset.requests
        batch = pa.record_batch([pa.array([r.request_id for r in requests], pa.int64()),
                                 pa.array([json.dumps(request_to_json(r)) for r in requests], pa.utf8()),
                                 pa.array([K] * len(requests), pa.int32())], names=["request_id", "request", "k"])
        writer, reader = client.do_exchange(flight.FlightDescriptor.for_path("retrieve"))
        with writer:
            writer.begin(batch.schema)
            writer.write_batch(batch)
            writer.done_writing()
            table = reader.read_all()
        got = fl.split_answers(table, [r.request_id for r in requests])
        assert_same_answers(got, single_engine(dataset).retrieve(requests, K), "front, plain client")
        lines = update_stream(rng, dataset, 15)  # the corpus as made: this test's cluster had no update
        ack = json.loads(list(client.do_action(flight.Action("update", "\n".join(lines).encode())))[0].body.to_pybytes())
        assert ack == {"applied": 15, "rejected": []}
        assert_same_answers(fl.retrieve_over_flight(f"grpc://127.0.0.1:{server.port}", requests, K),
                            single_engine(dataset, lines).retrieve(requests, K), "front after updates")
        health = json.loads(list(client.do_action(flight.Action("health", b"")))[0].body.to_pybytes())
        assert health["status"] == "ok" and health["shards"] == 2 and health["replicas"] == 2
        stats = fl.flight_action(f"grpc://127.0.0.1:{server.port}", "stats")
        assert stats["requests"] == 2 * len(requests) and stats["updates"] == 15
        with pytest.raises(flight.FlightServerError, match="invalid request: request 7"):
            fl.retrieve_over_flight(f"grpc://127.0.0.1:{server.port}", [{"request_id": 7, "user": {}}], K)
        ray_instance.kill(cluster.replica(1, 0), no_restart=True)  # a killed shard: every replica gone
        ray_instance.kill(cluster.replica(1, 1), no_restart=True)
        for _ in range(2):
            with pytest.raises(flight.FlightUnavailableError, match="shard 1 of 2 is unavailable"):
                fl.retrieve_over_flight(f"grpc://127.0.0.1:{server.port}", requests, K)
        seqs = [cluster.router.log.seq(s) for s in range(2)]
        with pytest.raises(flight.FlightUnavailableError, match="no update of this stream was applied"):
            fl.flight_action(f"grpc://127.0.0.1:{server.port}", "update", "\n".join(update_stream(rng, dataset, 30)))
        assert [cluster.router.log.seq(s) for s in range(2)] == seqs  # nothing logged for any shard
        health = fl.flight_action(f"grpc://127.0.0.1:{server.port}", "health")
        assert not health["available"] and health["shard_state"][1]["ads"] is None
    finally:
        client.close()
        server.shutdown()
        thread.join(10)
        cluster.close()


def test_retrieve_arch_sharded_prints_what_the_single_engine_prints(ray_instance, tmp_path):
    import cli

    runner = CliRunner()
    corpus_dir = tmp_path / "c"
    assert runner.invoke(cli.main, ["generate", "--ads", "600", "--requests", "5", "--seed", "3", "--updates", "40",
                                    "--out", str(corpus_dir), "-q"]).exit_code == 0
    common = ["retrieve", "--data", str(corpus_dir), "--k", "15", "--updates-file", str(corpus_dir / "updates.jsonl"),
              "--json", "-q", "--device", "cpu"]
    want = runner.invoke(cli.main, common + ["--arch", "colocated"])
    got = runner.invoke(cli.main, common + ["--arch", "sharded", "--shards", "4"])
    assert want.exit_code == 0 and got.exit_code == 0, got.output
    assert got.output == want.output and len(got.output.splitlines()) == 5
    bad = runner.invoke(cli.main, ["retrieve", "--data", str(corpus_dir), "--arch", "sharded", "--shards", "0"])
    assert bad.exit_code == 2 and "--shards" in bad.output


PATIENT_S = 600.0  # every wait of the process test below: far past what a loaded machine needs, still bounded


def test_serve_cluster_in_its_own_process_replays_acknowledged_updates_after_a_restart(tmp_path):
    """`andromeda serve cluster` started as a process (its own local Ray): a plain Flight client's
    answers equal one engine's; updates acknowledged by the front are in the shards' logs on disk, so
    the front stopped and started again on the same corpus answers with them before anything else.
    What it asserts holds on any machine: every call, the server's own deadline and each stop wait
    up to PATIENT_S (a loaded machine runs Ray and the replicas slowly, not differently), and the
    start is judged by the process's progress (`ServiceProcess`); nothing here times anything."""
    pytest.importorskip("ray", reason='the cluster tests need Ray: pip install -e ".[test,cluster]"')
    import cli
    from serving.services import ServiceProcess
    from andromeda_nb.store import load_dataset

    data = tmp_path / "corpus"
    made = CliRunner().invoke(cli.main, ["generate", "--ads", "500", "--requests", "4", "--seed", "9", "--out",
                                         str(data), "-q"])
    assert made.exit_code == 0, made.output
    dataset = load_dataset(str(data))
    rng = np.random.default_rng([SEED, 17])
    args = ["serve", "cluster", "--data", str(data), "--shards", "2", "--device", "cpu", "--port", "0", "-q",
            "--deadline", str(PATIENT_S), "--stop-deadline", str(PATIENT_S)]
    front = ServiceProcess("cli", args, name="serve cluster")
    try:
        location = front.location
        assert_same_answers(fl.retrieve_over_flight(location, dataset.requests, K, timeout=PATIENT_S),
                            single_engine(dataset).retrieve(dataset.requests, K), "front process")
        lines = update_stream(rng, dataset, 20)
        ack = fl.flight_action(location, "update", "\n".join(lines), timeout=PATIENT_S)  # once: not idempotent
        assert ack == {"applied": 20, "rejected": []}, ack
    finally:
        assert front.stop(timeout_s=PATIENT_S) == 0  # SIGTERM: the front ends its replicas and its Ray
    assert sorted(p.name for p in (data / "cluster-log").iterdir() if p.suffix == ".log") == \
        ["shard-0-of-2.log", "shard-1-of-2.log"]
    front = ServiceProcess("cli", args, name="serve cluster, started again")
    try:
        # the first answer after the restart already holds the replay: it happens before the front listens
        health = fl.flight_action(front.location, "health", timeout=PATIENT_S)
        assert health["replayed"] == 20 and health["log"]["durable"] and sum(health["log"]["seq"]) == 20, health
        assert_same_answers(fl.retrieve_over_flight(front.location, dataset.requests, K, timeout=PATIENT_S),
                            single_engine(dataset, lines).retrieve(dataset.requests, K), "after a restart")
    finally:
        assert front.stop(timeout_s=PATIENT_S) == 0


def test_the_sharded_check_script_finds_serve_cluster_equal_to_one_engine_and_says_where_shards_run(tmp_path):
    """`scripts/check_sharded.py` (the multi-GPU machine's check): `serve cluster` as a process and one
    engine get the same update stream, then every request; equal answers exit 0 and the result names
    each shard's placement from the front's `health`; a changed answer is reported with its request."""
    pytest.importorskip("ray", reason='the cluster tests need Ray: pip install -e ".[test,cluster]"')
    import importlib.util

    import cli
    from serving.services import PROJECT_ROOT

    spec = importlib.util.spec_from_file_location("check_sharded", PROJECT_ROOT / "scripts" / "check_sharded.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    data = tmp_path / "corpus"
    made = CliRunner().invoke(cli.main, ["generate", "--ads", "300", "--requests", "4", "--seed", "8", "--updates",
                                         "40", "--out", str(data), "-q"])
    assert made.exit_code == 0, made.output
    out = tmp_path / "check.json"
    code = script.main(["--data", str(data), "--shards", "2", "--device", "cpu", "--updates",
                        str(data / "updates.jsonl"), "--k", "10", "--out", str(out)])
    result = json.loads(out.read_text())
    assert code == 0 and result["equal"] and not result["differences"], result
    assert result["updates_applied"][0] == result["updates_applied"][1] > 0
    assert [s["shard"] for s in result["shard_state"]] == [0, 1]
    assert sum(s["ads"] for s in result["shard_state"]) > 0 and all(s["gpu"] is None for s in result["shard_state"])
    # the comparison itself: one changed score is a difference naming its request
    from andromeda_nb.store import load_dataset

    requests = load_dataset(str(data)).requests[:2]
    answers = [(np.array([3, 1], np.int64), np.array([0.5, 0.25], np.float32)) for _ in requests]
    changed = [answers[0], (answers[1][0], np.array([0.5, 0.2], np.float32))]
    assert script.differences(answers, answers, requests) == []
    assert [line.split(":")[0] for line in script.differences(changed, answers, requests)] == [
        f"request {requests[1].request_id}"]
    assert script.differences(answers[:1], answers, requests)[0] == "1 answers for 2 requests"


def test_shard_processes_end_when_the_command_that_started_them_is_killed(tmp_path):
    """A `benchmarks.cluster` killed with -9 cannot stop its shard processes; they watch it (`--parent-pid`)
    and end by themselves."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap

    import cli
    from tests.support.servers import ends_within, process_running
    from serving.services import PROJECT_ROOT

    data = tmp_path / "corpus"
    made = CliRunner().invoke(cli.main, ["generate", "--ads", "60", "--requests", "2", "--seed", "6", "--out",
                                         str(data), "-q"])
    assert made.exit_code == 0, made.output
    parent = textwrap.dedent(f"""
        import time
        from benchmarks.cluster import _ShardProcesses
        procs = _ShardProcesses({str(data)!r}, 2, "cpu", lambda m: None)
        print(" ".join(str(p.proc.pid) for p in procs.procs), flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    shards = []
    try:
        shards = [int(p) for p in proc.stdout.readline().split()]
        assert len(shards) == 2 and all(process_running(p) for p in shards)
        proc.kill()
        proc.wait()
        assert not ends_within(shards), "a shard process outlived the command that started it"
    finally:
        proc.kill()
        for pid in shards:
            if process_running(pid):
                os.kill(pid, signal.SIGKILL)


def test_bench_cluster_prints_one_json_line_of_checked_rows_and_refuses_what_does_not_go_together(tmp_path):
    """`andromeda bench cluster`: the fan-out measurement from the command line, stamped with the
    command that made it; --data and --tiled are one or the other, tiled pools need a GPU (or the
    simulator), GPUs are chosen only for shards on the GPU."""
    import cli

    data = tmp_path / "corpus"
    runner = CliRunner()
    assert runner.invoke(cli.main, ["generate", "--ads", "120", "--requests", "2", "--seed", "12", "--out", str(data),
                                    "-q"]).exit_code == 0
    made = runner.invoke(cli.main, ["bench", "cluster", "--data", str(data), "--device", "cpu", "--shards", "1",
                                    "--batches", "2", "--repeat", "1", "--k", "5", "--json", "-q"])
    assert made.exit_code == 0, made.output
    result = json.loads(made.output.strip().splitlines()[-1])
    assert result["kind"] == "cluster_data_path" and result["complete"] and result["placement"] == "processes"
    assert {r["path"] for r in result["rows"]} == {"in-process", "flight", "flight-columns"}
    assert result["provenance"]["command"].startswith("andromeda bench cluster")
    for args, code, message in ((["--data", str(data), "--tiled", "2"], 2, "or --tiled COPIES"),
                                (["--tiled", "2", "--device", "cpu"], 2, "tiled pools live on the GPU"),
                                (["--data", str(data), "--device", "cpu", "--gpus", "2"], 1,
                                 "placement 'processes' on device 'gpu'")):
        refused = runner.invoke(cli.main, ["bench", "cluster", *args])
        assert refused.exit_code == code and message in refused.output, refused.output


# --- the front's update turn: deadline and stopping (no Ray needed) -----------------------------------


def test_an_update_waits_for_its_turn_no_longer_than_the_deadline_and_a_stopping_server_ends_it():
    """The router's lock: a writer waiting keeps new readers out; its wait is bounded by the deadline
    (measured on a clock the test moves, so no machine is too slow for it) and ended by `stopping`."""
    import threading

    from cluster.router import _ReadWriteLock
    from serving.durable import DeadlineExceeded, ServerStopping

    now = [0.0]
    lock = _ReadWriteLock(clock=lambda: now[0])
    lock.WAIT_STEP_S = 0.01
    reading = lock.read()
    reading.__enter__()  # a request in flight
    outcome = {}

    def writer(**kw):
        try:
            with lock.write(**kw):
                outcome["wrote"] = True
        except (DeadlineExceeded, ServerStopping) as exc:
            outcome["error"] = exc

    t = threading.Thread(target=writer, kwargs={"deadline_s": 5.0})
    t.start()
    while not lock._writers_waiting:
        pass
    got_in = threading.Event()

    def reader():
        with lock.read():
            got_in.set()

    late = threading.Thread(target=reader)
    late.start()
    assert not got_in.wait(0.2), "a new request went ahead of the waiting update"
    now[0] = 6.0  # past the deadline while the request is still in flight
    t.join(5)
    assert isinstance(outcome.get("error"), DeadlineExceeded) and "wrote" not in outcome
    late.join(5)
    assert got_in.is_set(), "the request waits no longer once the update gave up"
    stopping = threading.Event()
    outcome.clear()
    t = threading.Thread(target=writer, kwargs={"deadline_s": None, "stopping": stopping})
    t.start()
    stopping.set()
    t.join(5)
    assert isinstance(outcome.get("error"), ServerStopping) and "nothing" in str(outcome["error"])
    reading.__exit__(None, None, None)
    outcome.clear()
    writer(deadline_s=0.0)
    assert outcome == {"wrote": True}, "a free lock is taken at once, whatever the deadline"
