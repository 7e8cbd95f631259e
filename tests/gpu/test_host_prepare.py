"""The host's share of a match batch (gpu/index.py), compiled, against plain forms of the same thing:
requests encoded together (`encode_requests`) against `encode_request` one by one; the group tables
filled by numba against `residual_tables` and a term-by-term rtab; the circle table against
`haversine_km` for every (user, circle) pair, with users placed exactly on radius boundaries (and
one float64 step outside), at the poles and across the antimeridian; the shipped match kernel (v8)
against the oracle at such places; and the GPU engine, which prepares batch i + 1 before it fetches
batch i with one synchronization per batch, against the float64 reference.

Kernels run under the CUDA simulator (tests/conftest.py); pools use 32-slot chunks."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from andromeda_nb.compiled import EncodedBatch, encode_request, encode_requests
from andromeda_nb.geo import haversine_km
from andromeda_nb.oracle import OracleIndex
from andromeda_nb.targeting import parse_ad, parse_request
from andromeda_nb.testing import KERNEL_DEVICE, random_ads, random_requests, request_lists
from gpu.index import CircleLookup, GpuTargetingIndex, RequestBatch, Vocabulary, residual_tables


CHUNK = 32


def _same_encoding(batch: EncodedBatch, one_by_one, context: str) -> None:
    assert len(batch) == len(one_by_one), context
    for b, e in enumerate(one_by_one):
        got = batch[b]
        assert got.terms.dtype == np.int64 and np.array_equal(got.terms, e.terms), f"{context}: request {b} terms"
        for name in ("age", "gender", "publisher", "device", "os", "time"):
            assert getattr(got, name) == getattr(e, name), f"{context}: request {b} {name}"
        for name in ("latitude", "longitude"):
            want, have = getattr(e, name), getattr(got, name)
            assert (math.isnan(want) and math.isnan(have)) or want == have, f"{context}: request {b} {name}"


# --- encoding ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [3, 4])
def test_encode_requests_equals_encode_request(seed):
    rng = np.random.default_rng(seed)
    requests = random_requests(rng, 70)
    one_by_one = [encode_request(r) for r in requests]
    assert sum(len(e.terms) for e in one_by_one) > 70  # users hold terms
    _same_encoding(encode_requests(requests), one_by_one, f"seed={seed}")
    _same_encoding(EncodedBatch.of(one_by_one), one_by_one, f"seed={seed} from encoded requests")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request_lists(0, 9))
def test_encode_requests_equals_encode_request_hypothesis(requests):
    _same_encoding(encode_requests(requests), [encode_request(r) for r in requests], "drawn requests")


@pytest.mark.parametrize("seed", [5, 6])
def test_a_lone_request_encodes_as_in_a_batch(seed):
    """`encode_requests` of one request (its own path) gives the arrays, dtypes and values of
    `encode_request` and of the same request inside a batch."""
    requests = random_requests(np.random.default_rng(seed), 40)
    batch = encode_requests(requests)
    for b, r in enumerate(requests):
        lone = encode_requests([r])
        _same_encoding(lone, [encode_request(r)], f"seed={seed} request {b}")
        _same_encoding(lone, [batch[b]], f"seed={seed} request {b} against the batch")
        assert lone.term_ptr.dtype == np.int64 and lone.term_ptr.tolist() == [0, len(lone.terms)]
        for name in ("age", "gender", "publisher", "device", "os", "time", "latitude", "longitude"):
            assert getattr(lone, name).shape == (1,) and getattr(lone, name).dtype == getattr(batch, name).dtype, name
    assert sum(len(encode_requests([r]).terms) for r in requests) > 40  # the users hold terms


def test_encode_requests_keeps_namespaces_and_counts_duplicates_once():
    """Interest 7 and behavior 7 stay two terms; a user without country, region, city or locale holds
    none of them; ids listed twice are one term."""
    req = parse_request({"request_id": 1, "user": {"age": 30, "interests": [7, 7, 9], "behaviors": [7]},
                         "context": {"publisher_platform": "facebook", "device_platform": "mobile",
                                     "user_os": "iOS", "time": 5}}, seed=0, experts=6, width=16)
    batch = encode_requests([req, req])
    assert batch.term_ptr.tolist() == [0, 3, 6]
    assert np.array_equal(batch[0].terms, encode_request(req).terms)
    assert math.isnan(batch.latitude[0])


# --- group tables ----------------------------------------------------------------------------------------


def _plain_tables(encoded, vocab: Vocabulary, group: int):
    """rtab, ftab, rtime, nreq of a batch, term by term in Python (the form before compilation)."""
    groups = max(1, -(-len(encoded) // group))
    rtab = np.zeros((groups, max(1, len(vocab))), np.uint64)
    ftab = np.zeros((groups, residual_tables(encoded[:1]).shape[0]), np.uint64)
    rtime = np.zeros((groups, group), np.int64)
    nreq = np.zeros(groups, np.int32)
    for g in range(groups):
        part = encoded[g * group:(g + 1) * group]
        nreq[g] = len(part)
        ftab[g] = residual_tables(part)
        for r, e in enumerate(part):
            for d in vocab.lookup(e.terms):
                rtab[g, d] |= np.uint64(1 << r)
            rtime[g, r] = e.time
    return rtab, ftab, rtime, nreq


@pytest.mark.parametrize("group,n", [(64, 130), (32, 33), (64, 1)])
def test_compiled_group_tables_equal_the_plain_ones(group, n):
    rng = np.random.default_rng(17 + n)
    ads = random_ads(rng, 40)
    index = GpuTargetingIndex.build(ads, version=7, chunk_slots=CHUNK)
    encoded = [encode_request(r) for r in random_requests(rng, n)]
    rtab, ftab, rtime, nreq = _plain_tables(encoded, index.vocab, group)
    assert rtab.any() and ftab.any(), "seed draws users holding terms of the corpus"
    built = RequestBatch.build(encoded, index.vocab, index._cuda, group)
    got = built.arrays
    word = np.uint32 if group == 32 else np.uint64
    sent = built.dense_tables()["rtab"]
    assert sent.dtype == word and not sent[:, rtab.shape[1]:].any(), f"group={group} n={n}: words past the vocabulary"
    assert np.array_equal(sent[:, :rtab.shape[1]], rtab.astype(word)), f"group={group} n={n} rtab"
    assert not got["rtab"].copy_to_host().any(), "the kept table is zero outside a match"
    assert np.array_equal(got["ftab"].copy_to_host(), ftab.astype(word)), f"group={group} n={n} ftab"
    assert np.array_equal(got["rtime"].copy_to_host(), rtime) and np.array_equal(got["nreq"].copy_to_host(), nreq)
    rpos = got["rpos"].copy_to_host()
    for r, e in enumerate(encoded):
        assert np.array_equal(rpos[r // group, r % group], [e.latitude, e.longitude], equal_nan=True)


def test_reused_buffers_hold_no_stale_bits():
    """A batch built on the buffers of a larger one carries none of its bits."""
    rng = np.random.default_rng(23)
    index = GpuTargetingIndex.build(random_ads(rng, 40), version=8, chunk_slots=CHUNK)
    many = [encode_request(r) for r in random_requests(rng, 64)]
    few = many[:2]
    buffers: dict = {}
    RequestBatch.build(many, index.vocab, index._cuda, 64, buffers, index._circles())
    built = RequestBatch.build(few, index.vocab, index._cuda, 64, buffers, index._circles())
    small, sent = built.arrays, built.dense_tables()
    rtab, ftab, _, _ = _plain_tables(few, index.vocab, 64)
    assert np.array_equal(sent["rtab"][:, :rtab.shape[1]], rtab) and not sent["rtab"][:, rtab.shape[1]:].any()
    assert np.array_equal(small["ftab"].copy_to_host(), ftab)
    circles = index.circle_table(few, 64)
    assert np.array_equal(sent["ctab"][:, :circles.shape[1]], circles) and not sent["ctab"][:, circles.shape[1]:].any()


# --- the circle table ------------------------------------------------------------------------------------


def _plain_circle_table(circles: np.ndarray, lat, lon, group: int) -> np.ndarray:
    table = np.zeros((max(1, -(-len(lat) // group)), max(1, len(circles))), np.uint64)
    for r, (la, lo) in enumerate(zip(lat, lon)):
        for q, (clat, clon, rad) in enumerate(circles):
            if haversine_km(la, lo, clat, clon) <= rad:  # NaN: False
                table[r // group, q] |= np.uint64(1 << (r % group))
    return table


def _boundary_case(rng, n_circles: int, n_points: int):
    """Circles (some at the poles and on the antimeridian) and users: each circle's radius is the
    distance to some user exactly (that user is inside, the boundary counts), and a second user sits
    one float64 step of the radius outside another circle; the rest are random or without a location."""
    lat = rng.uniform(-90, 90, n_points)
    lon = rng.uniform(-180, 180, n_points)
    lat[:4] = [90.0, -90.0, 89.9999, 0.0]
    lon[:4] = [0.0, 45.0, -179.9999, 180.0]
    lat[4], lon[4] = np.nan, np.nan
    centres = np.column_stack([rng.uniform(-90, 90, n_circles), rng.uniform(-180, 180, n_circles)])
    edges = np.asarray([[89.9, 170.0], [-89.95, 0.0], [0.01, 179.99], [0.0, -179.95]])
    centres[:4] = edges[:min(4, n_circles)]
    radius = rng.uniform(0.5, 80.0, n_circles)
    for q in range(n_circles):  # a user near each of the first circles, then the radius set to it
        r = 5 + (q % (n_points - 5))
        lat[r] = np.clip(centres[q, 0] + rng.uniform(-0.5, 0.5), -90, 90)
        lon[r] = (centres[q, 1] + rng.uniform(-0.5, 0.5) + 180) % 360 - 180
        d = haversine_km(lat[r], lon[r], centres[q, 0], centres[q, 1])
        if 0 < d <= 80:
            radius[q] = d if q % 2 == 0 else np.nextafter(d, 0.0)  # exactly on it / one step inside of it
    circles = np.column_stack([centres, radius])
    return circles, lat, lon


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n_circles=st.integers(1, 60), n_points=st.integers(6, 140),
       group=st.sampled_from([32, 64]))
def test_circle_table_equals_haversine_on_every_pair(seed, n_circles, n_points, group):
    rng = np.random.default_rng(seed)
    circles, lat, lon = _boundary_case(rng, n_circles, n_points)
    want = _plain_circle_table(circles, lat, lon, group)
    table = np.full(want.shape, np.uint64(0xDEADBEEF), np.uint64)  # every word must be written
    CircleLookup(circles).fill(lat, lon, group, table)
    assert np.array_equal(table, want), f"seed={seed} circles={n_circles} points={n_points} group={group}"


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n_points=st.integers(6, 140), group=st.sampled_from([32, 64]),
       threads=st.integers(1, 3))
def test_a_large_search_split_over_threads_gives_the_entries_of_one_run(seed, n_points, group, threads):
    """A batch whose search is large is split into runs of requests searched on threads: the same
    entries, in the same order, as one run, wherever the cuts fall against the request groups."""
    import gpu.index as gi

    rng = np.random.default_rng(seed)
    circles, lat, lon = _boundary_case(rng, 300, n_points)
    circles[:, 2] = np.maximum(circles[:, 2], 40.0)  # wide circles: many entries
    lat[5:] = rng.uniform(-1.0, 1.0, n_points - 5)  # users and circles crowded in one place
    lon[5:] = rng.uniform(-1.0, 1.0, n_points - 5)
    circles[4:, 0] = rng.uniform(-1.0, 1.0, 296)
    circles[4:, 1] = rng.uniform(-1.0, 1.0, 296)
    one = CircleLookup(circles)
    want_word, want_bits = one.entries(lat, lon, group, 300)
    split = CircleLookup(circles)
    split._room = 8  # every run outgrows its first room
    split._per_request = float(gi.SEARCH_PART_ENTRIES)  # as if the last batch's requests each found so many
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gi, "SEARCH_THREADS", threads)
        word, bits = split.entries(lat, lon, group, 300)
    assert np.array_equal(word, want_word) and np.array_equal(bits, want_bits), f"seed={seed} threads={threads}"
    assert len(want_word) > n_points, "the case should be a large search"
    assert split._per_request == len(word) / n_points


def test_circle_table_boundaries_counted():
    """The boundary case above puts users on radius boundaries: inside exactly at the radius, outside
    one float64 step beyond it (the radius one step below the distance)."""
    rng = np.random.default_rng(61)
    circles, lat, lon = _boundary_case(rng, 40, 60)
    table = np.zeros((1, 40), np.uint64)
    CircleLookup(circles).fill(lat, lon, 64, table)
    on_edge = outside_by_one_step = 0
    for q in range(40):
        r = 5 + (q % 55)
        d = haversine_km(lat[r], lon[r], circles[q, 0], circles[q, 1])
        bit = (int(table[0, q]) >> r) & 1
        if d == circles[q, 2]:
            assert bit == 1, f"seed 61: user {r} exactly on the edge of circle {q} is outside"
            on_edge += 1
        elif d == np.nextafter(circles[q, 2], np.inf):
            assert bit == 0, f"seed 61: user {r} one step outside circle {q} is inside"
            outside_by_one_step += 1
    assert on_edge >= 10 and outside_by_one_step >= 10


# --- the shipped kernel at the places that matter ----------------------------------------------------------


def test_shipped_kernel_equals_oracle_at_poles_antimeridian_and_edges():
    """v8 (shipped) and v7 against the oracle: custom locations at a pole, across the antimeridian and
    users 1 m inside and 1 m outside radius edges (the oracle's chord form and the indexes'
    haversine agree to about 1e-12 km, so 1 m decides the same way in both)."""
    from gpu.kernels import match as K

    assert K.SHIPPED == 8
    km = 1.0 / 111.19492664455873  # degrees of latitude per km on the sphere of DESIGN section 2
    places = [(89.95, 10.0, 20.0), (-89.99, -120.0, 5.0), (0.0, 179.99, 30.0), (45.0, -179.999, 12.0),
              (10.0, 20.0, 50.0)]
    specs = [{"ad_id": i, "targeting": {"geo_locations": {"custom_locations": [
        {"latitude": la, "longitude": lo, "radius": rad, "distance_unit": "kilometer"}]}}}
        for i, (la, lo, rad) in enumerate(places)]
    specs.append({"ad_id": 99, "targeting": {"geo_locations": {"countries": ["US"]}, "excluded_geo_locations": {
        "custom_locations": [{"latitude": 0.0, "longitude": -179.9, "radius": 40, "distance_unit": "kilometer"}]}}})
    ads = [parse_ad(o, seed=0, dim=4, formats=8) for o in specs]
    points = [(90.0, 0.0), (90.0, -170.0), (-90.0, 0.0), (0.0, -179.99), (0.0, 180.0), (45.0, 179.999),
              (float("nan"), float("nan"))]
    for la, lo, rad in places:  # 1 m inside and outside along the meridian, where the latitude allows it
        for delta in (rad - 0.001, rad + 0.001):
            for sign in (1, -1):
                if abs(la + sign * delta * km) <= 90:
                    points.append((la + sign * delta * km, lo))
    requests = []
    for i, (la, lo) in enumerate(points):
        user = {"age": 30, "country": "US"}
        if not math.isnan(la):
            user.update(latitude=la, longitude=lo)
        requests.append(parse_request({"request_id": i, "user": user, "context": {
            "publisher_platform": "facebook", "device_platform": "mobile", "user_os": "iOS", "time": 5}},
            seed=0, experts=6, width=16))
    expected = OracleIndex.build(ads).match(requests)
    inside = sum(int(a in e) for e in expected for a in range(5))
    assert 10 <= inside < len(requests) * 5, inside  # some users in circles, not all
    assert any(99 not in e.tolist() for e in expected) and any(99 in e.tolist() for e in expected)
    for version in (8, 7):
        index = GpuTargetingIndex.build(ads, version=version, chunk_slots=CHUNK)
        got = index.match(requests)
        for r, (e, g) in enumerate(zip(expected, got)):
            assert np.array_equal(e, g), f"version {version} request {r} at {points[r]}: want {e} got {g}"


def test_shipped_version_is_what_an_index_runs():
    from gpu.kernels import match as K
    from gpu.lab import match as lab

    assert GpuTargetingIndex(device=KERNEL_DEVICE).version == K.SHIPPED == lab.SHIPPED
    assert K.VERSIONS[K.SHIPPED].recipe.circle_table and lab.VERSIONS[K.SHIPPED] is K.VERSIONS[K.SHIPPED]
    assert not K.VERSIONS[K.SIMULATOR_FALLBACK].gpu_only


# --- the engine: batch i + 1 prepared while batch i runs -------------------------------------------------


class _CountingStream:
    """Stands in for the index's stream under the simulator (where streams do nothing): counts waits."""

    def __init__(self, log):
        self.log = log

    def synchronize(self):
        self.log.append("sync")

    def __bool__(self):
        return True


@pytest.mark.skipif(KERNEL_DEVICE == "gpu", reason="stands a counting object in for the index's stream, which only "
                    "the simulator's launches accept; on a device tests/gpu/test_graphs.py checks the same engine")
def test_engine_overlaps_preparation_and_synchronizes_once_per_batch(monkeypatch):
    import gpu.engine as engine_module
    from andromeda_nb.compare import compare_topk
    from andromeda_nb.dataset import Dataset
    from andromeda_nb.model import MoeModel, quantize
    from andromeda_nb.reference import ReferenceRetriever

    rng = np.random.default_rng(71)
    ads = [dataclasses.replace(a, format=a.format % 2) for a in random_ads(rng, 120, dim=16)]
    requests = random_requests(rng, 5)
    model = MoeModel.init(71, D=16, F=2)
    dataset = Dataset(ads=ads, embeddings=quantize(np.stack([a.embedding for a in ads]), "fp32"), requests=requests,
                      model=model, seed=0, precision="fp32")
    monkeypatch.setattr(engine_module, "MAX_BATCH", 2)  # 5 requests: batches of 2, 2, 1
    engine = engine_module.GpuEngine(dataset, device="sim")
    log: list[str] = []
    engine.index.stream = _CountingStream(log)
    pipe = engine.pipeline
    prepare, fetch, launch, tables = engine.index.prepare, pipe.fetch, pipe.launch, engine.tables
    split = pipe.launch_split
    monkeypatch.setattr(engine.index, "prepare", lambda *a, **kw: (log.append("prepare"), prepare(*a, **kw))[1])
    monkeypatch.setattr(pipe, "fetch", lambda *a, **kw: (log.append("fetch"), fetch(*a, **kw))[1])
    monkeypatch.setattr(pipe, "launch", lambda *a, **kw: (log.append("launch"), launch(*a, **kw))[1])
    monkeypatch.setattr(pipe, "launch_split", lambda *a, **kw: (log.append("split"), split(*a, **kw))[1])
    monkeypatch.setattr(engine, "tables", lambda *a, **kw: (log.append("user"), tables(*a, **kw))[1])
    answers = engine.retrieve(requests, 7)
    # the first batch's user side is computed after its match is enqueued (nothing ahead of it on the
    # device); each later batch is prepared whole (user side included) while the device runs the one before
    assert log == ["split", "prepare", "user", "user", "prepare", "fetch", "sync", "launch", "user", "prepare",
                   "fetch", "sync", "launch", "fetch", "sync"], log
    reference = ReferenceRetriever.build(dataset)
    assert sum(len(ids) for ids, _ in answers) > 0
    for request, (ids, scores) in zip(requests, answers):
        ref_ids, result = reference.score_eligible(request)
        cmp = compare_topk(ref_ids, result, ids, scores, 7)
        assert cmp.ok, f"seed 71 request {request.request_id}: {cmp.message}"
    # the same batches again and again: their plans are captured (a second sighting) and replayed, with
    # the same answers bit for bit
    for _ in range(2):
        again = engine.retrieve(requests, 7)
        for (ids, scores), (ids2, scores2) in zip(answers, again):
            assert np.array_equal(ids, ids2) and np.array_equal(scores, scores2)
    # (two staging buffers in turn, batches of 2, 2, 1, the first in two plans: each call meets 4 plans,
    # the third call the first call's again, each then captured; replays count each graph launch, the
    # first after its capture too)
    assert pipe.graphs.captures == 4 and pipe.graphs.replays == 4
