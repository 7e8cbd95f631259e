"""Launch plans and their graphs (gpu/graphs.py, gpu/pipeline.py): a plan's key names exactly the arrays
and values its launches bind; the cache runs a plan seen once step by step, captures it the second
time and replays it after; a graph binds the arrays it was captured with, so a plan over a new array
is a new graph (the simulator's graphs replay the captured plan, as a device graph would); and the GPU
engine answers the same, bit for bit, from graphs or step by step, as the float64 reference does,
through updates that grow its arrays.

Kernels run under the CUDA simulator (tests/conftest.py), or on the GPU with ANDROMEDA_TEST_GPU=1."""

from __future__ import annotations

import dataclasses

import numpy as np

from gpu import runtime
from gpu.graphs import Copy, GraphCache, Launch, plan_key, run_plan

cuda = runtime.cuda()


@cuda.jit
def _axpy(out, x, a):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = out[i] + a * x[i]


def _step(out, x, a):
    return Launch(_axpy, (1,), 32, (out, x, np.float32(a)))


def test_a_plan_key_is_its_kernels_shapes_array_identities_and_values():
    x, out = cuda.to_device(np.arange(32, dtype=np.float32)), cuda.to_device(np.zeros(32, np.float32))
    twin = cuda.to_device(np.zeros(32, np.float32))  # same shape and dtype, another array
    key = plan_key([_step(out, x, 2.0)])
    assert plan_key([_step(out, x, 2.0)]) == key  # new step objects over the same arrays and values
    assert plan_key([_step(twin, x, 2.0)]) != key  # another array of the same shape
    assert plan_key([_step(out, x, 3.0)]) != key  # another value
    assert plan_key([Launch(_axpy, (2,), 32, (out, x, np.float32(2.0)))]) != key  # another launch shape
    assert plan_key([_step(out, x, 2.0), _step(out, x, 2.0)]) != key  # more steps
    host = cuda.pinned_array(32, np.float32)
    assert plan_key([Copy(host, out, to_host=True)]) != plan_key([Copy(host, twin, to_host=True)])


def test_the_cache_runs_a_new_plan_then_captures_it_then_replays_it():
    x = cuda.to_device(np.arange(32, dtype=np.float32))
    out = cuda.to_device(np.zeros(32, np.float32))
    host = cuda.pinned_array(32, np.float32)
    stream = cuda.stream()
    cache = GraphCache()

    def plan():
        return [_step(out, x, 1.0), Copy(host, out, to_host=True)]

    for n in range(1, 5):
        cache.run(plan(), stream)
        stream.synchronize()
        assert np.array_equal(host, n * np.arange(32, dtype=np.float32)), f"run {n}"  # every run did the work
    assert cache.captures == 1 and cache.replays == 3 and len(cache) == 1


def test_a_graph_binds_its_arrays_and_a_plan_over_a_new_array_is_a_new_graph():
    x = cuda.to_device(np.arange(32, dtype=np.float32))
    first = cuda.to_device(np.zeros(32, np.float32))
    cache = GraphCache()
    stream = cuda.stream()
    for _ in range(3):
        cache.run([_step(first, x, 1.0)], stream)
    stream.synchronize()
    assert np.array_equal(first.copy_to_host(), 3 * np.arange(32, dtype=np.float32))
    # the array is replaced (as an update that grows a table replaces it): the plan over the new one
    # must not replay the old graph, which would write the old array
    second = cuda.to_device(np.zeros(32, np.float32))
    for _ in range(3):
        cache.run([_step(second, x, 1.0)], stream)
    stream.synchronize()
    assert np.array_equal(second.copy_to_host(), 3 * np.arange(32, dtype=np.float32))
    assert np.array_equal(first.copy_to_host(), 3 * np.arange(32, dtype=np.float32))
    assert cache.captures == 2


def test_a_graph_keeps_the_arrays_it_binds_and_the_cache_drops_them_past_its_limit():
    import weakref

    x = cuda.to_device(np.arange(32, dtype=np.float32))
    cache = GraphCache(limit=2)
    stream = cuda.stream()
    out = cuda.to_device(np.zeros(32, np.float32))
    ref = weakref.ref(out)
    for _ in range(2):
        cache.run([_step(out, x, 1.0)], stream)
    del out
    assert ref() is not None  # held by its graph: no new array can take its identity
    for a in (2.0, 3.0):
        other = cuda.to_device(np.zeros(32, np.float32))
        for _ in range(2):
            cache.run([_step(other, x, a)], stream)
    assert ref() is None and len(cache) == 1  # the third graph dropped the first two, and their arrays


def test_run_plan_enqueues_the_steps_in_order():
    x = cuda.to_device(np.ones(32, np.float32))
    out = cuda.to_device(np.zeros(32, np.float32))
    host = cuda.pinned_array(32, np.float32)
    host_in = cuda.pinned_array(32, np.float32)
    host_in[:] = np.arange(32)
    stream = cuda.stream()
    run_plan([Copy(out, host_in, to_host=False), _step(out, x, 5.0), Copy(host, out, to_host=True)], stream)
    stream.synchronize()
    assert np.array_equal(host, np.arange(32) + 5.0)


def test_the_engine_answers_the_same_from_graphs_and_step_by_step_through_updates():
    """Both engines are asked each batch three times (run, captured, replayed) between update slices
    that add ads past the pool's capacity (new chunks: every slot-indexed array of the index and the
    scorer is replaced), and must agree bit for bit with each other and with the float64 reference."""
    from andromeda_nb.reference import ReferenceRetriever
    from andromeda_nb.testing import random_ads
    from andromeda_nb.types import Upsert
    from gpu.engine import GpuEngine
    from tests.migration.test_colocated import KERNEL_DEVICE, _updates, assert_equal_reference, make_dataset

    precision = "int8"
    dataset, rng = make_dataset(47, n_ads=120, n_requests=2, precision=precision)
    reference = ReferenceRetriever.build(dataset)
    graphs, steps = GpuEngine(dataset, KERNEL_DEVICE), GpuEngine(dataset, KERNEL_DEVICE, graphs=False)
    capacities = [graphs.index.capacity]
    for step in range(2):
        for _ in range(3):
            got, want = graphs.retrieve(dataset.requests, 9), steps.retrieve(dataset.requests, 9)
            for (ids, sc), (ids2, sc2) in zip(got, want):
                assert np.array_equal(ids, ids2) and np.array_equal(sc, sc2), f"{precision} step {step}"
        assert_equal_reference(reference, dataset.requests, got, 9, f"{precision} step {step}")
        ups = _updates(rng, reference, dataset, 30)
        if step == 0:  # past the capacity of a format: a new chunk, and every slot-indexed array made anew
            fresh = random_ads(rng, 300, dim=dataset.model.D)
            ups += [Upsert(dataclasses.replace(a, ad_id=10_000 + i, format=0)) for i, a in enumerate(fresh)]
        for u in ups:
            reference.apply(u)
        graphs.apply_many(ups)
        steps.apply_many(ups)
        capacities.append(graphs.index.capacity)
    assert graphs.pipeline.graphs.captures >= 2 and graphs.pipeline.graphs.replays >= 2
    assert capacities[1] > capacities[0], capacities  # the updates did grow the arrays
