"""Limits with clear errors, each configurable (issue 15, point 6): request bytes, requests per batch, k,
updates per call, update bytes, JSON depth and the per-call deadline; a call over a limit is refused
whole and changes nothing. Large update calls are applied in slices that retrieval runs between (the
latency figures are measured by scripts/bench_update_stall.py, docs/RELIABILITY.md)."""

from __future__ import annotations

import json
import threading
import time

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
    """An update call that waits for its turn past the deadline changes nothing, however long its
    parse took (it fails before its turn or when the wait runs out, both naming the deadline); an
    exchange is dated on the server's exchange clock, here a simulated one moved on by hand, so its
    first batch is answered and a batch after the deadline refused on any machine."""
    server = colocated_server(corpus, limits=ServiceLimits(deadline_s=0.5))
    loc = f"grpc://127.0.0.1:{server.port}"
    clock = _SimulatedClock()
    server.exchange_clock = clock
    try:
        with server.journal.lock:  # another update call holding the server for longer than the deadline
            with pytest.raises(flight.FlightTimedOutError, match="waited .* past the server's deadline of 0.5 s "
                                                                 r"\(--deadline\); nothing was applied"):
                fl.flight_action(loc, "update", lines_of(update_stream(corpus, 2, 2)), timeout=60)
        assert server.seq == 0
        client = flight.connect(loc)
        answered = []
        try:
            writer, reader = client.do_exchange(flight.FlightDescriptor.for_path("retrieve"))
            with pytest.raises(flight.FlightTimedOutError, match="older than the server's deadline of 0.5 s"):
                with writer:
                    writer.begin(fl.REQUEST_SCHEMA)
                    writer.write_batch(fl.request_batch(corpus.requests[:1], 5))
                    answered.append(reader.read_chunk().data.num_rows)  # in time: the clock has not moved
                    clock.sleep(0.7)  # the exchange is now older than the deadline, whatever the machine's speed
                    writer.write_batch(fl.request_batch(corpus.requests[:1], 5))
                    reader.read_chunk()
            assert answered and answered[0] > 0
        finally:
            client.close()
    finally:
        stop(server)


def test_a_large_update_call_is_applied_in_slices_that_retrieval_runs_between(corpus):
    """A retrieval that arrives between two slices of a long update call is answered before the call
    ends, at the updates applied so far. The retrieval is sent from between the slices themselves
    (the server's slice step wrapped), so that it falls inside the call does not depend on thread
    scheduling."""
    server = colocated_server(corpus, limits=ServiceLimits(update_slice=32))
    loc = f"grpc://127.0.0.1:{server.port}"
    updates = update_stream(corpus, 2000, 3)
    apply_slice, seen = server._apply, []

    def apply_then_retrieve(items):
        done = apply_slice(items)
        if len(seen) < 3:  # after each of the first three slices: the call holds its turn, the engine is free
            assert server.journal.lock.locked()
            seqs: list = []
            answers = fl.retrieve_over_flight(loc, corpus.requests[:1], 10, seqs=seqs, timeout=60)
            assert len(answers) == 1
            seen.append((server.seq, seqs[0]))
        return done

    server._apply = apply_then_retrieve
    try:
        ack = fl.flight_action(loc, "update", lines_of(updates), timeout=600)
        assert ack["seq"] == 2000 and server.journal.slices >= 2000 // 32 + 1
        assert len(seen) == 3
        for applied, answered_at in seen:  # each answer names the updates the engine held when it ran
            assert 0 < answered_at == applied < 2000, seen
        assert [a for a, _ in seen] == sorted({a for a, _ in seen}), seen  # later slices, later seqs
    finally:
        stop(server)


def test_an_unauthenticated_or_over_limit_call_is_refused_before_its_body_is_parsed(corpus):
    """An unauthenticated 400 MB `update` raised a server's memory by 1 GB before it was refused. The
    streamed update exchange checks the token before it reads any chunk, and counts the body's
    bytes as the chunks arrive, refusing the call at the first chunk past --max-update-bytes before
    the rest is read; the `update` action checks the token and the body's declared size before the
    body is copied or parsed; a retrieve exchange without a token is refused before any batch is
    read. Counted by the server (`stats`: update_bytes, bytes_in) and by the journal's parse, never
    by the machine's memory: scripts/probe_unauthenticated_memory.py measures that."""
    from serving import hostmem
    from serving.guard import ClientCredentials, ServerGuard

    reader, admin = ClientCredentials(token="reader-token-0123456789"), ClientCredentials(token="admin-token-0123456789")
    server = colocated_server(corpus, limits=ServiceLimits(max_update_bytes=64 << 10),
                              guard=ServerGuard(reader_token=reader.token, admin_token=admin.token))
    loc = f"grpc://127.0.0.1:{server.port}"
    parses = []
    real_parse = server.journal._parse
    server.journal._parse = lambda body, window: parses.append(len(body)) or real_parse(body, window)
    big = b'{"op":"retire","ad_id":1}\n' * 40_000  # 1 MB: sixteen times the limit
    small = lines_of(update_stream(corpus, 3, 11)).encode()
    given_back = hostmem._give_back.count

    def counters():
        stats = fl.flight_action(loc, "stats", credentials=admin)
        return stats["update_bytes"], stats["bytes_in"]

    try:
        for creds, error in ((None, flight.FlightUnauthenticatedError), (reader, flight.FlightUnauthorizedError)):
            client = fl.connect(loc, creds) if creds else flight.connect(loc)
            try:
                with pytest.raises(error):
                    fl.send_update_stream(client, big, chunk_bytes=16 << 10)
                with pytest.raises(error):
                    list(client.do_action(flight.Action("update", big)))
                if creds is None:  # a reader may retrieve; a stranger's request batch is never read
                    with pytest.raises(error):
                        fl.retrieve_over_flight(loc, corpus.requests, 5, client=client)
                    assert counters() == (0, 0)
            finally:
                client.close()
            assert counters()[0] == 0 and parses == [], "a refused caller's body was read or parsed"
        # the admin token, over the limit: the exchange stops reading at the first chunk past it
        client = fl.connect(loc, admin)
        try:
            with pytest.raises(flight.FlightServerError, match=r"update body of bytes \(81,920 so far\) is over the "
                                                               r"server's limit of 65536 \(--max-update-bytes\)"):
                fl.send_update_stream(client, big, chunk_bytes=16 << 10)
            assert counters()[0] == 5 * (16 << 10) < len(big) and parses == []
            with pytest.raises(flight.FlightServerError, match=r"update body of bytes \(1040000\) is over"):
                list(client.do_action(flight.Action("update", big)))  # its declared size, before any copy
            assert counters()[0] == 5 * (16 << 10) and parses == []
            ack = fl.send_update_stream(client, small, chunk_bytes=100)  # within the limit, in many chunks
            assert ack["applied"] == 3 and parses == [len(small)]
            assert counters()[0] == 5 * (16 << 10) + len(small)
        finally:
            client.close()
        deadline = time.monotonic() + 30  # the refused calls asked for their memory to be handed back
        while hostmem._give_back.count == given_back and time.monotonic() < deadline:
            time.sleep(0.05)
        assert hostmem._give_back.count > given_back
    finally:
        stop(server)


class _SimulatedClock:
    """Seconds that pass only when told to: `sleep(s)` and `work(s)` move it on. The journal's pacing
    runs on it exactly as on time.monotonic, with no other process able to stretch a step."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    work = sleep


def test_an_update_call_keeps_to_its_cpu_share_only_while_retrievals_arrive():
    """While a retrieval began or ended within ACTIVE_S, the journal pauses between slices so that
    applying takes at most `update_cpu_share` of the call's time; with no retrieval, or a share of
    1, it never pauses. On a simulated clock (each slice 3 ms of work), so the figures are exact on
    any machine; scripts/time_update_share.py measures the same on the real clock."""
    from serving.durable import ACTIVE_S, ReadGate, UpdateJournal
    from serving.wal import WriteAheadLog

    lines = [json.dumps({"op": "retire", "ad_id": i}) for i in range(1, 81)]
    slice_s = 0.003

    def run(share: float, reading_until: int | None) -> tuple[float, float, list[float]]:
        """(paused, the call's time, the time each of its 20 slices began); a retrieval arrives just
        before each of the first `reading_until` slices (None: before every one)."""
        clock = _SimulatedClock()
        gate = ReadGate(clock=clock)
        journal = UpdateJournal(WriteAheadLog.memory("test"), seed=1, dim=8, formats=2, gate=gate,
                                limits=ServiceLimits(update_slice=4, update_cpu_share=share),
                                clock=clock, sleep=clock.sleep)
        began: list[float] = []

        def apply(items):
            if reading_until is None or len(began) < reading_until:
                with gate.reading():  # a retrieval batch arrives between the slices
                    pass
            began.append(clock())
            clock.work(slice_s)
            return None

        t0 = clock()
        ack = journal.submit("\n".join(lines).encode(), live=lambda ad_id: True, apply=apply)
        assert ack["applied"] == 80 and len(began) == 20
        return journal.paused_s, clock() - t0, began

    def pauses(began: list[float]) -> list[float]:  # the pause after each slice but the last
        return [b - a - slice_s for a, b in zip(began, began[1:])]

    for share in (0.5, 0.2):
        paused, call_s, began = run(share, reading_until=None)
        each = slice_s * (1 / share - 1)  # the pause that leaves a slice's work exactly its share
        assert pauses(began) == pytest.approx([each] * 19), (share, pauses(began))
        # the call: 20 slices of work and 19 pauses, so all but the last slice keep exactly to the share
        assert paused == pytest.approx(19 * each) and call_s == pytest.approx(20 * slice_s + paused), (share, call_s)
    for share, reading_until in ((1.0, None), (0.5, 0)):  # a share of 1, or no retrieval: no pause
        paused, call_s, began = run(share, reading_until)
        assert paused == 0 and pauses(began) == pytest.approx([0.0] * 19) and call_s == pytest.approx(20 * slice_s)
    # retrievals stop before the fourth slice: slices that end within ACTIVE_S of the last one pause, later ones not
    paused, _, began = run(0.2, reading_until=3)
    last_read, each = began[2], slice_s * (1 / 0.2 - 1)
    want = [each if start + slice_s - last_read < ACTIVE_S else 0.0 for start in began[:-1]]
    assert pauses(began) == pytest.approx(want) and 0 < want.count(0.0) < 19, (want, pauses(began))
    with pytest.raises(ValueError, match="update_cpu_share: expected a share in"):
        ServiceLimits(update_cpu_share=1.5)


def test_the_deadline_measures_waiting_for_the_turn_not_parsing(monkeypatch):
    """Three concurrent 100 MB calls: `waited 96.1 s for its turn, past the server's deadline of
    60 s`, where most of the time was parsing. The deadline counts a call's wait for its turn only:
    on a simulated clock, a call whose parse takes 100 deadlines (a slow parser) and whose wait is
    short is applied; a call whose parse is instant but whose wait passes the deadline is refused,
    its parse and wait named, nothing logged. Exact on any machine: the clock moves only when told."""
    import serving.durable as durable
    from serving.durable import DeadlineExceeded, UpdateJournal
    from serving.wal import WriteAheadLog

    clock = _SimulatedClock()
    body = "\n".join(json.dumps({"op": "retire", "ad_id": i}) for i in range(1, 41)).encode()
    journal = UpdateJournal(WriteAheadLog.memory("test"), seed=1, dim=8, formats=2,
                            limits=ServiceLimits(deadline_s=1.0), clock=clock, sleep=clock.sleep)
    real_parse = durable.parse_update

    def slow_parse(*args, **kw):  # 2.5 s a line: 100 s for the call, a hundred times the deadline
        clock.work(2.5)
        return real_parse(*args, **kw)

    monkeypatch.setattr(durable, "parse_update", slow_parse)
    t0 = clock()
    ack = journal.submit(body, live=lambda ad_id: True, apply=lambda items: None)
    assert ack["applied"] == 40 and ack["seq"] == 40 and clock() - t0 == pytest.approx(100.0)
    assert ack["seconds"]["parse"] == pytest.approx(100.0)
    monkeypatch.setattr(durable, "parse_update", real_parse)

    # a call that parses at once but waits: another call holds the turn while the clock passes 1.5 s
    holder_has_turn, release = threading.Event(), threading.Event()

    def hold_the_turn():
        with journal.lock:
            holder_has_turn.set()
            release.wait(30)

    holder = threading.Thread(target=hold_the_turn)
    holder.start()
    holder_has_turn.wait(30)
    original = journal._take_turn

    def waiting(call):  # the clock moves on 1.5 s while the call waits for its turn
        clock.work(1.5)
        return original(call)

    journal._take_turn = waiting
    try:
        with pytest.raises(DeadlineExceeded, match=r"waited 1\.5 s for its turn \(after 0\.0 s parsing it, which "
                                                   r"does not count\), past the server's deadline of 1 s"):
            journal.submit(body, live=lambda ad_id: True, apply=lambda items: None)
    finally:
        release.set()
        holder.join(30)
    assert journal.log.last_seq == 40  # nothing of the refused call was logged


class _RetrievalsArriving:
    """A read gate on which retrievals keep arriving (`active`) with none in flight at any moment."""

    busy = False

    def active(self, within_s: float = 0.0) -> bool:
        return True


def test_parsing_and_logging_keep_to_the_share_too():
    """A large call's parsing and log encoding pause like its applying while retrievals arrive (every
    PACE_EVERY lines), so the whole call leaves the cores to retrieval; with no retrieval, or a share
    of 1, parsing never pauses. The journal runs on its thread's CPU time plus the pauses it takes
    (which pass without waiting): the parsing is real work, but a busy machine cannot stretch it."""
    from serving.durable import ReadGate, UpdateJournal
    from serving.wal import WriteAheadLog

    lines = "\n".join(json.dumps({"op": "retire", "ad_id": i}) for i in range(1, 4001)).encode()

    def run(share: float, reading: bool) -> tuple[float, float]:
        paused = [0.0]
        journal = UpdateJournal(WriteAheadLog.memory("test"), seed=1, dim=8, formats=2,
                                gate=_RetrievalsArriving() if reading else ReadGate(),
                                limits=ServiceLimits(update_slice=1 << 20, update_cpu_share=share),
                                clock=lambda: time.thread_time() + paused[0],
                                sleep=lambda s: paused.__setitem__(0, paused[0] + s))
        ack = journal.submit(lines, live=lambda ad_id: True, apply=lambda items: None)
        assert ack["applied"] == 4000 and journal.paused_s == pytest.approx(paused[0])
        return journal.paused_s, ack["seconds"]["parse"]

    paused, parse_s = run(0.25, True)  # one slice and a log in memory: every pause is the parse's
    # at a share of a quarter three quarters of the parse's time are pauses, less what the last
    # window leaves untaken; never more
    assert 0.6 * parse_s <= paused <= 0.75 * parse_s + 0.001, (paused, parse_s)
    assert run(1.0, True)[0] == 0 and run(0.25, False)[0] == 0
