"""The CPU inverted index equals the oracle: random corpora, requests and update sequences."""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import cpu_baseline.index as cpu_index
from andromeda_nb import testing
from migration.architectures import MATCHERS, load_class
from andromeda_nb.oracle import OracleIndex
from andromeda_nb.targeting import parse_ad, parse_request
from andromeda_nb.types import Retire, SetStatus, Upsert
from cpu_baseline.index import CpuTargetingIndex


def _assert_same(cpu, oracle, requests, context):
    got, want = cpu.match(requests), oracle.match(requests)
    for request, g, w in zip(requests, got, want):
        assert g.dtype == np.int64
        assert np.all(np.diff(g) > 0), f"ids not ascending ({context}, request {request.request_id})"
        assert np.array_equal(g, w), (
            f"{context}, request {request.request_id}: cpu {g.tolist()} oracle {w.tolist()}")
    return sum(len(w) for w in want)


@pytest.mark.parametrize("seed", range(12))
def test_equals_oracle_through_update_streams(seed, monkeypatch):
    monkeypatch.setattr(cpu_index, "DELTA_MERGE_MIN", 8)  # merges happen inside small streams too
    rng = np.random.default_rng(seed)
    n_ads = int(rng.integers(0, 150))
    ads = testing.random_ads(rng, n_ads, dim=8)
    requests = testing.random_requests(rng, 25)
    cpu, oracle = CpuTargetingIndex.build(ads, threads=2), OracleIndex.build(ads)
    eligible = 0
    for step in range(4):
        eligible += _assert_same(cpu, oracle, requests, f"seed {seed}, {n_ads} ads, step {step}")
        for update in testing.random_updates(rng, list(oracle.ads.values()), 25, dim=8):
            cpu.apply(update)
            oracle.apply(update)
        assert len(cpu) == len(oracle)
    eligible += _assert_same(cpu, oracle, requests, f"seed {seed}, final")
    if n_ads > 20:
        assert eligible > 0, f"seed {seed}: nothing eligible, the test would prove nothing"
    cpu.close()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(testing.ads_and_updates(max_ads=12, max_updates=15), testing.request_lists(1, 5))
def test_equals_oracle_hypothesis(ads_updates, requests):
    ads, updates = ads_updates
    cpu, oracle = CpuTargetingIndex.build(ads, threads=1), OracleIndex.build(ads)
    _assert_same(cpu, oracle, requests, "initial")
    for update in updates:
        cpu.apply(update)
        oracle.apply(update)
    _assert_same(cpu, oracle, requests, "after updates")


def test_retired_slot_is_reused_and_old_postings_are_dead():
    rng = np.random.default_rng(7)
    ads = testing.random_ads(rng, 40, dim=8)
    requests = testing.random_requests(rng, 30)
    cpu, oracle = CpuTargetingIndex.build(ads, threads=1), OracleIndex.build(ads)
    capacity = cpu.capacity
    victim = ads[3]
    slot = cpu.slot_of(victim.ad_id)
    for index in (cpu, oracle):
        index.apply(Retire(victim.ad_id))
    assert victim.ad_id not in cpu
    newcomer = testing.random_ads(rng, 1, dim=8, ids=[10_000])[0]
    for index in (cpu, oracle):
        index.apply(Upsert(newcomer))
    assert cpu.slot_of(10_000) == slot  # the freed slot came back
    assert cpu.capacity == capacity
    _assert_same(cpu, oracle, requests, "after slot reuse")
    # a status change and a replacement of the same ad
    for index in (cpu, oracle):
        index.apply(SetStatus(10_000, "PAUSED"))
    _assert_same(cpu, oracle, requests, "paused")
    replacement = Upsert(testing.random_ads(rng, 1, dim=8, ids=[10_000])[0])
    for index in (cpu, oracle):
        index.apply(replacement)
    _assert_same(cpu, oracle, requests, "replaced")
    cpu.merge()
    assert cpu.describe()["delta_ads"] == 0
    _assert_same(cpu, oracle, requests, "merged")


def test_growth_beyond_capacity():
    rng = np.random.default_rng(11)
    cpu, oracle = CpuTargetingIndex.build([], threads=1), OracleIndex.build([])
    for ad in testing.random_ads(rng, 60, dim=8):
        cpu.apply(Upsert(ad))
        oracle.apply(Upsert(ad))
    assert cpu.capacity >= 60 and len(cpu) == 60
    _assert_same(cpu, oracle, testing.random_requests(rng, 20), "grown from empty")


def test_match_arch_cpu_is_this_index():
    assert load_class(MATCHERS, "cpu") is CpuTargetingIndex
    rng = np.random.default_rng(2)
    ads = testing.random_ads(rng, 30, dim=8)
    index = CpuTargetingIndex.build(ads)
    assert len(index) == 30
    assert index.match([]) == []
    info = index.describe()
    assert info["ads"] == 30 and info["main_postings"] > 0


def test_sparse_and_dense_touch_paths_agree_with_oracle():
    """Users reaching most ads take the sequential pass, users reaching few the touched list."""
    import dataclasses

    rng = np.random.default_rng(13)
    ads = testing.random_ads(rng, 400, dim=8)
    requests = testing.random_requests(rng, 20)
    bare = [dataclasses.replace(r, user=dataclasses.replace(r.user, country="JP", region=-1, city=-1, locale=-1,
                                                            ids={})) for r in requests[:10]]
    cpu, oracle = CpuTargetingIndex.build(ads, threads=1), OracleIndex.build(ads)
    word, touched = cpu._scratch_arrays()
    reached = []
    for request in bare + requests[10:]:
        _assert_same(cpu, oracle, [request], "sparse/dense")
        e = cpu_index.encode_request(request)
        m = cpu._main
        n = cpu_index._walk_postings(e.terms, m.terms, m.ptr, m.slot, m.clause, False, 1, cpu._cols["segment"],
                                     word, touched, 0)
        word[touched[:n]] = 0
        reached.append(n / cpu.capacity)
    assert min(reached) * cpu_index.DENSE_TOUCH_RATIO < 1 < max(reached) * cpu_index.DENSE_TOUCH_RATIO, reached


@pytest.mark.parametrize("seed", range(4))
def test_retire_only_streams_reuse_slots_cleanly(seed):
    """Streams of retirements and creations only (no ad replaced, so no dead main entries until a
    retirement marks them): a created ad that takes a retired ad's slot must not inherit the retired
    ad's postings."""
    rng = np.random.default_rng(100 + seed)
    ads = testing.random_ads(rng, 60, dim=8)
    requests = testing.random_requests(rng, 40)
    cpu, oracle = CpuTargetingIndex.build(ads, threads=1), OracleIndex.build(ads)
    next_id = max(a.ad_id for a in ads) + 1
    for step in range(5):
        live = sorted(oracle.ads)
        gone = [int(i) for i in rng.choice(live, 8, replace=False)]
        fresh = testing.random_ads(rng, 8, dim=8, ids=range(next_id, next_id + 8))
        next_id += 8
        for update in [Retire(i) for i in gone] + [Upsert(a) for a in fresh]:
            cpu.apply(update)
            oracle.apply(update)
        _assert_same(cpu, oracle, requests, f"seed {seed}, step {step}")


@pytest.mark.parametrize("seed", range(4))
def test_incremental_delta_equals_oracle_between_small_batches(seed, monkeypatch):
    """The delta postings are rebuilt incrementally (kept entries, less those of slots replaced or
    retired since, plus the new ones); with no merge in between, refreshed after every few updates,
    they must still equal the oracle through replacements, retirements and slot reuse."""
    monkeypatch.setattr(cpu_index, "DELTA_MERGE_MIN", 1 << 30)
    rng = np.random.default_rng(100 + seed)
    ads = testing.random_ads(rng, 80, dim=8)
    requests = testing.random_requests(rng, 20)
    cpu, oracle = CpuTargetingIndex.build(ads, threads=1), OracleIndex.build(ads)
    eligible = 0
    for step in range(40):
        for update in testing.random_updates(rng, list(oracle.ads.values()), int(rng.integers(1, 6)), dim=8):
            cpu.apply(update)
            oracle.apply(update)
        if step % 2:  # refreshed by the writer, else by the next match
            cpu.refresh()
        eligible += _assert_same(cpu, oracle, requests, f"seed {100 + seed}, step {step}")
        _assert_delta_is_a_rebuild(cpu, f"seed {100 + seed}, step {step}")
    assert cpu.merges == 0 and cpu.describe()["delta_ads"] > 20 and eligible > 0
    cpu.close()


def _assert_delta_is_a_rebuild(cpu, context):
    """The delta postings, kept up to date by merging (no sort of the whole segment), hold exactly
    the entries of the delta's live ads, in the order a fresh build sorts them: terms ascending,
    slots ascending within a term, circles by slot."""
    d = cpu._delta
    entries = list(cpu._delta_entries.values())
    fresh = cpu_index._Postings(*(cpu_index._concat([e[i] for e in [cpu_index._Postings.empty().flat(), *entries]], i)
                                  for i in range(6)))
    assert np.all(np.diff(d.terms) > 0) and d.ptr[0] == 0 and d.ptr[-1] == len(d.slot), context
    for t in range(len(d.terms)):
        assert np.all(np.diff(d.slot[d.ptr[t] : d.ptr[t + 1]]) >= 0), f"{context}: slots out of order in a term"
    assert np.all(np.diff(d.circle_slot) >= 0), context

    def flat_set(p):
        terms = np.repeat(p.terms, np.diff(p.ptr))
        return sorted(zip(terms.tolist(), p.slot.tolist(), p.clause.tolist())), sorted(
            zip(p.circle_slot.tolist(), p.circle_clause.tolist(), map(tuple, p.circles.tolist())))

    assert flat_set(d) == flat_set(fresh), f"{context}: the merged delta differs from a rebuild"


def _schedule_request(rid, time):
    return parse_request({"request_id": rid, "user": {"age": 30, "country": "US"},
                          "context": {"publisher_platform": "facebook", "device_platform": "mobile",
                                      "user_os": "iOS", "time": time}}, seed=0, experts=2, width=4)


def test_schedule_start_inclusive_end_exclusive_equals_oracle():
    """Requests at every schedule edge: at start_time and one second before the end an ad is shown, one
    second before the start and exactly at end_time it is not; for ads built into the main segment and
    ads upserted into the delta, open starts and open ends included."""
    geo = {"geo_locations": {"countries": ["US"]}}
    schedules = [(100, 200), (None, 150), (150, None), (200, 201)]
    ads = [parse_ad({"ad_id": i + 1, "start_time": s, "end_time": e, "targeting": geo}, seed=0, dim=4, formats=1)
           for i, (s, e) in enumerate(schedules)]
    times = [99, 100, 149, 150, 199, 200, 201]
    requests = [_schedule_request(i, t) for i, t in enumerate(times)]
    want = {99: [2], 100: [1, 2], 149: [1, 2], 150: [1, 3], 199: [1, 3], 200: [3, 4], 201: [3]}
    oracle = OracleIndex.build(ads)
    assert [w.tolist() for w in oracle.match(requests)] == [want[t] for t in times]
    cpu = CpuTargetingIndex.build(ads, threads=1)
    _assert_same(cpu, oracle, requests, "schedules, main segment")
    moved = [dataclasses.replace(a, ad_id=a.ad_id + 10) for a in ads]  # the same schedules, through the delta
    for update in [Retire(a.ad_id) for a in ads] + [Upsert(a) for a in moved]:
        cpu.apply(update)
        oracle.apply(update)
    assert [w.tolist() for w in oracle.match(requests)] == [[i + 10 for i in want[t]] for t in times]
    _assert_same(cpu, oracle, requests, "schedules, delta segment")
    cpu.close()
