"""The batched tensor-core scorer: each ad tile's stored embeddings read once for a group of requests,
not once per request.

Measured (H100, commit 653333f, `scripts/probe_score_batched.py --ads 10000000 --requests 64`; docs/
BENCHMARKS.md): answers equal to the shipped v8's, but 61.0 ms for the batch against v8's 11.7 ms. v8
compacts each request's eligible slots (about 6% of a pool) into full m16 tiles before its products;
this kernel runs the products and the epilogue over every slot of each tile a request sees (42% of the
tiles of a generated corpus), about seven times the work, which the single read does not repay. Kept
in the lab as the measured first try; a batched design that wins must make the products dense over a
group's columns and keep the epilogue to the eligible (ad, request) pairs.

The kernel shipped when it was written (`gpu/kernels/score_mma.py`, v8) ran grid (blocks, requests):
each request walks its own eligible ads, so a batch of R requests read an ad's row from device memory
once per request that can see it (in a generated corpus 42% of 32-slot tiles hold an ad eligible for
a request at a 6% share; v11, v14, v17 and v19 (shipped), since, run the same walk on grid (requests, blocks), so those
reads after the first come from L2). Here a
block takes a slot range and a group of up to RG requests and reads every tile of the range once:

* Grid (groups, NB): blockIdx.x is the request group (fastest, so the groups of one slot range are
  launched side by side and, for a batch of more than one group, read the range's bytes through L2
  after the first group's read from device memory), blockIdx.y the range of `chunks` chunks
  (4096 slots by default: the shipped kernels' output granularity, so the candidates have the same
  shape, R x ceil(S / 4096) x cap, and the final top-K reads them unchanged).
* A round is one chunk (format-uniform); warp w takes tile w of it. The warp ORs the tile's
  eligibility words of the group's requests; a tile nobody can see is skipped without a load.
  Otherwise it loads the tile's A words (both m16 tiles of the 32 slots, 16-byte loads, the 'tiles'
  layout, exactly as the shipped kernel's full walk) into registers once, then for each request of
  the group whose word is nonzero: that request's B fragments of the chunk's format (`prep_tables`'
  fp16 hi/lo tables, read through L1/L2: the 8 warps of a round share them), the same mma products
  (exact: hi x hi + hi x lo, + lo x hi at fp32) and the same epilogue as the shipped kernel
  (`score_mma._products` and `score_mma._epilogue`, imported, not copied), so each ad's score is the
  shipped kernel's bit for bit. The warp appends its eligible ads' (key, block offset) pairs to the
  request's list in shared memory (one shared atomic a warp).
* Lists: LIST_ENTRIES pairs a block, split evenly among the group's requests (stride = entries /
  rg). After a round a request whose list could overflow in the next one (more than stride -
  ROUND_SLOTS entries) is pruned: its top `cap` are selected into its own output block (device memory
  the block itself owns, its L1/L2 copy) and read back as the list's first `cap` entries. At the end
  each request's list is selected once into its output block, padded with key 0 as every kernel's.
  Exact float ties at a cut are kept in arrival order, as the shipped block top-K keeps them (DESIGN
  section 4); the final top-K orders ties by ad id. Who selects (`select`): "block", the shipped
  block top-K (`block_topk`'s template with one shared histogram instead of eight, for lists of a few
  hundred keys), one request after another; or "warp", `warp_topk_emit_list` below, the same radix
  select by one warp with warp barriers only, 8 requests at once. A batch of R requests over S slots
  runs R * S / 4096 selections, four times the shipped wide walk's, so their cost matters; the warp
  form costs registers (ptxas for sm_90 at fp16: 160, or 284 bytes of spills held to 128, against 138
  and 16 for the block form), which is why both are kept until the probe has timed them on a device.
* Group size: rg = the largest that gives every request room for cap + ROUND_SLOTS entries, at most
  RG_MAX (16; k = 100 fits 16), the batch split into balanced groups. k up to MAX_K = 4096 still fits
  one request a group. Shared memory: the lists 48 KiB, the accumulators 17 KiB, the histograms 8 KiB.

Kernel arguments: the shipped tensor-core kernel's (`score_mma` docstring: emb, scale, chunk_format,
elig, tabs, frag, fscale, cap, out_key, out_slot) plus `rg` (int32, requests a group) after `cap`.

Under the CUDA simulator the tensor-core and warp operations synchronize the whole block
(`gpu.kernels.mma`, `gpu.kernels.warp`), so there the two skips (a tile nobody in the group sees, a
request that sees nothing of the tile) are taken by the block together: the OR of the warps' words.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from andromeda_nb.jitcache import generated_function
from andromeda_nb.slots import CHUNK_SLOTS
from andromeda_nb.versions import Version, version_table

from .. import runtime
from ..graphs import Launch, run_plan
from andromeda_nb.templates import specialize

from ..kernels import block_topk, score_mma
from ..kernels.block_topk import HIST_BINS, HIST_COPIES, STATE_WORDS, slot_listed
from ..kernels.radix import radix_select_row
from ..kernels.tiles import QUAD_WORDS, words_per_ad
from ..kernels.warp import sync_warp

cuda = runtime.cuda()
from numba import int32, uint32  # noqa: E402  (after the device choice)

THREADS = score_mma.THREADS  # 8 warps: one 32-slot tile of a chunk each
WARPS = THREADS // 32
CHUNKS = 16  # chunks a block (4096 slots): the shipped kernels' output block
ROUND_SLOTS = WARPS * 32  # slots a round adds at most to a request's list (one chunk)
LIST_ENTRIES = 6144  # (key, offset) pairs a block holds, over the group's requests
RG_MAX = 16  # requests a group at most
TILE_WORDS = score_mma.TILE_WORDS
SELECTS = ("warp", "block")
# the block-wide selection of a list of a few hundred keys, with one shared histogram instead of the
# shipped block top-K's eight (8 times fewer words to clear and sum each round; a short list's atomics
# rarely collide): the shipped template, its free name rebound
block_topk_emit_list1 = cuda.jit(device=True)(specialize(block_topk._block_topk_emit_template,
                                                         "block_topk_emit_list1", slot_at=slot_listed, HIST_COPIES=1,
                                                         select_row=radix_select_row))
assert HIST_COPIES * HIST_BINS >= WARPS * 256  # the warp selection takes 256 histogram words a warp
WARP_STATE = 4  # shared words of a warp's selection: the k-th key, keys still wanted, two emission counters


@cuda.jit(device=True)
def warp_topk_emit_list(keys, offs, base, n, cap, hist, part, st, active, out_key, out_slot, r, b, first_slot):
    """One warp's top-K of a list: the `cap` largest of the nonzero keys[base:base + n] (entry i is slot
    first_slot + offs[base + i]) into out_key[r, b, :cap] / out_slot[r, b, :cap], padded with key 0 and
    slot -1; exact ties at the cut kept in arrival order, as `block_topk.block_topk_emit_list` keeps
    them. The same 4-round radix select on 8-bit digits as `gpu.kernels.radix`, with the warp's own
    part of the block's shared scratch (`hist` uint32[WARPS * 256], `part` uint32[WARPS * 32], `st`
    uint32[WARPS * WARP_STATE]; indexed, not sliced, so that no view of them is hoisted into the
    scoring loop's registers) and warp barriers only, so the 8 warps of a block select for 8
    requests at once. Every lane calls it, the same number of barriers whatever the data (the
    simulator's warp barrier is the block's); `active` False writes nothing (a call that only keeps
    the simulator's barriers in step)."""
    lane = cuda.threadIdx.x & 31
    warp = cuda.threadIdx.x >> 5
    h0 = warp * 256
    p0 = warp * 32
    s0 = warp * WARP_STATE
    prefix = uint32(0)
    mask = uint32(0)
    krem = uint32(cap)
    emit_all = n <= cap
    for rnd in range(4):
        shift = uint32(24 - 8 * rnd)
        for d in range(lane, 256, 32):
            hist[h0 + d] = uint32(0)
        sync_warp()
        if not emit_all:
            for i in range(lane, n, 32):
                key = keys[base + i]
                if (key & mask) == prefix:
                    cuda.atomic.add(hist, h0 + int32((key >> shift) & uint32(255)), uint32(1))
        sync_warp()
        mine = uint32(0)  # lane l holds digits 8l .. 8l + 7
        for d in range(8 * lane, 8 * lane + 8):
            mine += hist[h0 + d]
        part[p0 + lane] = mine
        sync_warp()
        above = uint32(0)  # keys of the prefix with a higher digit than the lane's
        for j in range(lane + 1, 32):
            above += part[p0 + j]
        if not emit_all and above < krem and krem <= above + mine:  # the k-th key's digit is the lane's
            d = 8 * lane + 7
            while above + hist[h0 + d] < krem:
                above += hist[h0 + d]
                d -= 1
            st[s0] = prefix | (uint32(d) << shift)
            st[s0 + 1] = krem - above
        sync_warp()
        if not emit_all:
            prefix = st[s0]
            krem = st[s0 + 1]
            mask |= uint32(255) << shift
        sync_warp()
    if lane == 0:
        st[s0 + 2] = uint32(0)
        st[s0 + 3] = uint32(0)
    sync_warp()
    if active:
        n_greater = uint32(cap) - krem
        for i in range(lane, n, 32):
            key = keys[base + i]
            if emit_all or key > prefix:
                p = cuda.atomic.add(st, s0 + 2, uint32(1))
                out_key[r, b, p] = key
                out_slot[r, b, p] = first_slot + offs[base + i]
            elif key == prefix:
                p = cuda.atomic.add(st, s0 + 3, uint32(1))
                if p < krem:
                    out_key[r, b, n_greater + p] = key
                    out_slot[r, b, n_greater + p] = first_slot + offs[base + i]
        count = n if emit_all else cap
        for j in range(count + lane, cap, 32):
            out_key[r, b, j] = uint32(0)
            out_slot[r, b, j] = -1
    sync_warp()


@dataclass(frozen=True)
class BatchedSpec:
    precision: str
    dim: int
    experts: int
    top_e: int
    mode: str = "exact"
    chunks: int = CHUNKS  # chunks a block: the output block is the block's slot range
    list_entries: int = LIST_ENTRIES
    rg_max: int = RG_MAX
    max_registers: int | None = None
    select: str = "block"  # who selects a request's list: the block, or one warp ("warp", 8 requests at once)

    @property
    def ads_per_block(self) -> int:
        return self.chunks * CHUNK_SLOTS

    def mma_spec(self) -> score_mma.MmaSpec:
        """The shipped kernel's spec of the same shape (its product and epilogue generators)."""
        return score_mma.MmaSpec(self.precision, self.dim, self.experts, self.top_e, self.mode)


_SKELETON = """
def {name}(emb, scale, chunk_format, elig, tabs, frag, fscale, cap, rg, out_key, out_slot):
    hist = cuda.shared.array({hist_n}, uint32)
    part = cuda.shared.array(16, uint32)
    state = cuda.shared.array({state_n}, uint32)
    acc = cuda.shared.array(({warps}, 32, {acc_stride}), float32)
    lkey = cuda.shared.array({list_n}, uint32)
    loff = cuda.shared.array({list_n}, int32)
    cnt = cuda.shared.array({rg_max}, uint32)
    wb = cuda.shared.array({warps}, uint32)
    wpart = cuda.shared.array({warps} * 32, uint32)
    wst = cuda.shared.array({warps} * {warp_state}, uint32)
{sim_shared}
    tid = cuda.threadIdx.x
    warp = tid >> 5
    lane = tid & 31
    g = lane >> 2
    q = lane & 3
    grp = cuda.blockIdx.x
    b = cuda.blockIdx.y
    n_chunks = chunk_format.shape[0]
    n_f = tabs.shape[1]
    r0 = grp * rg
    nr = min(rg, elig.shape[0] - r0)
    stride = {list_n} // rg
    limit = stride - {round_slots}
    c0 = b * {cpb}
    slot0 = c0 * {chunk}
    if tid < {rg_max}:
        cnt[tid] = uint32(0)
    cuda.syncthreads()
    for cl in range({cpb}):
        c = c0 + cl
        if c < n_chunks:
            f = chunk_format[c]
            tile = c * {warps} + warp
            tbase = tile * {tile_words}
            seen = uint32(0)
            for j in range(nr):
                seen |= elig[r0 + j, tile]
{uniform_seen}
            if seen != uint32(0):
{load_a}
                for j in range(nr):
                    r = r0 + j
                    ew = elig[r, tile]
{uniform_ew}
                    if run != uint32(0):
{load_b}
{products}
                        sync_warp()
                        key = uint32(0)
{epilogue}
                        if lane == 0:
                            wb[warp] = cuda.atomic.add(cnt, j, uint32(cuda.popc(ew)))
                        sync_warp()
                        if (ew >> uint32(lane)) & uint32(1):
                            below = ew & ((uint32(1) << uint32(lane)) - uint32(1))
                            p = j * stride + int32(wb[warp]) + int32(cuda.popc(below))
                            lkey[p] = key
                            loff[p] = s - slot0
                        sync_warp()
        cuda.syncthreads()
{prune}
{final}
"""


def _indent(lines, n):
    pad = " " * n
    return "\n".join(pad + ln if ln else ln for ln in lines)


def _uniform(var: str, out: str) -> list[str]:
    """Lines making `out` from the warp's `var`: itself on the GPU; under the simulator the OR over the
    block's warps (its warp operations are block barriers: every warp must take the same branch)."""
    if not runtime.simulator_enabled():
        return [f"{out} = {var}"]
    return [f"anyw[warp] = {var}", "cuda.syncthreads()", f"{out} = uint32(0)",
            f"for w in range({WARPS}):", f"    {out} |= anyw[w]", "cuda.syncthreads()"]


_PRUNE_BLOCK = """for j in range(nr):
    n = int32(cnt[j])
    if n > limit:  # the next round could overflow: keep the best cap (through the output block)
        block_topk_emit_list1(lkey[j * stride:], loff[j * stride:], n, cap, hist, part, state, out_key,
                              out_slot, r0 + j, b, slot0)
        cuda.syncthreads()
        for i in range(tid, cap, {threads}):
            lkey[j * stride + i] = out_key[r0 + j, b, i]
            loff[j * stride + i] = out_slot[r0 + j, b, i] - slot0
        if tid == 0:
            cnt[j] = uint32(cap)
        cuda.syncthreads()"""

_FINAL_BLOCK = """for j in range(nr):
    block_topk_emit_list1(lkey[j * stride:], loff[j * stride:], int32(cnt[j]), cap, hist, part, state, out_key,
                          out_slot, r0 + j, b, slot0)
    cuda.syncthreads()"""

# warp w selects for requests w, w + 8, ...; `act` and `n` say whether and how much (the simulator calls
# every warp's selection the same number of times, with nothing to write where there is nothing to do)
_PRUNE_WARP = """for jj in range((nr + {warps_m1}) // {warps}):
    j = jj * {warps} + warp
    n = int32(cnt[j]) if j < nr else 0
    act = n > limit
{guard}
        warp_topk_emit_list(lkey, loff, j * stride, n if act else 0, cap, hist, wpart, wst, act, out_key,
                            out_slot, r0 + j, b, slot0)
        if act:
            for i in range(lane, cap, 32):
                lkey[j * stride + i] = out_key[r0 + j, b, i]
                loff[j * stride + i] = out_slot[r0 + j, b, i] - slot0
            if lane == 0:
                cnt[j] = uint32(cap)
cuda.syncthreads()"""

_FINAL_WARP = """for jj in range((nr + {warps_m1}) // {warps}):
    j = jj * {warps} + warp
    act = j < nr
    n = int32(cnt[j]) if act else 0
    warp_topk_emit_list(lkey, loff, j * stride, n, cap, hist, wpart, wst, act, out_key, out_slot, r0 + j, b, slot0)"""


def _selection(spec: BatchedSpec) -> tuple[str, str]:
    """The prune after a round and the final selection, by the block or by one warp a request."""
    if spec.select == "block":
        return _indent(_PRUNE_BLOCK.format(threads=THREADS).splitlines(), 8), \
            _indent(_FINAL_BLOCK.splitlines(), 4)
    guard = "    if True:" if runtime.simulator_enabled() else "    if act:"
    fmt = dict(warps=WARPS, warps_m1=WARPS - 1, warp_state=WARP_STATE, guard=guard)
    return _indent(_PRUNE_WARP.format(**fmt).splitlines(), 8), _indent(_FINAL_WARP.format(**fmt).splitlines(), 4)


def _loads_and_products(spec: BatchedSpec) -> tuple[list[str], list[str]]:
    """The shipped full walk's lines for one 32-slot tile, split where the products start: the A loads
    (once a tile) and the products into `acc` (once a request)."""
    lines = score_mma._products(spec.mma_spec())
    first = lines.index("c0_0 = float32(0.0)")
    loads, products = lines[:first], lines[first:]
    assert all("mma_f16" not in ln for ln in loads) and any("load_u32x4(emb" in ln for ln in loads)
    assert all("load_u32x4(emb" not in ln for ln in products)
    return loads, products


def _load_b(spec: BatchedSpec) -> list[str]:
    """Request r's B fragments of format f, its table's inverse scale and its biases (as the shipped
    kernel loads them when a chunk's format changes)."""
    E, D = spec.experts, spec.dim
    G = score_mma.groups(D, E)
    lines = [f"fb = ((r * n_f + f) * {G}) * 128 + lane * 4"]
    lines += [f"bf{j}_0, bf{j}_1, bf{j}_2, bf{j}_3 = load_u32x4(frag, fb + {j * 128})" for j in range(G)]
    lines.append("inv = fscale[r, f]")
    qb0 = 2 * E * D
    lines += [f"qb{e} = tabs[r, f, {qb0 + e}]" for e in range(E)]
    lines += [f"ub{e} = tabs[r, f, {qb0 + E + e}]" for e in range(E)]
    return lines


def _name(spec: BatchedSpec) -> str:
    regs = f"_r{spec.max_registers}" if spec.max_registers else ""
    shape = "" if (spec.chunks, spec.list_entries, spec.rg_max) == (CHUNKS, LIST_ENTRIES, RG_MAX) else \
        f"_c{spec.chunks}_l{spec.list_entries}_g{spec.rg_max}"
    select = "" if spec.select == "block" else f"_{spec.select}sel"
    return f"score_batched_{spec.precision}_d{spec.dim}_e{spec.experts}_k{spec.top_e}_{spec.mode}{regs}{shape}{select}"


def kernel_source(spec: BatchedSpec) -> str:
    name = _name(spec)
    loads, products = _loads_and_products(spec)
    sim = runtime.simulator_enabled()
    prune, final = _selection(spec)
    NG = score_mma.n_gate_tiles(spec.experts)
    V = words_per_ad(spec.precision, spec.dim) // QUAD_WORDS
    return _SKELETON.format(
        name=name, hist_n=HIST_COPIES * HIST_BINS, state_n=STATE_WORDS, warps=WARPS, acc_stride=8 * 2 * NG + 1,
        list_n=spec.list_entries, rg_max=spec.rg_max, round_slots=ROUND_SLOTS, cpb=spec.chunks, chunk=CHUNK_SLOTS,
        threads=THREADS, tile_words=V * TILE_WORDS, warp_state=WARP_STATE, prune=prune, final=final,
        sim_shared=_indent([f"anyw = cuda.shared.array({WARPS}, uint32)"] if sim else [], 4),
        uniform_seen=_indent(_uniform("seen", "seen"), 12), uniform_ew=_indent(_uniform("ew", "run"), 20),
        load_a=_indent(loads, 16), load_b=_indent(_load_b(spec), 24), products=_indent(products, 24),
        epilogue=_indent(score_mma._epilogue(spec.mma_spec()), 24))


def _namespace() -> dict:
    """The names the generated code calls: the shipped tensor-core kernel's (the same functions)."""
    return {**score_mma._namespace(), "warp_topk_emit_list": warp_topk_emit_list,
            "block_topk_emit_list1": block_topk_emit_list1}


def python_function(spec: BatchedSpec):
    """The generated kernel as a plain Python function (before `cuda.jit`)."""
    fn, _ = generated_function(_name(spec), kernel_source(spec), _namespace(),
                               cache=not runtime.simulator_enabled())
    return fn


def group_size(spec: BatchedSpec, n_requests: int, cap: int) -> int:
    """Requests a group: as many as the lists give room for cap + ROUND_SLOTS entries each (at most
    rg_max), the batch then split into balanced groups (20 requests at 16 a group: two of 10)."""
    most = min(spec.rg_max, spec.list_entries // (cap + ROUND_SLOTS))
    if most < 1:
        raise ValueError(f"cap {cap} leaves no room in {spec.list_entries} list entries for a round of "
                         f"{ROUND_SLOTS} slots")
    n = max(1, n_requests)
    groups = -(-n // most)
    return -(-n // groups)


class BatchedScoreKernel:
    """`score.ScoreKernel`'s interface (`FusedScorer` runs it as any scoring version): `plan` and `launch`
    prepare the batch's B fragments (the shipped kernel's preparation, one small launch) and run the
    batched kernel, grid (groups, blocks)."""

    layout = "tiles"
    threads = THREADS

    def __init__(self, spec: BatchedSpec):
        if spec.select not in SELECTS:
            raise ValueError(f"unknown selection {spec.select!r}; choose from {', '.join(SELECTS)}")
        if spec.mode not in score_mma.MODES:
            raise ValueError(f"unknown tensor-core mode {spec.mode!r}; choose from {', '.join(score_mma.MODES)}")
        if not score_mma.supports("moe", spec.precision, spec.dim, spec.experts):
            raise ValueError(f"the tensor-core scorer does not serve {spec.precision} at D = {spec.dim}, "
                             f"E = {spec.experts}")
        self.spec = spec
        self.ads_per_block = spec.ads_per_block
        limited = spec.max_registers is not None and not runtime.simulator_enabled()
        options = {"max_registers": spec.max_registers} if limited else {}
        self.kernel = cuda.jit(python_function(spec), cache=not runtime.simulator_enabled(), **options)
        # the B fragments come from the shipped kernel's preparation (and its kept buffers)
        self.tables = score_mma.get_mma_kernel(spec.precision, spec.dim, spec.experts, spec.top_e, spec.mode)

    def group_size(self, n_requests: int, cap: int) -> int:
        return group_size(self.spec, n_requests, cap)

    def grid(self, n_slots: int, n_requests: int, cap: int) -> tuple[int, int]:
        rg = self.group_size(n_requests, cap)
        return (-(-max(1, n_requests) // rg), -(-n_slots // self.ads_per_block))

    def prepare_plan(self, tabs):
        return self.tables.prepare_plan(tabs)

    def plan(self, emb, scale, chunk_format, elig, tabs, cap, out_key, out_slot) -> list:
        """Table preparation and scoring as a `gpu.graphs` plan (`tabs` on the device)."""
        steps, frag, fscale = self.prepare_plan(tabs)
        R = elig.shape[0]
        n_slots = chunk_format.shape[0] * CHUNK_SLOTS
        rg = self.group_size(R, int(cap))
        return steps + [Launch(self.kernel, self.grid(n_slots, R, int(cap)), THREADS,
                               (emb, scale, chunk_format, elig, tabs, frag, fscale, np.int32(cap), np.int32(rg),
                                out_key, out_slot))]

    def launch(self, emb, scale, chunk_format, elig, tabs, cap, out_key, out_slot, stream=0):
        if isinstance(tabs, np.ndarray):
            tabs = cuda.to_device(np.ascontiguousarray(tabs, np.float32))
        run_plan(self.plan(emb, scale, chunk_format, elig, tabs, cap, out_key, out_slot), stream)


@lru_cache(maxsize=None)
def get_batched_kernel(precision: str, dim: int, experts: int, top_e: int, mode: str = "exact", **shape) -> \
        BatchedScoreKernel:
    """The compiled batched kernel of one shape; `shape`: BatchedSpec's chunks, list_entries, rg_max,
    max_registers (the tests use small ones)."""
    return BatchedScoreKernel(BatchedSpec(precision, dim, experts, top_e, mode, **shape))


@dataclass(frozen=True)
class BatchedRecipe:
    """The batched kernel as a version of the scoring family (`gpu.kernels.score`'s recipes): the
    'tiles' layout, MoE only. `register_limits`: (precision, max_registers) pairs, the rest unlimited.
    fp16 is held to 128: the compiler takes 138 there (ptxas for sm_90, the block selection, no
    spills), room for one 256-thread block an SM; 128 (16 bytes of spills) gives two, of the three
    that the 73 KiB of shared memory a block allows. int8 takes 98 unlimited (two blocks an SM) and
    spills 20 bytes when held to 128, so it is not held. To be measured: scripts/probe_score_batched.py
    times both limits."""

    register_limits: tuple = (("fp16", 128),)
    layout: str = "tiles"

    def build(self, spec):
        if spec.kind != "moe":
            raise ValueError(f"the batched tensor-core scorer serves the MoE only, not {spec.kind!r}")
        return get_batched_kernel(spec.precision, spec.dim, spec.experts, spec.top_e,
                                  max_registers=dict(self.register_limits).get(spec.precision))


VERSIONS = version_table(
    Version(9, "v9 batched", "the tensor-core kernel over a group of up to 16 requests a block: each tile's "
            "A words loaded once for the group, then each request that sees the tile scored from them; "
            "per-request lists of eligible keys, selected into the shipped output blocks of 4096 slots; "
            "128 registers at fp16",
            BatchedRecipe()),
)
BATCHED = VERSIONS[9]

__all__ = ["BATCHED", "BatchedRecipe", "BatchedScoreKernel", "BatchedSpec", "VERSIONS", "get_batched_kernel",
           "group_size", "kernel_source", "python_function"]
