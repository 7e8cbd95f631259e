"""Random valid ads, requests and update streams (the tests' data and `generate --updates`): seeded numpy generators and hypothesis
strategies, both drawing from one description of "a plausible spec" (so they cover the same cases).

Vocabularies are small on purpose (5 countries, a handful of regions, cities, locales and ids per
key, four custom-location centres, one near the antimeridian and one near a pole) so that a random
request matches a fair share of random ads and every clause kind is exercised both ways. About one
user in ten has no known location (NaN coordinates). Every ad goes through `targeting.parse_ad`, so
`Ad.targeting_json` is the object the spec came from.

Seeded:      random_ads(rng, n), random_requests(rng, m), random_updates(rng, ads, n)
Hypothesis:  targeting_jsons(), specs(), ads(), ad_lists(), requests(), request_lists(),
             ads_and_updates()
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any, Sequence

import numpy as np

from .constants import (
    AGE_HIGHEST,
    AGE_LOWEST,
    AGE_MIN_DEFAULT,
    DATA_EPOCH as T0,
    DEFAULT_D,
    DEFAULT_E,
    DEFAULT_F,
    DEVICE_PLATFORMS,
    FLEX_KEYS,
    PUBLISHER_PLATFORMS,
    SECONDS_PER_DAY as DAY,
    SIGNAL_WIDTH,
    STATUSES,
    USER_OS,
)
from .targeting import parse_ad, parse_request
from .types import Ad, Request, Retire, SetStatus, Upsert, Update

COUNTRIES = ("US", "GB", "DE", "FR", "BR")
N_REGIONS = 8
N_CITIES = 12
N_LOCALES = 5
N_IDS = 8  # ids per flexible key and custom audiences: 0..N_IDS-1
COMMON_FLEX_KEYS = FLEX_KEYS[:3]  # most objects use these, so overlaps with users are frequent
CENTRES = ((40.7, -74.0), (51.5, -0.1), (-33.9, 151.2), (10.0, 179.8), (89.6, 20.0))



# --- one generator, two sources of randomness -------------------------------------------------------


class _RngSource:
    """Random choices from a numpy Generator."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def coin(self, p: float) -> bool:
        return bool(self.rng.random() < p)

    def int(self, lo: int, hi: int) -> int:  # inclusive
        return int(self.rng.integers(lo, hi + 1))

    def float(self, lo: float, hi: float) -> float:
        return float(self.rng.uniform(lo, hi))

    def pick(self, seq: Sequence):
        return seq[int(self.rng.integers(len(seq)))]

    def sample(self, seq: Sequence, lo: int, hi: int) -> list:
        k = min(self.int(lo, hi), len(seq))
        return [seq[i] for i in sorted(self.rng.choice(len(seq), k, replace=False))]


class _DrawSource:
    """The same choices drawn through hypothesis (so failures shrink)."""

    def __init__(self, draw):
        from hypothesis import strategies as st

        self.draw = draw
        self.st = st

    def coin(self, p: float) -> bool:
        return self.draw(self.st.integers(0, 99)) < round(p * 100)

    def int(self, lo: int, hi: int) -> int:
        return self.draw(self.st.integers(lo, hi))

    def float(self, lo: float, hi: float) -> float:
        return self.draw(self.st.floats(lo, hi, allow_nan=False, allow_infinity=False))

    def pick(self, seq: Sequence):
        return seq[self.draw(self.st.integers(0, len(seq) - 1))]

    def sample(self, seq: Sequence, lo: int, hi: int) -> list:
        k = min(self.int(lo, hi), len(seq))
        pool = list(range(len(seq)))
        idx = [pool.pop(self.int(0, len(pool) - 1)) for _ in range(k)]
        return [seq[i] for i in sorted(idx)]


def _ids(src, lo: int = 1, hi: int = 3, n: int = N_IDS) -> list[int]:
    return src.sample(range(n), lo, hi)


def _point(src) -> tuple[float, float]:
    lat0, lon0 = src.pick(CENTRES)
    lat = min(90.0, max(-90.0, lat0 + src.float(-0.6, 0.6)))
    lon = lon0 + src.float(-0.8, 0.8)
    lon = (lon + 180.0) % 360.0 - 180.0
    return lat, lon


def _custom_location(src) -> dict:
    lat, lon = _point(src)
    if src.coin(0.7):
        return {"latitude": lat, "longitude": lon, "radius": src.float(5.0, 80.0),
                "distance_unit": "kilometer"}
    return {"latitude": lat, "longitude": lon, "radius": src.float(3.0, 50.0), "distance_unit": "mile"}


def _geo(src) -> dict:
    geo: dict[str, Any] = {}
    while not geo:
        if src.coin(0.6):
            geo["countries"] = src.sample(COUNTRIES, 2, 4)
        if src.coin(0.3):
            geo["regions"] = _ids(src, 1, 3, N_REGIONS)
        if src.coin(0.3):
            geo["cities"] = _ids(src, 1, 3, N_CITIES)
        if src.coin(0.35):
            geo["custom_locations"] = [_custom_location(src) for _ in range(src.int(1, 2))]
    return geo


def _id_object(src) -> dict:
    keys = src.sample(COMMON_FLEX_KEYS, 1, 2) if src.coin(0.85) else src.sample(FLEX_KEYS, 1, 2)
    return {key: _ids(src) for key in keys}


def _targeting(src) -> dict:
    t: dict[str, Any] = {}
    if src.coin(0.4):
        t["age_min"] = src.int(AGE_LOWEST, 40)
    if src.coin(0.4):
        t["age_max"] = src.int(max(t.get("age_min", AGE_MIN_DEFAULT), 20), AGE_HIGHEST)
    if src.coin(0.3):
        t["genders"] = src.sample((1, 2), 1, 2)
    audiences = src.coin(0.2)
    if not audiences or src.coin(0.5):
        t["geo_locations"] = _geo(src)
    if src.coin(0.15):
        t["excluded_geo_locations"] = _geo(src)
    if src.coin(0.2):
        t["locales"] = _ids(src, 1, 3, N_LOCALES)
    for key, universe in (("publisher_platforms", PUBLISHER_PLATFORMS),
                          ("device_platforms", DEVICE_PLATFORMS), ("user_os", USER_OS)):
        if src.coin(0.25):
            t[key] = src.sample(universe, 1, len(universe) - 1)
    if src.coin(0.4):
        n_objects = src.int(1, 2) if src.coin(0.9) else src.int(3, 4)
        t["flexible_spec"] = [_id_object(src) for _ in range(n_objects)]
    if src.coin(0.2):
        t["exclusions"] = _id_object(src)
    if audiences:
        t["custom_audiences"] = _ids(src, 1, 3)
    if src.coin(0.15):
        t["excluded_custom_audiences"] = _ids(src, 1, 2)
    return t


def _ad_json(src, ad_id: int, formats: int) -> dict:
    obj: dict[str, Any] = {"ad_id": ad_id, "targeting": _targeting(src)}
    if src.coin(0.15):
        obj["status"] = src.pick(STATUSES[1:])
    if src.coin(0.25):
        obj["start_time"] = T0 + src.int(-3, 3) * DAY
    if src.coin(0.25):
        obj["end_time"] = T0 + src.int(-2, 4) * DAY
    obj["format"] = src.int(0, formats - 1)
    return obj


def _user(src) -> dict:
    u: dict[str, Any] = {"age": src.int(AGE_LOWEST, 70) if src.coin(0.9) else src.pick((0, 12, 80, 120))}
    u["gender"] = src.int(0, 2)
    if src.coin(0.9):
        u["country"] = src.pick(COUNTRIES)
    if src.coin(0.9):
        u["region"] = src.int(0, N_REGIONS - 1)
    if src.coin(0.9):
        u["city"] = src.int(0, N_CITIES - 1)
    if src.coin(0.9):
        u["latitude"], u["longitude"] = _point(src)
    if src.coin(0.9):
        u["locale"] = src.int(0, N_LOCALES - 1)
    for key in COMMON_FLEX_KEYS:
        u[key] = _ids(src, 0, 4)
    for key in FLEX_KEYS[3:]:
        if src.coin(0.3):
            u[key] = _ids(src, 1, 2)
    u["custom_audiences"] = _ids(src, 0, 2)
    return u


def _request_json(src, request_id: int) -> dict:
    return {
        "request_id": request_id,
        "user": _user(src),
        "context": {
            "publisher_platform": src.pick(PUBLISHER_PLATFORMS),
            "device_platform": src.pick(DEVICE_PLATFORMS),
            "user_os": src.pick(USER_OS),
            "time": T0 + src.int(-4 * DAY, 5 * DAY),
        },
    }


# --- seeded numpy generators --------------------------------------------------------------------------


def random_ad_json(rng: np.random.Generator, ad_id: int, *, formats: int = DEFAULT_F) -> dict:
    """One valid ad line (no embedding)."""
    return _ad_json(_RngSource(rng), ad_id, formats)


def random_request_json(rng: np.random.Generator, request_id: int) -> dict:
    """One valid request line (no signals)."""
    return _request_json(_RngSource(rng), request_id)


def random_ads(rng: np.random.Generator, n: int, *, dim: int = DEFAULT_D, formats: int = DEFAULT_F,
               ids: Sequence[int] | None = None) -> list[Ad]:
    """`n` valid ads with distinct, sparse, shuffled ids (or the `ids` given) and random float32
    embeddings ~ N(0, 1/dim)."""
    if ids is None:
        ids = rng.choice(max(10 * n, 16), n, replace=False)
    emb = (rng.standard_normal((n, dim)) / np.sqrt(dim)).astype(np.float32)
    src = _RngSource(rng)
    return [
        dataclasses.replace(parse_ad(_ad_json(src, int(i), formats), seed=0, dim=dim, formats=formats,
                                     derive_embedding=False), embedding=e)
        for i, e in zip(ids, emb)
    ]


def random_requests(rng: np.random.Generator, m: int, *, experts: int = DEFAULT_E, width: int = SIGNAL_WIDTH,
                    start_id: int = 0) -> list[Request]:
    """`m` valid requests with ids start_id.. and random float32 N(0, 1) signals (experts, width)."""
    src = _RngSource(rng)
    out = []
    for r in range(start_id, start_id + m):
        obj = _request_json(src, r)
        obj["signals"] = rng.standard_normal((experts, width)).tolist()
        out.append(parse_request(obj, seed=0, experts=experts, width=width))
    return out


def _updates(src, live_ids, n: int, invalid: float, make_ad) -> list[Update]:
    # `live` is kept sorted as it changes (a draw picks from the live ids in ascending order), rather
    # than sorted again for every update: at 10M ads that sort was most of `generate --updates`' time
    live = sorted({int(i) for i in live_ids})
    retired: set[int] = set()
    next_id = (live[-1] if live else -1) + 1
    out: list[Update] = []
    for _ in range(n):
        if invalid and src.coin(invalid):  # a status/retire for an id that is not live
            ghost = src.pick(sorted(retired)) if retired and src.coin(0.5) else next_id + 1000
            out.append(SetStatus(ghost, src.pick(STATUSES)) if src.coin(0.5) else Retire(ghost))
            continue
        op = src.int(0, 9)
        if op < 3 or not live:  # create (sometimes bringing a retired id back)
            if retired and src.coin(0.3):
                ad_id = src.pick(sorted(retired))
                retired.discard(ad_id)
            else:
                ad_id, next_id = next_id, next_id + 1
            bisect.insort(live, ad_id)  # never live already: a new id or a retired one
            out.append(Upsert(make_ad(ad_id)))
        elif op < 5:  # replace every field of a live ad
            out.append(Upsert(make_ad(src.pick(live))))
        elif op < 8:
            out.append(SetStatus(src.pick(live), src.pick(STATUSES)))
        else:
            ad_id = src.pick(live)
            del live[bisect.bisect_left(live, ad_id)]
            retired.add(ad_id)
            out.append(Retire(ad_id))
    return out


def random_updates(rng: np.random.Generator, ads: Sequence[Ad], n: int, *, invalid: float = 0.0,
                   dim: int = DEFAULT_D, formats: int = DEFAULT_F) -> list[Update]:
    """`n` updates against the live set `ads`, in order: creates, replacements, status changes,
    retirements, re-creations of retired ids; with `invalid` > 0 that fraction are status/retire
    updates for ids that are not live (a checked stream must reject them)."""
    return _random_updates(rng, (a.ad_id for a in ads), n, invalid, dim, formats)


def random_update_stream(seed: int, ad_ids, n: int, *, dim: int = DEFAULT_D,
                         formats: int = DEFAULT_F) -> list[Update]:
    """`n` seeded, valid updates against a corpus holding `ad_ids`: the stream of `generate --updates`."""
    return _random_updates(np.random.default_rng([seed, 0x5EED0DA7]), ad_ids, n, 0.0, dim, formats)


def _random_updates(rng, live_ids, n: int, invalid: float, dim: int, formats: int) -> list[Update]:
    src = _RngSource(rng)

    def make_ad(ad_id: int) -> Ad:
        ad = parse_ad(_ad_json(src, ad_id, formats), seed=0, dim=dim, formats=formats, derive_embedding=False)
        return dataclasses.replace(ad, embedding=(rng.standard_normal(dim) / np.sqrt(dim)).astype(np.float32))

    return _updates(src, live_ids, n, invalid, make_ad)


# --- deep specs: many positive clauses, all satisfied or all but one ------------------------------------

DEEP_AUDIENCE_BASE = 1 << 34  # custom audience ids of realistic size: 35 bits
MAX_POSITIVE_CLAUSES = 28  # geo, locales, 25 flexible_spec objects, custom audiences


def deep_spec_pair(rng: np.random.Generator, n_positive: int, *, ad_id: int, fail_id: int,
                   formats: int = DEFAULT_F) -> tuple[dict, dict, dict]:
    """(user object, ad line, twin ad line): the ad's targeting compiles to exactly `n_positive`
    positive clauses (1..28; geo first, then locales, flexible_spec objects and custom audiences,
    as `compiled.spec_clauses` orders them) and the user satisfies every one; the twin (id `fail_id`)
    is the same ad with one clause, drawn at random, that the user does not satisfy. Ids are drawn
    at random up to 2**40 (custom audiences around 2**35); the geo clause is a country, a region
    or a custom location around the user."""
    if not 1 <= n_positive <= MAX_POSITIVE_CLAUSES:
        raise ValueError(f"n_positive must be 1..{MAX_POSITIVE_CLAUSES}, got {n_positive}")
    extra = n_positive - 1  # clauses after geo (geo: always, so the spec is valid without audiences)
    locales = extra > 25 or (extra > 0 and rng.random() < 0.5)
    audiences = extra - locales > 25 or (extra - locales > 0 and rng.random() < 0.5)
    n_flex = extra - locales - audiences
    lat, lon = float(rng.uniform(-60, 60)), float(rng.uniform(-179, 179))
    user: dict[str, Any] = {"age": int(rng.integers(18, 60)), "gender": int(rng.integers(0, 3)),
                            "country": "US", "region": int(rng.integers(1, 1 << 40)),
                            "city": 7, "latitude": lat, "longitude": lon,
                            "locale": int(rng.integers(1, 1 << 40))}
    geo_kind = int(rng.integers(3))
    held_geo = [{"countries": ["US"]}, {"regions": [user["region"]]},
                {"custom_locations": [{"latitude": lat, "longitude": lon, "radius": 10.0,
                                       "distance_unit": "kilometer"}]}][geo_kind]
    missed_geo = [{"countries": ["GB"]}, {"regions": [user["region"] + 1]},
                  {"custom_locations": [{"latitude": -lat, "longitude": lon, "radius": 10.0,
                                         "distance_unit": "kilometer"}]}][geo_kind]
    clauses: list[tuple[str, Any, Any]] = [("geo_locations", held_geo, missed_geo)]
    if locales:
        clauses.append(("locales", [user["locale"], user["locale"] + 5], [user["locale"] + 1]))
    flex_objects, missed_objects = [], []
    for _ in range(n_flex):
        key = FLEX_KEYS[int(rng.integers(len(FLEX_KEYS)))]
        ident = int(rng.integers(1, 1 << 40))
        user.setdefault(key, []).append(ident)
        flex_objects.append({key: [ident]})
        missed_objects.append({key: [ident ^ 1 if ident ^ 1 not in user[key] else ident + 2]})
    audience = DEEP_AUDIENCE_BASE + int(rng.integers(1 << 34))
    if audiences:
        user["custom_audiences"] = [audience]
    targeting: dict[str, Any] = {name: held for name, held, _ in clauses}
    if n_flex:
        targeting["flexible_spec"] = flex_objects
    if audiences:
        targeting["custom_audiences"] = [audience, audience + 3]
    twin = {key: (list(v) if isinstance(v, list) else v) for key, v in targeting.items()}
    failing = int(rng.integers(n_positive))
    if failing == 0:
        twin["geo_locations"] = missed_geo
    elif locales and failing == 1:
        twin["locales"] = clauses[1][2]
    elif failing < 1 + locales + n_flex:
        j = failing - 1 - locales
        twin["flexible_spec"] = [missed_objects[j] if i == j else o for i, o in enumerate(flex_objects)]
    else:
        twin["custom_audiences"] = [audience + 1]
    for key in FLEX_KEYS:  # one id per object, drawn from 2**40: a repeat is possible, harmless
        if key in user:
            user[key] = sorted(set(user[key]))
    fmt = int(rng.integers(formats))
    ad = {"ad_id": ad_id, "format": fmt, "targeting": targeting}
    return user, ad, {"ad_id": fail_id, "format": fmt, "targeting": twin}


# --- hypothesis strategies ----------------------------------------------------------------------------


def _st():
    from hypothesis import strategies as st

    return st


def targeting_jsons():
    """Valid targeting objects (JSON-ready dicts)."""
    st = _st()
    return st.composite(lambda draw: _targeting(_DrawSource(draw)))()


def specs():
    """Valid, parsed `TargetingSpec`s."""
    from .targeting import parse_targeting

    return targeting_jsons().map(parse_targeting)


def _ad_from(src, ad_id: int, dim: int, formats: int) -> Ad:
    ad = parse_ad(_ad_json(src, ad_id, formats), seed=0, dim=dim, formats=formats)
    return ad


def ads(ad_id: int = 0, *, dim: int = 8, formats: int = DEFAULT_F):
    """One valid `Ad` with the given id (embedding derived from the id, seed 0)."""
    st = _st()
    return st.composite(lambda draw: _ad_from(_DrawSource(draw), ad_id, dim, formats))()


def _seeded_ad(ad_id: int, seed: int, dim: int, formats: int) -> Ad:
    return _ad_from(_RngSource(np.random.default_rng(seed)), ad_id, dim, formats)


def ad_lists(min_size: int = 0, max_size: int = 12, *, dim: int = 8, formats: int = DEFAULT_F):
    """Lists of valid ads with distinct ids. For speed each ad comes from its own drawn seed (two
    draws per ad instead of dozens): shrinking drops ads and lowers ids and seeds."""
    st = _st()
    seeds = st.integers(0, 2**32 - 1)

    def build(draw):
        pairs = draw(st.lists(st.tuples(st.integers(0, 200), seeds), min_size=min_size, max_size=max_size,
                              unique_by=lambda p: p[0]))
        return [_seeded_ad(i, seed, dim, formats) for i, seed in pairs]

    return st.composite(build)()


def requests(request_id: int = 0, *, experts: int = DEFAULT_E, width: int = SIGNAL_WIDTH):
    """One valid `Request` (signals derived from the id, seed 0)."""
    st = _st()
    return st.composite(
        lambda draw: parse_request(_request_json(_DrawSource(draw), request_id), seed=0, experts=experts,
                                   width=width)
    )()


def request_lists(min_size: int = 1, max_size: int = 6, *, experts: int = DEFAULT_E,
                  width: int = SIGNAL_WIDTH):
    """Lists of valid requests with ids 0..n-1, each from its own drawn seed (as `ad_lists`)."""
    st = _st()

    def build(draw):
        seeds = draw(st.lists(st.integers(0, 2**32 - 1), min_size=min_size, max_size=max_size))
        return [
            parse_request(_request_json(_RngSource(np.random.default_rng(seed)), r), seed=0, experts=experts,
                          width=width)
            for r, seed in enumerate(seeds)
        ]

    return st.composite(build)()


def ads_and_updates(max_ads: int = 10, max_updates: int = 15, *, invalid: float = 0.0, dim: int = 8,
                    formats: int = DEFAULT_F):
    """(initial ads, update list) pairs; see `random_updates`. The sequence of operations is drawn
    step by step; each upserted ad comes from a drawn seed."""
    st = _st()

    def build(draw):
        src = _DrawSource(draw)
        initial = draw(ad_lists(0, max_ads, dim=dim, formats=formats))
        n = draw(st.integers(0, max_updates))
        make_ad = lambda i: _seeded_ad(i, draw(st.integers(0, 2**32 - 1)), dim, formats)  # noqa: E731
        return initial, _updates(src, (a.ad_id for a in initial), n, invalid, make_ad)

    return st.composite(build)()


__all__ = [
    "random_ads", "random_requests", "random_updates", "random_update_stream", "random_ad_json", "random_request_json",
    "targeting_jsons", "specs", "ads", "ad_lists", "requests", "request_lists",
    "ads_and_updates", "deep_spec_pair", "T0", "DAY",
]
