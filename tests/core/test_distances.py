"""Great-circle distances against independent truth.

Two formulas decide custom locations: `andromeda_nb.geo.haversine_km`, which every index shares, and
the oracle's own `great_circle_km` (a chord between unit vectors). Each is held here to

* published worked examples: Ed Williams' Aviation Formulary, "Worked examples" (LAX 33deg57'N
  118deg24'W to JFK 40deg38'N 73deg47'W: d = 0.623585 radians, 2144 nm;
  https://edwilliams.org/avform147.htm), and Rosetta Code's "Haversine formula" task (BNA
  36.12, -86.67 to LAX 33.94, -118.40: 2887.2599506071106 km on a sphere of 6372.8 km), both
  converted to the project's sphere of 6371.0088 km by their angle;
* closed forms on the sphere: along the equator and a meridian, between a pole and any point, at
  antipodes, and the right angle between (lat1, 0) and (lat2, 90): cos d = sin(lat1) sin(lat2),
  where the latitudes differ, so that the cos(latitude) factors of the haversine form are tested;
* a third formula written here, atan2(|a x b|, a . b) on unit vectors (accurate at every
  distance), at random points including poles, the antimeridian, antipodes and separations down to
  1 metre.

Every check can fail: the same checks run on deliberately wrong formulas (a cos(latitude) factor
dropped, cos(lat1) squared, degrees not converted) and must reject each one.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from andromeda_nb.constants import EARTH_RADIUS_KM as R
from andromeda_nb.geo import haversine_km
from andromeda_nb.oracle import great_circle_km

FORMULAS = {"geo.haversine_km": haversine_km, "oracle.great_circle_km": great_circle_km}
SHORT_KM = 200.0  # below this, agreement to SHORT_TOL_KM (radii are at most 80 km)
SHORT_TOL_KM = 1e-9
LONG_TOL_KM = 1e-3  # near antipodes both forms lose digits to the arcsine


def _dms(deg: int, minutes: float) -> float:
    return deg + minutes / 60.0


def _unit(lat: float, lon: float) -> np.ndarray:
    p, l = math.radians(lat), math.radians(lon)
    return np.array([math.cos(p) * math.cos(l), math.cos(p) * math.sin(l), math.sin(p)])


def atan2_km(lat1, lon1, lat2, lon2) -> float:
    """The independent truth of this file: the angle between the unit vectors by atan2."""
    a, b = _unit(lat1, lon1), _unit(lat2, lon2)
    return R * math.atan2(float(np.linalg.norm(np.cross(a, b))), float(a @ b))


# --- the checks, as functions of a distance formula (so that wrong formulas can be shown to fail) ------


def published_errors(fn) -> list[str]:
    bad = []
    lax, jfk = (_dms(33, 57), -_dms(118, 24)), (_dms(40, 38), -_dms(73, 47))
    want = 0.623585 * R  # radians, printed to 6 decimals
    if abs(fn(*lax, *jfk) - want) > 0.5e-6 * R:
        bad.append(f"LAX-JFK {fn(*lax, *jfk):.6f} km, published {want:.6f}")
    want = 2887.2599506071106 / 6372.8 * R
    if abs(fn(36.12, -86.67, 33.94, -118.40) - want) > 1e-9:
        bad.append(f"BNA-LAX {fn(36.12, -86.67, 33.94, -118.40):.9f} km, published {want:.9f}")
    return bad


def closed_form_errors(fn) -> list[str]:
    rng = np.random.default_rng(1)
    bad = []
    for _ in range(200):
        lat1, lat2 = rng.uniform(-89.9, 89.9, 2)
        lon = rng.uniform(-180, 180)
        dlon = rng.uniform(-179.9, 179.9)
        cases = {
            "equator": (fn(0.0, lon, 0.0, lon + dlon), R * math.radians(abs(dlon))),
            "meridian": (fn(lat1, lon, lat2, lon), R * math.radians(abs(lat1 - lat2))),
            "pole": (fn(90.0, lon, lat1, lon + dlon), R * math.radians(90.0 - lat1)),
            "antipode": (fn(lat1, lon, -lat1, lon + 180.0), R * math.pi),
            "right angle": (fn(lat1, 0.0, lat2, 90.0),
                            R * math.acos(math.sin(math.radians(lat1)) * math.sin(math.radians(lat2)))),
        }
        for name, (got, want) in cases.items():
            tol = SHORT_TOL_KM if want < SHORT_KM else LONG_TOL_KM
            if abs(got - want) > tol:
                bad.append(f"{name} at ({lat1:.3f}, {lat2:.3f}, {dlon:.3f}): {got} km, want {want}")
    return bad


def random_point_errors(fn, n: int = 3000) -> list[str]:
    """Against atan2_km at random pairs: anywhere, near poles and the antimeridian, near antipodes,
    and at separations from 1 m to 100 km in random directions."""
    rng = np.random.default_rng(2)
    bad = []
    for i in range(n):
        kind = i % 5
        lat1 = float(rng.uniform(-90, 90)) if kind != 1 else float(rng.choice([-1, 1]) * rng.uniform(89.0, 90.0))
        lon1 = float(rng.uniform(-180, 180)) if kind != 2 else float(rng.choice([-1, 1]) * rng.uniform(179.0, 180.0))
        if kind == 3:  # near the antipode
            lat2, lon2 = -lat1 + rng.normal(0, 1e-3), lon1 + 180.0 + rng.normal(0, 1e-3)
        elif kind == 4 or kind == 2:  # a short step in a random direction: 1 m to 100 km
            step = 10 ** rng.uniform(-3, 2) / R  # radians
            bearing = rng.uniform(0, 2 * math.pi)
            p1, l1 = math.radians(lat1), math.radians(lon1)
            p2 = math.asin(math.sin(p1) * math.cos(step) + math.cos(p1) * math.sin(step) * math.cos(bearing))
            l2 = l1 + math.atan2(math.sin(bearing) * math.sin(step) * math.cos(p1),
                                 math.cos(step) - math.sin(p1) * math.sin(p2))
            lat2, lon2 = math.degrees(p2), (math.degrees(l2) + 180.0) % 360.0 - 180.0
        else:
            lat2, lon2 = float(rng.uniform(-90, 90)), float(rng.uniform(-180, 180))
        got, want = fn(lat1, lon1, lat2, lon2), atan2_km(lat1, lon1, lat2, lon2)
        tol = SHORT_TOL_KM if want < SHORT_KM else LONG_TOL_KM
        if abs(got - want) > tol:
            bad.append(f"({lat1}, {lon1}) to ({lat2}, {lon2}): {got} km, want {want}")
    return bad


CHECKS = {"published": published_errors, "closed forms": closed_form_errors, "random points": random_point_errors}


@pytest.mark.parametrize("name", FORMULAS)
@pytest.mark.parametrize("check", CHECKS)
def test_distance_formula(name, check):
    bad = CHECKS[check](FORMULAS[name])
    assert not bad, f"{name}, {check}: {len(bad)} wrong, e.g. {bad[:3]}"


def test_one_metre_apart():
    """Separations of 1 m along a meridian, a parallel and a diagonal, at mid and high latitudes."""
    for lat in (0.0, 45.0, 89.0):
        dlat = math.degrees(0.001 / R)
        dlon = math.degrees(0.001 / (R * math.cos(math.radians(lat))))
        for fn in FORMULAS.values():
            assert fn(lat, 10.0, lat + dlat, 10.0) == pytest.approx(0.001, abs=1e-12)
            assert fn(lat, 10.0, lat, 10.0 + dlon) == pytest.approx(0.001, abs=1e-9)


# --- wrong formulas must fail -----------------------------------------------------------------------------


def _haversine_variant(lat1, lon1, lat2, lon2, *, cos_factor):
    p1, p2 = math.radians(lat1), math.radians(lat2)
    s = math.sin((p2 - p1) / 2)
    t = math.sin(math.radians(lon2 - lon1) / 2)
    h = min(1.0, s * s + cos_factor(p1, p2) * t * t)
    return 2.0 * R * math.asin(math.sqrt(h))


def _no_radians(lat1, lon1, lat2, lon2):
    s = math.sin((lat2 - lat1) / 2)
    t = math.sin((lon2 - lon1) / 2)
    h = min(1.0, s * s + math.cos(lat1) * math.cos(lat2) * t * t)
    return 2.0 * R * math.asin(math.sqrt(h))


WRONG = {
    "cos(latitude) dropped": lambda *a: _haversine_variant(*a, cos_factor=lambda p1, p2: 1.0),
    "cos(lat1) squared": lambda *a: _haversine_variant(*a, cos_factor=lambda p1, p2: math.cos(p1) ** 2),
    "one cos(latitude) only": lambda *a: _haversine_variant(*a, cos_factor=lambda p1, p2: math.cos(p2)),
    "degrees as radians": _no_radians,
}


@pytest.mark.parametrize("wrong", WRONG)
def test_wrong_formulas_are_rejected(wrong):
    """Each wrong formula fails the closed forms and the random points (and is not saved by either)."""
    fn = WRONG[wrong]
    assert closed_form_errors(fn), f"{wrong}: passed the closed forms"
    assert random_point_errors(fn, n=500), f"{wrong}: passed the random points"


def test_the_correct_variant_of_the_wrong_ones_passes():
    """The harness of the wrong formulas, given the right factor, is right: the failures above come
    from the planted mistakes, not from the variant code."""
    fn = lambda *a: _haversine_variant(*a, cos_factor=lambda p1, p2: math.cos(p1) * math.cos(p2))  # noqa: E731
    assert not closed_form_errors(fn) and not random_point_errors(fn, n=500)
