"""The value types every part of the project passes around: ads, targeting specs, users, requests.

These are plain, immutable containers. Parsing and validation live in `andromeda_nb.targeting`
(`parse_ad`, `parse_targeting`, `parse_request`); eligibility lives in `andromeda_nb.oracle`.
A `TargetingSpec` is the validated, normalized form of DESIGN section 2's JSON object: defaults are
filled in (age_min 18, age_max 65), units are converted (custom-location radii in km), and every
optional constraint that is absent is `None` (meaning "no constraint").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np


class TargetingError(ValueError):
    """A spec, ad, request or update that breaks the contract.

    `path` is the JSON path of the offending value, e.g. `targeting.flexible_spec[2].interests[7]`.
    `line` is the 1-based line of a JSON Lines file the value came from, when known;
    `request_id` the request it belongs to, when it is a request's. The text names them in one
    order for ads and requests alike, outermost first: `line 3: ad 6: status: ...`,
    `line 4: request 1: user.age: ...`.
    """

    def __init__(self, ad_id, path: str, message: str, *, line: int | None = None, request_id=None):
        self.ad_id = ad_id
        self.request_id = request_id
        self.path = path
        self.message = message
        self.line = line
        where = (f"ad {ad_id}" if ad_id is not None else f"request {request_id}" if request_id is not None
                 else "input")
        if line is not None:
            where = f"line {line}: {where}"
        super().__init__(f"{where}: {path}: {message}" if path else f"{where}: {message}")


@dataclass(frozen=True)
class CustomLocation:
    latitude: float
    longitude: float
    radius_km: float  # converted from miles where the spec said so


@dataclass(frozen=True)
class GeoSpec:
    countries: frozenset[str] = frozenset()
    regions: frozenset[int] = frozenset()
    cities: frozenset[int] = frozenset()
    custom_locations: tuple[CustomLocation, ...] = ()


@dataclass(frozen=True)
class TargetingSpec:
    age_min: int = 18
    age_max: int = 65  # 65 means "65 and older"
    genders: frozenset[int] | None = None
    geo_locations: GeoSpec | None = None
    excluded_geo_locations: GeoSpec | None = None
    locales: frozenset[int] | None = None
    publisher_platforms: frozenset[str] | None = None
    device_platforms: frozenset[str] | None = None
    user_os: frozenset[str] | None = None
    # each object maps a FLEX_KEYS key to its non-empty id set; OR within an object, AND across
    flexible_spec: tuple[Mapping[str, frozenset[int]], ...] = ()
    exclusions: Mapping[str, frozenset[int]] | None = None
    custom_audiences: frozenset[int] | None = None
    excluded_custom_audiences: frozenset[int] | None = None


@dataclass(frozen=True)
class Ad:
    ad_id: int
    targeting: TargetingSpec
    status: str = "ACTIVE"
    start_time: int | None = None
    end_time: int | None = None
    format: int = 0
    # the targeting object as given (JSON-ready), kept so that export round-trips exactly
    targeting_json: Mapping = field(default_factory=dict, compare=False, hash=False)
    # float32 (D,) or None when the line carried none (the corpus generates it from id and seed)
    embedding: np.ndarray | None = field(default=None, compare=False, hash=False)


@dataclass(frozen=True)
class User:
    age: int
    gender: int = 0
    country: str = ""
    region: int = -1
    city: int = -1
    latitude: float = 0.0
    longitude: float = 0.0
    locale: int = -1
    # USER_ID_KEYS key -> frozenset of ids (absent keys: empty)
    ids: Mapping[str, frozenset[int]] = field(default_factory=dict)

    def id_set(self, key: str) -> frozenset[int]:
        return self.ids.get(key, frozenset())


@dataclass(frozen=True)
class Context:
    publisher_platform: str
    device_platform: str
    user_os: str
    time: int


@dataclass(frozen=True)
class Request:
    request_id: int
    user: User
    context: Context
    # float32 (E, S): signal group e feeds expert e
    signals: np.ndarray = field(compare=False, hash=False)


# --- updates (DESIGN section 6) ---------------------------------------------------------------------


@dataclass(frozen=True)
class Upsert:
    ad: Ad


@dataclass(frozen=True)
class SetStatus:
    ad_id: int
    status: str


@dataclass(frozen=True)
class Retire:
    ad_id: int


Update = Upsert | SetStatus | Retire
