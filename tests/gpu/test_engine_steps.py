"""The GPU engine's batch in steps (`GpuEngine.begin`, `launch`, `ready`, `fetch`: what a server that
overlaps its batches runs, serving/overlap.py): the next batch prepared while one is in flight, the
answers equal to the float64 reference (under the simulator each launch takes seconds: one pair of
batches)."""

from __future__ import annotations

import pytest


def test_a_batch_in_steps_answers_as_retrieve_with_the_next_prepared_while_one_is_in_flight():
    from andromeda_nb.reference import ReferenceRetriever
    from gpu.engine import GpuEngine
    from tests.migration.test_colocated import KERNEL_DEVICE, assert_equal_reference, make_dataset

    dataset, _ = make_dataset(53, n_ads=80, n_requests=3, precision="fp16")
    engine = GpuEngine(dataset, KERNEL_DEVICE)
    first, second = dataset.requests[:1], dataset.requests[1:]
    launched = engine.launch(engine.begin(first, alone=True), 9)  # alone: the match enqueued first
    prepared = engine.begin(second)  # the host's share of the next, the first on the device
    got = engine.fetch(launched)
    assert engine.ready(launched)
    launched = engine.launch(prepared, 9)
    got += engine.fetch(launched)
    assert_equal_reference(ReferenceRetriever.build(dataset), dataset.requests, got, 9, "in steps")
    assert engine.fetch(engine.launch(engine.begin([]), 9)) == []
    with pytest.raises(ValueError, match=f"at most {engine.max_batch} requests"):
        engine.begin([dataset.requests[0]] * (engine.max_batch + 1))
