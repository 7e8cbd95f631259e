"""Seeded synthetic corpus: ads and requests with the shapes of a real ads system.

What it makes (all from one seed, identical on every run):

* a geo world: about 60 real countries (ISO-3166 alpha-2, approximate centroids, a user share that
  falls off with rank), regions inside each country and cities inside each region, with
  coordinates; region and city ids are globally unique ints;
* ads in the JSON shape of DESIGN section 2: country, region, city and (a few percent) custom-location
  targeting, sometimes geo exclusions; age ranges, genders, locales, placements; one to several
  flexible_spec objects whose ids are Zipf-distributed over vocabularies of realistic sizes
  (`VOCABULARY`), exclusions, custom audiences out of 100,000; paused, archived and deleted ads;
  start and end times around a fixed `NOW`; a format in 0..F-1 and an embedding from
  `derive.ad_embeddings`;
* requests whose users live in the same world (a city inside its region inside its country, a point
  near the city), hold Zipf-distributed ids from the same vocabularies, and come with a context
  (placement, time in the two weeks after `NOW`) and signals from `derive.request_signals_many`.

Ids of different vocabularies overlap on purpose (interest 7 and behavior 7 both exist), so an
implementation that mixes up the namespaces is caught.

The settings in `CorpusSettings` are tuned so that a typical request finds about 1% to 20% of the
pool eligible (`andromeda generate` prints the distribution). Ads are made in chunks of
`CHUNK_ADS` with one random stream per chunk; the per-ad work is a short Python loop over values
drawn in bulk with numpy, so a million ads take a few tens of seconds.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Iterator

import numpy as np

from . import derive
from .constants import (
    DATA_EPOCH as NOW,  # schedules are drawn around it, requests in the 14 days after
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

CHUNK_ADS = 65_536

VOCABULARY = {
    "interests": 20_000,
    "behaviors": 1_000,
    "life_events": 50,
    "industries": 30,
    "income": 10,
    "family_statuses": 10,
    "education_statuses": 10,
    "relationship_statuses": 10,
    "work_positions": 5_000,
}
CUSTOM_AUDIENCES = 100_000
LOCALES = 60

# code, centroid latitude, longitude, half-extent in degrees (regions are spread over about this much)
COUNTRIES = (
    ("US", 39.8, -98.6, 12.0), ("IN", 22.0, 79.0, 9.0), ("BR", -10.0, -52.0, 10.0),
    ("ID", -2.0, 118.0, 8.0), ("MX", 23.0, -102.0, 7.0), ("PH", 12.0, 122.0, 4.0),
    ("VN", 16.0, 107.0, 4.0), ("GB", 54.0, -2.0, 3.0), ("DE", 51.0, 10.0, 3.0),
    ("FR", 46.5, 2.5, 3.5), ("TR", 39.0, 35.0, 4.0), ("TH", 15.0, 101.0, 4.0),
    ("EG", 27.0, 30.0, 4.0), ("IT", 42.5, 12.5, 3.0), ("ES", 40.0, -4.0, 3.5),
    ("NG", 9.0, 8.0, 4.5), ("PK", 30.0, 70.0, 5.0), ("BD", 24.0, 90.0, 2.0),
    ("JP", 36.0, 138.0, 4.0), ("KR", 36.0, 128.0, 1.5), ("CO", 4.0, -73.0, 4.0),
    ("AR", -34.0, -64.0, 7.0), ("CA", 56.0, -106.0, 10.0), ("PL", 52.0, 19.0, 2.5),
    ("MY", 4.0, 102.0, 3.0), ("SA", 24.0, 45.0, 6.0), ("PE", -10.0, -76.0, 5.0),
    ("DZ", 28.0, 2.0, 6.0), ("MA", 32.0, -6.0, 3.0), ("UA", 49.0, 32.0, 4.0),
    ("IQ", 33.0, 44.0, 3.0), ("VE", 7.0, -66.0, 4.0), ("CL", -33.0, -71.0, 6.0),
    ("AU", -25.0, 134.0, 10.0), ("ZA", -29.0, 24.0, 5.0), ("KE", 0.0, 38.0, 3.0),
    ("RO", 46.0, 25.0, 2.5), ("NL", 52.2, 5.5, 1.0), ("EC", -1.5, -78.0, 2.0),
    ("GT", 15.5, -90.0, 1.5), ("BE", 50.6, 4.6, 0.8), ("SE", 62.0, 15.0, 4.0),
    ("PT", 39.5, -8.0, 1.5), ("CZ", 49.8, 15.5, 1.5), ("GR", 39.0, 22.0, 2.0),
    ("HU", 47.0, 19.5, 1.5), ("AT", 47.5, 14.5, 1.5), ("CH", 46.8, 8.2, 1.0),
    ("IL", 31.0, 35.0, 1.0), ("AE", 24.0, 54.0, 1.5), ("SG", 1.35, 103.8, 0.2),
    ("NZ", -41.0, 174.0, 3.0), ("IE", 53.0, -8.0, 1.5), ("DK", 56.0, 10.0, 1.5),
    ("NO", 61.0, 9.0, 3.0), ("FI", 64.0, 26.0, 3.0), ("TW", 23.7, 121.0, 1.0),
    ("HK", 22.3, 114.2, 0.2), ("GH", 8.0, -1.0, 2.0), ("KZ", 48.0, 67.0, 7.0),
)

# seed streams (one per kind of draw, so changing one kind never shifts another)
_WORLD_STREAM, _VOCAB_STREAM, _ADS_STREAM, _REQUESTS_STREAM = 11, 12, 13, 14


@dataclass(frozen=True)
class CorpusSettings:
    """The knobs of the generator; stored in meta.json so a corpus says how it was made."""

    # users
    user_interests_median: float = 60.0
    user_behaviors_median: float = 12.0
    user_audiences_median: float = 25.0
    zipf_users: float = 1.0  # exponent of the id popularity users draw from
    # ads
    zipf_ads: float = 0.9  # exponent of the id popularity ads target
    ad_interests_median: float = 6.0
    flex_objects_p: tuple = (0.12, 0.6, 0.2, 0.06, 0.02)  # 0, 1, 2, 3, 4+ objects
    countries_p: tuple = (0.3, 0.12, 0.08, 0.14, 0.18, 0.18)  # 1, 2, 3, 4..8, 8..30, 30..60 countries
    geo_kind_p: tuple = (0.76, 0.12, 0.09, 0.03)  # countries, regions, cities, custom locations
    audience_only_p: float = 0.03  # custom audiences and no geo_locations
    custom_audiences_p: float = 0.08
    excluded_audiences_p: float = 0.05
    exclusions_p: float = 0.08
    excluded_geo_p: float = 0.05
    locales_p: float = 0.08
    status_p: tuple = (0.86, 0.08, 0.035, 0.025)  # ACTIVE, PAUSED, ARCHIVED, DELETED
    formats_skew: float = 0.6  # format f has weight 1 / (f + 1) ** skew


@dataclass
class GeoWorld:
    """Countries > regions > cities, with coordinates (degrees) and user shares.

    Arrays: country_* (C,), region_* (R,), city_* (T,); *_weight are shares within the parent.
    """

    countries: tuple[str, ...]
    country_lat: np.ndarray
    country_lon: np.ndarray
    country_weight: np.ndarray
    country_locale: np.ndarray  # int64 (C,): the country's main locale id
    region_id: np.ndarray  # int64 (R,)
    region_country: np.ndarray  # int64 (R,): index into countries
    region_lat: np.ndarray
    region_lon: np.ndarray
    region_weight: np.ndarray
    city_id: np.ndarray  # int64 (T,)
    city_region: np.ndarray  # int64 (T,): index into region_*
    city_lat: np.ndarray
    city_lon: np.ndarray
    city_weight: np.ndarray
    # derived
    regions_of: list[np.ndarray] = field(default_factory=list)  # per country: region indices
    cities_of: list[np.ndarray] = field(default_factory=list)  # per region: city indices
    city_share: np.ndarray = field(default=None)  # (T,) share of all users living in each city


def _zipf_weights(n: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    return w / w.sum()


def _wrap_lon(lon):
    return (np.asarray(lon) + 180.0) % 360.0 - 180.0


def build_world(seed: int) -> GeoWorld:
    rng = np.random.default_rng([seed, _WORLD_STREAM])
    codes = tuple(c[0] for c in COUNTRIES)
    c_lat = np.array([c[1] for c in COUNTRIES])
    c_lon = np.array([c[2] for c in COUNTRIES])
    c_ext = np.array([c[3] for c in COUNTRIES])
    c_w = _zipf_weights(len(codes), 0.9)
    # a locale is shared by a few countries (think of one language spoken in several)
    locale = rng.integers(1, LOCALES + 1, len(codes))
    locale[:8] = np.arange(1, 9)  # the biggest markets have their own
    r_country, r_lat, r_lon, r_w = [], [], [], []
    for ci in range(len(codes)):
        n = int(np.clip(round(3 + 60 * math.sqrt(c_w[ci])), 3, 40))
        r_country += [ci] * n
        lat = np.clip(c_lat[ci] + rng.uniform(-1, 1, n) * c_ext[ci], -75.0, 75.0)
        lon = _wrap_lon(c_lon[ci] + rng.uniform(-1, 1, n) * c_ext[ci] / max(math.cos(math.radians(c_lat[ci])), 0.3))
        r_lat.append(lat)
        r_lon.append(lon)
        r_w.append(rng.permutation(_zipf_weights(n, 0.8)))
    r_country = np.asarray(r_country, np.int64)
    r_lat, r_lon, r_w = np.concatenate(r_lat), np.concatenate(r_lon), np.concatenate(r_w)
    n_regions = len(r_country)
    region_id = 1000 + np.cumsum(rng.integers(1, 8, n_regions)).astype(np.int64)
    t_region, t_lat, t_lon, t_w = [], [], [], []
    for ri in range(n_regions):
        n = int(rng.integers(3, 21))
        spread = max(c_ext[r_country[ri]] / math.sqrt(n_regions / len(codes)), 0.05)
        t_region += [ri] * n
        t_lat.append(np.clip(r_lat[ri] + rng.normal(0, spread * 0.5, n), -78.0, 78.0))
        lon_stretch = max(math.cos(math.radians(r_lat[ri])), 0.3)
        t_lon.append(_wrap_lon(r_lon[ri] + rng.normal(0, spread * 0.5, n) / lon_stretch))
        t_w.append(_zipf_weights(n, 1.1))  # the first city of a region is its biggest
    t_region = np.asarray(t_region, np.int64)
    city_id = 100_000 + np.cumsum(rng.integers(1, 40, len(t_region))).astype(np.int64)
    world = GeoWorld(
        countries=codes, country_lat=c_lat, country_lon=c_lon, country_weight=c_w,
        country_locale=locale.astype(np.int64), region_id=region_id, region_country=r_country,
        region_lat=r_lat, region_lon=r_lon, region_weight=r_w, city_id=city_id, city_region=t_region,
        city_lat=np.concatenate(t_lat), city_lon=np.concatenate(t_lon), city_weight=np.concatenate(t_w),
    )
    world.regions_of = [np.flatnonzero(r_country == ci) for ci in range(len(codes))]
    world.cities_of = [np.flatnonzero(t_region == ri) for ri in range(n_regions)]
    world.city_share = c_w[r_country[t_region]] * r_w[t_region] * world.city_weight
    return world


@dataclass
class Vocabulary:
    """Per id key: the ids in popularity order (rank 0 is the most popular) and the cumulative
    popularity that users and ads draw from."""

    ids: dict[str, np.ndarray]
    user_cdf: dict[str, np.ndarray]
    ad_cdf: dict[str, np.ndarray]


def build_vocabulary(seed: int, settings: CorpusSettings) -> Vocabulary:
    rng = np.random.default_rng([seed, _VOCAB_STREAM])
    sizes = dict(VOCABULARY, custom_audiences=CUSTOM_AUDIENCES)
    ids, user_cdf, ad_cdf = {}, {}, {}
    for key, n in sizes.items():
        if key == "custom_audiences":  # audience ids look like the long ids of a real system
            ids[key] = 23_800_000_000 + 7919 * rng.permutation(n).astype(np.int64)
        else:  # small ids, overlapping across keys on purpose
            ids[key] = 1 + rng.permutation(n).astype(np.int64)
        user_cdf[key] = np.cumsum(_zipf_weights(n, settings.zipf_users))
        ad_cdf[key] = np.cumsum(_zipf_weights(n, settings.zipf_ads))
    return Vocabulary(ids, user_cdf, ad_cdf)


def _draw_lists(rng, counts: np.ndarray, ids: np.ndarray, cdf: np.ndarray) -> list[list[int]]:
    """One list per entry of `counts`: that many popularity-weighted draws, deduplicated and sorted.
    An entry with count 0 gives an empty list."""
    counts = np.asarray(counts, np.int64)
    total = int(counts.sum())
    drawn = ids[np.minimum(np.searchsorted(cdf, rng.random(total) * cdf[-1], side="right"), len(ids) - 1)]
    owner = np.repeat(np.arange(len(counts)), counts)
    order = np.lexsort((drawn, owner))
    drawn, owner = drawn[order], owner[order]
    keep = np.ones(total, bool)
    keep[1:] = (drawn[1:] != drawn[:-1]) | (owner[1:] != owner[:-1])
    drawn, owner = drawn[keep], owner[keep]
    bounds = np.searchsorted(owner, np.arange(len(counts) + 1)).tolist()
    flat = drawn.tolist()
    return [flat[bounds[i] : bounds[i + 1]] for i in range(len(counts))]


def _lognormal_counts(rng, n: int, median: float, sigma: float, lo: int, hi: int) -> np.ndarray:
    return np.clip(np.rint(median * np.exp(sigma * rng.standard_normal(n))), lo, hi).astype(np.int64)


def _choice_index(rng, p, n: int) -> np.ndarray:
    p = np.asarray(p, np.float64)
    return np.minimum(np.searchsorted(np.cumsum(p / p.sum()), rng.random(n), side="right"), len(p) - 1)


def _round(x: float, digits: int = 6) -> float:
    return float(round(float(x), digits))


# --- ads --------------------------------------------------------------------------------------------


@dataclass
class AdColumns:
    """A chunk of generated ads, column by column (row i is one ad)."""

    ad_id: np.ndarray  # int64 (n,)
    status: list[str]
    start_time: list[int | None]
    end_time: list[int | None]
    format: np.ndarray  # int16 (n,)
    targeting: list[str]  # JSON text of each ad's targeting object
    embedding: np.ndarray  # float32 (n, D)
    compiled: object = None  # compiled.CompiledTargeting of the chunk (iter_ads(..., compile=True))

    def __len__(self) -> int:
        return len(self.ad_id)

    def ad_object(self, i: int, *, with_embedding: bool = True) -> dict:
        """Ad i as a JSON Lines object of DESIGN section 2."""
        obj = {
            "ad_id": int(self.ad_id[i]),
            "status": self.status[i],
            "start_time": self.start_time[i],
            "end_time": self.end_time[i],
            "format": int(self.format[i]),
            "targeting": json.loads(self.targeting[i]),
        }
        if with_embedding:
            obj["embedding"] = self.embedding[i].astype(np.float64).tolist()
        return obj

    def ad_objects(self) -> Iterator[dict]:
        for i in range(len(self)):
            yield self.ad_object(i)


_PUBLISHER_CHOICES = (
    None, ("facebook",), ("instagram",), ("facebook", "instagram"),
    ("facebook", "instagram", "messenger"), ("facebook", "audience_network"), ("audience_network",),
    ("facebook", "instagram", "audience_network", "messenger"),
)
_PUBLISHER_P = (0.45, 0.12, 0.1, 0.18, 0.06, 0.03, 0.02, 0.04)
_DEVICE_CHOICES = (None, ("mobile",), ("mobile", "desktop"), ("desktop",), ("connected_tv",))
_DEVICE_P = (0.55, 0.3, 0.1, 0.04, 0.01)
_OS_CHOICES = (None, ("iOS",), ("Android",), ("iOS", "Android"), ("Windows", "macOS"))
_OS_P = (0.9, 0.035, 0.035, 0.02, 0.01)
_AGE_MIN_CHOICES = (None, 13, 18, 21, 25, 30, 35, 45)
_AGE_MIN_P = (0.45, 0.03, 0.25, 0.08, 0.1, 0.04, 0.03, 0.02)
_AGE_MAX_CHOICES = (None, 65, 24, 34, 44, 54, 64)
_AGE_MAX_P = (0.65, 0.1, 0.05, 0.07, 0.05, 0.04, 0.04)
_GENDER_CHOICES = (None, (1,), (2,), (1, 2))
_GENDER_P = (0.8, 0.09, 0.09, 0.02)
# how often a flexible_spec object carries each key besides interests, and the median id count
_FLEX_EXTRA_P = {
    "behaviors": 0.2, "life_events": 0.05, "industries": 0.04, "income": 0.04, "family_statuses": 0.03,
    "education_statuses": 0.03, "relationship_statuses": 0.03, "work_positions": 0.03,
}
_FLEX_MEDIAN = {
    "behaviors": 3.0, "life_events": 1.5, "industries": 1.5, "income": 2.0, "family_statuses": 1.5,
    "education_statuses": 1.5, "relationship_statuses": 1.5, "work_positions": 3.0,
}


class _AdChunkMaker:
    """Draws one chunk of ads. Every random quantity is drawn in bulk with numpy up front; `make`
    then only assembles the JSON objects from plain Python lists."""

    def __init__(self, world: GeoWorld, vocab: Vocabulary, settings: CorpusSettings, formats: int):
        self.world = world
        self.vocab = vocab
        self.s = settings
        self.formats = formats
        self.format_p = 1.0 / (np.arange(formats) + 1.0) ** settings.formats_skew
        self.city_cdf = np.cumsum(world.city_share)
        self.log_country_weight = np.log(world.country_weight)
        self.country_codes = np.array(world.countries, dtype=object)
        # the biggest city of every region, as ids, and region ids, per country
        self.region_ids_of = [world.region_id[r].tolist() for r in world.regions_of]
        self.big_city_of = [[int(world.city_id[world.cities_of[r][0]]) for r in regs] for regs in world.regions_of]

    def _ids(self, rng, key: str, counts) -> list[list[int]]:
        return _draw_lists(rng, counts, self.vocab.ids[key], self.vocab.ad_cdf[key])

    def _countries(self, rng, n_countries: np.ndarray) -> list[list[str]]:
        """Weighted sampling without replacement (Gumbel top-m): big markets are picked most often.
        Each list comes out in the order of COUNTRIES."""
        n, c = len(n_countries), len(self.world.countries)
        keys = self.log_country_weight[None, :] + rng.gumbel(size=(n, c))
        rank = np.empty((n, c), np.int64)
        np.put_along_axis(rank, np.argsort(-keys, axis=1), np.arange(c)[None, :], axis=1)
        rows, cols = np.nonzero(rank < np.asarray(n_countries)[:, None])
        flat = self.country_codes[cols].tolist()
        bounds = np.searchsorted(rows, np.arange(n + 1)).tolist()
        return [flat[bounds[i] : bounds[i + 1]] for i in range(n)]

    def _circles(self, rng, n: int) -> list[list[dict]]:
        w = self.world
        n_circles = rng.integers(1, 4, n).tolist()
        total = int(sum(n_circles))
        city = np.minimum(np.searchsorted(self.city_cdf, rng.random(total) * self.city_cdf[-1]), len(w.city_id) - 1)
        lat = np.round(np.clip(w.city_lat[city] + rng.normal(0.0, 0.05, total), -89.0, 89.0), 6).tolist()
        lon = np.round(_wrap_lon(w.city_lon[city] + rng.normal(0.0, 0.05, total)), 6).tolist()
        miles = np.repeat(rng.random(n) < 0.3, n_circles)
        radius = np.round(1.0 + rng.gamma(1.5, 8.0, total), 1)
        radius = np.where(miles, np.minimum(radius, 50.0), np.minimum(radius, 80.0)).tolist()
        units = np.where(miles, "mile", "kilometer").tolist()
        circles = [{"latitude": lat[j], "longitude": lon[j], "radius": radius[j], "distance_unit": units[j]}
                   for j in range(total)]
        bounds = np.concatenate([[0], np.cumsum(n_circles)]).tolist()
        return [circles[bounds[i] : bounds[i + 1]] for i in range(n)]

    def _geo(self, rng, n: int) -> list[dict | None]:
        """geo_locations per ad (None for the audience-only ads)."""
        w, s = self.world, self.s
        kind = _choice_index(rng, s.geo_kind_p, n)
        kind[rng.random(n) < s.audience_only_p] = -1
        n_countries = np.choose(
            _choice_index(rng, s.countries_p, n),
            [np.ones(n, np.int64), np.full(n, 2), np.full(n, 3), rng.integers(4, 9, n), rng.integers(8, 31, n),
             rng.integers(30, 61, n)],
        )
        out: list[dict | None] = [None] * n
        rows = np.flatnonzero(kind == 0)
        for i, codes in zip(rows.tolist(), self._countries(rng, n_countries[rows])):
            out[i] = {"countries": codes}
        # region and city ads stay inside one market: 1..5 of its regions, or their biggest cities
        home = _choice_index(rng, w.country_weight, n).tolist()
        n_sub = rng.integers(1, 6, n).tolist()
        pick = rng.random((n, 5)).tolist()
        for key, k in (("regions", 1), ("cities", 2)):
            table = self.region_ids_of if k == 1 else self.big_city_of
            for i in np.flatnonzero(kind == k).tolist():
                options = table[home[i]]
                out[i] = {key: sorted({options[int(x * len(options))] for x in pick[i][: n_sub[i]]})}
        rows = np.flatnonzero(kind == 3)
        for i, circles in zip(rows.tolist(), self._circles(rng, len(rows))):
            out[i] = {"custom_locations": circles}
        return out

    def _excluded_geo(self, rng, geo: list[dict | None]) -> list[dict | None]:
        """For a few country-targeted ads: exclude one region (or its biggest city) of a listed country."""
        w = self.world
        n = len(geo)
        on = (rng.random(n) < self.s.excluded_geo_p).tolist()
        pick = rng.random((n, 2)).tolist()
        out: list[dict | None] = [None] * n
        for i in range(n):
            g = geo[i]
            if not on[i] or g is None or "countries" not in g:
                continue
            ci = w.countries.index(g["countries"][int(pick[i][0] * len(g["countries"]))])
            j = int(pick[i][1] * len(self.region_ids_of[ci]))
            if pick[i][1] < 0.5:
                out[i] = {"regions": [self.region_ids_of[ci][j]]}
            else:
                out[i] = {"cities": [self.big_city_of[ci][j]]}
        return out

    def _flexible(self, rng, n: int) -> list[list[dict]]:
        s = self.s
        n_obj = _choice_index(rng, s.flex_objects_p, n)
        n_obj = np.where(n_obj == 4, rng.integers(4, 7, n), n_obj)
        total = int(n_obj.sum())
        objects: list[dict] = [{} for _ in range(total)]
        has = {"interests": rng.random(total) < 0.9}
        for key, p in _FLEX_EXTRA_P.items():
            has[key] = rng.random(total) < p
        has["interests"] |= ~np.any(np.stack(list(has.values())), axis=0)  # never an empty object
        for key in FLEX_KEYS:
            rows = np.flatnonzero(has[key])
            if key == "interests":
                counts = _lognormal_counts(rng, len(rows), s.ad_interests_median, 0.9, 1, 200)
            else:
                counts = _lognormal_counts(rng, len(rows), _FLEX_MEDIAN[key], 0.6, 1, 20)
            for row, ids in zip(rows.tolist(), self._ids(rng, key, counts)):
                objects[row][key] = ids
        bounds = np.concatenate([[0], np.cumsum(n_obj)]).tolist()
        return [objects[bounds[i] : bounds[i + 1]] for i in range(n)]

    def _exclusions(self, rng, n: int) -> list[dict | None]:
        keys = ("interests", "behaviors", "life_events", "relationship_statuses")
        key_pick = _choice_index(rng, (0.5, 0.25, 0.1, 0.15), n)
        key_pick[rng.random(n) >= self.s.exclusions_p] = -1
        counts = rng.integers(1, 6, n)
        out: list[dict | None] = [None] * n
        for j, key in enumerate(keys):
            rows = np.flatnonzero(key_pick == j)
            for i, ids in zip(rows.tolist(), self._ids(rng, key, counts[rows])):
                out[i] = {key: ids}
        return out

    def _audiences(self, rng, n: int, p: float, force=None) -> list[list[int] | None]:
        on = rng.random(n) < p
        if force is not None:
            on |= force
        counts = rng.integers(1, 6, n)
        rows = np.flatnonzero(on)
        out: list[list[int] | None] = [None] * n
        for i, ids in zip(rows.tolist(), self._ids(rng, "custom_audiences", counts[rows])):
            out[i] = ids
        return out

    def _schedule(self, rng, n: int) -> tuple[list, list]:
        has_start = rng.random(n) < 0.5
        future_start = rng.random(n) < 0.06
        start = np.where(future_start, NOW + rng.integers(DAY // 24, 30 * DAY, n), NOW - rng.integers(0, 120 * DAY, n))
        has_end = rng.random(n) < 0.45
        past_end = rng.random(n) < 0.08
        end = np.where(past_end, NOW - rng.integers(DAY // 24, 30 * DAY, n), NOW + rng.integers(DAY // 24, 60 * DAY, n))
        end = np.where(has_start & (end <= start), start + rng.integers(DAY, 30 * DAY, n), end)
        return (
            [t if h else None for t, h in zip(start.tolist(), has_start.tolist())],
            [t if h else None for t, h in zip(end.tolist(), has_end.tolist())],
        )

    def _locales(self, rng, geo: list[dict | None]) -> list[list[int] | None]:
        """For a few ads: the main locale of the first targeted country plus up to two others."""
        w = self.world
        n = len(geo)
        on = (rng.random(n) < self.s.locales_p).tolist()
        extra = rng.integers(1, LOCALES + 1, (n, 2)).tolist()
        n_extra = rng.integers(0, 3, n).tolist()
        locale_of = dict(zip(w.countries, w.country_locale.tolist()))
        out: list[list[int] | None] = [None] * n
        for i in range(n):
            if on[i]:
                g = geo[i]
                main = locale_of[g["countries"][0]] if g is not None and "countries" in g else extra[i][1]
                out[i] = sorted({main, *extra[i][: n_extra[i]]})
        return out

    def make(self, rng, n: int) -> tuple[list[str], np.ndarray, list[int | None], list[int | None], list[dict]]:
        """(status, format int16, start_time, end_time, targeting object) for n ads."""
        s = self.s
        geo = self._geo(rng, n)
        columns = {
            "geo_locations": geo,
            "excluded_geo_locations": self._excluded_geo(rng, geo),
            "locales": self._locales(rng, geo),
            "genders": _pick(rng, _GENDER_CHOICES, _GENDER_P, n),
            "publisher_platforms": _pick(rng, _PUBLISHER_CHOICES, _PUBLISHER_P, n),
            "device_platforms": _pick(rng, _DEVICE_CHOICES, _DEVICE_P, n),
            "user_os": _pick(rng, _OS_CHOICES, _OS_P, n),
            "flexible_spec": [x or None for x in self._flexible(rng, n)],
            "exclusions": self._exclusions(rng, n),
            "custom_audiences": self._audiences(rng, n, s.custom_audiences_p, np.array([g is None for g in geo])),
            "excluded_custom_audiences": self._audiences(rng, n, s.excluded_audiences_p),
        }
        age_min = _pick(rng, _AGE_MIN_CHOICES, _AGE_MIN_P, n)
        age_max = _pick(rng, _AGE_MAX_CHOICES, _AGE_MAX_P, n)
        targeting: list[dict] = [{} for _ in range(n)]
        for i, (lo, hi) in enumerate(zip(age_min, age_max)):
            t = targeting[i]
            if lo is not None:
                t["age_min"] = lo
            if hi is not None and hi >= (lo or 18):
                t["age_max"] = hi
        for key in _TARGETING_ORDER:
            for t, value in zip(targeting, columns[key]):
                if value is not None:
                    t[key] = value
        fmt = _choice_index(rng, self.format_p, n).astype(np.int16)
        status = [STATUSES[x] for x in _choice_index(rng, s.status_p, n).tolist()]
        start, end = self._schedule(rng, n)
        return status, fmt, start, end, targeting


# key order of a generated targeting object (after age_min, age_max)
_TARGETING_ORDER = (
    "genders", "geo_locations", "excluded_geo_locations", "locales", "publisher_platforms",
    "device_platforms", "user_os", "flexible_spec", "exclusions", "custom_audiences",
    "excluded_custom_audiences",
)


def _pick(rng, choices: tuple, p: tuple, n: int) -> list:
    """n values drawn from `choices` with probabilities `p`; tuples come back as fresh lists."""
    values = [list(c) if isinstance(c, tuple) else c for c in choices]
    return [values[j] for j in _choice_index(rng, p, n).tolist()]


def _validated_compiled(seed: int, dim: int, formats: int, ad_ids, status, fmt, start, end, targeting):
    """Every generated ad through `targeting.parse_ad` (the checks `import` applies; a failure is a
    generator bug and raises), compiled (`compiled.compile_ads`, row i is ad i)."""
    from .compiled import compile_ads
    from .store import paused_gc
    from .targeting import parse_ad

    with paused_gc():
        ads = [parse_ad({"ad_id": int(ad_ids[i]), "status": status[i], "start_time": start[i],
                         "end_time": end[i], "format": int(fmt[i]), "targeting": targeting[i]},
                        seed=seed, dim=dim, formats=formats, derive_embedding=False, copy_targeting=False)
               for i in range(len(ad_ids))]
        return compile_ads(ads)


def _make_chunk(args) -> AdColumns:
    maker, seed, dim, index, n, first_id, compile_chunk = args
    rng = np.random.default_rng([seed, _ADS_STREAM, index])
    ad_ids = first_id + np.cumsum(rng.integers(1, 10, n)).astype(np.int64)  # ids with gaps
    status, fmt, start, end, targeting = maker.make(rng, n)
    compiled = (_validated_compiled(seed, dim, maker.formats, ad_ids, status, fmt, start, end, targeting)
                if compile_chunk else None)
    encode = json.JSONEncoder(separators=(",", ":")).encode
    return AdColumns(
        ad_id=ad_ids, status=status, start_time=start, end_time=end, format=fmt,
        targeting=[encode(t) for t in targeting], embedding=derive.ad_embeddings(ad_ids, seed, dim),
        compiled=compiled,
    )


def iter_ads(n_ads: int, seed: int, *, dim: int = DEFAULT_D, formats: int = DEFAULT_F,
             settings: CorpusSettings | None = None, world: GeoWorld | None = None,
             chunk: int = CHUNK_ADS, workers: int = 1, compile: bool = False) -> Iterator[AdColumns]:
    """Yield the corpus's ads in chunks of at most `chunk` rows, in ad-id order.

    Chunk c uses its own random stream and starts its ids at 1_000_000 + 10 * c * chunk, so chunks
    are independent: `workers` > 1 makes them in that many processes with identical results.
    `compile=True` also validates every ad (`targeting.parse_ad`) and fills `AdColumns.compiled`.
    """
    settings = settings or CorpusSettings()
    world = world or build_world(seed)
    maker = _AdChunkMaker(world, build_vocabulary(seed, settings), settings, formats)
    jobs = [(maker, seed, dim, index, min(chunk, n_ads - lo), 1_000_000 + 10 * lo, compile)
            for index, lo in enumerate(range(0, n_ads, chunk))]
    if workers <= 1 or len(jobs) <= 1:
        yield from map(_make_chunk, jobs)
        return
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(min(workers, len(jobs))) as pool:
        yield from pool.imap(_make_chunk, jobs)


# --- requests ---------------------------------------------------------------------------------------

_PUBLISHER_TRAFFIC = (0.55, 0.35, 0.05, 0.05)  # in PUBLISHER_PLATFORMS order
_DEVICE_TRAFFIC = (0.8, 0.17, 0.03)
_OS_BY_DEVICE = {  # in USER_OS order
    "mobile": (0.45, 0.55, 0.0, 0.0, 0.0, 0.0),
    "desktop": (0.0, 0.0, 0.68, 0.25, 0.05, 0.02),
    "connected_tv": (0.0, 0.3, 0.0, 0.0, 0.1, 0.6),
}
_AGE_BANDS = ((13, 18, 0.05), (18, 25, 0.2), (25, 35, 0.27), (35, 45, 0.19), (45, 55, 0.13),
              (55, 65, 0.1), (65, 85, 0.06))
# per key: (probability of holding any, median count) for the keys besides interests and behaviors
_USER_FEW = {
    "life_events": (0.35, 1.0), "industries": (0.5, 1.0), "income": (0.8, 1.0),
    "family_statuses": (0.75, 1.0), "education_statuses": (0.8, 1.0),
    "relationship_statuses": (0.7, 1.0), "work_positions": (0.45, 1.5),
}


def make_requests(n_requests: int, seed: int, *, experts: int = DEFAULT_E, width: int = SIGNAL_WIDTH,
                  settings: CorpusSettings | None = None, world: GeoWorld | None = None,
                  first_id: int = 1) -> list[dict]:
    """Request objects of DESIGN section 2 (`request_id`, `user`, `context`, `signals`)."""
    settings = settings or CorpusSettings()
    world = world or build_world(seed)
    vocab = build_vocabulary(seed, settings)
    rng = np.random.default_rng([seed, _REQUESTS_STREAM])
    n = n_requests
    w = world
    city = np.minimum(np.searchsorted(np.cumsum(w.city_share), rng.random(n) * w.city_share.sum()), len(w.city_id) - 1)
    region = w.city_region[city]
    country = w.region_country[region]
    dist_km = np.abs(rng.normal(0.0, 9.0, n))
    bearing = rng.uniform(0.0, 2 * math.pi, n)
    lat = np.clip(w.city_lat[city] + dist_km * np.cos(bearing) / 111.2, -89.9, 89.9)
    lon = _wrap_lon(w.city_lon[city] + dist_km * np.sin(bearing) / (111.2 * np.maximum(np.cos(np.radians(lat)), 0.05)))
    band = _choice_index(rng, [b[2] for b in _AGE_BANDS], n)
    age = np.array([rng.integers(_AGE_BANDS[b][0], _AGE_BANDS[b][1]) for b in band], np.int64)
    gender = _choice_index(rng, (0.04, 0.48, 0.48), n)
    locale = np.where(rng.random(n) < 0.85, w.country_locale[country], rng.integers(1, LOCALES + 1, n))

    def held(key, counts):
        return _draw_lists(rng, counts, vocab.ids[key], vocab.user_cdf[key])

    ids = {
        "interests": held("interests", _lognormal_counts(rng, n, settings.user_interests_median, 0.8, 1, 800)),
        "behaviors": held("behaviors", _lognormal_counts(rng, n, settings.user_behaviors_median, 0.7, 0, 200)),
    }
    for key, (p, median) in _USER_FEW.items():
        counts = np.where(rng.random(n) < p, _lognormal_counts(rng, n, median, 0.5, 1, 5), 0)
        ids[key] = held(key, counts)
    ids["custom_audiences"] = held(
        "custom_audiences", _lognormal_counts(rng, n, settings.user_audiences_median, 1.0, 0, 1000))
    publisher = _choice_index(rng, _PUBLISHER_TRAFFIC, n)
    device = _choice_index(rng, _DEVICE_TRAFFIC, n)
    os_u = rng.random(n)
    when = NOW + rng.integers(0, 14 * DAY, n)
    request_ids = np.arange(first_id, first_id + n, dtype=np.int64)
    signals = derive.request_signals_many(request_ids, seed, experts, width)
    out = []
    for i in range(n):
        dev = DEVICE_PLATFORMS[device[i]]
        os_cdf = np.cumsum(_OS_BY_DEVICE[dev])
        user = {
            "age": int(age[i]),
            "gender": int(gender[i]),
            "country": w.countries[country[i]],
            "region": int(w.region_id[region[i]]),
            "city": int(w.city_id[city[i]]),
            "latitude": _round(lat[i]),
            "longitude": _round(lon[i]),
            "locale": int(locale[i]),
        }
        for key in (*FLEX_KEYS, "custom_audiences"):
            if ids[key][i]:
                user[key] = ids[key][i]
        out.append({
            "request_id": int(request_ids[i]),
            "user": user,
            "context": {
                "publisher_platform": PUBLISHER_PLATFORMS[publisher[i]],
                "device_platform": dev,
                "user_os": USER_OS[min(int(np.searchsorted(os_cdf, os_u[i] * os_cdf[-1], side="right")),
                                       len(USER_OS) - 1)],
                "time": int(when[i]),
            },
            "signals": signals[i].tolist(),
        })
    return out


def settings_dict(settings: CorpusSettings) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(settings).items()}



# --- a corpus directory ------------------------------------------------------------------------------

ELIGIBILITY_SAMPLE_ADS = 4000
ELIGIBILITY_SAMPLE_REQUESTS = 100


@dataclass
class GenerateSummary:
    out_dir: str
    ads: int
    requests: int
    seed: int
    precision: str
    dim: int
    sample_ads: list = field(default_factory=list)  # ad objects of DESIGN section 2, evenly spaced
    request_objects: list = field(default_factory=list)


def generate_corpus(out_dir, n_ads: int, n_requests: int, seed: int, *, dim: int = DEFAULT_D,
                    precision: str = "fp32", experts: int = DEFAULT_E, formats: int = DEFAULT_F,
                    settings: CorpusSettings | None = None, workers: int = 1, progress=None,
                    sample_ads: int = ELIGIBILITY_SAMPLE_ADS) -> GenerateSummary:
    """Write a seeded corpus into `out_dir`: ads.parquet, targeting.npz (every ad validated by
    `targeting.parse_ad` and compiled), requests.parquet, model.npz (from `MoeModel.init(seed)`) and
    meta.json. `progress(n)` is called as ads are written. Keeps an evenly spaced sample of at most
    `sample_ads` ads for `eligible_fractions`."""
    from pathlib import Path

    from . import store
    from .compiled import concat_compiled
    from .model import MoeModel, quantize

    if n_ads < 0 or n_requests < 0:
        raise ValueError("the numbers of ads and requests must not be negative")
    if dim < 1:
        raise ValueError(f"dim must be positive, got {dim}")
    settings = settings or CorpusSettings()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = MoeModel.init(seed, D=dim, E=experts, F=formats)
    world = build_world(seed)
    stride = max(1, -(-n_ads // max(sample_ads, 1)))
    summary = GenerateSummary(str(out), n_ads, n_requests, seed, precision, dim)
    compiled_parts = []
    with store.AdsWriter(out, precision, dim) as writer:
        done = 0
        for cols in iter_ads(n_ads, seed, dim=dim, formats=formats, settings=settings, world=world,
                             workers=workers, compile=True):
            compiled_parts.append(cols.compiled)
            writer.write(store.ads_record_batch(cols.ad_id, cols.status, cols.start_time, cols.end_time,
                                                cols.format, cols.targeting, quantize(cols.embedding, precision)))
            for i in range((-done) % stride, len(cols), stride):
                summary.sample_ads.append(cols.ad_object(i))
            done += len(cols)
            if progress is not None:
                progress(len(cols))
        if n_ads == 0:
            empty = quantize(np.empty((0, dim), np.float32), precision)
            writer.write(store.ads_record_batch([], [], [], [], [], [], empty))
    targeting = store.write_targeting(out, concat_compiled(compiled_parts))
    del compiled_parts
    summary.request_objects = make_requests(n_requests, seed, experts=experts, width=model.S,
                                            settings=settings, world=world)
    store.write_requests(out, summary.request_objects)
    model.save(out / store.MODEL_FILE)
    store.write_meta(out, seed=seed, model=model, precision=precision, n_ads=n_ads, n_requests=n_requests,
                     source={"kind": "generate", "now": NOW, "settings": settings_dict(settings)},
                     targeting=targeting)
    return summary


def eligible_fractions(ad_objects: list[dict], request_objects: list[dict], seed: int, *, dim: int = DEFAULT_D,
                       experts: int = DEFAULT_E, width: int = SIGNAL_WIDTH, formats: int = DEFAULT_F,
                       max_requests: int = ELIGIBILITY_SAMPLE_REQUESTS) -> np.ndarray:
    """Fraction of the given ads the oracle finds eligible, per request (float64, at most
    `max_requests` requests, evenly spaced; empty when there are no ads)."""
    from .oracle import eligible
    from .targeting import parse_ad, parse_request

    ads = [parse_ad(o, seed=seed, dim=dim, formats=formats) for o in ad_objects]
    step = max(1, -(-len(request_objects) // max_requests))
    requests = [parse_request(o, seed=seed, experts=experts, width=width) for o in request_objects[::step]]
    if not ads:
        return np.zeros(0)
    return np.array([sum(eligible(a, r) for a in ads) / len(ads) for r in requests], np.float64)


UPDATES_FILE = "updates.jsonl"


def write_update_stream(out_dir, n: int, seed: int, *, dim: int = DEFAULT_D, formats: int = DEFAULT_F):
    """Write `n` seeded, valid updates against the corpus in `out_dir` (`random_specs.random_update_stream`
    over its ad ids) to `out_dir/updates.jsonl`, one JSON line each (DESIGN section 6). Returns the path."""
    from pathlib import Path

    import pyarrow.parquet as pq

    from .random_specs import random_update_stream
    from .updates import update_to_json

    out = Path(out_dir)
    ad_ids = pq.read_table(out / "ads.parquet", columns=["ad_id"]).column("ad_id").to_numpy()
    path = out / UPDATES_FILE
    with open(path, "w") as f:
        for update in random_update_stream(seed, ad_ids.tolist(), n, dim=dim, formats=formats):
            f.write(json.dumps(update_to_json(update)) + "\n")
    return path
