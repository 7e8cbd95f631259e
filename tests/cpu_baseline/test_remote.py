"""Remote-scoring architecture: the Flight exchange, the scoring service, the index host, traffic
relays and reliability. Servers bind 127.0.0.1 only and are started and stopped by the tests."""

import json
import socket
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest
from click.testing import CliRunner

from serving import protocol as fl
from andromeda_nb.compare import compare_topk
from andromeda_nb.dataset import Dataset
from andromeda_nb.model import MoeModel, quantize
from andromeda_nb.reference import ReferenceRetriever
from serving.relay import Relay
from andromeda_nb.targeting import request_to_json
from andromeda_nb.testing import random_ads, random_requests, random_updates, update_to_json
from cpu_baseline.index_host import IndexHostServer, top_k
from cpu_baseline.remote import RemoteRetriever
from cpu_baseline.scoring_service import ScoringServer

pytestmark = pytest.mark.e2e  # starts servers or processes, or runs whole commands

SEED = 0  # random_requests / random_ads derive with seed 0


def make_dataset(seed: int, n_ads: int = 300, n_requests: int = 12, precision: str = "fp32", D: int = 16):
    rng = np.random.default_rng(seed)
    ads = random_ads(rng, n_ads, dim=D)
    requests = random_requests(rng, n_requests)
    model = MoeModel.init(seed, D=D)
    table = quantize(np.stack([a.embedding for a in ads]) if ads else np.empty((0, D), np.float32), precision)
    return Dataset(ads=ads, embeddings=table, requests=requests, model=model, seed=SEED, precision=precision), rng


class Services:
    """A scoring service and an index host in this process (threads), for fast tests."""

    def __init__(self, dataset, *, delay_s: float = 0.0, scorer_timeout_s: float = 10.0):
        self.scorer = ScoringServer(dataset, "grpc://127.0.0.1:0", delay_s=delay_s)
        self.host = IndexHostServer(dataset, f"grpc://127.0.0.1:{self.scorer.port}", "grpc://127.0.0.1:0",
                                    scorer_timeout_s=scorer_timeout_s, threads=2, scorer_secret=self.scorer.pair_secret)
        self.location = f"grpc://127.0.0.1:{self.host.port}"

    def close(self):
        self.host.shutdown()
        self.host.close_resources()
        self.scorer.shutdown()


@pytest.fixture
def services():
    dataset, rng = make_dataset(21, precision="int8")
    svc = Services(dataset)
    yield svc, dataset, rng
    svc.close()


def assert_equals_reference(reference, requests, answers, k, context):
    for request, (ids, scores) in zip(requests, answers):
        ref_ids, result = reference.score_eligible(request)
        cmp = compare_topk(ref_ids, result, ids, scores, k)
        assert cmp.ok, f"{context}, request {request.request_id}, k={k}: {cmp.message}"


# --- the shared exchange code -------------------------------------------------------------------------


def test_request_and_answer_batches_round_trip():
    dataset, _ = make_dataset(1, n_ads=5, n_requests=3)
    batch = fl.request_batch(dataset.requests, 7)
    assert batch.schema.equals(fl.REQUEST_SCHEMA)
    requests, ks = fl.decode_request_batch(batch, seed=SEED, experts=6, width=16)
    assert [r.request_id for r in requests] == [r.request_id for r in dataset.requests]
    assert ks == [7, 7, 7]
    assert np.array_equal(requests[1].signals, dataset.requests[1].signals)
    answers = [(np.array([5, 3], np.int64), np.array([0.5, 0.25], np.float32)),
               (np.empty(0, np.int64), np.empty(0, np.float32)),
               (np.array([9], np.int64), np.array([1.0], np.float32))]
    out = fl.answer_batch([10, 11, 12], answers)
    back = fl.split_answers(out, [10, 11, 12])
    for (a, s), (b, t) in zip(answers, back):
        assert np.array_equal(a, b) and np.array_equal(s, t)
    with pytest.raises(fl.InvalidInput, match="outside 1..4096"):
        fl.check_k(0)


def test_top_k_orders_by_score_then_id():
    ids = np.array([1, 2, 3, 4, 5, 6], np.int64)
    scores = np.array([0.5, 0.9, 0.5, 0.1, 0.5, 0.9], np.float32)
    got_ids, got_scores = top_k(ids, scores, 4)
    assert got_ids.tolist() == [2, 6, 1, 3]
    assert got_scores.tolist() == pytest.approx([0.9, 0.9, 0.5, 0.5])
    assert top_k(ids, scores, 10)[0].tolist() == [2, 6, 1, 3, 5, 4]


# --- index host + scoring service in this process --------------------------------------------------


def test_remote_equals_reference_through_updates(services):
    svc, dataset, rng = services
    reference = ReferenceRetriever.build(dataset)
    requests = dataset.requests
    for step in range(3):
        for k in (1, 10, 100):
            answers = fl.retrieve_over_flight(svc.location, requests, k)
            assert_equals_reference(reference, requests, answers, k, f"step {step}")
        assert sum(len(a[0]) for a in answers) > 0
        updates = random_updates(rng, list(reference.index.ads.values()), 20, dim=dataset.model.D)
        ack = fl.flight_action(svc.location, "update", "\n".join(json.dumps(update_to_json(u)) for u in updates))
        assert set(ack.pop("seconds")) == {"parse", "log", "apply"}
        assert ack == {"applied": len(updates), "rejected": [], "seq": 20 * (step + 1)}
        for update in updates:
            reference.apply(update)


def test_update_rejections_change_nothing(services):
    svc, dataset, _ = services
    before = fl.retrieve_over_flight(svc.location, dataset.requests, 20)
    lines = [json.dumps({"op": "retire", "ad_id": 123456789}), "not json",
             json.dumps({"op": "status", "ad_id": int(dataset.ads[0].ad_id), "status": "SLEEPY"})]
    ack = fl.flight_action(svc.location, "update", "\n".join(lines))
    assert ack["applied"] == 0
    assert [r["line"] for r in ack["rejected"]] == [1, 2, 3]
    assert "does not exist" in ack["rejected"][0]["error"]
    after = fl.retrieve_over_flight(svc.location, dataset.requests, 20)
    for (a, s), (b, t) in zip(before, after):
        assert np.array_equal(a, b) and np.array_equal(s, t)


def test_malformed_requests_get_clear_errors_and_the_server_keeps_serving(services):
    svc, dataset, _ = services
    client = flight.connect(svc.location)
    good = request_to_json(dataset.requests[0])

    def send(batch):
        return fl.exchange_batches(client, [batch], timeout=10)

    bad_json = pa.record_batch([pa.array([1], pa.int64()), pa.array(['{"user": '], pa.utf8()),
                                pa.array([5], pa.int32())], schema=fl.REQUEST_SCHEMA)
    with pytest.raises(flight.FlightServerError, match="invalid request: request 1: request is not valid JSON"):
        send(bad_json)
    no_user = dict(good)
    del no_user["user"]
    with pytest.raises(flight.FlightServerError, match="invalid request: request 2"):
        send(fl.request_batch([{**no_user, "request_id": 2}], 5))
    bad_age = json.loads(json.dumps(good))
    bad_age["user"]["age"] = "old"
    with pytest.raises(flight.FlightServerError, match=r"invalid request: request 3: user\.age"):
        send(fl.request_batch([{**bad_age, "request_id": 3}], 5))
    with pytest.raises(flight.FlightServerError, match="k = 0 is outside"):
        send(fl.request_batch([good], [0]))
    wrong_columns = pa.record_batch([pa.array([1], pa.int64())], names=["request_id"])
    with pytest.raises(flight.FlightServerError, match="lacks column"):
        writer, reader = client.do_exchange(flight.FlightDescriptor.for_path("retrieve"))
        with writer:
            writer.begin(wrong_columns.schema)
            writer.write_batch(wrong_columns)
            writer.done_writing()
            reader.read_all()
    with pytest.raises(flight.FlightServerError, match="unknown exchange"):
        writer, reader = client.do_exchange(flight.FlightDescriptor.for_path("nope"))
        with writer:
            writer.begin(fl.REQUEST_SCHEMA)
            writer.write_batch(fl.request_batch([good], 5))
            writer.done_writing()
            reader.read_all()
    with pytest.raises(flight.FlightServerError, match="unknown action 'nope'"):
        fl.flight_action(svc.location, "nope")
    # still serving, and the errors were counted
    answers = fl.retrieve_over_flight(svc.location, dataset.requests[:2], 5)
    assert len(answers) == 2
    stats = fl.flight_action(svc.location, "stats")
    assert stats["errors"] >= 7 and stats["requests"] >= 2
    client.close()


def test_health_and_stats(services):
    svc, dataset, _ = services
    health = fl.flight_action(svc.location, "health")
    assert health["status"] == "ok" and health["ads"] == len(dataset.ads)
    before = fl.flight_action(svc.location, "stats")
    fl.retrieve_over_flight(svc.location, dataset.requests, 10, batch_size=5)
    after = fl.flight_action(svc.location, "stats")
    assert after["requests"] - before["requests"] == len(dataset.requests)
    assert after["batches"] - before["batches"] == 3
    assert after["bytes_in"] > before["bytes_in"] and after["bytes_out"] > before["bytes_out"]
    scorer_stats = fl.flight_action(svc.location, "scorer-stats")
    assert scorer_stats["server"] == "scorer" and scorer_stats["candidates"] > 0
    scorer_health = fl.flight_action(f"grpc://127.0.0.1:{svc.scorer.port}", "health")
    assert scorer_health["rows"] == len(dataset.ads) and scorer_health["precision"] == "int8"


def test_scoring_service_takes_ad_ids_in_any_order(services):
    """The candidate hop carries ad ids; the service finds the rows itself, through updates too."""
    from andromeda_nb.compare import compare_scores
    from andromeda_nb.model import user_side
    from cpu_baseline.scoring_service import CANDIDATE_SCHEMA, ScorerClient, user_side_bytes

    svc, dataset, rng = services
    assert CANDIDATE_SCHEMA.names == ["ad_id"] and CANDIDATE_SCHEMA.field("ad_id").type == pa.int64()
    reference = ReferenceRetriever.build(dataset)
    client = ScorerClient(f"grpc://127.0.0.1:{svc.scorer.port}")
    try:
        for request in dataset.requests[:4]:
            ids, result = reference.score_eligible(request)
            side = user_side(dataset.model, request).float32()
            side = user_side_bytes(side["U"], side["Q"], side["gamma"], side["beta"])
            shuffled = rng.permutation(len(ids))
            (got,) = client.score([(ids[shuffled], side)])
            cmp = compare_scores(result.take(shuffled), got, ids=ids[shuffled])
            assert cmp.ok, f"request {request.request_id}: {cmp.message}"
        live = sorted(reference.index.ads)
        gone, kept = live[0], live[1:4]
        fl.flight_action(svc.location, "update", json.dumps({"op": "retire", "ad_id": gone}))
        with pytest.raises(flight.FlightError, match=f"ad {gone} is not live"):
            client.score([(np.array([kept[0], gone], np.int64), side)])
        (got,) = client.score([(np.array(kept, np.int64), side)])  # the service keeps serving
        assert got.shape == (3,) and np.isfinite(got).all()
    finally:
        client.close()


def test_scorer_down_gives_a_clear_error_and_the_host_keeps_serving():
    dataset, _ = make_dataset(5)
    svc = Services(dataset, scorer_timeout_s=60.0)
    try:
        assert fl.retrieve_over_flight(svc.location, dataset.requests[:2], 5)  # warm (kernels compiled)
        svc.host.scorer.timeout_s = 3.0
        svc.scorer.shutdown()
        t = time.monotonic()
        with pytest.raises((flight.FlightUnavailableError, flight.FlightTimedOutError), match="scoring service"):
            fl.retrieve_over_flight(svc.location, dataset.requests[:3], 5, timeout=20)
        # the host's 3 s deadline, not the 60 s it started with (the client's own 20 s timeout would
        # not name the scoring service); 15 s leaves a loaded machine room
        assert time.monotonic() - t < 15
        health = fl.flight_action(svc.location, "health")  # still serving, and saying what is wrong
        assert health["status"] == "degraded" and "scoring service" in " ".join(health["reasons"])
    finally:
        svc.close()


SLOW_SCORER_S = 6.0  # the slow scorer's delay: twelve times the host's 0.5 s deadline, a bound a loaded machine keeps


def test_slow_scorer_times_out_within_the_deadline():
    dataset, _ = make_dataset(6)
    svc = Services(dataset, scorer_timeout_s=60.0)
    try:
        assert fl.retrieve_over_flight(svc.location, dataset.requests[:2], 5)  # warm (kernels compiled)
        svc.scorer.delay_s, svc.host.scorer.timeout_s = SLOW_SCORER_S, 0.5
        t = time.monotonic()
        with pytest.raises(flight.FlightTimedOutError, match="did not answer .* within 0.5 s"):
            fl.retrieve_over_flight(svc.location, dataset.requests[:1], 5, timeout=20)
        assert time.monotonic() - t < SLOW_SCORER_S  # the host gave up before the scorer could have answered
        health = fl.flight_action(svc.location, "health")  # degraded while the scorer is too slow
        assert health["status"] == "degraded" and "did not answer" in " ".join(health["reasons"])
        deadline = time.monotonic() + 10  # its health answers in time: the monitor clears it
        while fl.flight_action(svc.location, "health")["status"] != "ok":
            assert time.monotonic() < deadline, "health stayed degraded"
            time.sleep(0.1)
    finally:
        svc.scorer.delay_s = 0.0
        svc.close()


def test_index_host_refuses_a_scorer_with_another_corpus():
    dataset, _ = make_dataset(7)
    other, _ = make_dataset(8)
    scorer = ScoringServer(other, "grpc://127.0.0.1:0")
    try:
        with pytest.raises(RuntimeError, match="different corpus"):
            IndexHostServer(dataset, f"grpc://127.0.0.1:{scorer.port}", "grpc://127.0.0.1:0")
    finally:
        scorer.shutdown()


# --- traffic ----------------------------------------------------------------------------------------------


def test_relay_counts_every_byte_each_way():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def echo_twice():
        conn, _ = server.accept()
        data = b""
        while len(data) < 1000:
            data += conn.recv(4096)
        conn.sendall(data + data)
        conn.close()

    threading.Thread(target=echo_twice, daemon=True).start()
    with Relay("127.0.0.1", server.getsockname()[1]) as relay:
        client = socket.create_connection(("127.0.0.1", relay.port))
        client.sendall(b"x" * 1000)
        got = b""
        while len(got) < 2000:
            chunk = client.recv(4096)
            if not chunk:
                break
            got += chunk
        client.close()
        relay.wait_idle()
        traffic = relay.snapshot()
    server.close()
    assert (traffic.upstream, traffic.downstream, traffic.connections) == (1000, 2000, 1)


# --- real processes -------------------------------------------------------------------------------------


def test_remote_retriever_processes_traffic_and_sigterm():
    dataset, rng = make_dataset(31, n_ads=400, n_requests=6, precision="fp16")
    reference = ReferenceRetriever.build(dataset)
    remote = RemoteRetriever.build(dataset, traffic=True)
    try:
        answers = remote.retrieve(dataset.requests, 10)
        assert_equals_reference(reference, dataset.requests, answers, 10, "processes")
        updates = random_updates(rng, dataset.ads, 15, dim=dataset.model.D)
        for update in updates:
            remote.apply(update)
            reference.apply(update)
        answers, per_request = remote.retrieve_traffic(dataset.requests, 10)
        assert_equals_reference(reference, dataset.requests, answers, 10, "processes after updates")
        for request, (ids, _), hops in zip(dataset.requests, answers, per_request):
            assert set(hops) == {"client->index host", "index host->scorer"}
            client_hop, scorer_hop = hops["client->index host"], hops["index host->scorer"]
            assert client_hop["upstream"] > len(json.dumps(request_to_json(request)))
            assert client_hop["downstream"] >= 12 * len(ids)  # ad_id + score per row, plus framing
            if len(ids):  # the user side (20 x 16 float32) and 4 bytes per candidate go to the scorer
                assert scorer_hop["upstream"] > (2 * 6 + 2 * 8) * 16 * 4
        processes = list(remote.processes)
    finally:
        remote.close()
    assert [p.proc.returncode for p in processes] == [0, 0]  # SIGTERM: a clean exit


def test_cli_help_texts():
    from cli import main

    runner = CliRunner()
    for args in (["serve", "scorer", "--help"], ["serve", "remote", "--help"], ["bench", "cpu", "--help"]):
        result = runner.invoke(main, args)
        assert result.exit_code == 0, result.output
        assert "Usage:" in result.output and len(result.output.splitlines()) > 5


def test_cli_retrieve_remote_traffic_json_equals_reference(tmp_path):
    from cli import main

    runner = CliRunner()
    data = tmp_path / "corpus"
    result = runner.invoke(main, ["generate", "--ads", "800", "--requests", "3", "--seed", "4", "--out", str(data),
                                  "--precision", "int8", "--quiet"])
    assert result.exit_code == 0, result.output
    ref = runner.invoke(main, ["retrieve", "--data", str(data), "--arch", "reference", "--k", "20", "--json", "-q"])
    got = runner.invoke(main, ["retrieve", "--data", str(data), "--arch", "remote", "--k", "20", "--json", "-q",
                               "--traffic"])
    assert ref.exit_code == 0 and got.exit_code == 0, got.output
    ref_lines = [json.loads(line) for line in ref.stdout.splitlines()]
    got_lines = [json.loads(line) for line in got.stdout.splitlines()]
    assert [g["request_id"] for g in got_lines] == [r["request_id"] for r in ref_lines]
    for r, g in zip(ref_lines, got_lines):
        assert g["ads"] == r["ads"]  # seeded corpus without near-ties: the same order
        assert np.allclose(g["scores"], r["scores"], atol=1e-4)
        assert g["traffic"]["client->index host"]["upstream"] > 0
        assert g["traffic"]["index host->scorer"]["total"] > 0
    refused = runner.invoke(main, ["retrieve", "--data", str(data), "--arch", "reference", "--traffic"])
    assert refused.exit_code != 0 and "--traffic needs" in refused.output


def test_remote_retriever_connects_to_running_services(services):
    svc, dataset, _ = services
    reference = ReferenceRetriever.build(dataset)
    with RemoteRetriever.build(dataset, host=svc.location.split("://")[1]) as remote:
        assert remote.processes == []  # nothing started, nothing to stop
        assert_equals_reference(reference, dataset.requests, remote.retrieve(dataset.requests, 15), 15, "connected")
        assert remote.action("health")["status"] == "ok"
    assert fl.flight_action(svc.location, "health")["status"] == "ok"  # still running after close()


def test_candidate_lists_over_the_scorers_request_limit_go_in_pieces():
    """At a large pool one request's candidates can pass the scoring service's request limit (at 10M
    ads, 596,225 candidates: 4.8 MB against 4 MiB). The index host learns the limit from the
    service's health and sends such a list as several batches, each within it: answers still equal
    the reference, and the service saw more batches than requests, none over its limit."""
    from dataclasses import replace

    from serving.limits import DEFAULT_LIMITS
    from andromeda_nb.model import user_side
    from cpu_baseline.scoring_service import ScorerClient, user_side_bytes

    dataset, _ = make_dataset(31, n_ads=400, n_requests=10)
    side = user_side(dataset.model, dataset.requests[0]).float32()
    side_bytes = len(user_side_bytes(side["U"], side["Q"], side["gamma"], side["beta"]))
    limits = replace(DEFAULT_LIMITS, max_request_bytes=side_bytes + 8 * 7)  # 7 candidates a batch
    scorer = ScoringServer(dataset, "grpc://127.0.0.1:0", limits=limits)
    host = IndexHostServer(dataset, f"grpc://127.0.0.1:{scorer.port}", "grpc://127.0.0.1:0", threads=2,
                           scorer_secret=scorer.pair_secret)
    location = f"grpc://127.0.0.1:{host.port}"
    try:
        assert host.scorer.max_batch_bytes == limits.max_request_bytes
        reference = ReferenceRetriever.build(dataset)
        eligible = [len(reference.score_eligible(r)[0]) for r in dataset.requests]
        assert max(eligible) > 7, "the corpus must give some request more candidates than one batch holds"
        answers = fl.retrieve_over_flight(location, dataset.requests, 5)
        assert_equals_reference(reference, dataset.requests, answers, 5, "candidates in pieces")
        stats = fl.flight_action(f"grpc://127.0.0.1:{scorer.port}", "stats")
        assert stats["errors"] == 0
        assert stats["batches"] == sum(-(-n // 7) for n in eligible if n), stats
        # a client that does not know the limit is refused by the service, naming it
        plain = ScorerClient(f"grpc://127.0.0.1:{scorer.port}")
        try:
            ids = reference.score_eligible(dataset.requests[int(np.argmax(eligible))])[0]
            side = user_side(dataset.model, dataset.requests[int(np.argmax(eligible))]).float32()
            with pytest.raises(flight.FlightError, match="max-request-bytes"):
                plain.score([(ids, user_side_bytes(side["U"], side["Q"], side["gamma"], side["beta"]))])
        finally:
            plain.close()
    finally:
        host.shutdown()
        host.close_resources()
        scorer.shutdown()
