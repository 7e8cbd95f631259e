"""The compiled targeting form: its layout, and `eligible_compiled` (the formula every index
implements) equal to the oracle on random corpora."""

import math

import numpy as np
from hypothesis import HealthCheck, given, settings

from andromeda_nb.compiled import (
    AGE_UNBOUNDED,
    NS_CUSTOM_AUDIENCE,
    NS_FLEX,
    NULL_END,
    NULL_START,
    compile_ads,
    country_code,
    eligible_compiled,
    encode_request,
    term,
)
from andromeda_nb.oracle import eligible
from andromeda_nb.targeting import parse_ad, parse_request
from andromeda_nb.testing import ad_lists, random_ads, random_requests, request_lists


def _ad(ad_id, targeting, **fields):
    return parse_ad(dict({"ad_id": ad_id, "targeting": targeting}, **fields), seed=0, dim=4)


def test_layout_of_one_spec():
    ad = _ad(9, {
        "age_max": 65, "genders": [2],
        "geo_locations": {"countries": ["US"], "custom_locations": [
            {"latitude": 1.0, "longitude": 2.0, "radius": 10, "distance_unit": "mile"}]},
        "flexible_spec": [{"interests": [7, 7, 3]}, {"behaviors": [7]}],
        "exclusions": {"interests": [5]}, "excluded_custom_audiences": [4],
        "publisher_platforms": ["instagram", "messenger"],
    }, start_time=100)
    ct = compile_ads([ad])
    assert ct.ad_id.tolist() == [9]
    assert ct.age_min[0] == 18 and ct.age_max[0] == AGE_UNBOUNDED
    assert ct.gender_mask[0] == 0b100
    assert ct.publisher_mask[0] == 0b1010 and ct.device_mask[0] == 0b111 and ct.os_mask[0] == 0b111111
    assert ct.start_time[0] == 100 and ct.end_time[0] == NULL_END
    assert ct.n_positive[0] == 3 and ct.clause_ptr.tolist() == [0, 4]
    assert ct.clause_negative.tolist() == [0, 0, 0, 1]
    clauses = [ct.terms[ct.term_ptr[j]:ct.term_ptr[j + 1]].tolist() for j in range(4)]
    assert clauses[0] == [term(0, country_code("US"))]
    assert clauses[1] == [term(NS_FLEX["interests"], 3), term(NS_FLEX["interests"], 7)]
    assert clauses[2] == [term(NS_FLEX["behaviors"], 7)]  # behavior 7 is not interest 7
    assert clauses[3] == sorted([term(NS_FLEX["interests"], 5), term(NS_CUSTOM_AUDIENCE, 4)])
    assert ct.circle_ptr.tolist() == [0, 1, 1, 1, 1]
    np.testing.assert_allclose(ct.circles[0], [1.0, 2.0, 16.09344])
    assert len(ct) == 1 and ct.nbytes > 0


def test_excluded_geo_locations_bring_their_circles_to_the_negative_clause():
    circle = {"latitude": 10.0, "longitude": 20.0, "radius": 5, "distance_unit": "kilometer"}
    ad = _ad(4, {"geo_locations": {"countries": ["US"]},
                 "excluded_geo_locations": {"regions": [8], "custom_locations": [circle]}})
    ct = compile_ads([ad])
    assert ct.clause_negative.tolist() == [0, 1] and ct.circle_ptr.tolist() == [0, 0, 1]
    np.testing.assert_allclose(ct.circles[0], [10.0, 20.0, 5.0])
    # a user inside the excluded circle is refused, one outside it is not, as the oracle says
    for lat, want in ((10.01, False), (10.5, True)):
        req = parse_request({"request_id": 1, "user": {"age": 30, "country": "US", "latitude": lat, "longitude": 20.0},
                             "context": {"publisher_platform": "facebook", "device_platform": "mobile",
                                         "user_os": "iOS", "time": 5}}, seed=0, experts=1, width=1)
        assert eligible(ad, req) is want
        assert eligible_compiled(ct, 0, encode_request(req)) is want


def test_open_schedule_and_empty_corpus():
    ct = compile_ads([_ad(1, {"custom_audiences": [1]})])
    assert ct.start_time[0] == NULL_START and ct.end_time[0] == NULL_END
    assert ct.n_positive[0] == 1 and ct.clause_negative.tolist() == [0]
    empty = compile_ads([])
    assert len(empty) == 0 and empty.circles.shape == (0, 3) and empty.clause_ptr.tolist() == [0]


def test_encode_request():
    r = parse_request({"request_id": 1, "user": {"age": 40, "country": "BR", "region": 3, "interests": [2, 9],
                                                   "behaviors": [2], "custom_audiences": [6]},
                       "context": {"publisher_platform": "messenger", "device_platform": "desktop",
                                   "user_os": "other", "time": 5}}, seed=0, experts=1, width=1)
    enc = encode_request(r)
    assert enc.terms.tolist() == sorted([term(0, country_code("BR")), term(1, 3), term(NS_FLEX["interests"], 2),
                                         term(NS_FLEX["interests"], 9), term(NS_FLEX["behaviors"], 2),
                                         term(NS_CUSTOM_AUDIENCE, 6)])
    assert (enc.publisher, enc.device, enc.os, enc.time, enc.age) == (3, 1, 5, 5, 40)
    assert math.isnan(enc.latitude)


def _check_equal(ads, reqs):
    ct = compile_ads(ads)
    hits = 0
    for r in reqs:
        enc = encode_request(r)
        for i, ad in enumerate(ads):
            expect = eligible(ad, r)
            got = eligible_compiled(ct, i, enc)
            assert got == expect, f"ad {ad.ad_id} request {r.request_id}: compiled {got}, oracle {expect}"
            hits += expect
    return hits


def test_compiled_equals_oracle_seeded():
    seed = 41
    rng = np.random.default_rng(seed)
    ads = random_ads(rng, 400, dim=4)
    reqs = random_requests(rng, 30, experts=2, width=2)
    hits = _check_equal(ads, reqs)
    assert hits > 100, f"seed {seed}: too few matches ({hits}) to be a useful check"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ad_lists(1, 12, dim=4), request_lists(1, 6, experts=2, width=2))
def test_compiled_equals_oracle_property(ads, reqs):
    _check_equal(ads, reqs)


def test_has_duplicates_agrees_with_unique():
    """`has_duplicates` (one sort) says what comparing np.unique's length says, on random ids."""
    from andromeda_nb.compiled import has_duplicates

    rng = np.random.default_rng(29)
    for n, high in ((1000, 10 ** 6), (1000, 2000), (2, 5), (1, 3), (0, 1)):
        ids = rng.integers(1, high, n).astype(np.int64)
        assert has_duplicates(ids) == (len(np.unique(ids)) != n), f"seed=29 n={n} high={high}"
