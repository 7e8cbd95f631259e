"""Parsing and validation of DESIGN section 2: every field, every limit, the exact error paths, and
the JSON round trips."""

import copy
import json
import math

import numpy as np
import pytest

from andromeda_nb.compiled import MAX_TERM_ID
from andromeda_nb.constants import KM_PER_MILE
from andromeda_nb.derive import ad_embedding, request_signals
from andromeda_nb.targeting import (
    ad_to_json,
    parse_ad,
    parse_context,
    parse_request,
    parse_targeting,
    parse_user,
    request_to_json,
    spec_to_json,
)
from andromeda_nb.testing import random_ads, random_requests
from andromeda_nb.types import TargetingError

GEO = {"countries": ["US"]}
AD_ID = 41


def spec(**fields):
    t = {"geo_locations": GEO}
    t.update(fields)
    return t


def reject(targeting) -> TargetingError:
    with pytest.raises(TargetingError) as info:
        parse_targeting(targeting, AD_ID)
    assert info.value.ad_id == AD_ID
    assert str(AD_ID) in str(info.value)
    return info.value


def circle(**over):
    c = {"latitude": 10.0, "longitude": 20.0, "radius": 5, "distance_unit": "kilometer"}
    c.update(over)
    return c


# --- accepted specs --------------------------------------------------------------------------------


def test_defaults_and_normalization():
    s = parse_targeting({"geo_locations": {"countries": ["US", "US", "GB"], "regions": [3, 3]}}, 1)
    assert (s.age_min, s.age_max) == (18, 65)
    assert s.genders is None and s.locales is None and s.flexible_spec == ()
    assert s.geo_locations.countries == frozenset({"US", "GB"})
    assert s.geo_locations.regions == frozenset({3})


def test_full_spec_parses():
    t = {
        "age_min": 13, "age_max": 65, "genders": [2, 1, 2],
        "geo_locations": {"countries": ["DE"], "regions": [0], "cities": [MAX_TERM_ID],
                          "custom_locations": [circle(radius=50, distance_unit="mile")]},
        "excluded_geo_locations": {"cities": [5]},
        "locales": [6], "publisher_platforms": ["instagram"], "device_platforms": ["connected_tv"],
        "user_os": ["other", "iOS"],
        "flexible_spec": [{"interests": [1, 2], "behaviors": [3]}, {"life_events": [4]}],
        "exclusions": {"work_positions": [9]},
        "custom_audiences": [7], "excluded_custom_audiences": [8],
    }
    s = parse_targeting(t, 1)
    assert s.genders == frozenset({1, 2})
    assert s.geo_locations.custom_locations[0].radius_km == pytest.approx(50 * KM_PER_MILE)
    assert s.flexible_spec[1] == {"life_events": frozenset({4})}
    assert s.exclusions == {"work_positions": frozenset({9})}
    assert s.user_os == frozenset({"other", "iOS"})


def test_custom_audiences_make_geo_optional():
    s = parse_targeting({"custom_audiences": [1]}, 1)
    assert s.geo_locations is None and s.custom_audiences == frozenset({1})


def test_limits_are_inclusive():
    parse_targeting(spec(flexible_spec=[{"interests": [1]}] * 25), 1)
    parse_targeting(spec(flexible_spec=[{"interests": list(range(600)), "behaviors": list(range(400))}]), 1)
    parse_targeting(spec(exclusions={"interests": list(range(1000)) + [0, 1]}), 1)  # duplicates: 1000 distinct
    parse_targeting({"geo_locations": {"custom_locations": [circle(radius=80), circle(radius=50, distance_unit="mile"),
                                                            circle(latitude=-90, longitude=180, radius=1e-9)]}}, 1)
    parse_targeting(spec(age_min=30, age_max=30), 1)


# --- rejected specs: the exact path of each kind of bad input ---------------------------------------


@pytest.mark.parametrize(
    "targeting, path, words",
    [
        ("not an object", "targeting", "object"),
        (spec(colour=["red"]), "targeting.colour", "unknown key"),
        (spec(age_min=True), "targeting.age_min", "bool"),
        (spec(age_min=18.0), "targeting.age_min", "float"),
        (spec(age_min="18"), "targeting.age_min", "string"),
        (spec(age_min=12), "targeting.age_min", "13..65"),
        (spec(age_max=66), "targeting.age_max", "13..65"),
        (spec(age_min=40, age_max=30), "targeting.age_min", "greater"),
        (spec(age_min=31, age_max=30), "targeting.age_min", "greater"),
        (spec(age_max=15), "targeting.age_max", "default age_min 18"),
        (spec(genders=[]), "targeting.genders", "empty"),
        (spec(genders=[1, 0]), "targeting.genders[1]", "not one of"),
        (spec(genders=[True]), "targeting.genders[0]", "bool"),
        (spec(genders=1), "targeting.genders", "list"),
        ({"age_min": 20}, "targeting.geo_locations", "required unless custom_audiences"),
        ({"geo_locations": {}}, "targeting.geo_locations", "empty object"),
        ({"geo_locations": None}, "targeting.geo_locations", "null"),
        ({"geo_locations": {"countries": []}}, "targeting.geo_locations.countries", "empty"),
        ({"geo_locations": {"countries": ["US", "us"]}}, "targeting.geo_locations.countries[1]", "ISO"),
        ({"geo_locations": {"countries": ["USA"]}}, "targeting.geo_locations.countries[0]", "ISO"),
        ({"geo_locations": {"countries": [840]}}, "targeting.geo_locations.countries[0]", "string"),
        ({"geo_locations": {"zips": ["10001"]}}, "targeting.geo_locations.zips", "unknown key"),
        ({"geo_locations": {"regions": [-1]}}, "targeting.geo_locations.regions[0]", "out of range"),
        ({"geo_locations": {"cities": [1, 2**40]}}, "targeting.geo_locations.cities[1]", "out of range"),
        ({"geo_locations": {"cities": [False]}}, "targeting.geo_locations.cities[0]", "bool"),
        ({"geo_locations": {"custom_locations": [circle(radius=0)]}},
         "targeting.geo_locations.custom_locations[0].radius", "> 0"),
        ({"geo_locations": {"custom_locations": [circle(radius=-3)]}},
         "targeting.geo_locations.custom_locations[0].radius", "> 0"),
        ({"geo_locations": {"custom_locations": [circle(), circle(radius=80.001)]}},
         "targeting.geo_locations.custom_locations[1].radius", "at most 80"),
        ({"geo_locations": {"custom_locations": [circle(radius=50.01, distance_unit="mile")]}},
         "targeting.geo_locations.custom_locations[0].radius", "at most 50"),
        ({"geo_locations": {"custom_locations": [circle(radius=float("nan"))]}},
         "targeting.geo_locations.custom_locations[0].radius", "finite"),
        ({"geo_locations": {"custom_locations": [circle(radius=True)]}},
         "targeting.geo_locations.custom_locations[0].radius", "bool"),
        ({"geo_locations": {"custom_locations": [circle(latitude=90.5)]}},
         "targeting.geo_locations.custom_locations[0].latitude", "out of range"),
        ({"geo_locations": {"custom_locations": [circle(longitude=-180.01)]}},
         "targeting.geo_locations.custom_locations[0].longitude", "out of range"),
        ({"geo_locations": {"custom_locations": [circle(latitude="10")]}},
         "targeting.geo_locations.custom_locations[0].latitude", "number"),
        ({"geo_locations": {"custom_locations": [circle(distance_unit="km")]}},
         "targeting.geo_locations.custom_locations[0].distance_unit", "not one of"),
        ({"geo_locations": {"custom_locations": [{"latitude": 1, "longitude": 2, "radius": 3}]}},
         "targeting.geo_locations.custom_locations[0].distance_unit", "required"),
        ({"geo_locations": {"custom_locations": [circle(name="home")]}},
         "targeting.geo_locations.custom_locations[0].name", "unknown key"),
        ({"geo_locations": {"custom_locations": []}}, "targeting.geo_locations.custom_locations", "empty"),
        (spec(excluded_geo_locations={}), "targeting.excluded_geo_locations", "empty object"),
        (spec(excluded_geo_locations={"countries": ["xx"]}), "targeting.excluded_geo_locations.countries[0]", "ISO"),
        (spec(locales=[]), "targeting.locales", "empty"),
        (spec(locales=[1, "2"]), "targeting.locales[1]", "int"),
        (spec(publisher_platforms=["facebook", "tiktok"]), "targeting.publisher_platforms[1]", "not one of"),
        (spec(device_platforms=[]), "targeting.device_platforms", "empty"),
        (spec(user_os=["ios"]), "targeting.user_os[0]", "not one of"),
        (spec(flexible_spec=[]), "targeting.flexible_spec", "empty"),
        (spec(flexible_spec={"interests": [1]}), "targeting.flexible_spec", "list"),
        (spec(flexible_spec=[{"interests": [1]}] * 26), "targeting.flexible_spec", "at most 25"),
        (spec(flexible_spec=[{"interests": [1]}, {}]), "targeting.flexible_spec[1]", "empty object"),
        (spec(flexible_spec=[{"interests": [1]}, {"hobbies": [1]}]), "targeting.flexible_spec[1].hobbies",
         "unknown key"),
        (spec(flexible_spec=[{"interests": []}]), "targeting.flexible_spec[0].interests", "empty"),
        (spec(flexible_spec=[{"interests": list(range(13)) + [-5]}]),
         "targeting.flexible_spec[0].interests[13]", "out of range"),
        (spec(flexible_spec=[{"behaviors": [1]}, {"interests": list(range(12)) + [1.5]}]),
         "targeting.flexible_spec[1].interests[12]", "float"),
        (spec(flexible_spec=[{"interests": list(range(600)), "behaviors": list(range(401))}]),
         "targeting.flexible_spec[0]", "at most 1000"),
        (spec(exclusions=[{"interests": [1]}]), "targeting.exclusions", "object"),
        (spec(exclusions={"interests": list(range(1001))}), "targeting.exclusions", "at most 1000"),
        (spec(exclusions={}), "targeting.exclusions", "empty object"),
        (spec(custom_audiences=[]), "targeting.custom_audiences", "empty"),
        (spec(excluded_custom_audiences=[3, None]), "targeting.excluded_custom_audiences[1]", "null"),
    ],
)
def test_rejected_with_path(targeting, path, words):
    err = reject(targeting)
    assert err.path == path, str(err)
    assert words in err.message, str(err)
    assert path in str(err)


def test_errors_do_not_depend_on_dict_order_for_the_first_bad_field():
    # a single bad field is named whatever else is in the object
    for extra in ({}, {"locales": [1]}, {"custom_audiences": [2]}):
        t = dict(extra, geo_locations=GEO, genders=[3])
        assert reject(t).path == "targeting.genders[0]"


# --- ads --------------------------------------------------------------------------------------------


def ad_line(**over):
    obj = {"ad_id": AD_ID, "targeting": spec()}
    obj.update(over)
    return obj


def test_ad_defaults_and_derived_embedding():
    ad = parse_ad(ad_line(), seed=5, dim=8)
    assert (ad.status, ad.start_time, ad.end_time, ad.format) == ("ACTIVE", None, None, 0)
    np.testing.assert_array_equal(ad.embedding, ad_embedding(AD_ID, 5, 8))
    assert ad.embedding.dtype == np.float32 and np.abs(ad.embedding).sum() > 0
    other = parse_ad(ad_line(), seed=6, dim=8)
    assert not np.array_equal(ad.embedding, other.embedding)


def test_ad_fields_parse():
    emb = [0.5, -1, 2.25, 1e-3]
    ad = parse_ad(ad_line(status="PAUSED", start_time=10, end_time=None, format=7, embedding=emb),
                  seed=0, dim=4, formats=8)
    assert (ad.status, ad.start_time, ad.end_time, ad.format) == ("PAUSED", 10, None, 7)
    np.testing.assert_array_equal(ad.embedding, np.asarray(emb, np.float32))


@pytest.mark.parametrize(
    "over, path, words",
    [
        ({"ad_id": True}, "ad_id", "bool"),
        ({"ad_id": -1}, "ad_id", "out of range"),
        ({"ad_id": "41"}, "ad_id", "int"),
        ({"status": "RUNNING"}, "status", "not one of"),
        ({"status": None}, "status", "string"),
        ({"start_time": 1.5}, "start_time", "float"),
        ({"end_time": "soon"}, "end_time", "string"),
        ({"end_time": 2**63}, "end_time", "out of range"),
        ({"format": 8}, "format", "0..7"),
        ({"format": -1}, "format", "0..7"),
        ({"format": False}, "format", "bool"),
        ({"embedding": [0.0, 1.0, 2.0]}, "embedding", "expected 4"),
        ({"embedding": [0.0, 1.0, float("inf"), 2.0]}, "embedding[2]", "finite"),
        ({"embedding": [0.0, 1.0, 2.0, 1e39]}, "embedding[3]", "out of range"),
        ({"embedding": [0.0, True, 2.0, 3.0]}, "embedding[1]", "bool"),
        ({"embedding": "0,1,2,3"}, "embedding", "list"),
        ({"bid": 3}, "bid", "unknown key"),
        ({"targeting": None}, "targeting", "object"),
        ({"targeting": spec(flexible_spec=[{"interests": [1]}, {"behaviors": [2, 3, "x"]}])},
         "targeting.flexible_spec[1].behaviors[2]", "string"),
    ],
)
def test_bad_ads(over, path, words):
    with pytest.raises(TargetingError) as info:
        parse_ad(ad_line(**over), seed=0, dim=4, formats=8, line=12)
    err = info.value
    assert err.path == path, str(err)
    assert words in err.message, str(err)
    assert err.line == 12 and "line 12" in str(err)
    if path != "ad_id":
        assert err.ad_id == AD_ID


def test_ad_missing_fields():
    with pytest.raises(TargetingError, match="ad_id: is required"):
        parse_ad({"targeting": spec()}, seed=0, dim=4)
    with pytest.raises(TargetingError) as info:
        parse_ad({"ad_id": 3}, seed=0, dim=4)
    assert info.value.path == "targeting" and info.value.ad_id == 3
    with pytest.raises(TargetingError, match="JSON object"):
        parse_ad([1, 2], seed=0, dim=4)


def test_formats_limit_is_the_given_one():
    parse_ad(ad_line(format=2), seed=0, dim=4, formats=3)
    with pytest.raises(TargetingError, match="0..2"):
        parse_ad(ad_line(format=3), seed=0, dim=4, formats=3)


def test_ad_json_round_trip():
    rng = np.random.default_rng(11)
    for ad in random_ads(rng, 60, dim=8):
        line = json.loads(json.dumps(ad_to_json(ad)))
        back = parse_ad(line, seed=99, dim=8)
        assert back == ad  # all compared fields, the parsed spec included
        assert back.targeting_json == ad.targeting_json
        np.testing.assert_array_equal(back.embedding, ad.embedding)


def test_spec_to_json_round_trip_including_mile_radii():
    rng = np.random.default_rng(12)
    specs = [a.targeting for a in random_ads(rng, 80, dim=4)]
    specs.append(parse_targeting({"geo_locations": {"custom_locations": [circle(radius=50, distance_unit="mile")]}}))
    for s in specs:
        back = parse_targeting(json.loads(json.dumps(spec_to_json(s))))
        for geo_name in ("geo_locations", "excluded_geo_locations"):
            g, h = getattr(s, geo_name), getattr(back, geo_name)
            if g is None:
                assert h is None
                continue
            assert len(g.custom_locations) == len(h.custom_locations)
            for c, d in zip(g.custom_locations, h.custom_locations):
                assert d.radius_km == pytest.approx(c.radius_km, rel=1e-15, abs=1e-12)
        s_no_circles = _without_radius(s)
        assert _without_radius(back) == s_no_circles


def _without_radius(s):
    import dataclasses

    def strip(g):
        if g is None:
            return None
        return dataclasses.replace(g, custom_locations=tuple((c.latitude, c.longitude) for c in g.custom_locations))

    return dataclasses.replace(s, geo_locations=strip(s.geo_locations),
                               excluded_geo_locations=strip(s.excluded_geo_locations))


def test_ad_without_targeting_json_exports_normalized_spec():
    import dataclasses

    ad = parse_ad(ad_line(targeting={"custom_audiences": [3, 1, 3]}), seed=0, dim=4)
    bare = dataclasses.replace(ad, targeting_json={})
    out = ad_to_json(bare)
    assert out["targeting"] == {"age_min": 18, "age_max": 65, "custom_audiences": [1, 3]}
    assert parse_ad(out, seed=0, dim=4) == ad


def test_input_object_is_not_aliased():
    line = ad_line()
    ad = parse_ad(line, seed=0, dim=4)
    line["targeting"]["geo_locations"]["countries"].append("FR")
    assert ad.targeting_json["geo_locations"]["countries"] == ["US"]


# --- users, contexts, requests ------------------------------------------------------------------------

CONTEXT = {"publisher_platform": "facebook", "device_platform": "mobile", "user_os": "Android", "time": 1000}


def req_line(user=..., context=..., **over):
    obj = {"request_id": 17, "user": {"age": 30} if user is ... else user,
           "context": dict(CONTEXT) if context is ... else context}
    obj.update(over)
    return obj


def test_user_defaults_and_no_location():
    u = parse_user({"age": 30})
    assert (u.gender, u.country, u.region, u.city, u.locale) == (0, "", -1, -1, -1)
    assert math.isnan(u.latitude) and math.isnan(u.longitude)
    assert u.id_set("interests") == frozenset()


def test_user_full():
    u = parse_user({"age": 65, "gender": 2, "country": "FR", "region": 4, "city": 9, "latitude": -45.5,
                    "longitude": 179, "locale": 3, "interests": [1, 1, 2], "custom_audiences": [], "income": [0]})
    assert (u.latitude, u.longitude) == (-45.5, 179.0)
    assert u.id_set("interests") == frozenset({1, 2}) and u.id_set("income") == frozenset({0})
    assert u.id_set("custom_audiences") == frozenset()


@pytest.mark.parametrize(
    "user, path, words",
    [
        ({}, "user.age", "required"),
        ({"age": "30"}, "user.age", "string"),
        ({"age": 30.0}, "user.age", "float"),
        ({"age": 121}, "user.age", "out of range"),
        ({"age": 30, "gender": 3}, "user.gender", "not one of"),
        ({"age": 30, "gender": True}, "user.gender", "bool"),
        ({"age": 30, "country": "usa"}, "user.country", "ISO"),
        ({"age": 30, "region": -2}, "user.region", "out of range"),
        ({"age": 30, "latitude": 10.0}, "user.longitude", "together"),
        ({"age": 30, "longitude": 10.0}, "user.latitude", "together"),
        ({"age": 30, "latitude": 91.0, "longitude": 0}, "user.latitude", "out of range"),
        ({"age": 30, "latitude": 0, "longitude": float("nan")}, "user.longitude", "finite"),
        ({"age": 30, "interests": [1, 2, "3"]}, "user.interests[2]", "string"),
        ({"age": 30, "custom_audiences": [-1]}, "user.custom_audiences[0]", "out of range"),
        ({"age": 30, "hobbies": [1]}, "user.hobbies", "unknown key"),
    ],
)
def test_bad_users(user, path, words):
    with pytest.raises(TargetingError) as info:
        parse_request(req_line(user=user), seed=0, experts=2, width=3)
    err = info.value
    assert err.ad_id is None and err.path == path, str(err)
    assert words in err.message and err.request_id == 17, str(err)
    assert str(err) == f"request 17: {path}: {err.message}", "the request first, then the path, as for ads"


@pytest.mark.parametrize(
    "context, path",
    [
        ({k: v for k, v in CONTEXT.items() if k != "time"}, "context.time"),
        (dict(CONTEXT, time=1.0), "context.time"),
        (dict(CONTEXT, publisher_platform="web"), "context.publisher_platform"),
        (dict(CONTEXT, device_platform=None), "context.device_platform"),
        (dict(CONTEXT, user_os="android"), "context.user_os"),
        (dict(CONTEXT, hour=3), "context.hour"),
    ],
)
def test_bad_contexts(context, path):
    with pytest.raises(TargetingError) as info:
        parse_request(req_line(context=context), seed=0, experts=2, width=3)
    assert info.value.path == path and "request 17" in str(info.value)


def test_parse_user_and_context_directly():
    with pytest.raises(TargetingError) as info:
        parse_user({"age": 30, "behaviors": [True]}, "u", request_id=5)
    assert info.value.path == "u.behaviors[0]" and str(info.value).startswith("request 5: u.behaviors[0]: ")


def test_ads_and_requests_are_named_in_one_order():
    """Line, then the ad or request, then the JSON path, then what is wrong, for both kinds."""
    with pytest.raises(TargetingError) as ad:
        parse_ad({"ad_id": 6, "status": "BOGUS", "targeting": {}}, seed=0, dim=4, line=5)
    with pytest.raises(TargetingError) as request:
        parse_request(req_line(user={"age": "x"}), seed=0, experts=2, width=3, line=3)
    assert str(ad.value).startswith("line 5: ad 6: status: "), str(ad.value)
    assert str(request.value).startswith("line 3: request 17: user.age: must be an int"), str(request.value)
    c = parse_context(CONTEXT)
    assert (c.publisher_platform, c.time) == ("facebook", 1000)


def test_request_signals_given_and_derived():
    r = parse_request(req_line(), seed=3, experts=2, width=3)
    np.testing.assert_array_equal(r.signals, request_signals(17, 3, 2, 3))
    sig = [[1, 2, 3.5], [-1, 0.25, 9]]
    r = parse_request(req_line(signals=sig), seed=3, experts=2, width=3)
    assert r.signals.dtype == np.float32 and r.signals.shape == (2, 3)
    np.testing.assert_array_equal(r.signals, np.asarray(sig, np.float32))
    # the whole-matrix path and the row-by-row path give the same float32 values
    from andromeda_nb.targeting import _plain_matrix

    rng = np.random.default_rng(8)
    many = (rng.standard_normal((6, 32)) * 10.0 ** rng.integers(-30, 30, (6, 32))).tolist()
    fast = _plain_matrix(many, 32)
    slow = np.stack([parse_request(req_line(signals=[row, row]), seed=3, experts=2, width=32).signals[0]
                     for row in many])
    assert fast is not None and fast.dtype == np.float32 and np.array_equal(fast, slow)
    assert _plain_matrix([[1, 2], [3, False]], 2) is None and _plain_matrix([[1, 2], [3]], 2) is None


@pytest.mark.parametrize(
    "over, path",
    [
        ({"signals": [[1, 2, 3]]}, "signals"),
        ({"signals": [[1, 2, 3], [1, 2]]}, "signals[1]"),
        ({"signals": [[1, 2, 3], [1, None, 3]]}, "signals[1][1]"),
        ({"signals": [[1, 2, 3], [1, float("nan"), 3]]}, "signals[1][1]"),
        ({"signals": [[1, 2, 3], [1, True, 3]]}, "signals[1][1]"),
        ({"signals": [[1, 2, 3], [1, 2, 1e39]]}, "signals[1][2]"),
        ({"signals": [[1, 2, 3], [1, 2, 10**400]]}, "signals[1][2]"),  # beyond float64: an error, not a crash
        ({"signals": [[1, 2, 3], (1, 2, 3)]}, None),  # a tuple row (not JSON): accepted by the row check
        ({"user": {"age": 30, "latitude": 10**400, "longitude": 1.0}}, "user.latitude"),
        ({"request_id": "17"}, "request_id"),
        ({"extra": 1}, "extra"),
        ({"user": None}, "user"),
    ],
)
def test_bad_requests(over, path):
    if path is None:
        parse_request(req_line(**over), seed=0, experts=2, width=3)
        return
    with pytest.raises(TargetingError) as info:
        parse_request(req_line(**over), seed=0, experts=2, width=3)
    assert info.value.path == path, str(info.value)


def test_request_id_passed_separately():
    obj = req_line()
    del obj["request_id"]
    r = parse_request(obj, seed=1, experts=2, width=3, request_id=5)
    assert r.request_id == 5
    with pytest.raises(TargetingError, match="required"):
        parse_request(obj, seed=1, experts=2, width=3)
    with pytest.raises(TargetingError, match="disagrees"):
        parse_request(req_line(), seed=1, experts=2, width=3, request_id=5)


def test_request_json_round_trip():
    rng = np.random.default_rng(13)
    reqs = random_requests(rng, 40, experts=3, width=4)
    assert any(math.isnan(r.user.latitude) for r in reqs) and any(not math.isnan(r.user.latitude) for r in reqs)
    for r in reqs:
        obj = json.loads(json.dumps(request_to_json(r)))
        back = parse_request(obj, seed=0, experts=3, width=4)
        assert back.request_id == r.request_id and back.context == r.context
        _same_user(back.user, r.user)
        np.testing.assert_array_equal(back.signals, r.signals)
        flight = request_to_json(r, with_id=False)
        assert "request_id" not in flight
        again = parse_request(copy.deepcopy(flight), seed=0, experts=3, width=4, request_id=r.request_id)
        _same_user(again.user, r.user)


def _same_user(a, b):
    for f in ("age", "gender", "country", "region", "city", "locale"):
        assert getattr(a, f) == getattr(b, f)
    for f in ("latitude", "longitude"):
        x, y = getattr(a, f), getattr(b, f)
        assert (math.isnan(x) and math.isnan(y)) or x == y
    assert dict(a.ids) == dict(b.ids)


def test_embedding_forms_and_deferred_derivation():
    ad = parse_ad(ad_line(), seed=5, dim=8, derive_embedding=False)
    assert ad.embedding is None
    arr = np.linspace(-1, 1, 4)
    for form in (arr, arr.astype(np.float32), arr.tolist(), [int(x) for x in (1, 0, -1, 2)]):
        emb = parse_ad(ad_line(embedding=form), seed=0, dim=4).embedding
        np.testing.assert_array_equal(emb, np.asarray(form, np.float32))
    with pytest.raises(TargetingError) as info:
        parse_ad(ad_line(embedding=np.array([0.0, np.nan, 1.0, 2.0])), seed=0, dim=4)
    assert info.value.path == "embedding[1]"


def test_signals_travel_as_shortest_float32_text_and_read_back_exactly():
    import json

    import numpy as np

    from andromeda_nb.targeting import float32_json, parse_request, request_to_json
    from andromeda_nb.testing import random_requests

    rng = np.random.default_rng(21)
    values = np.concatenate([rng.standard_normal(20000).astype(np.float32),
                             np.float32([0.0, -0.0, 1e-38, 3.4e38, -1.5e-7])])
    assert np.array_equal(np.asarray(float32_json(values), np.float32), values)
    for request in random_requests(rng, 20):
        obj = request_to_json(request)
        text = json.dumps(obj["signals"])
        back = parse_request(json.loads(json.dumps(obj)), seed=0, experts=request.signals.shape[0],
                             width=request.signals.shape[1])
        assert np.array_equal(back.signals, request.signals)
        # the float64 expansion of a float32 needs ~17 significant digits; the shortest form ~9
        assert len(text) < 0.75 * len(json.dumps(request.signals.astype(np.float64).tolist()))
