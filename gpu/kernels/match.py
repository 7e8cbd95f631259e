"""Targeting match kernels: DESIGN section 2 evaluated for every ad slot of the pool, on the device.

Versions (`VERSIONS` below; `andromeda bench match` times every one, the index ships `BEST`):
    v1 naive      one thread per (slot, request); the user's terms are found by binary search in the
                  request's sorted term list; each eligible bit is set with an atomic OR.
    v2 batched    one thread per slot serves a group of up to 32 requests in one pass over the per-ad
                  columns: bit r of a 32-bit mask is request r of the group. Residual rules (age,
                  gender, placements) are six lookups in per-group tables held in shared memory; a
                  clause is the OR of per-term request masks (`rtab`), and the clause loops stop as soon
                  as the answer is known. The 32x32 bit matrix (slots x requests) of a warp is
                  transposed in shared memory, so each output word is written once, with no atomics.
    v3 shuffled   v2 with the transpose done by warp shuffles (`shfl_xor_sync`) instead of shared
                  memory and barriers. GPU only: the CUDA simulator has no warp intrinsics.
    v4 wide       groups of 64 requests (the masks were 64-bit integers already, so a pass serves
                  twice the requests for the same instructions), and the term loop issues four
                  independent table loads before it tests for an early exit (v2 waited for each
                  load); shared-memory transpose of both 32-bit halves.
    v5 wide+shfl  v4 with the shuffle transpose (GPU only).
    v6 v5, 64 regs the same code compiled with at most 64 registers per thread, for 4 blocks per SM
                  instead of 3 (GPU only).
    v7 circle table  v4 with custom locations decided on the host: `ctab[g, q]` holds the requests of
                  group g inside circle q (float64 great-circle distance, the oracle's function,
                  tested only for circles in a latitude band around each user), OR-ed like terms, so
                  the kernel has no float64 math and no trigonometry.
    v8 table+shfl v7 with the shuffle transpose (GPU only).
Under the simulator the index runs `SIMULATOR_FALLBACK` (v4), which computes the same bits as v5.

Kernels: `match_v1` .. `match_v8`, `compact_programs`, `scatter_slots`.
Launchers: `launch(version, index_arrays, request_arrays, out)`, `launch_compact(...)`,
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

Clause program of one ad: word 0 = number of clauses; then per clause a header word
`n_terms | CIRCLES_BIT (if it has custom locations) | NEGATIVE_BIT (the one negative clause)`, two
words `circle_start, n_circles` when CIRCLES_BIT is set, then `n_terms` dense term ids (uint32 indices
into the index's term vocabulary; user terms outside the vocabulary can match no ad and are dropped).
Positive clauses come first (geo, locales, flexible_spec objects, custom audiences; compiled order).

Per-request inputs, batched kernels (G groups of up to R = GROUP_OF[version] requests, 32 or 64;
request r of the call is bit r % R of group r // R; masks are uint32 for R = 32, uint64 for 64):
    rtab       uint[G, V]        bit b of rtab[g, t] = request R g + b holds dense term t
    ftab       uint[G, FTAB_WORDS] request masks per residual value (offsets *_OFF below): e.g.
                                 ftab[g, AMIN_OFF + a] = requests of the group with age >= a
    rtime      int64[G, R]       request times (unused lanes: 0)
    rpos       float64[G, R, 2]  user latitude, longitude (NaN: no known location)
    ctab       uint64[G, Q']     v7, v8 instead of rpos and circles: bit b of ctab[g, q] = request R g + b
                                 is inside custom location q (Q' = max(1, Q))
    nreq       int32[G]          requests in the group (1..R)
Per-request inputs, v1:
    rscal      int64[B, 6]       age, gender, publisher, device, os, time
    rpos1      float64[B, 2]     latitude, longitude
    rterm_ptr  int64[B + 1]      request b holds dense terms rterms[rterm_ptr[b]:rterm_ptr[b+1]], sorted
    rterms     uint32[T]
Output: out uint32[B, capacity // 32], bit s % 32 of out[b, s // 32] = slot s eligible for request b
(the layout documented in gpu/index.py). v1 ORs into it (the launcher zeroes it first); v2 and v3
write every word of the rows they serve.
"""

from __future__ import annotations

from andromeda_nb.geo import haversine_km

from .. import runtime

cuda = runtime.cuda()
from numba import float64, int32, int64, uint32, uint64  # noqa: E402  (after the simulator choice)

# --- launch configuration ----------------------------------------------------------------------------
THREADS_PER_BLOCK = 256  # = slots.CHUNK_SLOTS: one block covers one chunk, so one format
GROUP_REQUESTS = 32  # requests per group in v2, v3 (bits of a mask word)
WIDE_GROUP = 64  # requests per group in v4, v5
TERM_UNROLL = 4  # independent table loads per step of the v4/v5 term loop

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

haversine_dev = cuda.jit(device=True)(haversine_km)


# --- shared device functions -------------------------------------------------------------------------
@cuda.jit(device=True, cache=True)
def _has_term(rterms, lo, hi, t):
    """Binary search for dense term t in the sorted rterms[lo:hi]."""
    while lo < hi:
        mid = (lo + hi) >> 1
        v = int64(rterms[mid])
        if v == t:
            return True
        if v < t:
            lo = mid + 1
        else:
            hi = mid
    return False


@cuda.jit(device=True, cache=True)
def _circle_mask(circles, cs, nc, lat, lon, need):
    """Requests of `need` (a group mask) whose user lies in one of circles[cs:cs+nc]."""
    hit = int64(0)
    for k in range(nc):
        clat = circles[cs + k, 0]
        clon = circles[cs + k, 1]
        rad = circles[cs + k, 2]
        rest = need & ~hit
        r = 0
        while rest != 0:
            if rest & 1:
                if haversine_dev(lat[r], lon[r], clat, clon) <= rad:
                    hit |= int64(1) << r
            rest >>= 1
            r += 1
    return hit


@cuda.jit(device=True, cache=True)
def _eval_program(prog, p, alive, rtab, g, circles, lat, lon):
    """Run one slot's clause program for a group: `alive` in, surviving requests out."""
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
        sat = int64(0)
        for j in range(nt):
            sat |= int64(rtab[g, prog[q + j]])
            if (sat & alive) == alive:
                break
        q += nt
        need = alive & ~sat
        if need != 0 and nc > 0:
            sat |= _circle_mask(circles, cs, nc, lat, lon, need)
        if h & NEGATIVE_BIT:
            alive &= ~sat
        else:
            alive &= sat
        if alive == 0:
            break
    return alive & FULL_MASK


@cuda.jit(device=True, cache=True)
def _residual_alive(slot, resid, sched, ft, tm, n):
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
def _slot_mask(slot, resid, prog_ptr, prog, sched, circles, rtab, g, ft, tm, lat, lon, n):
    """The group mask of requests for which `slot` is eligible."""
    alive = _residual_alive(slot, resid, sched, ft, tm, n)
    if alive == 0:
        return alive
    return _eval_program(prog, prog_ptr[slot], alive, rtab, g, circles, lat, lon)


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
    y = int64(cuda.shfl_xor_sync(FULL_MASK, int32(x), s)) & FULL_MASK  # int32: the shuffle's type
    if (lane & s) == 0:
        return (x & m) | ((y & m) << s) & FULL_MASK
    return (x & ~m & FULL_MASK) | ((y >> s) & m)


@cuda.jit(device=True, cache=True)
def _load_group(ftab, rtime, rpos, g, ft, tm, lat, lon, tid):
    i = tid
    while i < FTAB_WORDS:
        ft[i] = ftab[g, i]
        i += cuda.blockDim.x
    if tid < GROUP_REQUESTS:
        tm[tid] = rtime[g, tid]
        lat[tid] = rpos[g, tid, 0]
        lon[tid] = rpos[g, tid, 1]
    cuda.syncthreads()


# --- kernels -----------------------------------------------------------------------------------------
@cuda.jit(cache=True)
def match_v1(resid, prog_ptr, prog, sched, circles, rscal, rpos1, rterm_ptr, rterms, out):
    """v1: one thread per (slot, request); grid x over slots, y over requests."""
    slot = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    b = cuda.blockIdx.y
    if slot >= resid.shape[0] or b >= out.shape[0]:
        return
    w = int64(resid[slot])
    if (w & ACTIVE_BIT) == 0:
        return
    age = rscal[b, 0]
    amin = (w >> AGE_MIN_SHIFT) & 127
    amax = (w >> AGE_MAX_SHIFT) & 127
    if age < amin or (amax != AGE_UNBOUNDED and age > amax):
        return
    if ((w >> (GENDER_SHIFT + rscal[b, 1])) & 1) == 0 and ((w >> GENDER_SHIFT) & 7) != 7:
        return
    if ((w >> (PUBLISHER_SHIFT + rscal[b, 2])) & 1) == 0:
        return
    if ((w >> (DEVICE_SHIFT + rscal[b, 3])) & 1) == 0:
        return
    if ((w >> (OS_SHIFT + rscal[b, 4])) & 1) == 0:
        return
    t = rscal[b, 5]
    if (w & SCHEDULE_BIT) != 0 and (t < sched[slot, 0] or t >= sched[slot, 1]):
        return
    lo = rterm_ptr[b]
    hi = rterm_ptr[b + 1]
    lat = rpos1[b, 0]
    lon = rpos1[b, 1]
    p = prog_ptr[slot]
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
        found = False
        for j in range(nt):
            if _has_term(rterms, lo, hi, int64(prog[q + j])):
                found = True
                break
        q += nt
        if not found:
            for k in range(nc):
                if haversine_dev(lat, lon, circles[cs + k, 0], circles[cs + k, 1]) <= circles[cs + k, 2]:
                    found = True
                    break
        if found == ((h & NEGATIVE_BIT) != 0):
            return
    cuda.atomic.or_(out, (b, slot >> 5), uint32(1 << (slot & 31)))


@cuda.jit(cache=True)
def match_v2(resid, prog_ptr, prog, sched, circles, rtab, ftab, rtime, rpos, nreq, out):
    """v2: one thread per slot, one group of <= 32 requests per grid row (blockIdx.y); shared-memory
    transpose. Block size: a multiple of 32, at most THREADS_PER_BLOCK. The bounds guard masks
    instead of returning, because every thread of the block must reach the barriers."""
    slot = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    in_range = slot < resid.shape[0]
    g = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    ft = cuda.shared.array(FTAB_WORDS, uint32)
    tm = cuda.shared.array(GROUP_REQUESTS, int64)
    lat = cuda.shared.array(GROUP_REQUESTS, float64)
    lon = cuda.shared.array(GROUP_REQUESTS, float64)
    tr = cuda.shared.array(THREADS_PER_BLOCK, uint32)
    _load_group(ftab, rtime, rpos, g, ft, tm, lat, lon, tid)
    n = nreq[g]
    x = int64(0)
    if in_range:
        x = _slot_mask(slot, resid, prog_ptr, prog, sched, circles, rtab, g, ft, tm, lat, lon, n)
    x = _transpose_stage_shared(x, tr, tid, 16, 0x0000FFFF)
    x = _transpose_stage_shared(x, tr, tid, 8, 0x00FF00FF)
    x = _transpose_stage_shared(x, tr, tid, 4, 0x0F0F0F0F)
    x = _transpose_stage_shared(x, tr, tid, 2, 0x33333333)
    x = _transpose_stage_shared(x, tr, tid, 1, 0x55555555)
    lane = tid & 31
    if in_range and lane < n:
        out[g * GROUP_REQUESTS + lane, slot >> 5] = uint32(x)


@cuda.jit(cache=True)
def match_v3(resid, prog_ptr, prog, sched, circles, rtab, ftab, rtime, rpos, nreq, out):
    """v3: v2 with the transpose by warp shuffles (GPU only)."""
    slot = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    in_range = slot < resid.shape[0]
    g = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    ft = cuda.shared.array(FTAB_WORDS, uint32)
    tm = cuda.shared.array(GROUP_REQUESTS, int64)
    lat = cuda.shared.array(GROUP_REQUESTS, float64)
    lon = cuda.shared.array(GROUP_REQUESTS, float64)
    _load_group(ftab, rtime, rpos, g, ft, tm, lat, lon, tid)
    n = nreq[g]
    x = int64(0)
    if in_range:
        x = _slot_mask(slot, resid, prog_ptr, prog, sched, circles, rtab, g, ft, tm, lat, lon, n)
    lane = tid & 31
    x = _transpose_stage_shuffle(x, lane, 16, 0x0000FFFF)
    x = _transpose_stage_shuffle(x, lane, 8, 0x00FF00FF)
    x = _transpose_stage_shuffle(x, lane, 4, 0x0F0F0F0F)
    x = _transpose_stage_shuffle(x, lane, 2, 0x33333333)
    x = _transpose_stage_shuffle(x, lane, 1, 0x55555555)
    if in_range and lane < n:
        out[g * GROUP_REQUESTS + lane, slot >> 5] = uint32(x)


# --- v4 / v5: 64-request groups ----------------------------------------------------------------------
@cuda.jit(device=True, cache=True)
def _circle_mask_wide(circles, cs, nc, lat, lon, need):
    """`_circle_mask` for 64-bit group masks (bit 63 makes the mask negative: no shifting loop)."""
    hit = int64(0)
    for k in range(nc):
        clat = circles[cs + k, 0]
        clon = circles[cs + k, 1]
        rad = circles[cs + k, 2]
        for r in range(WIDE_GROUP):
            if ((need & ~hit) >> r) & 1:
                if haversine_dev(lat[r], lon[r], clat, clon) <= rad:
                    hit |= int64(1) << r
    return hit


@cuda.jit(device=True, cache=True)
def _clause_terms_wide(prog, q, nt, alive, rtab, g):
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
def _eval_program_wide(prog, p, alive, rtab, g, circles, lat, lon):
    """`_eval_program` with TERM_UNROLL independent loads per early-exit test."""
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
        sat = _clause_terms_wide(prog, q, nt, alive, rtab, g)
        q += nt
        need = alive & ~sat
        if need != 0 and nc > 0:
            sat |= _circle_mask_wide(circles, cs, nc, lat, lon, need)
        if h & NEGATIVE_BIT:
            alive &= ~sat
        else:
            alive &= sat
        if alive == 0:
            break
    return alive


@cuda.jit(device=True, cache=True)
def _slot_mask_wide(slot, resid, prog_ptr, prog, sched, circles, rtab, g, ft, tm, lat, lon, n):
    """The 64-bit group mask of requests for which `slot` is eligible."""
    alive = _residual_alive(slot, resid, sched, ft, tm, n)
    if alive == 0:
        return alive
    return _eval_program_wide(prog, prog_ptr[slot], alive, rtab, g, circles, lat, lon)


@cuda.jit(device=True, cache=True)
def _load_group_wide(ftab, rtime, rpos, g, ft, tm, lat, lon, tid):
    i = tid
    while i < FTAB_WORDS:
        ft[i] = ftab[g, i]
        i += cuda.blockDim.x
    if tid < WIDE_GROUP:
        tm[tid] = rtime[g, tid]
        lat[tid] = rpos[g, tid, 0]
        lon[tid] = rpos[g, tid, 1]
    cuda.syncthreads()


@cuda.jit(device=True, cache=True)
def _transpose_shared(x, tr, tid):
    x = _transpose_stage_shared(x, tr, tid, 16, 0x0000FFFF)
    x = _transpose_stage_shared(x, tr, tid, 8, 0x00FF00FF)
    x = _transpose_stage_shared(x, tr, tid, 4, 0x0F0F0F0F)
    x = _transpose_stage_shared(x, tr, tid, 2, 0x33333333)
    return _transpose_stage_shared(x, tr, tid, 1, 0x55555555)


@cuda.jit(device=True, cache=True)
def _transpose_shuffle(x, lane):
    x = _transpose_stage_shuffle(x, lane, 16, 0x0000FFFF)
    x = _transpose_stage_shuffle(x, lane, 8, 0x00FF00FF)
    x = _transpose_stage_shuffle(x, lane, 4, 0x0F0F0F0F)
    x = _transpose_stage_shuffle(x, lane, 2, 0x33333333)
    return _transpose_stage_shuffle(x, lane, 1, 0x55555555)


@cuda.jit(cache=True)
def match_v4(resid, prog_ptr, prog, sched, circles, rtab, ftab, rtime, rpos, nreq, out):
    """v4: one thread per slot, one group of <= 64 requests per grid row; shared-memory transpose of
    each 32-bit half. The bounds guard masks instead of returning (barriers)."""
    slot = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    in_range = slot < resid.shape[0]
    g = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    ft = cuda.shared.array(FTAB_WORDS, uint64)
    tm = cuda.shared.array(WIDE_GROUP, int64)
    lat = cuda.shared.array(WIDE_GROUP, float64)
    lon = cuda.shared.array(WIDE_GROUP, float64)
    tr = cuda.shared.array(THREADS_PER_BLOCK, uint32)
    _load_group_wide(ftab, rtime, rpos, g, ft, tm, lat, lon, tid)
    n = nreq[g]
    x = int64(0)
    if in_range:
        x = _slot_mask_wide(slot, resid, prog_ptr, prog, sched, circles, rtab, g, ft, tm, lat, lon, n)
    lo = _transpose_shared(x & FULL_MASK, tr, tid)
    hi = _transpose_shared((x >> 32) & FULL_MASK, tr, tid)
    lane = tid & 31
    if in_range:
        if lane < n:
            out[g * WIDE_GROUP + lane, slot >> 5] = uint32(lo)
        if lane + 32 < n:
            out[g * WIDE_GROUP + 32 + lane, slot >> 5] = uint32(hi)


@cuda.jit(cache=True)
def match_v5(resid, prog_ptr, prog, sched, circles, rtab, ftab, rtime, rpos, nreq, out):
    """v5: v4 with the shuffle transpose (GPU only)."""
    slot = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    in_range = slot < resid.shape[0]
    g = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    ft = cuda.shared.array(FTAB_WORDS, uint64)
    tm = cuda.shared.array(WIDE_GROUP, int64)
    lat = cuda.shared.array(WIDE_GROUP, float64)
    lon = cuda.shared.array(WIDE_GROUP, float64)
    _load_group_wide(ftab, rtime, rpos, g, ft, tm, lat, lon, tid)
    n = nreq[g]
    x = int64(0)
    if in_range:
        x = _slot_mask_wide(slot, resid, prog_ptr, prog, sched, circles, rtab, g, ft, tm, lat, lon, n)
    lane = tid & 31
    lo = _transpose_shuffle(x & FULL_MASK, lane)
    hi = _transpose_shuffle((x >> 32) & FULL_MASK, lane)
    if in_range:
        if lane < n:
            out[g * WIDE_GROUP + lane, slot >> 5] = uint32(lo)
        if lane + 32 < n:
            out[g * WIDE_GROUP + 32 + lane, slot >> 5] = uint32(hi)


# --- v7 / v8: custom locations decided on the host ------------------------------------------------------
@cuda.jit(device=True, cache=True)
def _eval_program_ctab(prog, p, alive, rtab, g, ctab):
    """`_eval_program_wide` with custom locations read from the circle table: ctab[g, q] holds the
    requests of the group inside circle q (gpu.index.GpuTargetingIndex.circle_table), so a clause's
    circles are OR-ed like its terms and the kernel does no trigonometry."""
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
        sat = _clause_terms_wide(prog, q, nt, alive, rtab, g)
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
def _slot_mask_ctab(slot, resid, prog_ptr, prog, sched, ctab, rtab, g, ft, tm, n):
    """`_slot_mask_wide` over the circle table."""
    alive = _residual_alive(slot, resid, sched, ft, tm, n)
    if alive == 0:
        return alive
    return _eval_program_ctab(prog, prog_ptr[slot], alive, rtab, g, ctab)


@cuda.jit(device=True, cache=True)
def _load_group_ctab(ftab, rtime, g, ft, tm, tid):
    i = tid
    while i < FTAB_WORDS:
        ft[i] = ftab[g, i]
        i += cuda.blockDim.x
    if tid < WIDE_GROUP:
        tm[tid] = rtime[g, tid]
    cuda.syncthreads()


@cuda.jit(cache=True)
def match_v7(resid, prog_ptr, prog, sched, ctab, rtab, ftab, rtime, nreq, out):
    """v7: v4 with custom locations from the host's circle table (no float64 math on the device)."""
    slot = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    in_range = slot < resid.shape[0]
    g = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    ft = cuda.shared.array(FTAB_WORDS, uint64)
    tm = cuda.shared.array(WIDE_GROUP, int64)
    tr = cuda.shared.array(THREADS_PER_BLOCK, uint32)
    _load_group_ctab(ftab, rtime, g, ft, tm, tid)
    n = nreq[g]
    x = int64(0)
    if in_range:
        x = _slot_mask_ctab(slot, resid, prog_ptr, prog, sched, ctab, rtab, g, ft, tm, n)
    lo = _transpose_shared(x & FULL_MASK, tr, tid)
    hi = _transpose_shared((x >> 32) & FULL_MASK, tr, tid)
    lane = tid & 31
    if in_range:
        if lane < n:
            out[g * WIDE_GROUP + lane, slot >> 5] = uint32(lo)
        if lane + 32 < n:
            out[g * WIDE_GROUP + 32 + lane, slot >> 5] = uint32(hi)


@cuda.jit(cache=True)
def match_v8(resid, prog_ptr, prog, sched, ctab, rtab, ftab, rtime, nreq, out):
    """v8: v7 with the shuffle transpose (GPU only)."""
    slot = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    in_range = slot < resid.shape[0]
    g = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    ft = cuda.shared.array(FTAB_WORDS, uint64)
    tm = cuda.shared.array(WIDE_GROUP, int64)
    _load_group_ctab(ftab, rtime, g, ft, tm, tid)
    n = nreq[g]
    x = int64(0)
    if in_range:
        x = _slot_mask_ctab(slot, resid, prog_ptr, prog, sched, ctab, rtab, g, ft, tm, n)
    lane = tid & 31
    lo = _transpose_shuffle(x & FULL_MASK, lane)
    hi = _transpose_shuffle((x >> 32) & FULL_MASK, lane)
    if in_range:
        if lane < n:
            out[g * WIDE_GROUP + lane, slot >> 5] = uint32(lo)
        if lane + 32 < n:
            out[g * WIDE_GROUP + 32 + lane, slot >> 5] = uint32(hi)


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


def _register_capped(kernel, name: str, max_registers: int):
    """`kernel`'s code compiled again as its own kernel `name`, with at most `max_registers` registers
    per thread (ptxas spills the rest to local memory). Under the simulator, which has no registers,
    it is `kernel` itself. The copy gets its own name so that numba's cache keeps the two apart."""
    if runtime.simulator_enabled():
        return kernel
    import types

    py = kernel.py_func
    fn = types.FunctionType(py.__code__, py.__globals__, name, py.__defaults__, py.__closure__)
    fn.__qualname__ = name
    fn.__doc__ = py.__doc__
    return cuda.jit(cache=True, max_registers=max_registers)(fn)


# v6 = v5 held to 64 registers: 66 registers allowed 3 blocks of 256 threads per SM, 64 allow 4 (the
# register file holds 65,536); the 8 bytes it spills sit on the custom-location path
match_v6 = _register_capped(match_v5, "match_v6", 64)

VERSIONS = {1: match_v1, 2: match_v2, 3: match_v3, 4: match_v4, 5: match_v5, 6: match_v6, 7: match_v7, 8: match_v8}
GROUP_OF = {2: GROUP_REQUESTS, 3: GROUP_REQUESTS, 4: WIDE_GROUP, 5: WIDE_GROUP, 6: WIDE_GROUP, 7: WIDE_GROUP,
            8: WIDE_GROUP}  # batched versions
BATCHED = set(GROUP_OF)
CIRCLE_TABLE = {7, 8}  # read custom locations from the host's circle table (`ctab`), not `circles`
NEEDS_WARP_INTRINSICS = {3, 5, 6, 8}
BEST = 6  # fastest measured (docs/GPU_INDEX.md); the index ships it
SIMULATOR_FALLBACK = 4  # the same bits as BEST, without warp intrinsics


# --- launchers ---------------------------------------------------------------------------------------
def launch(version: int, ix, rq, out) -> None:
    """Run match kernel `version` on index arrays `ix` (resid, prog_ptr, prog, sched, circles) and
    request arrays `rq` (a dict made by gpu.index.RequestBatch) into `out` (uint32[B, capacity // 32])."""
    kernel = VERSIONS[version]
    capacity = ix[0].shape[0]
    if capacity == 0 or out.shape[0] == 0:
        return
    threads, blocks_x = block_shape(capacity)
    if version in CIRCLE_TABLE:
        grid = (blocks_x, rq["nreq"].shape[0])
        kernel[grid, threads](*ix[:4], rq["ctab"], rq["rtab"], rq["ftab"], rq["rtime"], rq["nreq"], out)
    elif version in BATCHED:
        grid = (blocks_x, rq["nreq"].shape[0])
        kernel[grid, threads](*ix, rq["rtab"], rq["ftab"], rq["rtime"], rq["rpos"], rq["nreq"], out)
    else:
        out[:] = 0  # v1 ORs bits into zeroed words
        grid = (blocks_x, out.shape[0])
        kernel[grid, threads](*ix, rq["rscal"], rq["rpos1"], rq["rterm_ptr"], rq["rterms"], out)


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
    """(name, python function, argument types) of every kernel, for compiling with compile_ptx."""
    from numba import types as T

    u32, i64, f64, i32 = T.uint32, T.int64, T.float64, T.int32
    ix = (u32[::1], i64[::1], u32[::1], i64[:, ::1], f64[:, ::1])
    batched = ix + (u32[:, ::1], u32[:, ::1], i64[:, ::1], f64[:, :, ::1], i32[::1], u32[:, ::1])
    wide = ix + (T.uint64[:, ::1], T.uint64[:, ::1], i64[:, ::1], f64[:, :, ::1], i32[::1], u32[:, ::1])
    naive = ix + (i64[:, ::1], f64[:, ::1], i64[::1], u32[::1], u32[:, ::1])
    table = ix[:4] + (T.uint64[:, ::1], T.uint64[:, ::1], T.uint64[:, ::1], i64[:, ::1], i32[::1], u32[:, ::1])
    return [
        ("match_v1", match_v1.py_func, naive),
        ("match_v2", match_v2.py_func, batched),
        ("match_v3", match_v3.py_func, batched),
        ("match_v4", match_v4.py_func, wide),
        ("match_v5", match_v5.py_func, wide),
        ("match_v7", match_v7.py_func, table),
        ("match_v8", match_v8.py_func, table),
        ("compact_programs", compact_programs.py_func, (u32[::1], i64[::1], u32[::1], i64[::1], u32[::1])),
        ("scatter_slots", scatter_slots.py_func, (i64[::1], u32[::1], i64[::1], i64[:, ::1], u32[::1], i64[::1], i64[:, ::1])),
    ]

