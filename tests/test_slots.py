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
