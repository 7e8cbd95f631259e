"""How many 32-slot tiles hold at least one eligible ad, per request, under three slot orders: the
index's (grouped by format), grouped by format then by the first targeted country, and by country
then format. A scorer that skips empty tiles reads the share of tiles printed here; one that walks a
list of eligible slots reads the eligible share. Oracle eligibility on the generated base corpus.

    PYTHONPATH=. python3 scripts/probe_tile_occupancy.py --ads 8192 --requests 64 --out probe.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from andromeda_nb.oracle import OracleIndex  # noqa: E402
from andromeda_nb.provenance import report_probe  # noqa: E402
from benchmarks.tiling import generate_base  # noqa: E402

TILE = 32


def geo_key(ad) -> str:
    """The first targeted country ('+' when several), else the first region or city, else none."""
    g = ad.targeting.geo_locations
    if g is None:
        return "~none"
    countries = sorted(g.countries)
    if countries:
        return countries[0] + ("+" if len(countries) > 1 else "")
    return f"~sub{sorted(g.regions)[:1]}{sorted(g.cities)[:1]}"


def tile_share(eligible: np.ndarray, order: np.ndarray) -> float:
    """Mean over requests of the share of whole 32-slot tiles with an eligible ad."""
    e = eligible[:, order]
    n = e.shape[1] // TILE * TILE
    return float(e[:, :n].reshape(e.shape[0], -1, TILE).any(axis=2).mean())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ads", type=int, default=8192)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    base = generate_base(args.ads, args.requests, args.seed)
    pos = {a.ad_id: i for i, a in enumerate(base.ads)}
    eligible = np.zeros((len(base.requests), len(base.ads)), bool)
    for r, ids in enumerate(OracleIndex.build(base.ads).match(base.requests)):
        eligible[r, [pos[int(i)] for i in ids]] = True
    fmt = np.array([a.format for a in base.ads])
    geo = np.array([geo_key(a) for a in base.ads])
    result = {
        "ads": args.ads, "requests": args.requests, "seed": args.seed, "tile_slots": TILE,
        "eligible_share": float(eligible.mean()),
        "eligible_share_per_request": {"min": float(eligible.mean(1).min()), "max": float(eligible.mean(1).max())},
        "tiles_with_an_eligible_ad": {
            "by_format": tile_share(eligible, np.argsort(fmt, kind="stable")),
            "by_format_then_country": tile_share(eligible, np.lexsort((geo, fmt))),
            "by_country_then_format": tile_share(eligible, np.lexsort((fmt, geo))),
        },
    }
    report_probe(result, "probe_tile_occupancy.py", argv if argv is not None else sys.argv[1:], args.out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
