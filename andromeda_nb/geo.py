"""Great-circle distance, written once for every target.

`haversine_km` uses only the `math` module, so the same function runs in plain Python (the oracle),
under `numba.njit` (the CPU index) and as a `numba.cuda.jit(device=True)` function (the GPU index).
DESIGN section 2: a sphere of radius 6371.0088 km, float64 throughout, inside means distance <= radius.
"""

from __future__ import annotations

import math

from .constants import EARTH_RADIUS_KM


def haversine_km(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    """Distance in km between two points given in degrees (float64)."""
    p1 = math.radians(lat1)
    p2 = math.radians(lat2)
    dp = p2 - p1
    dl = math.radians(lon2 - lon1)
    s = math.sin(dp * 0.5)
    t = math.sin(dl * 0.5)
    h = s * s + math.cos(p1) * math.cos(p2) * t * t
    if h > 1.0:
        h = 1.0
    return 2.0 * EARTH_RADIUS_KM * math.asin(math.sqrt(h))
