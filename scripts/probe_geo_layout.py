"""How much a layout co-design by geography could save: the slot order clustered by the countries an
ad's geo clause names, and a per-chunk summary that lets a launch skip every chunk none of whose ads
any request of the group could match on geography.

For every ad, a 64-bit geo mask: bit b(t) for every term t of its geo_locations clause, where b maps a
country to its own bit and a region or city to its country's bit (`andromeda_nb.corpus.build_world`
for the corpus's seed; any other term to a hash); all 64 bits for an ad with custom locations or no
geo clause (with `--bucket hash`, every term its own hashed bit: what an index knows without the
geographic hierarchy). A request's mask: the bits of the geo terms it holds. A chunk's summary: the OR of its
ads' masks. Where summary AND mask is 0, no ad of the chunk can be eligible: the test is exact for
any bucket function, because an ad's clause term and a request's term set the same bit.

Two slot orders within each format's chunks of 256: the corpus's (as `SlotAllocator.from_ads` lays
it out), and clustered (ads sorted by mask popcount, then mask). For each, per request and per
group of 64: the share of chunks the summary skips, the share no eligible ad touches (what a
perfect skip would leave), eligible ads per touched chunk, and the 32-row tiles of one chunk's
eligible slots that the scoring kernel's walk fills, per chunk of the pool (its work); and per ad,
the share of the pool whose mask meets one request's (what a per-slot test would pass). Eligibility
from the CPU index.

    PYTHONPATH=. python3 scripts/probe_geo_layout.py --data DIR --out FILE
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from andromeda_nb.bench import software, write_json  # noqa: E402
from andromeda_nb.provenance import host_info  # noqa: E402

ALL = np.uint64(0xFFFFFFFFFFFFFFFF)
GROUP = 64
TILE_ROWS = 32  # rows of the scoring kernel's tile of one chunk's eligible slots


def bucket_of(world):
    """term -> bit (0..63): a country its own, a region or city its country's, anything else a hash."""
    from andromeda_nb.compiled import NS_CITY, NS_COUNTRY, NS_REGION, TERM_SHIFT, country_code

    country_bit = {country_code(c): i % 64 for i, c in enumerate(world.countries)}
    region_bit = {int(r): int(c) % 64 for r, c in zip(world.region_id, world.region_country)}
    city_bit = {int(t): region_bit[int(world.region_id[r])] for t, r in zip(world.city_id, world.city_region)}

    def bucket(t: int) -> int:
        ns, ident = t >> TERM_SHIFT, t & ((1 << TERM_SHIFT) - 1)
        table = {NS_COUNTRY: country_bit, NS_REGION: region_bit, NS_CITY: city_bit}.get(ns)
        if table is not None and ident in table:
            return table[ident]
        return (t * 0x9E3779B97F4A7C15 >> 58) & 63

    return bucket


def hash_bucket(t: int) -> int:
    """term -> bit (0..63) by the term id alone: what an index knows without a geographic hierarchy."""
    return (t * 0x9E3779B97F4A7C15 >> 58) & 63


def ad_masks(ct, bucket) -> np.ndarray:
    """uint64 per ad: the bits of its geo_locations clause (all bits: custom locations, or none)."""
    from andromeda_nb.compiled import NS_CITY, NS_COUNTRY, NS_REGION, TERM_SHIFT

    geo_ns = {NS_COUNTRY, NS_REGION, NS_CITY}
    out = np.full(len(ct), ALL, np.uint64)
    for i in range(len(ct)):
        lo, hi = ct.clause_ptr[i], ct.clause_ptr[i + 1]
        if ct.n_positive[i] == 0:
            continue
        c = lo  # the geo clause comes first among the positive clauses when there is one
        terms = ct.terms[ct.term_ptr[c]:ct.term_ptr[c + 1]]
        if ct.circle_ptr[c + 1] > ct.circle_ptr[c] or not len(terms) or not all(
                (int(t) >> TERM_SHIFT) in geo_ns for t in terms):
            continue
        m = 0
        for t in terms:
            m |= 1 << bucket(int(t))
        out[i] = np.uint64(m)
    return out


def request_mask(request, bucket) -> int:
    from andromeda_nb.compiled import NS_CITY, NS_COUNTRY, NS_REGION, country_code, term

    u = request.user
    m = 0
    if len(u.country) == 2:
        m |= 1 << bucket(term(NS_COUNTRY, country_code(u.country)))
    if u.region >= 0:
        m |= 1 << bucket(term(NS_REGION, u.region))
    if u.city >= 0:
        m |= 1 << bucket(term(NS_CITY, u.city))
    return m


def layout(formats: np.ndarray, key: np.ndarray | None, chunk: int) -> np.ndarray:
    """Slot of each ad: format by format in chunks of `chunk` (each format's last chunk padded), ads
    in corpus order or sorted by `key` within their format."""
    slot = np.empty(len(formats), np.int64)
    base = 0
    for f in np.unique(formats):
        rows = np.flatnonzero(formats == f)
        if key is not None:
            rows = rows[np.lexsort((rows, key[rows]))]
        slot[rows] = base + np.arange(len(rows))
        base += -(-len(rows) // chunk) * chunk
    return slot


def measure(masks, slot, eligible, req_masks, chunk: int) -> dict:
    n_chunks = int(slot.max()) // chunk + 1
    summary = np.zeros(n_chunks, np.uint64)
    np.bitwise_or.at(summary, slot // chunk, masks)
    per = {"skipped": [], "untouched": [], "eligible_per_touched_chunk": [], "tiles_per_chunk": []}
    groups = {"skipped": [], "untouched": []}
    for lo in range(0, len(req_masks), GROUP):
        g_mask, g_touched = 0, np.zeros(n_chunks, bool)
        for r in range(lo, min(lo + GROUP, len(req_masks))):
            touched = np.bincount(slot[eligible[r]] // chunk, minlength=n_chunks)
            skipped = (summary & np.uint64(req_masks[r])) == 0
            assert not (skipped & (touched > 0)).any(), "the summary skipped a chunk with an eligible ad"
            per["skipped"].append(skipped.mean())
            per["untouched"].append((touched == 0).mean())
            if (touched > 0).any():
                per["eligible_per_touched_chunk"].append(touched[touched > 0].mean())
            per["tiles_per_chunk"].append((-(-touched // TILE_ROWS)).sum() / n_chunks)  # 32-row tiles the walk fills
            g_mask |= req_masks[r]
            g_touched |= touched > 0
        groups["skipped"].append(((summary & np.uint64(g_mask)) == 0).mean())
        groups["untouched"].append((~g_touched).mean())
    out = {"chunks": n_chunks,
           "one_request": {k: round(float(np.mean(v)), 4) for k, v in per.items()},
           f"group_of_{GROUP}": {k: round(float(np.mean(v)), 4) for k, v in groups.items()}}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a generated corpus directory")
    ap.add_argument("--chunk", type=int, default=256, help="slots per chunk")
    ap.add_argument("--bucket", choices=("country", "hash"), default="country",
                    help="country: a region or city sets its country's bit (the corpus's world); hash: every "
                         "term its own hashed bit (no hierarchy needed)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from andromeda_nb.corpus import build_world
    from andromeda_nb.store import load_dataset
    from cpu_baseline.index import CpuTargetingIndex

    dataset = load_dataset(args.data)
    ct = dataset.compiled
    bucket = bucket_of(build_world(dataset.seed)) if args.bucket == "country" else hash_bucket
    masks = ad_masks(ct, bucket)
    requests = list(dataset.requests)
    req_masks = [request_mask(r, bucket) for r in requests]
    row_of = {int(a): i for i, a in enumerate(ct.ad_id)}
    eligible = [np.asarray([row_of[int(a)] for a in ids], np.int64)
                for ids in CpuTargetingIndex.from_compiled(ct).match(requests)]
    popcount = np.asarray([bin(int(m)).count("1") for m in masks], np.uint64)
    order_key = np.lexsort((masks, popcount))  # popcount, then the mask itself
    rank = np.empty(len(masks), np.int64)
    rank[order_key] = np.arange(len(masks))
    layouts = {"corpus_order": layout(ct.format, None, args.chunk), "clustered": layout(ct.format, rank, args.chunk)}
    result = {"kind": "geo_layout_probe", "ads": len(ct), "requests": len(requests), "chunk": args.chunk,
              "ads_with_geo_mask": round(float((masks != ALL).mean()), 4),
              "single_country_ads": round(float((popcount == 1).mean()), 4),
              "bucket": args.bucket,
              # per ad, one request: the share of the pool whose geo mask meets the request's
              "ads_passing_geo_test": round(float(np.mean([((masks & np.uint64(m)) != 0).mean() for m in req_masks])), 4),
              "eligible_share": round(float(np.mean([len(e) for e in eligible]) / len(ct)), 4),
              "layouts": {name: measure(masks, slot, eligible, req_masks, args.chunk) for name, slot in layouts.items()},
              "software": software(), "host": host_info(),
              "command": shlex.join(["python3", "scripts/probe_geo_layout.py", *(argv if argv is not None else sys.argv[1:])])}
    print(json.dumps({k: result[k] for k in ("ads", "bucket", "ads_with_geo_mask", "single_country_ads", "eligible_share",
                                              "ads_passing_geo_test",
                                              "layouts")}, indent=1))
    if args.out:
        write_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
