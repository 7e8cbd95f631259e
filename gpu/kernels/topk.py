"""Final top-K on the GPU from the per-block candidates of the fused scoring kernel (DESIGN section 4:
score descending, ties by ad id ascending; K up to MAX_K = 4096).

The product runs `SHIPPED`:
    v2 segments            when there are more than SEGMENT_LEN candidates per request, a first
                           kernel (`segment_topk_v2`, grid (segments, R)) keeps the top K of every
                           segment of SEGMENT_LEN candidates, in parallel over the whole GPU;
                           `final_topk_v1` then runs on segments x K candidates: one thread block per
                           request finds the K-th largest key, the keys above it and up to P - (number
                           above) keys equal to it go to a scratch of P = next power of two >= 2K
                           entries; a bitonic sort of the scratch by (key descending, ad id ascending),
                           in shared memory when P <= SHARED_SORT (K <= 512; each of its log2(P) *
                           (log2(P) + 1) / 2 stages a barrier, not a round trip through L2), in global
                           memory otherwise, then the first K rows are written. Exact unless more than
                           P - (number above) candidates share the K-th key exactly (then an arbitrary
                           subset of those equal scores is kept).
Both kernels select with the block-wide radix select of `gpu.kernels.radix`, the one the scoring
kernels' block top-K runs. v1 (`final_topk_v1` alone: one block reads every candidate of its
request, milliseconds at millions of candidates) is in the kernel lab, `gpu/lab/topk.py`; both
versions are `TopkPlan`s, which differ only in whether the segment stage runs.

Kernel `final_topk_v1` arguments:
    cand_key    uint32[R, NB, CA]  per-block candidate keys (gpu.kernels.score), 0 = none
    cand_slot   int32[R, NB, CA]
    cap         int32              valid entries per block (<= CA)
    slot_ad_id  int64[S]           ad id of every slot
    k           int32
    sk, ss, sid uint32 / int32 / int64 [R, P] scratch
    out_id      int64[R, >= k]     ad ids in rank order
    out_score   float32[R, >= k]
    out_count   int32[R]           rows written per request (min(k, candidates))
Launch: grid (R,), block (FINAL_THREADS,) (fewer under the simulator).

`topk_host` is the same rule in numpy for the CPU path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from andromeda_nb.templates import specialize
from andromeda_nb.versions import Version, pick, version_table

from .. import runtime
from ..graphs import Launch, run_plan
from . import _bits
from .radix import (HIST_BINS, ST_N_EQUAL, ST_N_GREATER, ST_TOTAL, STATE_WORDS, radix_select_blocks,
                    radix_select_blocks_warp)

cuda = runtime.cuda()
from numba import int32, int64, uint32  # noqa: E402

FINAL_THREADS = 1024
SIM_THREADS = 32
SEGMENT_LEN = 16384  # candidates per first-stage block (v2)
SHARED_SORT = 1024  # scratch entries sorted in shared memory (12 KB; K <= 512); larger ones in global memory


def scratch_size(k: int) -> int:
    p = 64
    while p < 2 * k:
        p *= 2
    return p


@cuda.jit(device=True, inline=True)
def _before(ka, ia, kb, ib):
    """Rank order: a comes before b (key descending, ad id ascending)."""
    return ka > kb or (ka == kb and ia < ib)


@cuda.jit(device=True, cache=True)
def _bitonic(keys, ids, P, tid, nt):
    """Sort keys[:P], ids[:P] (P a power of two, in shared memory) into rank order (key descending,
    ad id ascending) by a bitonic network, every thread of the block taking pairs of each stage."""
    size = 2
    while size <= P:
        stride = size // 2
        while stride > 0:
            for i in range(tid, P // 2, nt):
                lo = 2 * stride * (i // stride) + (i % stride)
                hi = lo + stride
                first = (lo & size) == 0
                ka, ia, kb, ib = keys[lo], ids[lo], keys[hi], ids[hi]
                if _before(kb, ib, ka, ia) == first:
                    keys[lo], keys[hi] = kb, ka
                    ids[lo], ids[hi] = ib, ia
            cuda.syncthreads()
            stride //= 2
        size *= 2


select_blocks = None  # bound per form below: the radix select over per-block candidates


def _segment_template(cand_key, cand_slot, cap, seg_len, k, out_key, out_slot):
    """First stage of v2: block (seg, r) keeps the top k of flat candidates [seg * seg_len, ...) in
    out_key[r, seg, :k] / out_slot[r, seg, :k] (padding key 0)."""
    hist = cuda.shared.array(HIST_BINS, uint32)
    part = cuda.shared.array(16, uint32)
    state = cuda.shared.array(STATE_WORDS, uint32)
    seg = cuda.blockIdx.x
    r = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    m = cand_key.shape[1] * cap
    lo = seg * seg_len
    hi = lo + seg_len
    if hi > m:
        hi = m
    kth, krem, emit_all = select_blocks(cand_key, r, cap, lo, hi, k, hist, part, state, 1)
    n_greater = uint32(k) - krem
    for i in range(lo + tid, hi, nt):
        b = i // cap
        j = i - b * cap
        key = cand_key[r, b, j]
        if key != 0:
            if emit_all or key > kth:
                p = cuda.atomic.add(state, ST_N_GREATER, uint32(1))
                out_key[r, seg, p] = key
                out_slot[r, seg, p] = cand_slot[r, b, j]
            elif key == kth:
                p = cuda.atomic.add(state, ST_N_EQUAL, uint32(1))
                if p < krem:
                    out_key[r, seg, n_greater + p] = key
                    out_slot[r, seg, n_greater + p] = cand_slot[r, b, j]
    cuda.syncthreads()
    count = k
    if emit_all:
        count = int32(state[ST_TOTAL])
    for j in range(count + tid, k, nt):
        out_key[r, seg, j] = uint32(0)
        out_slot[r, seg, j] = -1


def _final_template(cand_key, cand_slot, cap, slot_ad_id, k, sk, ss, sid, out_id, out_score, out_count):
    hist = cuda.shared.array(HIST_BINS, uint32)
    part = cuda.shared.array(16, uint32)
    state = cuda.shared.array(STATE_WORDS, uint32)
    r = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    nb = cand_key.shape[1]
    m = nb * cap
    P = sk.shape[1]
    kth, krem, emit_all = select_blocks(cand_key, r, cap, 0, m, k, hist, part, state, 1)
    n_greater = uint32(k) - krem
    room = uint32(P) - n_greater
    for i in range(tid, m, nt):
        b = i // cap
        j = i - b * cap
        key = cand_key[r, b, j]
        if key != 0:
            pos = int64(-1)
            if emit_all or key > kth:
                pos = int64(cuda.atomic.add(state, ST_N_GREATER, uint32(1)))
            elif key == kth:
                p = cuda.atomic.add(state, ST_N_EQUAL, uint32(1))
                if p < room:
                    pos = int64(n_greater + p)
            if pos >= 0:
                slot = cand_slot[r, b, j]
                sk[r, pos] = key
                ss[r, pos] = slot
                sid[r, pos] = slot_ad_id[slot]
    cuda.syncthreads()
    if emit_all:
        total = int64(state[ST_TOTAL])
    else:
        eq = state[ST_N_EQUAL]
        if eq > room:
            eq = room
        total = int64(n_greater + eq)
    for j in range(total + tid, P, nt):
        sk[r, j] = uint32(0)
        ss[r, j] = -1
        sid[r, j] = 0x7FFFFFFFFFFFFFFF
    cuda.syncthreads()
    keys, ids = sk[r], sid[r]  # the scratch's rows of this request, sorted where they are
    if P <= SHARED_SORT:  # or in shared memory: a barrier a stage, not a round trip through L2
        keys = cuda.shared.array(SHARED_SORT, uint32)
        ids = cuda.shared.array(SHARED_SORT, int64)
        for j in range(tid, P, nt):
            keys[j] = sk[r, j]
            ids[j] = sid[r, j]
        cuda.syncthreads()
    _bitonic(keys, ids, P, tid, nt)
    n_out = total
    if n_out > k:
        n_out = k
    for j in range(tid, n_out, nt):
        out_id[r, j] = ids[j]
        out_score[r, j] = _bits.key_to_f32(keys[j])
    if tid == 0:
        out_count[r] = n_out


def _kernel(template, name: str, select):
    return cuda.jit(cache=True)(specialize(template, name, select_blocks=select))


# the two stages counting a key at a time (v2) and a warp's equal digits at once (the lab's v3)
segment_topk_v2 = _kernel(_segment_template, "segment_topk_v2", radix_select_blocks)
final_topk_v1 = _kernel(_final_template, "final_topk_v1", radix_select_blocks)
segment_topk_v3 = _kernel(_segment_template, "segment_topk_v3", radix_select_blocks_warp)
final_topk_v3 = _kernel(_final_template, "final_topk_v3", radix_select_blocks_warp)


def n_segments(n_candidates: int, segment_len: int | None = None) -> int:
    """First-stage blocks of a request's `n_candidates` at `segment_len` (None: SEGMENT_LEN)."""
    return -(-n_candidates // (segment_len or SEGMENT_LEN))


def threads() -> int:
    return SIM_THREADS if runtime.simulator_enabled() else FINAL_THREADS


@dataclass(frozen=True)
class TopkPlan:
    """How a version selects: with `segmented`, the segment stage first when the candidates of a
    request fill more than one segment; then the final kernel."""

    segmented: bool
    segment_len: int | None = None  # candidates per first-stage block (None: SEGMENT_LEN)
    warp_counts: bool = False  # the radix select counts a warp's equal digits with one atomic (v3)

    def launch(self, keys, slots, width: int, slot_ad_id, k: int, bufs: dict, R: int, stream=0) -> None:
        """Top-k of candidates `keys`/`slots` (R, blocks, >= width) into bufs["out_id"], ["out_score"],
        ["out_count"], with the scratch bufs["sk"], ["ss"], ["sid"] and, when segmented,
        bufs["seg_key"], ["seg_slot"] (R, n_segments, k) (`gpu.fused.FusedScorer` allocates them)."""
        run_plan(self.plan(keys, slots, width, slot_ad_id, k, bufs, R), stream)

    def plan(self, keys, slots, width: int, slot_ad_id, k: int, bufs: dict, R: int) -> list:
        """The launches of `launch` as a `gpu.graphs` plan."""
        steps = []
        n_seg = bufs["seg_key"].shape[1]
        segment, final = (segment_topk_v3, final_topk_v3) if self.warp_counts else (segment_topk_v2, final_topk_v1)
        if self.segmented and n_seg > 1:
            steps.append(Launch(segment, (n_seg, R), threads(),
                                (keys, slots, np.int32(width), np.int32(self.segment_len or SEGMENT_LEN), np.int32(k), bufs["seg_key"],
                                 bufs["seg_slot"])))
            keys, slots, width = bufs["seg_key"], bufs["seg_slot"], k
        steps.append(Launch(final, (R,), threads(),
                            (keys, slots, np.int32(width), slot_ad_id, np.int32(k), bufs["sk"], bufs["ss"], bufs["sid"],
                             bufs["out_id"], bufs["out_score"], bufs["out_count"])))
        return steps


VERSIONS = version_table(
    Version(2, "v2 segments", "segments, then block per request", TopkPlan(segmented=True)),
)
SHIPPED = 2


def version(v=None) -> Version:
    """The Version `v` names (a number of `VERSIONS`, a Version from the lab, None: SHIPPED)."""
    return pick(VERSIONS, v, SHIPPED, "top-K")


def topk_host(ids: np.ndarray, scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top k of (ids, scores as float32) by score descending, ties by id ascending: the rule of
    `andromeda_nb.reference.reference_topk`, which it runs."""
    from andromeda_nb.reference import reference_topk

    return reference_topk(ids, np.asarray(scores, np.float32), k)


__all__ = ["FINAL_THREADS", "SEGMENT_LEN", "SHIPPED", "TopkPlan", "VERSIONS", "final_topk_v1", "final_topk_v3",
           "n_segments", "segment_topk_v2", "segment_topk_v3", "scratch_size", "threads", "topk_host", "version"]
