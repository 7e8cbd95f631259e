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
