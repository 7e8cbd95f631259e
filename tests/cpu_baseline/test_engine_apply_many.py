"""The CPU engine applies a server's slice of updates at once (`CpuEngine.apply_many`: each run of
upserts of distinct ads compiled, indexed, quantized and stored together; issue 37, point 8), and that
leaves exactly the state of applying the same updates one by one: the index's columns, slots and
delta entries, the row map, the stored embeddings (fp32, fp16 and int8), and every answer. Drawn
streams repeat ads within a slice (a repeat begins a new run) and mix status changes and retirements
between upserts; an upsert the engine cannot store fails at the same update with the same error."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from andromeda_nb import testing
from andromeda_nb.dataset import Dataset
from andromeda_nb.model import ModelError, MoeModel, quantize
from andromeda_nb.testing import random_ads, random_requests, random_updates
from andromeda_nb.types import Upsert
from andromeda_nb.updates import LiveAds, upsert_runs
from cpu_baseline.engine import CpuEngine

D, F = 8, 2
SCALE = testing.draw_scale()
DRAWN = settings(deadline=None, derandomize=SCALE == 1, database=None, max_examples=25 * SCALE,
                 suppress_health_check=[HealthCheck.too_slow])


def _dataset(seed: int, precision: str, n_ads: int = 12) -> Dataset:
    rng = np.random.default_rng(seed)
    ads = [dataclasses.replace(a, format=a.format % F) for a in random_ads(rng, n_ads, dim=D)]
    table = quantize(np.stack([a.embedding for a in ads]), precision)
    return Dataset(ads=ads, embeddings=table, requests=random_requests(rng, 6), model=MoeModel.init(seed, D=D, F=F),
                   seed=seed, precision=precision)


def _state(engine: CpuEngine) -> dict:
    index = engine.index
    index.refresh()
    rows = engine.rows
    return {
        "columns": {name: col.copy() for name, col in index._cols.items()},
        "slots": dict(index._slot_of),
        "free": list(index._free),
        "zero": sorted(index._zero),
        "delta": {slot: [a.copy() for a in entries] for slot, entries in index._delta_entries.items()},
        "postings": [a.copy() for a in (*index._main.flat(), *index._delta.flat())],
        "main_dead": index._main_dead,
        "rows": {int(ad_id): rows.row_of(ad_id) for ad_id in index._slot_of},
        "values": engine.scorer._values[: engine.scorer.rows].copy(),
        "scale": engine.scorer._scale[: engine.scorer.rows].copy(),
        "formats": engine.scorer._formats[: engine.scorer.rows].copy(),
    }


def _assert_same(a: dict, b: dict, context: str) -> None:
    assert a.keys() == b.keys()
    for key in ("slots", "free", "zero", "main_dead", "rows"):
        assert a[key] == b[key], f"{context}: {key}"
    for key in ("values", "scale", "formats"):
        np.testing.assert_array_equal(a[key], b[key], err_msg=f"{context}: {key}")
    for i, (x, y) in enumerate(zip(a["postings"], b["postings"])):
        np.testing.assert_array_equal(x, y, err_msg=f"{context}: postings array {i} (main, then delta)")
    for name in a["columns"]:
        np.testing.assert_array_equal(a["columns"][name], b["columns"][name], err_msg=f"{context}: column {name}")
    assert a["delta"].keys() == b["delta"].keys(), context
    for slot in a["delta"]:
        for x, y in zip(a["delta"][slot], b["delta"][slot]):
            np.testing.assert_array_equal(x, y, err_msg=f"{context}: delta entries of slot {slot}")


def _checked(dataset, updates):
    live = LiveAds(a.ad_id for a in dataset.ads)
    return [u for u in updates if live.accept(u) is None]


@DRAWN
@given(st.integers(0, 2**16), st.sampled_from(["fp32", "fp16", "int8"]), st.integers(1, 40), st.integers(1, 17))
def test_a_slice_applied_at_once_leaves_the_state_of_one_by_one(seed, precision, n_updates, slice_len):
    dataset = _dataset(seed, precision)
    updates = _checked(dataset, random_updates(np.random.default_rng(seed + 1), dataset.ads, n_updates, dim=D,
                                               formats=F))
    one, many = CpuEngine(dataset), CpuEngine(dataset)
    context = f"seed {seed}, {precision}, {len(updates)} updates, slices of {slice_len}"
    try:
        for lo in range(0, len(updates), slice_len):
            piece = updates[lo : lo + slice_len]
            for update in piece:
                one.apply(update)
            many.apply_many(piece)
            _assert_same(_state(one), _state(many), f"{context}, after {lo + len(piece)}")
        for k in (1, 5):
            for (ids_a, sc_a), (ids_b, sc_b) in zip(one.retrieve(dataset.requests, k), many.retrieve(dataset.requests, k)):
                np.testing.assert_array_equal(ids_a, ids_b, err_msg=context)
                np.testing.assert_array_equal(sc_a, sc_b, err_msg=context)
    finally:
        one.close()
        many.close()


def test_upsert_runs_split_at_a_repeated_ad_and_around_other_updates():
    dataset = _dataset(3, "fp32")
    a, b = (Upsert(ad) for ad in dataset.ads[:2])
    retire = random_updates(np.random.default_rng(0), dataset.ads, 40, dim=D)
    other = next(u for u in retire if not isinstance(u, Upsert))
    assert list(upsert_runs([a, b, a, other, b, b])) == [[a, b], [a], [other], [b], [b]]
    assert list(upsert_runs([])) == []


def test_an_upsert_the_engine_cannot_store_fails_where_one_by_one_fails():
    dataset = _dataset(5, "int8")
    fresh = random_ads(np.random.default_rng(9), 3, dim=D)
    ids = [10_000 + i for i in range(3)]
    good = [Upsert(dataclasses.replace(ad, ad_id=i, format=0)) for ad, i in zip(fresh, ids)]
    bad = Upsert(dataclasses.replace(fresh[0], ad_id=20_000, format=F))  # format out of range
    one, many = CpuEngine(dataset), CpuEngine(dataset)
    try:
        with pytest.raises(ModelError) as first:
            for update in [good[0], good[1], bad, good[2]]:
                one.apply(update)
        with pytest.raises(ModelError) as second:
            many.apply_many([good[0], good[1], bad, good[2]])
        assert str(first.value) == str(second.value)
        _assert_same(_state(one), _state(many), "a bad format in a run")
    finally:
        one.close()
        many.close()
