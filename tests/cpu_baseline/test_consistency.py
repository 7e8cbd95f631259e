"""One order of updates for both remote services (issue 15, points 1, 2 and 4): a scoring service that
restarts is caught up from the index host's log before it scores again; updates sent while it is down
or paused are acknowledged once logged, never applied to one service only, and applied to both as soon
as it answers; `health` says degraded meanwhile; the scoring service takes only its host's numbered
records, idempotently. In-process servers on 127.0.0.1, plus one pair of real processes."""

from __future__ import annotations

import json
import time

import pyarrow.flight as flight
import pytest

from serving import protocol as fl
from serving.services import ServiceProcess
from andromeda_nb.testing import update_to_json
from cpu_baseline.index_host import IndexHostServer
from cpu_baseline.scoring_service import ScorerBehind, ScorerClient, ScoringServer
from serving.guard import new_pair_secret, sign_records
from serving.wal import corpus_lineage

from tests.support.servers import assert_equals_reference, lines_of, reference_at, saved_corpus, update_stream

pytestmark = pytest.mark.e2e  # starts servers or processes, or runs whole commands

K = 50
SECRET = new_pair_secret()  # the pair's: a scoring service started again here gets the same one


def _scorer(dataset, location="grpc://127.0.0.1:0", **kw):
    return ScoringServer(dataset, location, pair_secret=SECRET, **kw)


def _host(dataset, scorer_port, **kw):
    return IndexHostServer(dataset, f"grpc://127.0.0.1:{scorer_port}", "grpc://127.0.0.1:0", threads=1,
                           monitor_s=kw.pop("monitor_s", 0.1), scorer_secret=kw.pop("scorer_secret", SECRET), **kw)


def _records(dataset, *records, lineage=None) -> bytes:
    """Log records as the index host delivers them, naming the log's lineage (unsigned)."""
    lineage = corpus_lineage(dataset) if lineage is None else lineage
    return "\n".join(json.dumps({"seq": seq, "lineage": lineage, "update": update}) for seq, update in records).encode()


def _wait_for(predicate, timeout=15.0, what="the condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen within {timeout} s")


@pytest.fixture
def pair(tmp_path):
    root, dataset = saved_corpus(tmp_path / "corpus", 31, n_ads=160, n_requests=6, precision="fp16")
    servers = {"scorer": _scorer(dataset, "grpc://127.0.0.1:0")}
    servers["host"] = _host(dataset, servers["scorer"].port)
    yield servers, dataset
    for server in servers.values():
        server.shutdown()
    servers["host"].close_resources()


def _loc(server):
    return f"grpc://127.0.0.1:{server.port}"


def test_a_restarted_scorer_is_caught_up_before_it_scores(pair):
    servers, dataset = pair
    stream = update_stream(dataset, 40, 1)
    assert fl.flight_action(_loc(servers["host"]), "update", lines_of(stream))["seq"] == 40
    reference = reference_at(dataset, stream)
    assert_equals_reference(reference, dataset.requests, fl.retrieve_over_flight(_loc(servers["host"]),
                                                                                dataset.requests, K), K, "before")
    port = servers["scorer"].port
    servers["scorer"].shutdown()
    _wait_for(lambda: fl.flight_action(_loc(servers["host"]), "health")["status"] == "degraded",
              what="health saying degraded")
    assert "unreachable" in " ".join(fl.flight_action(_loc(servers["host"]), "health")["reasons"])
    servers["scorer"] = _scorer(dataset, f"grpc://127.0.0.1:{port}")  # back at its snapshot: update 0
    answers = fl.retrieve_over_flight(_loc(servers["host"]), dataset.requests, K)  # caught up, then scored
    assert_equals_reference(reference, dataset.requests, answers, K, "after the scorer restarted")
    assert servers["scorer"].seq == 40
    _wait_for(lambda: fl.flight_action(_loc(servers["host"]), "health")["status"] == "ok", what="health ok")


def test_both_services_restarted_the_host_replays_its_log_and_catches_the_scorer_up(tmp_path):
    """The index host started again on its log (records 1..N) beside a fresh scoring service (update
    0): before it listens it brings the scorer to N, in slices of the host's update slice."""
    from serving.limits import ServiceLimits
    from serving.wal import WriteAheadLog, corpus_lineage

    root, dataset = saved_corpus(tmp_path / "corpus", 32, n_ads=120, n_requests=4, precision="fp16")
    stream = update_stream(dataset, 30, 2)
    log = WriteAheadLog.open(tmp_path / "updates.log", lineage=corpus_lineage(dataset), snapshot_seq=0)
    scorer = _scorer(dataset, "grpc://127.0.0.1:0")
    host = _host(dataset, scorer.port, log=log, limits=ServiceLimits(update_slice=7))
    try:
        assert fl.flight_action(_loc(host), "update", lines_of(stream))["seq"] == 30
    finally:
        host.shutdown()
        host.close_resources()
        scorer.shutdown()
    log = WriteAheadLog.open(tmp_path / "updates.log", lineage=corpus_lineage(dataset), snapshot_seq=0)
    scorer = _scorer(dataset, "grpc://127.0.0.1:0")
    host = _host(dataset, scorer.port, log=log, limits=ServiceLimits(update_slice=7))
    try:
        assert host.replayed == 30 and scorer.seq == 30
        assert_equals_reference(reference_at(dataset, stream), dataset.requests,
                                fl.retrieve_over_flight(_loc(host), dataset.requests, K), K, "both restarted")
    finally:
        host.shutdown()
        host.close_resources()
        scorer.shutdown()


def test_updates_while_the_scorer_is_down_are_logged_then_applied_to_both(pair):
    servers, dataset = pair
    host = _loc(servers["host"])
    stream = update_stream(dataset, 30, 2)
    fl.flight_action(host, "update", lines_of(stream[:10]))
    port = servers["scorer"].port
    servers["scorer"].shutdown()
    servers["host"].scorer.timeout_s = 2.0
    ack = fl.flight_action(host, "update", lines_of(stream[10:]), timeout=30)
    assert (ack["applied"], ack["seq"], ack["pending"]) == (20, 30, 20), ack  # acknowledged: on disk
    assert "will be applied before the next retrieval" in ack["warning"]
    assert servers["host"].index_seq == 10  # the index waits for the scorer: never one service alone
    with pytest.raises(flight.FlightUnavailableError, match="scoring service .* 20 logged updates wait"):
        fl.retrieve_over_flight(host, dataset.requests, K, timeout=30)
    health = fl.flight_action(host, "health")
    assert health["status"] == "degraded" and "20 logged updates wait for the scoring service" in health["reasons"]
    servers["scorer"] = _scorer(dataset, f"grpc://127.0.0.1:{port}")
    _wait_for(lambda: fl.flight_action(host, "health")["status"] == "ok", what="the monitor catching up")
    assert servers["scorer"].seq == servers["host"].index_seq == 30
    answers = fl.retrieve_over_flight(host, dataset.requests, K)
    assert_equals_reference(reference_at(dataset, stream), dataset.requests, answers, K, "after catching up")


def test_a_paused_scorer_applies_late_and_nothing_is_applied_twice(pair, monkeypatch):
    servers, dataset = pair
    host, scorer = _loc(servers["host"]), servers["scorer"]
    stream = update_stream(dataset, 25, 3)
    real = scorer.apply_records

    def paused(body):
        time.sleep(1.5)  # longer than the host waits: the host gets a timeout, the scorer applies anyway
        return real(body)

    monkeypatch.setattr(scorer, "apply_records", paused)
    servers["host"].scorer.timeout_s = 0.5
    ack = fl.flight_action(host, "update", lines_of(stream), timeout=30)
    assert ack["pending"] == 25 and ack["seq"] == 25
    monkeypatch.setattr(scorer, "apply_records", real)
    _wait_for(lambda: scorer.seq == 25, what="the paused scorer applying")
    servers["host"].scorer.timeout_s = 10.0
    answers = fl.retrieve_over_flight(host, dataset.requests, K, timeout=30)
    assert_equals_reference(reference_at(dataset, stream), dataset.requests, answers, K, "after the pause")
    assert fl.flight_action(_loc(scorer), "stats")["updates"] == 25  # the re-delivery changed nothing


def test_the_scorer_takes_only_numbered_records_from_its_host(pair):
    servers, dataset = pair
    scorer = _loc(servers["scorer"])
    update = update_to_json(update_stream(dataset, 1, 4)[0])
    with pytest.raises(flight.FlightServerError, match="takes its index host's log records .* only"):
        fl.flight_action(scorer, "update", sign_records(SECRET, json.dumps(update).encode()))  # a stray update
    with pytest.raises(flight.FlightServerError, match="records start at 5, but this service is at update 0"):
        fl.flight_action(scorer, "update", sign_records(SECRET, _records(dataset, (5, update))))
    record = sign_records(SECRET, _records(dataset, (1, update)))
    assert fl.flight_action(scorer, "update", record) == {"applied": 1, "seq": 1}
    assert fl.flight_action(scorer, "update", record) == {"applied": 0, "seq": 1}  # re-delivery: a no-op
    client = ScorerClient(scorer)
    try:
        with pytest.raises(ScorerBehind, match="at update 1, the caller expects 0"):
            client.score([(dataset.ad_ids[:3], b"\0" * 4 * (2 * 6 + 2 * 8) * 16)], seq=0)
    finally:
        client.close()


def test_a_forged_or_out_of_lineage_record_is_refused_and_health_says_so(pair):
    """On the default open loopback, one forged `{"seq": 1, ...}` record sent to the scoring service
    made it skip the index host's real record 1, and answers stayed wrong with health ok on both
    sides. Records are taken only signed with the pair's secret (or with the admin token) and naming
    the scoring service's lineage: a record without a signature, with a wrong one (another secret,
    or a body changed after signing) or of another log is refused whole, nothing is applied, both
    healths say so, and the index host's real records then apply and answer as the reference."""
    servers, dataset = pair
    scorer, host = servers["scorer"], _loc(servers["host"])
    forged_update = {"op": "retire", "ad_id": int(dataset.ad_ids[0])}
    forged = _records(dataset, (1, forged_update))
    tampered = sign_records(SECRET, _records(dataset, (1, update_to_json(update_stream(dataset, 1, 6)[0]))))
    tampered = tampered.replace(b'"seq": 1, ', b'"seq": 1, "x": 0, ')
    refusals = [(forged, flight.FlightUnauthorizedError, "no signature"),
                (sign_records(new_pair_secret(), forged), flight.FlightUnauthorizedError, "does not hold"),
                (tampered, flight.FlightUnauthorizedError, "does not hold"),
                (sign_records(SECRET, _records(dataset, (1, forged_update), lineage="another-log")),
                 flight.FlightServerError, "belongs to the log of lineage 'another-log'")]
    for n, (body, error, reason) in enumerate(refusals, start=1):
        with pytest.raises(error, match=reason):
            fl.flight_action(_loc(scorer), "update", body)
        health = fl.flight_action(_loc(scorer), "health")
        assert health["seq"] == 0 and health["refused"]["updates"] == n and reason in health["refused"]["last"]
    assert scorer.seq == 0 and int(dataset.ad_ids[0]) in scorer.table  # nothing of them applied
    _wait_for(lambda: fl.flight_action(host, "health").get("scorer_refused", {}).get("updates") == len(refusals),
              what="the index host's health repeating the scorer's refusals")
    stream = update_stream(dataset, 12, 7)
    assert fl.flight_action(host, "update", lines_of(stream))["seq"] == 12  # the real records, signed, apply
    assert scorer.seq == 12
    assert_equals_reference(reference_at(dataset, stream), dataset.requests,
                            fl.retrieve_over_flight(host, dataset.requests, K), K, "after the forged records")
    assert fl.flight_action(host, "health")["status"] == "ok"


def test_the_pair_started_for_a_command_shares_its_secret_out_of_the_arguments(tmp_path):
    """`RemoteRetriever.build` makes the pair's secret and hands it to both processes in their
    environment: no argument of either holds it, the pair's updates apply, and a record sent to the
    scoring service by anyone else is refused."""
    from cpu_baseline.remote import RemoteRetriever

    root, dataset = saved_corpus(tmp_path / "corpus", 34, n_ads=100, n_requests=4)
    retriever = RemoteRetriever.build(dataset, data_dir=str(root))
    try:
        scorer = next(p for p in retriever.processes if p.name == "scorer")
        secrets = set()
        for proc in retriever.processes:
            with open(f"/proc/{proc.proc.pid}/environ", "rb") as fh:
                secrets |= {v for k, _, v in (x.partition(b"=") for x in fh.read().split(b"\0"))
                            if k == b"ANDROMEDA_PAIR_SECRET"}
            with open(f"/proc/{proc.proc.pid}/cmdline", "rb") as fh:
                arguments = fh.read()
            assert b"secret" not in arguments.lower()
        assert len(secrets) == 1 and not any(secret in arguments for secret in secrets)
        assert not (root / "pair.secret").exists()  # a command's own services write nothing into the corpus
        stream = update_stream(dataset, 6, 8)
        assert retriever.apply_lines(lines_of(stream).splitlines())["seq"] == 6
        with pytest.raises(flight.FlightUnauthorizedError, match="index host only"):
            fl.flight_action(scorer.location, "update", _records(dataset, (7, {"op": "retire",
                                                                               "ad_id": int(dataset.ad_ids[1])})))
        assert_equals_reference(reference_at(dataset, stream), dataset.requests, retriever.retrieve(dataset.requests, K),
                                K, "the pair started for a command")
    finally:
        retriever.close()


def test_processes_scorer_killed_and_restarted_on_the_same_port(tmp_path):
    """The issue's case 1 with real processes: upsert through `serve remote`, SIGKILL the scorer, start
    it again on the same port: retrieval resynchronizes instead of failing for good."""
    root, dataset = saved_corpus(tmp_path / "corpus", 32, n_ads=120, n_requests=4)
    scorer = ServiceProcess("cpu_baseline.remote_servers", ["scorer", "--data", str(root)], name="scorer")
    host = None
    try:
        host = ServiceProcess("cpu_baseline.remote_servers", ["remote", "--data", str(root), "--scorer", scorer.location],
                              name="index host")
        stream = update_stream(dataset, 20, 5)  # creates among them: ads the restarted scorer has never seen
        assert fl.flight_action(host.location, "update", lines_of(stream))["seq"] == 20
        port = scorer.port
        scorer.proc.kill()
        scorer.stop()
        scorer = ServiceProcess("cpu_baseline.remote_servers", ["scorer", "--data", str(root), "--port", str(port)],
                                name="scorer")
        answers = fl.retrieve_over_flight(host.location, dataset.requests, K, timeout=60)
        assert_equals_reference(reference_at(dataset, stream), dataset.requests, answers, K, "after SIGKILL")
        health = fl.flight_action(host.location, "health")
        assert health["seq"] == health["scorer_seq"] == 20
        host.proc.kill()  # and the host: it replays its log and the scorer needs nothing
        host.stop()
        host = ServiceProcess("cpu_baseline.remote_servers", ["remote", "--data", str(root), "--scorer", scorer.location],
                              name="index host")
        assert fl.flight_action(host.location, "health")["replayed"] == 20
        answers = fl.retrieve_over_flight(host.location, dataset.requests, K, timeout=60)
        assert_equals_reference(reference_at(dataset, stream), dataset.requests, answers, K, "after the host restarted")
    finally:
        if host is not None:
            host.stop()
        scorer.stop()


def test_a_reconnect_leaves_calls_in_flight_on_the_old_channel_alone(pair):
    """Retrievals and the monitor share the index host's scorer client: the first to see the channel
    fail replaces it, and the old one is closed only after the call deadline, so a call still on it
    never fails with "FlightClient is closed" (the soak saw that, and the monitor thread died of it)."""
    servers, dataset = pair
    client = ScorerClient(_loc(servers["scorer"]), timeout_s=0.5)
    try:
        old = client.client
        client._reconnect(old)
        fresh = client.client
        assert fresh is not old
        client._reconnect(old)  # a second thread that saw the same failure: nothing more to do
        assert client.client is fresh
        assert list(old.do_action(flight.Action("health", b"")))  # still open for a call in flight on it
        time.sleep(0.5 + 1.0 + 0.3)
        with pytest.raises(Exception, match="closed"):
            list(old.do_action(flight.Action("health", b"")))  # closed once the deadline has passed
        assert client.action("health")["status"] == "ok"
    finally:
        client.close()


def test_the_monitor_outlives_any_error_of_a_health_call(pair, monkeypatch):
    servers, dataset = pair
    host = servers["host"]
    real = host.scorer.action
    failures = []

    def flaky(name, *args, **kw):
        if name == "health" and len(failures) < 3:
            failures.append(name)
            raise ValueError("not a Flight error")
        return real(name, *args, **kw)

    monkeypatch.setattr(host.scorer, "action", flaky)
    _wait_for(lambda: len(failures) == 3, what="three failed health calls")
    assert host._monitor.is_alive(), "the monitor thread died"
    assert fl.flight_action(_loc(host), "update", lines_of(update_stream(dataset, 5, 9)))["seq"] == 5
    _wait_for(lambda: fl.flight_action(_loc(host), "health")["status"] == "ok", what="health ok again")
