"""The corpus generator: determinism, realistic shapes, geo consistency, eligible fraction in range,
and the derived embeddings / signals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from andromeda_nb import corpus, derive
from andromeda_nb.constants import DEFAULT_F, FLEX_KEYS, STATUSES
from andromeda_nb.oracle import in_custom_location
from andromeda_nb.targeting import parse_ad, parse_request

SEED = 11
N_ADS = 3000
N_REQUESTS = 40


@pytest.fixture(scope="module")
def ad_objects():
    return [a for chunk in corpus.iter_ads(N_ADS, SEED) for a in chunk.ad_objects()]


@pytest.fixture(scope="module")
def request_objects():
    return corpus.make_requests(N_REQUESTS, SEED)


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_same_seed_gives_identical_files(tmp_path):
    a = corpus.generate_corpus(tmp_path / "a", 700, 9, SEED, precision="int8")
    b = corpus.generate_corpus(tmp_path / "b", 700, 9, SEED, precision="int8", workers=2)
    files_a, files_b = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert set(files_a) == {"meta.json", "ads.parquet", "targeting.npz", "requests.parquet", "model.npz"}
    assert files_a == files_b, f"seed {SEED}: two runs wrote different files"
    assert a.sample_ads == b.sample_ads
    corpus.generate_corpus(tmp_path / "c", 700, 9, SEED + 1, precision="int8")
    files_c = _files(tmp_path / "c")
    assert files_c["ads.parquet"] != files_a["ads.parquet"]
    assert files_c["requests.parquet"] != files_a["requests.parquet"]


def test_chunks_and_workers_do_not_change_the_ads():
    one = list(corpus.iter_ads(1300, SEED, chunk=400, workers=1))
    two = list(corpus.iter_ads(1300, SEED, chunk=400, workers=2))
    assert [len(c) for c in one] == [400, 400, 400, 100]
    for x, y in zip(one, two):
        assert np.array_equal(x.ad_id, y.ad_id)
        assert x.targeting == y.targeting and x.status == y.status
        assert np.array_equal(x.embedding, y.embedding)
    ids = np.concatenate([c.ad_id for c in one])
    assert np.all(np.diff(ids) > 0), "ad ids must be unique and increasing"
    assert np.any(np.diff(ids) > 1), "ids have gaps, so nothing may assume id == row"


def test_every_generated_ad_and_request_is_valid(ad_objects, request_objects):
    ads = [parse_ad(a, seed=SEED, dim=64) for a in ad_objects]
    reqs = [parse_request(r, seed=SEED, experts=6, width=16) for r in request_objects]
    assert len(ads) == N_ADS and len(reqs) == N_REQUESTS
    # the embedding in the row is derive.ad_embedding of (id, seed)
    for a in ads[:20]:
        assert np.array_equal(a.embedding, derive.ad_embedding(a.ad_id, SEED, 64))
    for r in reqs[:5]:
        assert np.array_equal(r.signals, derive.request_signals(r.request_id, SEED, 6, 16))


def test_ad_shapes(ad_objects):
    statuses = {s: sum(a["status"] == s for a in ad_objects) / N_ADS for s in STATUSES}
    assert 0.8 < statuses["ACTIVE"] < 0.92 and all(statuses[s] > 0 for s in STATUSES), statuses
    formats = np.array([a["format"] for a in ad_objects])
    assert set(formats.tolist()) == set(range(DEFAULT_F))
    assert np.bincount(formats)[0] > np.bincount(formats)[-1], "formats are skewed towards 0"
    t = [a["targeting"] for a in ad_objects]
    geo = [x.get("geo_locations", {}) for x in t]
    share = lambda pred: sum(map(pred, t)) / N_ADS  # noqa: E731
    assert 0.01 < sum("custom_locations" in g for g in geo) / N_ADS < 0.06
    assert sum("regions" in g for g in geo) and sum("cities" in g for g in geo)
    assert 0.01 < share(lambda x: "geo_locations" not in x) < 0.06  # audience-only ads
    assert all("custom_audiences" in x for x in t if "geo_locations" not in x)
    assert 0.03 < share(lambda x: "exclusions" in x) < 0.15
    assert 0.02 < share(lambda x: "excluded_geo_locations" in x) < 0.08
    assert 0.05 < share(lambda x: "custom_audiences" in x) < 0.2
    n_flex = np.array([len(x.get("flexible_spec", ())) for x in t])
    assert n_flex.max() >= 4 and 0.5 < np.mean(n_flex == 1) < 0.7 and np.mean(n_flex == 0) > 0.05
    keys = {k for x in t for obj in x.get("flexible_spec", ()) for k in obj}
    assert keys == set(FLEX_KEYS)
    times = [(a["start_time"], a["end_time"]) for a in ad_objects]
    assert any(s is not None and s > corpus.NOW for s, _ in times), "some ads start in the future"
    assert any(e is not None and e <= corpus.NOW for _, e in times), "some ads have ended"
    assert all(s is None or e is None or s < e for s, e in times)


def test_id_popularity_is_zipf_like_and_vocabularies_overlap(ad_objects, request_objects):
    interests = [i for a in ad_objects for o in a["targeting"].get("flexible_spec", ())
                 for i in o.get("interests", ())]
    counts = np.sort(np.unique(interests, return_counts=True)[1])[::-1]
    assert len(counts) > 2000, "ads reach deep into the 20,000 interests"
    assert counts[0] > 20 * np.median(counts), "a few interests are far more popular than the median"
    user_interests = {i for r in request_objects for i in r["user"].get("interests", ())}
    user_behaviors = {i for r in request_objects for i in r["user"].get("behaviors", ())}
    assert user_interests & user_behaviors, "interest and behavior ids overlap, so namespaces matter"
    assert max(user_interests) <= corpus.VOCABULARY["interests"]
    audiences = {i for r in request_objects for i in r["user"].get("custom_audiences", ())}
    assert min(audiences) > 10**9  # audience ids look like a real system's long ids


def test_users_are_consistent_with_the_geo_world(request_objects):
    world = corpus.build_world(SEED)
    assert len(world.countries) >= 55
    assert len(set(world.region_id.tolist())) == len(world.region_id), "region ids are globally unique"
    assert len(set(world.city_id.tolist())) == len(world.city_id), "city ids are globally unique"
    region_index = {int(r): i for i, r in enumerate(world.region_id)}
    city_index = {int(c): i for i, c in enumerate(world.city_id)}
    for r in request_objects:
        u = r["user"]
        ci = city_index[u["city"]]
        ri = region_index[u["region"]]
        assert world.city_region[ci] == ri, f"request {r['request_id']}: city outside its region"
        assert world.countries[world.region_country[ri]] == u["country"]
        # the user's point is near the city's coordinates
        assert in_custom_location(parse_request(r, seed=SEED, experts=6, width=16).user,
                                  float(world.city_lat[ci]), float(world.city_lon[ci]), 80.0)


def test_users_are_sometimes_inside_custom_locations(ad_objects, request_objects):
    ads = [parse_ad(a, seed=SEED, dim=64) for a in ad_objects if "custom_locations" in
           a["targeting"].get("geo_locations", {})]
    users = [parse_request(r, seed=SEED, experts=6, width=16).user for r in request_objects]
    circles = [c for a in ads for c in a.targeting.geo_locations.custom_locations]
    inside = sum(in_custom_location(u, c.latitude, c.longitude, c.radius_km) for u in users for c in circles)
    assert 0 < inside < len(users) * len(circles) * 0.05
    units = {loc["distance_unit"] for a in ad_objects
             for loc in a["targeting"].get("geo_locations", {}).get("custom_locations", ())}
    assert units == {"kilometer", "mile"}


def test_eligible_fraction_is_in_range(ad_objects, request_objects):
    fractions = corpus.eligible_fractions(ad_objects, request_objects, SEED)
    q = np.percentile(fractions, [10, 50, 90])
    detail = f"seed {SEED}, {N_ADS} ads x {N_REQUESTS} requests: p10/median/p90 = {q}"
    assert 0.02 <= q[1] <= 0.10, detail
    assert np.mean((fractions >= 0.01) & (fractions <= 0.20)) >= 0.8, detail
    assert fractions.max() <= 0.25, detail


def test_derived_values_are_stable_and_bulk_equals_single():
    e = derive.ad_embeddings([5, 1_000_001, -3], 42, 64)
    assert e.dtype == np.float32 and e.shape == (3, 64)
    assert np.array_equal(e[1], derive.ad_embedding(1_000_001, 42, 64))
    assert not np.array_equal(e[0], derive.ad_embedding(5, 43, 64))
    # pinned values: a change here changes every derived embedding of every imported corpus
    assert derive.ad_embedding(5, 42, 4).tolist() == [
        0.23414771258831024, -0.0579720064997673, 0.9727060794830322, -0.08718926459550858]
    assert derive.request_signals(3, 1, 1, 3).tolist() == [
        [-0.7664673924446106, -0.8886486291885376, 0.020878909155726433]]
    big = derive.ad_embeddings(np.arange(20_000), 1, 64)
    assert abs(big.mean()) < 1e-3 and abs(big.std() * 8 - 1) < 0.01
    s = derive.request_signals_many([1, 2], 3, 6, 16)
    assert s.shape == (2, 6, 16) and np.array_equal(s[1], derive.request_signals(2, 3, 6, 16))
