"""What every Numba kernel of the ``numba`` backend shares (the counterpart of ``cuda_kernels/rotary_common.cuh``).

Every array reaches a kernel as a flat 1-D buffer plus int64 element offsets and strides (see
:func:`element_offset`), so any strided view (BSHD, BHSD, negative strides, ``out is x``) is read
and written in place, and index arithmetic is int64 whatever the size. float16 data arrives as its
uint16 bit pattern and is converted to float32 in registers (:func:`load` / :func:`store`).
:func:`borrowed` drops an array's meminfo for the duration of a call (no incref/decref per view).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.imputils import lower_builtin
from numba.extending import intrinsic, overload, type_callable

from .simd import HELPER_JIT, OVERLOAD_JIT

# geometry columns of one rotate item: heads, then (offset, sB, sS, sH, sD) of x and of out, copy_tail (a separate
# output), stream (a separate output large enough for non-temporal stores, see rotation.STREAM_MIN_BYTES)
GEO_HEADS, GEO_X, GEO_OUT, GEO_COPY_TAIL, GEO_STREAM, GEO_COLUMNS = 0, 1, 6, 11, 12, 13


# -- float16 as uint16 bits: exact conversions (LLVM fpext / fptrunc, round to nearest even) -----
@intrinsic
def _half_bits_to_f32(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def _f32_to_half_bits(typingctx, value):
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


def load(buf, i):
    """buf[i] in the work dtype: float16 bits (uint16) -> float32, float32/float64 unchanged."""
    if buf.dtype == np.uint16:
        return np.float32(buf[i].view(np.float16))
    return buf[i]


def store(buf, i, value):
    """buf[i] = value rounded to buf's dtype (float16 bits for a uint16 buffer)."""
    if buf.dtype == np.uint16:
        buf[i] = np.float16(np.float32(value)).view(np.uint16)
    else:
        buf[i] = value


@overload(load, jit_options=OVERLOAD_JIT)
def _load_impl(buf, i):
    if buf.dtype == types.uint16:
        return lambda buf, i: _half_bits_to_f32(buf[i])
    return lambda buf, i: buf[i]


@overload(store, jit_options=OVERLOAD_JIT)
def _store_impl(buf, i, value):
    if buf.dtype == types.uint16:
        def impl(buf, i, value):
            buf[i] = _f32_to_half_bits(np.float32(value))
        return impl

    def impl(buf, i, value):
        buf[i] = value
    return impl


# -- index arithmetic ----------------------------------------------------------------------------
@njit(**HELPER_JIT)
def element_offset(offset, stride_b, stride_s, stride_h, b, s, h):
    """Flat index of element (b, s, h, 0): ``offset + b*stride_b + s*stride_s + h*stride_h`` in int64."""
    return np.int64(offset) + np.int64(b) * np.int64(stride_b) + np.int64(s) * np.int64(stride_s) \
        + np.int64(h) * np.int64(stride_h)


# -- borrowed views --------------------------------------------------------------------------------
# A view of an NRT-managed array costs an atomic incref/decref pair on its meminfo, which was 60% of the
# serial rotation kernel's time at decode size (the parfor gufunc of a parallel kernel gets views without
# a meminfo, so it never paid).
def borrowed(array):
    """array itself; compiled, the same array without its meminfo: a view whose incref/decref do nothing
    (the caller keeps array alive for the whole call, as it does the parfor gufunc's views)."""
    return array


# typed and lowered in place (a typing template and a lowering, not an @overload): no function of its own
# to compile per array type (an overload compiled one for each of ~25 array types, ~1.5 s of first calls)
@type_callable(borrowed)
def _type_borrowed(context):
    def typer(array):
        if isinstance(array, types.Array):
            return array
    return typer


@lower_builtin(borrowed, types.Array)
def _lower_borrowed(context, builder, signature, args):
    ary = context.make_array(signature.args[0])(context, builder, args[0])
    ary.meminfo = ir.Constant(ary.meminfo.type, None)
    return ary._getvalue()
