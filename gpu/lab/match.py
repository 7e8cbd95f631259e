"""The match kernel lab: every version of the GPU targeting match, the superseded ones beside the
shipped ones (`gpu/kernels/match.py`), so that the history can still be timed (`andromeda bench
match`) and checked (tests/gpu/test_gpu_index.py) against the oracle.

Versions (`VERSIONS`, every one; the index ships `gpu.kernels.match.SHIPPED`):
    v1 naive      one thread per (slot, request); the user's terms are found by binary search in the
                  request's sorted term list; each eligible bit is set with an atomic OR.
    v2 batched    one thread per slot serves a group of up to 32 requests in one pass over the per-ad
                  columns: bit r of a 32-bit mask is request r of the group. Residual rules (age,
                  gender, placements) are six lookups in per-group tables held in shared memory; a
                  clause is the OR of per-term request masks (`rtab`), and the clause loops stop as soon
                  as the answer is known. The 32x32 bit matrix (slots x requests) of a warp is
                  transposed in shared memory, so each output word is written once, with no atomics.
    v3 shuffled   v2 with the transpose done by warp shuffles (`shfl_xor_sync`) instead of shared
                  memory and barriers. Under the CUDA simulator the shuffles are emulated (`gpu.kernels.warp`).
    v4 wide       groups of 64 requests (the masks were 64-bit integers already, so a pass serves
                  twice the requests for the same instructions), and the term loop issues four
                  independent table loads before it tests for an early exit (v2 waited for each
                  load); shared-memory transpose of both 32-bit halves; custom locations by the
                  float64 great-circle distance on the device.
    v5 wide+shfl  v4 with the shuffle transpose (emulated under the simulator).
    v6 v5, 64 regs the same code compiled with at most 64 registers per thread, for 4 blocks per SM
                  instead of 3 (emulated under the simulator). Shipped until v8 measured faster.
    v7 circle table  v4 with custom locations decided on the host: `ctab[g, q]` holds the requests of
                  group g inside circle q (float64 great-circle distance, the function every index
                  uses, tested only for circles in a latitude band around each user), OR-ed like
                  terms, so the kernel has no float64 math and no trigonometry. Shipped as the
                  simulator's fallback.
    v8 table+shfl v7 with the shuffle transpose (emulated under the simulator). Shipped.
    v9 v8, 40 regs the same code compiled with at most 40 registers per thread (v8 takes 48): 6 blocks
                  of 256 threads per SM instead of 5, for the lone request, whose match ncu found bound
                  by issuing instructions at 52% achieved occupancy (emulated under the simulator).

v2 to v8 come from the one generator of the shipped file, `batched_kernel`: the request groups of
32 (`NARROW`) and of 64 with the great-circle test on the device (`WIDE`) are defined here, the one
with the host's circle table (`CIRCLE_TABLE`) there. Argument layouts are documented in
gpu/kernels/match.py.
"""

from __future__ import annotations

from andromeda_nb.geo import haversine_km
from andromeda_nb.versions import Version, version_table

from ..kernels import match as shipped
from ..kernels.match import (  # noqa: F401  (the constants are read by the kernels below)
    ACTIVE_BIT, AGE_MAX_SHIFT, AGE_MIN_SHIFT, AGE_UNBOUNDED, CIRCLE_TABLE, CIRCLES_BIT, DEVICE_SHIFT, FTAB_WORDS,
    FULL_MASK, GENDER_SHIFT, NEGATIVE_BIT, OS_SHIFT, PUBLISHER_SHIFT, SCHEDULE_BIT, TERM_COUNT_MASK, WIDE_GROUP,
    RequestGroup, clause_terms_wide, load_group_template, residual_alive, write_rows_wide, batched_kernel,
    block_shape, cuda, device_function, index_signature,
)
from ..kernels.match import kernel_signatures as shipped_signatures

from numba import int64, uint32, uint64  # noqa: E402  (after the simulator choice: gpu.kernels.match made it)

haversine_dev = cuda.jit(device=True)(haversine_km)

GROUP_REQUESTS = 32  # requests per group in v2, v3 (bits of a mask word)


# --- v1: one thread per (slot, request) ----------------------------------------------------------------
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



class NaiveKernel:
    """v1's launch: grid x over slots, y over requests; the output is zeroed first (v1 ORs bits in)."""

    group = 0  # the per-request form of the request arrays
    circle_table = False

    def __init__(self):
        # an instance attribute: a CUDA dispatcher set on the class would bind as a method on the GPU
        self.kernel = match_v1

    def launch(self, ix, rq, out, stream=0) -> None:
        threads, blocks_x = block_shape(ix[0].shape[0])
        out[:] = 0  # ordered before the launch: the default stream waits for the index's stream and back
        self.kernel[(blocks_x, out.shape[0]), threads, stream](*ix[:5], rq["rscal"], rq["rpos1"], rq["rterm_ptr"],
                                                               rq["rterms"], out)


# --- v2, v3: groups of 32 requests -----------------------------------------------------------------------
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
def _slot_mask(slot, resid, prog_ptr, prog, sched, circles, rtab, g, ft, tm, lat, lon, n):
    """The group mask of requests for which `slot` is eligible."""
    alive = residual_alive(slot, resid, sched, ft, tm, n)
    if alive == 0:
        return alive
    return _eval_program(prog, prog_ptr[slot], alive, rtab, g, circles, lat, lon)



def _write_rows_narrow(x, tid, slot, g, n, in_range, out):
    """A 32-request group: the warp's masks transposed, one word per request of the group and slot word."""
    x = transpose(x, tid)  # noqa: F821  (bound by batched_kernel)
    lane = tid & 31
    if in_range and lane < n:
        out[g * GROUP_REQUESTS + lane, slot >> 5] = uint32(x)


NARROW = RequestGroup("narrow", GROUP_REQUESTS, uint32,
                      device_function(load_group_template, "load_group_narrow", group_requests=GROUP_REQUESTS),
                      _slot_mask, _write_rows_narrow)


# --- v4, v5, v6: groups of 64 requests, custom locations by the great-circle test on the device ---------
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
        sat = clause_terms_wide(prog, q, nt, alive, rtab, g)
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
    alive = residual_alive(slot, resid, sched, ft, tm, n)
    if alive == 0:
        return alive
    return _eval_program_wide(prog, prog_ptr[slot], alive, rtab, g, circles, lat, lon)


WIDE = RequestGroup("wide", WIDE_GROUP, uint64, device_function(load_group_template, "load_group_wide",
                                                                group_requests=WIDE_GROUP),
                    _slot_mask_wide, write_rows_wide)


# --- the table ---------------------------------------------------------------------------------------------
_V2 = batched_kernel("match_v2", NARROW, "shared")
_V3 = batched_kernel("match_v3", NARROW, "shuffle")
_V4 = batched_kernel("match_v4", WIDE, "shared")
_V5 = batched_kernel("match_v5", WIDE, "shuffle")
# v6 = the shuffle transpose held to 64 registers: 66 registers allowed 3 blocks of 256 threads per SM,
# 64 allow 4 (the register file holds 65,536); the 8 bytes it spills sit on the custom-location path
_V6 = batched_kernel("match_v6", WIDE, "shuffle", max_registers=64)
match_v2, match_v3, match_v4, match_v5, match_v6 = _V2.kernel, _V3.kernel, _V4.kernel, _V5.kernel, _V6.kernel
# v9 = the shipped v8 held to 40 registers: v8 takes 48, so 5 blocks of 256 threads fit an SM (62.5%
# occupancy); 40 fit 6 (75%), for the lone request, whose match is bound by issuing instructions
_V9 = batched_kernel("match_v9", shipped.CIRCLE_TABLE, "shuffle", max_registers=40)
match_v9 = _V9.kernel

VERSIONS = version_table(
    Version(1, "v1 naive", "one thread per (slot, request), binary search of the user's terms, atomic OR",
            NaiveKernel()),
    Version(2, "v2 batched", "32-request groups, shared-memory transpose", _V2),
    Version(3, "v3 shuffled", "v2 with the warp-shuffle transpose", _V3),
    Version(4, "v4 wide", "64-request groups, four table loads per early-exit test, shared-memory transpose", _V4),
    Version(5, "v5 wide+shfl", "v4 with the warp-shuffle transpose", _V5),
    Version(6, "v6 wide+shfl, 64 regs", "v5 compiled with at most 64 registers per thread", _V6),
    *shipped.VERSIONS.values(),
    # GPU only: under the simulator, which has no registers, it would be v8 again
    Version(9, "v9 table+shfl, 40 regs", "v8 compiled with at most 40 registers per thread", _V9, gpu_only=True),
)
SHIPPED = shipped.SHIPPED
SIMULATOR_FALLBACK = shipped.SIMULATOR_FALLBACK


def kernel_signatures():
    """(name, python function, argument types) of every match kernel, shipped and lab, for compile_ptx."""
    from numba import types as T

    ix = index_signature()
    u32, u64, i64, f64, i32 = T.uint32, T.uint64, T.int64, T.float64, T.int32
    requests = (i64[:, ::1], f64[:, :, ::1], i32[::1], u64[::1], u32[:, ::1])  # rtime, rpos, nreq, gmask, out
    narrow = ix + (u64[::1], u32[:, ::1], u32[:, ::1]) + requests  # summary, rtab, ftab
    wide = ix + (u64[::1], u64[:, ::1], u64[:, ::1]) + requests
    naive = ix + (i64[:, ::1], f64[:, ::1], i64[::1], u32[::1], u32[:, ::1])
    product = {name: (fn, sig) for name, fn, sig in shipped_signatures()}
    return [
        ("match_v1", match_v1.py_func, naive),
        ("match_v2", match_v2.py_func, narrow),
        ("match_v3", match_v3.py_func, narrow),
        ("match_v4", match_v4.py_func, wide),
        ("match_v5", match_v5.py_func, wide),
        ("match_v6", match_v6.py_func, wide),
        ("match_v9", match_v9.py_func, product["match_v8"][1]),
        *((name, fn, sig) for name, (fn, sig) in product.items()),
    ]


__all__ = ["CIRCLE_TABLE", "NARROW", "SHIPPED", "SIMULATOR_FALLBACK", "VERSIONS", "WIDE", "kernel_signatures"]
