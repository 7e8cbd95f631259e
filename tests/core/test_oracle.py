"""The oracle against DESIGN section 2's table, row by row with its edges, plus monotonicity
properties (hypothesis) and the OracleIndex interface."""

import copy
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from andromeda_nb.constants import KM_PER_MILE
from andromeda_nb.geo import haversine_km
from andromeda_nb.oracle import OracleIndex, eligible, great_circle_km
from andromeda_nb.targeting import parse_ad, parse_request
from andromeda_nb.testing import random_ads, random_requests, request_lists, targeting_jsons
from andromeda_nb.types import Retire, SetStatus, Upsert

T = 1_000_000
CTX = {"publisher_platform": "instagram", "device_platform": "mobile", "user_os": "iOS", "time": T}
USER = {"age": 30, "gender": 1, "country": "US", "region": 5, "city": 50, "latitude": 40.0, "longitude": -74.0,
        "locale": 2, "interests": [7], "behaviors": [3], "custom_audiences": [11]}
GEO = {"countries": ["US"]}
PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def ad(targeting=None, **fields):
    obj = {"ad_id": fields.pop("ad_id", 1), "targeting": {"geo_locations": GEO} if targeting is None else targeting}
    obj.update(fields)
    return parse_ad(obj, seed=0, dim=4)


def req(context=None, **user):
    u = dict(USER)
    for k, v in user.items():
        if v is None:
            u.pop(k, None)
        else:
            u[k] = v
    return parse_request({"request_id": 1, "user": u, "context": dict(CTX, **(context or {}))},
                         seed=0, experts=2, width=2)


def ok(targeting, request=None, **fields) -> bool:
    return eligible(ad(targeting, **fields), request or req())


def geo(**g):
    return {"geo_locations": g}


def test_baseline_is_eligible():
    assert ok(None)


# --- ad-level fields ----------------------------------------------------------------------------------


@pytest.mark.parametrize("status, expected", [("ACTIVE", True), ("PAUSED", False), ("ARCHIVED", False),
                                              ("DELETED", False)])
def test_status(status, expected):
    assert ok(None, status=status) is expected


@pytest.mark.parametrize(
    "start, end, expected",
    [(None, None, True), (T, None, True), (T + 1, None, False), (None, T + 1, True), (None, T, False),
     (T, T + 1, True), (T - 5, T, False), (T + 1, T - 1, False)],
)
def test_schedule_start_inclusive_end_exclusive(start, end, expected):
    assert ok(None, start_time=start, end_time=end) is expected


# --- age and gender ----------------------------------------------------------------------------------


@pytest.mark.parametrize("age, expected", [(17, False), (18, True), (13, False), (64, True), (65, True), (99, True)])
def test_age_min_defaults_to_18_and_age_max_to_65_and_older(age, expected):
    assert ok(geo(countries=["US"]), req(age=age)) is expected


@pytest.mark.parametrize("age, expected", [(12, False), (13, True), (40, True), (41, False)])
def test_age_range(age, expected):
    assert ok({"geo_locations": GEO, "age_min": 13, "age_max": 40}, req(age=age)) is expected


@pytest.mark.parametrize("age, expected", [(63, True), (64, True), (65, False), (80, False)])
def test_age_max_64_is_an_upper_bound(age, expected):
    assert ok({"geo_locations": GEO, "age_max": 64}, req(age=age)) is expected


@pytest.mark.parametrize("age", [65, 66, 120])
def test_age_max_65_means_65_and_older(age):
    assert ok({"geo_locations": GEO, "age_min": 65, "age_max": 65}, req(age=age))
    assert not ok({"geo_locations": GEO, "age_min": 65, "age_max": 65}, req(age=64))


@pytest.mark.parametrize(
    "genders, user_gender, expected",
    [(None, 0, True), (None, 1, True), (None, 2, True), ([1], 0, False), ([1], 1, True), ([1], 2, False),
     ([2], 2, True), ([1, 2], 0, False), ([1, 2], 2, True)],
)
def test_genders(genders, user_gender, expected):
    t = {"geo_locations": GEO}
    if genders is not None:
        t["genders"] = genders
    assert ok(t, req(gender=user_gender)) is expected


# --- geo ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "g, user, expected",
    [
        ({"countries": ["GB", "US"]}, {}, True),
        ({"countries": ["GB"]}, {}, False),
        ({"countries": ["GB"]}, {"country": None}, False),
        ({"regions": [5]}, {}, True),
        ({"regions": [50]}, {}, False),  # user city 50 is not region 50: ids match within their key
        ({"cities": [50]}, {}, True),
        ({"cities": [5]}, {"city": None}, False),
        ({"countries": ["GB"], "regions": [4], "cities": [50]}, {}, True),  # OR across geo keys
        ({"countries": ["GB"], "regions": [4], "cities": [51]}, {}, False),
        ({"regions": [5]}, {"region": None}, False),
    ],
)
def test_geo_locations(g, user, expected):
    assert ok(geo(**g), req(**user)) is expected


def test_excluded_geo_beats_included():
    t = {"geo_locations": {"countries": ["US"]}, "excluded_geo_locations": {"cities": [50]}}
    assert not ok(t)
    assert ok(t, req(city=51))
    t = {"geo_locations": {"regions": [5]}, "excluded_geo_locations": {"regions": [5]}}
    assert not ok(t)
    circle = {"latitude": 40.0, "longitude": -74.0, "radius": 1, "distance_unit": "kilometer"}
    t = {"geo_locations": {"countries": ["US"]}, "excluded_geo_locations": {"custom_locations": [circle]}}
    assert not ok(t)
    assert ok(t, req(latitude=41.0))


def _north_of(lat: float, km: float) -> float:
    """Latitude `km` due north along a meridian (exact on the sphere: arc length = R * angle)."""
    return lat + math.degrees(km / 6371.0088)


@pytest.mark.parametrize("unit, radius", [("kilometer", 25.0), ("mile", 12.5), ("kilometer", 80.0), ("mile", 50.0)])
def test_custom_location_edges(unit, radius):
    r_km = radius * (KM_PER_MILE if unit == "mile" else 1.0)
    loc = {"latitude": 10.0, "longitude": 20.0, "radius": radius, "distance_unit": unit}
    t = geo(custom_locations=[loc])
    for margin, expected in ((-1e-4, True), (1e-4, False), (-0.5, True), (0.5, False)):
        lat = _north_of(10.0, r_km + margin)
        assert abs(haversine_km(lat, 20.0, 10.0, 20.0) - (r_km + margin)) < 1e-8  # the construction holds
        assert ok(t, req(country="GB", region=None, city=None, latitude=lat, longitude=20.0)) is expected


def test_custom_location_boundary_is_inclusive():
    # the radius is set to the oracle's own distance for this point: exactly on the boundary
    rng = np.random.default_rng(21)
    for _ in range(50):
        lat0, lon0 = rng.uniform(-80, 80), rng.uniform(-180, 180)
        lat, lon = lat0 + rng.uniform(-0.3, 0.3), float(np.clip(lon0 + rng.uniform(-0.3, 0.3), -180, 180))
        d = great_circle_km(lat, lon, lat0, lon0)
        assume_ok = 0 < d <= 80
        if not assume_ok:
            continue
        user = req(country="GB", region=None, city=None, latitude=lat, longitude=lon)
        on = geo(custom_locations=[{"latitude": lat0, "longitude": lon0, "radius": d, "distance_unit": "kilometer"}])
        assert ok(on, user)
        below = np.nextafter(d, 0.0)
        off = geo(custom_locations=[{"latitude": lat0, "longitude": lon0, "radius": below,
                                     "distance_unit": "kilometer"}])
        assert not ok(off, user)


def test_miles_are_converted():
    loc = {"latitude": 0.0, "longitude": 0.0, "radius": 10, "distance_unit": "mile"}  # 16.09344 km
    user_at = lambda km: req(country="GB", latitude=_north_of(0.0, km), longitude=0.0)  # noqa: E731
    assert ok(geo(custom_locations=[loc]), user_at(16.0))
    assert not ok(geo(custom_locations=[loc]), user_at(16.2))
    assert not ok(geo(custom_locations=[dict(loc, distance_unit="kilometer")]), user_at(16.0))


def test_custom_location_across_the_antimeridian():
    loc = {"latitude": 0.0, "longitude": 179.95, "radius": 20, "distance_unit": "kilometer"}
    assert ok(geo(custom_locations=[loc]), req(country="GB", latitude=0.0, longitude=-179.95))  # ~11 km away


def test_user_without_location_is_in_no_circle():
    loc = {"latitude": 0.0, "longitude": 0.0, "radius": 80, "distance_unit": "kilometer"}
    nowhere = req(country="GB", latitude=None, longitude=None)
    assert math.isnan(nowhere.user.latitude)
    assert not ok(geo(custom_locations=[loc]), nowhere)
    assert ok(geo(custom_locations=[loc]), req(country="GB", latitude=0.0, longitude=0.0))
    # and is not excluded by one either
    assert ok({"geo_locations": {"countries": ["GB"]}, "excluded_geo_locations": {"custom_locations": [loc]}}, nowhere)


def test_circle_or_country():
    far = {"latitude": -40.0, "longitude": 100.0, "radius": 5, "distance_unit": "kilometer"}
    assert ok(geo(countries=["US"], custom_locations=[far]))
    assert not ok(geo(countries=["GB"], custom_locations=[far]))


# --- locales, placements ------------------------------------------------------------------------------


@pytest.mark.parametrize("locales, user, expected", [([2], {}, True), ([1, 3], {}, False), ([2], {"locale": None}, False)])
def test_locales(locales, user, expected):
    assert ok({"geo_locations": GEO, "locales": locales}, req(**user)) is expected


@pytest.mark.parametrize(
    "key, values, expected",
    [
        ("publisher_platforms", ["instagram"], True),
        ("publisher_platforms", ["facebook", "messenger", "audience_network"], False),
        ("device_platforms", ["mobile", "desktop"], True),
        ("device_platforms", ["connected_tv"], False),
        ("user_os", ["iOS"], True),
        ("user_os", ["Android", "other"], False),
    ],
)
def test_placements(key, values, expected):
    assert ok({"geo_locations": GEO, key: values}) is expected


# --- flexible_spec, exclusions, custom audiences -------------------------------------------------------


@pytest.mark.parametrize(
    "flex, expected",
    [
        ([{"interests": [7]}], True),
        ([{"interests": [1, 2, 7]}], True),
        ([{"interests": [3]}], False),  # the user holds behavior 3, not interest 3
        ([{"interests": [1], "behaviors": [3]}], True),  # OR within an object
        ([{"interests": [7]}, {"behaviors": [3]}], True),  # AND across objects
        ([{"interests": [7]}, {"behaviors": [4]}], False),
        ([{"interests": [7]}, {"life_events": [7]}], False),
        ([{"interests": [7]}] * 25, True),
    ],
)
def test_flexible_spec_and_of_or(flex, expected):
    assert ok({"geo_locations": GEO, "flexible_spec": flex}) is expected


@pytest.mark.parametrize(
    "exclusions, expected",
    [({"interests": [7]}, False), ({"interests": [1], "behaviors": [3]}, False), ({"interests": [3]}, True),
     ({"behaviors": [7]}, True), ({"work_positions": [7]}, True)],
)
def test_exclusions(exclusions, expected):
    assert ok({"geo_locations": GEO, "exclusions": exclusions}) is expected


def test_flexible_and_exclusion_together():
    t = {"geo_locations": GEO, "flexible_spec": [{"interests": [7]}], "exclusions": {"behaviors": [3]}}
    assert not ok(t)
    assert ok(t, req(behaviors=[]))


@pytest.mark.parametrize(
    "aud, excl, user_aud, expected",
    [([11], None, [11], True), ([10, 11], None, [11], True), ([10], None, [11], False), ([10], None, [], False),
     (None, [11], [11], False), (None, [10], [11], True), ([11], [11], [11], False), ([11], [12], [11, 12], False)],
)
def test_custom_audiences(aud, excl, user_aud, expected):
    t = {"geo_locations": GEO}
    if aud is not None:
        t["custom_audiences"] = aud
    if excl is not None:
        t["excluded_custom_audiences"] = excl
    assert ok(t, req(custom_audiences=user_aud)) is expected


def test_custom_audiences_without_geo_match_everywhere():
    t = {"custom_audiences": [11]}
    assert ok(t, req(country="BR", region=None, city=None, latitude=None, longitude=None))
    assert not ok(t, req(custom_audiences=[]))


def test_all_constraints_are_anded():
    t = {"age_min": 25, "age_max": 35, "genders": [1], "geo_locations": GEO, "locales": [2],
         "publisher_platforms": ["instagram"], "device_platforms": ["mobile"], "user_os": ["iOS"],
         "flexible_spec": [{"interests": [7]}], "custom_audiences": [11]}
    assert ok(t)
    for broken in ({"age": 36}, {"gender": 2}, {"country": "GB"}, {"locale": 1}, {"interests": [8]},
                   {"custom_audiences": [12]}):
        assert not ok(t, req(**broken)), broken
    for ctx in ({"publisher_platform": "facebook"}, {"device_platform": "desktop"}, {"user_os": "Linux"}):
        assert not ok(t, req(context=ctx)), ctx


# --- OracleIndex ----------------------------------------------------------------------------------------


def test_oracle_index_matches_brute_force_and_applies_updates():
    rng = np.random.default_rng(31)
    ads = random_ads(rng, 300, dim=4)
    reqs = random_requests(rng, 25, experts=2, width=2)
    index = OracleIndex.build(ads)
    assert len(index) == 300
    got = index.match(reqs)
    total = 0
    for r, ids in zip(reqs, got):
        assert ids.dtype == np.int64 and np.all(np.diff(ids) > 0)
        expect = sorted(a.ad_id for a in ads if eligible(a, r))
        assert ids.tolist() == expect
        total += len(expect)
    assert total > 25  # the data makes matches common
    # a status change, a retirement and a replacement
    live = [a for a in ads if a.status == "ACTIVE"]
    index.apply(SetStatus(live[0].ad_id, "PAUSED"))
    index.apply(Retire(live[1].ad_id))
    index.apply(Upsert(ad(None, ad_id=live[2].ad_id, status="DELETED")))
    assert len(index) == 299
    gone = {live[0].ad_id, live[1].ad_id, live[2].ad_id}
    for r, before, after in zip(reqs, got, index.match(reqs)):
        assert set(after.tolist()) == set(before.tolist()) - gone


def test_oracle_index_rejects_duplicate_ids():
    with pytest.raises(ValueError, match="duplicate ad id 1"):
        OracleIndex.build([ad(None), ad(None)])


# --- properties ------------------------------------------------------------------------------------------


def _eligible_ids(targeting, reqs):
    a = parse_ad({"ad_id": 1, "targeting": targeting}, seed=0, dim=4)
    return {r.request_id for r in reqs if eligible(a, r)}


def _id_objects():
    keys = st.sampled_from(["interests", "behaviors", "life_events", "income"])
    return st.dictionaries(keys, st.lists(st.integers(0, 7), min_size=1, max_size=3), min_size=1, max_size=2)


@PROPS
@given(targeting_jsons(), request_lists(4, 10, experts=2, width=2), _id_objects())
def test_adding_an_exclusion_never_grows(t, reqs, extra):
    before = _eligible_ids(t, reqs)
    widened = copy.deepcopy(t)
    excl = widened.setdefault("exclusions", {})
    for key, ids in extra.items():
        excl[key] = excl.get(key, []) + ids
    assert _eligible_ids(widened, reqs) <= before
    more = copy.deepcopy(t)
    more["excluded_custom_audiences"] = more.get("excluded_custom_audiences", []) + extra.get("interests", [0])
    assert _eligible_ids(more, reqs) <= before


@PROPS
@given(targeting_jsons(), request_lists(4, 10, experts=2, width=2), _id_objects())
def test_adding_a_flexible_object_never_grows(t, reqs, obj):
    before = _eligible_ids(t, reqs)
    t2 = copy.deepcopy(t)
    t2["flexible_spec"] = t2.get("flexible_spec", []) + [obj]
    after = _eligible_ids(t2, reqs)
    assert after <= before
    # and it removes exactly the users holding none of its ids
    holders = {r.request_id for r in reqs if any(r.user.id_set(k) & set(v) for k, v in obj.items())}
    assert after == before & holders


@PROPS
@given(targeting_jsons(), request_lists(4, 10, experts=2, width=2), st.integers(0, 20), st.integers(0, 20))
def test_widening_the_age_range_never_shrinks(t, reqs, lower, raise_):
    before = _eligible_ids(t, reqs)
    t2 = copy.deepcopy(t)
    t2["age_min"] = max(13, t.get("age_min", 18) - lower)
    t2["age_max"] = min(65, t.get("age_max", 65) + raise_)
    assert _eligible_ids(t2, reqs) >= before


@PROPS
@given(targeting_jsons(), request_lists(4, 10, experts=2, width=2))
def test_excluding_the_included_geo_empties_the_geo_matches(t, reqs):
    if "geo_locations" not in t:
        return
    t2 = copy.deepcopy(t)
    t2["excluded_geo_locations"] = copy.deepcopy(t["geo_locations"])
    assert _eligible_ids(t2, reqs) == set()


def test_parallel_oracle_equals_the_streamed_one(tmp_path, monkeypatch):
    """`match_corpus` in two processes, one Parquet row group per task, gives what `match_stream`
    and `OracleIndex` give, with an update stream applied (creates, replacements, status changes,
    retirements)."""
    from andromeda_nb import store
    from andromeda_nb.corpus import generate_corpus
    from andromeda_nb.oracle import match_corpus, match_stream
    from andromeda_nb.testing import random_updates
    from andromeda_nb.updates import LiveAds, apply_updates

    monkeypatch.setattr(store, "ROW_GROUP_ADS", 300)
    generate_corpus(tmp_path / "c", n_ads=1500, n_requests=6, seed=3)
    dataset = store.load_dataset(tmp_path / "c")
    assert dataset._ads_loader.n_groups() == 5
    rng = np.random.default_rng(3)
    ads = list(dataset.ad_chunks())
    flat = [a for chunk in ads for a in chunk]
    updates = random_updates(rng, flat, 200, dim=dataset.model.D, formats=dataset.model.F)
    oracle = OracleIndex.build(flat)
    assert not apply_updates(updates, [oracle], LiveAds(a.ad_id for a in flat))
    requests = dataset.requests
    want = oracle.match(requests)
    streamed = match_stream(dataset.ad_chunks(), requests, updates)
    parallel = match_corpus(dataset, requests, updates, workers=2)
    assert sum(len(w) for w in want) > 0
    for w, s, p in zip(want, streamed, parallel):
        assert w.tolist() == s.tolist() == p.tolist()
