"""Fused scoring kernels, as shipped: eligibility, gather, gated-MoE (or two-tower dot) score and
per-block top-K, in one pass over the stored embeddings (DESIGN section 3).

The product runs `SHIPPED` where its recipe serves the shape best, else `FALLBACK` (`version()`):
    v19 wide, request-major, free walk, running floor  the 2E per-ad dots as mma.sync m16n8k16 tiles on the tensor cores, the
                  request's tables carried as fp16 hi + lo pairs (float32 accuracy), over each chunk's
                  eligible slots only (a warp lists them in shared memory and gathers their rows into
                  the tiles, so the bytes read follow the eligible ads, not the pool), one ad per lane
                  for routing and softmax; a block walks 64 chunks (16,384 slots) and keeps its
                  eligible ads' keys as a list, so its top-K selects among the eligible ads once,
                  not among 4096 keys (mostly empty) every 16 chunks (`gpu/kernels/score_mma.py`,
                  which says how); the grid is (requests, blocks), so the blocks of a batch's
                  requests over one range of slots are resident together and an ad eligible for
                  several of them comes from L2 after its first read (v8, the same walk on a
                  (blocks, requests) grid, ran one request's blocks after another's and read each
                  eligible row from DRAM once per request); a block counts its eligible ads first and,
                  when they fit its list at once (as a match's 2% to 14% always do), its warps walk
                  their chunks without a block barrier between rounds, each waiting for no other
                  (v14, the same with the rounds' two barriers in every block, spent a third of a
                  warp's cycles at them); held to 128 registers a thread (two blocks an SM), where
                  v11, the same walk at 80 (three blocks), spills to local memory; and each request
                  keeps a running floor in device memory: a block whose select keeps k ads raises it
                  (an atomic max) to the key of the k-th, and a later block lists an ad scored below it
                  as key 0, never kept, so most lists hold at most k keys and go out with no select
                  (v17, the same without the floor, ran every block's four select rounds); shipped for the
                  MoE at fp16 and int8 with D = 64, where it was measured faster (docs/BENCHMARKS.md,
                  the co-located pipeline)
    v4 tiled x4   four ads per thread (64-thread blocks); embeddings tile-interleaved as 32-bit words
                  (below) read with 16-byte loads; the block's format table in shared memory, d-major
                  (2E floats per dimension: gate keys then expert vectors, FiLM folded in), read with
                  16-byte loads that feed four FMAs each (chunks are format-uniform, so every lane reads
                  the same address: broadcast, no bank conflicts); each ad streamed one 16-byte quad at
                  a time (generated code, the quad's values unrolled into scalars: no local memory)
                  while all 2E dots advance; then routing picks the top-k gates and combines the
                  routed expert dots; int8 unpacked by one byte permute and one add per value. The
                  fallback: dot kernels, float32 storage, D = 128.
Both run under the CUDA simulator too (the tensor-core kernel through `gpu.kernels.mma`'s emulation).
The versions before them (v1 naive, v2 and v3 with one and two ads per thread, v5 the tensor-core
kernel without a register limit, v6 its full walk over every slot at 80 registers, v7 the compacted walk
with a block top-K every 4096 slots, v8 the shipped walk on a (blocks, requests) grid, v14 the shipped walk with
the rounds' barriers in every block, v17 the shipped walk without the running floor) are in the kernel lab, `gpu/lab/score.py`, which `andromeda bench
score` times and the tests check. A version is one entry of `VERSIONS`: a number, a name, and a
recipe with `layout` ('rows' | 'tiles') and `build(spec)`; the tiled versions share the generator
`tiled(ads_per_thread)`, the tensor-core ones `TensorCoreRecipe` (the
register limit and the compacted walk are its parameters).

Kernels (one per version, precision, D, E, top-k and kind 'moe' | 'dot', generated and compiled on
first use by `get_kernel`). Every kernel has the same arguments:

    emb          stored embeddings in the version's layout: 'rows' (S, D) float32|float16|int8, or
                 'tiles' uint32[S * D * bytes / 4]
    scale        float32[S]         int8 scale per slot (ones otherwise; read only for int8)
    chunk_format int32[S / 256]     format of every chunk of 256 slots
    elig         uint32[R, S / 32]  bit (s % 32) of elig[r, s // 32]: request r may see slot s
                                    (gpu.index.GpuTargetingIndex.match_slots)
    tabs         float32[R, F, TW]  per-request folded tables (andromeda_nb.scoring.fold_tables;
                                    dot kernels read the user vector from row 0)
    cap          int32              candidates kept per block: min(k, ADS_PER_BLOCK)
    out_key      uint32[R, NB, >= cap]  per-block candidates: orderable score keys (_bits.f32_to_key),
    out_slot     int32[R, NB, >= cap]   and their slots; key 0 = no candidate (padding)

Launch: grid (NB, R) with NB = ceil(S / ADS_PER_BLOCK), block (threads of the version,) (the
tensor-core kernels: their own block of slots, and grid (R, NB) when request-major, as v19 is). Each block
covers CHUNKS_PER_BLOCK chunks (ADS_PER_BLOCK = 2048 ads), scores its eligible ads, keeps the keys in
shared memory and selects its top `cap` by the block-wide radix select of `gpu.kernels.radix` (per-warp
shared histograms); only those are written. Nothing else per ad reaches device memory.
Exact float ties at a block's cut-off are kept in arrival order (DESIGN section 4 compares tied scores
as sets).

Device layout 'tiles': slots are grouped in tiles of 32 (one warp); ad words are grouped in
quads of 4 (16 bytes). Word j of slot s lives at

    ((s // 32) * V + j // 4) * 128 + (s % 32) * 4 + j % 4          V = words per ad / 4

so the 32 lanes of a warp loading quad q of their ads read 512 contiguous bytes. Words hold the
stored values little-endian: one float32, two float16 (low half first) or four int8 (byte 0 first).
`gpu.kernels.tiles.to_tiles` and `from_tiles` convert from and to row-major stored values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import numpy as np

from andromeda_nb.jitcache import generated_function
from andromeda_nb.scoring import dot_score, moe_score, table_width
from andromeda_nb.slots import CHUNK_SLOTS
from andromeda_nb.versions import Version, pick, version_table

from .. import runtime
from ..graphs import Launch, run_plan
from . import _bits
from .block_topk import HIST_BINS, HIST_COPIES, STATE_WORDS, block_topk_emit
from .tiles import QUAD_WORDS, words_per_ad

cuda = runtime.cuda()
from numba import float32, int32, uint32  # noqa: E402  (after the device choice)

CHUNKS_PER_BLOCK = 8
ADS_PER_BLOCK = CHUNKS_PER_BLOCK * CHUNK_SLOTS  # 2048
KINDS = ("moe", "dot")


# --- code generation ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelSpec:
    version: Version
    kind: str  # "moe" | "dot"
    precision: str
    dim: int
    experts: int
    top_e: int

    @property
    def table_width(self) -> int:
        return table_width(self.experts, self.dim)


_SKELETON = '''
def {name}(emb, scale, chunk_format, elig, tabs, cap, out_key, out_slot):
    keys = cuda.shared.array({keys_n}, uint32)
    tab = cuda.shared.array({tab_n}, float32{align})
    hist = cuda.shared.array({hist_n}, uint32)
    part = cuda.shared.array(16, uint32)
    state = cuda.shared.array({state_n}, uint32)
    tid = cuda.threadIdx.x
    b = cuda.blockIdx.x
    r = cuda.blockIdx.y
    n_chunks = chunk_format.shape[0]
    c0 = b * {cpb}
    cur_f = -1
{preload}
    for cl in range({cpb}):
        c = c0 + cl
{key_init}
        if c < n_chunks:
{tables}
            slot = c * {chunk} + tid
{body}
{key_store}
    cuda.syncthreads()
    block_topk_emit(keys, {keys_n}, cap, hist, part, state, out_key, out_slot, r, b, c0 * {chunk})
'''
_TABLE_PER_CHUNK = '''            f = chunk_format[c]
            if f != cur_f:
                cuda.syncthreads()
                for j in range(tid, {dpe}, {nt}):
                    d = j // {pe}
                    e = j - d * {pe}
                    v = float32(0.0)
                    if e < {two_e}:
                        v = tabs[r, f, e * {dim} + d]
                    tab[j] = v
                for j in range(tid, {two_e}, {nt}):
                    tab[{dpe} + j] = tabs[r, f, {two_e_d} + j]
                cuda.syncthreads()
                cur_f = f'''

_TABLE_ONCE = '''    for j in range(tid, {tw}, {nt}):
        tab[j] = tabs[r, 0, j]
    cuda.syncthreads()'''


def _indent(lines, n):
    pad = " " * n
    return "\n".join(pad + ln if ln else ln for ln in lines)


def _quad_values(spec: KernelSpec, p: str, q_words: list[str]) -> list[tuple[str, list[str]]]:
    """Lines turning the 4 words of one quad into float32 scalars: (lines, value names)."""
    lines, names = [], []
    for w in q_words:
        if spec.precision == "fp32":
            lines.append(f"v{len(names)}_{p} = u32_as_f32({w})")
            names.append(f"v{len(names)}_{p}")
        elif spec.precision == "fp16":
            for half in ("lo", "hi"):
                lines.append(f"v{len(names)}_{p} = half_{half}({w})")
                names.append(f"v{len(names)}_{p}")
        else:
            lines.append(f"x_{w} = {w} ^ uint32(0x80808080)")
            for j in range(4):
                lines.append(f"v{len(names)}_{p} = i8_to_f32(x_{w}, {j})")
                names.append(f"v{len(names)}_{p}")
    return lines, names


def _padded_experts(experts: int) -> int:
    """Floats per embedding dimension in the shared d-major table (2E rounded up to a quad)."""
    return -(-2 * experts // QUAD_WORDS) * QUAD_WORDS


def _tiled_body(spec: KernelSpec, apt: int) -> list[str]:
    """Per-ad code for `apt` ads per thread (slots slot + i * nt); results in keys k0..k{apt-1}.

    The ad is streamed quad by quad (a runtime loop over the V quads of the ad; the values of one
    quad are unrolled scalars) and every dot product advances together: E gate dots and E expert
    dots for 'moe' (the shared table is d-major, 2E floats per dimension, read with 16-byte loads
    that serve every ad of the thread), one dot for 'dot'. Routing then picks the top-k experts and
    combines their already-computed expert dots."""
    D, E, K = spec.dim, spec.experts, spec.top_e
    W = words_per_ad(spec.precision, D)
    V = W // QUAD_WORDS
    per_quad = D // V  # embedding values per quad
    nt = CHUNK_SLOTS // apt
    ads = [f"a{i}" for i in range(apt)]
    slots = [f"slot + {i * nt}" if i else "slot" for i in range(apt)]
    n_acc = 2 * E if spec.kind == "moe" else 1
    PE = _padded_experts(E)
    lines = [f"e{i} = (elig[r, ({s}) >> 5] >> (({s}) & 31)) & 1" for i, s in enumerate(slots)]
    lines.append(f"if {' or '.join(f'e{i}' for i in range(apt))}:")
    body = []
    for p, s in zip(ads, slots):
        body.append(f"base_{p} = ((({s}) >> 5) * {V}) * 128 + (({s}) & 31) * 4")
        body += [f"acc{j}_{p} = float32(0.0)" for j in range(n_acc)]
    body.append(f"for q in range({V}):")
    loop = []
    values = {}
    for p in ads:
        ws = [f"w{j}_{p}" for j in range(4)]
        loop.append(f"{', '.join(ws)} = load_u32x4(emb, base_{p} + q * 128)")
        qlines, names = _quad_values(spec, p, ws)
        loop += qlines
        values[p] = names
    if spec.kind == "dot":
        loop.append(f"d0 = q * {per_quad}")
        for m in range(per_quad // 4):
            loop.append(f"u0, u1, u2, u3 = lds_f32x4(tab, d0 + {4 * m})")
            for j in range(4):
                for p in ads:
                    loop.append(f"acc0_{p} += {values[p][4 * m + j]} * u{j}")
    else:
        loop.append(f"t0 = q * {per_quad * PE}")
        for j in range(per_quad):
            for m in range(PE // 4):
                loop.append(f"u{4 * m}, u{4 * m + 1}, u{4 * m + 2}, u{4 * m + 3} = lds_f32x4(tab, t0 + {j * PE + 4 * m})")
            for a in range(2 * E):
                for p in ads:
                    loop.append(f"acc{a}_{p} += {values[p][j]} * u{a}")
    body += ["    " + ln for ln in loop]
    scaled = spec.precision == "int8"
    for i, (p, s) in enumerate(zip(ads, slots)):
        sc = f" * sc_{p}" if scaled else ""
        if scaled:
            body.append(f"sc_{p} = scale[{s}]")
        if spec.kind == "dot":
            body.append(f"k{i} = f32_to_key(acc0_{p}{sc}) if e{i} else uint32(0)")
            continue
        qb, ub = D * PE, D * PE + E
        for e in range(E):
            body.append(f"g{e}_{p} = acc{e}_{p}{sc} + tab[{qb + e}]")
        body.append(f"m_{p} = 0")
        num, den = [], []
        for j in range(K):
            body += [f"b{j}_{p} = -1", f"gv{j}_{p} = float32(0.0)", f"x{j}_{p} = float32(0.0)"]
            for e in range(E):
                body.append(f"if (m_{p} >> {e}) & 1 == 0 and (b{j}_{p} < 0 or g{e}_{p} > gv{j}_{p}):")
                body.append(f"    b{j}_{p} = {e}")
                body.append(f"    gv{j}_{p} = g{e}_{p}")
                body.append(f"    x{j}_{p} = acc{E + e}_{p}")
            body.append(f"m_{p} |= 1 << b{j}_{p}")
            wj = "float32(1.0)" if j == 0 else f"float32(math.exp(gv{j}_{p} - gv0_{p}))"
            body.append(f"w{j}_{p} = {wj}")
            num.append(f"w{j}_{p} * (x{j}_{p}{sc} + tab[{ub} + b{j}_{p}])")
            den.append(f"w{j}_{p}")
        body.append(f"sc{i} = ({' + '.join(num)}) / ({' + '.join(den)})")
        body.append(f"k{i} = f32_to_key(sc{i}) if e{i} else uint32(0)")
    return lines + ["    " + ln for ln in body]


def _source(spec: KernelSpec, name: str) -> tuple[str, int]:
    """(kernel source, threads per block)."""
    recipe = spec.version.recipe
    apt = recipe.ads_per_thread
    nt = CHUNK_SLOTS // apt
    body = recipe.body(spec, apt)
    if not recipe.staged_tables:
        tables, preload = "", ""
    elif spec.kind == "dot":
        tables, preload = "", _TABLE_ONCE.format(tw=spec.dim, nt=nt)
    else:
        pe = _padded_experts(spec.experts)
        tables = _TABLE_PER_CHUNK.format(dpe=spec.dim * pe, pe=pe, two_e=2 * spec.experts, dim=spec.dim,
                                         two_e_d=2 * spec.experts * spec.dim, nt=nt)
        preload = ""
    key_init = _indent([f"k{i} = uint32(0)" for i in range(apt)], 8)
    key_store = _indent([f"keys[cl * {CHUNK_SLOTS} + tid + {i * nt}] = k{i}" for i in range(apt)], 8)
    src = _SKELETON.format(
        name=name, keys_n=ADS_PER_BLOCK, tab_n=_shared_table_floats(spec),
        align="" if runtime.simulator_enabled() else ", alignment=16", hist_n=HIST_COPIES * HIST_BINS,
        state_n=STATE_WORDS, cpb=CHUNKS_PER_BLOCK, chunk=CHUNK_SLOTS, preload=preload, key_init=key_init,
        tables=tables, body=_indent(body, 12), key_store=key_store,
    )
    return src, nt


def _shared_table_floats(spec: KernelSpec) -> int:
    if not spec.version.recipe.staged_tables:
        return 4
    if spec.kind == "dot":
        return spec.dim
    return spec.dim * _padded_experts(spec.experts) + 2 * spec.experts


def kernel_source(spec: KernelSpec) -> str:
    return _source(spec, _name(spec))[0]


def _name(spec: KernelSpec) -> str:
    return f"score_v{spec.version.number}_{spec.kind}_{spec.precision}_d{spec.dim}_e{spec.experts}_k{spec.top_e}"


def _namespace() -> dict:
    return {
        "cuda": cuda, "math": math, "float32": float32, "int32": int32, "uint32": uint32,
        "moe_score": _device(moe_score), "dot_score": _device(dot_score),
        "block_topk_emit": block_topk_emit, "load_u32x4": _bits.load_u32x4, "u32_as_f32": _bits.u32_as_f32,
        "half_lo": _bits.half_lo, "lds_f32x4": _bits.lds_f32x4, "half_hi": _bits.half_hi, "i8_to_f32": _bits.i8_to_f32,
        "f32_to_key": _bits.f32_to_key,
    }


@lru_cache(maxsize=None)
def _device(fn):
    return cuda.jit(device=True)(fn)


def python_function(spec: KernelSpec):
    """The generated kernel as a plain Python function (before `cuda.jit`), and its threads per block."""
    name = _name(spec)
    src, nt = _source(spec, name)
    fn, _ = generated_function(name, src, _namespace(), cache=not runtime.simulator_enabled())
    return fn, nt


@dataclass
class ScoreKernel:
    spec: KernelSpec
    kernel: object  # numba CUDA dispatcher
    threads: int
    layout: str
    ads_per_block: int = ADS_PER_BLOCK

    def grid(self, n_slots: int, n_requests: int) -> tuple[int, int]:
        return (-(-n_slots // ADS_PER_BLOCK), n_requests)

    def plan(self, emb, scale, chunk_format, elig, tabs, cap, out_key, out_slot) -> list:
        """The launch as a `gpu.graphs` plan (`tabs` on the device)."""
        n_slots = chunk_format.shape[0] * CHUNK_SLOTS
        return [Launch(self.kernel, self.grid(n_slots, elig.shape[0]), self.threads,
                       (emb, scale, chunk_format, elig, tabs, np.int32(cap), out_key, out_slot))]

    def launch(self, emb, scale, chunk_format, elig, tabs, cap, out_key, out_slot, stream=0):
        run_plan(self.plan(emb, scale, chunk_format, elig, tabs, cap, out_key, out_slot), stream)


@dataclass(frozen=True)
class GeneratedRecipe:
    """How a version's kernel is written: the generator above, with the per-ad code `body(spec,
    ads_per_thread) -> lines` (results in keys k0..k{ads_per_thread-1}) and whether the block stages
    the request's format tables in shared memory (`staged_tables`) or the body reads them from
    global memory."""

    layout: str  # "rows" | "tiles"
    ads_per_thread: int
    body: Callable[[KernelSpec, int], list[str]]
    staged_tables: bool = True

    def build(self, spec: KernelSpec) -> ScoreKernel:
        fn, nt = python_function(spec)
        return ScoreKernel(spec, cuda.jit(fn, cache=not runtime.simulator_enabled()), nt, self.layout)


def tiled(ads_per_thread: int) -> GeneratedRecipe:
    """The tiled kernels (v2 to v4): tiled words, staged d-major tables, `ads_per_thread` ads a thread."""
    return GeneratedRecipe("tiles", ads_per_thread, _tiled_body)


@dataclass(frozen=True)
class TensorCoreRecipe:
    """The tensor-core kernel (`gpu/kernels/score_mma.py`) as a version of this family: the same
    'tiles' layout, MoE only, `max_registers` per thread (None: what the compiler takes)."""

    max_registers: int | None = None
    compact: bool = False  # walk each chunk's eligible slots only (score_mma._COMPACT_SKELETON)
    wide: bool = False  # the compacted walk over 64 chunks a block, keys as a list (score_mma._WIDE_SKELETON)
    chunks: int = 64  # wide: chunks a block walks (score_mma.WIDE_CHUNKS by default)
    request_major: bool = False  # grid (R, NB): a batch's requests walk the same chunks at once
    warp_counts: bool = False  # wide: the block top-K's radix select counts a warp's equal digits at once
    pooled: bool = False  # wide: a round of one format runs its warps' lists as one (score_mma._POOLED_ROUND)
    free_at: int = 0  # wide: a block with at most this many eligible ads walks without barriers (score_mma._FREE_TAIL)
    floor: bool = False  # wide: a running floor per request, ads scored below it not kept (score_mma MmaSpec.floor)
    layout: str = "tiles"

    def build(self, spec: KernelSpec):
        from .score_mma import get_mma_kernel  # imported here: score_mma builds on this module

        if spec.kind != "moe":
            raise ValueError(f"the tensor-core scorer serves the MoE only, not {spec.kind!r}")
        return get_mma_kernel(spec.precision, spec.dim, spec.experts, spec.top_e, max_registers=self.max_registers,
                              compact=self.compact, wide=self.wide, chunks=self.chunks,
                              request_major=self.request_major, warp_counts=self.warp_counts, pooled=self.pooled,
                              free_at=self.free_at, floor=self.floor)

    def prefers(self, kind: str, precision: str, dim: int) -> bool:
        """Where it was measured faster than the CUDA-core kernel (docs/results/score_mma_runs.md,
        run6, run7 and the D = 128 run3): the MoE at fp16 and int8 with D = 64, on a device with tensor cores
        (compute capability 8.0 or newer; the simulator emulates them)."""
        return kind == "moe" and precision in ("fp16", "int8") and dim == 64 and runtime.has_tensor_cores()


VERSIONS = version_table(
    Version(4, "v4 tiled x4", "16-byte loads of tiled words, shared d-major format table, four ads per thread",
            tiled(4)),
    Version(19, "v19 free walk, running floor", "v17 (the free walk over 16,384 slots a block on a (requests, "
            "blocks) grid, its eligible ads' keys kept as a list, 128 registers) with a running floor per request in "
            "device memory: a block that keeps k ads raises its request's floor to the k-th key it kept (an atomic "
            "max), and a later block lists an ad scored below the floor as key 0, never kept: its select counts only "
            "the ads that can still be in the answer, and most of its lists come out within k with no select "
            "(score_mma.py; MoE only)",
            TensorCoreRecipe(128, compact=True, wide=True, request_major=True, free_at=4096, floor=True)),
)
# docs/BENCHMARKS.md, the co-located pipeline (H100, the generated 10M-ad corpus of distinct ads, v17, v19 and
# v20 in one lease, commit 9294f81): the scoring kernel of a batch of 64 3.80 ms against v17's 5.32, batches of 64
# 107.5 G pool ads/s against 86.1 G, one request p50 0.89 and 0.92 ms (two runs) against 0.91; at 100M distinct
# copies batches of 64 124.5 G against v14's 85.9 G. v20 (v19 over 128 chunks a block for batches) no faster.
SHIPPED = 19
FALLBACK = 4  # for the shapes SHIPPED does not serve best: dot kernels, fp32 storage, D = 128


def version(v=None, kind: str = "moe", precision: str = "fp16", dim: int = 64) -> Version:
    """The Version `v` names (a number of `VERSIONS`, a Version from the lab); None: SHIPPED where its
    recipe serves (kind, precision, dim) best, else FALLBACK."""
    if v is None:
        shipped = VERSIONS[SHIPPED]
        serves = getattr(shipped.recipe, "prefers", lambda *_: True)
        return shipped if serves(kind, precision, dim) else VERSIONS[FALLBACK]
    return pick(VERSIONS, v, SHIPPED, "scoring")


@lru_cache(maxsize=None)
def get_kernel(version_, kind: str, precision: str, dim: int, experts: int, top_e: int) -> ScoreKernel:
    """The compiled kernel of a version (a number of `VERSIONS` or a `Version`) for one kind, precision
    and size."""
    chosen = version(version_, kind, precision, dim)
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; choose from {KINDS}")
    return chosen.recipe.build(KernelSpec(chosen, kind, precision, dim, experts, top_e))


def cap_for(k: int, ads_per_block: int = ADS_PER_BLOCK) -> int:
    return min(int(k), ads_per_block)


def n_blocks(n_slots: int, ads_per_block: int = ADS_PER_BLOCK) -> int:
    return -(-n_slots // ads_per_block)


__all__ = [
    "ADS_PER_BLOCK", "CHUNKS_PER_BLOCK", "FALLBACK", "KINDS", "GeneratedRecipe", "KernelSpec", "SHIPPED", "ScoreKernel",
    "TensorCoreRecipe",
    "VERSIONS", "cap_for", "get_kernel", "kernel_source", "n_blocks", "tiled", "version",
]
