"""The fused gated-MoE scorer on tensor cores: eligibility, gather, the 2E per-ad dot products as
`mma.sync` tiles, routing, softmax, score and per-block top-K, in one pass over the stored embeddings.

Why: the per-ad work of the gated MoE is 2E dot products of length D (E gate logits, E expert
scores), 768 multiply-adds per ad at E = 6, D = 64. On the CUDA cores that is instruction-bound
(`score.py` v4 reaches about 40% of copy bandwidth). Seen as matrices it is one product per format
chunk, [ads x D] by [D x 2E]: tensor-core work, which leaves the kernel bound by the bytes it must
read, as the dot-product kernel is.

A block covers ADS_PER_BLOCK = 4096 slots (16 format-uniform chunks of 256) with 8 warps; in each
chunk a warp owns one 32-slot tile, two m16 tiles of 16 ads. Per m16 tile and k-step of 16
dimensions it issues one m16n8k16 product per n-tile: NG = ceil(E / 8) tiles of gate columns and NG
of expert columns (column n of tile i is expert 8 (i mod NG) + n; columns past E are zero).

Operands:
* A, the ads: the stored values in the 'tiles' layout of `score.py` (16-byte quads of 32 slots),
  each lane loading whole quads of its two rows with 16-byte loads. Which quad word feeds which
  k index is a fixed permutation of the D dimensions (`dim_map`): the dot product does not care
  about the order as long as B uses the same one. fp16 words are fragments as they are; int8 words
  become fp16 pairs exactly (`mma.i8x2_to_f16x2`); float32 values are split into fp16 hi + lo
  (`mma.split_f16x2`) with a third product for lo x B.
* B, the request's folded table of one format (`andromeda_nb.scoring.fold_tables`, float32), scaled
  by a power of two so that its largest value lies in [1, 2), split into fp16 hi + lo, and laid out
  in fragment order by `prep_tables` (one small launch per batch): each lane loads its B registers
  with 16-byte loads when the chunk's format changes, and keeps them.
* C accumulates in float32. Default mode 'exact': A hi x B hi + A hi x B lo (+ A lo x B hi for
  float32 storage), within 1e-4 of the float64 reference like the CUDA-core kernels. Mode 'fast'
  (opt-in, DESIGN section 4's reduced-precision rule): A hi x B hi only.

Epilogue per ad, on the four lanes of a group that hold its row (each holds 2 gate and 2 expert
columns per n-tile pair): unscale, add the biases; the E gate logits are gathered to the four lanes
by index shuffles, every lane routes (top-k, ties to the lower expert, as `scoring.moe_score`), the
routed expert values come by shuffles from their owners, then the softmax-weighted score. The
group's first lane writes the orderable key to shared memory; `block_topk.block_topk_emit` keeps the
block's best `cap`. Nothing per ad reaches device memory.

Kernel arguments (the CUDA-core kernels' plus the prepared table):

    emb          uint32[S * D * bytes / 4]   stored embeddings, 'tiles' layout
    scale        float32[S]                  int8 scale per slot (read only for int8)
    chunk_format int32[S / 256]              format of every chunk
    elig         uint32[R, S / 32]           eligibility bits (slot s: bit s % 32 of word s // 32)
    tabs         float32[R, F, TW]           folded tables (biases are read from here)
    frag         uint32[R * F * G * 128]     B fragments: [r, f, group j, lane, 4 words], G = T * 2NG
                                             groups (k-step t, n-tile n: j = t * 2NG + n), the 4 words
                                             hi b0, hi b1, lo b0, lo b1
    fscale       float32[R, F]               the inverse of each table's power-of-two scale
    cap, out_key, out_slot                   as `score.py`: the block's top `cap` keys and slots

The simulator has no tensor cores or warp barrier: `gpu.kernels.mma` and `gpu.kernels.warp` emulate them
there with shared memory and block barriers, so the same generated kernel (with its tile skip made block-uniform) runs
under the simulator in the tests, on tiny pools.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from andromeda_nb.jitcache import generated_function
from andromeda_nb.scoring import table_width
from andromeda_nb.slots import CHUNK_SLOTS

from .. import runtime
from ..graphs import Launch, run_plan
from . import _bits, mma, warp
from andromeda_nb.constants import PRECISION_BYTES as BYTES

from .block_topk import (HIST_BINS, HIST_COPIES, ST_KEPT, STATE_WORDS, block_topk_emit, block_topk_emit_list,
                         block_topk_emit_list_floor, block_topk_emit_list_warp)
from .tiles import QUAD_WORDS, words_per_ad

cuda = runtime.cuda()
from numba import float32, int32, uint32  # noqa: E402  (after the device choice)

THREADS = 256  # 8 warps: one 32-slot tile of a chunk each
WARPS = THREADS // 32
CHUNKS_PER_BLOCK = 16  # 4096 ads per block top-K: twice the CUDA-core kernels' (the selection's barriers
ADS_PER_BLOCK = CHUNKS_PER_BLOCK * CHUNK_SLOTS  # and serial steps cost as much as scoring 2048 ads)
WIDE_CHUNKS = 64  # chunks per block of the wide walk (16,384 slots): one block top-K for most of them
LIST_CAP = 4096  # (key, offset) entries a wide block holds before it must select
ROUND_SLOTS = WARPS * CHUNK_SLOTS  # slots a round of the wide walk covers (one chunk per warp)
ST_LIST = STATE_WORDS - 2  # shared state word (past the radix select's own) counting a wide block's list
ST_COUNT = STATE_WORDS - 1  # the free walk's: the block's eligible ads
K_STEP = 16  # dimensions per m16n8k16 product
N_TILE = 8  # columns per n-tile
MODES = ("exact", "fast")
PREP_THREADS = 128
TILE_WORDS = 128  # words per quad row of a 32-slot tile (32 slots x 4 words)


# --- the k permutation: which stored dimension feeds which k index ------------------------------------


def dim_map(precision: str, dim: int) -> np.ndarray:
    """int32[T, 16] (T = D / 16 k-steps): the stored dimension that lane (g, q) feeds to k index
    `k` of k-step t, for the A registers the kernel builds from its quads (lane q of a group loads
    quads q, q + 4, q + 8, ... of its rows). k = 2q + h (low register) or 8 + 2q + h (high)."""
    if not supports("moe", precision, dim, 1):
        raise ValueError(f"the tensor-core scorer does not serve {precision} at D = {dim}")
    steps = dim // K_STEP
    out = np.empty((steps, K_STEP), np.int32)
    for t in range(steps):
        for k in range(K_STEP):
            upper, q, h = k // 8, (k % 8) // 2, k % 2
            if precision == "fp16":  # a word is two dims; k-step t uses list words 2t (low), 2t + 1 (high)
                L = 2 * t + upper
                word = QUAD_WORDS * (q + 4 * (L // QUAD_WORDS)) + L % QUAD_WORDS
                out[t, k] = 2 * word + h
            elif precision == "int8":  # a word is four dims: bytes 0, 1 low, bytes 2, 3 high
                word = QUAD_WORDS * (q + 4 * (t // QUAD_WORDS)) + t % QUAD_WORDS
                out[t, k] = 4 * word + 2 * upper + h
            else:  # fp32: k-step t reads quad q + 4t whole: words 0, 1 low, 2, 3 high
                out[t, k] = QUAD_WORDS * (q + 4 * t) + 2 * upper + h
    return out


def n_gate_tiles(experts: int) -> int:
    return -(-experts // N_TILE)


def groups(dim: int, experts: int) -> int:
    """B fragment groups per (request, format): k-steps x n-tiles."""
    return (dim // K_STEP) * 2 * n_gate_tiles(experts)


# --- B fragments: the host reference and the device preparation ---------------------------------------


def table_scale(tab_row: np.ndarray) -> tuple[float, float]:
    """(scale, inverse): the power of two that brings the largest |value| into [1, 2) (1 for zeros)."""
    mx = float(np.max(np.abs(tab_row))) if len(tab_row) else 0.0
    if mx == 0.0 or not math.isfinite(mx):
        return 1.0, 1.0
    e = min(253, max(1, (int(np.float32(mx).view(np.uint32)) >> 23) & 0xFF))
    return float(2.0 ** (127 - e)), float(2.0 ** (e - 127))


def fragment_tables_host(tabs: np.ndarray, precision: str, dim: int, experts: int):
    """numpy form of `prep_tables`: (frag uint32[R * F * G * 128], fscale float32[R, F])."""
    tabs = np.asarray(tabs, np.float32)
    R, F, _ = tabs.shape
    E, D = experts, dim
    dims = dim_map(precision, dim)
    NG = n_gate_tiles(E)
    NT = 2 * NG
    T = D // K_STEP
    frag = np.zeros((R, F, T * NT, 32, 4), np.uint32)
    fscale = np.ones((R, F), np.float32)
    lanes = np.arange(32)
    g, q = lanes >> 2, lanes & 3
    for r in range(R):
        for f in range(F):
            row = tabs[r, f]
            s, inv = table_scale(row[: 2 * E * D])
            fscale[r, f] = inv
            for t in range(T):
                for nt in range(NT):
                    e = N_TILE * (nt % NG) + g
                    off = (E * D if nt >= NG else 0) + e * D
                    for upper in (0, 1):
                        k0 = 8 * upper + 2 * q
                        v0 = np.where(e < E, row[np.minimum(off + dims[t, k0], len(row) - 1)], 0) * np.float32(s)
                        v1 = np.where(e < E, row[np.minimum(off + dims[t, k0 + 1], len(row) - 1)], 0) * np.float32(s)
                        hi0, lo0 = mma.split_host(v0.astype(np.float32))
                        hi1, lo1 = mma.split_host(v1.astype(np.float32))
                        j = t * NT + nt
                        frag[r, f, j, :, upper] = mma.f16_words(hi0, hi1)
                        frag[r, f, j, :, 2 + upper] = mma.f16_words(lo0, lo1)
    return frag.reshape(-1), fscale


@cuda.jit(cache=True)
def prep_tables(tabs, dims, experts, ng, frag, fscale):
    """B fragments of every (format, request) table: grid (F, R), PREP_THREADS threads. tabs
    float32[R, F, TW]; dims int32[T, 16] (`dim_map`); frag uint32[R * F * G * 128]; fscale float32[R, F]."""
    f = cuda.blockIdx.x
    r = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    nt_ = cuda.blockDim.x
    n_f = tabs.shape[1]
    D = dims.shape[0] * 16
    red = cuda.shared.array(PREP_THREADS, float32)
    m = float32(0.0)
    for i in range(tid, 2 * experts * D, nt_):
        m = max(m, abs(tabs[r, f, i]))
    red[tid] = m
    cuda.syncthreads()
    step = PREP_THREADS // 2
    while step > 0:
        if tid < step:
            red[tid] = max(red[tid], red[tid + step])
        cuda.syncthreads()
        step //= 2
    mx = red[0]
    s = float32(1.0)
    inv = float32(1.0)
    if mx > float32(0.0):
        e = int32((_bits.f32_to_key(mx) & uint32(0x7FFFFFFF)) >> uint32(23))
        e = min(253, max(1, e))
        s = _bits.u32_as_f32(uint32(254 - e) << uint32(23))
        inv = _bits.u32_as_f32(uint32(e) << uint32(23))
    if tid == 0:
        fscale[r, f] = inv
    NT = 2 * ng
    n_words = dims.shape[0] * NT * 128
    base = (r * n_f + f) * n_words
    for w in range(tid, n_words, nt_):
        j = w >> 7
        lane = (w >> 2) & 31
        i = w & 3
        t = j // NT
        n = j - t * NT
        k0 = 8 * (i & 1) + 2 * (lane & 3)
        e = 8 * (n % ng) + (lane >> 2)
        v0 = float32(0.0)
        v1 = float32(0.0)
        if e < experts:
            off = e * D
            if n >= ng:
                off += experts * D
            v0 = tabs[r, f, off + dims[t, k0]] * s
            v1 = tabs[r, f, off + dims[t, k0 + 1]] * s
        hi, lo = mma.split_f16x2(v0, v1)
        if i < 2:
            frag[base + w] = hi
        else:
            frag[base + w] = lo


# --- the fused kernel: generated per (precision, D, E, top-k, mode) ----------------------------------------


@dataclass(frozen=True)
class MmaSpec:
    precision: str
    dim: int
    experts: int
    top_e: int
    mode: str = "exact"
    kind: str = "moe"
    max_registers: int | None = None
    compact: bool = False  # walk only the eligible slots of each chunk (see _COMPACT_SKELETON)
    wide: bool = False  # compacted walk over WIDE_CHUNKS chunks a block, keys as a list (_WIDE_SKELETON)
    emit_at: int = LIST_CAP - ROUND_SLOTS  # wide: a list longer than this after a round is selected
    out_slots: int = ADS_PER_BLOCK  # wide: slots per output block (the block top-K's granularity)
    chunks: int = WIDE_CHUNKS  # wide: chunks a block walks (fewer: more, shorter blocks for a lone request)
    request_major: bool = False  # grid (R, NB): the requests of a batch walk the same chunks at once (L2 reuse)
    warp_counts: bool = False  # wide: the list's radix select counts a warp's equal digits at once
    pooled: bool = False  # wide: a round whose listed chunks share a format runs one list over them (_POOLED_ROUND)
    free_at: int = 0  # wide: a block with at most this many eligible ads walks without the rounds' barriers (_FREE_TAIL)
    floor: bool = False  # wide: a running floor per request; an ad scored below it is not kept (block_topk_emit_list_floor)

    @property
    def table_width(self) -> int:
        return table_width(self.experts, self.dim)


# the opening both walks share: the block's shared arrays, who this thread is, which chunks it covers
_PROLOGUE = """
def {name}(emb, scale, chunk_format, elig, tabs, frag, fscale, cap, out_key, out_slot{floor_arg}):
    keys = cuda.shared.array({keys_n}, uint32)
    hist = cuda.shared.array({hist_n}, uint32)
    part = cuda.shared.array(16, uint32)
    state = cuda.shared.array({state_n}, uint32)
    acc = cuda.shared.array(({warps}, 32, {acc_stride}), float32)
    tid = cuda.threadIdx.x
    warp = tid >> 5
    lane = tid & 31
    g = lane >> 2
    q = lane & 3
    b = cuda.blockIdx.{b_axis}
    r = cuda.blockIdx.{r_axis}
    n_chunks = chunk_format.shape[0]
    n_f = tabs.shape[1]
    c0 = b * {cpb}
    cur_f = -1"""

_SKELETON = _PROLOGUE + """
    f_next = 0
    ew_next = uint32(0)
    if c0 < n_chunks:
        f_next = chunk_format[c0]
        ew_next = elig[r, c0 * {warps} + warp]
{init}
    for cl in range({cpb}):
        c = c0 + cl
        f = f_next
        ew = ew_next
        if cl + 1 < {cpb} and c + 1 < n_chunks:  # the next chunk's format and eligibility, early
            f_next = chunk_format[c + 1]
            ew_next = elig[r, (c + 1) * {warps} + warp]
        key = uint32(0)
        if c < n_chunks:
            if f != cur_f:
{load_b}
                cur_f = f
            if {skip}:
                tbase = (c * {warps} + warp) * {tile_words}
{body}
        keys[cl * {chunk} + warp * 32 + lane] = key
    cuda.syncthreads()
    block_topk_emit(keys, {keys_n}, cap, hist, part, state, out_key, out_slot, r, b, c0 * {chunk})
"""


# Both compacted walks open a chunk the same way: warp `warp` takes chunk cl = cw * WARPS + warp of
# the block, counts its eligible slots (n) and lists them in lst[warp] (block offsets), and loads the
# B fragments of the chunk's format when it has listed slots and the format changed.
_LIST_CHUNK = """    for cw in range({cpw}):
        cl = cw * {warps} + warp
        c = c0 + cl
        n = 0
        if c < n_chunks:
            off = 0
            for j in range({wpc}):
                pc = int32(cuda.popc(elig[r, c * {wpc} + j]))
                if j < lane:
                    off += pc
                n += pc
            if lane < {wpc}:
                w = elig[r, c * {wpc} + lane]
                while w != uint32(0):
                    lst[warp, off] = cl * {chunk} + lane * 32 + int32(cuda.popc((w ^ (w - uint32(1))) >> uint32(1)))
                    off += 1
                    w &= w - uint32(1)
            f = chunk_format[c]
            if n > 0 and f != cur_f:
{load_b}
                cur_f = f
"""

# The compacted walk: a warp takes whole chunks (chunk cl = cw * WARPS + warp of the block), lists the
# eligible slots of its chunk in shared memory (popcounts of the chunk's eligibility words, each of its
# first lanes writing the slots of one word), and runs the m16 tiles over that list, 32 listed slots at a
# time: the rows are gathered by slot, so the bytes read follow the eligible ads, not the pool. Keys
# start at 0 (never kept) and each listed ad writes its own; the block top-K is the same.
_COMPACT_SKELETON = _PROLOGUE + """
    lst = cuda.shared.array(({warps}, {chunk}), int32)
    slot0 = c0 * {chunk}
    for i in range(tid, {keys_n}, {threads}):
        keys[i] = uint32(0)
{init}
    cuda.syncthreads()
""" + _LIST_CHUNK + """        sync_warp()
{tile_count}
        for t in range(n_tiles):
{body}
        sync_warp()
    cuda.syncthreads()
    block_topk_emit(keys, {keys_n}, cap, hist, part, state, out_key, out_slot, r, b, slot0)
"""

# The wide walk: the compacted walk over WIDE_CHUNKS chunks a block (ROUND_SLOTS of them a round, one
# chunk per warp), its keys kept as a list. Each warp reserves room for its chunk's eligible ads in the
# block's list (one shared atomic) and writes (key, block offset) pairs there, so the block top-K
# selects among the eligible ads only, once per block rather than once per 4096 slots. After a round,
# a list longer than `emit_at` (and the last round's list) is selected into the block's next output
# block of `out_slots` slots' worth (the final top-K reads those as it reads every kernel's), and the
# list starts again: with emit_at = LIST_CAP - ROUND_SLOTS the list never overflows and a list is
# selected at most once per two rounds, so out_slots = 2 * ROUND_SLOTS suffices; the output blocks a
# block does not fill are padded with key 0. The block top-K keeps the best `cap` = min(k, out_slots)
# of at most LIST_CAP entries: exact while the list fits the output block (emit_at + ROUND_SLOTS <=
# out_slots, as shipped) or k <= out_slots.
_WIDE_HEAD = _PROLOGUE + """
    lst = cuda.shared.array(({warps}, {chunk}), int32)
    offs = cuda.shared.array({list_cap}, int32)
    wbase = cuda.shared.array({wbase_n}, uint32)
{pool_shared}
    slot0 = c0 * {chunk}
    sub0 = b * {subs}
    n_sub = min({subs}, out_key.shape[1] - sub0)
    emitted = 0
    if tid == 0:
        state[{st_list}] = uint32(0)
{count_init}{init}
    cuda.syncthreads()
{count_walk}""" + _LIST_CHUNK

_WIDE_ROUND = """        if lane == 0:
            wbase[warp] = cuda.atomic.add(state, {st_list}, uint32(n))
        sync_warp()
        base = int32(wbase[warp])
{tile_count}
        for t in range(n_tiles):
{body}
        sync_warp()
"""

_WIDE_TAIL = """        cuda.syncthreads()
        listed = int32(state[{st_list}])
        cuda.syncthreads()
        if listed > {emit_at} or (cw == {cpw} - 1 and listed > 0):
            {emit_list}(keys, offs, listed, cap, hist, part, state, out_key, out_slot, r, sub0 + emitted, slot0{floor_pass})
            emitted += 1
            cuda.syncthreads()
            if tid == 0:
                state[{st_list}] = uint32(0)
            cuda.syncthreads()
    for e in range(emitted, n_sub):
        for j in range(tid, cap, {threads}):
            out_key[r, sub0 + e, j] = uint32(0)
            out_slot[r, sub0 + e, j] = -1
"""

_WIDE_SKELETON = _WIDE_HEAD + _WIDE_ROUND + _WIDE_TAIL

# The free walk (v17; the shipped v19 is it with the running floor): the wide walk's block first counts its eligible ads (the popcounts of its
# chunks' eligibility words). When they fit its list at once (at most `free_at`, LIST_CAP, and the
# output block's slots where the caller wants that many), no list can need selecting mid-walk, so the
# warps walk their chunks without the two block barriers a round (a warp waits for no other; a block
# lasts as long as its busiest warp's whole walk, not the sum of every round's busiest) and the list
# is selected once, at the end. A block with more runs the wide walk's rounds as before. `free` is the
# same in every thread, so the barriers of either branch are reached by all of the block. The count
# fills the wide head's {count_walk} (its state word zeroed by {count_init}); both are empty elsewhere.
_FREE_COUNT = """    seen = 0
    for j in range(tid, {cpb} * {wpc}, {threads}):
        if c0 * {wpc} + j < n_chunks * {wpc}:
            seen += int32(cuda.popc(elig[r, c0 * {wpc} + j]))
    if seen > 0:
        cuda.atomic.add(state, {st_count}, uint32(seen))
    cuda.syncthreads()
    free = int32(state[{st_count}]) <= ({free_big} if cap < {out_slots} else {free_small})
"""

_PAD_OUTPUT = "    for e in range(emitted, n_sub):\n"
_ROUND_SELECT, _PAD_REST = _WIDE_TAIL.split(_PAD_OUTPUT)
_FREE_TAIL = ("        if not free:\n" + textwrap.indent(_ROUND_SELECT, "    ") + """    if free:
        cuda.syncthreads()
        listed = int32(state[{st_list}])
        if listed > 0:
            {emit_list}(keys, offs, listed, cap, hist, part, state, out_key, out_slot, r, sub0, slot0{floor_pass})
            emitted = 1
""" + _PAD_OUTPUT + _PAD_REST)

_FREE_SKELETON = _WIDE_HEAD + _WIDE_ROUND + _FREE_TAIL

# The pooled round (lab): the wide walk's warps list their chunks as before; when every chunk of the
# round that lists a slot has the same format (the common case: the layout keeps a format's chunks
# together), the round's lists are run as one list of `total` entries (pre[j]: where warp j's list
# starts in it), its 32-row tiles dealt to the warps in turn (tile t to warp t % WARPS), so the
# round's tiles are ceil(total / 32) instead of the sum over warps of ceil(n / 32): the walk's partial
# tiles (scripts/probe_batched_work.py counts 0.60x the tile products for lists over 4,096 slots on a
# generated corpus). A round of mixed formats runs the warps' own lists, as the wide walk does. The
# entries keep the list's order (warp j's entries at base + pre[j] + their place), so the selection
# and its ties are the wide walk's.
_POOLED_ROUND = """        if lane == 0:
            rcount[warp] = n
            rfmt[warp] = chunk_format[c] if n > 0 else -1
        cuda.syncthreads()
        rf = -1
        mixed = False
        total = 0
        for j in range({warps}):
            if tid == 0:
                pre[j] = total
            total += rcount[j]
            fj = rfmt[j]
            if fj >= 0:
                if rf < 0:
                    rf = fj
                elif fj != rf:
                    mixed = True
        if tid == 0 and not mixed:
            wbase[{warps}] = cuda.atomic.add(state, {st_list}, uint32(total))
        cuda.syncthreads()
        if mixed:
            src = warp
            if lane == 0:
                wbase[warp] = cuda.atomic.add(state, {st_list}, uint32(n))
            sync_warp()
            base = int32(wbase[warp])
{tile_count_mixed}
        else:
            src = -1
            if rf >= 0 and rf != cur_f:
                f = rf
{load_b_pooled}
                cur_f = f
            base = int32(wbase[{warps}])
            n = total
{tile_count_pooled}
        for tt in range(n_tiles):
            t = tt if src >= 0 else tt * {warps} + warp
{body}
        sync_warp()
"""

_POOLED_SKELETON = _WIDE_HEAD + _POOLED_ROUND + _WIDE_TAIL

# under the simulator a warp's barriers are the block's: every warp runs the block's largest tile count
_SIM_TILE_COUNT = [
    "most = cuda.shared.array(" + str(WARPS) + ", int32)",
    "most[warp] = (n + 31) >> 5",
    "cuda.syncthreads()",
    "n_tiles = 0",
    "for j in range(" + str(WARPS) + "):",
    "    n_tiles = max(n_tiles, most[j])",
    "cuda.syncthreads()",
]


def _indent(lines, n):
    pad = " " * n
    return "\n".join(pad + ln if ln else ln for ln in lines)


def _a_registers(spec: MmaSpec, t: int, h: int) -> tuple[list[str], list[str], list[str] | None]:
    """Lines building the A registers of k-step t for m-tile h: (lines, hi regs [a0..a3], lo regs)."""
    p = spec.precision
    A, B = f"ra{h}", f"rb{h}"  # loaded words of rows g and g + 8: {A}_{index}
    if p == "fp16":
        return [], [f"{A}_{2 * t}", f"{B}_{2 * t}", f"{A}_{2 * t + 1}", f"{B}_{2 * t + 1}"], None
    if p == "int8":
        lines = [f"xa = {A}_{t} ^ uint32({mma.I8_FLIP})", f"xb = {B}_{t} ^ uint32({mma.I8_FLIP})",
                 f"i0 = i8x2_to_f16x2(xa, uint32({mma.I8_LO}))", f"i1 = i8x2_to_f16x2(xb, uint32({mma.I8_LO}))",
                 f"i2 = i8x2_to_f16x2(xa, uint32({mma.I8_HI}))", f"i3 = i8x2_to_f16x2(xb, uint32({mma.I8_HI}))"]
        return lines, ["i0", "i1", "i2", "i3"], None
    w = [4 * t + i for i in range(4)]
    lines = [
        f"h0, l0 = split_f16x2(u32_as_f32({A}_{w[0]}), u32_as_f32({A}_{w[1]}))",
        f"h1, l1 = split_f16x2(u32_as_f32({B}_{w[0]}), u32_as_f32({B}_{w[1]}))",
        f"h2, l2 = split_f16x2(u32_as_f32({A}_{w[2]}), u32_as_f32({A}_{w[3]}))",
        f"h3, l3 = split_f16x2(u32_as_f32({B}_{w[2]}), u32_as_f32({B}_{w[3]}))",
    ]
    return lines, ["h0", "h1", "h2", "h3"], ["l0", "l1", "l2", "l3"]


def _listed(spec: MmaSpec, out: str) -> list[str]:
    """Lines setting `out` to the block offset of listed entry i (0 past the list's n entries): the
    warp's own list, or in a pooled round (src < 0) the entry of the round's list, found in the list
    of the last warp j whose list starts at or before i (pre[j] <= i)."""
    if not spec.pooled:
        return [f"{out} = lst[warp, i] if i < n else 0"]
    return [f"{out} = 0", "if i < n:", "    if src >= 0:", f"        {out} = lst[src, i]", "    else:",
            "        jl = 0", f"        for jj in range(1, {WARPS}):", "            if i >= pre[jj]:",
            "                jl = jj", f"        {out} = lst[jl, i - pre[jl]]"]


def _products(spec: MmaSpec) -> list[str]:
    """Both m16 tiles of the warp's 32-slot tile: every load first, then the products, the
    accumulators stored to the warp's rows of `acc` (row = slot in the tile, column = n-tile * 8 +
    column in it)."""
    D, E = spec.dim, spec.experts
    V = words_per_ad(spec.precision, D) // QUAD_WORDS
    T = D // K_STEP
    NT = 2 * n_gate_tiles(E)
    lines = []
    for h in range(2):
        for R, off in (("ra", 0), ("rb", 8)):
            if spec.compact:  # row 16h + off + g of the tile is listed slot t * 32 + that row (slot0 past the list)
                lines += [f"i = t * 32 + {16 * h + off} + g", *_listed(spec, "o"), "s = slot0 + o",
                          f"a{h}{R} = (s >> 5) * {V * TILE_WORDS} + (s & 31) * 4"]
            else:
                lines.append(f"a{h}{R} = tbase + ({16 * h + off} + g) * 4")
        for m in range(V // 4):  # lane q of a group loads quads q, q + 4, ... of rows g and g + 8
            for R in ("ra", "rb"):
                names = ", ".join(f"{R}{h}_{4 * m + i}" for i in range(4))
                lines.append(f"{names} = load_u32x4(emb, a{h}{R} + (q + {4 * m}) * {TILE_WORDS})")
    for h in range(2):
        for n in range(NT):
            lines += [f"c{n}_{i} = float32(0.0)" for i in range(4)]
        for t in range(T):
            a_lines, hi, lo = _a_registers(spec, t, h)
            lines += a_lines
            for n in range(NT):
                j = t * NT + n
                acc = ", ".join(f"c{n}_{i}" for i in range(4))
                lines.append(f"{acc} = mma_f16({', '.join(hi)}, bf{j}_0, bf{j}_1, {acc})")
                if spec.mode == "exact":
                    lines.append(f"{acc} = mma_f16({', '.join(hi)}, bf{j}_2, bf{j}_3, {acc})")
                    if lo is not None:
                        lines.append(f"{acc} = mma_f16({', '.join(lo)}, bf{j}_0, bf{j}_1, {acc})")
        for n in range(NT):
            for i in range(4):
                row = f"{16 * h + 8 * (i // 2)} + g"
                lines.append(f"acc[warp, {row}, {8 * n + i % 2} + 2 * q] = c{n}_{i}")
    return lines


def _epilogue(spec: MmaSpec) -> list[str]:
    """One ad per lane (slot = tile * 32 + lane): its gate logits and expert values from `acc`,
    routing (top-k, ties to the lower expert), softmax over the routed logits, the score, its key."""
    E, K = spec.experts, spec.top_e
    X0 = 8 * n_gate_tiles(E)  # first expert column
    if spec.compact:  # lane = listed slot t * 32 + lane (block offset o; slot0 past the list)
        lines = ["i = t * 32 + lane", *_listed(spec, "o"), "s = slot0 + o"]
    else:
        lines = ["s = c * 256 + warp * 32 + lane"]
    lines.append("sc = inv * scale[s]" if spec.precision == "int8" else "sc = inv")
    for e in range(E):
        lines.append(f"g{e} = acc[warp, lane, {e}] * sc + qb{e}")
        lines.append(f"x{e} = acc[warp, lane, {X0 + e}] * sc + ub{e}")
    lines.append("m = 0")
    for j in range(K):
        lines += [f"b{j} = -1", f"gv{j} = float32(0.0)", f"xv{j} = float32(0.0)"]
        for e in range(E):
            lines.append(f"if (m >> {e}) & 1 == 0 and (b{j} < 0 or g{e} > gv{j}):")
            lines += [f"    b{j} = {e}", f"    gv{j} = g{e}", f"    xv{j} = x{e}"]
        lines.append(f"m |= 1 << b{j}")
        lines.append(f"w{j} = " + ("float32(1.0)" if j == 0 else f"float32(math.exp(gv{j} - gv0))"))
    num = " + ".join(f"w{j} * xv{j}" for j in range(K))
    den = " + ".join(f"w{j}" for j in range(K))
    if spec.wide:
        key = f"f32_to_key(({num}) / ({den}))"
        if spec.floor:  # a key below the request's running floor is listed as 0 (never kept)
            lines += [f"kk = {key}", "keep = i < n and kk >= floor[r]"]
            key = "kk if keep else uint32(0)"
        lines.append("if i < n:")
        lines.append(f"    keys[base + i] = {key}")
        lines.append("    offs[base + i] = o")
        if spec.floor:  # the warp's kept keys, counted with one shared atomic
            lines += ["votes = ballot(keep)", "if lane == 0 and votes != uint32(0):",
                      f"    cuda.atomic.add(state, {ST_KEPT}, uint32(cuda.popc(votes)))"]
    elif spec.compact:
        lines.append("if i < n:")
        lines.append(f"    keys[o] = f32_to_key(({num}) / ({den}))")
    else:
        lines.append("if (ew >> uint32(lane)) & uint32(1):")
        lines.append(f"    key = f32_to_key(({num}) / ({den}))")
    return lines


def _source(spec: MmaSpec, name: str) -> str:
    E, D = spec.experts, spec.dim
    NG = n_gate_tiles(E)
    G = groups(D, E)
    V = words_per_ad(spec.precision, D) // QUAD_WORDS
    init = [f"bf{j}_{i} = uint32(0)" for j in range(G) for i in range(4)]
    init += ["inv = float32(1.0)"]
    init += [f"{x}b{e} = float32(0.0)" for x in "qu" for e in range(E)]
    load_b = [f"fb = ((r * n_f + f) * {G}) * 128 + lane * 4"]
    load_b += [f"bf{j}_0, bf{j}_1, bf{j}_2, bf{j}_3 = load_u32x4(frag, fb + {j * 128})" for j in range(G)]
    load_b.append("inv = fscale[r, f]")
    qb0 = 2 * E * D
    load_b += [f"qb{e} = tabs[r, f, {qb0 + e}]" for e in range(E)]
    load_b += [f"ub{e} = tabs[r, f, {qb0 + E + e}]" for e in range(E)]
    body = _products(spec) + ["sync_warp()"] + _epilogue(spec) + ["sync_warp()"]
    sim = runtime.simulator_enabled()
    # what every skeleton reads; each walk adds its own below
    common = dict(name=name, b_axis="y" if spec.request_major else "x", r_axis="x" if spec.request_major else "y",
                  floor_arg=", floor" if spec.floor else "", state_n=STATE_WORDS + (1 if spec.floor else 0),
                  hist_n=HIST_COPIES * HIST_BINS, chunk=CHUNK_SLOTS, warps=WARPS,
                  acc_stride=8 * 2 * NG + 1, init=_indent(init, 4))
    own_tiles = _SIM_TILE_COUNT if sim else ["n_tiles = (n + 31) >> 5"]  # a warp's tiles of its own list
    if spec.compact:  # the listing walks (compacted, and wide)
        common.update(threads=THREADS, wpc=CHUNK_SLOTS // 32, load_b=_indent(load_b, 16), body=_indent(body, 12),
                      tile_count=_indent(own_tiles, 8))
    if spec.wide:
        emit_list = "block_topk_emit_list_warp" if spec.warp_counts else "block_topk_emit_list"
        wide = dict(keys_n=LIST_CAP, list_cap=LIST_CAP, cpb=spec.chunks, cpw=spec.chunks // WARPS,
                    subs=spec.chunks * CHUNK_SLOTS // spec.out_slots, st_list=ST_LIST, emit_at=spec.emit_at,
                    emit_list="block_topk_emit_list_floor" if spec.floor else emit_list,
                    floor_pass=f", floor, cap < {spec.out_slots}" if spec.floor else "")
        kept_init = f"        state[{ST_KEPT}] = uint32(0)\n" if spec.floor else ""
        if spec.free_at:
            count = _FREE_COUNT.format(**common, **wide, st_count=ST_COUNT, out_slots=spec.out_slots,
                                       free_big=min(spec.free_at, LIST_CAP),
                                       free_small=min(spec.free_at, LIST_CAP, spec.out_slots))
            return _FREE_SKELETON.format(**common, **wide, pool_shared="", wbase_n=WARPS,
                                         count_init=f"        state[{ST_COUNT}] = uint32(0)\n" + kept_init,
                                         count_walk=count)
        wide.update(count_init=kept_init, count_walk="")  # the wide walk's rounds from the start
        if not spec.pooled:
            return _WIDE_SKELETON.format(**common, **wide, pool_shared="", wbase_n=WARPS)
        shared = [f"rcount = cuda.shared.array({WARPS}, int32)", f"rfmt = cuda.shared.array({WARPS}, int32)",
                  f"pre = cuda.shared.array({WARPS}, int32)"]
        # a pooled round deals tile t to warp t % WARPS; under the simulator every warp runs the most
        dealt = (["n_tiles = (((total + 31) >> 5) + " + str(WARPS - 1) + ") // " + str(WARPS)] if sim else
                 ["n_tiles = max(0, (((total + 31) >> 5) - warp + " + str(WARPS - 1) + ") // " + str(WARPS) + ")"])
        return _POOLED_SKELETON.format(**common, **wide, pool_shared=_indent(shared, 4), wbase_n=WARPS + 1,
                                       tile_count_mixed=_indent(own_tiles, 12),
                                       tile_count_pooled=_indent(dealt, 12), load_b_pooled=_indent(load_b, 16))
    if spec.compact:
        return _COMPACT_SKELETON.format(**common, keys_n=ADS_PER_BLOCK, cpb=CHUNKS_PER_BLOCK,
                                        cpw=CHUNKS_PER_BLOCK // WARPS)
    skip = "True" if sim else "ew != uint32(0)"  # block-uniform under the simulator
    return _SKELETON.format(**common, keys_n=ADS_PER_BLOCK, cpb=CHUNKS_PER_BLOCK, tile_words=V * TILE_WORDS,
                            load_b=_indent(load_b, 16), skip=skip, body=_indent(body, 16))


def _name(spec: MmaSpec) -> str:
    regs = f"_r{spec.max_registers}" if spec.max_registers else ""
    walk = "_compact" if spec.compact else ""
    if spec.wide:
        walk = f"_wide{spec.emit_at}" + ("" if spec.out_slots == ADS_PER_BLOCK else f"_o{spec.out_slots}")
        walk += "" if spec.chunks == WIDE_CHUNKS else f"_c{spec.chunks}"
    walk += "_rm" if spec.request_major else ""
    walk += "_wc" if spec.warp_counts else ""
    walk += "_pool" if spec.pooled else ""
    walk += f"_free{spec.free_at}" if spec.free_at else ""
    walk += "_floor" if spec.floor else ""
    return f"score_mma_{spec.kind}_{spec.precision}_d{spec.dim}_e{spec.experts}_k{spec.top_e}_{spec.mode}{regs}{walk}"


def kernel_source(spec: MmaSpec) -> str:
    return _source(spec, _name(spec))


def _namespace() -> dict:
    return {
        "cuda": cuda, "math": math, "float32": float32, "int32": int32, "uint32": uint32,
        "block_topk_emit": block_topk_emit, "block_topk_emit_list": block_topk_emit_list,
        "block_topk_emit_list_warp": block_topk_emit_list_warp, "block_topk_emit_list_floor": block_topk_emit_list_floor,
        "load_u32x4": _bits.load_u32x4, "u32_as_f32": _bits.u32_as_f32,
        "f32_to_key": _bits.f32_to_key, "mma_f16": mma.mma_f16, "split_f16x2": mma.split_f16x2,
        "i8x2_to_f16x2": mma.i8x2_to_f16x2, "sync_warp": warp.sync_warp, "ballot": warp.ballot,
    }


def kernel_signature(floor: bool = False) -> tuple:
    """The fused kernel's argument types, for compiling it ahead of a launch (`numba.cuda.compile_ptx`):
    emb, scale, chunk_format, elig, tabs, frag, fscale, cap, out_key, out_slot (and with a running
    floor, `floor`)."""
    from numba import types as T

    return (T.uint32[::1], T.float32[::1], T.int32[::1], T.uint32[:, ::1], T.float32[:, :, ::1], T.uint32[::1],
            T.float32[:, ::1], T.int32, T.uint32[:, :, ::1], T.int32[:, :, ::1]) + ((T.uint32[::1],) if floor else ())


@cuda.jit
def reset_floor(floor):
    """Every request's running floor back to 0 (nothing known yet), before a launch of a floor kernel."""
    i = cuda.grid(1)
    if i < floor.shape[0]:
        floor[i] = uint32(0)


def python_function(spec: MmaSpec):
    """The generated kernel as a plain Python function (before `cuda.jit`)."""
    name = _name(spec)
    fn, _ = generated_function(name, _source(spec, name), _namespace(), cache=not runtime.simulator_enabled())
    return fn


class MmaScoreKernel:
    """`score.ScoreKernel`'s interface for the tensor-core kernel: `launch` prepares the B fragments
    of the batch's tables (kept buffers, one small launch) and runs the fused kernel."""

    layout = "tiles"
    threads = THREADS

    def __init__(self, spec: MmaSpec):
        self.spec = spec
        # the output's block granularity (FusedScorer sizes the per-block candidates by it); a wide
        # block covers spec.chunks chunks and fills spec.chunks * CHUNK_SLOTS / out_slots output blocks
        self.ads_per_block = spec.out_slots if spec.wide else ADS_PER_BLOCK
        options = {} if spec.max_registers is None or runtime.simulator_enabled() else {"max_registers": spec.max_registers}
        self.kernel = cuda.jit(python_function(spec), cache=not runtime.simulator_enabled(), **options)
        self._dims = None
        self._bufs: dict = {}

    def grid(self, n_slots: int, n_requests: int) -> tuple[int, int]:
        per_block = self.spec.chunks * CHUNK_SLOTS if self.spec.wide else ADS_PER_BLOCK
        n_blocks = -(-n_slots // per_block)
        return (n_requests, n_blocks) if self.spec.request_major else (n_blocks, n_requests)

    def prepare(self, tabs, stream=0):
        """(frag, fscale) device arrays for `tabs` (float32 [R, F, TW], on the device)."""
        steps, frag, fscale = self.prepare_plan(tabs)
        run_plan(steps, stream)
        return frag, fscale

    def prepare_plan(self, tabs):
        """(plan, frag, fscale): the table preparation's launch as a `gpu.graphs` plan, and the device
        arrays it writes."""
        R, F = tabs.shape[0], tabs.shape[1]
        if self._dims is None:
            self._dims = cuda.to_device(dim_map(self.spec.precision, self.spec.dim))
        # one pair of buffers for the largest batch seen (a power of two), its first R requests' part
        # handed out: batches of changing sizes allocate nothing (an allocation synchronizes the device)
        per_request = F * groups(self.spec.dim, self.spec.experts) * 128
        if self._bufs.get("F") != F or self._bufs["rows"] < R:
            rows = runtime.kept_rows(R, self._bufs.get("rows", 0) if self._bufs.get("F") == F else 0)
            full = (cuda.device_array(rows * per_request, np.uint32), cuda.device_array((rows, F), np.float32))
            self._bufs = {"F": F, "rows": rows, "views": {}, "full": full}
        views = self._bufs["views"].get(R)
        if views is None:
            frag_full, fscale_full = self._bufs["full"]
            views = self._bufs["views"][R] = (frag_full[: R * per_request], fscale_full[:R])
        frag, fscale = views
        step = Launch(prep_tables, (F, R), PREP_THREADS, (tabs, self._dims, np.int32(self.spec.experts),
                                                          np.int32(n_gate_tiles(self.spec.experts)), frag, fscale))
        return [step], frag, fscale

    def plan(self, emb, scale, chunk_format, elig, tabs, cap, out_key, out_slot) -> list:
        """Table preparation and scoring as a `gpu.graphs` plan (`tabs` on the device); with a running
        floor, its reset first (one word a request, kept with the fragments' buffers)."""
        steps, frag, fscale = self.prepare_plan(tabs)
        n_slots = chunk_format.shape[0] * CHUNK_SLOTS
        R = elig.shape[0]
        args = (emb, scale, chunk_format, elig, tabs, frag, fscale, np.int32(cap), out_key, out_slot)
        if self.spec.floor:
            floor = self._floor(R)
            steps = steps + [Launch(reset_floor, (-(-R // 128),), 128, (floor,))]
            args += (floor,)
        return steps + [Launch(self.kernel, self.grid(n_slots, R), THREADS, args)]

    def _floor(self, R: int):
        """The first R words of the kept floor buffer (one for the largest batch seen, a power of two)."""
        full = self._bufs.get("floor")
        if full is None or full.shape[0] < R:
            full = self._bufs["floor"] = cuda.device_array(runtime.kept_rows(R, 0 if full is None else full.shape[0]),
                                                           np.uint32)
            self._bufs["floor_views"] = {}
        views = self._bufs["floor_views"]
        if R not in views:
            views[R] = full[:R]
        return views[R]

    def launch(self, emb, scale, chunk_format, elig, tabs, cap, out_key, out_slot, stream=0):
        if isinstance(tabs, np.ndarray):
            tabs = cuda.to_device(np.ascontiguousarray(tabs, np.float32))
        run_plan(self.plan(emb, scale, chunk_format, elig, tabs, cap, out_key, out_slot), stream)


def supports(kind: str, precision: str, dim: int, experts: int) -> bool:
    """Whether the tensor-core kernel serves this shape (else the CUDA-core kernels do): the MoE, with
    whole k-steps and at least four quads per ad, one for each lane of a group (D a multiple of 16
    at fp32, 32 at fp16, 64 at int8)."""
    if kind != "moe" or precision not in BYTES or experts < 1 or dim % K_STEP:
        return False
    return (dim * BYTES[precision]) % (4 * QUAD_WORDS * 4) == 0


@lru_cache(maxsize=None)
def get_mma_kernel(precision: str, dim: int, experts: int, top_e: int, mode: str = "exact",
                   max_registers: int | None = None, compact: bool = False, wide: bool = False,
                   emit_at: int = LIST_CAP - ROUND_SLOTS, out_slots: int = ADS_PER_BLOCK,
                   chunks: int = WIDE_CHUNKS, request_major: bool = False, warp_counts: bool = False,
                   pooled: bool = False, free_at: int = 0, floor: bool = False) -> MmaScoreKernel:
    if mode not in MODES:
        raise ValueError(f"unknown tensor-core mode {mode!r}; choose from {', '.join(MODES)}")
    if not supports("moe", precision, dim, experts):
        raise ValueError(f"the tensor-core scorer does not serve {precision} at D = {dim}, E = {experts}")
    if wide:
        if chunks < WARPS or chunks % WARPS:
            raise ValueError(f"a wide walk covers a multiple of {WARPS} chunks a block, not {chunks}")
        subs, rest = divmod(chunks * CHUNK_SLOTS, out_slots)
        rounds = chunks // WARPS
        # a list is selected once a round at most, or once per two rounds when a round cannot pass emit_at
        if rest or not 0 < emit_at <= LIST_CAP - ROUND_SLOTS or subs < (rounds if emit_at < ROUND_SLOTS else rounds // 2):
            raise ValueError(f"a wide walk with emit_at {emit_at} and {out_slots} slots per output block can "
                             f"overflow its list or its output blocks")
    return MmaScoreKernel(MmaSpec(precision, dim, experts, top_e, mode, max_registers=max_registers,
                                  compact=compact or wide, wide=wide, emit_at=emit_at, out_slots=out_slots,
                                  chunks=chunks, request_major=request_major, warp_counts=warp_counts and wide,
                                  pooled=pooled and wide, free_at=free_at if wide and not pooled else 0,
                                  floor=floor and wide and not pooled and not warp_counts))


__all__ = ["MODES", "MmaScoreKernel", "MmaSpec", "dim_map", "fragment_tables_host", "get_mma_kernel",
           "kernel_source", "prep_tables", "supports"]
