"""Limits with clear errors, each configurable (issue 15, point 6): request bytes, requests per batch, k,
updates per call, update bytes, JSON depth and the per-call deadline; a call over a limit is refused
whole and changes nothing. Large update calls are applied in slices that retrieval runs between (the
latency figures are measured by scripts/bench_update_stall.py, docs/RELIABILITY.md)."""

from __future__ import annotations

import json
import threading
import time

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from serving import protocol as fl
from serving.limits import ServiceLimits
from andromeda_nb.targeting import request_to_json

from tests.support.servers import colocated_server, lines_of, saved_corpus, stop, update_stream

pytestmark = pytest.mark.e2e  # starts servers or processes, or runs whole commands


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return saved_corpus(tmp_path_factory.mktemp("limits") / "corpus", 51, n_ads=300, n_requests=4)[1]


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="max_batch_requests: expected a positive number"):
        ServiceLimits(max_batch_requests=0)
    with pytest.raises(ValueError, match="max_k: expected 1..4096"):
        ServiceLimits(max_k=5000)


def test_each_limit_refuses_a_call_naming_itself(corpus):
    limits = ServiceLimits(max_request_bytes=20_000, max_batch_requests=8, max_k=50, max_updates=5,
                           max_update_bytes=3_000, max_json_depth=4)
    server = colocated_server(corpus, limits=limits)
    loc = f"grpc://127.0.0.1:{server.port}"
    request = request_to_json(corpus.requests[0], with_id=False)
    try:
        with pytest.raises(flight.FlightServerError, match=r"batch of requests \(9\) is over the server's limit of 8 "
                                                          r"\(--max-batch-requests\)"):
            fl.retrieve_over_flight(loc, [{**request, "request_id": i} for i in range(9)], 5, batch_size=9)
        big = {**request, "padding": "x" * 30_000}
        with pytest.raises(flight.FlightServerError, match=r"request batch of bytes \(\d+\) is over the server's "
                                                          r"limit of 20000 \(--max-request-bytes\)"):
            fl.retrieve_over_flight(loc, [{**big, "request_id": 1}], 5)
        with pytest.raises(flight.FlightServerError, match=r"request 1: k = 51 is over the server's limit of 50 "
                                                          r"\(--max-k\)"):
            fl.retrieve_over_flight(loc, [{**request, "request_id": 1}], 51)
        nested = {**request, "user": {**request["user"], "x": [[[1]]]}}
        with pytest.raises(flight.FlightServerError, match="request 2: request: nested 5 levels deep; at most 4"):
            fl.retrieve_over_flight(loc, [{**nested, "request_id": 2}], 5)
        updates = "\n".join(json.dumps({"op": "status", "ad_id": int(i), "status": "PAUSED"})
                             for i in corpus.ad_ids[:6]).split("\n")
        with pytest.raises(flight.FlightServerError, match=r"invalid update: update call of lines \(6\) is over the "
                                                          r"server's limit of 5 \(--max-updates\)"):
            fl.flight_action(loc, "update", "\n".join(updates))
        with pytest.raises(flight.FlightServerError, match=r"update body of bytes \(\d+\) is over the server's limit "
                                                          r"of 3000 \(--max-update-bytes\)"):
            fl.flight_action(loc, "update", "\n".join(updates[:5]) + " " * 3000)
        assert server.seq == 0  # nothing of a refused call was applied
        assert len(fl.retrieve_over_flight(loc, [{**request, "request_id": i} for i in range(8)], 50)) == 8
    finally:
        stop(server)


def test_the_deadline_bounds_waiting_updates_and_old_exchanges(corpus):
    server = colocated_server(corpus, limits=ServiceLimits(deadline_s=0.5))
    loc = f"grpc://127.0.0.1:{server.port}"
    try:
        with server.journal.lock:  # another update call holding the server for longer than the deadline
            with pytest.raises(flight.FlightTimedOutError, match="waited .* past the server's deadline of 0.5 s "
                                                                 r"\(--deadline\); nothing was applied"):
                fl.flight_action(loc, "update", lines_of(update_stream(corpus, 2, 2)), timeout=10)
        assert server.seq == 0
        client = flight.connect(loc)
        try:
            writer, reader = client.do_exchange(flight.FlightDescriptor.for_path("retrieve"))
            with pytest.raises(flight.FlightTimedOutError, match="older than the server's deadline of 0.5 s"):
                with writer:
                    writer.begin(fl.REQUEST_SCHEMA)
                    writer.write_batch(fl.request_batch(corpus.requests[:1], 5))
                    reader.read_chunk()  # the first batch is answered in time
                    time.sleep(0.7)
                    writer.write_batch(fl.request_batch(corpus.requests[:1], 5))
                    reader.read_chunk()
        finally:
            client.close()
    finally:
        stop(server)


def test_a_large_update_call_is_applied_in_slices_that_retrieval_runs_between(corpus):
    server = colocated_server(corpus, limits=ServiceLimits(update_slice=32))
    loc = f"grpc://127.0.0.1:{server.port}"
    updates = update_stream(corpus, 2000, 3)
    seen: list = []
    acks: list = []
    try:
        thread = threading.Thread(target=lambda: acks.append(fl.flight_action(loc, "update", lines_of(updates),
                                                                              timeout=120)))
        thread.start()
        client = flight.connect(loc)
        while thread.is_alive():  # the seq each answer reflects: some fall inside the call
            seqs: list = []
            fl.retrieve_over_flight(loc, corpus.requests[:1], 10, client=client, seqs=seqs)
            seen.extend(seqs)
        client.close()
        thread.join()
        assert acks[0]["seq"] == 2000 and server.journal.slices >= 2000 // 32 + 1
        inside = [s for s in seen if 0 < s < 2000]
        assert inside, f"no retrieval ran between the slices (answers at {sorted(set(seen))})"
    finally:
        stop(server)


def test_an_update_call_keeps_to_its_cpu_share_only_while_retrievals_arrive():
    """While a retrieval began or ended within ACTIVE_S, the journal pauses between slices so that
    applying takes at most `update_cpu_share` of the call's time; with no retrieval, or a share of
    1, it never pauses."""
    from serving.durable import MIN_PAUSE_S, ReadGate, UpdateJournal
    from serving.wal import WriteAheadLog

    lines = [json.dumps({"op": "retire", "ad_id": i}) for i in range(1, 81)]

    def run(share: float, reading: bool) -> tuple[float, float, float]:
        gate = ReadGate()
        journal = UpdateJournal(WriteAheadLog.memory("test"), seed=1, dim=8, formats=2, gate=gate,
                                limits=ServiceLimits(update_slice=4, update_cpu_share=share))
        applied_s = []

        def apply(items):
            if reading:
                with gate.reading():  # a retrieval batch arrives between the slices
                    pass
            t0 = time.monotonic()
            time.sleep(0.003)
            applied_s.append(time.monotonic() - t0)
            return None

        t0 = time.monotonic()
        ack = journal.submit("\n".join(lines).encode(), live=lambda ad_id: True, apply=apply)
        assert ack["applied"] == 80 and len(applied_s) == 20
        return journal.paused_s, sum(applied_s[:-1]), time.monotonic() - t0  # no pause after the last slice

    for share in (0.5, 0.2):
        paused, busy, call_s = run(share, reading=True)
        # applying took at most its share of the call's time (a pause owed at a window's end, or
        # the last, may be left untaken), and the pauses asked for never exceed what leaves
        # applying exactly that share
        assert busy / (call_s + 3 * MIN_PAUSE_S) <= share * 1.02, (share, busy, call_s)
        assert 0 < paused <= busy * (1 / share - 1) * 1.02, (share, paused, busy)
    assert run(1.0, reading=True)[0] == 0 and run(0.5, reading=False)[0] == 0
    with pytest.raises(ValueError, match="update_cpu_share: expected a share in"):
        ServiceLimits(update_cpu_share=1.5)


def test_parsing_and_logging_keep_to_the_share_too():
    """A large call's parsing and log encoding pause like its applying while retrievals arrive (every
    PACE_EVERY lines), so the whole call leaves the cores to retrieval; with no retrieval, or a share
    of 1, parsing never pauses."""
    from serving.durable import ReadGate, UpdateJournal
    from serving.wal import WriteAheadLog

    lines = "\n".join(json.dumps({"op": "retire", "ad_id": i}) for i in range(1, 4001)).encode()

    def run(share: float, reading: bool) -> tuple[float, float]:
        gate = ReadGate()
        journal = UpdateJournal(WriteAheadLog.memory("test"), seed=1, dim=8, formats=2, gate=gate,
                                limits=ServiceLimits(update_slice=1 << 20, update_cpu_share=share))
        stop = threading.Event()

        def retrievals():  # a retrieval every 5 ms while the call runs
            while not stop.is_set():
                with gate.reading():
                    pass
                time.sleep(0.005)

        thread = threading.Thread(target=retrievals, daemon=True)
        if reading:
            thread.start()
            time.sleep(0.02)
        try:
            ack = journal.submit(lines, live=lambda ad_id: True, apply=lambda items: None)
        finally:
            stop.set()
        assert ack["applied"] == 4000
        return journal.paused_s, ack["seconds"]["parse"]

    paused, parse_s = run(0.25, True)  # one slice and a log in memory: every pause is the parse's
    # at a share of a quarter about three quarters of the parse's time are pauses; half of that at least
    assert paused >= 0.35 * parse_s, (paused, parse_s)
    assert run(1.0, True)[0] == 0 and run(0.25, False)[0] == 0
