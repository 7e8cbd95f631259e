"""Tiled pools served as engines (`benchmarks.tiled`): a `TiledEngine` answers exactly as the GPU engine over a
`Dataset` of the same ads and embeddings; the shards of a tiled pool hold disjoint ads that together
are the pool of all their copies; the check against the float64 reference passes, and fails when the
reference's view of the pool is changed; the pool refuses updates clearly. Kernels run under the CUDA
simulator (or the real GPU with ANDROMEDA_TEST_GPU=1)."""


import numpy as np
import pytest

from andromeda_nb.compiled import take_compiled
from andromeda_nb.dataset import Dataset
from andromeda_nb.model import EmbeddingTable
from benchmarks.tiling import tile_compiled
from andromeda_nb.types import SetStatus
from andromeda_nb.testing import KERNEL_DEVICE



def small_pool(**changes):
    from benchmarks.tiled import TiledPool

    return TiledPool(**{"base_ads": 120, "copies": 3, "seed": 3, "dim": 16, "n_requests": 5, **changes})


def _host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


class _NoAds:
    def __call__(self):
        raise AssertionError("the engine reads compiled targeting only")


@pytest.fixture(scope="module")
def tiled():
    """One tiled engine for the module (the simulator runs a launch in seconds): copies 2, 3 and 4."""
    from benchmarks.tiled import TiledEngine

    pool = small_pool(first_copy=2)
    engine = TiledEngine(pool, KERNEL_DEVICE)
    yield pool, engine
    engine.close()


def test_a_tiled_engine_answers_as_the_gpu_engine_over_the_same_ads(tiled):
    from benchmarks.score import pool_values
    from gpu.engine import GpuEngine

    pool, engine = tiled
    ids = pool.ad_ids
    assert len(engine) == len(ids) == pool.n_ads == 360 and all(int(i) in engine for i in ids[::37])
    assert int(small_pool().ad_ids[0]) not in engine  # copy 0 is another pool's
    # the same ads as a corpus: the base tiled up to this pool's last copy, its own copies kept
    base = len(pool.base.compiled)
    compiled = take_compiled(tile_compiled(pool.base.compiled, pool.first_copy + pool.copies),
                             np.arange(pool.first_copy * base, (pool.first_copy + pool.copies) * base))
    assert np.array_equal(compiled.ad_id, ids)
    slots = np.array([engine.index.slots.slot_of(int(i)) for i in ids], np.int64)
    values = _host(pool_values(engine.xp, engine.stored, slots))
    dataset = Dataset(embeddings=EmbeddingTable(values, np.ones(len(ids), np.float32), pool.precision),
                      requests=pool.requests, model=pool.model, seed=pool.seed, precision=pool.precision,
                      compiled=compiled, ads_loader=_NoAds())
    plain = GpuEngine(dataset, KERNEL_DEVICE)
    got, want = engine.retrieve(pool.requests, 100), plain.retrieve(pool.requests, 100)
    for (a, b), (c, d) in zip(got, want):
        assert np.array_equal(a, c) and np.array_equal(b, d)
    assert sum(len(a) for a, _ in got) > 0
    plain.close()


def test_the_shards_of_a_tiled_pool_hold_disjoint_ads_that_make_the_whole_pool():
    pool = small_pool()
    shards = [pool.shard(s, 3) for s in range(3)]
    ids = [set(s.ad_ids.tolist()) for s in shards]
    assert all(len(i) == pool.n_ads for i in ids)
    assert not (ids[0] & ids[1]) and not (ids[1] & ids[2]) and not (ids[0] & ids[2])
    assert ids[0] | ids[1] | ids[2] == set(small_pool(copies=9).ad_ids.tolist())
    assert len({s.meta["lineage"] for s in shards}) == 3
    assert [p.requests[0].request_id for p in shards] == [pool.requests[0].request_id] * 3  # the same requests
    with pytest.raises(ValueError, match="shard 3 is outside 0..2"):
        pool.shard(3, 3)
    with pytest.raises(ValueError, match="at least 1"):
        small_pool(copies=0)


def test_the_reference_check_passes_and_fails_when_the_pool_is_not_what_was_scored(tiled):
    pool, engine = tiled
    checks = engine.check(pool.requests, 10)
    assert len(checks) == 5 and all(c["ok"] for c in checks), checks
    assert sum(c["eligible"] for c in checks) > 0 and all(c["returned"] == min(10, c["eligible"]) for c in checks)
    # the reference reads each slot's format from `fmt_slot`, the kernel from the chunks' formats
    kept = engine.stored.fmt_slot
    try:
        engine.stored.fmt_slot = (kept + 1) % pool.model.F
        busiest = max(range(len(checks)), key=lambda r: checks[r]["eligible"])
        assert not engine.check(pool.requests[busiest : busiest + 1], 10)[0]["ok"]
    finally:
        engine.stored.fmt_slot = kept


def test_a_tiled_pool_refuses_updates_by_name(tiled):
    pool, engine = tiled
    with pytest.raises(ValueError, match="a tiled pool takes no updates"):
        engine.apply(SetStatus(int(pool.ad_ids[0]), "paused"))
    with pytest.raises(ValueError, match="a tiled pool takes no updates"):
        engine.apply_many([])


@pytest.mark.e2e  # starts a shard process per shard
def test_cluster_bench_fans_out_to_tiled_shards_each_checked_and_equal_to_their_merge():
    """`benchmarks.cluster --tiled`: two shard processes, each its own copies of the pool laid out and
    checked against the float64 reference before it listens; the timed paths' answers equal the
    merge of the shards' own; the pool grows with the shards, so the scaling is per shard."""
    from benchmarks.cluster import measure_tiled, table

    pool = small_pool(copies=2, n_requests=2)
    result = measure_tiled(pool, [2], k=10, repeat=1, batches=(2,), device=KERNEL_DEVICE, say=lambda m: None)
    assert result["complete"] and result["ads_per_shard"] == 240 and result["requests"] == 2
    [checks] = result["shard_checks"]
    assert checks["shards"] == 2 and all(c["ok"] and c["requests"] == 4 for c in checks["shard_checks"])
    assert {(r["path"], r["shards"], r["batch"]) for r in result["rows"]} == {
        ("flight", 2, 2), ("flight-columns", 2, 2)}
    assert all(r["median_us"] > 0 and "overhead_us" not in r for r in result["rows"])
    assert all(row["pool_ads_per_s"] == round(480 / (next(r["median_us"] for r in result["rows"]
                                                            if r["path"] == row["path"]) * 1e-6))
               for row in result["scaling"])
    assert "240 ads per shard (tiled)" in table(result)
