"""The tensor-core scorer (gpu/kernels/score_mma.py) and its warp-level pieces (gpu/kernels/mma.py).

Under the CUDA simulator (CI): the k permutation, the B-fragment preparation (device kernel against the
numpy form, bit for bit), the emulated m16n8k16 product against numpy, the exact int8 and float32
conversions, and the whole fused kernel against the float64 reference on tiny pools. Compiled for
sm_90 in a subprocess: the products are `mma.sync` instructions, with no float64 and no local memory.
With ANDROMEDA_TEST_GPU=1 the same kernel runs on the real device on larger pools.
"""

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
from andromeda_nb.testing import KERNEL_DEVICE
from andromeda_nb.scoring import fold_tables
from andromeda_nb.slots import CHUNK_SLOTS

from gpu.kernels import mma
from tests.gpu.test_score_kernels import _check, random_user_side
from tests.support.lab import lab_case
from tests.support.ptx import needs_nvrtc

ROOT = Path(__file__).resolve().parents[2]
ON_GPU = KERNEL_DEVICE == "gpu"


@cuda.jit
def one_product(a, b, c, out):
    """One warp's m16n8k16 product: a uint32[32, 4], b uint32[32, 2], c float32[32, 4] per lane."""
    i = cuda.threadIdx.x
    d0, d1, d2, d3 = mma.mma_f16(a[i, 0], a[i, 1], a[i, 2], a[i, 3], b[i, 0], b[i, 1], c[i, 0], c[i, 1], c[i, 2],
                                 c[i, 3])
    out[i, 0], out[i, 1], out[i, 2], out[i, 3] = d0, d1, d2, d3


@cuda.jit
def convert(w, x, lo, hi, split_hi, split_lo):
    """Per thread: the int8 pairs of word w[i], and the fp16 split of x[i], x[i + 1]."""
    i = cuda.threadIdx.x
    wx = w[i] ^ np.uint32(mma.I8_FLIP)
    lo[i] = mma.i8x2_to_f16x2(wx, np.uint32(mma.I8_LO))
    hi[i] = mma.i8x2_to_f16x2(wx, np.uint32(mma.I8_HI))
    h, l = mma.split_f16x2(x[i], x[(i + 1) % 256])
    split_hi[i] = h
    split_lo[i] = l


def _sm():
    from gpu.kernels import score_mma

    return score_mma


@pytest.mark.parametrize("precision,dim", [("fp32", 16), ("fp32", 64), ("fp16", 32), ("fp16", 64), ("fp16", 128),
                                           ("int8", 64), ("int8", 128)])
def test_dim_map_is_a_permutation(precision, dim):
    dims = _sm().dim_map(precision, dim)
    assert dims.shape == (dim // 16, 16)
    assert sorted(dims.ravel().tolist()) == list(range(dim))


def test_unsupported_shapes_are_refused():
    sm = _sm()
    assert not sm.supports("moe", "int8", 32, 6)  # half a quad per lane
    assert not sm.supports("dot", "fp16", 64, 6)
    with pytest.raises(ValueError, match="does not serve"):
        sm.dim_map("int8", 32)
    with pytest.raises(ValueError, match="mode"):
        sm.get_mma_kernel("fp16", 64, 6, 2, mode="sloppy")


def _tables(rng, R, F, D, E, magnitude=1.0):
    tabs = np.stack([fold_tables(*(lambda s: (s.U, s.Q, s.gamma, s.beta))(random_user_side(rng, D=D, E=E, F=F)))
                     for _ in range(R)])
    return (tabs * np.float32(magnitude)).astype(np.float32)


@pytest.mark.parametrize("precision,magnitude", [("fp16", 1.0), ("int8", 3e4), ("fp32", 1e-3)])
def test_prepared_fragments_equal_the_host_form_and_carry_the_table(precision, magnitude):
    """The device preparation equals the numpy form bit for bit; (hi + lo) * inverse scale at the
    fragment positions gives back the table to about 22 bits, at any magnitude (no fp16 overflow)."""
    sm = _sm()
    rng = np.random.default_rng(11)
    R, F, D, E = 2, 3, 64, 6
    tabs = _tables(rng, R, F, D, E, magnitude)
    tabs[1, 2, : 2 * E * D] = 0.0  # an all-zero table: scale 1
    frag, fscale = sm.get_mma_kernel(precision, D, E, 2).prepare(cuda.to_device(tabs))
    host_frag, host_scale = sm.fragment_tables_host(tabs, precision, D, E)
    assert np.array_equal(frag.copy_to_host(), host_frag)
    assert np.array_equal(fscale.copy_to_host(), host_scale)
    # read the fragments back as B[k, n] per (request, format, k-step, n-tile)
    dims = sm.dim_map(precision, D)
    NG = sm.n_gate_tiles(E)
    NT, T = 2 * NG, D // 16
    words = host_frag.reshape(R, F, T * NT, 32, 4)
    lanes = np.arange(32)
    g, q = lanes >> 2, lanes & 3
    for r in range(R):
        for f in range(F):
            row = tabs[r, f]
            tol = 2.0 ** -20 * max(1e-30, float(np.abs(row[: 2 * E * D]).max()))
            for t in range(T):
                for n in range(NT):
                    e = 8 * (n % NG) + g
                    off = (E * D if n >= NG else 0) + e * D
                    for upper in (0, 1):
                        hi_lo, hi_hi = mma.f16_halves(words[r, f, t * NT + n, :, upper])
                        lo_lo, lo_hi = mma.f16_halves(words[r, f, t * NT + n, :, 2 + upper])
                        for part, (h, l) in enumerate(((hi_lo, lo_lo), (hi_hi, lo_hi))):
                            k = 8 * upper + 2 * q + part
                            want = np.where(e < E, row[np.minimum(off + dims[t, k], len(row) - 1)], 0.0)
                            got = (h.astype(np.float64) + l) * host_scale[r, f]
                            assert np.all(np.abs(got - want) <= tol), (precision, r, f, t, n, upper, part)


def test_emulated_product_follows_the_fragment_layout():
    """One warp: A (16 x 16) and B (16 x 8) handed out in the m16n8k16 fragment layout, the product
    read back from the accumulator layout, against numpy."""
    rng = np.random.default_rng(2)
    A = rng.standard_normal((16, 16)).astype(np.float16)
    B = rng.standard_normal((16, 8)).astype(np.float16)
    C = rng.standard_normal((16, 8)).astype(np.float32)
    a_words = np.zeros((32, 4), np.uint32)
    b_words = np.zeros((32, 2), np.uint32)
    for lane in range(32):
        g, q = lane >> 2, lane & 3
        a_words[lane] = [mma.f16_words(A[g, 2 * q], A[g, 2 * q + 1]), mma.f16_words(A[g + 8, 2 * q], A[g + 8, 2 * q + 1]),
                         mma.f16_words(A[g, 8 + 2 * q], A[g, 9 + 2 * q]),
                         mma.f16_words(A[g + 8, 8 + 2 * q], A[g + 8, 9 + 2 * q])]
        b_words[lane] = [mma.f16_words(B[2 * q, g], B[2 * q + 1, g]), mma.f16_words(B[8 + 2 * q, g], B[9 + 2 * q, g])]
    c_in = np.zeros((32, 4), np.float32)
    for lane in range(32):
        g, q = lane >> 2, lane & 3
        c_in[lane] = [C[g, 2 * q], C[g, 2 * q + 1], C[g + 8, 2 * q], C[g + 8, 2 * q + 1]]

    out = np.zeros((32, 4), np.float32)
    one_product[1, 32](a_words, b_words, c_in, out)
    want = A.astype(np.float64) @ B.astype(np.float64) + C
    for lane in range(32):
        g, q = lane >> 2, lane & 3
        expect = [want[g, 2 * q], want[g, 2 * q + 1], want[g + 8, 2 * q], want[g + 8, 2 * q + 1]]
        assert np.allclose(out[lane], expect, rtol=1e-5, atol=1e-5), lane


def test_int8_pairs_and_float32_splits_are_exact():
    words = np.arange(256, dtype=np.uint32) * np.uint32(0x01010101) ^ np.uint32(0x00FF7F80)
    x = np.random.default_rng(4).standard_normal(256).astype(np.float32) * np.float32(100.0)

    lo, hi, sh, sl = (np.zeros(256, np.uint32) for _ in range(4))
    convert[1, 256](words, x, lo, hi, sh, sl)
    signed = words.view(np.int8).reshape(256, 4).astype(np.float32)
    assert np.array_equal(np.stack(mma.f16_halves(lo), 1), signed[:, :2])
    assert np.array_equal(np.stack(mma.f16_halves(hi), 1), signed[:, 2:])
    h0, h1 = mma.f16_halves(sh)
    l0, l1 = mma.f16_halves(sl)
    x1 = np.roll(x, -1)
    assert np.array_equal(h0, x.astype(np.float16).astype(np.float32))
    assert np.all(np.abs(h0.astype(np.float64) + l0 - x) <= np.abs(x) * 2.0**-21)
    assert np.all(np.abs(h1.astype(np.float64) + l1 - x1) <= np.abs(x1) * 2.0**-21)


def _scored_case(seed, precision, D, E, top, n_chunks, R, F=3, density=0.5):
    rng = np.random.default_rng(seed)
    S = n_chunks * CHUNK_SLOTS
    chunk_format = rng.integers(0, F, n_chunks).astype(np.int32)
    table = quantize((rng.standard_normal((S, D)) / math.sqrt(D)).astype(np.float32), precision)
    ids = rng.permutation(10 * S)[:S].astype(np.int64)
    sides = [random_user_side(rng, D=D, E=E, F=F, top=top) for _ in range(R)]
    bits = (rng.random((R, S)) < density).astype(np.uint8)
    bits[:, : S // 4] = 0  # whole tiles with nothing eligible (skipped on the GPU)
    elig = np.packbits(bits, axis=1, bitorder="little").view(np.uint32)
    tabs = np.stack([fold_tables(s.U, s.Q, s.gamma, s.beta) for s in sides])
    return rng, chunk_format, table, ids, sides, elig, tabs


SIM_CASES = [("fp16", 64, 6, 2), ("int8", 64, 6, 2), ("fp32", 64, 6, 2), ("fp16", 32, 9, 3)]


@pytest.mark.parametrize("precision,D,E,top,version", [(*c, 5) for c in SIM_CASES] + [(*c, 7) for c in SIM_CASES[:2]])
def test_tensor_core_kernel_equals_the_reference(precision, D, E, top, version):
    """The fused kernel, exact mode, against the float64 reference (scores within SCORE_ATOL, gate
    ties excused; top-K order); E = 9 takes two n-tiles of gates and of experts. v7 walks each chunk's
    list of eligible slots (the case's first quarter has none)."""
    from gpu.fused import FusedScorer
    from gpu.kernels.score import TensorCoreRecipe
    from gpu.lab import score as lab

    seed = 300 + D + E
    n_chunks, R = (64, 3) if ON_GPU else (1, 1)
    density = 0.5 if version == 5 or ON_GPU else 0.1  # v7 under the simulator: one tile of listed slots
    rng, chunk_format, table, ids, sides, elig, tabs = _scored_case(seed, precision, D, E, top, n_chunks, R,
                                                                    density=density)
    fs = FusedScorer(table.values, table.scale, chunk_format, ids, experts=E, top_e=top, version=lab.VERSIONS[version])
    assert isinstance(fs.kernel_version.recipe, TensorCoreRecipe)
    k = 40 if not ON_GPU else int(rng.choice([5, 100, 3000]))
    fmt_slot = np.repeat(chunk_format, CHUNK_SLOTS)
    _check(fs.topk(elig, tabs, k), sides, table, fmt_slot, ids, elig, k, "moe",
           context=f"seed {seed} tensor cores {precision} D={D} E={E} top {top} k={k}")


@pytest.mark.parametrize("geometry", ["shipped", "selects every round"])
def test_wide_walk_equals_the_reference(geometry):
    """v8, the compacted walk over 64 chunks a block with its keys as a list: as shipped (the list
    selected once, at the end, from two chunks' eligible ads, and the block's output padded), and with
    a list selected after every round that passes 16 entries (eligible ads in the first and the ninth
    chunk: two rounds, each selecting its own top k into its own output block). On the GPU: 192 chunks
    (three blocks, the list selected mid-walk) and R = 3."""
    from gpu.fused import FusedScorer
    from gpu.kernels import score_mma
    from gpu.lab import score as lab

    n_chunks, R = (192, 3) if ON_GPU else (9, 1)
    rng, chunk_format, table, ids, sides, elig, tabs = _scored_case(77, "fp16", 64, 6, 2, n_chunks, R,
                                                                    density=0.5 if ON_GPU else 0.1)
    if not ON_GPU:  # eligible ads in chunks 0 and 8 only: one per round of the walk
        bits = np.unpackbits(elig.view(np.uint8), axis=1, bitorder="little")
        bits[:, : CHUNK_SLOTS] = rng.random((R, CHUNK_SLOTS)) < 0.1
        bits[:, CHUNK_SLOTS : 8 * CHUNK_SLOTS] = 0
        elig = np.packbits(bits, axis=1, bitorder="little").view(np.uint32)
    fs = FusedScorer(table.values, table.scale, chunk_format, ids, experts=6, top_e=2, version=lab.VERSIONS[8])
    assert fs.kernel.spec.wide and fs.kernel.grid(fs.n_slots, R)[0] == -(-n_chunks // score_mma.WIDE_CHUNKS)
    if geometry != "shipped":
        fs.kernel = score_mma.get_mma_kernel("fp16", 64, 6, 2, max_registers=80, wide=True, emit_at=16,
                                             out_slots=score_mma.ROUND_SLOTS)
    k = 10 if not ON_GPU else int(rng.choice([5, 100, 3000]))
    _check(fs.topk(elig, tabs, k), sides, table, np.repeat(chunk_format, CHUNK_SLOTS), ids, elig, k, "moe",
           context=f"wide walk ({geometry}) k={k}")
    with pytest.raises(ValueError, match="can overflow"):
        score_mma.get_mma_kernel("fp16", 64, 6, 2, wide=True, emit_at=16)  # 8 selections, 4 output blocks


@pytest.mark.parametrize("version, chunks", [(10, 16)])
def test_wide_walk_over_fewer_chunks_equals_the_reference(version, chunks):
    """v10, the wide walk over 16 chunks a block (more, shorter blocks for a lone request): the same
    output blocks as v8, more kernel blocks, the same answers. 17 chunks under the simulator: the
    second block holds one chunk."""
    from gpu.fused import FusedScorer
    from gpu.kernels import score_mma
    from gpu.lab import score as lab

    n_chunks, R = (200, 3) if ON_GPU else (17, 1)
    rng, chunk_format, table, ids, sides, elig, tabs = _scored_case(78 + chunks, "fp16", 64, 6, 2, n_chunks, R,
                                                                    density=0.3 if ON_GPU else 0.08)
    fs = FusedScorer(table.values, table.scale, chunk_format, ids, experts=6, top_e=2, version=lab.VERSIONS[version])
    assert fs.kernel.spec.chunks == chunks and fs.kernel.ads_per_block == score_mma.ADS_PER_BLOCK
    assert fs.kernel.grid(fs.n_slots, R)[0] == -(-n_chunks // chunks)
    k = 10 if not ON_GPU else int(rng.choice([5, 100, 3000]))
    _check(fs.topk(elig, tabs, k), sides, table, np.repeat(chunk_format, CHUNK_SLOTS), ids, elig, k, "moe",
           context=f"wide walk over {chunks} chunks k={k}")
    with pytest.raises(ValueError, match="multiple of 8 chunks"):
        score_mma.get_mma_kernel("fp16", 64, 6, 2, wide=True, chunks=12)


@pytest.mark.parametrize("number", [lab_case(11), lab_case(13), lab_case(14)])  # v14: v11 at 128 registers
def test_request_major_grid_equals_the_reference(number):
    """v11, v8 with the grid's axes swapped (blockIdx.x the request, blockIdx.y the block of slots):
    the same output blocks, every request's answers equal to the reference. Two requests under the
    simulator, so a request read from the wrong axis leaves one of them unanswered; on the GPU 200
    chunks (four blocks of slots) and R = 3. v13 is v11 with the block top-K counting a warp's equal
    digits at once; v14 is v11 at 128 registers (v17 and the shipped v19 are tested below)."""
    from gpu.fused import FusedScorer
    from gpu.lab import score as lab

    n_chunks, R = (200, 3) if ON_GPU else (9, 2)
    rng, chunk_format, table, ids, sides, elig, tabs = _scored_case(91, "fp16", 64, 6, 2, n_chunks, R,
                                                                    density=0.3 if ON_GPU else 0.08)
    fs = FusedScorer(table.values, table.scale, chunk_format, ids, experts=6, top_e=2, version=lab.VERSIONS[number])
    assert fs.kernel.spec.request_major and fs.kernel.grid(fs.n_slots, R) == (R, -(-n_chunks // 64))
    assert fs.kernel.spec.warp_counts == (number == 13)
    k = 10 if not ON_GPU else int(rng.choice([5, 100, 3000]))
    _check(fs.topk(elig, tabs, k), sides, table, np.repeat(chunk_format, CHUNK_SLOTS), ids, elig, k, "moe",
           context=f"v{number} request-major wide walk k={k}")


def test_pooled_rounds_equal_the_reference():
    """v16 (lab): a round of the wide walk whose listed chunks share a format runs their lists as one,
    its tiles dealt to the warps in turn; a round of mixed formats runs each warp's own list. Under
    the simulator 16 chunks, two rounds: the first of one format with 3 to 40 eligible slots in each
    chunk (so no chunk's list fills a tile, and the pooled list's tiles cross the warps' lists), the
    second of two formats (the warps' own lists); k keeps every eligible ad of both requests, so every
    pooled entry's score is checked. On the GPU 200 chunks of runs of one format, R = 3."""
    from gpu.fused import FusedScorer
    from gpu.kernels import score_mma
    from gpu.lab import score as lab

    n_chunks, R = (200, 3) if ON_GPU else (16, 2)
    rng, chunk_format, table, ids, sides, elig, tabs = _scored_case(97, "fp16", 64, 6, 2, n_chunks, R, density=0.0)
    chunk_format[:] = np.repeat(rng.integers(0, 3, -(-n_chunks // 8)), 8)[:n_chunks]  # rounds of one format
    chunk_format[8:16] = [0, 1, 0, 1, 2, 2, 0, 1]  # ... but the second: mixed
    bits = np.zeros((R, n_chunks * CHUNK_SLOTS), np.uint8)
    for r in range(R):
        for c in range(n_chunks):
            if c % 8 != 5:  # one chunk a round lists nothing
                bits[r, c * CHUNK_SLOTS + rng.choice(CHUNK_SLOTS, int(rng.integers(3, 41)), replace=False)] = 1
    elig = np.packbits(bits, axis=1, bitorder="little").view(np.uint32)
    fs = FusedScorer(table.values, table.scale, chunk_format, ids, experts=6, top_e=2, version=lab.VERSIONS[16])
    assert fs.kernel.spec.pooled and fs.kernel.spec.wide and fs.kernel.spec.request_major
    k = int(bits.sum(axis=1).max()) if not ON_GPU else int(rng.choice([5, 100, 3000]))
    _check(fs.topk(elig, tabs, k), sides, table, np.repeat(chunk_format, CHUNK_SLOTS), ids, elig, k, "moe",
           context=f"v16 pooled rounds k={k}")
    assert "_pool" in score_mma.kernel_source(fs.kernel.spec).split("(")[0]


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_free_walk_equals_the_reference(precision):
    """v17 (the shipped v19 without its running floor): a block that counts no more eligible ads than its list holds walks without the
    rounds' barriers and selects once; one with more runs the wide walk's rounds. First v17 as built
    (every block free under the simulator: 9 chunks, two requests); then (fp16) the same walk free only up to
    16 ads, selecting after every round that passes 16 (out_slots one round): request 0 lists 10 ads
    over both rounds (free), request 1 about 50 a round (the rounds), in one launch. On the GPU 200
    chunks, R = 3, densities on both sides of the list."""
    from gpu.fused import FusedScorer
    from gpu.kernels import score_mma
    from gpu.lab import score as lab

    n_chunks, R = (200, 3) if ON_GPU else (9, 2)
    rng, chunk_format, table, ids, sides, elig, tabs = _scored_case(99, precision, 64, 6, 2, n_chunks, R,
                                                                    density=0.5 if ON_GPU else 0.05)
    fs = FusedScorer(table.values, table.scale, chunk_format, ids, experts=6, top_e=2, version=lab.VERSIONS[17])
    assert fs.kernel.spec.free_at == score_mma.LIST_CAP and fs.kernel.spec.request_major
    k = 10 if not ON_GPU else int(rng.choice([5, 100, 3000]))
    fmt_slot = np.repeat(chunk_format, CHUNK_SLOTS)
    _check(fs.topk(elig, tabs, k), sides, table, fmt_slot, ids, elig, k, "moe",
           context=f"v17 free walk {precision} k={k}")
    if precision != "fp16":
        return

    bits = np.zeros((R, n_chunks * CHUNK_SLOTS), np.uint8)
    for r in range(R):
        for c in ([0, 8] if not ON_GPU else range(n_chunks)):
            many = r % 2 == 1 or ON_GPU and c % 3 == 0
            pick = rng.choice(CHUNK_SLOTS, int(rng.integers(40, 60)) if many else 5, replace=False)
            bits[r, c * CHUNK_SLOTS + pick] = 1
    elig = np.packbits(bits, axis=1, bitorder="little").view(np.uint32)
    fs = FusedScorer(table.values, table.scale, chunk_format, ids, experts=6, top_e=2, version=lab.VERSIONS[17])
    fs.kernel = score_mma.get_mma_kernel("fp16", 64, 6, 2, max_registers=128, wide=True, emit_at=16,
                                         out_slots=score_mma.ROUND_SLOTS, request_major=True, free_at=16)
    assert "_free16" in score_mma.kernel_source(fs.kernel.spec).split("(")[0]
    k = 10 if not ON_GPU else int(rng.choice([5, 100, 3000]))
    _check(fs.topk(elig, tabs, k), sides, table, fmt_slot, ids, elig, k, "moe",
           context=f"v17's walk free up to 16 ads k={k}")


@pytest.mark.parametrize("R", [2] if not ON_GPU else [1, 3])
def test_wide_free_walk_over_128_chunks_equals_the_reference(R):
    """v18 (lab): a batch walks 128 chunks a block with v17's free walk, a lone request v17's 64; the
    same output blocks, the answers equal to the reference. 17 chunks under the simulator (one block
    of the batch's walk); on the GPU 300 chunks, R = 1 (the lone walk) and 3, densities on both sides
    of the list."""
    from gpu.fused import FusedScorer
    from gpu.lab import score as lab

    n_chunks = 300 if ON_GPU else 17
    rng, chunk_format, table, ids, sides, elig, tabs = _scored_case(95 + R, "fp16", 64, 6, 2, n_chunks, R,
                                                                    density=0.15 if ON_GPU else 0.05)
    fs = FusedScorer(table.values, table.scale, chunk_format, ids, experts=6, top_e=2, version=lab.VERSIONS[18])
    walk = fs.kernel.lone if R == 1 else fs.kernel.batch
    assert walk.spec.chunks == (64 if R == 1 else 128) and walk.spec.free_at == 4096
    assert walk.grid(fs.n_slots, R) == (R, -(-n_chunks // walk.spec.chunks))
    k = 10 if not ON_GPU else int(rng.choice([5, 100, 3000]))
    _check(fs.topk(elig, tabs, k), sides, table, np.repeat(chunk_format, CHUNK_SLOTS), ids, elig, k, "moe",
           context=f"v18 R={R} k={k}")


def _floor_kernels(n_chunks):
    """A free walk with and without the running floor: the lab's v17 and v19 on the GPU; under the
    simulator the same walks over 8 chunks a block (one output block of a round's slots), so a
    request's few chunks make three blocks, run in order (request 0's blocks before request 1's)."""
    from gpu.kernels import score_mma
    from gpu.lab import score as lab

    if ON_GPU:
        return lab.VERSIONS[17], lab.VERSIONS[19]
    shape = dict(max_registers=128, wide=True, chunks=8, out_slots=score_mma.ROUND_SLOTS, request_major=True,
                 free_at=score_mma.LIST_CAP)
    return (score_mma.get_mma_kernel("fp16", 64, 6, 2, **shape),
            score_mma.get_mma_kernel("fp16", 64, 6, 2, **shape, floor=True))


def _floor_scorers(n_chunks, table, chunk_format, ids):
    from gpu.fused import FusedScorer
    from gpu.lab import score as lab

    plain, floored = _floor_kernels(n_chunks)
    out = []
    for kernel in (plain, floored):
        fs = FusedScorer(table.values, table.scale, chunk_format, ids, experts=6, top_e=2,
                         version=kernel if ON_GPU else lab.VERSIONS[17])
        if not ON_GPU:
            fs.kernel = kernel
        out.append(fs)
    assert not out[0].kernel.spec.floor and out[1].kernel.spec.floor
    return out


def _same_answers(a, b, context):
    for r, ((ia, sa), (ib, sb)) in enumerate(zip(a, b)):
        assert np.array_equal(ia, ib) and np.array_equal(sa, sb), f"{context} request {r}: {ia[:12]} vs {ib[:12]}"


@pytest.mark.parametrize("precision", ["fp16"] if not ON_GPU else ["fp16", "int8"])
def test_running_floor_equals_the_reference_and_the_walk_without_it(precision):
    """v19 (shipped): a block that keeps k ads raises its request's floor to the k-th key it kept, and later
    blocks list the ads scored below it as key 0. The answers equal the reference and (on the GPU) ids
    and scores bit for bit the same walk's without the floor; the floor rose for every request (read
    back after the launch). On the GPU 200 chunks, R = 3 (64 chunks a block)."""
    n_chunks, R = (200, 3) if ON_GPU else (17, 2)
    rng, chunk_format, table, ids, sides, elig, tabs = _scored_case(91, precision, 64, 6, 2, n_chunks, R,
                                                                    density=0.3 if ON_GPU else 0.03)
    plain, floored = _floor_scorers(n_chunks, table, chunk_format, ids)
    k = 10 if not ON_GPU else int(rng.choice([5, 100]))
    got = floored.topk(elig, tabs, k)
    _check(got, sides, table, np.repeat(chunk_format, CHUNK_SLOTS), ids, elig, k, "moe", context=f"v19 {precision} k={k}")
    if ON_GPU:  # under the simulator the tie case below compares the two walks bit for bit
        _same_answers(plain.topk(elig, tabs, k), got, f"v19 against v17 k={k}")
    floor = floored.kernel._bufs["floor"].copy_to_host()[:R]
    assert (floor > 0).all(), f"the floor never rose: {floor}"


def test_running_floor_keeps_a_tie_at_the_floor():
    """An ad whose key equals the floor may still be in the answer (ties go to the lower ad id), so the
    floor leaves out only keys below it: the second block lists 60 ads and raises the floor to its k-th
    key; the third block holds one copy of that ad (its row, its chunk's format), with a lower id, and
    scored after the floor rose. The two tie for the answer's last place: it has the copy, as the walk
    without the floor answers."""
    from tests.gpu.test_score_kernels import reference64

    n_chunks, k = 24, 10
    rng, chunk_format, table, ids, sides, _, tabs = _scored_case(93, "fp16", 64, 6, 2, n_chunks, 1)
    per_block = (64 if ON_GPU else 8) * CHUNK_SLOTS
    if ON_GPU:  # blocks of 64 chunks: the same three blocks over 192 chunks
        n_chunks = 192
        rng, chunk_format, table, ids, sides, _, tabs = _scored_case(93, "fp16", 64, 6, 2, n_chunks, 1)
    bits = np.zeros(n_chunks * CHUNK_SLOTS, np.uint8)
    listed = per_block + rng.choice(per_block, 60, replace=False)
    bits[listed] = 1
    ref = reference64(sides[0], table.values[listed], table.scale[listed],
                      np.repeat(chunk_format, CHUNK_SLOTS)[listed])[0]
    order = np.argsort(-ref)
    gaps = np.abs(np.diff(ref[order]))
    kk = next(j for j in range(k - 1, 40) if gaps[j - 1] > 1e-3 and gaps[j] > 1e-3)  # the k-th, well apart
    src = int(listed[order[kk]])
    dst = 2 * per_block + 5 * CHUNK_SLOTS + 17
    table.values[dst], table.scale[dst] = table.values[src], table.scale[src]
    chunk_format[dst // CHUNK_SLOTS] = chunk_format[src // CHUNK_SLOTS]
    if ids[dst] > ids[src]:
        ids[dst], ids[src] = ids[src], ids[dst]
    bits[dst] = 1
    elig = np.packbits(bits[None], axis=1, bitorder="little").view(np.uint32)
    plain, floored = _floor_scorers(n_chunks, table, chunk_format, ids)
    want = plain.topk(elig, tabs, kk + 1)  # the copies tie for the last place: the lower id takes it
    assert ids[dst] in want[0][0] and ids[src] not in want[0][0]
    _same_answers(want, floored.topk(elig, tabs, kk + 1), "v19 tie at the floor")
    _check(want, sides, table, np.repeat(chunk_format, CHUNK_SLOTS), ids, elig, kk + 1, "moe", context="v17 tie")


@pytest.mark.parametrize("R", [1] if not ON_GPU else [1, 3])  # R > 1 runs v11, tested above
def test_lone_walk_equals_the_reference(R):
    """v12: a batch of one request runs the 16-chunk walk (its own kernel, four times the blocks), a
    larger batch v11's request-major walk; both write the same output blocks, and the answers equal
    the reference. 17 chunks under the simulator: the lone walk's second block holds one chunk."""
    from gpu.fused import FusedScorer
    from gpu.graphs import Launch
    from gpu.lab import score as lab

    n_chunks = 200 if ON_GPU else 17
    rng, chunk_format, table, ids, sides, elig, tabs = _scored_case(93 + R, "fp16", 64, 6, 2, n_chunks, R,
                                                                    density=0.3 if ON_GPU else 0.08)
    fs = FusedScorer(table.values, table.scale, chunk_format, ids, experts=6, top_e=2, version=lab.VERSIONS[12])
    walk = fs.kernel.lone if R == 1 else fs.kernel.batch
    assert walk.spec.chunks == (16 if R == 1 else 64) and fs.kernel.lone.ads_per_block == fs.kernel.ads_per_block
    launched = [s for s in fs.kernel.plan(fs.d_emb, fs.d_scale, fs.d_chunk_format, elig, tabs, 10,
                                          np.zeros((R, 1, 10), np.uint32), np.zeros((R, 1, 10), np.int32))
                if isinstance(s, Launch) and s.kernel is walk.kernel]
    assert len(launched) == 1 and launched[0].grid == walk.grid(fs.n_slots, R)
    k = 10 if not ON_GPU else int(rng.choice([5, 100, 3000]))
    _check(fs.topk(elig, tabs, k), sides, table, np.repeat(chunk_format, CHUNK_SLOTS), ids, elig, k, "moe",
           context=f"lone walk R={R} k={k}")


def test_fast_mode_meets_the_reduced_precision_rule():
    """'fast' (fp16 tables, no low part): scores within 1e-2 of the reference's score spread and at
    least 99% of the reference top-K recovered (DESIGN section 4)."""
    from andromeda_nb.reference import reference_topk
    from gpu.fused import FusedScorer
    from gpu.kernels import score_mma

    n_chunks = 64 if ON_GPU else 1
    rng, chunk_format, table, ids, sides, elig, tabs = _scored_case(41, "fp16", 64, 6, 2, n_chunks, 1, density=1.0)
    fs = FusedScorer(table.values, table.scale, chunk_format, ids, experts=6, top_e=2, version=4)
    fs.kernel = score_mma.get_mma_kernel("fp16", 64, 6, 2, mode="fast")
    k = 100
    got_ids, got_scores = fs.topk(elig, tabs, k)[0]
    from tests.gpu.test_score_kernels import reference64

    rows = np.flatnonzero(np.unpackbits(elig[0].view(np.uint8), bitorder="little"))
    ref, _ = reference64(sides[0], table.values[rows], table.scale[rows], np.repeat(chunk_format, CHUNK_SLOTS)[rows])
    want_ids, _ = reference_topk(ids[rows], ref, k)
    where = {int(a): i for i, a in enumerate(ids[rows])}
    err = np.abs(got_scores - ref[[where[int(a)] for a in got_ids]])
    spread = float(ref.max() - ref.min())
    assert err.max() <= 1e-2 * spread
    assert len(set(got_ids.tolist()) & set(want_ids.tolist())) >= 0.99 * min(k, len(rows))


@pytest.mark.skipif(ON_GPU, reason="compiled by the GPU run itself")
@needs_nvrtc
def test_tensor_core_kernels_compile_for_sm90():
    """Every served shape compiles for sm_90 (compile_ptx, no GPU): the products are mma.sync
    instructions, with no float64 arithmetic and no local memory."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(ROOT)
    cases = ["fp16:64:exact", "int8:64:exact", "fp32:64:exact", "fp16:128:exact", "int8:128:exact", "fp16:64:fast",
             "fp16:64:exact:compact", "int8:64:exact:compact", "fp16:64:exact:wide", "fp16:64:exact:wide:rm:wc",
             "fp16:64:exact:wide:rm:pool", "fp16:64:exact:wide:rm:free", "fp16:64:exact:wide:rm:free:floor"]
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "support" / "ptx_mma_check.py"), *half],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for half in (cases[0::2], cases[1::2])]
    rows = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(rows) == len(cases) + 1, rows  # + the preparation kernel
    for row in rows:
        assert row["mma"] == row["mma_expected"], row
        assert not row["local_memory"] and not row["f64"], row


def test_the_tensor_core_kernel_ships_only_where_the_device_has_tensor_cores(monkeypatch):
    from gpu import runtime
    from gpu.kernels import score as sk

    assert sk.version(None, "moe", "fp16", 64).number == sk.SHIPPED == 19
    for shape in (("moe", "fp32", 64), ("moe", "fp16", 128), ("dot", "fp16", 64)):
        assert sk.version(None, *shape).number == sk.FALLBACK, shape
    monkeypatch.setattr(runtime, "has_tensor_cores", lambda: False)  # a device before compute capability 8.0
    assert sk.version(None, "moe", "int8", 64).number == sk.FALLBACK
