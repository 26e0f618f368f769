"""Word-at-a-time primitives for the codec's kernels: 64-element compare masks and bit tricks on uint64.

The O(n) passes of the codec (which elements changed, which exponent class each old element is in)
run 64 elements at a time: one vector compare turns 64 bit patterns into one uint64 mask, and counting,
ranking and selecting become ``popcount``/``tzcnt``/``pdep`` on that word instead of a branch per
element. The masks are numba intrinsics that emit LLVM vector IR (load ``<64 x iN>``, compare with a
splat, bitcast ``<64 x i1>`` to ``i64``), which LLVM lowers to whatever the host has: ``vpcmpuw`` into a
mask register on AVX-512, compares plus ``vpmovmskb`` on AVX2, NEON sequences elsewhere. The loads are
unaligned and never read past ``start + 64``; callers handle the last partial word with scalar code.

``pdep`` (bit deposit) is the BMI2 instruction where it is fast (Intel since Haswell, AMD since Zen 3;
Zen 1 and 2 microcode it at up to ~300 cycles), else a loop over the source's set bits with a
broadword select (Vigna, "Broadword implementation of rank/select queries", 2008): correct everywhere,
fast where it matters. The choice is made once per process from the host CPU LLVM compiles for, which
is also what numba's on-disk cache is keyed on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import llvmlite.binding as llvm
import llvmlite.ir as ir
import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_I64 = ir.IntType(64)
_SLOW_PDEP = ("znver1", "znver2")


def _fast_pdep() -> bool:
    features = llvm.get_host_cpu_features()
    return bool(features.get("bmi2", False)) and llvm.get_host_cpu_name() not in _SLOW_PDEP


FAST_PDEP = _fast_pdep()


@intrinsic
def _ctpop(typingctx, x):
    """Set bits of a uint64 (``llvm.ctpop``: one ``popcnt`` where the host has it)."""
    sig = types.int64(types.uint64)

    def codegen(context, builder, signature, args):
        fn = builder.module.declare_intrinsic("llvm.ctpop", [_I64])
        return builder.call(fn, [args[0]])

    return sig, codegen


@intrinsic
def _cttz(typingctx, x):
    """Trailing zero bits of a uint64 (64 for 0)."""
    sig = types.int64(types.uint64)

    def codegen(context, builder, signature, args):
        fn = builder.module.declare_intrinsic("llvm.cttz", [_I64, ir.IntType(1)])
        return builder.call(fn, [args[0], ir.Constant(ir.IntType(1), 0)])

    return sig, codegen


@intrinsic
def _pdep_bmi2(typingctx, src, mask):
    sig = types.uint64(types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(_I64, [_I64, _I64])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.bmi.pdep.64")
        return builder.call(fn, list(args))

    return sig, codegen


def _load64(context, builder, arrty, arr, start):
    ary = context.make_array(arrty)(context, builder, arr)
    elem = context.get_value_type(arrty.dtype)
    ptr = builder.gep(ary.data, [start])
    vty = ir.VectorType(elem, 64)
    return builder.load(builder.bitcast(ptr, vty.as_pointer()), align=arrty.dtype.bitwidth // 8), vty


def _splat(builder, vty, value):
    one = builder.insert_element(ir.Constant(vty, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
    zeros = ir.Constant(ir.VectorType(ir.IntType(32), 64), [0] * 64)
    return builder.shuffle_vector(one, ir.Constant(vty, ir.Undefined), zeros)


@intrinsic
def _ge_mask64(typingctx, arr, start, magmask, threshold):
    """Bit k set iff ``arr[start + k] & magmask >= threshold`` (unsigned), k < 64."""
    if not isinstance(arr, types.Array) or not isinstance(arr.dtype, types.Integer):
        return None
    sig = types.uint64(arr, types.intp, arr.dtype, arr.dtype)

    def codegen(context, builder, signature, args):
        a, start, mm, thr = args
        v, vty = _load64(context, builder, signature.args[0], a, start)
        v = builder.and_(v, _splat(builder, vty, mm))
        bits = builder.icmp_unsigned(">=", v, _splat(builder, vty, thr))
        return builder.bitcast(bits, _I64)

    return sig, codegen


@intrinsic
def _ne_mask64(typingctx, a, b, start):
    """Bit k set iff ``a[start + k] != b[start + k]``, k < 64."""
    if not isinstance(a, types.Array) or a != b:
        return None
    sig = types.uint64(a, b, types.intp)

    def codegen(context, builder, signature, args):
        x, y, start = args
        va, _ = _load64(context, builder, signature.args[0], x, start)
        vb, _ = _load64(context, builder, signature.args[1], y, start)
        return builder.bitcast(builder.icmp_unsigned("!=", va, vb), _I64)

    return sig, codegen


# Typed names for the intrinsics (numba resolves them to the same objects; mypy sees the call shapes).
popcount = cast(Callable[[np.uint64], int], _ctpop)
tzcnt = cast(Callable[[np.uint64], int], _cttz)
ge_mask64 = cast(Callable[[np.ndarray, int, Any, Any], np.uint64], _ge_mask64)
ne_mask64 = cast(Callable[[np.ndarray, np.ndarray, int], np.uint64], _ne_mask64)

_M1 = np.uint64(0x5555555555555555)
_M2 = np.uint64(0x3333333333333333)
_M4 = np.uint64(0x0F0F0F0F0F0F0F0F)
_L8 = np.uint64(0x0101010101010101)
_H8 = np.uint64(0x8080808080808080)


def _select_in_byte() -> np.ndarray:
    table = np.zeros((256, 8), dtype=np.uint8)
    for byte in range(256):
        ones = [i for i in range(8) if byte >> i & 1]
        table[byte, : len(ones)] = ones
    return table.reshape(-1)


SELECT_IN_BYTE = _select_in_byte()


@njit(cache=True, nogil=True, inline="always")
def select64(x: np.uint64, j: int) -> int:
    """Index of the j-th (0-based) set bit of ``x``; ``x`` must have more than j set bits."""
    s = x - ((x >> np.uint64(1)) & _M1)
    s = (s & _M2) + ((s >> np.uint64(2)) & _M2)
    s = (s + (s >> np.uint64(4))) & _M4
    prefix = s * _L8  # byte b: set bits in bytes 0..b
    below = (((np.uint64(j) * _L8) | _H8) - prefix) & _H8  # high bit of byte b: prefix_b <= j
    byte = popcount(below)
    shift = np.uint64(8 * byte)
    before = np.int64(((prefix << np.uint64(8)) >> shift) & np.uint64(0xFF))
    value = np.int64((x >> shift) & np.uint64(0xFF))
    return int(8 * byte + np.int64(SELECT_IN_BYTE[8 * value + j - before]))


@njit(cache=True, nogil=True, inline="always")
def _pdep_soft(src: np.uint64, mask: np.uint64) -> np.uint64:
    out = np.uint64(0)
    while src:
        out |= np.uint64(1) << np.uint64(select64(mask, tzcnt(src)))
        src &= src - np.uint64(1)
    return out


pdep = cast(Callable[[np.uint64, np.uint64], np.uint64], _pdep_bmi2 if FAST_PDEP else _pdep_soft)
