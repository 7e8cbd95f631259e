"""The ad id <-> row map shared by every embedding store (`andromeda_nb.rows`)."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from andromeda_nb.rows import FREE, RowMap, fit_rows


def test_rows_start_in_corpus_order_and_look_up_in_any_order():
    ids = np.array([40, 7, 19, 3], np.int64)
    rows = RowMap(ids)
    assert len(rows) == 4 and rows.n_rows == 4
    assert rows.rows_of([3, 40, 19, 7]).tolist() == [3, 0, 2, 1]
    assert rows.row_of(19) == 2 and rows.row_of(5) is None
    assert 7 in rows and 8 not in rows
    assert rows.rows_of(np.empty(0, np.int64)).shape == (0,)


def test_duplicate_and_negative_ids_are_refused():
    with pytest.raises(ValueError, match="duplicate ad id 7 .rows 1 and 3"):
        RowMap([1, 7, 2, 7])
    with pytest.raises(ValueError, match="ad id -2 is negative"):
        RowMap([1]).assign(-2)


def test_unknown_id_is_named():
    rows = RowMap([1, 2, 3])
    with pytest.raises(KeyError, match="ad 9 is not live"):
        rows.rows_of([2, 9, 3])
    rows.release(2)
    with pytest.raises(KeyError, match="ad 2 is not live"):
        rows.rows_of([2])
    with pytest.raises(KeyError, match="ad 2 is not live"):
        rows.release(2)


def test_freed_rows_are_reused_before_the_table_grows():
    rows = RowMap([10, 11, 12])
    assert rows.assign(11) == (1, False)
    assert rows.release(11) == 1 and rows.row_ad.tolist() == [10, FREE, 12]
    assert rows.assign(99) == (1, True)
    assert rows.assign(100) == (3, True) and rows.n_rows == 4
    assert rows.row_ad.tolist() == [10, 99, 12, 100]


def test_fit_rows_grows_geometrically_and_keeps_contents():
    a = np.arange(6, dtype=np.float32).reshape(3, 2)
    assert fit_rows(a, 3) is a
    b = fit_rows(a, 4, fill=-1)
    assert b.shape == (16, 2) and (b[:3] == a).all() and (b[3:] == -1).all()
    c = fit_rows(np.zeros(20, np.int64), 21)
    assert c.shape == (40,)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["assign", "release"]), st.integers(0, 30)), max_size=80),
       st.integers(0, 10))
def test_random_changes_match_a_plain_dict(ops, n0):
    """After any sequence of changes, every live id has its own row and rows_of agrees with row_ad."""
    rows = RowMap(np.arange(n0, dtype=np.int64) * 3)
    live = {i * 3 for i in range(n0)}
    for op, ad_id in ops:
        if op == "assign":
            row, new = rows.assign(ad_id)
            assert new == (ad_id not in live)
            live.add(ad_id)
        elif ad_id in live:
            rows.release(ad_id)
            live.discard(ad_id)
        else:
            with pytest.raises(KeyError):
                rows.release(ad_id)
    ids = np.array(sorted(live), np.int64)
    got = rows.rows_of(ids)
    assert len(set(got.tolist())) == len(ids) == len(rows)
    assert (rows.row_ad[got] == ids).all()
    assert (rows.row_ad >= 0).sum() == len(ids)


def test_copy_rows_equals_numpy_fancy_assignment():
    """`copy_rows` (compiled, byte for byte) writes what dst[dst_rows] = src[src_rows] writes, for the
    embedding dtypes and negative rows (destination rows distinct, as slots are); out of range is an
    IndexError (random data, seed 43)."""
    from andromeda_nb.rows import copy_rows

    rng = np.random.default_rng(43)
    for dtype in (np.float16, np.float32, np.int8):
        src = (rng.normal(size=(500, 64)) * 50).astype(dtype)
        dst_rows = rng.permutation(700)[:400] - 100  # some negative
        src_rows = rng.integers(-500, 500, 400)
        for rows in (dst_rows, dst_rows[::-1]):
            want = (rng.normal(size=(700, 64)) * 50).astype(dtype)
            got = want.copy()
            want[rows] = src[src_rows]
            copy_rows(got, rows, src, src_rows)
            assert got.tobytes() == want.tobytes(), f"seed=43 dtype={np.dtype(dtype)}"
    with pytest.raises(IndexError):
        copy_rows(np.zeros((5, 4), np.float32), np.array([5]), np.ones((3, 4), np.float32), np.array([0]))
