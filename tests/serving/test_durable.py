"""The update journal (serving.durable) on its own, over a log in memory: one call's updates are checked
against the live ads as the call's own earlier updates leave them, the accepted ones logged in
order and applied, the rejected ones named by line and never logged. No server is started."""

from __future__ import annotations

import json

from serving.durable import UpdateJournal
from serving.wal import WriteAheadLog

GEO = {"geo_locations": {"countries": ["US"]}}


def _journal() -> UpdateJournal:
    return UpdateJournal(WriteAheadLog.memory("test"), seed=1, dim=8, formats=2)


def _body(*updates) -> bytes:
    return "\n".join(json.dumps(u) for u in updates).encode()


def test_one_call_checks_each_update_against_the_live_ads_its_own_earlier_updates_leave():
    journal = _journal()
    applied: list = []
    live = {1, 2}
    body = _body({"op": "retire", "ad_id": 1},
                 {"op": "status", "ad_id": 1, "status": "PAUSED"},  # retired two lines before
                 {"op": "upsert", "ad": {"ad_id": 3, "targeting": GEO}},
                 {"op": "status", "ad_id": 3, "status": "PAUSED"},  # created one line before
                 {"op": "retire", "ad_id": 3},
                 {"op": "retire", "ad_id": 3},  # retired the line before
                 {"op": "status", "ad_id": 2, "status": "PAUSED"})
    ack = journal.submit(body, live=lambda ad_id: ad_id in live, apply=lambda items: applied.extend(items))
    assert ack["applied"] == 5, ack
    assert [(r["line"], r["ad_id"]) for r in ack["rejected"]] == [(2, 1), (6, 3)], ack
    assert all("does not exist" in r["error"] for r in ack["rejected"]), ack
    # the accepted updates, logged in order with consecutive sequence numbers, then applied in that order
    assert [record.seq for record, _ in applied] == [1, 2, 3, 4, 5] and ack["seq"] == 5
    assert [record.update["op"] for record, _ in applied] == ["retire", "upsert", "status", "retire", "status"]
    assert [r.update["op"] for r in journal.log.records_after(0)] == ["retire", "upsert", "status", "retire", "status"]


def test_a_second_call_sees_the_live_ads_the_first_left():
    journal = _journal()
    live = {1}

    def apply(items):
        for _, update in items:
            if type(update).__name__ == "Retire":
                live.discard(update.ad_id)

    assert journal.submit(_body({"op": "retire", "ad_id": 1}), live=lambda a: a in live, apply=apply)["applied"] == 1
    ack = journal.submit(_body({"op": "retire", "ad_id": 1}), live=lambda a: a in live, apply=apply)
    assert ack["applied"] == 0 and [r["line"] for r in ack["rejected"]] == [1]


def test_concurrent_calls_pause_the_garbage_collector_until_the_last_one_ends():
    """Update calls in flight at once pause the cyclic collector together (`store.paused_gc`): it comes
    back on when the last call ends, not when the first does (a full collection over the other calls'
    parsed updates held the interpreter for seconds), and stays off when it was off before."""
    import gc
    import threading

    from andromeda_nb.store import paused_gc

    was = gc.isenabled()
    gc.enable()
    try:
        entered, first_may_leave, first_left, second_may_leave = (threading.Event() for _ in range(4))
        seen = {}

        def first():
            with paused_gc():
                entered.set()
                first_may_leave.wait(10)
            first_left.set()

        def second():
            entered.wait(10)
            with paused_gc():
                first_may_leave.set()
                first_left.wait(10)
                seen["after the first left"] = gc.isenabled()
                second_may_leave.wait(10)

        threads = [threading.Thread(target=first), threading.Thread(target=second)]
        for t in threads:
            t.start()
        first_left.wait(10)
        second_may_leave.set()
        for t in threads:
            t.join(10)
        assert seen == {"after the first left": False} and gc.isenabled()
        gc.disable()
        with paused_gc():
            pass
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


def test_a_call_that_arrives_while_another_is_applied_joins_its_turn_in_log_order():
    """Three concurrent 50 MB calls: the later ones waited for the earlier ones' turns (60 to 90 s each,
    paced) past the 60 s deadline and were refused. Now a call that arrives while another is applied
    is taken into the same turn between two slices: checked against the live ads at the log's end
    (the first call's updates logged but not yet applied count), logged after it, applied after it,
    and acknowledged once its own updates are. On a simulated clock where applying the first call
    takes 100 deadlines, the second is not refused; both calls' updates are applied in log order."""
    import threading

    from serving.limits import ServiceLimits

    from tests.serving.test_limits import _SimulatedClock

    clock = _SimulatedClock()
    journal = UpdateJournal(WriteAheadLog.memory("test"), seed=1, dim=8, formats=2,
                            limits=ServiceLimits(deadline_s=1.0, update_slice=10), clock=clock, sleep=clock.sleep)
    live = set(range(1, 1000))
    applied: list = []
    second: dict = {}
    seen_at_slice = {}

    def apply(items):
        applied.extend(record.seq for record, _ in items)
        for _, update in items:
            live.discard(update.ad_id)
        slices = len(applied) // 10
        if slices == 1:  # the first call's first slice: the second call arrives, parsed, and waits for the turn
            thread = threading.Thread(target=lambda: second.update(
                ack=journal.submit(_body(*({"op": "retire", "ad_id": i} for i in range(150, 250))),
                                   live=lambda ad_id: ad_id in live, apply=apply)))
            second["thread"] = thread
            thread.start()
            for _ in range(10_000):  # until it waits for the turn (a guard against a hang, not a timing)
                if journal._pending:
                    break
                threading.Event().wait(0.001)
            assert journal._pending
        else:
            clock.work(5.0)  # each later slice takes 5 s: the first call's applying lasts about 100 s
        seen_at_slice.setdefault(slices, journal.log.last_seq)

    first = journal.submit(_body(*({"op": "retire", "ad_id": i} for i in range(1, 201))),
                           live=lambda ad_id: ad_id in live, apply=apply)
    second["thread"].join(30)
    assert first["applied"] == 200 and first["seq"] == 200 and "stopped" not in first, first
    ack = second.get("ack")
    assert ack is not None, second
    # ads 150..200 were retired by the first call, logged but not all applied when the second was checked
    assert ack["applied"] == 49 and ack["seq"] == 249 and sorted(r["ad_id"] for r in ack["rejected"]) == \
        list(range(150, 201)), ack
    assert seen_at_slice[2] == 249  # taken into the turn and logged after the first call's first slice
    assert applied == list(range(1, 250))  # applied in log order, the first call's then the second's
    assert [record.seq for record in journal.log.records_after(0)] == list(range(1, 250))
    assert clock() - 1000.0 >= 100.0 and not journal._pending and not journal._backlog


def test_a_stopping_server_acknowledges_every_call_logged_in_the_shared_turn():
    """SIGTERM while two calls share a turn (the second logged, the first being applied): both are
    acknowledged as logged, each saying how much of it was applied (the rest is replayed at the next
    start), and a call that comes after ends with nothing of it logged."""
    import threading

    import pytest

    from serving.durable import ServerStopping
    from serving.limits import ServiceLimits

    journal = UpdateJournal(WriteAheadLog.memory("test"), seed=1, dim=8, formats=2,
                            limits=ServiceLimits(update_slice=10))
    applied: list = []
    second: dict = {}

    def apply(items):
        applied.extend(record.seq for record, _ in items)
        if len(applied) == 10:  # the first slice: the second call arrives and waits for the turn
            second["thread"] = threading.Thread(target=lambda: second.update(ack=journal.submit(
                _body(*({"op": "retire", "ad_id": i} for i in range(300, 350))), live=lambda ad_id: True,
                apply=apply)))
            second["thread"].start()
            for _ in range(10_000):  # until it waits for the turn (a guard against a hang, not a timing)
                if journal._pending:
                    break
                threading.Event().wait(0.001)
        if len(applied) == 30:  # SIGTERM during the third slice
            journal.stopping.set()

    first = journal.submit(_body(*({"op": "retire", "ad_id": i} for i in range(1, 201))), live=lambda ad_id: True,
                           apply=apply)
    second["thread"].join(30)
    ack = second["ack"]
    assert first["seq"] == 200 and "all 200 updates are logged" in first["stopped"] and \
        "30 were applied before it stopped" in first["stopped"], first
    assert ack["seq"] == 250 and "all 50 updates are logged" in ack["stopped"] and \
        "0 were applied before it stopped" in ack["stopped"], ack
    assert applied == list(range(1, 31)) and journal.log.last_seq == 250
    with pytest.raises(ServerStopping, match="nothing of this update call was logged or applied"):
        journal.submit(_body({"op": "retire", "ad_id": 400}), live=lambda ad_id: True, apply=apply)
    assert journal.log.last_seq == 250


def _gated_journal(monkeypatch):
    """A journal whose parse of a body waits on an event named by the body's first ad id, recording
    which bodies are being parsed at once; bodies of 200 bytes or more count as large."""
    import threading

    import serving.durable as durable

    monkeypatch.setattr(durable, "LARGE_BODY_BYTES", 200)
    monkeypatch.setattr(durable, "GATE_POLL_S", 0.01)
    journal = UpdateJournal(WriteAheadLog.memory("test"), seed=1, dim=8, formats=2)
    release = {}
    state = {"now": set(), "together": []}
    lock = threading.Lock()
    parse = journal._parse

    def gated_parse(body, window):
        first = json.loads(bytes(body).split(b"\n")[0])["ad_id"]
        with lock:
            state["now"].add(first)
            state["together"].append(frozenset(state["now"]))
        release.setdefault(first, threading.Event()).wait(30)
        with lock:
            state["now"].discard(first)
        return parse(body, window)

    journal._parse = gated_parse
    return journal, release, state


def _submit_in_thread(journal, body, out, name, live):
    import threading

    def run():
        try:
            out[name] = journal.submit(body, live=lambda ad_id: ad_id in live, apply=lambda items: None)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out[name] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _until(cond, what):
    import threading

    for _ in range(3000):  # a guard against a hang, not a timing
        if cond():
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"never happened: {what}")


def test_large_bodies_parse_one_at_a_time_and_a_small_one_never_waits_behind_them(monkeypatch):
    """Three concurrent 50 MB calls parsed together, each holding the interpreter, left a retrieval
    three parsers to compete with. Bodies of LARGE_BODY_BYTES or more now parse one at a time; a small
    body parses at once, even while a large one is being parsed; every call is applied."""
    import threading

    journal, release, state = _gated_journal(monkeypatch)
    live = set(range(1, 1000))
    big_a = _body(*({"op": "retire", "ad_id": i} for i in range(1, 40)))
    big_b = _body(*({"op": "retire", "ad_id": i} for i in range(100, 140)))
    small = _body({"op": "retire", "ad_id": 500})
    assert len(big_a) >= 200 and len(big_b) >= 200 and len(small) < 200
    out: dict = {}
    threads = [_submit_in_thread(journal, big_a, out, "a", live)]
    _until(lambda: 1 in state["now"], "the first large body being parsed")
    threads.append(_submit_in_thread(journal, big_b, out, "b", live))
    threads.append(_submit_in_thread(journal, small, out, "small", live))
    _until(lambda: 500 in state["now"], "the small body parsed while the large one is")
    threading.Event().wait(0.1)
    assert 100 not in state["now"], "a second large body parsed while the first was being parsed"
    release[500].set()
    _until(lambda: "small" in out, "the small call acknowledged")
    release[1].set()
    _until(lambda: 100 in state["now"], "the second large body parsed once the first was done")
    release[100].set()
    for t in threads:
        t.join(30)
    assert not any(1 in s and 100 in s for s in state["together"]), state["together"]
    assert {1, 500} in [set(s) for s in state["together"]]
    assert out["a"]["applied"] == 39 and out["b"]["applied"] == 40 and out["small"]["applied"] == 1, out
    assert journal.log.last_seq == 80


def test_a_stopping_server_ends_a_large_call_waiting_to_parse_with_nothing_logged(monkeypatch):
    from serving.durable import ServerStopping

    journal, release, state = _gated_journal(monkeypatch)
    live = set(range(1, 1000))
    out: dict = {}
    first = _submit_in_thread(journal, _body(*({"op": "retire", "ad_id": i} for i in range(1, 40))), out, "a", live)
    _until(lambda: 1 in state["now"], "the first large body being parsed")
    second = _submit_in_thread(journal, _body(*({"op": "retire", "ad_id": i} for i in range(100, 140))), out, "b",
                               live)
    _until(lambda: second.is_alive(), "the second call started")
    journal.stopping.set()
    second.join(30)
    assert isinstance(out["b"], ServerStopping), out
    assert 100 not in {ad for s in state["together"] for ad in s}  # never parsed
    release[1].set()
    first.join(30)
    assert isinstance(out["a"], ServerStopping), out  # its parse ends at the stop too: nothing logged
    assert journal.log.last_seq == 0
