"""The block-wide radix select that both top-K stages run, written once: the block top-K inside the
scoring kernels (`gpu.kernels.score`) and the segment and final top-K of `gpu.kernels.topk`.

Keys are orderable uint32 (`_bits.f32_to_key`; key 0 marks "no candidate"). Four rounds of 8 bits,
from the top digit down: the block counts the digits of the keys that match the prefix found so
far into shared histograms, and one thread (`radix_digit`) finds the digit of the k-th largest key.
What comes out is that key's value (`kth`), how many keys equal to it are still wanted (`krem`), or
`emit_all` when there are at most k nonzero keys. The callers then emit the keys above `kth` and
`krem` of those equal to it, each in its own layout. The select is written once and compiled in
forms that differ in how a key is read: `radix_select_blocks` over per-block candidates
(R, blocks, width) in global memory (`topk.py`), `radix_select_row` over one block's keys in shared
memory (the scoring kernels); and in how a round's digits are counted: one shared atomic a key
(shipped), or one a distinct digit of a warp's 32 keys (`_warp` forms, `match.any.sync`: the lab's
top-K v3 and scoring v13, measured no faster on an H100, docs/BENCHMARKS.md).

`gpu.runtime.cuda` must have been chosen (device or simulator) before this module is imported.
"""

from __future__ import annotations

from andromeda_nb.templates import specialize

from .. import runtime

cuda = runtime.cuda()
from numba import int32, uint32  # noqa: E402  (after the device choice)

from .warp import match_any_i32  # noqa: E402

HIST_BINS = 256
# shared `state` words of the radix select (uint32 each)
ST_EMIT_ALL, ST_PREFIX, ST_KREM, ST_TOTAL, ST_N_GREATER, ST_N_EQUAL = range(6)
STATE_WORDS = 8


@cuda.jit(device=True)
def radix_digit(hist, part, state, rnd, prefix, shift, krem, k):
    """One thread's step of round `rnd` of a block-wide 4-round radix select for the `k` largest
    keys, after the block has counted the round's 8-bit digits (at bit `shift`, among keys that
    match `prefix` on the higher digits) into hist[0:256] and the sums of each 16 bins into
    part[0:16]. `krem` keys are still wanted. Writes state: in round 0 ST_TOTAL (keys counted) and
    ST_EMIT_ALL = 1 when there are at most k of them; otherwise ST_PREFIX (prefix with this round's
    digit of the k-th key) and ST_KREM (keys still wanted that carry that digit)."""
    if rnd == 0:
        total = uint32(0)
        for g in range(16):
            total += part[g]
        state[ST_TOTAL] = total
        if total <= uint32(k):
            state[ST_EMIT_ALL] = 1
    if state[ST_EMIT_ALL] == 0:
        cum = uint32(0)
        g = 15
        while g > 0 and cum + part[g] < krem:
            cum += part[g]
            g -= 1
        d = g * 16 + 15
        while d > g * 16 and cum + hist[d] < krem:
            cum += hist[d]
            d -= 1
        state[ST_PREFIX] = prefix | (uint32(d) << shift)
        state[ST_KREM] = krem - cum


key_at = None  # bound per form below: how flat entry i of request r is read
count_digits = None  # bound per form below: how a round's digits are counted


def _radix_select_template(keys, r, width, lo, hi, k, hist, part, state, copies):
    """The `k` largest nonzero keys among flat entries [lo, hi) of request r (`key_at` reads entry i).
    `hist` shared uint32[copies * HIST_BINS] holds `copies` histograms (a warp counts into copy
    warp % copies: fewer atomic collisions), `part` shared uint32[16], `state` shared
    uint32[STATE_WORDS]. Every thread of the block calls it (it has barriers) and gets (kth, krem,
    emit_all): with emit_all every nonzero key is wanted (state[ST_TOTAL] counts them); otherwise
    the keys above kth and krem of the keys equal to kth. Leaves state[ST_N_GREATER] and
    state[ST_N_EQUAL] at 0, as emission counters."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    copy = (tid // 32) % copies
    prefix = uint32(0)
    mask = uint32(0)
    krem = uint32(k)
    emit_all = False
    if tid == 0:
        state[ST_EMIT_ALL] = 0
        state[ST_N_GREATER] = 0
        state[ST_N_EQUAL] = 0
    for rnd in range(4):
        shift = uint32(24 - 8 * rnd)
        for j in range(tid, copies * HIST_BINS, nt):
            hist[j] = 0
        cuda.syncthreads()
        count_digits(keys, r, width, lo, hi, hist, copy * HIST_BINS, mask, prefix, shift)
        cuda.syncthreads()
        if tid < 16:
            s = uint32(0)
            for d in range(tid * 16, tid * 16 + 16):
                t = uint32(0)
                for c in range(copies):
                    t += hist[c * HIST_BINS + d]
                hist[d] = t
                s += t
            part[tid] = s
        cuda.syncthreads()
        if tid == 0:
            radix_digit(hist, part, state, rnd, prefix, shift, krem, k)
        cuda.syncthreads()
        if state[ST_EMIT_ALL] != 0:
            emit_all = True
            break
        prefix = state[ST_PREFIX]
        mask = mask | (uint32(255) << shift)
        krem = state[ST_KREM]
    return prefix, krem, emit_all


def _count_each_template(keys, r, width, lo, hi, hist, off, mask, prefix, shift):
    """Count the digit at `shift` of every nonzero key among entries [lo, hi) that matches `prefix` on
    `mask` into hist[off:off + HIST_BINS]: one shared atomic a key."""
    for i in range(lo + cuda.threadIdx.x, hi, cuda.blockDim.x):
        key = key_at(keys, r, width, i)
        if key != 0 and (key & mask) == prefix:
            cuda.atomic.add(hist, off + int32((key >> shift) & uint32(255)), uint32(1))


def _count_by_warp_template(keys, r, width, lo, hi, hist, off, mask, prefix, shift):
    """`_count_each_template`'s counts, one shared atomic per distinct digit of a warp's 32 keys: the
    lanes holding the same digit are found together (`match_any_i32`) and the lowest of them adds
    their number. Scores sit close together, so in the first rounds most keys of a warp share a
    digit, and one atomic a key is 32 atomics on one address, each waiting for the one before.
    Every thread of the block runs every step (the simulator's form of the warp vote needs it)."""
    tid = cuda.threadIdx.x
    below = (uint32(1) << uint32(tid % 32)) - uint32(1)  # the lanes under this one
    base = lo
    while base < hi:
        i = base + tid
        d = int32(HIST_BINS)  # no digit: a key outside the range, 0, or off the prefix
        if i < hi:
            key = key_at(keys, r, width, i)
            if key != 0 and (key & mask) == prefix:
                d = int32((key >> shift) & uint32(255))
        peers = uint32(match_any_i32(d))
        if d != HIST_BINS and (peers & below) == 0:
            cuda.atomic.add(hist, off + d, uint32(cuda.popc(peers)))
        base += cuda.blockDim.x


@cuda.jit(device=True)
def key_in_blocks(keys, r, width, i):
    """Flat entry i of request r of per-block candidates keys uint32[R, blocks, >= width]."""
    b = i // width
    return keys[r, b, i - b * width]


@cuda.jit(device=True)
def key_in_row(keys, r, width, i):
    """Entry i of a one-dimensional key array (a block's keys in shared memory; r and width unused)."""
    return keys[i]


def _select(name: str, key_at, count_template):
    count = cuda.jit(device=True)(specialize(count_template, f"{name}_count", key_at=key_at))
    return cuda.jit(device=True)(specialize(_radix_select_template, name, key_at=key_at, count_digits=count))


# the one radix select, in the forms the top-K stages read their keys in, counting a key at a time; and
# counting a warp's equal digits at once (the lab's top-K v3 and scoring v13)
radix_select_blocks = _select("radix_select_blocks", key_in_blocks, _count_each_template)
radix_select_row = _select("radix_select_row", key_in_row, _count_each_template)
radix_select_blocks_warp = _select("radix_select_blocks_warp", key_in_blocks, _count_by_warp_template)
radix_select_row_warp = _select("radix_select_row_warp", key_in_row, _count_by_warp_template)


__all__ = ["HIST_BINS", "STATE_WORDS", "ST_EMIT_ALL", "ST_KREM", "ST_N_EQUAL", "ST_N_GREATER", "ST_PREFIX",
           "ST_TOTAL", "radix_digit", "radix_select_blocks", "radix_select_blocks_warp", "radix_select_row",
           "radix_select_row_warp"]
