"""A server's life (issue 15, point 6): SIGTERM ends it within the stop deadline whatever its clients do
(idle exchanges held open), after the batches in flight are answered; servers started for a command end
with it, even when it is killed. Processes bind 127.0.0.1 and are started and stopped here."""

from __future__ import annotations

import pytest
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pyarrow.flight as flight

from serving import protocol as fl
from serving.services import PROJECT_ROOT, ServiceProcess

from tests.support.servers import ends_within, process_running, saved_corpus

pytestmark = pytest.mark.e2e  # starts servers or processes, or runs whole commands

IDLE_CLIENTS = 20


def _hold_idle_exchanges(location, n):
    """`n` clients, each with an exchange open and nothing sent on it (the issue's idle clients)."""
    held = []
    for _ in range(n):
        client = flight.connect(location)
        writer, reader = client.do_exchange(flight.FlightDescriptor.for_path("retrieve"))
        writer.begin(fl.REQUEST_SCHEMA)
        held.append((client, writer, reader))
    return held


def _sigterm_and_time(proc: ServiceProcess) -> tuple[float, int]:
    start = time.monotonic()
    proc.proc.send_signal(signal.SIGTERM)
    code = proc.proc.wait(30)
    return time.monotonic() - start, code


def test_sigterm_ends_servers_with_idle_exchanges_within_the_deadline(tmp_path):
    root, dataset = saved_corpus(tmp_path / "corpus", 61, n_ads=80, n_requests=2)
    scorer = ServiceProcess("cpu_baseline.remote_servers", ["scorer", "--data", str(root)], name="scorer")
    servers = {
        "colocated": ServiceProcess("migration.colocated_server", ["--data", str(root), "--device", "cpu", "--log", "off"]),
        "remote": ServiceProcess("cpu_baseline.remote_servers", ["remote", "--data", str(root), "--scorer", scorer.location],
                                 name="index host"),
        "scorer": scorer,
    }
    held = []
    try:
        for name in ("colocated", "remote"):
            assert fl.retrieve_over_flight(servers[name].location, dataset.requests, 5)  # serving
            held += _hold_idle_exchanges(servers[name].location, IDLE_CLIENTS)
        for name in ("colocated", "remote", "scorer"):
            took, code = _sigterm_and_time(servers[name])
            assert code == 0 and took < 5.0 + 1.5, f"{name}: exit code {code} after {took:.1f} s"
    finally:
        for client, writer, reader in held:
            client.close()
        for proc in servers.values():
            proc.stop()


def test_a_batch_in_flight_is_answered_before_the_server_exits(tmp_path):
    root, dataset = saved_corpus(tmp_path / "corpus", 62, n_ads=80, n_requests=2)
    scorer = ServiceProcess("cpu_baseline.remote_servers", ["scorer", "--data", str(root), "--delay", "1.5"], name="scorer")
    host = ServiceProcess("cpu_baseline.remote_servers", ["remote", "--data", str(root), "--scorer", scorer.location],
                          name="index host")
    answers, errors = [], []
    try:
        thread = threading.Thread(target=lambda: _collect(answers, errors, host.location, dataset.requests))
        thread.start()
        _wait_in_flight(host.location)  # the batch is at the (slow) scorer now
        took, code = _sigterm_and_time(host)
        thread.join(30)
        assert not errors and len(answers) == len(dataset.requests), errors
        assert code == 0 and took < 5.0 + 1.5, f"exit code {code} after {took:.1f} s"
    finally:
        host.stop()
        scorer.stop()


def _wait_in_flight(location, timeout_s: float = 20.0) -> None:
    """Until the server reports a retrieval batch in flight (`stats`), however slowly the client starts."""
    deadline = time.monotonic() + timeout_s
    while fl.flight_action(location, "stats")["in_flight"] == 0:
        assert time.monotonic() < deadline, "the batch never reached the server"
        time.sleep(0.02)


def _collect(answers, errors, location, requests):
    try:
        answers.extend(fl.retrieve_over_flight(location, requests, 5, timeout=30))
    except Exception as exc:  # reported by the test
        errors.append(exc)


def test_services_started_for_a_command_end_when_it_is_killed(tmp_path):
    root, _ = saved_corpus(tmp_path / "corpus", 63, n_ads=60, n_requests=2)
    parent = textwrap.dedent(f"""
        import sys, time
        from andromeda_nb.store import load_dataset
        from cpu_baseline.remote import RemoteRetriever
        remote = RemoteRetriever.build(load_dataset({str(root)!r}))
        print(" ".join(str(p.proc.pid) for p in remote.processes), flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    children = []
    try:
        children = [int(p) for p in proc.stdout.readline().split()]
        assert len(children) == 2 and all(process_running(p) for p in children)
        proc.kill()  # as `kill -9` of `andromeda retrieve --arch remote`
        proc.wait()
        assert not ends_within(children, 10), "the scorer or index host outlived the command"
    finally:
        proc.kill()
        for pid in children:
            if process_running(pid):
                os.kill(pid, signal.SIGKILL)
