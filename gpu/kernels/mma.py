"""Warp-level building blocks of the tensor-core scorer, for the real GPU and for the CUDA simulator.

On the GPU each is one or a few PTX instructions, emitted as inline assembly from a numba intrinsic
(no foreign code to link):

    mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) -> (d0, d1, d2, d3)
        one `mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`: D = A B + C for a 16 x 16 fp16 tile
        A, a 16 x 8 fp16 tile B and float32 C, D, spread over the 32 lanes of a warp (layout below)
    pack_f16x2(x0, x1)         uint32 holding fp16(x0) in its low and fp16(x1) in its high half
    split_f16x2(x0, x1)        (hi, lo): hi = pack_f16x2(x0, x1), lo = the packed rounding residuals
                               x - fp16(x); hi + lo carries about 22 bits of each float32
    i8x2_to_f16x2(wx, sel)     two signed bytes of a word as a packed fp16 pair, exactly: wx is the
                               word ^ 0x80808080; `sel` = I8_LO (bytes 0, 1) or I8_HI (bytes 2, 3);
                               one byte permute builds 1024 + (byte + 128) in each half, one packed
                               subtract removes 1152

Fragment layout of m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"), with g = lane >> 2 (the
group) and q = lane & 3 (the thread in the group); each register holds two fp16 values, the lower
column or row index in the low half:

    A (row-major 16 x 16):  a0 = A[g, 2q:2q+2]   a1 = A[g+8, 2q:2q+2]
                            a2 = A[g, 8+2q:10+2q] a3 = A[g+8, 8+2q:10+2q]
    B (column-major 16 x 8): b0 = B[2q:2q+2, g]  b1 = B[8+2q:10+2q, g]
    C, D (16 x 8 float32):  d0, d1 = D[g, 2q], D[g, 2q+1]    d2, d3 = D[g+8, 2q], D[g+8, 2q+1]

The simulator has no tensor cores, no warp shuffles and no warp-level barrier. There each function is
plain Python: the warp's registers meet in a shared scratch array between two block-wide barriers
(`syncthreads`), and every thread computes its own part. So in simulated kernels every thread of the
block must reach each call (block-uniform control flow around them), which the generated scorer
respects there; on the GPU only the warp must be converged, as the instructions require.
`andromeda_nb.devices.resolve` must have chosen the device before this module is imported.
"""

from __future__ import annotations

import numpy as np

from .. import runtime

I8_FLIP = 0x80808080
I8_LO = 0x4140  # byte permute: [byte 0, 0x64, byte 1, 0x64]
I8_HI = 0x4342  # [byte 2, 0x64, byte 3, 0x64]
F16X2_1152 = 0x64806480  # 1152.0 (1024 + 128) in both halves
WARP = 32
SCRATCH_THREADS = 1024  # the most threads a block may have

cuda = runtime.cuda()


# --- host-side helpers (numpy): the same conversions, for references and tests ------------------------


def f16_words(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """uint32 words holding float16(lo) in the low and float16(hi) in the high half."""
    lo16 = np.asarray(lo, np.float32).astype(np.float16).view(np.uint16).astype(np.uint32)
    hi16 = np.asarray(hi, np.float32).astype(np.float16).view(np.uint16).astype(np.uint32)
    return lo16 | (hi16 << np.uint32(16))


def f16_halves(words) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) halves of uint32 words, as float32."""
    w = np.asarray(words, np.uint32)
    lo = (w & np.uint32(0xFFFF)).astype(np.uint16).view(np.float16).astype(np.float32)
    hi = (w >> np.uint32(16)).astype(np.uint16).view(np.float16).astype(np.float32)
    return lo, hi


def split_host(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(hi, lo) float16 parts of float32 values: hi = fp16(x), lo = fp16(x - hi)."""
    x = np.asarray(x, np.float32)
    hi = x.astype(np.float16)
    lo = (x - hi.astype(np.float32)).astype(np.float16)
    return hi, lo


if runtime.simulator_enabled():

    # device functions, so that the simulator hands them its cuda module (shared arrays, barriers)
    @cuda.jit(device=True)
    def _tid() -> int:
        return int(cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z))


    def _word_halves(w) -> tuple[float, float]:
        lo, hi = f16_halves(np.asarray([int(w)], np.uint32))
        return float(lo[0]), float(hi[0])

    @cuda.jit(device=True)
    def mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        # one array per block and call site (the simulator keys shared arrays by source line)
        a = cuda.shared.array((SCRATCH_THREADS, 4), np.uint32)
        b = cuda.shared.array((SCRATCH_THREADS, 2), np.uint32)
        t = _tid()
        a[t, 0], a[t, 1], a[t, 2], a[t, 3] = a0, a1, a2, a3
        b[t, 0], b[t, 1] = b0, b1
        cuda.syncthreads()
        base = t - t % WARP
        g, q = (t % WARP) >> 2, t & 3
        lanes = base + 4 * g + np.arange(4)  # the lanes holding rows g and g + 8 of A
        a_lo, a_hi = f16_halves(a[lanes])  # (4 lanes, 4 registers)
        row_g = np.empty(16, np.float64)
        row_g8 = np.empty(16, np.float64)
        for qq in range(4):
            row_g[2 * qq], row_g[2 * qq + 1] = a_lo[qq, 0], a_hi[qq, 0]
            row_g8[2 * qq], row_g8[2 * qq + 1] = a_lo[qq, 1], a_hi[qq, 1]
            row_g[8 + 2 * qq], row_g[9 + 2 * qq] = a_lo[qq, 2], a_hi[qq, 2]
            row_g8[8 + 2 * qq], row_g8[9 + 2 * qq] = a_lo[qq, 3], a_hi[qq, 3]
        cols = []
        for n in (2 * q, 2 * q + 1):
            blanes = base + 4 * n + np.arange(4)  # the lanes holding column n of B
            b_lo, b_hi = f16_halves(b[blanes])
            col = np.empty(16, np.float64)
            for qq in range(4):
                col[2 * qq], col[2 * qq + 1] = b_lo[qq, 0], b_hi[qq, 0]
                col[8 + 2 * qq], col[9 + 2 * qq] = b_lo[qq, 1], b_hi[qq, 1]
            cols.append(col)
        d0 = np.float32(float(row_g @ cols[0]) + float(c0))
        d1 = np.float32(float(row_g @ cols[1]) + float(c1))
        d2 = np.float32(float(row_g8 @ cols[0]) + float(c2))
        d3 = np.float32(float(row_g8 @ cols[1]) + float(c3))
        cuda.syncthreads()
        return d0, d1, d2, d3

    def pack_f16x2(x0, x1):
        return np.uint32(f16_words(np.float32(x0), np.float32(x1)))

    def split_f16x2(x0, x1):
        x = np.asarray([x0, x1], np.float32)
        hi, lo = split_host(x)
        return (np.uint32(f16_words(hi[0], hi[1])), np.uint32(f16_words(lo[0], lo[1])))

    def i8x2_to_f16x2(wx, sel):
        wx = int(wx)
        if int(sel) == I8_LO:
            b0, b1 = wx & 0xFF, (wx >> 8) & 0xFF
        else:
            b0, b1 = (wx >> 16) & 0xFF, (wx >> 24) & 0xFF
        return np.uint32(f16_words(np.float32(b0 - 128), np.float32(b1 - 128)))

else:
    from llvmlite import ir
    from numba import types
    from numba.core.extending import intrinsic

    _f32 = ir.FloatType()
    _i32 = ir.IntType(32)

    @intrinsic
    def _mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        sig = types.UniTuple(types.float32, 4)(types.uint32, types.uint32, types.uint32, types.uint32,
                                               types.uint32, types.uint32, types.float32, types.float32,
                                               types.float32, types.float32)

        def codegen(context, builder, sig, args):
            ret = ir.LiteralStructType([_f32] * 4)
            fnty = ir.FunctionType(ret, [_i32] * 6 + [_f32] * 4)
            asm = ir.InlineAsm(
                fnty,
                "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
            )
            res = builder.call(asm, args)
            parts = [builder.extract_value(res, i) for i in range(4)]
            return context.make_tuple(builder, sig.return_type, parts)

        return sig, codegen

    @intrinsic
    def _pack(typingctx, x0, x1):
        sig = types.uint32(types.float32, types.float32)

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(_i32, [_f32, _f32])
            # cvt.rn.f16x2.f32 d, a, b puts a in the high half: pass x1 first
            asm = ir.InlineAsm(fnty, "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f")
            return builder.call(asm, [args[1], args[0]])

        return sig, codegen

    @intrinsic
    def _split(typingctx, x0, x1):
        sig = types.UniTuple(types.uint32, 2)(types.float32, types.float32)

        def codegen(context, builder, sig, args):
            ret = ir.LiteralStructType([_i32, _i32])
            fnty = ir.FunctionType(ret, [_f32, _f32])
            asm = ir.InlineAsm(
                fnty,
                "{ .reg .b16 h0, h1; .reg .f32 r0, r1;"
                " cvt.rn.f16.f32 h0, $2; cvt.rn.f16.f32 h1, $3;"
                " cvt.f32.f16 r0, h0; cvt.f32.f16 r1, h1;"
                " sub.f32 r0, $2, r0; sub.f32 r1, $3, r1;"
                " mov.b32 $0, {h0, h1};"
                " cvt.rn.f16x2.f32 $1, r1, r0; }",
                "=r,=r,f,f",
            )
            res = builder.call(asm, args)
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_value(res, 0), builder.extract_value(res, 1)])

        return sig, codegen

    @intrinsic
    def _i8x2(typingctx, wx, sel):
        sig = types.uint32(types.uint32, types.uint32)

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(_i32, [_i32, _i32])
            asm = ir.InlineAsm(
                fnty,
                "{ .reg .b32 t, c; prmt.b32 t, $1, 0x64646464, $2; mov.b32 c, 0x64806480; sub.f16x2 $0, t, c; }",
                "=r,r,r",
            )
            return builder.call(asm, args)

        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return _mma(types.uint32(a0), types.uint32(a1), types.uint32(a2), types.uint32(a3), types.uint32(b0),
                    types.uint32(b1), types.float32(c0), types.float32(c1), types.float32(c2), types.float32(c3))

    @cuda.jit(device=True, inline=True)
    def pack_f16x2(x0, x1):
        return _pack(types.float32(x0), types.float32(x1))

    @cuda.jit(device=True, inline=True)
    def split_f16x2(x0, x1):
        return _split(types.float32(x0), types.float32(x1))

    @cuda.jit(device=True, inline=True)
    def i8x2_to_f16x2(wx, sel):
        return _i8x2(types.uint32(wx), types.uint32(sel))


__all__ = ["I8_FLIP", "I8_HI", "I8_LO", "f16_halves", "f16_words", "i8x2_to_f16x2", "mma_f16", "pack_f16x2",
           "split_f16x2", "split_host"]
