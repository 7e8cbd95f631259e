"""Targeting match kernel, as shipped: DESIGN section 2 evaluated for every ad slot of the pool, on the device.

The index (`gpu.index.GpuTargetingIndex`) runs `SHIPPED` (v8), on a GPU and under the CUDA simulator
alike (there its warp shuffles are emulated by `gpu.kernels.warp`); v7 is kept beside it as
`SIMULATOR_FALLBACK` for versions marked GPU only:

    v7 circle table  one thread per slot serves a group of up to 64 requests in one pass over the
                  per-ad columns: bit r of a 64-bit mask is request r of the group. Residual rules
                  (age, gender, placements) are six lookups in per-group tables held in shared memory;
                  a clause is the OR of per-term request masks (`rtab`), its term loop issues four
                  independent table loads before it tests whether the answer is known; custom
                  locations are decided on the host (`gpu.index.CircleLookup`, compiled, the float64
                  great-circle distance every index uses) and read from the circle table `ctab`, OR-ed
                  like terms, so the kernel has no float64 arithmetic, no trigonometry and no local
                  memory. The 32x32 bit matrices (slots x requests) of a warp are transposed in shared
                  memory, so each output word is written once, with no atomics.
    v8 table+shfl v7 with the transpose done by warp shuffles (`shfl_xor_sync`) instead of shared
                  memory and barriers.

Why v8 ships: on one H200 (docs/GPU_INDEX.md, docs/BENCHMARKS.md), 266 G pool ads/s
at 10M ads (batch 64) and 340 G at 100M (batch 256), against 69.8 G and 77.7 G for v6, the version
shipped before it, with the same answer bits at full size and the oracle's answers; the float64
great-circle test of v6 had cost it 64 registers and 48 bytes of local memory per thread. What v8
moves to the host (the circle table, with the rest of a batch's preparation) is compiled and
overlaps the previous batch's kernels (gpu/index.py).

Both come from `batched_kernel`, the one generator of the batched kernels, parameterised by the request
group (its width, how it reaches shared memory, how a slot is evaluated and where custom locations
come from), the transpose and a register cap. The versions before them (v1 naive, v2/v3 with
32-request groups, v4/v5/v6 with the great-circle test on the device) are in the kernel lab,
`gpu/lab/match.py`, which builds them from the same generator; `andromeda bench match` times every
one and the tests check every one.

Kernels: `match_v7`, `match_v8`, `compact_programs`, `scatter_slots`.
Launchers: `launch(version, index_arrays, request_arrays, out, stream)`, `launch_compact(...)`,
`launch_scatter(...)`.

Per-slot columns (capacity = number of slots, a multiple of 32; CHUNK_SLOTS in production):
    resid      uint32[capacity]  packed residual word: bits 0-6 age_min, 7-13 age_max (127 = no
                                 upper bound), 14-16 gender mask, 17-20 publisher mask, 21-23 device
                                 mask, 24-29 os mask, 30 ACTIVE, 31 HAS_SCHEDULE; 0 for an empty slot
    prog_ptr   int64[capacity]   offset of the slot's clause program in `prog`
    sched      int64[capacity, 2] start_time, end_time (NULL_START / NULL_END when open); read only
                                 when HAS_SCHEDULE is set
Shared by all slots:
    prog       uint32[P]         clause programs (format below)
    circles    float64[Q, 3]     custom locations: latitude, longitude (degrees), radius (km)
Per block of SUMMARY_SLOTS slots (the batched kernels):
    summary    uint64[ceil(capacity / SUMMARY_SLOTS)]  the OR of its ads' geographic masks
                                 (`andromeda_nb.geo_layout`: a geo clause's bits, every bit for an ad
                                 without one); 0 when it holds no ad. Any superset would be exact;
                                 the index makes it again from its ads after every update call.

Clause program of one ad: word 0 = number of clauses; then per clause a header word
`n_terms | CIRCLES_BIT (if it has custom locations) | NEGATIVE_BIT (the one negative clause)`, two
words `circle_start, n_circles` when CIRCLES_BIT is set, then `n_terms` dense term ids (uint32 indices
into the index's term vocabulary; user terms outside the vocabulary can match no ad and are dropped).
Positive clauses come first (geo, locales, flexible_spec objects, custom audiences; compiled order).

Per-request inputs, batched kernels (G groups of up to R = the version's group requests, 32 or 64;
request r of the call is bit r % R of group r // R; masks are uint32 for R = 32, uint64 for 64):
    rtab       uint[G, V]        bit b of rtab[g, t] = request R g + b holds dense term t
    ftab       uint[G, FTAB_WORDS] request masks per residual value (offsets *_OFF below): e.g.
                                 ftab[g, AMIN_OFF + a] = requests of the group with age >= a
    rtime      int64[G, R]       request times (unused lanes: 0)
    rpos       float64[G, R, 2]  user latitude, longitude (NaN: no known location)
    ctab       uint64[G, Q']     versions reading the host's circle table (v7, v8, shipped) take it in
                                 place of `circles`: bit b of ctab[g, q] = request R g + b is inside
                                 custom location q (Q' = max(1, Q)); they leave rpos unread (the
                                 lab's v2 to v6 read rpos and `circles` instead)
    (rtab and ctab are kept on the device, zero between batches: a batch sends its nonzero words as
    ridx/rbits and cidx/cbits with their counts, `set_table_bits` ORs them in before the match and
    `clear_table_bits` zeroes them after it; `table_steps`)
    nreq       int32[G]          requests in the group (1..R)
    gmask      uint64[G]         the OR of the group's geographic masks (the bits of the geo terms its
                                 requests hold that some ad uses; never 0, since every ad without a
                                 geo clause must meet it): a block with summary & gmask == 0 is skipped
Per-request inputs, the lab's v1:
    rscal      int64[B, 6]       age, gender, publisher, device, os, time
    rpos1      float64[B, 2]     latitude, longitude
    rterm_ptr  int64[B + 1]      request b holds dense terms rterms[rterm_ptr[b]:rterm_ptr[b+1]], sorted
    rterms     uint32[T]
Output: out uint32[B, capacity // 32], bit s % 32 of out[b, s // 32] = slot s eligible for request b
(the layout documented in gpu/index.py). The batched kernels write every word of the rows they serve
(v1 ORs into it; its launcher zeroes it first).
"""

from __future__ import annotations

from dataclasses import dataclass

from andromeda_nb.templates import specialize
from andromeda_nb.versions import Version, pick, version_table

from .. import runtime
from ..graphs import Launch, run_plan

cuda = runtime.cuda()
from numba import float64, int32, int64, uint32, uint64  # noqa: E402  (after the simulator choice)

from . import warp  # noqa: E402

# --- launch configuration ----------------------------------------------------------------------------
THREADS_PER_BLOCK = 256  # = slots.CHUNK_SLOTS: one block covers one chunk, so one format
SUMMARY_SLOTS = THREADS_PER_BLOCK  # slots per entry of the geographic summary: one block's
WIDE_GROUP = 64  # requests per group of the shipped kernels (bits of a 64-bit mask)
TERM_UNROLL = 4  # independent table loads per step of the wide term loop

# --- residual word layout ----------------------------------------------------------------------------
AGE_MIN_SHIFT, AGE_MAX_SHIFT = 0, 7
GENDER_SHIFT, PUBLISHER_SHIFT, DEVICE_SHIFT, OS_SHIFT = 14, 17, 21, 24
ACTIVE_BIT = 1 << 30
SCHEDULE_BIT = 1 << 31
AGE_UNBOUNDED = 127

# --- clause program layout ---------------------------------------------------------------------------
NEGATIVE_BIT = 1 << 31
CIRCLES_BIT = 1 << 30
TERM_COUNT_MASK = CIRCLES_BIT - 1

# --- per-group residual tables (ftab) ----------------------------------------------------------------
GENDER_OFF = 0  # 8 entries: gender mask -> requests whose gender bit is set
PUBLISHER_OFF = 8  # 16
DEVICE_OFF = 24  # 8
OS_OFF = 32  # 64
AMIN_OFF = 96  # 128: age_min value -> requests with age >= it
AMAX_OFF = 224  # 128: age_max value -> requests with age <= it (all for AGE_UNBOUNDED)
FTAB_WORDS = 352

FULL_MASK = 0xFFFFFFFF

# --- device functions of the shipped kernels ---------------------------------------------------------
@cuda.jit(device=True, cache=True)
def residual_alive(slot, resid, sched, ft, tm, n):
    """The requests of the group (mask) that pass `slot`'s residual rules: ACTIVE, gender, placements,
    age limits (lookups in the group's tables `ft`) and the schedule (request times `tm`)."""
    w = int64(resid[slot])
    if (w & ACTIVE_BIT) == 0:
        return int64(0)
    alive = int64(ft[GENDER_OFF + ((w >> GENDER_SHIFT) & 7)])
    alive &= int64(ft[PUBLISHER_OFF + ((w >> PUBLISHER_SHIFT) & 15)])
    alive &= int64(ft[DEVICE_OFF + ((w >> DEVICE_SHIFT) & 7)])
    alive &= int64(ft[OS_OFF + ((w >> OS_SHIFT) & 63)])
    alive &= int64(ft[AMIN_OFF + ((w >> AGE_MIN_SHIFT) & 127)])
    alive &= int64(ft[AMAX_OFF + ((w >> AGE_MAX_SHIFT) & 127)])
    if alive != 0 and (w & SCHEDULE_BIT) != 0:
        start = sched[slot, 0]
        end = sched[slot, 1]
        m = int64(0)
        for r in range(n):
            t = tm[r]
            if start <= t and t < end:
                m |= int64(1) << r
        alive &= m
    if alive == 0:
        return alive
    return alive


@cuda.jit(device=True, cache=True)
def _transpose_stage_shared(x, tr, tid, s, m):
    """One butterfly stage of the 32x32 bit transpose through shared memory: lane l swaps the
    off-diagonal s x s blocks with lane l ^ s (m = the columns j with j & s == 0)."""
    tr[tid] = x
    cuda.syncthreads()
    y = int64(tr[tid ^ s])
    cuda.syncthreads()
    if (tid & s) == 0:
        return (x & m) | ((y & m) << s) & FULL_MASK
    return (x & ~m & FULL_MASK) | ((y >> s) & m)


@cuda.jit(device=True, cache=True)
def _transpose_stage_shuffle(x, lane, s, m):
    """The same stage with a warp shuffle."""
    y = int64(warp.shfl_xor_i32(int32(x), s)) & FULL_MASK  # int32: the shuffle's type
    if (lane & s) == 0:
        return (x & m) | ((y & m) << s) & FULL_MASK
    return (x & ~m & FULL_MASK) | ((y >> s) & m)


@cuda.jit(device=True, cache=True)
def clause_terms_wide(prog, q, nt, alive, rtab, g):
    """The requests (64-bit mask) holding one of the clause's `nt` terms prog[q:q+nt], TERM_UNROLL
    independent table loads per test of whether every request still `alive` is already satisfied."""
    sat = int64(0)
    j = int64(0)
    while j + TERM_UNROLL <= nt:
        t0 = prog[q + j]
        t1 = prog[q + j + 1]
        t2 = prog[q + j + 2]
        t3 = prog[q + j + 3]
        sat |= int64(rtab[g, t0]) | int64(rtab[g, t1]) | int64(rtab[g, t2]) | int64(rtab[g, t3])
        j += TERM_UNROLL
        if (sat & alive) == alive:
            break
    if (sat & alive) != alive:
        while j < nt:
            sat |= int64(rtab[g, prog[q + j]])
            j += 1
    return sat


@cuda.jit(device=True, cache=True)
def _transpose_shared(x, tid):
    """The 32x32 bit transpose of a warp's 32-bit masks through shared memory (every thread of the
    block must call it: it has barriers)."""
    tr = cuda.shared.array(THREADS_PER_BLOCK, uint32)
    x = _transpose_stage_shared(x, tr, tid, 16, 0x0000FFFF)
    x = _transpose_stage_shared(x, tr, tid, 8, 0x00FF00FF)
    x = _transpose_stage_shared(x, tr, tid, 4, 0x0F0F0F0F)
    x = _transpose_stage_shared(x, tr, tid, 2, 0x33333333)
    return _transpose_stage_shared(x, tr, tid, 1, 0x55555555)


@cuda.jit(device=True, cache=True)
def _transpose_shuffle(x, tid):
    """The same transpose by warp shuffles (emulated under the simulator: `gpu.kernels.warp`)."""
    lane = tid & 31
    x = _transpose_stage_shuffle(x, lane, 16, 0x0000FFFF)
    x = _transpose_stage_shuffle(x, lane, 8, 0x00FF00FF)
    x = _transpose_stage_shuffle(x, lane, 4, 0x0F0F0F0F)
    x = _transpose_stage_shuffle(x, lane, 2, 0x33333333)
    return _transpose_stage_shuffle(x, lane, 1, 0x55555555)


TRANSPOSES = {"shared": _transpose_shared, "shuffle": _transpose_shuffle}


# --- the batched kernels: one template, one generator ------------------------------------------------
# The template's free names are bound for each version by `batched_kernel` (a copy of this module's
# globals with them set); these placeholders only say what each one is.
group_requests = None  # requests per group: 32 or 64
group_word = None  # numba type of a group mask: uint32 or uint64
group_positions = None  # user positions the group's tables hold: its requests, or 1 when it reads none
load_group = None  # device fn: the group's tables (ftab, rtime, rpos) into shared memory
slot_mask = None  # device fn: the group mask of requests for which a slot is eligible
write_rows = None  # device fn: transpose a warp's masks and write the group's output rows
transpose = None  # device fn: the 32x32 bit transpose write_rows uses


def _batched_template(resid, prog_ptr, prog, sched, places, summary, rtab, ftab, rtime, rpos, nreq, gmask, out):
    """One thread per slot, one group of requests per grid row (blockIdx.y); `places` is the
    custom-location table the group's `slot_mask` reads (circles, or the host's circle table). A block
    whose slots' geographic summary shares no bit with the group's mask (`summary`, `gmask`) holds no
    ad any request of the group can match on geography: it loads no group table, reads no slot and
    writes zero words. The
    bounds guard masks instead of returning, because every thread of the block must reach the
    barriers."""
    first = cuda.blockIdx.x * cuda.blockDim.x
    slot = first + cuda.threadIdx.x
    in_range = slot < resid.shape[0]
    g = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    ft = cuda.shared.array(FTAB_WORDS, group_word)
    tm = cuda.shared.array(group_requests, int64)
    lat = cuda.shared.array(group_positions, float64)
    lon = cuda.shared.array(group_positions, float64)
    n = nreq[g]
    live = (summary[first // SUMMARY_SLOTS] & gmask[g]) != uint64(0)  # unsigned both sides: no float compare
    if live:  # the same for every thread of the block, so its barriers are met by all or by none
        load_group(ftab, rtime, rpos, g, ft, tm, lat, lon, tid)
    x = int64(0)
    if in_range and live:
        x = slot_mask(slot, resid, prog_ptr, prog, sched, places, rtab, g, ft, tm, lat, lon, n)
    write_rows(x, tid, slot, g, n, in_range, out)


def load_group_template(ftab, rtime, rpos, g, ft, tm, lat, lon, tid):
    """The group's residual tables, request times and user positions into shared memory."""
    i = tid
    while i < FTAB_WORDS:
        ft[i] = ftab[g, i]
        i += cuda.blockDim.x
    if tid < group_requests:
        tm[tid] = rtime[g, tid]
        lat[tid] = rpos[g, tid, 0]
        lon[tid] = rpos[g, tid, 1]
    cuda.syncthreads()


def write_rows_wide(x, tid, slot, g, n, in_range, out):
    """A 64-request group: both 32-bit halves of the warp's masks transposed, then one word per
    request of the group and slot word."""
    lo = transpose(x & FULL_MASK, tid)
    hi = transpose((x >> 32) & FULL_MASK, tid)
    lane = tid & 31
    if in_range:
        if lane < n:
            out[g * WIDE_GROUP + lane, slot >> 5] = uint32(lo)
        if lane + 32 < n:
            out[g * WIDE_GROUP + 32 + lane, slot >> 5] = uint32(hi)


@dataclass(frozen=True)
class RequestGroup:
    """How a batched kernel serves one group of requests: its width and mask word, how its tables
    reach shared memory, how a slot's mask is evaluated (and where custom locations come from), and
    how the transposed masks are written."""

    name: str
    requests: int  # 32 or 64
    word: object  # numba type of a mask: uint32 or uint64
    load_group: object  # device function (ftab, rtime, rpos, g, ft, tm, lat, lon, tid)
    slot_mask: object  # device function (slot, resid, prog_ptr, prog, sched, places, rtab, g, ft, tm, lat, lon, n)
    write_rows: object  # plain function (x, tid, slot, g, n, in_range, out), specialized by transpose
    circle_table: bool = False  # `places` is the host's circle table (ctab), not the circles

    @property
    def positions(self) -> int:
        """User positions held in shared memory: none are read with the circle table (one slot kept)."""
        return 1 if self.circle_table else self.requests


def device_function(template, name: str, **bound):
    """`specialize`, compiled as a device function."""
    return cuda.jit(device=True, cache=True)(specialize(template, name, **bound))


@dataclass(frozen=True)
class MatchKernel:
    """A batched match kernel and what its launch needs (the recipe of a match `Version`)."""

    kernel: object  # numba CUDA dispatcher
    group: int  # requests per group
    circle_table: bool  # reads the host's circle table (`ctab`) in place of `circles`

    def plan(self, ix, rq, out) -> list:
        """The launch as a `gpu.graphs` plan (one step)."""
        threads, blocks_x = block_shape(ix[0].shape[0])
        places = rq["ctab"] if self.circle_table else ix[4]
        return [Launch(self.kernel, (blocks_x, rq["nreq"].shape[0]), threads,
                       (*ix[:4], places, ix[5], rq["rtab"], rq["ftab"], rq["rtime"], rq["rpos"], rq["nreq"], rq["gmask"],
                        out))]

    def launch(self, ix, rq, out, stream=0) -> None:
        run_plan(self.plan(ix, rq, out), stream)


def batched_kernel(name: str, group: RequestGroup, transpose_kind: str, max_registers: int | None = None
                   ) -> MatchKernel:
    """The batched match kernel `name` for a request group, a transpose ("shared" or "shuffle") and a
    register cap (ptxas spills what does not fit; ignored under the simulator, which has no
    registers). Every batched version, shipped or in the lab, is made here."""
    write = device_function(group.write_rows, f"{name}_write_rows", transpose=TRANSPOSES[transpose_kind])
    fn = specialize(_batched_template, name, group_requests=group.requests, group_word=group.word,
                    group_positions=group.positions, load_group=group.load_group, slot_mask=group.slot_mask,
                    write_rows=write)
    options = {} if max_registers is None or runtime.simulator_enabled() else {"max_registers": max_registers}
    return MatchKernel(cuda.jit(cache=True, **options)(fn), group.requests, group.circle_table)


# --- the shipped request group: custom locations decided on the host (the circle table) -------------
@cuda.jit(device=True, cache=True)
def _eval_program_ctab(prog, p, alive, rtab, g, ctab):
    """Run one slot's clause program for a group of 64 (`alive` in, surviving requests out), TERM_UNROLL
    independent `rtab` loads per early-exit test; custom locations are read from the circle table:
    ctab[g, q] holds the requests of the group inside circle q (gpu.index.CircleLookup), so a clause's
    circles are OR-ed like its terms and the kernel does no float64 arithmetic and no trigonometry."""
    n_clauses = int64(prog[p])
    q = p + 1
    for _c in range(n_clauses):
        h = int64(prog[q])
        q += 1
        nt = h & TERM_COUNT_MASK
        cs = int64(0)
        nc = int64(0)
        if h & CIRCLES_BIT:
            cs = int64(prog[q])
            nc = int64(prog[q + 1])
            q += 2
        sat = clause_terms_wide(prog, q, nt, alive, rtab, g)
        q += nt
        k = int64(0)
        while k < nc and (sat & alive) != alive:
            sat |= int64(ctab[g, cs + k])
            k += 1
        if h & NEGATIVE_BIT:
            alive &= ~sat
        else:
            alive &= sat
        if alive == 0:
            break
    return alive


@cuda.jit(device=True, cache=True)
def _slot_mask_ctab(slot, resid, prog_ptr, prog, sched, ctab, rtab, g, ft, tm, lat, lon, n):
    """The 64-bit group mask of requests for which `slot` is eligible, custom locations read from the
    circle table (`lat`, `lon` unused: the table holds the answer)."""
    alive = residual_alive(slot, resid, sched, ft, tm, n)
    if alive == 0:
        return alive
    return _eval_program_ctab(prog, prog_ptr[slot], alive, rtab, g, ctab)


@cuda.jit(device=True, cache=True)
def _load_group_ctab(ftab, rtime, rpos, g, ft, tm, lat, lon, tid):
    """The group's residual tables and request times into shared memory (no positions: unused)."""
    i = tid
    while i < FTAB_WORDS:
        ft[i] = ftab[g, i]
        i += cuda.blockDim.x
    if tid < WIDE_GROUP:
        tm[tid] = rtime[g, tid]
    cuda.syncthreads()


CIRCLE_TABLE = RequestGroup("circle table", WIDE_GROUP, uint64, _load_group_ctab, _slot_mask_ctab, write_rows_wide,
                            circle_table=True)

# v8 = the shuffle transpose: no barriers in the transpose (v2 -> v3 and v4 -> v5 measured +20 to +45%);
# v7 = the same group with the shared-memory transpose: the same bits without warp intrinsics
_V7 = batched_kernel("match_v7", CIRCLE_TABLE, "shared")
_V8 = batched_kernel("match_v8", CIRCLE_TABLE, "shuffle")
match_v7, match_v8 = _V7.kernel, _V8.kernel

VERSIONS = version_table(
    Version(7, "v7 circle table", "64-request groups, custom locations decided on the host (the circle table), "
            "shared-memory transpose", _V7),
    Version(8, "v8 table+shfl", "v7 with the warp-shuffle transpose", _V8),
)
SHIPPED = 8  # fastest measured with equal answers (docs/GPU_INDEX.md: 266 G pool ads/s at 10M, v6 69.8 G)
SIMULATOR_FALLBACK = 7  # for a version marked GPU only: the same bits without warp intrinsics


def version(v=None) -> Version:
    """The Version `v` names (a number of `VERSIONS`, a Version from the lab, None: SHIPPED)."""
    return pick(VERSIONS, v, SHIPPED, "match")


# --- maintenance kernels -------------------------------------------------------------------------------
@cuda.jit(cache=True)
def compact_programs(old_prog, old_ptr, lengths, new_ptr, new_prog):
    """Copy every slot's program to its new offset. old_ptr/new_ptr int64[capacity], lengths
    uint32[capacity] (0 for empty slots); one thread per slot."""
    slot = cuda.grid(1)
    if slot >= old_ptr.shape[0]:
        return
    src = old_ptr[slot]
    dst = new_ptr[slot]
    for i in range(int64(lengths[slot])):
        new_prog[dst + i] = old_prog[src + i]


@cuda.jit(cache=True)
def scatter_slots(slots, resid_v, ptr_v, sched_v, resid, prog_ptr, sched):
    """Write the per-slot columns of the updated slots. slots int64[U], resid_v uint32[U],
    ptr_v int64[U], sched_v int64[U, 2]; one thread per updated slot (slots are distinct)."""
    i = cuda.grid(1)
    if i >= slots.shape[0]:
        return
    s = slots[i]
    resid[s] = resid_v[i]
    prog_ptr[s] = ptr_v[i]
    sched[s, 0] = sched_v[i, 0]
    sched[s, 1] = sched_v[i, 1]


@cuda.jit(cache=True)
def set_table_bits(rtab, ridx, rbits, ctab, cidx, cbits, counts):
    """Write a batch's nonzero words into the kept group tables (flat views): rtab[ridx[i]] |= rbits[i]
    for i < counts[0], ctab[cidx[i]] |= cbits[i] for i < counts[1]. Several entries may name one word
    (two requests of a group in one circle), hence the atomic OR; one thread per entry."""
    i = cuda.grid(1)
    if i < counts[0]:
        cuda.atomic.or_(rtab, ridx[i], rbits[i])
    if i < counts[1]:
        cuda.atomic.or_(ctab, cidx[i], cbits[i])


@cuda.jit(cache=True)
def clear_table_bits(rtab, ridx, ctab, cidx, counts):
    """Zero the words `set_table_bits` wrote, after the match has read them: the kept tables are all
    zero between batches."""
    i = cuda.grid(1)
    if i < counts[0]:
        rtab[ridx[i]] = 0
    if i < counts[1]:
        ctab[cidx[i]] = 0


def table_steps(rq) -> tuple[list, list]:
    """(before, after) the match of a batch with sparse group tables (`gpu.index.RequestBatch`): the
    launch that writes its words into the kept tables, and the one that zeroes them again. A batch of
    the per-request form (the lab's v1) has none."""
    if "ridx" not in rq:
        return [], []
    entries = max(rq["ridx"].shape[0], rq["cidx"].shape[0])
    blocks = -(-entries // THREADS_PER_BLOCK)
    flat_r, flat_c = rq["rtab_flat"], rq["ctab_flat"]
    return ([Launch(set_table_bits, (blocks,), THREADS_PER_BLOCK,
                    (flat_r, rq["ridx"], rq["rbits"], flat_c, rq["cidx"], rq["cbits"], rq["counts"]))],
            [Launch(clear_table_bits, (blocks,), THREADS_PER_BLOCK,
                    (flat_r, rq["ridx"], flat_c, rq["cidx"], rq["counts"]))])


# --- launchers ---------------------------------------------------------------------------------------
def plan(version: Version, ix, rq, out) -> list | None:
    """`launch` as a `gpu.graphs` plan: None for a version whose recipe makes none (the lab's v1)."""
    if ix[0].shape[0] == 0 or out.shape[0] == 0:
        return []
    make = getattr(version.recipe, "plan", None)
    return None if make is None else make(ix, rq, out)


def launch(version: Version, ix, rq, out, stream=0) -> None:
    """Run match kernel `version` on index arrays `ix` (resid, prog_ptr, prog, sched, circles, summary) and
    request arrays `rq` (a dict made by gpu.index.RequestBatch) into `out` (uint32[B, capacity // 32]),
    on `stream`. The launch shape depends only on the capacity (`block_shape`) and the number of groups."""
    if ix[0].shape[0] == 0 or out.shape[0] == 0:
        return
    version.recipe.launch(ix, rq, out, stream)


def block_shape(capacity: int) -> tuple[int, int]:
    """(threads per block, blocks) covering `capacity` slots (a multiple of 32): THREADS_PER_BLOCK
    threads, fewer only for pools smaller than one block (tiny test pools under the simulator)."""
    threads = min(THREADS_PER_BLOCK, capacity)
    return threads, -(-capacity // threads)


def launch_compact(old_prog, old_ptr, lengths, new_ptr, new_prog) -> None:
    n = old_ptr.shape[0]
    if n:
        compact_programs[-(-n // THREADS_PER_BLOCK), THREADS_PER_BLOCK](old_prog, old_ptr, lengths, new_ptr, new_prog)


def launch_scatter(slots, resid_v, ptr_v, sched_v, resid, prog_ptr, sched) -> None:
    n = slots.shape[0]
    if n:
        scatter_slots[-(-n // THREADS_PER_BLOCK), THREADS_PER_BLOCK](slots, resid_v, ptr_v, sched_v, resid, prog_ptr, sched)




def kernel_signatures():
    """(name, python function, argument types) of every kernel here, for compiling with compile_ptx."""
    from numba import types as T

    ix = index_signature()
    table = ix[:4] + (T.uint64[:, ::1], T.uint64[::1], T.uint64[:, ::1], T.uint64[:, ::1], T.int64[:, ::1],
                      T.float64[:, :, ::1], T.int32[::1], T.uint64[::1], T.uint32[:, ::1])
    u32, i64 = T.uint32, T.int64
    return [
        ("match_v7", match_v7.py_func, table),
        ("match_v8", match_v8.py_func, table),
        ("compact_programs", compact_programs.py_func, (u32[::1], i64[::1], u32[::1], i64[::1], u32[::1])),
        *[(f"set_table_bits_{w}", set_table_bits.py_func, (w[::1], i64[::1], w[::1], T.uint64[::1], i64[::1],
                                                           T.uint64[::1], T.int32[::1])) for w in (u32, T.uint64)],
        *[(f"clear_table_bits_{w}", clear_table_bits.py_func, (w[::1], i64[::1], T.uint64[::1], i64[::1],
                                                               T.int32[::1])) for w in (u32, T.uint64)],
        ("scatter_slots", scatter_slots.py_func, (i64[::1], u32[::1], i64[::1], i64[:, ::1], u32[::1], i64[::1],
                                                  i64[:, ::1])),
    ]


def index_signature() -> tuple:
    """Argument types of the index arrays (resid, prog_ptr, prog, sched, circles); the batched kernels
    take the geographic summary (uint64[::1]) after them."""
    from numba import types as T

    return (T.uint32[::1], T.int64[::1], T.uint32[::1], T.int64[:, ::1], T.float64[:, ::1])
