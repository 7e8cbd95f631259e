"""GPU targeting index (gpu/index.py, gpu/kernels/match.py) against the oracle.

Runs the kernels under the CUDA simulator at tiny sizes (tests/conftest.py), every kernel version
on random corpora, requests and update streams; compiles every kernel for sm_90 with compile_ptx in
a subprocess (compile_ptx needs the real numba.cuda, not the simulator); checks the slot layout the
scoring kernel relies on. Pools use 32-slot chunks so that a simulated block stays small.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from andromeda_nb.compiled import MAX_TERM_ID, compile_ads, encode_request
from andromeda_nb.oracle import OracleIndex, eligible
from andromeda_nb.targeting import parse_ad, parse_request
from andromeda_nb.testing import KERNEL_DEVICE, random_ads, random_requests, random_updates
from andromeda_nb.updates import LiveAds, apply_updates
from andromeda_nb import devices
from gpu.index import GpuTargetingIndex, Vocabulary, clause_programs, residual_tables, resid_words
from gpu.kernels.match import SHIPPED as SHIPPED_MATCH
from tests.support.ptx import needs_nvrtc

CHUNK = 32  # slots per format chunk in these tests (production: CHUNK_SLOTS = 256)
FORMATS = 3


def _kernels():
    """Every match kernel version: the kernel lab's table (the shipped ones included)."""
    from gpu.lab import match as K

    return K


def _version(number: int):
    return _kernels().VERSIONS[number]


def _layout():
    """The kernels' data layout (residual words, clause programs, group tables): the shipped file's."""
    from gpu.kernels import match as K

    return K


def _sim_versions():
    K = _kernels()
    return [v for v in sorted(K.VERSIONS) if devices.gpu_usable() or not K.VERSIONS[v].gpu_only]


def _assert_same(expected, got, config: str):
    assert len(expected) == len(got), config
    for i, (e, g) in enumerate(zip(expected, got)):
        if not np.array_equal(e, g):
            missing = sorted(set(e.tolist()) - set(g.tolist()))
            extra = sorted(set(g.tolist()) - set(e.tolist()))
            pytest.fail(f"{config}: request {i}: missing {missing[:10]} extra {extra[:10]}")


# --- host-side building blocks, against hand-computed values -----------------------------------------


def test_residual_tables_hand_computed():
    K = _layout()
    reqs = [
        parse_request({"request_id": 1, "user": {"age": 30, "gender": 2},
                       "context": {"publisher_platform": "instagram", "device_platform": "desktop",
                                   "user_os": "Linux", "time": 5}}, seed=0, experts=6, width=16),
        parse_request({"request_id": 2, "user": {"age": 70, "gender": 0},
                       "context": {"publisher_platform": "facebook", "device_platform": "mobile",
                                   "user_os": "iOS", "time": 5}}, seed=0, experts=6, width=16),
    ]
    ft = residual_tables([encode_request(r) for r in reqs])
    # gender mask 0b100 (female only): request 0 (gender 2); 0b001 (unknown only): request 1; all: both
    assert ft[K.GENDER_OFF + 0b100] == 0b01
    assert ft[K.GENDER_OFF + 0b001] == 0b10
    assert ft[K.GENDER_OFF + 0b111] == 0b11
    assert ft[K.GENDER_OFF + 0b010] == 0
    assert ft[K.PUBLISHER_OFF + 0b0010] == 0b01  # instagram
    assert ft[K.PUBLISHER_OFF + 0b0001] == 0b10  # facebook
    assert ft[K.DEVICE_OFF + 0b010] == 0b01
    assert ft[K.OS_OFF + (1 << 4)] == 0b01  # Linux
    assert ft[K.OS_OFF + 1] == 0b10  # iOS
    assert ft[K.AMIN_OFF + 30] == 0b11 and ft[K.AMIN_OFF + 31] == 0b10
    assert ft[K.AMAX_OFF + 30] == 0b01 and ft[K.AMAX_OFF + 65] == 0b01  # 70 > 65
    assert ft[K.AMAX_OFF + K.AGE_UNBOUNDED] == 0b11  # "65 and older"


def test_clause_program_and_residual_word_hand_computed():
    K = _layout()
    ad = parse_ad({"ad_id": 9, "status": "ACTIVE", "start_time": 100, "format": 1, "targeting": {
        "age_min": 21, "genders": [2], "publisher_platforms": ["messenger"],
        "geo_locations": {"countries": ["US"], "custom_locations": [
            {"latitude": 1.0, "longitude": 2.0, "radius": 10, "distance_unit": "kilometer"}]},
        "flexible_spec": [{"interests": [5, 3]}],
        "excluded_custom_audiences": [7]}}, seed=0, dim=4)
    ct = compile_ads([ad])
    vocab = Vocabulary(ct.terms)
    prog, start, length = clause_programs(ct, np.zeros(1, np.int64), vocab.dense_bulk(ct.terms), circle_base=4)
    d = {int(t): int(vocab.dense_bulk(np.asarray([t]))[0]) for t in ct.terms}
    terms = ct.terms.tolist()  # geo: [US]; flex: [3, 5] sorted; negative: [audience 7]
    assert prog.tolist() == [
        3,
        1 | K.CIRCLES_BIT, 4, 1, d[terms[0]],
        2, d[terms[1]], d[terms[2]],
        1 | K.NEGATIVE_BIT, d[terms[3]],
    ]
    assert start.tolist() == [0] and length.tolist() == [len(prog)]
    w = int(resid_words(ct)[0])
    assert w & 127 == 21 and (w >> K.AGE_MAX_SHIFT) & 127 == K.AGE_UNBOUNDED
    assert (w >> K.GENDER_SHIFT) & 7 == 0b100
    assert (w >> K.PUBLISHER_SHIFT) & 15 == 0b1000
    assert (w >> K.DEVICE_SHIFT) & 7 == 0b111 and (w >> K.OS_SHIFT) & 63 == 0b111111
    assert w & K.ACTIVE_BIT and w & K.SCHEDULE_BIT


# --- equality with the oracle ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [11, 12])
def test_random_corpus_equals_oracle(seed):
    rng = np.random.default_rng(seed)
    ads = random_ads(rng, 60, formats=FORMATS)
    requests = random_requests(rng, 37)  # one full group of 32 and a partial one
    expected = OracleIndex.build(ads).match(requests)
    assert sum(map(len, expected)) > 0
    for version in _sim_versions():
        index = GpuTargetingIndex.build(ads, version=_version(version), chunk_slots=CHUNK)
        _assert_same(expected, index.match(requests), f"seed={seed} version={version} ads=60 requests=37")


@pytest.mark.parametrize("version", [SHIPPED_MATCH, 4])
def test_retire_only_stream_equals_oracle(version):
    """Retirements with no create after them to reuse the freed slots: every retired ad, eligible
    before, is gone from every answer, and no freed slot answers (random streams re-create into
    freed slots before a check, which hides a slot that keeps matching once released)."""
    from andromeda_nb.types import Retire

    rng = np.random.default_rng(23)
    ads = random_ads(rng, 40, formats=1)
    requests = random_requests(rng, 30)
    oracle = OracleIndex.build(ads)
    index = GpuTargetingIndex.build(ads, version=_version(version), chunk_slots=CHUNK)
    seen = sorted({int(i) for ids in oracle.match(requests) for i in ids})
    assert len(seen) >= 6
    for step, ad_id in enumerate(rng.choice(seen, 6, replace=False).tolist()):
        index.apply(Retire(ad_id))
        oracle.apply(Retire(ad_id))
        _assert_same(oracle.match(requests), index.match(requests), f"version={version} after retire {step} ({ad_id})")


@pytest.mark.parametrize("version", [4, 7])
def test_update_stream_equals_oracle(monkeypatch, version):
    """Creates, replacements (with and without a format change), status changes, retirements,
    re-creations and rejected updates; alternating single `apply` and batched `apply_many`; capacity
    growth and program compaction both happen on the way. v7 also reads the custom locations that
    updates add through the host's circle table."""
    import gpu.index as gi

    monkeypatch.setattr(gi, "COMPACT_MIN_WORDS", 40)
    monkeypatch.setattr(gi, "COMPACT_RATIO", 0.2)
    seed = 21
    rng = np.random.default_rng(seed)
    # two formats, each filling exactly one chunk: the first create of a format must grow the pool
    ads = [dataclasses.replace(a, format=i % 2) for i, a in enumerate(random_ads(rng, 2 * CHUNK, formats=2))]
    requests = random_requests(rng, 32)
    updates = random_updates(rng, ads, 120, invalid=0.1, formats=FORMATS)
    oracle = OracleIndex.build(ads)
    live = LiveAds(a.ad_id for a in ads)
    index = GpuTargetingIndex.build(ads, version=_version(version), chunk_slots=CHUNK)
    cap0, bytes0 = index.capacity, index.device_bytes()
    rejected = 0
    for step, start in enumerate(range(0, len(updates), 40)):
        part = updates[start:start + 40]
        accepted = []
        for u in part:
            if live.accept(u) is None:
                accepted.append(u)
                oracle.apply(u)
            else:
                rejected += 1
        if step % 2 == 0:
            for u in accepted:
                index.apply(u)
        else:
            index.apply_many(accepted)
        assert len(index) == len(oracle)
        ever = {a.ad_id for a in ads} | set(oracle.ads)  # live ids through growth and compaction
        assert all((i in index) == (i in oracle.ads) for i in ever), f"seed={seed} after update {start + len(part)}"
        _assert_same(oracle.match(requests), index.match(requests),
                     f"seed={seed} version={version} after update {start + len(part)}")
    assert rejected > 0
    assert index.compactions > 0
    assert index.capacity > cap0 and index.device_bytes() > bytes0


def test_update_visible_to_next_request():
    """An update acknowledged before a request starts is visible to it (single updates, no batching)."""
    rng = np.random.default_rng(31)
    ads = random_ads(rng, 20, formats=1)
    requests = random_requests(rng, 8)
    index = GpuTargetingIndex.build(ads, version=_kernels().SIMULATOR_FALLBACK, chunk_slots=CHUNK)
    oracle = OracleIndex.build(ads)
    targets = [index, oracle]
    live = LiveAds(a.ad_id for a in ads)
    for u in random_updates(rng, ads, 6, formats=1):
        assert apply_updates([u], targets, live) == []
        _assert_same(oracle.match(requests), index.match(requests), f"seed=31 after {u!r}")


def test_a_format_change_moves_the_ad_and_the_engine_scores_it_as_the_reference():
    """Upserts that change eligible ads' formats (half one by one, half in one `apply_many`): the GPU
    engine over this index answers every request with k at least its eligible count, so every
    eligible ad's score is compared with the float64 reference (the eligible sets alone do not
    change with a format), and each moved ad sits in a slot of its new format."""
    from andromeda_nb.compare import compare_topk
    from andromeda_nb.dataset import Dataset
    from andromeda_nb.model import MoeModel, quantize
    from andromeda_nb.reference import ReferenceRetriever
    from andromeda_nb.testing import KERNEL_DEVICE
    from andromeda_nb.types import Upsert
    from gpu.engine import GpuEngine

    seed, D, F = 26, 16, 2
    rng = np.random.default_rng(seed)
    ads = [dataclasses.replace(a, format=a.format % F) for a in random_ads(rng, 60, dim=D)]
    requests = random_requests(rng, 4)
    dataset = Dataset(ads=ads, embeddings=quantize(np.stack([a.embedding for a in ads]), "fp32"), requests=requests,
                      model=MoeModel.init(seed, D=D, F=F), seed=0, precision="fp32")
    reference = ReferenceRetriever.build(dataset)
    engine = GpuEngine(dataset, KERNEL_DEVICE)
    try:
        eligible = sorted({int(i) for ids in reference.index.match(requests) for i in ids})
        moved = [dataclasses.replace(reference.index.ads[i], format=F - 1 - reference.index.ads[i].format)
                 for i in eligible]
        assert len(moved) >= 4 and {a.format for a in moved} == set(range(F)), f"seed={seed}: too few to move"
        half = len(moved) // 2
        for ad in moved[:half]:
            engine.apply(Upsert(ad))
        engine.apply_many([Upsert(ad) for ad in moved[half:]])
        for ad in moved:
            reference.apply(Upsert(ad))
        k = max(len(ids) for ids in reference.index.match(requests))
        for request, (ids, scores) in zip(requests, engine.retrieve(requests, k)):
            ref_ids, result = reference.score_eligible(request)
            assert len(ids) == len(ref_ids), f"seed={seed} request {request.request_id}: not every eligible ad"
            cmp = compare_topk(ref_ids, result, ids, scores, k)
            assert cmp.ok, f"seed={seed} ads=60 k={k} request {request.request_id} after format changes: {cmp.message}"
        slots = engine.index.slots
        assert all(slots.format_of_slot(slots.slot_of(ad.ad_id)) == ad.format for ad in moved)
    finally:
        engine.close()


def _request(rid, age, time, **user):
    return parse_request({"request_id": rid, "user": {"age": age, **user},
                          "context": {"publisher_platform": "facebook", "device_platform": "mobile",
                                      "user_os": "iOS", "time": time}}, seed=0, experts=6, width=16)


def test_boundaries_equal_oracle():
    """Schedule ends (start inclusive, end exclusive), age limits (65 = and older), a custom location
    with the user 1 km inside and 1 km outside, a negative clause: hand-picked edges."""
    geo = {"countries": ["US"]}
    specs = [
        {"ad_id": 1, "start_time": 100, "end_time": 200, "targeting": {"geo_locations": geo}},
        {"ad_id": 2, "targeting": {"geo_locations": geo, "age_min": 21, "age_max": 30}},
        {"ad_id": 3, "targeting": {"geo_locations": geo, "age_min": 40, "age_max": 65}},
        {"ad_id": 4, "targeting": {"geo_locations": {"custom_locations": [
            {"latitude": 0.0, "longitude": 0.0, "radius": 10, "distance_unit": "kilometer"}]}}},
        {"ad_id": 5, "targeting": {"geo_locations": geo, "excluded_geo_locations": {"regions": [3]}}},
        {"ad_id": 6, "status": "PAUSED", "targeting": {"geo_locations": geo}},
    ]
    ads = [parse_ad(o, seed=0, dim=4, formats=8) for o in specs]
    km = 1.0 / 111.19492664455873  # degrees of latitude per km on the sphere of DESIGN section 2
    requests = [_request(i, age, t, country="US", region=region, latitude=lat, longitude=0.0)
                for i, (age, t, region, lat) in enumerate([
                    (20, 99, 3, 9 * km), (21, 100, 1, 11 * km), (30, 199, 3, 0.0), (31, 200, 1, 9.9 * km),
                    (39, 150, 1, 10.1 * km), (40, 150, 2, -9 * km), (65, 150, 3, 0.0), (90, 150, 1, 0.0)])]
    expected = OracleIndex.build(ads).match(requests)
    assert [e.tolist() for e in expected] == [[4], [1, 2, 5], [1, 2, 4], [4, 5], [1, 5], [1, 3, 4, 5], [1, 3, 4],
                                              [1, 3, 4, 5]]
    for version in _sim_versions():
        index = GpuTargetingIndex.build(ads, version=_version(version), chunk_slots=CHUNK)
        _assert_same(expected, index.match(requests), f"boundaries version={version}")


def test_an_upsert_bringing_a_never_seen_term_is_matched_by_the_next_request():
    """Match (which builds the vocabulary's hash table), then upserts whose clauses name terms no ad
    had used, then match again: requests naming the new terms reach the new ads, as the oracle says
    (a hash table kept from before the upserts knows none of the new terms)."""
    from andromeda_nb.types import Upsert

    rng = np.random.default_rng(41)
    ads = random_ads(rng, 30, formats=1)
    new_interest, new_behavior = MAX_TERM_ID, MAX_TERM_ID - 1  # ids far above those the ads draw
    us = {"geo_locations": {"countries": ["US"]}}
    fresh = [parse_ad({"ad_id": 10**6 + i, "targeting": {**us, "flexible_spec": [spec]}}, seed=0, dim=4, formats=1)
             for i, spec in enumerate([{"interests": [new_interest]}, {"behaviors": [new_behavior, 3]}])]
    requests = random_requests(rng, 6) + [
        _request(100, 30, 150, country="US", interests=[new_interest]),
        _request(101, 30, 150, country="US", behaviors=[new_behavior]),
        _request(102, 30, 150, country="US", interests=[new_behavior])]  # the id, in another namespace
    oracle = OracleIndex.build(ads)
    index = GpuTargetingIndex.build(ads, chunk_slots=CHUNK)
    _assert_same(oracle.match(requests), index.match(requests), "seed=41 before the upserts")
    terms = len(index.vocab)
    for ad in fresh:
        index.apply(Upsert(ad))
        oracle.apply(Upsert(ad))
    assert len(index.vocab) >= terms + 2  # the terms were new to the index
    expected = oracle.match(requests)
    assert [10**6] == [i for i in expected[-3].tolist() if i >= 10**6]
    assert [10**6 + 1] == [i for i in expected[-2].tolist() if i >= 10**6]
    assert not [i for i in expected[-1].tolist() if i >= 10**6]
    _assert_same(expected, index.match(requests), "seed=41 after upserts of never-seen terms")


def test_circle_table_equals_the_great_circle_distance():
    """The host's circle table (v7, v8) against `haversine_km` for every (user, circle) pair: users
    1 m inside and outside edges, at a centre, without a location, near a pole and across the date
    line; 70 requests span two groups of 64."""
    from andromeda_nb.geo import haversine_km

    rng = np.random.default_rng(53)
    ads = random_ads(rng, 80, formats=FORMATS)
    index = GpuTargetingIndex.build(ads, version=_version(7), chunk_slots=CHUNK)
    circles = index.circles_h
    assert len(circles) >= 5, "seed 53 draws custom locations"
    km = 1.0 / 111.19492664455873
    points = [(float("nan"), float("nan")), (89.99, 10.0), (0.5, 179.999), (0.5, -179.999)]
    for lat, lon, rad in circles[:20]:
        points += [(lat, lon), (lat + (rad - 0.001) * km, lon), (lat + (rad + 0.001) * km, lon)]
    while len(points) < 70:
        points.append((rng.uniform(-60, 60), rng.uniform(-180, 180)))
    encoded = [dataclasses.replace(encode_request(random_requests(rng, 1)[0]), latitude=la, longitude=lo)
               for la, lo in points[:70]]
    table = index.circle_table(encoded, 64)
    assert table.shape == (2, len(circles))
    inside = 0
    for r, e in enumerate(encoded):
        for q, (lat, lon, rad) in enumerate(circles):
            want = haversine_km(e.latitude, e.longitude, lat, lon) <= rad
            got = bool((int(table[r // 64, q]) >> (r % 64)) & 1)
            assert got == want, f"seed 53 request {r} at {points[r]} circle {q} {circles[q].tolist()}"
            inside += want
    assert inside >= 20  # the centres and the points just inside


# --- slot layout (the scoring kernel's contract) ----------------------------------------------------


def test_slot_order_output_layout():
    rng = np.random.default_rng(41)
    ads = random_ads(rng, 70, formats=FORMATS)
    requests = random_requests(rng, 5)
    index = GpuTargetingIndex.build(ads, version=_kernels().SIMULATOR_FALLBACK, chunk_slots=CHUNK, spare=0.3)
    slots = index.slots
    assert index.capacity % CHUNK == 0 and slots.capacity == index.capacity
    fmt_of = {a.ad_id: a.format for a in ads}
    used = np.flatnonzero(slots.slot_ad_id >= 0)
    # every chunk holds one format: the ads in it have the chunk's format
    assert all(fmt_of[int(slots.slot_ad_id[s])] == slots.format_of_slot(s) for s in used)
    words = index.match_slots([encode_request(r) for r in requests]).copy_to_host()
    assert words.dtype == np.uint32 and words.shape == (5, index.capacity // 32)
    by_id = {a.ad_id: a for a in ads}
    for b, r in enumerate(requests):
        for s in range(index.capacity):
            bit = (int(words[b, s // 32]) >> (s % 32)) & 1
            ad_id = int(slots.slot_ad_id[s])
            want = ad_id >= 0 and eligible(by_id[ad_id], r)
            assert bit == want, f"request {b} slot {s} ad {ad_id}"


def test_reused_upload_buffers_and_output():
    """A serving loop's calls: every match_slots call reuses the index's request buffers and one kept
    output array, and each answer is still the oracle's; a batch prepared without reuse keeps its
    own buffers; an output of the wrong shape is refused."""
    rng = np.random.default_rng(41)
    ads = random_ads(rng, 50, formats=2)
    requests = random_requests(rng, 12)
    index = GpuTargetingIndex.build(ads, version=_kernels().SIMULATOR_FALLBACK, chunk_slots=CHUNK)
    oracle = OracleIndex.build(ads)
    kept = index.prepare([encode_request(r) for r in requests[:3]])
    out = index.new_output(3)
    for lo in range(0, 12, 3):
        part = requests[lo:lo + 3]
        got = index.match_slots([encode_request(r) for r in part], out=out)
        assert got is out
        _assert_same(oracle.match(part), index.slot_masks_to_ids(got.copy_to_host()), f"seed=41 requests {lo}..")
    index.run(kept, out)
    _assert_same(oracle.match(requests[:3]), index.slot_masks_to_ids(out.copy_to_host()), "seed=41 kept batch")
    with pytest.raises(ValueError, match=r"out: expected a uint32 device array of shape \(2, "):
        index.match_slots([encode_request(r) for r in requests[:2]], out=out)


def test_kept_output_for_changing_batch_sizes_allocates_once(monkeypatch):
    """`kept_output` for batches of changing sizes: after the largest, the first rows of one kept
    array (no allocation), and the match written there is the oracle's for each batch."""
    rng = np.random.default_rng(43)
    ads = random_ads(rng, 40, formats=2)
    requests = random_requests(rng, 10)
    index = GpuTargetingIndex.build(ads, version=_kernels().SIMULATOR_FALLBACK, chunk_slots=CHUNK)
    oracle = OracleIndex.build(ads)
    made = []
    real = index.new_output
    monkeypatch.setattr(index, "new_output", lambda n: made.append(n) or real(n))
    first = index.kept_output(4)
    assert made == [4] and tuple(first.shape) == (4, index.capacity // 32)
    at = 0
    for n in (2, 4, 1, 3):
        part = requests[at:at + n]
        at += n
        out = index.kept_output(n)
        assert tuple(out.shape) == (n, index.capacity // 32)
        index.match_slots([encode_request(r) for r in part], out=out)
        _assert_same(oracle.match(part), index.slot_masks_to_ids(out.copy_to_host()), f"batch of {n}")
    assert made == [4], f"kept_output allocated again: {made[1:]}"
    assert index.kept_output(3) is index.kept_output(3)
    index.kept_output(6)  # a larger batch: one new array, a power of two rows
    assert made == [4, 8]


def test_kept_output_follows_the_capacity_as_it_grows():
    """After updates grow the pool, the kept output is remade at the new width (a stale one would be
    refused by match_slots, or miss the new slots) and the match in it is the oracle's."""
    rng = np.random.default_rng(44)
    # two formats, each filling exactly one chunk: the first create of a format grows the pool
    ads = [dataclasses.replace(a, format=i % 2) for i, a in enumerate(random_ads(rng, 2 * CHUNK, formats=2))]
    requests = random_requests(rng, 3)
    index = GpuTargetingIndex.build(ads, version=_kernels().SIMULATOR_FALLBACK, chunk_slots=CHUNK)
    oracle = OracleIndex.build(ads)
    before = index.kept_output(3)
    cap0 = index.capacity
    live = LiveAds(a.ad_id for a in ads)
    accepted = [u for u in random_updates(rng, ads, 60, invalid=0.0, formats=FORMATS) if live.accept(u) is None]
    for u in accepted:
        oracle.apply(u)
    index.apply_many(accepted)
    assert index.capacity > cap0
    out = index.kept_output(3)
    assert tuple(out.shape) == (3, index.capacity // 32) != tuple(before.shape)
    index.match_slots([encode_request(r) for r in requests], out=out)
    _assert_same(oracle.match(requests), index.slot_masks_to_ids(out.copy_to_host()), "after growth")


def test_empty_index_and_no_requests():
    index = GpuTargetingIndex.build([], chunk_slots=CHUNK)
    assert len(index) == 0 and index.capacity == 0
    rng = np.random.default_rng(5)
    assert [len(x) for x in index.match(random_requests(rng, 2))] == [0, 0]
    assert index.match([]) == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="version"):
        GpuTargetingIndex(version=99)
    with pytest.raises(ValueError, match="multiple of 32"):
        GpuTargetingIndex.build([], chunk_slots=48)
    ads = random_ads(np.random.default_rng(1), 2, formats=1)
    with pytest.raises(ValueError, match="duplicate"):
        GpuTargetingIndex.build([ads[0], ads[0]])


# --- compilation for Hopper --------------------------------------------------------------------------

_COMPILE_SCRIPT = textwrap.dedent("""
    from gpu.lab.ptx import pretend_sm90
    # device functions called from a kernel are compiled for the current device's compute capability;
    # there is no device here, so name the one compile_ptx targets
    pretend_sm90()
    from numba import cuda
    from gpu.lab import match as K
    for name, fn, sig in K.kernel_signatures():
        ptx, _ = cuda.compile_ptx(fn, sig, cc=(9, 0))
        assert ".target sm_90" in ptx, name
        print(name, len(ptx), ".f64" in ptx, ".local" in ptx)
""")


@needs_nvrtc
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines()]
    assert [r[0] for r in rows] == [n for n, _, _ in _kernels().kernel_signatures()]
    # the circle-table kernels do no float64 arithmetic and need no local memory (the float64
    # great-circle test of v1 to v6 brings libdevice's trig reduction and its 40-byte local array)
    flags = {r[0]: (r[2] == "True", r[3] == "True") for r in rows}
    assert flags["match_v7"] == flags["match_v8"] == (False, False), flags
    assert flags["match_v5"] == (True, True), flags


# --- on a real GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not devices.gpu_usable(), reason="needs a real CUDA GPU (run with ANDROMEDA_TEST_GPU=1)")
def test_every_version_equals_oracle_on_gpu():
    rng = np.random.default_rng(51)
    ads = random_ads(rng, 3000, formats=8)
    requests = random_requests(rng, 100)
    expected = OracleIndex.build(ads).match(requests)
    for version in sorted(_kernels().VERSIONS):
        index = GpuTargetingIndex.build(ads, device="gpu", version=_version(version))
        _assert_same(expected, index.match(requests), f"seed=51 version={version} ads=3000 requests=100")


# --- the benchmark's tiled pools ---------------------------------------------------------------------


def test_tiled_index_equals_index_of_tiled_corpus():
    from benchmarks.tiling import tile_compiled
    from benchmarks.match import build_tiled_index

    rng = np.random.default_rng(61)
    ads = random_ads(rng, 25, formats=2)
    requests = [encode_request(r) for r in random_requests(rng, 6)]
    ct = compile_ads(ads)
    version = _kernels().SIMULATOR_FALLBACK
    tiled = build_tiled_index(ct, 3, version=version, chunk_slots=CHUNK, spare=0.0)
    direct = GpuTargetingIndex.from_compiled(tile_compiled(ct, 3), version=_version(version), chunk_slots=CHUNK)
    assert np.array_equal(tiled.slots.slot_ad_id, direct.slots.slot_ad_id)
    assert len(tiled) == len(direct) == 75
    a = tiled.match_slots(requests).copy_to_host()
    assert a.any() and np.array_equal(a, direct.match_slots(requests).copy_to_host())
    # the computed id -> slot map answers like the allocator's dict
    for ad_id in direct.slots.slot_ad_id[direct.slots.slot_ad_id >= 0].tolist():
        assert tiled.slots.slot_of(ad_id) == direct.slots.slot_of(ad_id)
    assert 10**9 not in tiled.slots


def test_a_tiled_index_in_a_ranked_order_answers_as_the_plain_one_by_ad_id():
    from benchmarks.tiling import stride_of
    from benchmarks.match import build_tiled_index

    rng = np.random.default_rng(62)
    ads = random_ads(rng, 40, formats=2)
    requests = random_requests(rng, 6)
    ct = compile_ads(ads)
    version = _kernels().SIMULATOR_FALLBACK
    rank = rng.permutation(len(ct))
    plain = build_tiled_index(ct, 3, version=version, chunk_slots=CHUNK)
    ranked = build_tiled_index(ct, 3, version=version, chunk_slots=CHUNK, rank=rank)
    ids = ranked.slots.slot_ad_id
    assert not np.array_equal(ids, plain.slots.slot_ad_id)
    # a format's slots hold its base ads in rank order, each base ad's three copies side by side
    row_of = {int(a): i for i, a in enumerate(ct.ad_id)}
    stride = stride_of(ct)
    for f in (0, 1):
        n_f = int((ct.format == f).sum())
        first = int(np.flatnonzero(ranked.slots.slot_format() == f)[0])
        held = ids[first:first + 3 * n_f].reshape(n_f, 3)
        assert (held // stride == np.arange(3)).all() and (held % stride == held[:, :1]).all()
        assert np.all(np.diff(rank[[row_of[int(a)] for a in held[:, 0]]]) > 0)
    a, b = ranked.match(requests), plain.match(requests)
    assert any(len(x) for x in a) and all(np.array_equal(x, y) for x, y in zip(a, b))
    for ad_id in ids[ids >= 0].tolist():
        assert ids[ranked.slots.slot_of(ad_id)] == ad_id


def test_bench_match_runs_and_checks(tmp_path, monkeypatch):
    """The benchmark end to end at simulator size: generation, tiling, the full-size oracle check,
    timing, updates while serving, the CPU index, the JSON file."""
    import json

    from benchmarks import match as bm
    from benchmarks.match_both import bench_match

    monkeypatch.setattr(bm, "WARMUP", 0)
    out = tmp_path / "match.json"
    result = bench_match(pools=[240], versions=[_kernels().SIMULATOR_FALLBACK], batches=[32], base_ads=80, requests=40,
                    updates=(2, 15), cpu_pool=160, chunk_slots=CHUNK, progress=False, out=str(out))
    pool = json.loads(out.read_text())["pools"][0]
    assert pool["ads"] == 240 and pool["copies"] == 3
    assert pool["check"]["ok"] and pool["check"]["requests_checked"] > 0 and pool["eligible_share"] > 0
    # the output of the timed launches is checked too, every request at every slot of this small pool
    timed = pool["checks"][f"v{_kernels().SIMULATOR_FALLBACK}/b32"]
    assert timed["ok"] and timed["requests_checked"] == timed["full_pool_requests"] == 32, timed
    assert result["checks_ok"] is True
    assert pool["updates"]["updates"] > 0 and pool["updates"]["touched_ads_checked"] > 0
    assert result["cpu_index"] is None or result["cpu_index"]["ads"] == 160
    for row in pool["timings"]:  # the simulator's event timer reads -1 ms: the host clock times it instead
        assert row["median_s"] > 0 and row["min_s"] > 0 and row["pool_ads_per_s"] > 0, row
        assert row["clock"].startswith("CUDA events" if devices.gpu_usable() else "host"), row


def test_cli_match_gpu_equals_oracle(tmp_path):
    """`andromeda match --arch gpu --device sim` against --arch oracle, in a fresh process as a user runs
    it (without the simulator switch in its environment: --device sim alone chooses it)."""
    data = tmp_path / "corpus"
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}

    def cli(*args):
        proc = subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True, env=env,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout

    cli("generate", "--ads", "150", "--requests", "12", "--seed", "5", "--out", str(data), "--quiet")
    gpu = cli("match", "--data", str(data), "--arch", "gpu", "--device", "sim", "--json", "--quiet")
    oracle = cli("match", "--data", str(data), "--arch", "oracle", "--json", "--quiet")
    assert gpu == oracle and '"eligible": [1' in gpu


def test_cli_bench_match_help():
    from click.testing import CliRunner

    import cli

    res = CliRunner().invoke(cli.main, ["bench", "match", "--help"])
    assert res.exit_code == 0 and "pool ads/s" in res.output
    res = CliRunner().invoke(cli.main, ["bench", "match", "--ads", "ten"])
    assert res.exit_code != 0 and "--ads" in res.output and "Traceback" not in res.output


# --- compiled host layout against its plain reference ------------------------------------------------

@pytest.mark.parametrize("seed", [5, 23])
def test_compiled_vocabulary_and_clause_programs_equal_the_plain_ones(seed):
    """`Vocabulary.of_terms` (one hashed pass) is `Vocabulary(terms)` with `dense_bulk(terms)`, and the
    compiled `clause_programs` is `clause_programs_plain`, word for word, on random ads in a random
    slot order, terms drawn so that the hash table grows several times and wraps around."""
    from gpu.index import clause_programs_plain

    rng = np.random.default_rng(seed)
    ct = compile_ads(random_ads(rng, 300))
    config = f"seed={seed} ads={len(ct)} terms={len(ct.terms)}"
    plain = Vocabulary(ct.terms)
    vocab, dense = Vocabulary.of_terms(ct.terms)
    assert len(vocab) == len(plain) and np.array_equal(vocab.terms(), plain.terms()), config
    assert dense.dtype == np.int64 and np.array_equal(dense, plain.dense_bulk(ct.terms)), config
    many = rng.integers(0, MAX_TERM_ID, 5000) | (rng.integers(0, 14, 5000) << 40)  # distinct terms beyond 1024
    many = np.concatenate([many, many[::-3], rng.choice(many, 2000)])
    big, big_dense = Vocabulary.of_terms(many)
    assert np.array_equal(big.terms(), Vocabulary(many).terms()), config
    assert np.array_equal(big_dense, Vocabulary(many).dense_bulk(many)), config
    empty, empty_dense = Vocabulary.of_terms(np.empty(0, np.int64))
    assert len(empty) == 0 and len(empty_dense) == 0
    for rows in (rng.permutation(len(ct)), rng.choice(len(ct), 50), np.empty(0, np.int64)):
        for base in (0, int(rng.integers(1, 1 << 20))):
            got = clause_programs(ct, rows, dense, circle_base=base)
            want = clause_programs_plain(ct, rows, dense, circle_base=base)
            for g, w in zip(got, want):
                assert g.dtype == w.dtype and np.array_equal(g, w), f"{config} rows={len(rows)} base={base}"


def test_the_built_rows_are_the_rows_of_the_slots():
    """`from_compiled`'s `built_rows` (the layout's own order, no lookup by id) names the compiled row
    whose ad each used slot holds, in slot order, for both layouts."""
    rng = np.random.default_rng(11)
    ct = compile_ads(random_ads(rng, 200, formats=FORMATS))
    for rank in (None, "geo"):
        index = GpuTargetingIndex.from_compiled(ct, device=KERNEL_DEVICE, chunk_slots=CHUNK, rank=rank)
        used = np.flatnonzero(index.slots.slot_ad_id >= 0)
        assert np.array_equal(ct.ad_id[index.built_rows], index.slots.slot_ad_id[used]), f"seed=11 rank={rank}"
