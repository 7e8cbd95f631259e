"""The batched tensor-core scorer (gpu/lab/score_batched.py) under the CUDA simulator, on tiny pools of
fresh random data: against the float64 reference (fp16 and int8 storage, batches of 1, 3 and a group
boundary + 1, eligibility clustered in tiles with empty tiles and a request that sees nothing), through
the list pruning, with ties ordered by ad id, and against the shipped kernel's answers and the full
walk's per-block candidates. Compiled for sm_90 in a subprocess: mma.sync products, no float64, no
local memory (and, where ptxas is installed, its register count and no spills).
With ANDROMEDA_TEST_GPU=1 the same checks run on the device on larger pools.

The kernel is a lab version measured slower than the shipped one (docs/BENCHMARKS.md), and each of
its simulated launches takes tens of seconds: under the simulator the default run keeps one case of
each check (`lab_case`); `--slow` (or the device) runs them all."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from numba import cuda  # after tests/conftest.py chose the simulator or the device

from andromeda_nb.model import quantize
from andromeda_nb.scoring import fold_tables
from andromeda_nb.slots import CHUNK_SLOTS
from andromeda_nb.testing import KERNEL_DEVICE

from tests.gpu.test_score_kernels import _check, random_user_side
from tests.support.lab import FULL, lab_case
from tests.support.ptx import needs_nvrtc

ROOT = Path(__file__).resolve().parents[2]
ON_GPU = KERNEL_DEVICE == "gpu"
E, TOP, F = 6, 2, 3


def clustered_eligibility(rng, R, S, tile_share, density, empty_request=None):
    """uint32 (R, S / 32): per request a random `tile_share` of the 32-slot tiles holds eligible ads, each
    slot of such a tile eligible with `density` (a match leaves eligible ads clustered); the first
    tile of every chunk is empty for all, and request `empty_request` (if any) sees nothing."""
    tiles = S // 32
    bits = np.zeros((R, S), np.uint8)
    for r in range(R):
        chosen = np.flatnonzero(rng.random(tiles) < tile_share)
        for t in chosen:
            bits[r, 32 * t: 32 * t + 32] = rng.random(32) < density
    bits.reshape(R, -1, CHUNK_SLOTS)[:, :, :32] = 0
    if empty_request is not None:
        bits[empty_request] = 0
    return np.packbits(bits, axis=1, bitorder="little").view(np.uint32)


def _case(seed, precision, n_chunks, R, *, tile_share=0.5, density=0.3, empty_request=None):
    rng = np.random.default_rng(seed)
    S = n_chunks * CHUNK_SLOTS
    chunk_format = rng.integers(0, F, n_chunks).astype(np.int32)
    table = quantize((rng.standard_normal((S, 64)) / math.sqrt(64)).astype(np.float32), precision)
    ids = rng.permutation(10 * S)[:S].astype(np.int64)
    sides = [random_user_side(rng, D=64, E=E, F=F, top=TOP) for _ in range(R)]
    elig = clustered_eligibility(rng, R, S, tile_share, density, empty_request)
    tabs = np.stack([fold_tables(s.U, s.Q, s.gamma, s.beta) for s in sides]).astype(np.float32)
    return rng, chunk_format, table, ids, sides, elig, tabs


def _scorer(table, chunk_format, ids, **shape):
    """A FusedScorer running the batched kernel (`shape`: BatchedSpec's chunks, list_entries, rg_max)."""
    from gpu.fused import FusedScorer
    from gpu.lab import score_batched as sb

    fs = FusedScorer(table.values, table.scale, chunk_format, ids, experts=E, top_e=TOP, version=sb.BATCHED)
    if shape:
        fs.kernel = sb.get_batched_kernel(table.precision, 64, E, TOP, **shape)
    return fs


def test_group_sizes():
    from gpu.lab import score_batched as sb

    spec = sb.BatchedSpec("fp16", 64, E, TOP)
    assert sb.group_size(spec, 64, 100) == 16  # k = 100: 16 requests a group
    assert sb.group_size(spec, 20, 100) == 10  # balanced: two groups of 10, not 16 + 4
    assert sb.group_size(spec, 1, 100) == 1
    assert sb.group_size(spec, 5, 4096) == 1  # the largest k: one request a group
    assert sb.group_size(sb.BatchedSpec("fp16", 64, E, TOP, rg_max=2), 3, 10) == 2
    with pytest.raises(ValueError, match="no room"):
        sb.group_size(sb.BatchedSpec("fp16", 64, E, TOP, list_entries=300), 1, 100)


# (precision, R, rg_max, select): one request; three in one group; three over groups of two (a group
# boundary + 1), the lists selected by the block and by warps
REFERENCE_CASES = [lab_case("fp16", 1, 16, "block"), lab_case("int8", 3, 16, "block"), ("fp16", 3, 2, "block"),
                   lab_case("int8", 3, 2, "warp"), lab_case("fp16", 3, 16, "warp")]


@pytest.mark.parametrize("precision,R,rg_max,select", REFERENCE_CASES)
def test_batched_kernel_equals_the_reference(precision, R, rg_max, select):
    """Every request's answer against the float64 reference (scores within 1e-4, gate ties excused,
    top-K order); 512-slot blocks, so two output blocks (on the GPU: 64 chunks, 4096-slot blocks)."""
    seed = 500 + R + rg_max + (precision == "int8") + 7 * (select == "warp")
    n_chunks, chunks = (64, 16) if ON_GPU else (4, 2)
    empty = 1 if R >= 3 else None
    rng, chunk_format, table, ids, sides, elig, tabs = _case(seed, precision, n_chunks, R, empty_request=empty)
    fs = _scorer(table, chunk_format, ids, chunks=chunks, rg_max=rg_max, select=select)
    k = 40 if not ON_GPU else int(rng.choice([5, 100, 3000]))
    answers = fs.topk(elig, tabs, k)
    if empty is not None:
        assert len(answers[empty][0]) == 0
    _check(answers, sides, table, np.repeat(chunk_format, CHUNK_SLOTS), ids, elig, k, "moe",
           context=f"seed {seed} batched {precision} R={R} rg_max={rg_max} {select} selection k={k}")


def _warp_select_kernel():
    """A one-warp kernel running the batched kernel's list selection over keys[3:3 + n]."""
    from gpu.lab.score_batched import WARP_STATE, warp_topk_emit_list

    @cuda.jit
    def select(keys, offs, n, cap, out_key, out_slot):
        hist = cuda.shared.array(256, np.uint32)
        part = cuda.shared.array(32, np.uint32)
        st = cuda.shared.array(WARP_STATE, np.uint32)
        warp_topk_emit_list(keys, offs, 3, n, cap, hist, part, st, True, out_key, out_slot, 0, 1, 1000)

    return select


@pytest.mark.parametrize("n,cap", [(0, 5), (7, 7), (7, 20), (300, 1), (300, 40), (300, 299)])
def test_warp_selection_keeps_the_largest_keys(n, cap):
    """The warp's radix select over a list with many equal keys: the kept keys are the `cap` largest as
    a multiset, each with its own slot, the rest padded (key 0, slot -1)."""
    rng = np.random.default_rng(n + cap)
    keys = (rng.integers(1, 40, n) * np.uint32(0x01010101)).astype(np.uint32)  # ties in every digit
    offs = rng.permutation(4 * max(n, 1))[:n].astype(np.int32)
    out_key = np.full((1, 2, cap), 7, np.uint32)
    out_slot = np.full((1, 2, cap), 7, np.int32)
    lead = np.array([9, 9, 9], np.uint32)  # entries before the list's base, never selected
    _warp_select_kernel()[1, 32](np.concatenate([lead, keys]), np.concatenate([lead.astype(np.int32), offs]),
                                 np.int32(n), np.int32(cap), out_key, out_slot)
    got_k, got_s = out_key[0, 1], out_slot[0, 1]
    m = min(n, cap)
    assert sorted(got_k[:m].tolist(), reverse=True) == sorted(keys.tolist(), reverse=True)[:m]
    assert (got_k[m:] == 0).all() and (got_s[m:] == -1).all()
    slot_of = {1000 + int(o): int(k) for k, o in zip(keys, offs)}
    assert all(slot_of[int(s_)] == int(k_) for k_, s_ in zip(got_k[:m], got_s[:m]))
    assert len(set(got_s[:m].tolist())) == m
    assert (out_key[0, 0] == 7).all()  # nothing written outside its output block


@pytest.mark.parametrize("select", [lab_case("warp"), lab_case("block")])
def test_lists_pruned_mid_block_keep_the_best(select):
    """Lists with room for little more than a round: after every round a request's list is pruned to
    its best `cap` through its output block (selected by one warp, or by the whole block), and the
    answers are still the reference's."""
    from gpu.lab import score_batched as sb

    R, k = 3, 6
    n_chunks = 64 if ON_GPU else 3
    rng, chunk_format, table, ids, sides, elig, tabs = _case(601, "fp16", n_chunks, R, tile_share=0.9, density=0.6)
    entries = 2 * (k + sb.ROUND_SLOTS + 10)  # two requests a group, each pruned once its list passes 16
    fs = _scorer(table, chunk_format, ids, chunks=3 if not ON_GPU else 16, list_entries=entries, rg_max=2,
                 select=select)
    assert fs.kernel.group_size(R, k) == 2
    per_chunk = np.unpackbits(elig.view(np.uint8), axis=1, bitorder="little").reshape(R, -1, CHUNK_SLOTS).sum(2)
    assert (per_chunk[:, :-1] > 16).all()  # every round but the last prunes every request
    _check(fs.topk(elig, tabs, k), sides, table, np.repeat(chunk_format, CHUNK_SLOTS), ids, elig, k, "moe",
           context=f"pruned lists ({select} selection) R={R} k={k}")


@pytest.mark.skipif(not FULL, reason="a further check of a lab kernel: with --slow or on the device")
def test_ties_are_ordered_by_ad_id():
    """One ad's row copied to eight slots of one format (two in each 512-slot block): nine equal top
    scores; with k = 3 the answer is the three smallest ids of the copies, ascending (each block keeps
    all its tied copies, so the final top-K sees every one). The shipped kernel gives the same scores;
    its single 16,384-slot block keeps 3 of the 9 ties in arrival order (DESIGN section 4 compares
    tied scores as sets), so only its scores and that its ids are copies are asserted."""
    from gpu.fused import FusedScorer

    n_chunks = 8
    rng, chunk_format, table, ids, sides, elig, tabs = _case(77, "fp16", n_chunks, 1, tile_share=0.6, density=0.5)
    chunk_format[:] = 0
    fs = _scorer(table, chunk_format, ids, chunks=2)
    base = fs.topk(elig, tabs, 1)[0][0][0]  # the best ad: its row copied, so its copies lead
    src = int(np.flatnonzero(ids == base)[0])
    copies = [512 * blk + off for blk in range(4) for off in (40, 300)]
    table.values[copies] = table.values[src]
    table.scale[copies] = table.scale[src]
    bits = np.unpackbits(elig.view(np.uint8), axis=1, bitorder="little")
    bits[0, copies] = 1
    elig = np.packbits(bits, axis=1, bitorder="little").view(np.uint32)
    fs = _scorer(table, chunk_format, ids, chunks=2)
    got_ids, got_scores = fs.topk(elig, tabs, 3)[0]
    tied = np.sort(ids[copies + [src]])
    assert got_ids.tolist() == tied[:3].tolist(), (got_ids, tied)
    assert got_scores[0] == got_scores[1] == got_scores[2]
    shipped = FusedScorer(table.values, table.scale, chunk_format, ids, experts=E, top_e=TOP)
    from gpu.kernels import score as sk

    assert shipped.version == sk.SHIPPED and isinstance(sk.VERSIONS[sk.SHIPPED].recipe, sk.TensorCoreRecipe)
    want_ids, want_scores = shipped.topk(elig, tabs, 3)[0]
    assert np.array_equal(got_scores, want_scores) and set(want_ids.tolist()) <= set(tied.tolist())


@pytest.mark.parametrize("precision", ["fp16", lab_case("int8")])
def test_batched_answers_equal_the_shipped_kernels(precision):
    """The same products and epilogue as the shipped kernel: every answer equal to its answers, ids and
    float32 scores bit for bit, for a batch over two groups (one output block under the simulator)."""
    from gpu.fused import FusedScorer

    R = 3
    n_chunks = 64 if ON_GPU else 2
    rng, chunk_format, table, ids, sides, elig, tabs = _case(700 + len(precision), precision, n_chunks, R,
                                                             empty_request=2)
    fs = _scorer(table, chunk_format, ids, chunks=2, rg_max=2)
    shipped = FusedScorer(table.values, table.scale, chunk_format, ids, experts=E, top_e=TOP)
    from gpu.kernels import score as sk

    assert shipped.version == sk.SHIPPED and isinstance(sk.VERSIONS[sk.SHIPPED].recipe, sk.TensorCoreRecipe)
    k = 30
    for r, ((gi, gs), (wi, ws)) in enumerate(zip(fs.topk(elig, tabs, k), shipped.topk(elig, tabs, k))):
        assert np.array_equal(gi, wi) and np.array_equal(gs, ws), f"{precision} request {r}"


@pytest.mark.skipif(not FULL, reason="a further check of a lab kernel: with --slow or on the device")
def test_batched_candidates_equal_the_full_walks():
    """Per 4096-slot output block (the shipped geometry), the batched kernel's candidates are the full
    walk's (v6, grid (blocks, requests)): the same (slot, key) pairs, padding alike."""
    from gpu.kernels import score_mma

    R, k = 3, 12
    n_chunks = 40 if ON_GPU else 2
    rng, chunk_format, table, ids, sides, elig, tabs = _case(801, "int8", n_chunks, R, empty_request=0)
    fs = _scorer(table, chunk_format, ids)
    assert fs.kernel.ads_per_block == score_mma.ADS_PER_BLOCK
    full = score_mma.get_mma_kernel("int8", 64, E, TOP, max_registers=80)
    nb = -(-n_chunks * CHUNK_SLOTS // score_mma.ADS_PER_BLOCK)
    d_elig, d_tabs = cuda.to_device(elig), cuda.to_device(tabs)
    got = []
    for kernel in (fs.kernel, full):
        out_key = cuda.device_array((R, nb, k), np.uint32)
        out_slot = cuda.device_array((R, nb, k), np.int32)
        kernel.launch(fs.d_emb, fs.d_scale, fs.d_chunk_format, d_elig, d_tabs, k, out_key, out_slot)
        got.append((out_key.copy_to_host(), out_slot.copy_to_host()))
    (bk, bs), (fk, fsl) = got
    for r in range(R):
        for blk in range(nb):
            a = sorted(zip(bs[r, blk][bk[r, blk] != 0].tolist(), bk[r, blk][bk[r, blk] != 0].tolist()))
            w = sorted(zip(fsl[r, blk][fk[r, blk] != 0].tolist(), fk[r, blk][fk[r, blk] != 0].tolist()))
            assert a == w, f"request {r} block {blk}"
            assert (bs[r, blk][bk[r, blk] == 0] == -1).all()
    assert (bk[0] == 0).all()  # request 0 sees nothing


@pytest.mark.skipif(ON_GPU, reason="compiled by the GPU run itself")
@needs_nvrtc
def test_batched_kernels_compile_for_sm90():
    """fp16 storage with both list selections compiles for sm_90 (int8 and fp32 storage, and the
    selections at and without the register cap, with --slow) (compile_ptx, no GPU): the products are mma.sync
    instructions (one request's worth, in the loop over the group), no float64, no local memory; where
    ptxas is installed, it assembles them with no spills (some spill at the 128-register limit: 124
    bytes a thread for fp16 with the block selection, with the CUDA 13.0 ptxas assembling relocatable
    code, which, unlike a whole program, it does past 48 KiB of static shared memory)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(ROOT)
    shapes = ["fp16:64:exact", "fp16:64:exact:128:warp"]  # both selections; every storage with --slow
    if FULL:
        shapes += ["int8:64:exact", "fp32:64:exact", "fp16:64:exact:128", "fp16:64:exact:0:warp"]
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "ptx_batched_check.py"), *shapes],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(shapes), rows
    for row in rows:
        assert row["mma"] == row["mma_expected"], row
        assert not row["local_memory"] and not row["f64"], row
        if row.get("ptxas") and "_r128" not in row["kernel"]:  # held to 128 registers some bytes spill
            assert row["ptxas"]["spill_bytes"] == 0, row


def test_the_version_runs_through_the_scoring_family():
    """v9 is a version of the scoring family: `gpu.kernels.score.get_kernel` builds it from the Version,
    with its register limit per precision and the shipped output blocks (4096 slots)."""
    from gpu.kernels import score as sk
    from gpu.kernels import score_mma
    from gpu.lab import score_batched as sb

    fp16 = sk.get_kernel(sb.BATCHED, "moe", "fp16", 64, E, TOP)
    int8 = sk.get_kernel(sb.BATCHED, "moe", "int8", 64, E, TOP)
    assert isinstance(fp16, sb.BatchedScoreKernel) and fp16.spec.max_registers == 128
    assert int8.spec.max_registers is None
    assert fp16.ads_per_block == int8.ads_per_block == score_mma.ADS_PER_BLOCK
    assert fp16.grid(10 * 4096 + 1, 64, 100) == (4, 11)  # 4 groups of 16, 11 output blocks
    with pytest.raises(ValueError, match="MoE only"):
        sk.get_kernel(sb.BATCHED, "dot", "fp16", 64, E, TOP)
