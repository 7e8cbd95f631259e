"""The targeting oracle: DESIGN section 2's table evaluated literally, one ad against one request.

Plain Python on the validated value types, slow on purpose and written to be read beside the table:
every index (the CPU inverted index, the GPU index, the compiled form's `eligible_compiled`) is
tested against `eligible`. It does not use `andromeda_nb.compiled`, so a bug there cannot hide here.

`OracleIndex` is the oracle as a `TargetingIndex` (`andromeda match --arch oracle`): it checks every
live ad against every request.

Custom locations are decided with the oracle's own great-circle distance (`great_circle_km`: the
chord between the two points as unit vectors, turned into an arc), derived differently from the
haversine form `andromeda_nb.geo.haversine_km` that every index shares: one wrong formula cannot
make both agree. The two agree to about 1e-12 km at the radii that matter (tests/core/test_distances.py),
far inside DESIGN section 2's 1e-6 km boundary allowance.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping, Sequence

import numpy as np

from .constants import AGE_HIGHEST, EARTH_RADIUS_KM
from .types import Ad, GeoSpec, Request, Retire, SetStatus, TargetingSpec, Upsert, Update, User


def _unit_vector(lat_deg: float, lon_deg: float) -> tuple[float, float, float]:
    lat, lon = math.radians(lat_deg), math.radians(lon_deg)
    return (math.cos(lat) * math.cos(lon), math.cos(lat) * math.sin(lon), math.sin(lat))


def great_circle_km(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    """Distance in km on the sphere of DESIGN section 2, from the straight chord c between the points
    as unit vectors: the arc is 2 asin(c / 2). Exact to rounding for the short arcs a radius can
    cover (near antipodes the arcsine loses digits, where no radius reaches)."""
    a, b = _unit_vector(lat1, lon1), _unit_vector(lat2, lon2)
    chord = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)))
    return 2.0 * EARTH_RADIUS_KM * math.asin(min(1.0, chord / 2.0))


def in_custom_location(user: User, latitude: float, longitude: float, radius_km: float) -> bool:
    """The user's point lies within the circle, boundary included. A user without a known location
    (NaN coordinates) lies in no circle."""
    if math.isnan(user.latitude) or math.isnan(user.longitude):
        return False
    return great_circle_km(user.latitude, user.longitude, latitude, longitude) <= radius_km


def matches_geo(geo: GeoSpec, user: User) -> bool:
    """The user's country, region or city is listed, or the user lies within a custom location."""
    if user.country and user.country in geo.countries:
        return True
    if user.region in geo.regions or user.city in geo.cities:
        return True
    return any(in_custom_location(user, c.latitude, c.longitude, c.radius_km) for c in geo.custom_locations)


def holds_any(user: User, obj: Mapping[str, frozenset[int]]) -> bool:
    """The user holds at least one id listed under any key of a flexible_spec / exclusions object;
    ids match only within their own key."""
    return any(not user.id_set(key).isdisjoint(ids) for key, ids in obj.items())


def spec_matches(spec: TargetingSpec, request: Request) -> bool:
    """Every present constraint of the targeting spec holds for the request's user and context."""
    user, ctx = request.user, request.context
    if user.age < spec.age_min:
        return False
    if spec.age_max != AGE_HIGHEST and user.age > spec.age_max:  # 65 means "65 and older"
        return False
    if spec.genders is not None and user.gender not in spec.genders:
        return False
    if spec.geo_locations is not None and not matches_geo(spec.geo_locations, user):
        return False
    if spec.excluded_geo_locations is not None and matches_geo(spec.excluded_geo_locations, user):
        return False
    if spec.locales is not None and user.locale not in spec.locales:
        return False
    if spec.publisher_platforms is not None and ctx.publisher_platform not in spec.publisher_platforms:
        return False
    if spec.device_platforms is not None and ctx.device_platform not in spec.device_platforms:
        return False
    if spec.user_os is not None and ctx.user_os not in spec.user_os:
        return False
    if not all(holds_any(user, obj) for obj in spec.flexible_spec):
        return False
    if spec.exclusions is not None and holds_any(user, spec.exclusions):
        return False
    audiences = user.id_set("custom_audiences")
    if spec.custom_audiences is not None and audiences.isdisjoint(spec.custom_audiences):
        return False
    excluded = spec.excluded_custom_audiences
    if excluded is not None and not audiences.isdisjoint(excluded):
        return False
    return True


def in_schedule(ad: Ad, time: int) -> bool:
    """start_time <= time < end_time, a null bound being open."""
    if ad.start_time is not None and time < ad.start_time:
        return False
    if ad.end_time is not None and time >= ad.end_time:
        return False
    return True


def eligible(ad: Ad, request: Request) -> bool:
    """DESIGN section 2: the ad is ACTIVE, in its schedule, and its targeting matches."""
    return (ad.status == "ACTIVE" and in_schedule(ad, request.context.time)
            and spec_matches(ad.targeting, request))


def _end_state(updates: Iterable[Update]) -> tuple["OracleIndex", set[int], dict[int, str]]:
    """An update stream (checked, in order) reduced to its end state per id: (the ads it created or
    replaced, in their final state; the ids whose original ad is gone; the status set on original
    ads that remain)."""
    upserted = OracleIndex()
    replaced: set[int] = set()
    status: dict[int, str] = {}
    for update in updates:
        ad_id = update.ad.ad_id if isinstance(update, Upsert) else update.ad_id
        if isinstance(update, Upsert) or isinstance(update, Retire):
            replaced.add(ad_id)
            status.pop(ad_id, None)
        if ad_id in upserted.ads or isinstance(update, Upsert):
            upserted.apply(update)
        elif isinstance(update, SetStatus):
            status[ad_id] = update.status
    return upserted, replaced, status


def _original_hits(ads: Iterable[Ad], requests: Sequence[Request], replaced: set[int],
                   status: dict[int, str]) -> list[list[int]]:
    """Per request, the ids of the original ads (not replaced, status as changed) that are eligible."""
    hits: list[list[int]] = [[] for _ in requests]
    for ad in ads:
        if ad.ad_id in replaced:
            continue
        if ad.ad_id in status:
            ad = dataclasses.replace(ad, status=status[ad.ad_id])
        for j, request in enumerate(requests):
            if eligible(ad, request):
                hits[j].append(ad.ad_id)
    return hits


def _merge(hit_lists: Iterable[list[list[int]]], upserted: "OracleIndex", requests) -> list[np.ndarray]:
    parts: list[list[np.ndarray]] = [[e] for e in upserted.match(requests)]
    for hits in hit_lists:
        for j, h in enumerate(hits):
            parts[j].append(np.asarray(h, np.int64))
    return [np.unique(np.concatenate(p)) for p in parts]


def match_stream(ad_chunks: Iterable[Sequence[Ad]], requests: Sequence[Request],
                 updates: Iterable[Update] = ()) -> list[np.ndarray]:
    """What `OracleIndex.build(ads)` answers after `updates` (already checked against the live
    ids, applied in order), for ads that arrive in chunks: memory for one chunk of parsed ads, not
    for the whole corpus. The stream is first reduced to its end state per id, then every original
    ad still live is checked with `eligible` as it streams by, and the upserted ads after.
    Eligible ad ids per request: int64, ascending."""
    upserted, replaced, status = _end_state(updates)
    hits = (_original_hits(chunk, requests, replaced, status) for chunk in ad_chunks)
    return _merge(hits, upserted, requests)


def _group_hits(loader, group: int, requests, replaced, status) -> list[list[int]]:
    return _original_hits(loader.group(group), requests, replaced, status)


def match_corpus(dataset, requests: Sequence[Request], updates: Iterable[Update] = (), *, workers: int = 1,
                 progress=None) -> list[np.ndarray]:
    """`match_stream` over a dataset's ads, in `workers` processes when the dataset was read from a
    corpus directory (each process parses one Parquet row group at a time and checks it with
    `eligible`: the oracle's work splits across cores, still plain Python). `progress(n)` is told
    each finished row group (n = row groups done). Same answer as `match_stream`."""
    updates = list(updates)
    loader = getattr(dataset, "_ads_loader", None)
    if workers <= 1 or dataset.ads_loaded or not hasattr(loader, "n_groups"):
        return match_stream(dataset.ad_chunks(), requests, updates)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    upserted, replaced, status = _end_state(updates)
    n = loader.n_groups()
    # spawned, not forked: the caller may hold a CUDA context or threads
    with ProcessPoolExecutor(min(workers, n), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_group_hits, loader, g, list(requests), replaced, status) for g in range(n)]
        results = []
        for done, future in enumerate(as_completed(futures), 1):
            results.append(future.result())
            if progress is not None:
                progress(done)
    return _merge(results, upserted, requests)


class OracleIndex:
    """`interfaces.TargetingIndex` by brute force over the live ads (a dict in insertion order)."""

    def __init__(self) -> None:
        self.ads: dict[int, Ad] = {}

    @classmethod
    def build(cls, ads: Sequence[Ad]) -> "OracleIndex":
        index = cls()
        for ad in ads:
            if ad.ad_id in index.ads:
                raise ValueError(f"duplicate ad id {ad.ad_id}")
            index.ads[ad.ad_id] = ad
        return index

    def match(self, requests: Sequence[Request]) -> list[np.ndarray]:
        out = []
        for request in requests:
            ids = sorted(ad_id for ad_id, ad in self.ads.items() if eligible(ad, request))
            out.append(np.asarray(ids, np.int64))
        return out

    def apply(self, update: Update) -> None:
        if isinstance(update, Upsert):
            self.ads[update.ad.ad_id] = update.ad
        elif isinstance(update, SetStatus):
            self.ads[update.ad_id] = dataclasses.replace(self.ads[update.ad_id], status=update.status)
        elif isinstance(update, Retire):
            del self.ads[update.ad_id]
        else:
            raise TypeError(f"not an update: {update!r}")

    def __len__(self) -> int:
        return len(self.ads)
