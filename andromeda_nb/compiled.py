"""Targeting compiled to flat arrays: the one form both indexes are built from.

A validated `TargetingSpec` becomes a conjunction of *clauses* plus a few per-ad residual columns.
A clause is a sorted set of *terms* (and, for geo, a list of circles); a user satisfies a clause
when it holds at least one of the terms or lies inside one of the circles. An ad is eligible when
every positive clause is satisfied, no negative clause is, and the residuals pass:

    positive clauses, in this order: geo_locations, locales, each flexible_spec object, custom_audiences
    negative clause (at most one): excluded_geo_locations + exclusions + excluded_custom_audiences
    residuals: status, schedule, age range, gender mask, placement masks

A term packs a namespace and an id into one int64: `(namespace << TERM_SHIFT) | id`, so interest 7
and behavior 7 stay different (DESIGN section 2). A request becomes a sorted array of the terms its
user holds (`encode_request`). The oracle in `andromeda_nb.oracle` never uses this module: it is the
independent reference this form is tested against.

Array shapes (N ads, M clauses, T terms, Q circles), all numpy, all in slot order of the ads given:

    ad_id        int64[N]     status int8[N] (STATUS_CODE)    format int16[N]
    start_time   int64[N]     NULL_START when open            end_time int64[N], NULL_END when open
    age_min      int8[N]      age_max int8[N] (AGE_UNBOUNDED when the spec says 65)
    gender_mask  uint8[N]     bit g set when user gender g (0, 1, 2) is allowed
    publisher_mask, device_mask, os_mask  uint8[N]  bit i set when enumeration value i is allowed
    clause_ptr   int64[N+1]   ad i owns clauses clause_ptr[i]:clause_ptr[i+1]; positives first
    n_positive   int32[N]     how many of those clauses are positive
    clause_negative uint8[M]  1 for the negative clause
    term_ptr     int64[M+1]   clause j owns terms[term_ptr[j]:term_ptr[j+1]], sorted ascending
    terms        int64[T]
    circle_ptr   int64[M+1]   clause j owns circles[circle_ptr[j]:circle_ptr[j+1]]
    circles      float64[Q,3] latitude, longitude (degrees), radius (km)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields
from typing import Iterable, Sequence

import numpy as np
from numba import njit

from .constants import (
    ACTIVE,
    AGE_HIGHEST,
    AGE_LOWEST,
    DEVICE_PLATFORMS,
    FLEX_KEYS,
    KM_PER_MILE,
    MAX_RADIUS_KM,
    MAX_RADIUS_MILES,
    PUBLISHER_PLATFORMS,
    STATUS_CODE,
    USER_OS,
)
from . import jitcache
from .geo import haversine_km
from .types import Ad, GeoSpec, Request, TargetingSpec

jitcache.install()  # cached code is recompiled when any project source changes

TERM_SHIFT = 40
MAX_TERM_ID = (1 << TERM_SHIFT) - 1
NS_COUNTRY, NS_REGION, NS_CITY, NS_LOCALE = 0, 1, 2, 3
NS_FLEX = {key: 4 + i for i, key in enumerate(FLEX_KEYS)}  # 4..12
NS_CUSTOM_AUDIENCE = 4 + len(FLEX_KEYS)  # 13

AGE_UNBOUNDED = 127  # stored age_max for "65 and older"
NULL_START = np.iinfo(np.int64).min
NULL_END = np.iinfo(np.int64).max
ALL_GENDERS = 0b111


def term(namespace: int, ident: int) -> int:
    return (namespace << TERM_SHIFT) | ident


def _mask(values: frozenset[str] | None, universe: Sequence[str]) -> int:
    if values is None:
        return (1 << len(universe)) - 1
    return sum(1 << universe.index(v) for v in values)


def _geo_terms(geo: GeoSpec) -> list[int]:
    out = [term(NS_COUNTRY, country_code(c)) for c in geo.countries]
    out += [term(NS_REGION, r) for r in geo.regions]
    out += [term(NS_CITY, c) for c in geo.cities]
    return out


def _geo_circles(geo: GeoSpec) -> list[tuple[float, float, float]]:
    return [(c.latitude, c.longitude, c.radius_km) for c in geo.custom_locations]


def _id_terms(obj) -> list[int]:
    return [term(NS_FLEX[key], i) for key, ids in obj.items() for i in ids]


def spec_clauses(spec: TargetingSpec) -> tuple[list[tuple[list[int], list]], tuple[list[int], list] | None]:
    """(positive clauses, negative clause or None); each clause is (terms, circles)."""
    positive: list[tuple[list[int], list]] = []
    if spec.geo_locations is not None:
        positive.append((_geo_terms(spec.geo_locations), _geo_circles(spec.geo_locations)))
    if spec.locales is not None:
        positive.append(([term(NS_LOCALE, x) for x in spec.locales], []))
    for obj in spec.flexible_spec:
        positive.append((_id_terms(obj), []))
    if spec.custom_audiences is not None:
        positive.append(([term(NS_CUSTOM_AUDIENCE, x) for x in spec.custom_audiences], []))
    neg_terms: list[int] = []
    neg_circles: list = []
    if spec.excluded_geo_locations is not None:
        neg_terms += _geo_terms(spec.excluded_geo_locations)
        neg_circles += _geo_circles(spec.excluded_geo_locations)
    if spec.exclusions is not None:
        neg_terms += _id_terms(spec.exclusions)
    if spec.excluded_custom_audiences is not None:
        neg_terms += [term(NS_CUSTOM_AUDIENCE, x) for x in spec.excluded_custom_audiences]
    negative = (neg_terms, neg_circles) if (neg_terms or neg_circles) else None
    return positive, negative


@dataclass
class CompiledTargeting:
    ad_id: np.ndarray
    status: np.ndarray
    format: np.ndarray
    start_time: np.ndarray
    end_time: np.ndarray
    age_min: np.ndarray
    age_max: np.ndarray
    gender_mask: np.ndarray
    publisher_mask: np.ndarray
    device_mask: np.ndarray
    os_mask: np.ndarray
    clause_ptr: np.ndarray
    n_positive: np.ndarray
    clause_negative: np.ndarray
    term_ptr: np.ndarray
    terms: np.ndarray
    circle_ptr: np.ndarray
    circles: np.ndarray

    def __len__(self) -> int:
        return len(self.ad_id)

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, f.name).nbytes for f in fields(self))


# every array of a CompiledTargeting: its dtype and what its length counts ("N" ads, "N+1", "M"
# clauses, "M+1", "T" terms, "Q" circles); stored corpora are checked against this table
COMPILED_ARRAYS: dict[str, tuple[type, str]] = {
    "ad_id": (np.int64, "N"), "status": (np.int8, "N"), "format": (np.int16, "N"),
    "start_time": (np.int64, "N"), "end_time": (np.int64, "N"), "age_min": (np.int8, "N"),
    "age_max": (np.int8, "N"), "gender_mask": (np.uint8, "N"), "publisher_mask": (np.uint8, "N"),
    "device_mask": (np.uint8, "N"), "os_mask": (np.uint8, "N"), "clause_ptr": (np.int64, "N+1"),
    "n_positive": (np.int32, "N"), "clause_negative": (np.uint8, "M"), "term_ptr": (np.int64, "M+1"),
    "terms": (np.int64, "T"), "circle_ptr": (np.int64, "M+1"), "circles": (np.float64, "Q"),
}


def compile_ads(ads: Iterable[Ad]) -> CompiledTargeting:
    """Compile ads (in the order given, which becomes slot order) to flat arrays."""
    ads = list(ads)
    n = len(ads)
    cols = {
        "ad_id": np.empty(n, np.int64),
        "status": np.empty(n, np.int8),
        "format": np.empty(n, np.int16),
        "start_time": np.empty(n, np.int64),
        "end_time": np.empty(n, np.int64),
        "age_min": np.empty(n, np.int8),
        "age_max": np.empty(n, np.int8),
        "gender_mask": np.empty(n, np.uint8),
        "publisher_mask": np.empty(n, np.uint8),
        "device_mask": np.empty(n, np.uint8),
        "os_mask": np.empty(n, np.uint8),
        "n_positive": np.empty(n, np.int32),
    }
    clause_ptr = [0]
    clause_negative: list[int] = []
    term_ptr = [0]
    terms: list[int] = []
    circle_ptr = [0]
    circles: list = []
    for i, ad in enumerate(ads):
        s = ad.targeting
        cols["ad_id"][i] = ad.ad_id
        cols["status"][i] = STATUS_CODE[ad.status]
        cols["format"][i] = ad.format
        cols["start_time"][i] = NULL_START if ad.start_time is None else ad.start_time
        cols["end_time"][i] = NULL_END if ad.end_time is None else ad.end_time
        cols["age_min"][i] = s.age_min
        cols["age_max"][i] = AGE_UNBOUNDED if s.age_max >= AGE_HIGHEST else s.age_max
        cols["gender_mask"][i] = ALL_GENDERS if s.genders is None else sum(1 << g for g in s.genders)
        cols["publisher_mask"][i] = _mask(s.publisher_platforms, PUBLISHER_PLATFORMS)
        cols["device_mask"][i] = _mask(s.device_platforms, DEVICE_PLATFORMS)
        cols["os_mask"][i] = _mask(s.user_os, USER_OS)
        positive, negative = spec_clauses(s)
        cols["n_positive"][i] = len(positive)
        for negative_flag, clauses in ((0, positive), (1, [negative] if negative else [])):
            for clause_terms, clause_circles in clauses:
                clause_negative.append(negative_flag)
                terms.extend(sorted(set(clause_terms)))
                term_ptr.append(len(terms))
                circles.extend(clause_circles)
                circle_ptr.append(len(circles))
        clause_ptr.append(len(clause_negative))
    return CompiledTargeting(
        clause_ptr=np.asarray(clause_ptr, np.int64),
        clause_negative=np.asarray(clause_negative, np.uint8),
        term_ptr=np.asarray(term_ptr, np.int64),
        terms=np.asarray(terms, np.int64),
        circle_ptr=np.asarray(circle_ptr, np.int64),
        circles=np.asarray(circles, np.float64).reshape(-1, 3),
        **cols,
    )


def has_duplicates(ad_ids: np.ndarray) -> bool:
    """Whether an id occurs twice: one sort (fast on the ascending ids a corpus usually holds), where
    np.unique's hashing took 0.7 s of CPU for a million ids on the development machine."""
    ids = np.sort(np.asarray(ad_ids, np.int64))
    return bool(np.any(ids[1:] == ids[:-1]))


def concat_compiled(parts: Sequence[CompiledTargeting]) -> CompiledTargeting:
    """The compiled form of the ads of `parts` one after the other (row order kept): equal, array
    for array, to `compile_ads` of all their ads at once."""
    if not parts:
        return compile_ads([])
    cols = {}
    for name, (dtype, length) in COMPILED_ARRAYS.items():
        if length == "N":
            cols[name] = np.concatenate([getattr(p, name) for p in parts]).astype(dtype, copy=False)
    for ptr, counted in (("clause_ptr", "clause_negative"), ("term_ptr", "terms"), ("circle_ptr", "circles")):
        offsets = np.cumsum([0] + [len(getattr(p, counted)) for p in parts])
        cols[ptr] = np.concatenate([getattr(p, ptr)[:-1] + off for p, off in zip(parts, offsets)]
                                   + [offsets[-1:]]).astype(np.int64)
    cols["clause_negative"] = np.concatenate([p.clause_negative for p in parts]).astype(np.uint8, copy=False)
    cols["terms"] = np.concatenate([p.terms for p in parts]).astype(np.int64, copy=False)
    cols["circles"] = np.concatenate([p.circles.reshape(-1, 3) for p in parts]).astype(np.float64, copy=False)
    return CompiledTargeting(**cols)


def _ranges(ptr: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The indices ptr[r]:ptr[r+1] of every row r of `rows`, concatenated (int64), and the new
    pointer array (int64, len(rows) + 1) over them."""
    starts, ends = ptr[rows], ptr[rows + 1]
    lengths = ends - starts
    new_ptr = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(lengths, out=new_ptr[1:])
    index = np.arange(new_ptr[-1], dtype=np.int64) - np.repeat(new_ptr[:-1] - starts, lengths)
    return index, new_ptr


def take_compiled(ct: CompiledTargeting, rows) -> CompiledTargeting:
    """The compiled form of the ads at `rows` (int, in the order given): equal, array for array, to
    `compile_ads` of those ads (a shard's slice of a corpus, `cluster.shards`)."""
    rows = np.asarray(rows, np.int64)
    if len(rows) and (rows.min() < 0 or rows.max() >= len(ct)):
        raise IndexError(f"rows outside 0..{len(ct) - 1}")
    cols = {name: getattr(ct, name)[rows] for name, (_, length) in COMPILED_ARRAYS.items() if length == "N"}
    clauses, cols["clause_ptr"] = _ranges(ct.clause_ptr, rows)
    cols["clause_negative"] = ct.clause_negative[clauses]
    terms, cols["term_ptr"] = _ranges(ct.term_ptr, clauses)
    cols["terms"] = ct.terms[terms]
    circles, cols["circle_ptr"] = _ranges(ct.circle_ptr, clauses)
    cols["circles"] = ct.circles.reshape(-1, 3)[circles]
    return CompiledTargeting(**cols)


def check_compiled(ct: CompiledTargeting) -> None:
    """Structural checks of a compiled form that did not come from `compile_ads` (a stored file):
    dtypes, lengths, pointer arrays that start at 0, never decrease and end at their array's length,
    and positive clauses before the negative one. Raises ValueError naming the first problem."""
    n = len(ct.ad_id)
    m = len(ct.clause_negative)
    sizes = {"N": n, "N+1": n + 1, "M": m, "M+1": m + 1, "T": len(ct.terms), "Q": len(ct.circles)}
    for name, (dtype, length) in COMPILED_ARRAYS.items():
        a = getattr(ct, name)
        if not isinstance(a, np.ndarray) or a.dtype != dtype:
            raise ValueError(f"{name}: expected {np.dtype(dtype)}, got {getattr(a, 'dtype', type(a).__name__)}")
        want_ndim = 2 if name == "circles" else 1
        if a.ndim != want_ndim or (name == "circles" and a.shape[1] != 3):
            raise ValueError(f"{name}: has shape {a.shape}")
        if len(a) != sizes[length]:
            raise ValueError(f"{name}: has {len(a)} rows, expected {sizes[length]} ({length})")
    for ptr, total in (("clause_ptr", m), ("term_ptr", len(ct.terms)), ("circle_ptr", len(ct.circles))):
        a = getattr(ct, ptr)
        if a[0] != 0 or a[-1] != total or np.any(np.diff(a) < 0):
            raise ValueError(f"{ptr}: must start at 0, never decrease and end at {total}")
    n_clauses = np.diff(ct.clause_ptr)
    n_negative = n_clauses - ct.n_positive
    if np.any(ct.n_positive < 0) or np.any((n_negative != 0) & (n_negative != 1)):
        raise ValueError("n_positive: disagrees with clause_ptr (each ad has at most one negative clause)")
    if m and not _negative_last(ct.clause_ptr, ct.n_positive, ct.clause_negative):
        raise ValueError("clause_negative: disagrees with n_positive (negative clause last)")


@njit(cache=True)
def _negative_last(clause_ptr, n_positive, clause_negative):
    """Whether clause j of ad i is flagged negative (1) exactly when it comes after the ad's
    n_positive[i] positive clauses (clause_ptr int64[N+1], n_positive int32[N], clause_negative uint8[M])."""
    for i in range(len(n_positive)):
        lo = clause_ptr[i]
        for j in range(lo, clause_ptr[i + 1]):
            if clause_negative[j] != (1 if j - lo >= n_positive[i] else 0):
                return False
    return True


_MAX_ABS_TIME = 1 << 62  # DESIGN section 2: times are ints with |t| <= 2**62
_MAX_RADIUS_KM = max(MAX_RADIUS_KM, MAX_RADIUS_MILES * KM_PER_MILE) * (1 + 1e-9)


def check_values(ct: CompiledTargeting, formats: int) -> None:
    """Value checks of a stored compiled form (after `check_compiled`): every value one that
    `compile_ads` of a valid ad can produce, so an edited file can never index past a table (a
    format of 30000 read the scorer's per-format tables out of bounds). `formats` is the model's F.
    Raises ValueError naming the array, the row and its ad id, and the allowed range."""
    def fail(name: str, bad: np.ndarray | int, allowed: str, ptrs: tuple = ()) -> None:
        """`bad`: a mask, or the index of the first bad value; `ptrs`: the pointer arrays that lead
        from that index back to its ad (term_ptr then clause_ptr for a term)."""
        i = int(np.flatnonzero(bad)[0]) if isinstance(bad, np.ndarray) else int(bad)
        row = i
        for ptr in ptrs:
            row = int(np.searchsorted(ptr, row, side="right")) - 1
        value = getattr(ct, name)[i]
        raise ValueError(f"{name}: row {row} (ad {int(ct.ad_id[row])}) holds {value.tolist()!r}; "
                         f"expected {allowed}")

    per_ad_checks = (
        ("ad_id", ct.ad_id < 0, "an ad id in 0..2**63-1"),
        ("status", (ct.status < 0) | (ct.status >= len(STATUS_CODE)),
         f"a status code in 0..{len(STATUS_CODE) - 1}"),
        ("format", (ct.format < 0) | (ct.format >= formats), f"a format in 0..{formats - 1}"),
        ("start_time", (ct.start_time != NULL_START) & (np.abs(ct.start_time) > _MAX_ABS_TIME),
         "a time with |t| <= 2**62, or open"),
        ("end_time", (ct.end_time != NULL_END) & (np.abs(ct.end_time) > _MAX_ABS_TIME),
         "a time with |t| <= 2**62, or open"),
        ("age_min", (ct.age_min < AGE_LOWEST) | (ct.age_min > AGE_HIGHEST), f"an age in {AGE_LOWEST}..{AGE_HIGHEST}"),
        ("age_max", ((ct.age_max < ct.age_min) | (ct.age_max >= AGE_HIGHEST)) & (ct.age_max != AGE_UNBOUNDED),
         f"an age in age_min..{AGE_HIGHEST - 1}, or {AGE_UNBOUNDED} for {AGE_HIGHEST} and older"),
        ("gender_mask", (ct.gender_mask == 0) | (ct.gender_mask > ALL_GENDERS), f"a mask in 1..{ALL_GENDERS}"),
        ("publisher_mask", (ct.publisher_mask == 0) | (ct.publisher_mask >= 1 << len(PUBLISHER_PLATFORMS)),
         f"a non-empty mask of {len(PUBLISHER_PLATFORMS)} bits"),
        ("device_mask", (ct.device_mask == 0) | (ct.device_mask >= 1 << len(DEVICE_PLATFORMS)),
         f"a non-empty mask of {len(DEVICE_PLATFORMS)} bits"),
        ("os_mask", (ct.os_mask == 0) | (ct.os_mask >= 1 << len(USER_OS)), f"a non-empty mask of {len(USER_OS)} bits"),
    )
    for name, bad, allowed in per_ad_checks:
        if np.any(bad):
            fail(name, bad, allowed)
    of_term = (ct.term_ptr, ct.clause_ptr)  # a term's clause, then the clause's ad
    out_of_range, unordered = _first_bad_terms(ct.terms, ct.term_ptr, NS_CUSTOM_AUDIENCE, TERM_SHIFT)
    if out_of_range >= 0:
        fail("terms", out_of_range, f"a term of namespace 0..{NS_CUSTOM_AUDIENCE} with an id in 0..2**40-1", of_term)
    if unordered >= 0:  # ascending and unique within each clause (the indexes search them)
        fail("terms", unordered, "terms ascending and unique within each clause", of_term)
    if len(ct.circles):
        lat, lon, radius = ct.circles[:, 0], ct.circles[:, 1], ct.circles[:, 2]
        with np.errstate(invalid="ignore"):
            bad = ~((np.abs(lat) <= 90) & (np.abs(lon) <= 180) & (radius > 0) & (radius <= _MAX_RADIUS_KM))
        if np.any(bad):
            i = int(np.flatnonzero(bad)[0])
            clause = int(np.searchsorted(ct.circle_ptr, i, side="right")) - 1
            row = int(np.searchsorted(ct.clause_ptr, clause, side="right")) - 1
            raise ValueError(f"circles: row {row} (ad {int(ct.ad_id[row])}) holds {ct.circles[i].tolist()!r}; "
                             f"expected latitude -90..90, longitude -180..180, radius in (0, "
                             f"{_MAX_RADIUS_KM:.3f}] km")


@njit(cache=True)
def _first_bad_terms(terms, term_ptr, max_namespace, shift):
    """(index of the first term that is negative or of a namespace above `max_namespace`, index of the
    first term not above the one before it in its clause), each -1 when there is none. terms
    int64[T], term_ptr int64[M+1] (checked: from 0 to T, never decreasing)."""
    out_of_range = -1
    for t in range(len(terms)):
        if terms[t] < 0 or (terms[t] >> shift) > max_namespace:
            out_of_range = t
            break
    unordered = -1
    for c in range(len(term_ptr) - 1):
        for t in range(term_ptr[c] + 1, term_ptr[c + 1]):
            if terms[t] <= terms[t - 1]:
                unordered = t
                break
        if unordered >= 0:
            break
    return out_of_range, unordered


@dataclass(frozen=True)
class EncodedRequest:
    """A request's user and context as the indexes read them."""

    terms: np.ndarray  # int64, sorted, unique: every term the user holds
    age: int
    gender: int
    latitude: float
    longitude: float
    publisher: int  # index into PUBLISHER_PLATFORMS
    device: int
    os: int
    time: int


def encode_request(request: Request) -> EncodedRequest:
    u, c = request.user, request.context
    t = []
    if len(u.country) == 2:
        t.append(term(NS_COUNTRY, country_code(u.country)))
    if u.region >= 0:
        t.append(term(NS_REGION, u.region))
    if u.city >= 0:
        t.append(term(NS_CITY, u.city))
    if u.locale >= 0:
        t.append(term(NS_LOCALE, u.locale))
    for key in FLEX_KEYS:
        t.extend(term(NS_FLEX[key], i) for i in u.id_set(key))
    t.extend(term(NS_CUSTOM_AUDIENCE, i) for i in u.id_set("custom_audiences"))
    return EncodedRequest(
        terms=np.unique(np.asarray(t, np.int64)),
        age=u.age,
        gender=u.gender,
        latitude=u.latitude,
        longitude=u.longitude,
        publisher=PUBLISHER_PLATFORMS.index(c.publisher_platform),
        device=DEVICE_PLATFORMS.index(c.device_platform),
        os=USER_OS.index(c.user_os),
        time=c.time,
    )


@dataclass
class EncodedBatch:
    """Requests encoded together, as arrays (B requests, T terms in all): what `encode_request` gives
    for each request, laid out so that an index prepares a whole batch without a Python loop over
    any request's terms.

        terms      int64[T]     request b holds terms[term_ptr[b]:term_ptr[b+1]], sorted and unique
        term_ptr   int64[B+1]
        age, gender, publisher, device, os, time   int64[B]
        latitude, longitude                        float64[B] (NaN: no known location)
    """

    terms: np.ndarray
    term_ptr: np.ndarray
    age: np.ndarray
    gender: np.ndarray
    latitude: np.ndarray
    longitude: np.ndarray
    publisher: np.ndarray
    device: np.ndarray
    os: np.ndarray
    time: np.ndarray

    def __len__(self) -> int:
        return len(self.term_ptr) - 1

    def __getitem__(self, b: int) -> EncodedRequest:
        """Request b as `encode_request` gives it."""
        return EncodedRequest(terms=self.terms[self.term_ptr[b]:self.term_ptr[b + 1]], age=int(self.age[b]),
                              gender=int(self.gender[b]), latitude=float(self.latitude[b]),
                              longitude=float(self.longitude[b]), publisher=int(self.publisher[b]),
                              device=int(self.device[b]), os=int(self.os[b]), time=int(self.time[b]))

    def __iter__(self):
        return (self[b] for b in range(len(self)))

    @classmethod
    def of(cls, encoded: "EncodedBatch | Sequence[EncodedRequest]") -> "EncodedBatch":
        """`encoded` itself when it is a batch, else the batch of the encoded requests given."""
        if isinstance(encoded, cls):
            return encoded
        encoded = list(encoded)
        lengths = np.asarray([len(e.terms) for e in encoded], np.int64)
        terms = np.concatenate([np.asarray(e.terms, np.int64) for e in encoded]) if encoded else np.empty(0, np.int64)
        ptr = np.zeros(len(encoded) + 1, np.int64)
        np.cumsum(lengths, out=ptr[1:])

        def col(name, dtype):
            return np.asarray([getattr(e, name) for e in encoded], dtype).reshape(len(encoded))

        return cls(terms=terms, term_ptr=ptr, age=col("age", np.int64), gender=col("gender", np.int64),
                   latitude=col("latitude", np.float64), longitude=col("longitude", np.float64),
                   publisher=col("publisher", np.int64), device=col("device", np.int64), os=col("os", np.int64),
                   time=col("time", np.int64))


@njit(cache=True, nogil=True)
def _sorted_unique_per_request(req, terms, n):
    """(terms int64[K], ptr int64[n + 1]): the terms of each request (req int64[T] names the request of
    terms[t]), sorted and unique, request after request."""
    ptr = np.zeros(n + 1, np.int64)
    for r in req:
        ptr[r + 1] += 1
    for r in range(n):
        ptr[r + 1] += ptr[r]
    fill = ptr[:-1].copy()
    grouped = np.empty(len(terms), np.int64)
    for t in range(len(terms)):
        grouped[fill[req[t]]] = terms[t]
        fill[req[t]] += 1
    out = np.empty(len(terms), np.int64)
    out_ptr = np.zeros(n + 1, np.int64)
    k = 0
    for r in range(n):
        seg = np.sort(grouped[ptr[r]:ptr[r + 1]])
        for i in range(len(seg)):
            if i == 0 or seg[i] != seg[i - 1]:
                out[k] = seg[i]
                k += 1
        out_ptr[r + 1] = k
    return out[:k].copy(), out_ptr


_PUBLISHER_INDEX = {name: i for i, name in enumerate(PUBLISHER_PLATFORMS)}
_DEVICE_INDEX = {name: i for i, name in enumerate(DEVICE_PLATFORMS)}
_OS_INDEX = {name: i for i, name in enumerate(USER_OS)}
_ID_NAMESPACES = tuple(NS_FLEX.items()) + (("custom_audiences", NS_CUSTOM_AUDIENCE),)


def country_code(country: str) -> int:
    """A country's term id: its two letters (ISO-3166 alpha-2, upper case) in base 26, 0..675; -1 for
    none ("")."""
    return (ord(country[0]) - 65) * 26 + (ord(country[1]) - 65) if len(country) == 2 else -1


_ID_KEYS = tuple(key for key, _ in _ID_NAMESPACES)
_ID_CODES = np.asarray([ns for _, ns in _ID_NAMESPACES], np.int64) << TERM_SHIFT  # each namespace's high bits
_SCALAR_CODES = np.asarray([NS_COUNTRY, NS_REGION, NS_CITY, NS_LOCALE], np.int64) << TERM_SHIFT
_INT_FIELDS = ("age", "gender", "publisher", "device", "os", "time")  # EncodedBatch's int64 fields


def encode_requests(requests: Sequence[Request]) -> EncodedBatch:
    """`encode_request` of every request, as one `EncodedBatch`. The fields are read once per request
    into one array of integers and one of places; every id set of every request becomes one array by
    one `np.fromiter` (no Python step per id), and the terms are namespaced, sorted and made unique
    for the whole batch at once: a few numpy calls a batch, however many namespaces. Requests that
    come as arrays (`serving.request_columns.RequestColumns`) are encoded from them, with no step
    per request."""
    encoded = getattr(requests, "encoded", None)
    if encoded is not None:
        return encoded()
    requests = list(requests)
    n = len(requests)
    if n == 1:  # a lone request, on the critical path before its match: plain Python beats numpy's calls
        return _encode_one(requests[0])
    users = [r.user for r in requests]
    # per request: country code, region, city, locale (-1: none), then the int fields in _INT_FIELDS' order
    ints = np.array([(country_code(u.country), u.region, u.city, u.locale, u.age, u.gender,
                      _PUBLISHER_INDEX[c.publisher_platform], _DEVICE_INDEX[c.device_platform], _OS_INDEX[c.user_os],
                      c.time) for u, c in ((r.user, r.context) for r in requests)], np.int64).reshape(n, 10).T.copy()
    place = np.array([(u.latitude, u.longitude) for u in users], np.float64).reshape(n, 2).T.copy()
    # the ids of request 0's namespaces in _ID_KEYS' order, then request 1's, ...
    empty: frozenset[int] = frozenset()
    sets = [ids.get(key, empty) for ids in (u.ids for u in users) for key in _ID_KEYS]
    counts = np.fromiter(map(len, sets), np.int64, len(sets))
    ids = np.fromiter(itertools.chain.from_iterable(sets), np.int64, int(counts.sum()))
    id_terms = np.repeat(np.tile(_ID_CODES, n), counts) | ids
    id_req = np.repeat(np.arange(n, dtype=np.int64), counts.reshape(n, len(_ID_KEYS)).sum(axis=1))
    return _encoded(n, ints[:4].T, [id_req], [id_terms], latitude=place[0], longitude=place[1],
                    **dict(zip(_INT_FIELDS, ints[4:])))


_ID_KEY_CODES = tuple((key, int(code)) for key, code in zip(_ID_KEYS, _ID_CODES))
_SCALAR_CODE_INTS = tuple(int(code) for code in _SCALAR_CODES)


def _encode_one(request: Request) -> EncodedBatch:
    """`encode_requests` of one request: its terms made unique by a set and sorted in Python, its fields
    one array of integers (the same arrays as the batch form, in a third of the time)."""
    u, c = request.user, request.context
    terms = {code | v for code, v in zip(_SCALAR_CODE_INTS, (country_code(u.country), u.region, u.city, u.locale))
             if v >= 0}
    ids = u.ids
    for key, code in _ID_KEY_CODES:
        got = ids.get(key)
        if got:
            terms.update([code | int(i) for i in got])
    ints = np.array([u.age, u.gender, _PUBLISHER_INDEX[c.publisher_platform], _DEVICE_INDEX[c.device_platform],
                     _OS_INDEX[c.user_os], c.time], np.int64)
    place = np.array([u.latitude, u.longitude], np.float64)
    return EncodedBatch(terms=np.array(sorted(terms), np.int64), term_ptr=np.array([0, len(terms)], np.int64),
                        latitude=place[0:1], longitude=place[1:2],
                        **{name: ints[i:i + 1] for i, name in enumerate(_INT_FIELDS)})


def encode_arrays(n: int, scalar_ids: np.ndarray, id_lists: dict, **fields) -> EncodedBatch:
    """The `EncodedBatch` of n requests given as arrays: `scalar_ids` int64 (n, 4), each request's
    country code, region, city and locale (-1: none); `id_lists` key of USER_ID_KEYS -> (counts
    int64 (n,), the ids of request 0, then of request 1, ...); `fields`: the `EncodedBatch` arrays
    age, gender, latitude, longitude, publisher, device, os, time."""
    parts_req, parts_term = [], []
    for key, ns in _ID_NAMESPACES:
        if key in id_lists:
            counts, ids = id_lists[key]
            parts_req.append(np.repeat(np.arange(n, dtype=np.int64), counts))
            parts_term.append((np.int64(ns) << TERM_SHIFT) | np.asarray(ids, np.int64))
    return _encoded(n, scalar_ids, parts_req, parts_term, **fields)


def _encoded(n: int, scalar_ids: np.ndarray, parts_req: list, parts_term: list, **fields) -> EncodedBatch:
    """The `EncodedBatch` of n requests: the terms of `scalar_ids` (int64 (n, 4), as `encode_arrays`
    takes them) and the id terms already namespaced (`parts_term`, each term's request in
    `parts_req`), sorted and unique per request; `fields` as `encode_arrays` takes them."""
    has = scalar_ids >= 0
    parts_req = [np.repeat(np.arange(n, dtype=np.int64), has.sum(axis=1)), *parts_req]
    parts_term = [(_SCALAR_CODES[None, :] | scalar_ids)[has], *parts_term]
    terms, ptr = _sorted_unique_per_request(np.concatenate(parts_req), np.concatenate(parts_term), n)
    return EncodedBatch(terms=terms, term_ptr=ptr, **{name: np.asarray(v) for name, v in fields.items()})


def _clause_holds(ct: CompiledTargeting, j: int, enc: EncodedRequest) -> bool:
    """The user holds one of clause j's terms, or lies inside one of its circles (boundary
    inclusive; a NaN location is inside none, as every comparison with NaN is false)."""
    clause_terms = ct.terms[ct.term_ptr[j] : ct.term_ptr[j + 1]]
    if len(clause_terms) and len(enc.terms):
        pos = np.searchsorted(enc.terms, clause_terms)
        pos = np.minimum(pos, len(enc.terms) - 1)
        if np.any(enc.terms[pos] == clause_terms):
            return True
    for q in range(ct.circle_ptr[j], ct.circle_ptr[j + 1]):
        lat, lon, radius_km = ct.circles[q]
        if haversine_km(enc.latitude, enc.longitude, lat, lon) <= radius_km:
            return True
    return False


def eligible_compiled(ct: CompiledTargeting, i: int, enc: EncodedRequest) -> bool:
    """Ad i (slot i) of `ct` against one encoded request, in plain Python: the formula every index
    implements (residual columns, then every positive clause holds and no negative clause does).
    Tested equal to `andromeda_nb.oracle.eligible`."""
    if ct.status[i] != ACTIVE:
        return False
    if not ct.start_time[i] <= enc.time < ct.end_time[i]:
        return False
    if not ct.age_min[i] <= enc.age <= ct.age_max[i]:
        return False
    if not (int(ct.gender_mask[i]) >> enc.gender) & 1:
        return False
    if not (int(ct.publisher_mask[i]) >> enc.publisher) & 1:
        return False
    if not (int(ct.device_mask[i]) >> enc.device) & 1:
        return False
    if not (int(ct.os_mask[i]) >> enc.os) & 1:
        return False
    for j in range(ct.clause_ptr[i], ct.clause_ptr[i + 1]):
        if _clause_holds(ct, j, enc) == bool(ct.clause_negative[j]):
            return False
    return True
