"""The update stream (DESIGN section 6): parsing with line numbers and reasons, the live-id checks,
and the property that applying a stream equals rebuilding from the final ad set."""

import json

import numpy as np
from hypothesis import HealthCheck, given, settings

from andromeda_nb.oracle import OracleIndex
from andromeda_nb.testing import ads_and_updates, random_ads, random_requests, random_updates, update_to_json
from andromeda_nb.types import Retire, SetStatus, Upsert
from andromeda_nb.updates import LiveAds, Rejection, UpdateLog, apply_update_file, apply_updates, read_updates

GEO = {"geo_locations": {"countries": ["US"]}}
KW = dict(seed=3, dim=4)


def line(obj):
    return json.dumps(obj)


def upsert(ad_id, **fields):
    return {"op": "upsert", "ad": dict({"ad_id": ad_id, "targeting": GEO}, **fields)}


def test_read_each_op_with_line_numbers():
    lines = [
        line(upsert(5, format=2)),
        "",
        line({"op": "status", "ad_id": 5, "status": "PAUSED"}),
        "   \n",
        line({"op": "retire", "ad_id": 5}),
    ]
    updates, rejections = read_updates(lines, **KW)
    assert rejections == []
    assert [n for n, _ in updates] == [1, 3, 5]
    (_, up), (_, st), (_, rt) = updates
    assert isinstance(up, Upsert) and up.ad.ad_id == 5 and up.ad.format == 2 and up.ad.embedding.shape == (4,)
    assert st == SetStatus(5, "PAUSED")
    assert rt == Retire(5)


def test_malformed_lines_are_rejected_with_line_and_reason():
    lines = [
        "{not json",
        line({"op": "delete", "ad_id": 1}),
        line({"ad_id": 1}),
        line({"op": "status", "ad_id": 1}),
        line({"op": "status", "ad_id": 1, "status": "RUNNING"}),
        line({"op": "retire", "ad_id": "1"}),
        line({"op": "retire", "ad_id": 1, "why": "done"}),
        line(upsert(8, targeting={"geo_locations": {"countries": ["US"]}, "genders": [3]})),
        line({"op": "upsert", "ad": {"targeting": GEO}}),
        line({"op": "upsert"}),
        line([1, 2]),
        line(upsert(9)),
    ]
    updates, rejections = read_updates(lines, **KW)
    assert [n for n, _ in updates] == [12]
    got = {r.line_no: r for r in rejections}
    assert sorted(got) == list(range(1, 12))
    expect = {
        1: (None, "malformed JSON"),
        2: (1, "op: 'delete' is not one of"),
        3: (1, "op: is required"),
        4: (1, "status: is required"),
        5: (1, "status: 'RUNNING' is not one of"),
        6: (None, "ad_id: must be an int"),
        7: (1, "why: unknown key"),
        8: (8, "ad.targeting.genders[0]: 3 is not one of"),
        9: (None, "ad.ad_id: is required"),
        10: (None, "ad: is required"),
        11: (None, "an update must be a JSON object"),
    }
    for n, (ad_id, words) in expect.items():
        assert got[n].ad_id == ad_id, got[n]
        assert got[n].reason.startswith(words) or words in got[n].reason, got[n]
    assert "line 8: ad 8: ad.targeting.genders[0]" in str(got[8])
    assert got[8].to_json() == {"line": 8, "ad_id": 8, "error": got[8].reason}


def test_read_from_path_and_from_objects(tmp_path):
    p = tmp_path / "updates.jsonl"
    p.write_text(line(upsert(1)) + "\n" + line({"op": "retire", "ad_id": 1}) + "\n")
    for source in (p, str(p), [upsert(1), {"op": "retire", "ad_id": 1}]):
        updates, rejections = read_updates(source, **KW)
        assert [type(u) for _, u in updates] == [Upsert, Retire] and not rejections


def test_live_ads_rules():
    live = LiveAds([1, 2])
    assert live.accept(SetStatus(3, "PAUSED")) is not None  # never created
    assert "does not exist" in live.check(Retire(3))
    assert live.accept(Retire(2)) is None and 2 not in live
    assert live.accept(Retire(2)) is not None  # already retired
    assert live.accept(SetStatus(2, "ACTIVE")) is not None
    assert live.accept(Upsert(random_ads(np.random.default_rng(0), 1, dim=4, ids=[2])[0])) is None
    assert 2 in live and live.accept(SetStatus(2, "PAUSED")) is None
    assert len(live) == 2


class Recorder:
    def __init__(self):
        self.seen = []

    def apply(self, update):
        self.seen.append(update)


def test_rejected_updates_change_nothing_and_the_rest_apply():
    rng = np.random.default_rng(5)
    ads = random_ads(rng, 4, dim=4, ids=[10, 11, 12, 13])
    new = random_ads(rng, 1, dim=4, ids=[14])[0]
    stream = [(1, Retire(10)), (2, SetStatus(10, "ACTIVE")), (3, Upsert(new)), (4, Retire(99)),
              (5, SetStatus(14, "PAUSED")), (6, Retire(10))]
    index, rec = OracleIndex.build(ads), Recorder()
    rejections = apply_updates(stream, [index, rec], LiveAds(a.ad_id for a in ads))
    assert [(r.line_no, r.ad_id) for r in rejections] == [(2, 10), (4, 99), (6, 10)]
    assert rec.seen == [Retire(10), Upsert(new), SetStatus(14, "PAUSED")]
    assert sorted(index.ads) == [11, 12, 13, 14] and index.ads[14].status == "PAUSED"


def test_update_log_and_file(tmp_path):
    rng = np.random.default_rng(6)
    ads = random_ads(rng, 3, dim=4, ids=[1, 2, 3])
    index = OracleIndex.build(ads)
    log = UpdateLog([index], [1, 2, 3])
    assert log.submit(Retire(4), line_no=7) == Rejection(7, 4, log.rejections[0].reason)
    assert log.submit(Retire(3)) is None and log.applied == 1 and len(index) == 2
    p = tmp_path / "u.jsonl"
    p.write_text("\n".join([line({"op": "retire", "ad_id": 1}), "oops", line({"op": "retire", "ad_id": 1}),
                            line(upsert(1, status="PAUSED"))]))
    index = OracleIndex.build(ads)
    applied, rejections = apply_update_file(p, [index], [1, 2, 3], **KW)
    assert applied == 2 and [r.line_no for r in rejections] == [2, 3]
    assert index.ads[1].status == "PAUSED"


def _final_ads(ads, updates):
    """The ad set a stream leaves, computed on its own: a dict, step by step."""
    final = {a.ad_id: a for a in ads}
    for u in updates:
        if isinstance(u, Upsert):
            final[u.ad.ad_id] = u.ad
        elif isinstance(u, SetStatus) and u.ad_id in final:
            import dataclasses

            final[u.ad_id] = dataclasses.replace(final[u.ad_id], status=u.status)
        elif isinstance(u, Retire):
            final.pop(u.ad_id, None)
    return list(final.values())


def _check_stream(ads, updates, reqs):
    # through the JSON Lines form, so the parser is part of the property
    lines = [json.dumps(update_to_json(u)) for u in updates]
    parsed, malformed = read_updates(lines, seed=0, dim=8)
    assert not malformed and [u for _, u in parsed] == updates
    index = OracleIndex.build(ads)
    rejections = apply_updates(parsed, [index], LiveAds(a.ad_id for a in ads))
    final = _final_ads(ads, updates)
    rebuilt = OracleIndex.build(final)
    assert len(index) == len(rebuilt) == len(final)
    for r, a, b in zip(reqs, index.match(reqs), rebuilt.match(reqs)):
        assert a.tolist() == b.tolist(), f"request {r.request_id}"
    return rejections


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ads_and_updates(max_ads=10, max_updates=20, invalid=0.2))
def test_stream_equals_rebuild_property(case):
    ads, updates = case
    reqs = random_requests(np.random.default_rng(len(updates)), 5, experts=2, width=2)
    _check_stream(ads, updates, reqs)


def test_stream_equals_rebuild_seeded():
    seed = 77
    rng = np.random.default_rng(seed)
    ads = random_ads(rng, 150, dim=8)
    updates = random_updates(rng, ads, 300, invalid=0.1, dim=8)
    reqs = random_requests(rng, 15, experts=2, width=2)
    kinds = {type(u) for u in updates}
    assert kinds == {Upsert, SetStatus, Retire}, f"seed {seed}"
    rejections = _check_stream(ads, updates, reqs)
    assert 10 <= len(rejections) <= 60, f"seed {seed}: {len(rejections)} rejections"


def test_index_live_ids_follow_the_index_and_answers_are_by_line():
    from andromeda_nb.updates import IndexLiveIds, update_answer
    from cpu_baseline.index import CpuTargetingIndex

    rng = np.random.default_rng(8)
    ads = random_ads(rng, 4, dim=4, ids=[10, 11, 12, 13])
    new = random_ads(rng, 1, dim=4, ids=[14])[0]
    stream = [(1, Retire(10)), (2, SetStatus(10, "ACTIVE")), (3, Upsert(new)), (4, Retire(99)),
              (5, SetStatus(14, "PAUSED")), (6, Retire(10))]
    index = CpuTargetingIndex.build(ads)
    live = IndexLiveIds(index)  # no copy of the ids: the index advances them as it applies
    rejections = apply_updates(stream, [index], live)
    assert [(r.line_no, r.ad_id) for r in rejections] == [(2, 10), (4, 99), (6, 10)]
    assert sorted(int(a) for a in [10, 11, 12, 13, 14] if a in index) == [11, 12, 13, 14] and len(live) == 4
    malformed = [Rejection(3, None, "malformed JSON: x"), Rejection(None, 7, "not from a file")]
    answer = update_answer(3, rejections + malformed)
    assert answer["applied"] == 3
    assert [(r["line"], r["ad_id"]) for r in answer["rejected"]] == [(None, 7), (2, 10), (3, None), (4, 99), (6, 10)]


def test_the_seeded_update_stream_equals_the_plain_rule():
    """`testing._updates` keeps the live ids sorted as they change; the plain rule sorts them again
    for every draw. On fresh random live sets, with invalid updates mixed in, both give the same
    stream, update for update."""
    from andromeda_nb import testing as t

    def plain(src, live_ids, n, invalid, make_ad):
        live, retired = {int(i) for i in live_ids}, set()
        next_id, out = max(live, default=-1) + 1, []
        for _ in range(n):
            if invalid and src.coin(invalid):
                ghost = src.pick(sorted(retired)) if retired and src.coin(0.5) else next_id + 1000
                out.append(SetStatus(ghost, src.pick(t.STATUSES)) if src.coin(0.5) else Retire(ghost))
                continue
            op = src.int(0, 9)
            if op < 3 or not live:
                if retired and src.coin(0.3):
                    ad_id = src.pick(sorted(retired))
                    retired.discard(ad_id)
                else:
                    ad_id, next_id = next_id, next_id + 1
                live.add(ad_id)
                out.append(Upsert(make_ad(ad_id)))
            elif op < 5:
                out.append(Upsert(make_ad(src.pick(sorted(live)))))
            elif op < 8:
                out.append(SetStatus(src.pick(sorted(live)), src.pick(t.STATUSES)))
            else:
                ad_id = src.pick(sorted(live))
                live.discard(ad_id)
                retired.add(ad_id)
                out.append(Retire(ad_id))
        return out

    rng = np.random.default_rng(11)
    for case in range(12):
        live = rng.choice(10**6, size=int(rng.integers(0, 40)), replace=False).tolist()
        seed, invalid = int(rng.integers(2**31)), float(rng.choice([0.0, 0.2]))
        streams = [fn(t._RngSource(np.random.default_rng(seed)), live, 60, invalid, lambda ad_id: ad_id)
                   for fn in (t._updates, plain)]
        assert streams[0] == streams[1], f"case {case}"
