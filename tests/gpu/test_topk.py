"""Final GPU top-K (gpu/kernels/topk.py) and the per-block selection of the scoring kernel, under the
CUDA simulator: the rank order and tie rule of DESIGN section 4 (score descending, ad id ascending)."""

import numpy as np
import pytest

from gpu.kernels._bits import f32_to_keys_host, keys_to_f32_host
from gpu.kernels.topk import scratch_size, topk_host


def final_topk_sim(keys, slots, slot_ad_id, k, cap):
    from gpu import runtime
    from gpu.kernels import topk

    cuda = runtime.cuda()
    R, nb, ca = keys.shape
    P = scratch_size(k)
    out_id = cuda.device_array((R, k), np.int64)
    out_score = cuda.device_array((R, k), np.float32)
    out_count = cuda.device_array(R, np.int32)
    topk.final_topk_v1[(R,), topk.threads()](
        cuda.to_device(keys), cuda.to_device(slots), np.int32(cap), cuda.to_device(slot_ad_id), np.int32(k),
        cuda.device_array((R, P), np.uint32), cuda.device_array((R, P), np.int32), cuda.device_array((R, P), np.int64),
        out_id, out_score, out_count)
    counts = out_count.copy_to_host()
    return [(out_id.copy_to_host()[r, : counts[r]], out_score.copy_to_host()[r, : counts[r]]) for r in range(R)]


def test_orderable_keys_follow_float_order():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(1000).astype(np.float32), np.float32([0.0, -0.0, 1e-38, -1e-38, 3e38, -3e38])])
    keys = f32_to_keys_host(x)
    assert np.all(keys != 0)
    order = np.argsort(keys, kind="stable")
    assert np.all(np.diff(x[order].astype(np.float64)) >= 0)
    assert np.array_equal(keys_to_f32_host(keys).view(np.uint32), x.view(np.uint32))


@pytest.mark.parametrize("seed,k", [(1, 5), (2, 64), (3, 300), (4, 600)])  # 600: the scratch sorted in global memory
def test_final_topk_equals_host_rule_with_ties(seed, k):
    rng = np.random.default_rng(seed)
    R, nb, cap = 2, 5, 40
    n_slots = nb * cap
    slot_ad_id = rng.permutation(10_000)[:n_slots].astype(np.int64)
    # few distinct scores, so many exact ties: ids must break them ascending
    scores = rng.integers(0, 12, (R, nb, cap)).astype(np.float32) / 4 - 1
    keys = f32_to_keys_host(scores).reshape(R, nb, cap)
    slots = np.arange(n_slots, dtype=np.int32).reshape(1, nb, cap).repeat(R, 0)
    keys[:, :, cap - 7 :] = 0  # padding: no candidate
    slots[:, :, cap - 7 :] = -1
    got = final_topk_sim(keys, slots, slot_ad_id, k, cap)
    for r in range(R):
        valid = keys[r] != 0
        ids = slot_ad_id[slots[r][valid]]
        want = topk_host(ids, scores[r][valid], k)
        order = np.lexsort((ids, -scores[r][valid].astype(np.float64)))[:k]
        assert np.array_equal(want[0], ids[order]), f"seed {seed} k {k}: host rule"
        assert np.array_equal(got[r][0], want[0]), f"seed {seed} k {k} request {r}"
        assert np.array_equal(got[r][1], want[1])


def _plan_topk(plan, keys, slots, slot_ad_id, k, cap):
    """Run a `TopkPlan` (both stages) on candidates (R, blocks, cap): (ids, scores) per request."""
    from gpu import runtime
    from gpu.graphs import run_plan
    from gpu.kernels import topk

    cuda = runtime.cuda()
    R, nb, _ = keys.shape
    n_seg = topk.n_segments(nb * cap, plan.segment_len)
    P = scratch_size(k)
    bufs = dict(sk=cuda.device_array((R, P), np.uint32), ss=cuda.device_array((R, P), np.int32),
                sid=cuda.device_array((R, P), np.int64), out_id=cuda.device_array((R, k), np.int64),
                out_score=cuda.device_array((R, k), np.float32), out_count=cuda.device_array(R, np.int32),
                seg_key=cuda.device_array((R, n_seg, k), np.uint32), seg_slot=cuda.device_array((R, n_seg, k), np.int32))
    steps = plan.plan(cuda.to_device(keys), cuda.to_device(slots), cap, cuda.to_device(slot_ad_id), k, bufs, R)
    assert len(steps) == (2 if n_seg > 1 else 1)
    run_plan(steps)
    counts = bufs["out_count"].copy_to_host()
    ids, scores = bufs["out_id"].copy_to_host(), bufs["out_score"].copy_to_host()
    return [(ids[r, : counts[r]], scores[r, : counts[r]]) for r in range(R)]


@pytest.mark.parametrize("number", [2, 3])
@pytest.mark.parametrize("spread,k", [(0, 9), (0, 70), (1, 9), (1, 70)])
def test_every_topk_version_equals_the_host_rule(number, spread, k):
    """Each version of the kernel lab's top-K (v3 counts a warp's equal digits with one atomic) over
    candidates in several segments, with padding and exact ties: the host's rule, ids and scores.
    spread 0: scores a few ulps apart (the keys of a warp share their first digits, the case v3 is
    for); 1: scores over several binades (the digits of a warp differ)."""
    from dataclasses import replace

    from gpu.lab import topk as topk_lab

    rng = np.random.default_rng(20 + 10 * spread + k)
    R, nb, cap = 2, 9, 40
    if spread:
        scores = rng.choice(np.float32(np.exp2(rng.integers(-8, 8, 60)) * rng.standard_normal(60)), (R, nb, cap))
    else:
        scores = keys_to_f32_host(np.uint32(0xBF000000) + rng.integers(0, 90, (R, nb, cap), dtype=np.uint32))
    keys = f32_to_keys_host(scores.astype(np.float32)).reshape(R, nb, cap)
    slots = rng.permutation(nb * cap).astype(np.int32).reshape(1, nb, cap).repeat(R, 0)
    drop = rng.random((R, nb, cap)) < 0.2  # padding: no candidate
    keys[drop], slots[drop] = 0, -1
    slot_ad_id = rng.permutation(100_000)[: nb * cap].astype(np.int64)
    plan = replace(topk_lab.VERSIONS[number].recipe, segment_len=100)  # 4 segments of up to 100
    got = _plan_topk(plan, keys, slots, slot_ad_id, k, cap)
    for r in range(R):
        live = keys[r] != 0
        want = topk_host(slot_ad_id[slots[r][live]], scores[r][live], k)
        assert np.array_equal(got[r][0], want[0]), f"v{number} request {r}: ids"
        assert np.array_equal(got[r][1], want[1]), f"v{number} request {r}: scores"


def test_block_selection_keeps_exactly_the_block_best():
    """Scores with many exact ties through the fused kernel's per-block radix select: every block keeps
    its top `cap` (ties at the cut-off resolved by arrival), so the final top-k is tie-correct."""
    from gpu.fused import FusedScorer
    from gpu.lab import score as score_lab
    from andromeda_nb.scoring import dot_table

    rng = np.random.default_rng(11)
    S, Dm = 512, 16
    values = np.zeros((S, Dm), np.float32)
    values[:, 0] = rng.integers(-20, 20, S) / 8.0  # dot with u = e0: 40 distinct values
    ids = rng.permutation(5000)[:S].astype(np.int64)
    fs = FusedScorer(values, np.ones(S, np.float32), np.zeros(2, np.int16), ids, experts=1, top_e=1,
                     version=score_lab.VERSIONS[2], kind="dot")
    elig = np.full((1, S // 32), 0xFFFFFFFF, np.uint32)
    u = np.zeros(Dm)
    u[0] = 1.0
    for k in (7, 100):
        got_ids, got_scores = fs.topk(elig, dot_table(u, 1, 1)[None], k)[0]
        want_ids, want_scores = topk_host(ids, values[:, 0], k)
        assert np.array_equal(got_scores, want_scores), f"k {k}"
        assert len(got_ids) == k
        # exact ties at the k-th score: any of the tied ids is acceptable as a set member
        kth = want_scores[-1]
        assert np.array_equal(got_ids[got_scores > kth], want_ids[want_scores > kth])


def test_segmented_final_topk_equals_single_block(monkeypatch):
    """Top-K v2 (segments first) on candidates spread over several segments gives v1's answer."""
    from gpu.fused import FusedScorer
    from gpu.kernels import topk
    from gpu.lab import score as score_lab
    from andromeda_nb.scoring import dot_table

    monkeypatch.setattr(topk, "SEGMENT_LEN", 12)  # 2 blocks x 10 candidates: segments of 12 and 8
    rng = np.random.default_rng(12)
    S, Dm = 2560, 16
    values = (rng.standard_normal((S, Dm)) / 4).astype(np.float32)
    ids = rng.permutation(5000)[:S].astype(np.int64)
    fs = FusedScorer(values, np.ones(S, np.float32), np.zeros(S // 256, np.int16), ids, experts=1, top_e=1,
                     version=score_lab.VERSIONS[2], kind="dot")
    elig = rng.integers(0, 2**32, (1, S // 32), dtype=np.uint64).astype(np.uint32)
    u = rng.standard_normal(Dm)
    got = fs.topk(elig, dot_table(u, 1, 1)[None], 10)
    assert fs._full["seg_key"].shape[1] > 1  # the segmented path ran
    for r in range(1):
        rows = np.flatnonzero(np.unpackbits(elig[r].view(np.uint8), bitorder="little"))
        want = topk_host(ids[rows], (values[rows].astype(np.float64) @ u).astype(np.float32), 10)
        assert np.array_equal(got[r][0], want[0]), f"request {r}"
        assert np.allclose(got[r][1], want[1], atol=1e-5)


@pytest.mark.parametrize("on_stream", [False, True])
def test_batches_of_changing_sizes_allocate_nothing_and_answer_right(monkeypatch, on_stream):
    """A server's batches change size from one to the next: after the largest, the scorer and the
    index hand out the first rows of the buffers they keep (no device or pinned allocation, each of
    which synchronizes the device), and every batch still gets the reference answer."""
    from gpu import fused
    from gpu.fused import FusedScorer
    from gpu.lab import score as score_lab
    from andromeda_nb.scoring import dot_table

    rng = np.random.default_rng(21)
    S, Dm, k = 1024, 16, 12
    values = (rng.standard_normal((S, Dm)) / 4).astype(np.float32)
    ids = rng.permutation(9000)[:S].astype(np.int64)
    fs = FusedScorer(values, np.ones(S, np.float32), np.zeros(S // 256, np.int16), ids, experts=1, top_e=1,
                     version=score_lab.VERSIONS[2], kind="dot")
    stream = fused.cuda.stream() if on_stream else 0
    allocations = []
    for name in ("device_array", "pinned_array"):
        real = getattr(fused.cuda, name)
        monkeypatch.setattr(fused.cuda, name, lambda *a, _real=real, _name=name, **kw: allocations.append(_name) or _real(*a, **kw))
    for n, R in enumerate([3, 1, 3, 2]):
        if n == 1:
            allocations.clear()  # the first (largest) batch made the buffers
        elig = rng.integers(0, 2**32, (R, S // 32), dtype=np.uint64).astype(np.uint32)
        users = rng.standard_normal((R, Dm))
        tabs = np.stack([dot_table(u, 1, 1) for u in users]).astype(np.float32)
        got = fs.topk(elig, tabs, k, stream)
        assert len(got) == R
        for r in range(R):
            rows = np.flatnonzero(np.unpackbits(elig[r].view(np.uint8), bitorder="little"))
            want = topk_host(ids[rows], (values[rows].astype(np.float64) @ users[r]).astype(np.float32), k)
            assert np.array_equal(got[r][0], want[0]), f"batch {n} of {R}, request {r}"
            assert np.allclose(got[r][1], want[1], atol=1e-5)
    assert allocations == [], f"allocated after the largest batch: {allocations}"
