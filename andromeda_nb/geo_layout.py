"""Geographic masks for a slot layout co-designed with the targeting match (docs/BENCHMARKS.md, "A layout
by geography"): slots clustered by the places an ad's geo clause names, and per chunk of slots a summary
that lets a match skip every chunk none of whose ads a request could match on geography.

Every geo term gets one bit of a 64-bit mask (`GeoBuckets.bit`): with a geographic hierarchy, a
country its own bit and a region or city its country's; without one, or for a place the hierarchy
does not know, a hash of the term id.

* An ad's mask: the bits of the terms of its geo clause; every bit (`ALL`) when it has no geo clause
  or its clause has custom locations (a circle can hold a user of any country).
* A request's mask: the bits of the geo terms it holds (its country, region and city).
* A chunk's summary: the OR of its ads' masks (`chunk_summaries`).

Where a chunk's summary AND a request's mask is 0, no ad of the chunk is eligible for the request:
an ad's geo clause needs the request to hold one of the clause's terms, and that term sets the same
bit in both masks. The test is exact for any bucket function; the hierarchy only makes it skip more.

    buckets = GeoBuckets.of_world(build_world(seed))    # or GeoBuckets() for hashed bits alone
    masks = buckets.ad_masks(compiled)
    rows = clustered_order(compiled.format, masks)       # within each format, by mask
    skip = (chunk_summaries(slot_of_row, masks, n_chunks) & buckets.request_mask(request)) == 0
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import jitcache
from .compiled import NS_CITY, NS_COUNTRY, NS_REGION, TERM_SHIFT, CompiledTargeting, country_code, term
from .constants import LAYOUTS
from .hashing import first_seen_ids
from .slots import CHUNK_SLOTS

ALL = np.uint64(0xFFFF_FFFF_FFFF_FFFF)
BITS = 64
GEO_NAMESPACES = (NS_COUNTRY, NS_REGION, NS_CITY)
_IDENT_MASK = (1 << TERM_SHIFT) - 1

jitcache.install()  # cached code is recompiled when any project source changes


def hashed_bit(t: int) -> int:
    """A term's bit by its id alone (Fibonacci hashing: the top 6 bits of id x 2^64 / phi)."""
    return ((int(t) * 0x9E3779B97F4A7C15) & 0xFFFF_FFFF_FFFF_FFFF) >> 58


def hashed_bits(terms: np.ndarray) -> np.ndarray:
    """`hashed_bit` of every term (int8): unsigned 64-bit products wrap as the masked product does."""
    return ((np.asarray(terms, np.int64).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(58)).astype(np.int8)


class GeoBuckets:
    """term id -> bit (0..63) of a geographic mask. The hierarchy: `countries` (ISO alpha-2, the i-th
    taking bit i mod 64), `region_country` a region id's country, `city_region` a city id's region;
    places it does not name are hashed. With none (`GeoBuckets()`) every term is hashed."""

    def __init__(self, countries=(), region_country: dict[int, str] | None = None,
                 city_region: dict[int, int] | None = None):
        self._country = {country_code(c): i % BITS for i, c in enumerate(countries)}
        self._region = {int(r): self._country_bit(country_code(c)) for r, c in (region_country or {}).items()}
        self._city = {int(t): self._region[int(r)] for t, r in (city_region or {}).items() if int(r) in self._region}
        self._sorted_tables = None  # `_tables`, made on first use

    @classmethod
    def of_world(cls, world) -> "GeoBuckets":
        """The hierarchy of a generated corpus's world (`andromeda_nb.corpus.build_world`)."""
        region_country = {int(r): world.countries[int(c)] for r, c in zip(world.region_id, world.region_country)}
        city_region = {int(t): int(world.region_id[int(r)]) for t, r in zip(world.city_id, world.city_region)}
        return cls(world.countries, region_country, city_region)

    def _country_bit(self, code: int) -> int:
        bit = self._country.get(code)
        return hashed_bit(term(NS_COUNTRY, code)) if bit is None else bit

    def bit(self, t: int) -> int:
        ns, ident = int(t) >> TERM_SHIFT, int(t) & _IDENT_MASK
        if ns == NS_COUNTRY:
            return self._country_bit(ident)
        if ns == NS_REGION and ident in self._region:
            return self._region[ident]
        if ns == NS_CITY and ident in self._city:
            return self._city[ident]
        return hashed_bit(t)

    def term_bits(self, terms: np.ndarray) -> np.ndarray:
        """int8 per term: its bit, or -1 for a term of no geographic namespace (`bit`, vectorized: the
        hash for every geo term, then the hierarchy's bits looked up by namespace and id)."""
        terms = np.asarray(terms, np.int64)
        out = np.full(len(terms), -1, np.int8)
        ns = terms >> TERM_SHIFT
        geo = np.flatnonzero(np.isin(ns, GEO_NAMESPACES))
        if not len(geo):
            return out
        t = terms[geo]
        bits = hashed_bits(t)
        ident, ns = t & _IDENT_MASK, ns[geo]
        for namespace, (keys, values) in self._tables().items():
            sel = np.flatnonzero(ns == namespace)
            if len(sel) and len(keys):
                pos = np.minimum(np.searchsorted(keys, ident[sel]), len(keys) - 1)
                hit = keys[pos] == ident[sel]
                bits[sel[hit]] = values[pos[hit]]
        out[geo] = bits
        return out

    def _tables(self) -> dict:
        """namespace -> (sorted ids, their bits) of the places the hierarchy names."""
        if self._sorted_tables is None:
            tables = {}
            for namespace, places in ((NS_COUNTRY, self._country), (NS_REGION, self._region), (NS_CITY, self._city)):
                keys = np.fromiter(places.keys(), np.int64, len(places))
                values = np.fromiter(places.values(), np.int8, len(places))
                order = np.argsort(keys)
                tables[namespace] = (keys[order], values[order])
            self._sorted_tables = tables
        return self._sorted_tables

    def ad_masks(self, ct: CompiledTargeting, bits_at=None) -> np.ndarray:
        """uint64 per ad of `ct`: the bits of its geo clause, or ALL (no geo clause, custom locations).
        `bits_at(positions)`: `term_bits(ct.terms[positions])` when the caller has it cheaper (an index
        looks each distinct term up once, through its vocabulary)."""
        out = np.full(len(ct), ALL, np.uint64)
        ads = np.flatnonzero(ct.n_positive > 0)
        if not len(ads):
            return out
        c = np.asarray(ct.clause_ptr, np.int64)[ads]  # the geo clause is the first positive clause when an ad has one
        lo, hi = np.asarray(ct.term_ptr, np.int64)[c], np.asarray(ct.term_ptr, np.int64)[c + 1]
        circles = np.asarray(ct.circle_ptr, np.int64)
        n = hi - lo
        keep = (n > 0) & (circles[c + 1] == circles[c])
        ads, lo, n = ads[keep], lo[keep], n[keep]
        if not len(ads):
            return out
        first = np.cumsum(n) - n  # each ad's terms are a run of the flat arrays below (n > 0 each)
        at = np.repeat(lo - first, n) + np.arange(int(n.sum()))
        bits = self.term_bits(np.asarray(ct.terms, np.int64)[at]) if bits_at is None else bits_at(at)
        geo_only = np.logical_and.reduceat(bits >= 0, first)
        masks = np.bitwise_or.reduceat(np.left_shift(np.uint64(1), np.maximum(bits, 0).astype(np.uint64)), first)
        out[ads[geo_only]] = masks[geo_only]
        return out

    @staticmethod
    def ad_masks_dense(ct: CompiledTargeting, dense_terms: np.ndarray, dense_bits: np.ndarray) -> np.ndarray:
        """`ad_masks(ct, lambda at: dense_bits[dense_terms[at]])` in one compiled pass over the ads'
        first clauses: `dense_terms` int64[T] the dense id of every term of `ct`, `dense_bits` int8[V]
        the bit of every dense id (-1: not geographic). The plain form made several temporaries of one
        word per geo term and reduced them with numpy (a second a million ads)."""
        return _ad_masks(np.asarray(ct.n_positive), np.asarray(ct.clause_ptr, np.int64),
                         np.asarray(ct.term_ptr, np.int64), np.asarray(ct.circle_ptr, np.int64),
                         np.asarray(dense_terms, np.int64), np.asarray(dense_bits, np.int8))

    def ad_mask(self, ct: CompiledTargeting, i: int = 0) -> np.uint64:
        """`ad_masks(ct)[i]` for one ad, in plain Python: what an upsert costs (no array work)."""
        if ct.n_positive[i] <= 0:
            return ALL
        c = int(ct.clause_ptr[i])
        lo, hi = int(ct.term_ptr[c]), int(ct.term_ptr[c + 1])
        if hi == lo or ct.circle_ptr[c + 1] > ct.circle_ptr[c]:
            return ALL
        m = 0
        for t in ct.terms[lo:hi].tolist():
            if t >> TERM_SHIFT not in GEO_NAMESPACES:
                return ALL
            m |= 1 << self.bit(t)
        return np.uint64(m)

    def request_mask(self, request) -> int:
        """The bits of the geo terms a request holds (0 when it holds none: it can match no geo clause)."""
        u = request.user
        m = 0
        if len(u.country) == 2:
            m |= 1 << self.bit(term(NS_COUNTRY, country_code(u.country)))
        if u.region >= 0:
            m |= 1 << self.bit(term(NS_REGION, u.region))
        if u.city >= 0:
            m |= 1 << self.bit(term(NS_CITY, u.city))
        return m


@njit(cache=True, parallel=True)
def _ad_masks(n_positive, clause_ptr, term_ptr, circle_ptr, dense_terms, dense_bits):
    """`GeoBuckets.ad_masks_dense` on ct's arrays: n_positive int32[N], clause_ptr int64[N+1], term_ptr
    and circle_ptr int64[M+1], dense_terms int64[T], dense_bits int8[V]; uint64[N]."""
    n = n_positive.shape[0]
    out = np.empty(n, np.uint64)
    for i in prange(n):
        mask = ALL
        if n_positive[i] > 0:
            c = clause_ptr[i]
            lo, hi = term_ptr[c], term_ptr[c + 1]
            if hi > lo and circle_ptr[c + 1] == circle_ptr[c]:
                m = np.uint64(0)
                for t in range(lo, hi):
                    b = dense_bits[dense_terms[t]]
                    if b < 0:
                        m = ALL
                        break
                    m |= np.uint64(1) << np.uint64(b)
                mask = m
        out[i] = mask
    return out


def clustered_order(formats: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """Rank of every ad in a slot order clustered by geography: within its format, ads sorted by the
    number of bits of their mask, then the mask (so one country's ads are neighbours and ALL comes
    last), then their position. int64 (N,): lower ranks take lower slots of the format.

    The masks are few distinct values (places and their combinations): each is numbered once
    (`hashing.first_seen_ids`), the distinct ones sorted by (bits, mask), and every ad ranked by a
    stable counting sort on (format, that number), in two passes over the ads
    (`clustered_order_plain` is the four-key sort it equals, the reference it is tested against)."""
    masks = np.asarray(masks, np.uint64)
    formats = np.asarray(formats)
    n = len(masks)
    if n == 0 or formats.dtype.kind not in "iu":
        return clustered_order_plain(formats, masks)
    distinct, ids = first_seen_ids(masks.view(np.int64))
    distinct = distinct.view(np.uint64)
    by_key = np.lexsort((distinct, _bit_counts(distinct)))
    place = np.empty(len(distinct), np.int64)
    place[by_key] = np.arange(len(distinct), dtype=np.int64)
    low, high = int(formats.min()), int(formats.max())
    if (high - low + 1) * len(distinct) > 4 * n + 1024:  # too many (format, mask) pairs to count: sort
        order = np.lexsort((place[ids], formats))
        rank = np.empty(n, np.int64)
        rank[order] = np.arange(n, dtype=np.int64)
        return rank
    return _counting_rank(formats, np.int64(low), place, ids)


def clustered_order_plain(formats: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """`clustered_order` as a four-key sort of every ad: the plain reference."""
    masks = np.asarray(masks, np.uint64)
    order = np.lexsort((np.arange(len(masks)), masks, _bit_counts(masks), np.asarray(formats)))
    rank = np.empty(len(masks), np.int64)
    rank[order] = np.arange(len(masks))
    return rank


def _bit_counts(masks: np.ndarray) -> np.ndarray:
    return np.bitwise_count(masks) if hasattr(np, "bitwise_count") else np.asarray(
        [bin(int(m)).count("1") for m in masks], np.uint8)


@njit(cache=True)
def _counting_rank(formats, low, place, ids):
    """int64[N]: the position of every ad in a stable sort by (format, place of its mask): formats
    (integers, N), each at least `low`; place int64[D] of every distinct mask; ids int64[N] the distinct
    mask of every ad. A counting sort over the (format, place) pairs: ties keep their order."""
    d = place.shape[0]
    n = ids.shape[0]
    key = np.empty(n, np.int64)
    n_keys = 0
    for i in range(n):
        key[i] = (np.int64(formats[i]) - low) * d + place[ids[i]]
        n_keys = max(n_keys, key[i] + 1)
    next_at = np.zeros(n_keys + 1, np.int64)
    for i in range(n):
        next_at[key[i] + 1] += 1
    for k in range(n_keys):
        next_at[k + 1] += next_at[k]
    for i in range(n):
        k = key[i]
        key[i] = next_at[k]  # the rank, in place of the key
        next_at[k] += 1
    return key


def world_buckets(seed: int) -> GeoBuckets:
    """The bits of the hierarchy of the world `seed` generates (`andromeda_nb.corpus.build_world`);
    exact for any corpus: places that world does not know are hashed."""
    from .corpus import build_world

    return GeoBuckets.of_world(build_world(seed))


def geo_rank(dataset) -> np.ndarray:
    """`clustered_order` of a dataset's ads, by `world_buckets` of its seed."""
    return clustered_order(dataset.compiled.format, world_buckets(dataset.seed).ad_masks(dataset.compiled))


def block_summaries(masks: np.ndarray, block: int) -> np.ndarray:
    """uint64[ceil(len(masks) / block)]: the OR of each block of `block` masks in slot order (0 for an
    empty slot)."""
    n = -(-len(masks) // block)
    padded = np.zeros(n * block, np.uint64)
    padded[:len(masks)] = masks
    return np.bitwise_or.reduce(padded.reshape(n, block), axis=1) if n else padded


def chunk_summaries(slot: np.ndarray, masks: np.ndarray, n_chunks: int, chunk: int = CHUNK_SLOTS) -> np.ndarray:
    """uint64 (n_chunks,): the OR of the masks of the ads in each chunk (ad i in slot `slot[i]`); 0 for
    a chunk with no ad."""
    by_slot = np.zeros(n_chunks * chunk, np.uint64)
    by_slot[np.asarray(slot, np.int64)] = masks
    return block_summaries(by_slot, chunk)


__all__ = ["ALL", "LAYOUTS", "GeoBuckets", "block_summaries", "chunk_summaries", "clustered_order", "clustered_order_plain", "geo_rank",
           "hashed_bit", "world_buckets"]
