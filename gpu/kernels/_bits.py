"""Bit-level helpers the scoring kernels need, for the real GPU and for the CUDA simulator.

On the GPU they are numba intrinsics or libdevice calls that compile to one or two instructions:

    load_u32x4(words, i)  one 16-byte load (ld.global.v4.u32) of words[i:i+4]; i a multiple of 4
    lds_f32x4(tab, i)      one 16-byte shared-memory load (ld.shared.v4.f32) of tab[i:i+4]; the
                           shared array must be 16-byte aligned and i a multiple of 4
    u32_as_f32(w)          the float32 whose bits are w
    half_lo(w), half_hi(w) the low / high float16 of a 32-bit word, widened to float32 (cvt.f32.f16)
    i8_to_f32(wx, j)       signed byte j of a word, given wx = word ^ 0x80808080: one byte permute
                           builds the float 2^23 + (byte + 128) (prmt), one add removes 2^23 + 128;
                           exact for every int8 value
    f32_to_key(x)          float32 -> uint32 key whose unsigned order is the float order (finite
                           values); key_to_f32 inverts it. Key 0 never comes from a finite float and
                           marks "no candidate".

The simulator runs kernels as Python, where these are plain numpy functions with the same results.
`andromeda_nb.devices.resolve` must have chosen the device before this module is imported.
"""

from __future__ import annotations

import numpy as np

from .. import runtime

I8_BIAS = np.float32(8388736.0)  # 2^23 + 128
I8_FLIP = 0x80808080
NO_KEY = 0

if runtime.simulator_enabled():

    def load_u32x4(words, i):
        return words[i], words[i + 1], words[i + 2], words[i + 3]

    def lds_f32x4(tab, i):
        return tab[i], tab[i + 1], tab[i + 2], tab[i + 3]

    def half_lo(w):
        return np.float32(np.array([int(w) & 0xFFFF], np.uint16).view(np.float16)[0])

    def half_hi(w):
        return np.float32(np.array([(int(w) >> 16) & 0xFFFF], np.uint16).view(np.float16)[0])

    def u32_as_f32(w):
        return np.array([int(w)], np.uint32).view(np.float32)[0]

    def i8_to_f32(wx, j):
        byte = (int(wx) >> (8 * int(j))) & 0xFF
        return np.float32(np.float32(8388608.0 + byte) - I8_BIAS)

    def f32_to_key(x):
        u = int(np.array([x], np.float32).view(np.uint32)[0])
        return np.uint32(u ^ 0xFFFFFFFF if u & 0x80000000 else u | 0x80000000)

    def key_to_f32(k):
        k = int(k)
        u = k & 0x7FFFFFFF if k & 0x80000000 else k ^ 0xFFFFFFFF
        return np.array([u], np.uint32).view(np.float32)[0]

else:
    from llvmlite import ir
    from numba import cuda, types
    from numba.core.extending import intrinsic
    from numba.cuda import libdevice

    @intrinsic
    def _ld_v4(typingctx, words, i):
        if not (isinstance(words, types.Array) and words.dtype == types.uint32 and isinstance(i, types.Integer)):
            return None
        sig = types.UniTuple(types.uint32, 4)(words, i)

        def codegen(context, builder, sig, args):
            arr = context.make_array(sig.args[0])(context, builder, args[0])
            idx = context.cast(builder, args[1], sig.args[1], types.int64)
            ptr = builder.gep(arr.data, [idx])
            vec_ty = ir.VectorType(ir.IntType(32), 4)
            gptr = builder.addrspacecast(ptr, ir.PointerType(ir.IntType(32), 1))
            vptr = builder.bitcast(gptr, ir.PointerType(vec_ty, 1))
            vec = builder.load(vptr, align=16)
            parts = [builder.extract_element(vec, ir.Constant(ir.IntType(32), j)) for j in range(4)]
            return context.make_tuple(builder, sig.return_type, parts)

        return sig, codegen

    @intrinsic
    def _lds_v4(typingctx, tab, i):
        if not (isinstance(tab, types.Array) and tab.dtype == types.float32 and isinstance(i, types.Integer)):
            return None
        sig = types.UniTuple(types.float32, 4)(tab, i)

        def codegen(context, builder, sig, args):
            arr = context.make_array(sig.args[0])(context, builder, args[0])
            idx = context.cast(builder, args[1], sig.args[1], types.int64)
            ptr = builder.gep(arr.data, [idx])
            vec_ty = ir.VectorType(ir.FloatType(), 4)
            sptr = builder.addrspacecast(ptr, ir.PointerType(ir.FloatType(), 3))
            vec = builder.load(builder.bitcast(sptr, ir.PointerType(vec_ty, 3)), align=16)
            parts = [builder.extract_element(vec, ir.Constant(ir.IntType(32), j)) for j in range(4)]
            return context.make_tuple(builder, sig.return_type, parts)

        return sig, codegen

    @intrinsic
    def _half_lo(typingctx, w):
        sig = types.float32(types.uint32)

        def codegen(context, builder, sig, args):
            h = builder.bitcast(builder.trunc(args[0], ir.IntType(16)), ir.HalfType())
            return builder.fpext(h, ir.FloatType())

        return sig, codegen

    @intrinsic
    def _half_hi(typingctx, w):
        sig = types.float32(types.uint32)

        def codegen(context, builder, sig, args):
            hi = builder.lshr(args[0], ir.Constant(ir.IntType(32), 16))
            h = builder.bitcast(builder.trunc(hi, ir.IntType(16)), ir.HalfType())
            return builder.fpext(h, ir.FloatType())

        return sig, codegen

    @intrinsic
    def _f32_bits(typingctx, x):
        sig = types.uint32(types.float32)

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.IntType(32))

        return sig, codegen

    @intrinsic
    def _bits_f32(typingctx, u):
        sig = types.float32(types.uint32)

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.FloatType())

        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def load_u32x4(words, i):
        return _ld_v4(words, i)

    @cuda.jit(device=True, inline=True)
    def lds_f32x4(tab, i):
        return _lds_v4(tab, i)

    @cuda.jit(device=True, inline=True)
    def half_lo(w):
        return _half_lo(w)

    @cuda.jit(device=True, inline=True)
    def half_hi(w):
        return _half_hi(w)

    @cuda.jit(device=True, inline=True)
    def u32_as_f32(w):
        return _bits_f32(w)

    @cuda.jit(device=True, inline=True)
    def i8_to_f32(wx, j):
        bits = libdevice.byte_perm(types.int32(wx), types.int32(0x4B000000), types.int32(0x7440 + j))
        return libdevice.int_as_float(bits) - I8_BIAS

    @cuda.jit(device=True, inline=True)
    def f32_to_key(x):
        u = _f32_bits(x)
        if u & types.uint32(0x80000000):
            return u ^ types.uint32(0xFFFFFFFF)
        return u | types.uint32(0x80000000)

    @cuda.jit(device=True, inline=True)
    def key_to_f32(k):
        if k & types.uint32(0x80000000):
            return _bits_f32(k & types.uint32(0x7FFFFFFF))
        return _bits_f32(k ^ types.uint32(0xFFFFFFFF))


def keys_to_f32_host(keys: np.ndarray) -> np.ndarray:
    """numpy form of key_to_f32 for whole arrays."""
    k = np.asarray(keys, np.uint32)
    u = np.where(k & np.uint32(0x80000000), k & np.uint32(0x7FFFFFFF), k ^ np.uint32(0xFFFFFFFF))
    return u.astype(np.uint32).view(np.float32)


def f32_to_keys_host(x: np.ndarray) -> np.ndarray:
    """numpy form of f32_to_key for whole arrays."""
    u = np.asarray(x, np.float32).view(np.uint32)
    return np.where(u & np.uint32(0x80000000), u ^ np.uint32(0xFFFFFFFF), u | np.uint32(0x80000000)).astype(np.uint32)
