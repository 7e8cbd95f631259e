"""The slot layout: format-grouped chunks, slot reuse, growth."""

import numpy as np
import pytest

from andromeda_nb.slots import EMPTY, SlotAllocator


def test_layout_groups_formats_in_chunks():
    rng = np.random.default_rng(7)
    ids = rng.permutation(1000) + 10
    formats = rng.integers(0, 5, size=1000)
    alloc = SlotAllocator.from_ads(ids, formats, chunk_slots=32)
    assert len(alloc) == 1000
    slot_format = alloc.slot_format()
    for ad_id, f in zip(ids, formats):
        s = alloc.slot_of(int(ad_id))
        assert alloc.slot_ad_id[s] == ad_id
        assert slot_format[s] == f  # every slot of a chunk has that chunk's format
    assert alloc.capacity % 32 == 0
    assert (alloc.slot_ad_id != EMPTY).sum() == 1000


def test_release_and_reuse_keeps_format():
    alloc = SlotAllocator.from_ads([1, 2, 3], [0, 1, 0], chunk_slots=4)
    s = alloc.release(1)
    assert alloc.slot_ad_id[s] == EMPTY and 1 not in alloc
    s2, grew = alloc.allocate(9, 0)
    assert not grew and alloc.format_of_slot(s2) == 0
    # a new format opens a new chunk
    s3, grew = alloc.allocate(10, 3)
    assert grew and alloc.format_of_slot(s3) == 3 and alloc.capacity == 12
    with pytest.raises(KeyError):
        alloc.allocate(10, 3)


def test_growth_when_chunk_full():
    alloc = SlotAllocator.from_ads([1, 2], [0, 0], chunk_slots=2)
    assert alloc.capacity == 2
    s, grew = alloc.allocate(3, 0)
    assert grew and alloc.capacity == 4 and alloc.format_of_slot(s) == 0


def test_a_named_slot_is_taken_and_the_free_list_passes_over_it():
    alloc = SlotAllocator.from_ads([1, 2, 3], [0, 1, 0], chunk_slots=4)
    # format 0: chunk 0 holds 1, 3 and slots 2, 3 free; format 1: chunk 1 holds 2
    assert alloc.chunk_free.tolist() == [2, 3] and alloc.chunks_of(0).tolist() == [0]
    s, grew = alloc.allocate(9, 0, slot=3)  # the slot below the free list's top
    assert (s, grew) == (3, False) and alloc.slot_of(9) == 3 and alloc.chunk_free.tolist() == [1, 3]
    for bad, fmt in ((3, 0), (5, 0), (99, 0)):  # taken, of format 1, outside
        with pytest.raises(ValueError, match=f"slot {bad} is not a free slot of format {fmt}"):
            alloc.allocate(10, fmt, slot=bad)
    assert 10 not in alloc
    s, _ = alloc.allocate(10, 0)  # the free list's top is slot 2; slot 3 is passed over later
    assert s == 2 and alloc.chunk_free[0] == 0
    s, grew = alloc.allocate(11, 0)  # nothing left of format 0: a new chunk, and its chunk list follows
    assert grew and s == 8 and alloc.chunks_of(0).tolist() == [0, 2] and alloc.chunk_free.tolist() == [0, 3, 3]
    s, grew = alloc.allocate(12, 0, new_chunk=True)  # a chunk of its own, though chunk 2 has room
    assert grew and s == 12 and alloc.chunks_of(0).tolist() == [0, 2, 3]
    alloc.release(9)
    assert alloc.chunk_free[0] == 1 and alloc.allocate(13, 0)[0] == 3  # released: on top again


def test_layout_equals_the_plain_per_format_layout():
    """`SlotAllocator.layout` (one gather, slots computed at once) lays out what the plain per-format
    loop did, on random ids, formats, ranks and spare room, and its rows are the order it used."""
    rng = np.random.default_rng(17)
    for n, spare in ((1000, 0.0), (777, 0.3), (1, 0.0)):
        ids = rng.choice(100 * n, n, replace=False).astype(np.int64)
        formats = rng.integers(0, 5, n).astype(np.int16)
        rank = rng.integers(0, 40, n)
        grouped = np.empty(n, np.int64)  # a permutation that keeps formats ascending (one pass, no sort)
        grouped[np.lexsort((rng.random(n), formats))] = np.arange(n)
        for r in (None, rank, grouped, rng.permutation(n)):
            alloc, rows = SlotAllocator.layout(ids, formats, chunk_slots=32, spare=spare, rank=r)
            order = np.argsort(formats, kind="stable") if r is None else np.lexsort((np.arange(n), r, formats))
            blocks, chunk_fmt = [], []
            for f in np.unique(formats):  # the plain layout, format by format
                fids = ids[order][formats[order] == f]
                chunks = -(-int(len(fids) * (1.0 + spare)) // 32)
                block = np.full(chunks * 32, EMPTY, np.int64)
                block[: len(fids)] = fids
                blocks.append(block)
                chunk_fmt += [int(f)] * chunks
            config = f"seed=17 n={n} spare={spare} rank={'given' if r is not None else None}"
            assert len(alloc) == n, config
            assert np.array_equal(alloc.slot_ad_id, np.concatenate(blocks)), config
            assert alloc.chunk_format.dtype == np.int16 and alloc.chunk_format.tolist() == chunk_fmt, config
            used = np.flatnonzero(alloc.slot_ad_id != EMPTY)
            assert np.array_equal(ids[rows], alloc.slot_ad_id[used]), config
            assert all(alloc.slot_of(int(ids[i])) == s for i, s in zip(rows.tolist(), used.tolist())), config


def test_the_id_to_slot_map_is_made_on_first_use_and_follows_updates():
    """After `layout` the id -> slot dict is made on first use, from the slots: lookups, membership,
    length and updates as with one made at once (random ids, seed 23)."""
    rng = np.random.default_rng(23)
    ids = rng.choice(10_000, 300, replace=False).astype(np.int64) + 1
    formats = rng.integers(0, 3, 300).astype(np.int16)
    alloc, rows = SlotAllocator.layout(ids, formats, chunk_slots=32, spare=0.2)
    assert alloc._slot_map is None and len(alloc) == 300  # not made yet
    used = np.flatnonzero(alloc.slot_ad_id != EMPTY)
    assert int(ids[rows[5]]) in alloc and 0 not in alloc
    assert alloc._slot_map == dict(zip(ids[rows].tolist(), used.tolist()))
    victim = int(ids[rows[7]])
    s = alloc.release(victim)
    assert victim not in alloc and len(alloc) == 299
    s2, _ = alloc.allocate(20_000, alloc.format_of_slot(s))
    assert alloc.slot_of(20_000) == s2 and len(alloc) == 300
    fresh, _ = SlotAllocator.layout(ids, formats, chunk_slots=32, spare=0.2)
    s3, _ = fresh.allocate(20_001, 0)  # an update first makes the map, then adds to it
    assert fresh.slot_of(20_001) == s3 and len(fresh) == 301 and fresh.slot_of(int(ids[rows[0]])) == used[0]
    with pytest.raises(KeyError):
        fresh.allocate(int(ids[rows[1]]), 0)


def test_runs_equal_np_unique_of_sorted_values():
    from andromeda_nb.slots import _runs

    rng = np.random.default_rng(29)
    for n in (0, 1, 500):
        values = np.sort(rng.integers(-3, 6, n).astype(np.int16))
        want = np.unique(values, return_index=True, return_counts=True)
        got = _runs(values)
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want)), f"seed=29 n={n}"
