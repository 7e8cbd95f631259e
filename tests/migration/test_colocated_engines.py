"""The co-located server with several engines behind one front (`serve colocated --engines N`,
`serving.engine_front`): on the CPU, with 2 engine worker processes, many concurrent clients get
the answers, errors and app_metadata of a one-engine server; an acknowledged update is seen by every
worker; a restart replays the log into every worker; a killed worker fails its calls with an error
naming it, makes health degraded and hangs nothing; SIGTERM ends the front and its workers, and the
workers end when the front is killed. Servers bind 127.0.0.1 and are started and stopped here; the
only processes ended are the ones these tests started."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import numpy as np
import pyarrow.flight as flight
import pytest

from andromeda_nb import store
from serving import engine_channel as ch
from serving import protocol as fl
from serving.services import ServiceProcess, open_corpus
from tests.support.servers import (assert_equals_reference, colocated_server, ends_within, lines_of, location,
                                   process_running, reference_at, saved_corpus, stop, update_stream)

ENGINES = 2
K = 20
CLIENTS = 8


def pooled_server(dataset, log=None, engines: int = ENGINES, gpu_turn: bool = False, endpoints: bool = False,
                  guard=None, fronts: int = 0):
    """The co-located front in this process over `engines` CPU engine workers (and `fronts` front
    processes), on a free loopback port."""
    from migration.colocated import make_pooled_server

    return make_pooled_server(dataset, "grpc://127.0.0.1:0", device="cpu", engines=engines, log=log,
                              gpu_turn=gpu_turn, endpoints=endpoints, guard=guard, fronts=fronts)


def worker_pids(server) -> list[int]:
    return [w.pid for w in server.engines.workers]


def ask_worker(worker, request_batch, timeout_s: float = 30.0):
    """One request batch straight to one engine worker: (answer batch, seq)."""
    import pyarrow as pa

    schema = request_batch.schema.serialize().to_pybytes()
    body = request_batch.serialize()
    msg = worker.request(schema, body, timeout_s)
    _, seq, _, _, data = ch.split_answer(msg)
    return pa.ipc.read_record_batch(pa.py_buffer(data), fl.ANSWER_SCHEMA), seq


def _answers(batch, requests):
    return fl.split_answers(batch, [r.request_id for r in requests])


def test_many_clients_get_the_answers_of_one_engine(tmp_path):
    """Taking turns on the device (`--gpu-turn`, the workers' `serving.batcher.GpuTurn`): the other
    tests of this file run the workers without it."""
    root, dataset = saved_corpus(tmp_path / "c", seed=5, n_ads=300, n_requests=6)
    one = colocated_server(dataset)
    front = pooled_server(dataset, gpu_turn=True)
    try:
        health = fl.flight_action(location(front), "health")
        assert health["status"] == "ok", health
        assert [e["worker"] for e in health["engines"]] == [1, 2] and all(e["alive"] for e in health["engines"])
        assert health["fingerprint"] == fl.flight_action(location(one), "health")["fingerprint"]
        want = {k: fl.retrieve_over_flight(location(one), dataset.requests, k) for k in (1, K)}
        got, errors = [], []

        def client(i: int) -> None:  # each its own Flight client, one request per call, JSON or columns
            try:
                conn = flight.connect(location(front))
                try:
                    for k in ((1, K) if i == 0 else (K,)):
                        for j, request in enumerate(dataset.requests):
                            fmt = "columns" if (i + j) % 2 else "json"
                            seqs: list = []
                            answer = fl.retrieve_over_flight(location(front), [request], k, client=conn, seqs=seqs,
                                                             request_format=fmt)[0]
                            got.append((k, j, answer, seqs))
                finally:
                    conn.close()
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not errors, errors
        assert len(got) == (CLIENTS + 1) * len(dataset.requests)
        for k, j, (ids, scores), seqs in got:
            want_ids, want_scores = want[k][j]
            assert np.array_equal(ids, want_ids), f"k={k}, request {j}"
            assert np.array_equal(scores, want_scores), f"k={k}, request {j}"
            assert seqs == [0]
        stats = fl.flight_action(location(front), "stats")
        assert stats["engines"] == ENGINES and stats["requests"] == len(got) and stats["errors"] == 0
        assert all(e["requests"] > 0 for e in stats["batching"]["per_engine"]), stats["batching"]  # both served
        assert all(e["turn"] for e in stats["batching"]["per_engine"]), stats["batching"]
        # a malformed request: the one-engine server's error, and the server keeps serving
        bad = fl.request_batch([json.dumps({"request_id": 7, "user": {"age": "old"}, "context": {}})], K)
        messages = []
        for server in (one, front):
            with pytest.raises(flight.FlightServerError) as err:
                fl.exchange_batches(flight.connect(location(server)), [bad])
            messages.append(str(err.value).split(". Detail")[0])
        assert messages[0] == messages[1] and "invalid request: request 7" in messages[1]
        assert fl.retrieve_over_flight(location(front), dataset.requests[:2], K)[0][0].tolist() == \
            want[K][0][0].tolist()
    finally:
        stop(front)
        stop(one)
    assert ends_within(worker_pids(front), 30) == []


def test_an_acknowledged_update_is_seen_by_every_worker(tmp_path):
    root, dataset = saved_corpus(tmp_path / "c", seed=6, n_ads=300, n_requests=6)
    updates = update_stream(dataset, 120, seed=6)
    front = pooled_server(dataset)
    try:
        seen = 0
        for lo in range(0, len(updates), 40):  # three calls, each followed at once by retrievals
            ack = fl.send_updates(location(front), lines_of(updates[lo : lo + 40]))
            assert ack["applied"] == 40 and not ack["rejected"], ack
            seen = lo + 40
            reference = reference_at(dataset, updates[:seen])
            for worker in front.engines.workers:  # each worker, asked straight
                batch, seq = ask_worker(worker, fl.request_batch(dataset.requests, K))
                assert seq == ack["seq"], worker.name
                assert_equals_reference(reference, dataset.requests, _answers(batch, dataset.requests), K,
                                        f"{worker.name} after {seen} updates")
            for _ in range(2 * ENGINES):  # and through the front: calls take turns among the workers
                seqs: list = []
                answers = fl.retrieve_over_flight(location(front), dataset.requests, K, seqs=seqs)
                assert seqs == [ack["seq"]]
                assert_equals_reference(reference, dataset.requests, answers, K, f"served after {seen} updates")
        health = fl.flight_action(location(front), "health")
        assert health["seq"] == ack["seq"] and [e["seq"] for e in health["engines"]] == [ack["seq"]] * ENGINES
        assert health["ads"] == len(reference.index.ads)
        # an update the front rejects (a retire of an ad that is not live) changes nothing anywhere
        ack2 = fl.send_updates(location(front), json.dumps({"op": "retire", "ad_id": 10**12}))
        assert ack2["applied"] == 0 and ack2["rejected"] and ack2["seq"] == ack["seq"]
    finally:
        stop(front)


def test_the_workers_own_endpoints_answer_as_the_front_and_after_its_acknowledgements(tmp_path):
    """`--endpoints`: the front's GetFlightInfo of ["retrieve"] lists one location a worker (its own
    Flight server on the front's host); each answers the front's answers, and after an update call the
    front acknowledged, the update's answers with its seq. Updates sent to a worker's endpoint are
    refused, naming the front; its health names the worker. The client (`serving.client.query`)
    follows an endpoint, and the front once that worker is gone; a one-engine server lists none."""
    from serving.client import query

    root, dataset = saved_corpus(tmp_path / "c", seed=9, n_ads=300, n_requests=6)
    one = colocated_server(dataset)
    front = pooled_server(dataset, endpoints=True)
    try:
        assert fl.retrieve_endpoints(location(one)) == []
        endpoints = fl.retrieve_endpoints(location(front))
        assert len(set(endpoints)) == ENGINES and location(front) not in endpoints
        assert all(e.startswith("grpc://127.0.0.1:") for e in endpoints), endpoints
        health = fl.flight_action(location(front), "health")
        assert [e["endpoint"] for e in health["engines"]] == endpoints
        want = fl.retrieve_over_flight(location(one), dataset.requests, K)
        for endpoint in endpoints:
            got = fl.retrieve_over_flight(endpoint, dataset.requests, K)
            assert all(np.array_equal(g[0], w[0]) and np.array_equal(g[1], w[1]) for g, w in zip(got, want)), endpoint
            ep_health = fl.flight_action(endpoint, "health")
            assert ep_health["status"] == "ok" and ep_health["server"] == "colocated engine worker"
            assert ep_health["worker"].startswith("engine worker ")
        updates = update_stream(dataset, 80, seed=9)
        ack = fl.send_updates(location(front), lines_of(updates))
        assert ack["applied"] == 80, ack
        reference = reference_at(dataset, updates)
        for endpoint in endpoints:  # read at once after the acknowledgement: every worker holds it
            seqs: list = []
            answers = fl.retrieve_over_flight(endpoint, dataset.requests, K, seqs=seqs)
            assert seqs == [ack["seq"]], endpoint
            assert_equals_reference(reference, dataset.requests, answers, K, f"{endpoint} after the update call")
            with pytest.raises(flight.FlightServerError, match="send updates to the server that listed it"):
                fl.send_updates(endpoint, lines_of(update_stream(dataset, 2, seed=10)))
        assert fl.flight_action(location(front), "health")["seq"] == ack["seq"]  # nothing came in by the workers
        requests = _request_dicts(dataset)
        result = query(location(front), requests, K)
        assert result.request_ids == [r.request_id for r in dataset.requests]
        assert_equals_reference(reference, dataset.requests, result.answers, K, "query following an endpoint")
        served = [fl.flight_action(e, "stats")["requests"] for e in endpoints]
        assert sum(served) >= 2 * len(dataset.requests) + len(dataset.requests), served  # the query came by one
        first, second = front.engines.workers
        os.kill(first.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while first.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fl.retrieve_endpoints(location(front)) == [endpoints[1]]
        for _ in range(3):  # whichever endpoint a process picks, the answers come (the front's, when it is gone)
            result = query(location(front), requests, K)
            assert_equals_reference(reference, dataset.requests, result.answers, K, "query with a worker gone")
    finally:
        stop(front)
        stop(one)


def test_a_guarded_front_guards_its_workers_endpoints(tmp_path):
    """The workers' endpoints take the front's guard, TLS and tokens: listed as grpc+tls locations;
    without the token refused, with it answered over TLS the front's answers."""
    from serving.guard import ClientCredentials, ServerGuard
    from tests.support.servers import make_certificates

    certs = make_certificates(tmp_path / "certs")
    root, dataset = saved_corpus(tmp_path / "c", seed=11, n_ads=200, n_requests=4)
    token = "reader-token-" + "x" * 24
    guard = ServerGuard.from_files(token=token, tls_cert=certs["server"], tls_key=certs["server_key"])
    front = pooled_server(dataset, endpoints=True, guard=guard)
    try:
        here = location(front, "grpc+tls")
        creds = ClientCredentials.from_files(token=token, tls_ca=certs["ca"])
        with pytest.raises(flight.FlightUnauthenticatedError):
            fl.retrieve_endpoints(here, credentials=ClientCredentials.from_files(tls_ca=certs["ca"]))
        endpoints = fl.retrieve_endpoints(here, credentials=creds)
        assert len(endpoints) == ENGINES and all(e.startswith("grpc+tls://127.0.0.1:") for e in endpoints), endpoints
        want = fl.retrieve_over_flight(here, dataset.requests, K, credentials=creds)
        for endpoint in endpoints:
            with pytest.raises(flight.FlightUnauthenticatedError):
                fl.retrieve_over_flight(endpoint, dataset.requests, K,
                                        credentials=ClientCredentials.from_files(tls_ca=certs["ca"]))
            got = fl.retrieve_over_flight(endpoint, dataset.requests, K, credentials=creds)
            assert all(np.array_equal(g[0], w[0]) for g, w in zip(got, want))
    finally:
        stop(front)


def _request_dicts(dataset) -> list[dict]:
    """The corpus's requests as JSON-ready dicts, as `serving.client.read_requests` gives them."""
    from serving.client import read_requests

    requests, unreadable = read_requests(dataset.source_dir)
    assert not unreadable
    return requests


def test_a_restart_replays_the_log_into_every_worker(tmp_path):
    root, dataset = saved_corpus(tmp_path / "c", seed=7, n_ads=250, n_requests=5)
    updates = update_stream(dataset, 60, seed=7)
    loaded, log = open_corpus(root)
    one = colocated_server(loaded, log=log)  # the log written by a one-engine server: the same log
    try:
        ack = fl.send_updates(location(one), lines_of(updates))
        assert ack["applied"] == len(updates)
    finally:
        stop(one)
    loaded, log = open_corpus(root)
    front = pooled_server(loaded, log=log)
    try:
        health = fl.flight_action(location(front), "health")
        assert health["replayed"] == len(updates) and health["seq"] == ack["seq"]
        assert [e["seq"] for e in health["engines"]] == [ack["seq"]] * ENGINES
        reference = reference_at(dataset, updates)
        for worker in front.engines.workers:
            batch, seq = ask_worker(worker, fl.request_batch(dataset.requests, K))
            assert seq == ack["seq"]
            assert_equals_reference(reference, dataset.requests, _answers(batch, dataset.requests), K,
                                    f"{worker.name} after a restart")
        result = fl.flight_action(location(front), "compact", timeout=60)  # compaction keeps working
        assert result["seq"] == ack["seq"]
        assert fl.flight_action(location(front), "health")["log"]["base_seq"] == ack["seq"]
        assert_equals_reference(reference, dataset.requests, fl.retrieve_over_flight(location(front), dataset.requests,
                                                                                      K), K, "after compaction")
    finally:
        stop(front)
    assert store.load_dataset(root).n_ads == len(reference.index.ads)


def test_a_killed_worker_fails_its_calls_by_name_and_never_hangs(tmp_path):
    root, dataset = saved_corpus(tmp_path / "c", seed=8, n_ads=200, n_requests=4)
    front = pooled_server(dataset)
    first, second = front.engines.workers
    try:
        os.kill(first.pid, signal.SIGSTOP)  # a call in its hands, then it is killed
        outcome: dict = {}

        def call() -> None:
            try:
                outcome["answer"] = ask_worker(first, fl.request_batch(dataset.requests, K), timeout_s=60)
            except Exception as exc:  # noqa: BLE001 - checked below
                outcome["error"] = exc

        thread = threading.Thread(target=call)
        thread.start()
        time.sleep(0.3)
        os.kill(first.pid, signal.SIGKILL)
        thread.join(30)
        assert not thread.is_alive(), "the call to a killed worker hung"
        error = outcome.get("error")
        assert isinstance(error, flight.FlightUnavailableError), outcome
        assert f"engine worker 1 of 2 (pid {first.pid})" in str(error) and "SIGKILL" in str(error)
        health = fl.flight_action(location(front), "health")
        assert health["status"] == "degraded"
        assert any(f"engine worker 1 of 2 (pid {first.pid}) has ended" in r for r in health["reasons"]), health
        assert [e["alive"] for e in health["engines"]] == [False, True]
        # later requests go to the worker left, answered as before
        answers = fl.retrieve_over_flight(location(front), dataset.requests, K)
        want = fl.split_answers(ask_worker(second, fl.request_batch(dataset.requests, K))[0],
                                [r.request_id for r in dataset.requests])
        assert all(np.array_equal(a[0], w[0]) for a, w in zip(answers, want))
        ack = fl.send_updates(location(front), lines_of(update_stream(dataset, 5, seed=8)))
        assert ack["applied"] == 5  # the worker left takes updates
        os.kill(second.pid, signal.SIGKILL)  # none left: a clear error at once, naming both
        started = time.monotonic()
        with pytest.raises(flight.FlightUnavailableError) as err:
            for _ in range(3):  # the first may race the reader's look at the channel
                fl.retrieve_over_flight(location(front), dataset.requests, K, timeout=30)
        assert time.monotonic() - started < 30
        assert "engine worker 2 of 2" in str(err.value)
        assert fl.flight_action(location(front), "health")["status"] == "degraded"
    finally:
        stop(front)


def test_a_call_past_its_deadline_closes_its_lane_and_the_late_answer_reaches_no_one(tmp_path):
    """A request lane (`serving.engine_channel`) whose caller gave up is never used again: the worker's
    late answer must not become the answer of the next call; the lanes' socket is this user's only
    and is gone with the server."""
    import stat

    root, dataset = saved_corpus(tmp_path / "c", seed=13, n_ads=200, n_requests=4)
    front = pooled_server(dataset, engines=1)
    (worker,) = front.engines.workers
    lane_dir = os.path.dirname(worker.lane_path)
    try:
        assert stat.S_IMODE(os.stat(lane_dir).st_mode) == 0o700
        first, second = fl.request_batch(dataset.requests[:1], K), fl.request_batch(dataset.requests[1:3], K)
        want, _ = ask_worker(worker, second)
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            with pytest.raises(flight.FlightTimedOutError, match=r"engine worker 1 of 1 .* within 0.5 s"):
                ask_worker(worker, first, timeout_s=0.5)
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        assert worker.in_hand == 0
        for _ in range(3):  # the late answer (to `first`) is on a closed lane, not the next call's
            got, _ = ask_worker(worker, second)
            assert got.equals(want)
        served = fl.retrieve_over_flight(location(front), dataset.requests, K)
        assert [len(ids) for ids, _ in served] == [len(ids) for ids, _ in _answers(
            ask_worker(worker, fl.request_batch(dataset.requests, K))[0], dataset.requests)]
    finally:
        stop(front)
    assert not os.path.exists(lane_dir)


def _serve(root, *extra, env=None) -> ServiceProcess:
    return ServiceProcess("migration.colocated_server", ["--data", str(root), "--device", "cpu", "--log", "off",
                                                          "--engines", str(ENGINES), *extra], name="front", env=env)


def test_sigterm_ends_the_front_and_every_worker(tmp_path):
    root, dataset = saved_corpus(tmp_path / "c", seed=9, n_ads=150, n_requests=3)
    proc = _serve(root)
    try:
        pids = [e["pid"] for e in fl.flight_action(proc.location, "health")["engines"]]
        assert len(pids) == ENGINES and all(process_running(p) for p in pids)
        assert len(fl.retrieve_over_flight(proc.location, dataset.requests, K)) == len(dataset.requests)
    finally:
        code = proc.stop()
    assert code == 0
    assert ends_within(pids, 30) == []


def test_workers_end_when_the_front_is_killed_and_leave_no_lane_sockets(tmp_path):
    import tempfile
    from pathlib import Path

    root, _ = saved_corpus(tmp_path / "c", seed=10, n_ads=150, n_requests=3)
    scratch = Path(tempfile.mkdtemp(prefix="t-", dir="/tmp"))  # the front makes its lane directory here
    proc = _serve(root, env={"TMPDIR": str(scratch)})
    try:
        pids = [e["pid"] for e in fl.flight_action(proc.location, "health")["engines"]]
        lanes = list(scratch.glob("andromeda-lanes-*"))
        assert len(lanes) == 1 and len(list(lanes[0].glob("worker-*.sock"))) == ENGINES
        proc.proc.send_signal(signal.SIGKILL)
        proc.proc.wait(30)
    finally:
        proc.stop()
    assert ends_within(pids, 30) == []
    left = list(scratch.iterdir())
    scratch.rmdir() if not left else None
    assert left == [], "the workers of a killed front left their lane sockets behind"


def test_the_lane_directory_leaves_a_temporary_directory_too_long_for_a_socket(tmp_path, monkeypatch):
    import tempfile

    from serving.engine_front import UNIX_PATH_BYTES, lane_directory
    from serving.process import ServeError

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    path = lane_directory(4)
    try:
        assert path.startswith("/tmp/andromeda-lanes-") and len(path + "/worker-4.sock") <= UNIX_PATH_BYTES
        assert os.stat(path).st_mode & 0o777 == 0o700
    finally:
        os.rmdir(path)
    assert list(deep.iterdir()) == []  # the one it tried there is gone
    other = tmp_path / ("f" * 100)
    other.mkdir()
    with pytest.raises(ServeError, match="TMPDIR to a shorter directory"):
        lane_directory(4, fallback=str(other))
    assert list(deep.iterdir()) == [] and list(other.iterdir()) == []


def test_engines_must_be_a_whole_number_of_at_least_one(tmp_path):
    import subprocess
    import sys

    from click.testing import CliRunner

    from cli import main
    from migration.colocated_server import run_colocated
    from serving.process import ServeError

    root, _ = saved_corpus(tmp_path / "c", seed=11, n_ads=50, n_requests=2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ServeError, match="--engines"):
            run_colocated(root, engines=bad)
    done = subprocess.run([sys.executable, "-m", "migration.colocated_server", "--data", str(root), "--device", "cpu",
                           "--engines", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--engines" in done.stderr and "at least 1" in done.stderr
    result = CliRunner().invoke(main, ["serve", "colocated", "--data", str(root), "--device", "cpu", "--engines", "0"])
    assert result.exit_code == 2 and "--engines" in result.output
    with pytest.raises(ServeError, match="--gpu-turn.*--engines 2"):  # a turn needs someone to take turns with
        run_colocated(root, engines=1, gpu_turn=True)
    result = CliRunner().invoke(main, ["serve", "colocated", "--data", str(root), "--device", "cpu", "--gpu-turn"])
    assert result.exit_code == 2 and "--gpu-turn" in result.output and "--engines 2" in result.output
    with pytest.raises(ServeError, match="--overlap-batches and --gpu-turn"):  # a turn holder has nothing to overlap
        run_colocated(root, engines=2, gpu_turn=True, overlap=True)
    result = CliRunner().invoke(main, ["serve", "colocated", "--data", str(root), "--device", "cpu", "--engines", "2",
                                       "--gpu-turn", "--overlap-batches"])
    assert result.exit_code == 2 and "--overlap-batches" in result.output and "one of the two" in result.output
    for bad in (-1, 1.5, True):
        with pytest.raises(ServeError, match="--fronts"):
            run_colocated(root, fronts=bad)
    with pytest.raises(ServeError, match="--fronts and --endpoints"):  # the fronts are what the server lists
        run_colocated(root, engines=2, fronts=2, endpoints=True)
    result = CliRunner().invoke(main, ["serve", "colocated", "--data", str(root), "--device", "cpu", "--engines", "2",
                                       "--fronts", "2", "--endpoints"])
    assert result.exit_code == 2 and "--fronts" in result.output and "one of --fronts and --endpoints" in result.output
    result = CliRunner().invoke(main, ["serve", "colocated", "--data", str(root), "--device", "cpu", "--fronts", "-1"])
    assert result.exit_code == 2 and "--fronts" in result.output


def test_a_worker_that_cannot_start_stops_the_server_with_its_reason(tmp_path):
    import subprocess
    import sys

    root, _ = saved_corpus(tmp_path / "c", seed=12, n_ads=50, n_requests=2)
    done = subprocess.run([sys.executable, "-m", "migration.colocated_server", "--data", str(root), "--device", "cpu",
                           "--log", "off", "--engines", "2", "--layout", "geo"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and not done.stdout  # never listened
    assert "engine worker" in done.stderr and "ended while starting" in done.stderr
    assert "slot layout 'geo' is the GPU engine's" in done.stderr


def test_fronts_gather_their_clients_into_engine_batches_and_answer_as_one_engine(tmp_path):
    """`--fronts 2` beside one engine worker: GetFlightInfo lists the two fronts (not the worker); many
    clients at once on the fronts, JSON and columnar, sharing request ids, each get the one-engine
    server's answers for their own requests, and the engine worker ran fewer batches than the fronts
    sent it requests; after an acknowledged update every front answers with it and its seq; a front
    refuses updates naming the server; health lists the fronts, and a killed front makes it degraded
    naming that front while the other answers; a killed engine worker fails the fronts' calls naming
    it."""
    from tests.support.threads import run_in_threads

    root, dataset = saved_corpus(tmp_path / "c", seed=13, n_ads=300, n_requests=8)
    one = colocated_server(dataset)
    front = pooled_server(dataset, engines=1, fronts=2)
    try:
        endpoints = fl.retrieve_endpoints(location(front))
        assert len(set(endpoints)) == 2 and location(front) not in endpoints, endpoints
        health = fl.flight_action(location(front), "health")
        assert [f["endpoint"] for f in health["fronts"]] == endpoints and len(health["engines"]) == 1
        assert all(f["engine"]["engine"].startswith("engine worker 1 of 1") for f in health["fronts"]), health["fronts"]
        want = fl.retrieve_over_flight(location(one), dataset.requests, K)
        requests = dataset.requests

        done, failed = [], []

        def client(i):  # every client asks the same requests (the same ids) in its own order and form
            try:
                order = [(j + i) % len(requests) for j in range(len(requests))]
                mine = [requests[j] for j in order]
                form = "columns" if i % 2 else "json"
                for part in (mine[:3], mine[3:]):
                    got = fl.retrieve_over_flight(endpoints[i % 2], part, K, request_format=form)
                    for r, g in zip(part, got):
                        w = want[requests.index(r)]
                        assert np.array_equal(g[0], w[0]) and np.array_equal(g[1], w[1]), (i, r.request_id)
                done.append(i)
            except BaseException as exc:  # noqa: BLE001 - the test says which client failed, and how
                failed.append((i, repr(exc)))

        run_in_threads(client, CLIENTS)
        assert not failed and sorted(done) == list(range(CLIENTS)), failed
        stats = fl.flight_action(location(front), "stats")
        engine_requests = stats["batching"]["requests"]
        front_calls = sum(f["calls"] for f in stats["front_batching"])
        assert engine_requests >= CLIENTS * len(requests) and front_calls >= 2 * CLIENTS, stats
        assert stats["batching"]["calls"] < front_calls, stats  # each front batch is one call to the engine
        updates = update_stream(dataset, 60, seed=13)
        ack = fl.send_updates(location(front), lines_of(updates))
        reference = reference_at(dataset, updates)
        for endpoint in endpoints:
            seqs: list = []
            answers = fl.retrieve_over_flight(endpoint, requests, K, seqs=seqs)
            assert seqs == [ack["seq"]], endpoint
            assert_equals_reference(reference, requests, answers, K, f"{endpoint} after the update call")
            with pytest.raises(flight.FlightServerError, match="send updates to the server that listed it"):
                fl.send_updates(endpoint, lines_of(update_stream(dataset, 2, seed=14)))
            own = fl.flight_action(endpoint, "health")
            assert own["server"] == "colocated front" and own["worker"].startswith("front "), own
        assert fl.retrieve_over_flight(endpoints[0], requests[:1], K, request_format="columns")
        first = front.engines.fronts[0]
        os.kill(first.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while first.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        health = fl.flight_action(location(front), "health")
        assert health["status"] == "degraded" and any(first.name in r for r in health["reasons"]), health
        assert fl.retrieve_endpoints(location(front)) == [endpoints[1]]
        assert_equals_reference(reference, requests, fl.retrieve_over_flight(endpoints[1], requests, K), K, "one front")
        os.kill(front.engines.workers[0].pid, signal.SIGKILL)
        with pytest.raises(flight.FlightUnavailableError, match="engine worker 1 of 1"):
            fl.retrieve_over_flight(endpoints[1], requests, K)
    finally:
        stop(front)
        stop(one)
