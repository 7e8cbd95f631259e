"""Acknowledged updates survive (issue 15, points 1 and 3): the co-located server killed with SIGKILL at
random points of an update stream (compactions among the calls), many times; after each restart every
acknowledged update is present, no update is half there, and the answers equal the oracle and the
float64 reference for exactly the state the server reports. A clean SIGTERM restart keeps everything;
the remote index host replays its log the same way. Servers bind 127.0.0.1 and are started and
stopped here."""

from __future__ import annotations

import pytest
import json
import threading

import numpy as np
import pyarrow.flight as flight

from serving import protocol as fl
from andromeda_nb.reference import ReferenceRetriever
from serving.services import ServiceProcess
from andromeda_nb.testing import update_to_json

from tests.support.servers import assert_equals_reference, reference_at, saved_corpus, update_stream

pytestmark = pytest.mark.e2e  # starts servers or processes, or runs whole commands

KILLS = 16  # SIGKILLs of the crash loop (each restart replays and is checked)
K_ALL = 4096  # above every eligible count: the answer is the whole eligible set, ranked
CRASH_SEED = 20260415


def _start(root, *extra):
    return ServiceProcess("migration.colocated_server", ["--data", str(root), "--device", "cpu", *extra],
                          name="the co-located server")


def _check_state(location, dataset, reference, context):
    answers = fl.retrieve_over_flight(location, dataset.requests, K_ALL, timeout=60)
    assert_equals_reference(reference, dataset.requests, answers, K_ALL, context)


def test_sigkill_at_random_points_loses_no_acknowledged_update(tmp_path):
    root, dataset = saved_corpus(tmp_path / "corpus", 21, n_ads=150, n_requests=6, precision="int8")
    stream = update_stream(dataset, 4000, CRASH_SEED)
    lines = [json.dumps(update_to_json(u)) for u in stream]
    rng = np.random.default_rng(CRASH_SEED)
    reference, at = ReferenceRetriever.build(dataset), 0  # the reference after stream[:at]
    acked = 0  # every update before this index was acknowledged
    compactions = 0
    print(f"crash loop: seed {CRASH_SEED}, {KILLS} kills, {len(stream)} updates")
    for kill in range(KILLS + 1):
        server = _start(root)
        try:
            health = fl.flight_action(server.location, "health")
            seq = health["seq"]
            context = f"restart {kill} (seed {CRASH_SEED}): server at update {seq}, {acked} acknowledged"
            assert acked <= seq <= len(stream), context  # nothing acknowledged is lost; nothing invented
            while at < seq:  # every update of the stream is valid, so the server holds exactly stream[:seq]
                reference.apply(stream[at])
                at += 1
            _check_state(server.location, dataset, reference, context)
            if kill == KILLS or seq == len(stream):
                break
            killer = threading.Timer(float(rng.uniform(0.02, 0.4)), server.proc.kill)
            killer.start()
            sent = acked = seq  # updates it holds but never acknowledged are kept: the stream goes on from them
            try:
                while sent < len(stream):
                    if rng.random() < 0.12:
                        fl.flight_action(server.location, "compact", timeout=30)
                        compactions += 1
                        continue
                    n = int(rng.integers(1, 25))
                    body = "\n".join(lines[sent : sent + n])
                    sent = min(len(stream), sent + n)
                    ack = fl.flight_action(server.location, "update", body, timeout=30)
                    assert ack["applied"] == ack["seq"] - acked and not ack["rejected"], ack
                    acked = ack["seq"]
                    assert acked == sent, context
            except flight.FlightError:
                pass  # killed mid-call: that call was not acknowledged
            finally:
                killer.cancel()
                server.proc.kill()  # the stream ran out first: the kill comes after the last acknowledgement
            server.proc.wait(10)
        finally:
            server.stop()
    assert compactions > 0 and acked > 100, (compactions, acked)


def test_clean_restart_keeps_every_update(tmp_path):
    root, dataset = saved_corpus(tmp_path / "corpus", 22, n_ads=100, n_requests=4)
    stream = update_stream(dataset, 60, 3)
    server = _start(root)
    try:
        ack = fl.flight_action(server.location, "update", "\n".join(json.dumps(update_to_json(u)) for u in stream))
        assert ack["seq"] == 60
    finally:
        assert server.stop() == 0  # SIGTERM: a clean exit
    server = _start(root)
    try:
        health = fl.flight_action(server.location, "health")
        assert (health["seq"], health["replayed"], health["log"]["durable"]) == (60, 60, True)
        _check_state(server.location, dataset, reference_at(dataset, stream), "after a clean restart")
    finally:
        server.stop()


def test_log_off_keeps_updates_in_memory_only_and_says_so(tmp_path):
    root, dataset = saved_corpus(tmp_path / "corpus", 23, n_ads=60, n_requests=2)
    server = _start(root, "--log", "off")
    try:
        health = fl.flight_action(server.location, "health")
        assert health["log"] == {"path": None, "durable": False, "base_seq": 0, "seq": 0}
        fl.flight_action(server.location, "update", json.dumps(update_to_json(update_stream(dataset, 1, 4)[0])))
    finally:
        server.stop()
    assert not (root / "updates.log").exists()
