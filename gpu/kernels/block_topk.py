"""The block top-K every scoring kernel ends with (the tiled kernels of `gpu.kernels.score` and the
tensor-core ones of `gpu.kernels.score_mma`): a block's keys in shared memory, its `cap` largest
selected by the block-wide radix select of `gpu.kernels.radix`, only those written out."""

from __future__ import annotations

from andromeda_nb.templates import specialize

from .. import runtime
from .radix import (HIST_BINS, ST_EMIT_ALL, ST_N_EQUAL, ST_N_GREATER, ST_PREFIX, ST_TOTAL, STATE_WORDS, radix_select_row,
                    radix_select_row_warp)

cuda = runtime.cuda()
from numba import int32, uint32  # noqa: E402  (after the device choice)

HIST_COPIES = 8  # per-warp histograms (warp % HIST_COPIES), fewer atomic collisions
ST_KEPT = STATE_WORDS  # the running floor's count of a list's kept keys: a word past the select's own


slot_at = None  # bound per form below: the slot of entry i of a block's keys
select_row = None  # bound per form below: the radix select (counting a key at a time, or a warp's digits at once)


def _block_topk_emit_template(keys, offs, n, cap, hist, part, state, out_key, out_slot, r, b, first_slot):
    """Keep the `cap` largest nonzero keys of shared `keys[:n]` (entry i is slot `slot_at(offs,
    first_slot, i)`) in out_key[r, b, :cap] / out_slot[r, b, :cap]; pad with key 0 when fewer are
    nonzero."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    kth, krem, emit_all = select_row(keys, r, n, 0, n, cap, hist, part, state, HIST_COPIES)
    n_greater = uint32(cap) - krem
    for i in range(tid, n, nt):
        key = keys[i]
        if key != 0:
            if emit_all or key > kth:
                p = cuda.atomic.add(state, ST_N_GREATER, uint32(1))
                out_key[r, b, p] = key
                out_slot[r, b, p] = slot_at(offs, first_slot, i)
            elif key == kth:
                p = cuda.atomic.add(state, ST_N_EQUAL, uint32(1))
                if p < krem:
                    out_key[r, b, n_greater + p] = key
                    out_slot[r, b, n_greater + p] = slot_at(offs, first_slot, i)
    count = cap
    if emit_all:
        count = int32(state[ST_TOTAL])
    for j in range(count + tid, cap, nt):
        out_key[r, b, j] = uint32(0)
        out_slot[r, b, j] = -1


@cuda.jit(device=True, inline=True)
def slot_dense(offs, first_slot, i):
    """Keys held by block offset: entry i is slot first_slot + i (`offs` unused)."""
    return first_slot + i


@cuda.jit(device=True, inline=True)
def slot_listed(offs, first_slot, i):
    """Keys held as a list: entry i is slot first_slot + offs[i]."""
    return first_slot + offs[i]


def _emit(name: str, slot, select):
    return cuda.jit(device=True)(specialize(_block_topk_emit_template, name, slot_at=slot, select_row=select))


# the one block top-K, in the two forms the scoring kernels hold their keys in: by block offset
# (`block_topk_emit`, every kernel but the wide walk) and as a list of (key, offset) pairs; the list's
# also with the radix select counting a warp's equal digits at once (the lab's scoring v13)
_emit_dense = _emit("block_topk_emit_dense", slot_dense, radix_select_row)
block_topk_emit_list = _emit("block_topk_emit_list", slot_listed, radix_select_row)
block_topk_emit_list_warp = _emit("block_topk_emit_list_warp", slot_listed, radix_select_row_warp)


@cuda.jit(device=True)
def radix_select_row_kept(keys, r, width, lo, hi, k, hist, part, state, copies):
    """`radix_select_row` over a list whose keys at or above the running floor a tile counted into
    `state[ST_KEPT]` (reset here): when at most k were kept every nonzero key is wanted (emit_all,
    `state[ST_TOTAL]` = the count) and no round runs."""
    kept = state[ST_KEPT]
    cuda.syncthreads()  # every thread has read the count before thread 0 resets it
    if kept > uint32(k):
        if cuda.threadIdx.x == 0:
            state[ST_KEPT] = 0
        return radix_select_row(keys, r, width, lo, hi, k, hist, part, state, copies)
    if cuda.threadIdx.x == 0:
        state[ST_KEPT] = 0
        state[ST_TOTAL] = kept
        state[ST_EMIT_ALL] = 1
        state[ST_N_GREATER] = 0
        state[ST_N_EQUAL] = 0
    cuda.syncthreads()
    return uint32(0), uint32(0), True


_emit_list_kept = _emit("block_topk_emit_list_kept", slot_listed, radix_select_row_kept)


@cuda.jit(device=True)
def block_topk_emit_list_floor(keys, offs, n, cap, hist, part, state, out_key, out_slot, r, b, first_slot, floor, whole):
    """`block_topk_emit_list` for a list whose keys below request r's running floor (`floor[r]`, device
    memory shared by the kernel's blocks) were listed as 0, `state[ST_KEPT]` counting the others. When
    at most `cap` were kept every one goes out with no select (`radix_select_row_kept`: the same set
    the select would keep). Otherwise the select keeps `cap`, and when `cap` is the whole k the caller
    wants (`whole`) the floor is raised to the key of the `cap`-th (the select's prefix after its last
    round): the answer then holds k keys at or above it, so a key below it can never be in the answer
    and a later block may leave it out. The floor only rises."""
    _emit_list_kept(keys, offs, n, cap, hist, part, state, out_key, out_slot, r, b, first_slot)
    if whole and cuda.threadIdx.x == 0 and state[ST_EMIT_ALL] == 0:
        cuda.atomic.max(floor, r, state[ST_PREFIX])


@cuda.jit(device=True)
def block_topk_emit(keys, n, cap, hist, part, state, out_key, out_slot, r, b, first_slot):
    """Keep the `cap` largest nonzero keys of shared `keys[:n]` (slot = first_slot + index) in
    out_key[r, b, :cap] / out_slot[r, b, :cap]; pad with key 0 when fewer are nonzero."""
    _emit_dense(keys, keys, n, cap, hist, part, state, out_key, out_slot, r, b, first_slot)


__all__ = ["HIST_BINS", "HIST_COPIES", "ST_KEPT", "STATE_WORDS", "block_topk_emit", "block_topk_emit_list",
           "block_topk_emit_list_floor", "block_topk_emit_list_warp"]
