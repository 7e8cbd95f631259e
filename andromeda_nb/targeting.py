"""Parsing and validation of ads, targeting specs and requests (DESIGN section 2), and their JSON forms.

Every check of DESIGN section 2 lives here, once: the corpus loader, the update stream and both
services call these functions, so an ad is accepted or rejected the same way everywhere. A rejected
value raises `TargetingError(ad_id, path, message)` whose `path` is the JSON path of the offending
value (`targeting.flexible_spec[3].interests[12]`, `user.interests[2]`, `signals[1][4]`).

Decisions this module makes where DESIGN leaves room (each one stated, so every implementation
agrees):

* Types are strict: a JSON bool is not an int, `18.0` is not an int, `null` is accepted only where
  DESIGN says so (`start_time`, `end_time`). Numbers (latitude, radius, embedding, signals) accept
  ints and floats but never bools, NaN or infinities.
* `distance_unit` is **required** in every custom location (no default): a radius of 30 means very
  different things in miles and kilometres, so the spec must say which.
* `age_min` defaults to 18 and `age_max` to 65 *before* the `age_min > age_max` check: a spec with
  only `age_max: 15` is rejected (it could never match anyone).
* Duplicate ids in a list are allowed and deduplicated. The 1000-id limit of a flexible_spec object
  (and of `exclusions`) counts its distinct ids across all its keys.
* Empty objects are rejected like empty lists: `geo_locations: {}`, a flexible_spec object `{}`,
  `exclusions: {}`.
* Ids (regions, cities, locales, flexible ids, custom audiences) are ints in 0..2**40-1
  (`compiled.MAX_TERM_ID`). Ad ids are ints in 0..2**63-1. Times are ints with
  |t| <= 2**62 (unix seconds; far from the int64 sentinels the compiled form uses for "open").
* A user's `latitude` and `longitude` are optional but come together; a user without them has an
  unknown location, stored as NaN, and lies inside no custom location. Absent `country` is "" and
  absent `region` / `city` / `locale` are -1: such a user matches no country / region / city / locale
  list. A user's id lists may be empty. `age` is required, an int in 0..120; `gender` defaults to 0.
* Every context field is required.
"""

from __future__ import annotations

import math
import re
from itertools import chain
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import derive
from .quoting import clip, quote
from .compiled import MAX_TERM_ID
from .constants import (
    AGE_HIGHEST,
    AGE_LOWEST,
    AGE_MAX_DEFAULT,
    AGE_MIN_DEFAULT,
    DEFAULT_F,
    DEVICE_PLATFORMS,
    DISTANCE_UNITS,
    FLEX_KEYS,
    GENDERS,
    GEO_KEYS,
    KM_PER_MILE,
    MAX_FLEXIBLE_SPEC_OBJECTS,
    MAX_IDS_PER_OBJECT,
    MAX_RADIUS_KM,
    MAX_RADIUS_MILES,
    PUBLISHER_PLATFORMS,
    STATUSES,
    USER_GENDERS,
    USER_ID_KEYS,
    USER_OS,
)
from .types import Ad, Context, CustomLocation, GeoSpec, Request, TargetingError, TargetingSpec, User

TARGETING_KEYS = (
    "age_min",
    "age_max",
    "genders",
    "geo_locations",
    "excluded_geo_locations",
    "locales",
    "publisher_platforms",
    "device_platforms",
    "user_os",
    "flexible_spec",
    "exclusions",
    "custom_audiences",
    "excluded_custom_audiences",
)
AD_KEYS = ("ad_id", "status", "start_time", "end_time", "format", "targeting", "embedding")
REQUEST_KEYS = ("request_id", "user", "context", "signals")
USER_KEYS = ("age", "gender", "country", "region", "city", "latitude", "longitude", "locale") + USER_ID_KEYS
CONTEXT_KEYS = ("publisher_platform", "device_platform", "user_os", "time")
CUSTOM_LOCATION_KEYS = ("latitude", "longitude", "radius", "distance_unit")

MAX_AD_ID = (1 << 63) - 1
MAX_ABS_TIME = 1 << 62
USER_AGE_RANGE = (0, 120)
NO_LOCATION = math.nan
_ISO2 = re.compile(r"[A-Z]{2}")
_F32_MAX = float(np.finfo(np.float32).max)
# every ISO-3166 alpha-2 shaped code: a list of valid countries is a subset (the fast path of `country`)
_ISO2_CODES = frozenset(chr(a) + chr(b) for a in range(65, 91) for b in range(65, 91))
_INT_ONLY = {int}
_STR_ONLY = {str}


# --- the checker: one place that builds every error -------------------------------------------------


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, (bool, np.bool_)):
        return "bool"
    if isinstance(v, (int, np.integer)):
        return "int"
    if isinstance(v, (float, np.floating)):
        return "float"
    if isinstance(v, str):
        return "string"
    if isinstance(v, (list, tuple, np.ndarray)):
        return "list"
    if isinstance(v, Mapping):
        return "object"
    return type(v).__name__


def _is_int(v: Any) -> bool:
    if type(v) is int:  # the common case, first
        return True
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _copy_json(v: Any) -> Any:
    """A deep copy of a JSON-shaped value (dicts, lists, scalars); much faster than copy.deepcopy."""
    t = type(v)
    if t is list:
        if set(map(type, v)) <= _JSON_SCALARS:  # a list of numbers or strings: one C-level copy
            return v.copy()
        return [x if type(x) in _JSON_SCALARS else _copy_json(x) for x in v]
    if t is dict or isinstance(v, Mapping):
        return {k: x if type(x) in _JSON_SCALARS else _copy_json(x) for k, x in v.items()}
    if isinstance(v, tuple):
        return [x if type(x) in _JSON_SCALARS else _copy_json(x) for x in v]
    return v


_JSON_SCALARS = frozenset({int, float, str, bool, type(None)})


def _is_number(v: Any) -> bool:
    return _is_int(v) or (isinstance(v, (float, np.floating)) and not isinstance(v, (bool, np.bool_)))


class _Checker:
    """Type and range checks that raise `TargetingError` naming the ad (or request) and the path."""

    def __init__(self, ad_id=None, line: int | None = None, request_id=None):
        self.ad_id = ad_id
        self.line = line
        self.request_id = request_id

    def fail(self, path: str, message: str):
        path = clip(path)  # a path holds keys from the input (an unknown key names itself)
        raise TargetingError(self.ad_id, path, message, line=self.line, request_id=self.request_id)

    def object(self, v, path: str, allowed: tuple[str, ...], *, nonempty: bool = False) -> Mapping:
        if type(v) is not dict and not isinstance(v, Mapping):
            self.fail(path, f"must be an object, got {_type_name(v)}")
        if not v.keys() <= _keyset(allowed):  # the per-key loop names the first unknown key
            for key in v:
                if not isinstance(key, str) or key not in allowed:
                    self.fail(_join(path, str(key)), f"unknown key {quote(key)}; allowed: {', '.join(allowed)}")
        if nonempty and not v:
            self.fail(path, "must not be an empty object")
        return v

    def int(self, v, path: str, lo: int, hi: int) -> int:
        if not _is_int(v):
            self.fail(path, f"must be an int, got {_type_name(v)}")
        v = int(v)
        if not lo <= v <= hi:
            self.fail(path, f"{quote(v)} is out of range {lo}..{hi}")
        return v

    def number(self, v, path: str, lo: float | None = None, hi: float | None = None) -> float:
        if not _is_number(v):
            self.fail(path, f"must be a number, got {_type_name(v)}")
        try:
            x = float(v)
        except OverflowError:  # an integer with more digits than any float holds
            self.fail(path, f"is out of range {lo}..{hi} (an integer of {len(str(abs(v)))} digits)")
        if not math.isfinite(x):
            self.fail(path, f"must be finite, got {x}")
        if (lo is not None and x < lo) or (hi is not None and x > hi):
            self.fail(path, f"{x} is out of range {lo}..{hi}")
        return x

    def list(self, v, path: str, *, nonempty: bool = True) -> list:
        if type(v) is not list:
            v = self._as_list(v, path)
        if nonempty and not v:
            self.fail(path, "must not be an empty list")
        return v

    def _as_list(self, v, path: str) -> list:
        if isinstance(v, np.ndarray):
            v = v.tolist()
        if not isinstance(v, (list, tuple)):
            self.fail(path, f"must be a list, got {_type_name(v)}")
        return list(v)

    def ids(self, v, path: str, *, nonempty: bool = True) -> frozenset[int]:
        items = self.list(v, path, nonempty=nonempty)
        # happy path in C: every item a plain int (not bool), all in range; otherwise the per-item
        # loop below names the first offending item
        if items and set(map(type, items)) == _INT_ONLY and min(items) >= 0 and max(items) <= MAX_TERM_ID:
            return frozenset(items)
        return frozenset(self.int(x, f"{path}[{i}]", 0, MAX_TERM_ID) for i, x in enumerate(items))

    def enum(self, v, path: str, universe: tuple) -> Any:
        if universe and isinstance(universe[0], str) and not isinstance(v, str):
            self.fail(path, f"must be a string, got {_type_name(v)}")
        if universe and _is_int(universe[0]) and not _is_int(v):
            self.fail(path, f"must be an int, got {_type_name(v)}")
        if v not in universe:
            self.fail(path, f"{quote(v)} is not one of {', '.join(map(repr, universe))}")
        return v.item() if isinstance(v, np.generic) else v

    def enum_set(self, v, path: str, universe: tuple) -> frozenset:
        items = self.list(v, path)
        # happy path: items of the universe's own type (so True never passes for 1), all members
        if set(map(type, items)) == {type(universe[0])}:
            values = frozenset(items)
            if values <= _keyset(universe):
                return values
        return frozenset(self.enum(x, f"{path}[{i}]", universe) for i, x in enumerate(items))

    def countries(self, v, path: str) -> frozenset[str]:
        items = self.list(v, path)
        if set(map(type, items)) == _STR_ONLY:
            values = frozenset(items)
            if values <= _ISO2_CODES:
                return values
        return frozenset(self.country(x, f"{path}[{i}]") for i, x in enumerate(items))

    def country(self, v, path: str) -> str:
        if not isinstance(v, str):
            self.fail(path, f"must be a string, got {_type_name(v)}")
        if not _ISO2.fullmatch(v):
            self.fail(path, f"{quote(v)} is not an ISO-3166 alpha-2 code (two upper-case letters)")
        return v

    def time(self, v, path: str) -> int:
        return self.int(v, path, -MAX_ABS_TIME, MAX_ABS_TIME)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


_KEYSETS: dict[tuple, frozenset] = {}


def _keyset(allowed: tuple) -> frozenset:
    """`allowed` as a frozenset, made once per tuple (the tuples are this module's constants)."""
    keys = _KEYSETS.get(allowed)
    if keys is None:
        keys = _KEYSETS[allowed] = frozenset(allowed)
    return keys


# --- targeting spec ---------------------------------------------------------------------------------


def _parse_custom_location(chk: _Checker, v, path: str) -> CustomLocation:
    obj = chk.object(v, path, CUSTOM_LOCATION_KEYS)
    for key in CUSTOM_LOCATION_KEYS:
        if key not in obj:
            chk.fail(_join(path, key), "is required in a custom location")
    lat = chk.number(obj["latitude"], _join(path, "latitude"), -90.0, 90.0)
    lon = chk.number(obj["longitude"], _join(path, "longitude"), -180.0, 180.0)
    unit = chk.enum(obj["distance_unit"], _join(path, "distance_unit"), DISTANCE_UNITS)
    limit = MAX_RADIUS_KM if unit == "kilometer" else MAX_RADIUS_MILES
    rpath = _join(path, "radius")
    radius = chk.number(obj["radius"], rpath)
    if not 0.0 < radius <= limit:
        chk.fail(rpath, f"{radius} {unit}s is out of range: must be > 0 and at most {limit:g}")
    radius_km = radius if unit == "kilometer" else radius * KM_PER_MILE
    return CustomLocation(latitude=lat, longitude=lon, radius_km=radius_km)


def _parse_geo(chk: _Checker, v, path: str) -> GeoSpec:
    obj = chk.object(v, path, GEO_KEYS, nonempty=True)
    countries: frozenset[str] = frozenset()
    regions: frozenset[int] = frozenset()
    cities: frozenset[int] = frozenset()
    circles: tuple[CustomLocation, ...] = ()
    if "countries" in obj:
        countries = chk.countries(obj["countries"], _join(path, "countries"))
    if "regions" in obj:
        regions = chk.ids(obj["regions"], _join(path, "regions"))
    if "cities" in obj:
        cities = chk.ids(obj["cities"], _join(path, "cities"))
    if "custom_locations" in obj:
        p = _join(path, "custom_locations")
        items = chk.list(obj["custom_locations"], p)
        circles = tuple(_parse_custom_location(chk, x, f"{p}[{i}]") for i, x in enumerate(items))
    return GeoSpec(countries=countries, regions=regions, cities=cities, custom_locations=circles)


def _parse_id_object(chk: _Checker, v, path: str) -> dict[str, frozenset[int]]:
    """A flexible_spec object or the exclusions object: FLEX_KEYS -> non-empty id lists."""
    obj = chk.object(v, path, FLEX_KEYS, nonempty=True)
    out = {key: chk.ids(obj[key], _join(path, key)) for key in FLEX_KEYS if key in obj}
    total = sum(len(ids) for ids in out.values())
    if total > MAX_IDS_PER_OBJECT:
        chk.fail(path, f"{total} distinct ids; at most {MAX_IDS_PER_OBJECT} per object")
    return out


def _targeting_spec(chk: _Checker, obj, path: str) -> TargetingSpec:
    obj = chk.object(obj, path, TARGETING_KEYS)
    p = lambda key: _join(path, key)  # noqa: E731
    kw: dict[str, Any] = {}
    age_min = AGE_MIN_DEFAULT
    age_max = AGE_MAX_DEFAULT
    if "age_min" in obj:
        age_min = chk.int(obj["age_min"], p("age_min"), AGE_LOWEST, AGE_HIGHEST)
    if "age_max" in obj:
        age_max = chk.int(obj["age_max"], p("age_max"), AGE_LOWEST, AGE_HIGHEST)
    if age_min > age_max:
        if "age_min" in obj:
            chk.fail(p("age_min"), f"age_min {age_min} is greater than age_max {age_max}")
        chk.fail(p("age_max"), f"age_max {age_max} is below the default age_min {age_min}")
    kw["age_min"], kw["age_max"] = age_min, age_max
    if "genders" in obj:
        kw["genders"] = chk.enum_set(obj["genders"], p("genders"), GENDERS)
    for key in ("geo_locations", "excluded_geo_locations"):
        if key in obj:
            kw[key] = _parse_geo(chk, obj[key], p(key))
    if "locales" in obj:
        kw["locales"] = chk.ids(obj["locales"], p("locales"))
    for key, universe in (
        ("publisher_platforms", PUBLISHER_PLATFORMS),
        ("device_platforms", DEVICE_PLATFORMS),
        ("user_os", USER_OS),
    ):
        if key in obj:
            kw[key] = chk.enum_set(obj[key], p(key), universe)
    if "flexible_spec" in obj:
        fp = p("flexible_spec")
        items = chk.list(obj["flexible_spec"], fp)
        if len(items) > MAX_FLEXIBLE_SPEC_OBJECTS:
            chk.fail(fp, f"{len(items)} objects; at most {MAX_FLEXIBLE_SPEC_OBJECTS}")
        kw["flexible_spec"] = tuple(_parse_id_object(chk, x, f"{fp}[{i}]") for i, x in enumerate(items))
    if "exclusions" in obj:
        kw["exclusions"] = _parse_id_object(chk, obj["exclusions"], p("exclusions"))
    for key in ("custom_audiences", "excluded_custom_audiences"):
        if key in obj:
            kw[key] = chk.ids(obj[key], p(key))
    if "geo_locations" not in obj and "custom_audiences" not in obj:
        chk.fail(p("geo_locations"), "is required unless custom_audiences is present")
    return TargetingSpec(**kw)


def parse_targeting(obj, ad_id=None, path: str = "targeting", *, line: int | None = None) -> TargetingSpec:
    """Validate one targeting object (DESIGN section 2) and return its normalized form.

    Raises `TargetingError(ad_id, path, message)` naming the first offending value.
    """
    return _targeting_spec(_Checker(ad_id, line), obj, path)


# --- ads ---------------------------------------------------------------------------------------------


def _parse_vector(chk: _Checker, v, path: str, size: int) -> np.ndarray:
    if isinstance(v, np.ndarray) and v.ndim == 1 and v.dtype.kind == "f":
        arr = v.astype(np.float64)
        if len(arr) != size:
            chk.fail(path, f"has {len(arr)} values; expected {size}")
        bad = np.flatnonzero(~np.isfinite(arr) | (np.abs(arr) > _F32_MAX))
        if len(bad):
            chk.fail(f"{path}[{bad[0]}]", f"must be a finite float32 value, got {arr[bad[0]]}")
        return arr.astype(np.float32)
    items = chk.list(v, path)
    if len(items) != size:
        chk.fail(path, f"has {len(items)} values; expected {size}")
    if {type(x) for x in items} <= {float, int}:  # fast path: plain JSON numbers
        try:
            arr = np.asarray(items, np.float64)
        except OverflowError:  # an integer beyond float64: named below
            arr = None
        if arr is not None and np.all(np.isfinite(arr)) and np.all(np.abs(arr) <= _F32_MAX):
            return arr.astype(np.float32)
    return np.asarray(
        [chk.number(x, f"{path}[{i}]", -_F32_MAX, _F32_MAX) for i, x in enumerate(items)], np.float32
    )


def _plain_matrix(rows, width: int) -> np.ndarray | None:
    """float32 (len(rows), width) when every row is a list of `width` plain JSON numbers (no bool,
    no null) that are finite float32 values: one conversion and one check for the whole matrix (a
    served request's signals); else None, and the caller checks row by row."""
    if not all(type(r) is list and len(r) == width for r in rows):
        return None
    if not set(map(type, chain.from_iterable(rows))) <= {float, int}:
        return None
    try:
        arr = np.array(rows, np.float64).reshape(len(rows), width)
    except OverflowError:  # an integer beyond float64: the row check names it
        return None
    if not (np.isfinite(arr).all() and (np.abs(arr) <= _F32_MAX).all()):
        return None
    return arr.astype(np.float32)


def parse_ad(obj, *, seed: int, dim: int, formats: int = DEFAULT_F, line: int | None = None,
             derive_embedding: bool = True, copy_targeting: bool = True) -> Ad:
    """Validate one ad line of DESIGN section 2 and return an `Ad`.

    `status` defaults to ACTIVE, `start_time` / `end_time` to null (open), `format` to 0 (must be in
    0..formats-1); `targeting` is required; an ad without `embedding` gets
    `derive.ad_embedding(ad_id, seed, dim)`, or None with `derive_embedding=False` (bulk loaders
    then fill many at once with `derive.ad_embeddings`). `line` (1-based, when the ad came from a
    file) is carried into the error. The `Ad` keeps its targeting object (`Ad.targeting_json`) as a
    deep copy; `copy_targeting=False` keeps `obj["targeting"]` itself, for bulk loaders that hand
    over freshly decoded JSON they never touch again.
    """
    chk = _Checker(None, line)
    if not isinstance(obj, Mapping):
        chk.fail("", f"an ad must be a JSON object, got {_type_name(obj)}")
    if "ad_id" not in obj:
        chk.fail("ad_id", "is required")
    ad_id = chk.int(obj["ad_id"], "ad_id", 0, MAX_AD_ID)
    chk.ad_id = ad_id
    chk.object(obj, "", AD_KEYS)
    status = chk.enum(obj.get("status", "ACTIVE"), "status", STATUSES)
    start = obj.get("start_time")
    end = obj.get("end_time")
    start = None if start is None else chk.time(start, "start_time")
    end = None if end is None else chk.time(end, "end_time")
    fmt = chk.int(obj.get("format", 0), "format", 0, formats - 1)
    if "targeting" not in obj:
        chk.fail("targeting", "is required")
    spec = _targeting_spec(chk, obj["targeting"], "targeting")
    if "embedding" in obj:
        embedding = _parse_vector(chk, obj["embedding"], "embedding", dim)
    else:
        embedding = derive.ad_embedding(ad_id, seed, dim) if derive_embedding else None
    return Ad(
        ad_id=ad_id,
        targeting=spec,
        status=status,
        start_time=start,
        end_time=end,
        format=fmt,
        targeting_json=_copy_json(obj["targeting"]) if copy_targeting else obj["targeting"],
        embedding=embedding,
    )


def _geo_to_json(geo: GeoSpec) -> dict:
    out: dict[str, Any] = {}
    if geo.countries:
        out["countries"] = sorted(geo.countries)
    if geo.regions:
        out["regions"] = sorted(geo.regions)
    if geo.cities:
        out["cities"] = sorted(geo.cities)
    if geo.custom_locations:
        locs = []
        for c in geo.custom_locations:
            # radii between 80 km and 50 miles are only expressible in miles
            if c.radius_km <= MAX_RADIUS_KM:
                radius, unit = c.radius_km, "kilometer"
            else:
                radius, unit = c.radius_km / KM_PER_MILE, "mile"
            locs.append({"latitude": c.latitude, "longitude": c.longitude, "radius": radius,
                         "distance_unit": unit})
        out["custom_locations"] = locs
    return out


def spec_to_json(spec: TargetingSpec) -> dict:
    """The normalized JSON form of a spec: defaults written out, ids sorted, radii in km (in miles
    only where the radius exceeds 80 km). `parse_targeting(spec_to_json(s))` is equivalent to `s`."""
    out: dict[str, Any] = {"age_min": spec.age_min, "age_max": spec.age_max}
    if spec.genders is not None:
        out["genders"] = sorted(spec.genders)
    if spec.geo_locations is not None:
        out["geo_locations"] = _geo_to_json(spec.geo_locations)
    if spec.excluded_geo_locations is not None:
        out["excluded_geo_locations"] = _geo_to_json(spec.excluded_geo_locations)
    if spec.locales is not None:
        out["locales"] = sorted(spec.locales)
    for key, universe in (
        ("publisher_platforms", PUBLISHER_PLATFORMS),
        ("device_platforms", DEVICE_PLATFORMS),
        ("user_os", USER_OS),
    ):
        values = getattr(spec, key)
        if values is not None:
            out[key] = [v for v in universe if v in values]
    if spec.flexible_spec:
        out["flexible_spec"] = [{k: sorted(obj[k]) for k in FLEX_KEYS if k in obj}
                                for obj in spec.flexible_spec]
    if spec.exclusions is not None:
        out["exclusions"] = {k: sorted(spec.exclusions[k]) for k in FLEX_KEYS if k in spec.exclusions}
    for key in ("custom_audiences", "excluded_custom_audiences"):
        values = getattr(spec, key)
        if values is not None:
            out[key] = sorted(values)
    return out


def ad_to_json(ad: Ad) -> dict:
    """The ad line of DESIGN section 2. The targeting object is the one the ad was parsed from when
    it has one (so export round-trips exactly), else `spec_to_json(ad.targeting)`; `embedding` is a
    list of floats (omitted when the ad has none)."""
    out: dict[str, Any] = {
        "ad_id": int(ad.ad_id),
        "status": ad.status,
        "start_time": None if ad.start_time is None else int(ad.start_time),
        "end_time": None if ad.end_time is None else int(ad.end_time),
        "format": int(ad.format),
        "targeting": _copy_json(ad.targeting_json) if ad.targeting_json else spec_to_json(ad.targeting),
    }
    if ad.embedding is not None:
        out["embedding"] = np.asarray(ad.embedding, np.float32).astype(np.float64).tolist()
    return out


# --- requests ----------------------------------------------------------------------------------------


def _user(chk: _Checker, obj, path: str) -> User:
    obj = chk.object(obj, path, USER_KEYS)
    p = lambda key: _join(path, key)  # noqa: E731
    if "age" not in obj:
        chk.fail(p("age"), "is required")
    age = chk.int(obj["age"], p("age"), *USER_AGE_RANGE)
    gender = chk.enum(obj.get("gender", 0), p("gender"), USER_GENDERS)
    country = obj.get("country")
    country = "" if country is None else chk.country(country, p("country"))
    region, city, locale = (
        -1 if obj.get(key) is None else chk.int(obj[key], p(key), 0, MAX_TERM_ID)
        for key in ("region", "city", "locale")
    )
    has_lat, has_lon = obj.get("latitude") is not None, obj.get("longitude") is not None
    if has_lat != has_lon:
        chk.fail(p("longitude" if has_lat else "latitude"), "latitude and longitude come together")
    lat = chk.number(obj["latitude"], p("latitude"), -90.0, 90.0) if has_lat else NO_LOCATION
    lon = chk.number(obj["longitude"], p("longitude"), -180.0, 180.0) if has_lon else NO_LOCATION
    ids = {key: chk.ids(obj[key], p(key), nonempty=False) for key in USER_ID_KEYS if key in obj}
    return User(
        age=age, gender=gender, country=country, region=region, city=city,
        latitude=lat, longitude=lon, locale=locale, ids={k: v for k, v in ids.items() if v},
    )


def _context(chk: _Checker, obj, path: str) -> Context:
    obj = chk.object(obj, path, CONTEXT_KEYS)
    for key in CONTEXT_KEYS:
        if key not in obj:
            chk.fail(_join(path, key), "is required")
    return Context(
        publisher_platform=chk.enum(obj["publisher_platform"], _join(path, "publisher_platform"),
                                    PUBLISHER_PLATFORMS),
        device_platform=chk.enum(obj["device_platform"], _join(path, "device_platform"), DEVICE_PLATFORMS),
        user_os=chk.enum(obj["user_os"], _join(path, "user_os"), USER_OS),
        time=chk.time(obj["time"], _join(path, "time")),
    )


def parse_user(obj, path: str = "user", *, request_id=None) -> User:
    """Validate a user profile (DESIGN section 2); see the module docstring for optional fields."""
    return _user(_Checker(request_id=request_id), obj, path)


def parse_context(obj, path: str = "context", *, request_id=None) -> Context:
    """Validate a request context: publisher_platform, device_platform, user_os, time (all required)."""
    return _context(_Checker(request_id=request_id), obj, path)


def parse_request(obj, *, seed: int, experts: int, width: int, request_id: int | None = None,
                  line: int | None = None) -> Request:
    """Validate one request line of DESIGN section 2 and return a `Request`.

    `request_id` may be passed separately (the Flight protocol carries it in its own column); then
    the object may omit it, and if it has one, the two must agree. Requests without `signals` get
    `derive.request_signals(request_id, seed, experts, width)`; given signals must be `experts`
    lists of `width` finite numbers. Errors are `TargetingError` with ad_id None and `request_id`
    set once the id is known (its text: `request N: PATH: ...`).
    """
    chk = _Checker(None, line)
    if not isinstance(obj, Mapping):
        chk.fail("", f"a request must be a JSON object, got {_type_name(obj)}")
    if "request_id" in obj:
        rid = chk.int(obj["request_id"], "request_id", -(1 << 63), (1 << 63) - 1)
        if request_id is not None and rid != request_id:
            chk.fail("request_id", f"{rid} disagrees with the request id {request_id} it was sent with")
    elif request_id is None:
        chk.fail("request_id", "is required")
    else:
        rid = int(request_id)
    chk.request_id = rid
    chk.object(obj, "", REQUEST_KEYS)
    for key in ("user", "context"):
        if key not in obj:
            chk.fail(key, "is required")
    user = _user(chk, obj["user"], "user")
    context = _context(chk, obj["context"], "context")
    if "signals" in obj:
        rows = chk.list(obj["signals"], "signals")
        if len(rows) != experts:
            chk.fail("signals", f"has {len(rows)} groups; expected {experts}")
        signals = _plain_matrix(rows, width)
        if signals is None:  # anything but plain numbers in range: each row checked, the first fault named
            signals = np.stack([_parse_vector(chk, r, f"signals[{e}]", width) for e, r in enumerate(rows)])
    else:
        signals = derive.request_signals(rid, seed, experts, width)
    return Request(request_id=rid, user=user, context=context, signals=signals)


def user_to_json(user: User) -> dict:
    out: dict[str, Any] = {"age": int(user.age), "gender": int(user.gender)}
    if user.country:
        out["country"] = user.country
    for key in ("region", "city"):
        if getattr(user, key) >= 0:
            out[key] = int(getattr(user, key))
    if not (math.isnan(user.latitude) or math.isnan(user.longitude)):
        out["latitude"] = float(user.latitude)
        out["longitude"] = float(user.longitude)
    if user.locale >= 0:
        out["locale"] = int(user.locale)
    for key in USER_ID_KEYS:
        ids = user.id_set(key)
        if ids:
            out[key] = sorted(int(i) for i in ids)
    return out


def context_to_json(context: Context) -> dict:
    return {
        "publisher_platform": context.publisher_platform,
        "device_platform": context.device_platform,
        "user_os": context.user_os,
        "time": int(context.time),
    }


def float32_json(values) -> list:
    """float32 values as JSON-ready floats with the shortest decimal form that reads back to the same
    float32 (`0.26991937`, not the float64 expansion `0.26991936564445496`): about half the text."""
    arr = np.asarray(values, np.float32)
    return [float32_json(row) for row in arr] if arr.ndim > 1 else [float(str(v)) for v in arr]


def request_to_json(request: Request, *, with_id: bool = True) -> dict:
    """The request line of DESIGN section 2 (`with_id=False`: the Flight `request` column's object)."""
    out: dict[str, Any] = {"request_id": int(request.request_id)} if with_id else {}
    out["user"] = user_to_json(request.user)
    out["context"] = context_to_json(request.context)
    out["signals"] = float32_json(request.signals)
    return out
