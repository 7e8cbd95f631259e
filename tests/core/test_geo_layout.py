"""Geographic masks for a layout by geography (`andromeda_nb.geo_layout`): every ad eligible for a
request shares a bit with it, so a chunk summary never skips a chunk that holds an eligible ad, with
the world's hierarchy and with hashed bits alone; the hierarchy gives a region and a city their
country's bit; the clustered order keeps formats apart and neighbours one country's ads; and the
clustered layout does skip chunks."""

from functools import lru_cache

import numpy as np
import pytest

from andromeda_nb.compiled import NS_CITY, NS_COUNTRY, NS_REGION, NS_LOCALE, country_code, term
from andromeda_nb.corpus import build_world
from andromeda_nb.geo_layout import (ALL, GeoBuckets, chunk_summaries, clustered_order, clustered_order_plain,
                                     hashed_bit)
from andromeda_nb.testing import KERNEL_DEVICE
from benchmarks.tiling import generate_base

SEED = 5
CHUNK = 32  # small chunks, so a corpus of a few thousand ads has many


@lru_cache(maxsize=1)
def corpus():
    from cpu_baseline.index import CpuTargetingIndex

    base = generate_base(3000, 24, SEED)
    ct = base.compiled
    row_of = {int(a): i for i, a in enumerate(ct.ad_id)}
    eligible = [np.asarray([row_of[int(a)] for a in ids], np.int64)
                for ids in CpuTargetingIndex.from_compiled(ct).match(base.requests)]
    return ct, base.requests, eligible


def buckets_of(kind: str) -> GeoBuckets:
    return GeoBuckets.of_world(build_world(SEED)) if kind == "world" else GeoBuckets()


def slots_of(formats: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Each ad's slot when every format starts a new chunk and its ads follow `rank`."""
    slot = np.empty(len(formats), np.int64)
    base = 0
    for f in np.unique(formats):
        rows = np.flatnonzero(formats == f)
        rows = rows[np.argsort(rank[rows], kind="stable")]
        slot[rows] = base + np.arange(len(rows))
        base += -(-len(rows) // CHUNK) * CHUNK
    return slot


@pytest.mark.parametrize("kind", ["world", "hashed"])
def test_every_eligible_ad_shares_a_bit_with_its_request(kind):
    ct, requests, eligible = corpus()
    buckets = buckets_of(kind)
    masks = buckets.ad_masks(ct)
    assert sum(len(e) for e in eligible) > 0
    for request, rows in zip(requests, eligible):
        m = np.uint64(buckets.request_mask(request))
        assert ((masks[rows] & m) != 0).all(), f"request {request.request_id}: an eligible ad's mask misses its bits"


@pytest.mark.parametrize("kind", ["world", "hashed"])
def test_chunk_summaries_skip_no_chunk_with_an_eligible_ad_and_the_clustered_layout_skips_some(kind):
    ct, requests, eligible = corpus()
    buckets = buckets_of(kind)
    masks = buckets.ad_masks(ct)
    slot = slots_of(ct.format, clustered_order(ct.format, masks))
    n_chunks = int(slot.max()) // CHUNK + 1
    summary = chunk_summaries(slot, masks, n_chunks, CHUNK)
    skipped_any = 0
    for request, rows in zip(requests, eligible):
        skipped = (summary & np.uint64(buckets.request_mask(request))) == 0
        assert not skipped[np.unique(slot[rows] // CHUNK)].any(), f"request {request.request_id}"
        skipped_any += int(skipped.sum())
    assert skipped_any > 0, "the clustered layout let no request skip a chunk"


def test_ads_without_a_plain_geo_clause_have_every_bit():
    ct, _, _ = corpus()
    buckets = GeoBuckets.of_world(build_world(SEED))
    masks = buckets.ad_masks(ct)
    assert all(buckets.ad_mask(ct, i) == masks[i] for i in range(len(ct)))  # one ad's path, the upserts'
    for i in range(len(ct)):
        c = ct.clause_ptr[i]
        plain = ct.n_positive[i] > 0 and ct.circle_ptr[c + 1] == ct.circle_ptr[c] and ct.term_ptr[c + 1] > ct.term_ptr[c] \
            and all(int(t) >> 40 in (NS_COUNTRY, NS_REGION, NS_CITY) for t in ct.terms[ct.term_ptr[c]:ct.term_ptr[c + 1]])
        if not plain:
            assert masks[i] == ALL, f"ad {ct.ad_id[i]}: no plain geo clause, yet a narrow mask"
        else:
            assert masks[i] != ALL and masks[i] != 0
    assert (masks != ALL).any() and (masks == ALL).any()


def test_a_region_and_a_city_take_their_countrys_bit():
    world = build_world(SEED)
    b = GeoBuckets.of_world(world)
    for t in range(0, len(world.city_id), 37):
        r = int(world.city_region[t])
        country = world.countries[int(world.region_country[r])]
        bit = b.bit(term(NS_COUNTRY, country_code(country)))
        assert b.bit(term(NS_REGION, int(world.region_id[r]))) == bit
        assert b.bit(term(NS_CITY, int(world.city_id[t]))) == bit
    # the world's countries take distinct bits while there are no more than 64
    bits = [b.bit(term(NS_COUNTRY, country_code(c))) for c in world.countries[:64]]
    assert len(set(bits)) == len(bits)
    # a place the hierarchy does not know, and any other term, is hashed into 0..63
    for t in (term(NS_REGION, 1), term(NS_CITY, 2), term(NS_LOCALE, 7)):
        assert b.bit(t) == hashed_bit(t) and 0 <= b.bit(t) < 64


def test_clustered_order_keeps_formats_apart_and_sorts_by_bits_then_mask():
    formats = np.array([1, 0, 1, 0, 1, 0, 1])
    masks = np.array([0b110, 0b1, int(ALL), 0b1, 0b10, 0b100, 0b10], np.uint64)
    rank = clustered_order(formats, masks)
    order = np.argsort(rank)
    assert list(formats[order]) == [0, 0, 0, 1, 1, 1, 1]
    # format 0: 0b1, 0b1 (first by position), 0b100; format 1: 0b10, 0b10, 0b110, ALL
    assert list(order) == [1, 3, 5, 4, 6, 0, 2]


@pytest.mark.parametrize("kind", ["world", "hashed"])
def test_compiled_ad_masks_equal_the_plain_ones(kind):
    """`ad_masks_dense` (compiled, through dense term ids) equals `ad_masks` on a generated corpus, with
    some terms' bits knocked out (-1: not geographic) so that ads fall back to ALL."""
    ct = corpus()[0]
    buckets = buckets_of(kind)
    distinct, dense = np.unique(ct.terms, return_inverse=True)
    bits = buckets.term_bits(distinct)
    rng = np.random.default_rng(SEED)
    bits[rng.random(len(bits)) < 0.05] = -1
    want = buckets.ad_masks(ct, lambda at: bits[dense[at]])
    got = buckets.ad_masks_dense(ct, dense, bits)
    assert got.dtype == np.uint64 and np.array_equal(got, want), f"seed={SEED} kind={kind}"
    assert len(np.unique(want)) > 10 and (want == ALL).any() and (want != ALL).any()
    assert np.array_equal(buckets.ad_masks_dense(ct, dense, buckets.term_bits(distinct)), buckets.ad_masks(ct))


def test_clustered_order_equals_the_four_key_sort():
    """`clustered_order` (distinct masks numbered, a counting sort) ranks as the plain four-key sort,
    with few and with many distinct masks (the sorting fallback) and negative formats (seed 31)."""
    rng = np.random.default_rng(31)
    for n, distinct, low in ((5000, 40, 0), (3000, 3000, -2), (1, 1, 3)):
        pool = rng.integers(0, 1 << 63, distinct, dtype=np.int64).astype(np.uint64) | np.uint64(1 << 63)
        pool[0] = ALL
        masks = pool[rng.integers(0, distinct, n)]
        formats = rng.integers(low, low + 6, n).astype(np.int16)
        got, want = clustered_order(formats, masks), clustered_order_plain(formats, masks)
        assert got.dtype == np.int64 and np.array_equal(got, want), f"seed=31 n={n} distinct={distinct}"


def test_the_gpu_engine_laid_out_by_geography_answers_as_the_reference_through_updates():
    from andromeda_nb.geo_layout import geo_rank
    from andromeda_nb.slots import EMPTY
    from gpu.engine import GpuEngine

    from tests.support.servers import reference_at, small_dataset, update_stream

    dataset = small_dataset(17, n_ads=300, n_requests=3)
    engine = GpuEngine(dataset, device=KERNEL_DEVICE, layout="geo")
    assert engine.describe()["layout"] == "geo"
    # the slots follow the clustered order within each format, and that is not the corpus's order
    slots = engine.index.slots
    ct = dataset.compiled
    rank = geo_rank(dataset)
    rank_of = dict(zip(ct.ad_id.tolist(), rank.tolist()))
    used = slots.slot_ad_id[slots.slot_ad_id != EMPTY]
    assert np.all(np.diff([rank_of[int(a)] for a in used]) > 0)
    plain = GpuEngine(dataset, device=KERNEL_DEVICE, layout="format").index.slots.slot_ad_id
    assert not np.array_equal(plain[plain != EMPTY], used)
    updates = update_stream(dataset, 12, seed=17)
    engine.apply_many(updates)
    reference = reference_at(dataset, updates)
    answers = engine.retrieve(dataset.requests, 7)
    assert sum(len(ids) for ids, _ in answers) > 0
    for request, (ids, scores) in zip(dataset.requests, answers):
        from andromeda_nb.compare import compare_topk

        ref_ids, result = reference.score_eligible(request)
        cmp = compare_topk(ref_ids, result, ids, scores, 7)
        assert cmp.ok, f"request {request.request_id}: {cmp.message}"


def test_an_unknown_layout_is_refused_by_name():
    from gpu.engine import GpuEngine

    from tests.support.servers import small_dataset

    with pytest.raises(ValueError, match="unknown slot layout 'country'"):
        GpuEngine(small_dataset(3, n_ads=20, n_requests=1), device="sim", layout="country")


def test_a_rank_of_the_wrong_length_is_refused():
    from andromeda_nb.slots import SlotAllocator

    with pytest.raises(ValueError, match="one number per ad expected, got 2 for 3 ads"):
        SlotAllocator.from_ads([1, 2, 3], [0, 0, 1], rank=np.array([0, 1]))
    alloc = SlotAllocator.from_ads([1, 2, 3], [0, 0, 1], chunk_slots=32, rank=np.array([5, 4, 0]))
    assert alloc.slot_of(2) == 0 and alloc.slot_of(1) == 1 and alloc.slot_of(3) == 32


# --- the match skips blocks by geography (gpu.index, gpu.kernels.match) --------------------------------


def _device():
    return KERNEL_DEVICE


def test_the_match_skips_blocks_no_request_of_the_group_can_match_and_reads_the_summary_to_do_so():
    from andromeda_nb.compiled import encode_request
    from gpu.index import GpuTargetingIndex

    ct, requests, eligible = corpus()
    buckets = buckets_of("world")
    rank = clustered_order(ct.format, buckets.ad_masks(ct))
    index = GpuTargetingIndex.from_compiled(ct, device=_device(), chunk_slots=CHUNK, rank=rank, buckets=buckets)
    block = index._k.SUMMARY_SLOTS
    slot_of_row = np.asarray([index.slots.slot_of(int(a)) for a in ct.ad_id], np.int64)
    skipped_any = 0
    for r in range(6):
        gmask = index.prepare([encode_request(requests[r])]).arrays["gmask"].copy_to_host()[0]
        skip = (index.summary_h & gmask) == 0
        assert np.array_equal(skip, index.skipped_blocks([encode_request(requests[r])])[0])
        # exact: no ad eligible for the request lies in a block its group skips
        assert not skip[slot_of_row[eligible[r]] // block].any(), f"seed {SEED} request {r}: a skipped block holds an eligible ad"
        skipped_any += int(skip.sum())
    assert skipped_any > 0, "the clustered layout gave no block to skip"
    # the answers are the CPU index's, request by request
    words = index.match_slots([encode_request(q) for q in requests]).copy_to_host()
    got = index.slot_masks_to_ids(words)
    for r, rows in enumerate(eligible):
        assert got[r].tolist() == sorted(ct.ad_id[rows].tolist()), f"seed {SEED} request {r}"
    # the kernel reads the summary: a block whose summary says "no ad here" is not read, so clearing the
    # summary of a block that holds eligible ads leaves its words 0 and every other word as it was
    r = next(r for r, rows in enumerate(eligible) if len(rows))
    b = int(slot_of_row[eligible[r][0]] // block)
    index.d_summary[b:b + 1].copy_to_device(np.zeros(1, np.uint64))
    cleared = index.match_slots([encode_request(q) for q in requests]).copy_to_host()
    lo, hi = b * block // 32, (b + 1) * block // 32
    assert not cleared[:, lo:hi].any() and words[:, lo:hi].any()
    assert np.array_equal(np.delete(cleared, np.s_[lo:hi], axis=1), np.delete(words, np.s_[lo:hi], axis=1))


def test_a_request_with_no_country_matches_ads_of_every_bit_and_upserts_widen_the_summary():
    from andromeda_nb.compiled import encode_requests
    from andromeda_nb.oracle import OracleIndex
    from andromeda_nb.targeting import parse_ad, parse_request
    from andromeda_nb.types import Upsert
    from gpu.index import GpuTargetingIndex

    def ad(ad_id, targeting):
        return parse_ad({"ad_id": ad_id, "format": 0, "targeting": targeting}, seed=0, dim=4, formats=1)

    def request(rid, **user):
        return parse_request({"request_id": rid, "user": {"age": 30, **user},
                              "context": {"publisher_platform": "facebook", "device_platform": "mobile",
                                          "user_os": "iOS", "time": 0}}, seed=0, experts=6, width=16)

    ads = [ad(i, {"geo_locations": {"countries": ["US"]}}) for i in range(1, 40)] + [ad(40, {"geo_locations": {"custom_locations": [
        {"latitude": 0.0, "longitude": 0.0, "radius": 50, "distance_unit": "kilometer"}]}})]  # every bit
    near = {"latitude": 0.1, "longitude": 0.1}
    requests = [request(1, **near), request(2, country="FR", **near), request(3, country="US", **near)]
    index = GpuTargetingIndex.build(ads, device=_device(), chunk_slots=CHUNK)  # hashed bits: one block of 64 slots
    # each request alone is a group of its own: the one with no country holds no geo term at all
    assert [index.match([q])[0].tolist() for q in requests] == [[40], [40], list(range(1, 41))]
    # a block of ads for the US alone: France shares no bit with it, until an ad for France lands there
    us = ads[:39]
    index = GpuTargetingIndex.build(us, device=_device(), chunk_slots=CHUNK)
    gmask = index.prepare(encode_requests(requests[1:2])).arrays["gmask"].copy_to_host()[0]
    assert int(index.summary_h[0] & gmask) == 0, "the block of US ads shares a bit with a request from France"
    assert [m.tolist() for m in index.match(requests[1:])] == [[], list(range(1, 40))]
    fr = ad(41, {"geo_locations": {"countries": ["FR"]}})
    index.apply(Upsert(fr))
    gmask = index.prepare(encode_requests(requests[1:2])).arrays["gmask"].copy_to_host()[0]  # France is a known term now
    assert int(index.summary_h[0] & gmask) != 0 and int(index.d_summary.copy_to_host()[0]) == int(index.summary_h[0])
    want = OracleIndex.build(us + [fr]).match(requests)
    assert [m.tolist() for m in index.match(requests)] == [m.tolist() for m in want] == [[], [41], list(range(1, 40))]


def test_upserts_take_slots_by_geography_and_summaries_are_made_again_exactly():
    from andromeda_nb.oracle import OracleIndex
    from andromeda_nb.targeting import parse_ad, parse_request
    from andromeda_nb.types import Retire, Upsert
    from gpu.index import GpuTargetingIndex

    def ad(ad_id, targeting):
        return parse_ad({"ad_id": ad_id, "format": 0, "targeting": targeting}, seed=0, dim=4, formats=1)

    def in_country(ad_id, country):
        return ad(ad_id, {"geo_locations": {"countries": [country]}})

    everywhere = {"geo_locations": {"custom_locations": [
        {"latitude": 0.0, "longitude": 0.0, "radius": 50, "distance_unit": "kilometer"}]}}
    near = {"latitude": 0.1, "longitude": 0.1}
    requests = [parse_request({"request_id": i, "user": {"age": 30, "country": c, **near},
                               "context": {"publisher_platform": "facebook", "device_platform": "mobile",
                                           "user_os": "iOS", "time": 0}}, seed=0, experts=6, width=16)
                for i, c in enumerate(["US", "FR", "DE", "IT", "ES"])]
    ads = [in_country(i, "US") for i in range(1, 101)]
    # one chunk of 256 slots is one block: 100 US ads, and spare room for two more, empty blocks
    index = GpuTargetingIndex.build(ads, device=_device(), spare=5.2)
    assert index.capacity == 768 and index.summary_h[1] == index.summary_h[2] == 0
    us_block = int(index.summary_h[0])
    live = list(ads)

    def check():
        want = OracleIndex.build(live).match(requests)
        assert [m.tolist() for m in index.match(requests)] == [m.tolist() for m in want]

    # ads for France and Germany in one call: each to an empty block of its own (the first one's bits
    # count for the second within the call), not into the US block (its free list's top)
    index.apply_many([Upsert(in_country(200, "FR")), Upsert(in_country(202, "DE"))])
    live += [in_country(200, "FR"), in_country(202, "DE")]
    assert [index.slots.slot_of(a) // 256 for a in (200, 202)] == [1, 2] and int(index.summary_h[0]) == us_block
    # another US ad goes where the US bit is
    index.apply(Upsert(in_country(201, "US")))
    live.append(in_country(201, "US"))
    assert index.slots.slot_of(201) // 256 == 0 and int(index.summary_h[0]) == us_block
    check()
    # with no block left empty, Spain's ad goes where the fewest bits are added, the emptiest of those
    index.apply(Upsert(in_country(205, "ES")))
    live.append(in_country(205, "ES"))
    assert index.slots.slot_of(205) // 256 in (1, 2) and int(index.summary_h[0]) == us_block
    # an ad of every bit widens no block: it opens a chunk of its own; then Italy's ad goes there,
    # the one block that already has its bit
    index.apply_many([Upsert(ad(203, everywhere)), Upsert(in_country(204, "IT"))])
    live += [ad(203, everywhere), in_country(204, "IT")]
    assert index.capacity == 1024 and [index.slots.slot_of(a) // 256 for a in (203, 204)] == [3, 3]
    # a US ad retargeted to France leaves the US block for one that has France
    index.apply(Upsert(in_country(5, "FR")))
    live[4] = in_country(5, "FR")
    assert index.slots.slot_of(5) // 256 == 1 and int(index.summary_h[0]) == us_block
    check()
    # retiring France's and Germany's ads (and Spain's) leaves their blocks' summaries empty again
    index.apply_many([Retire(200), Retire(202), Retire(5), Retire(205)])
    live = [a for a in live if a.ad_id not in (200, 202, 5, 205)]
    assert index.summary_h[1] == index.summary_h[2] == 0 and not index.d_summary.copy_to_host()[1:3].any()
    check()
    # the allocator's own order, kept to measure against, puts France in the US block
    plain = GpuTargetingIndex.build(ads, device=_device(), spare=5.2)
    plain.placement = "free-list"
    plain.apply(Upsert(in_country(200, "FR")))
    assert plain.slots.slot_of(200) // 256 == 0 and int(plain.summary_h[0]) != us_block


def test_term_bits_are_bit_of_every_term_and_an_index_ranks_by_geography_on_its_own():
    from andromeda_nb.geo_layout import hashed_bits
    from gpu.index import GpuTargetingIndex

    ct, _, _ = corpus()
    rng = np.random.default_rng(SEED)
    terms = np.concatenate([np.unique(ct.terms), rng.integers(0, 1 << 50, 2000),
                            [term(NS_REGION, 10**6), term(NS_CITY, 10**6), term(NS_COUNTRY, country_code("ZZ"))]])
    for kind in ("world", "hashed"):
        b = buckets_of(kind)
        want = [b.bit(int(t)) if int(t) >> 40 in (NS_COUNTRY, NS_REGION, NS_CITY) else -1 for t in terms]
        assert b.term_bits(terms).tolist() == want, kind
    assert hashed_bits(terms).tolist() == [hashed_bit(int(t)) for t in terms]
    b = buckets_of("world")
    by_rank = GpuTargetingIndex.from_compiled(ct, device=_device(), chunk_slots=CHUNK, buckets=b,
                                              rank=clustered_order(ct.format, b.ad_masks(ct)))
    by_name = GpuTargetingIndex.from_compiled(ct, device=_device(), chunk_slots=CHUNK, buckets=b, rank="geo")
    assert np.array_equal(by_rank.slots.slot_ad_id, by_name.slots.slot_ad_id)
    assert np.array_equal(by_rank.summary_h, by_name.summary_h)
    with pytest.raises(ValueError, match="unknown rank 'zigzag'"):
        GpuTargetingIndex.from_compiled(ct, device=_device(), chunk_slots=CHUNK, rank="zigzag")
