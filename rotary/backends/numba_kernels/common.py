"""What every Numba kernel of the ``numba`` backend shares (the counterpart of ``cuda_kernels/rotary_common.cuh``).

Every array reaches a kernel as a flat 1-D buffer plus int64 element offsets and strides (see
:func:`element_offset`), so any strided view (BSHD, BHSD, negative strides, ``out is x``) is read
and written in place, and index arithmetic is int64 whatever the size. float16 data arrives as its
uint16 bit pattern and is converted to float32 in registers (:func:`load` / :func:`store`).
:func:`borrowed` drops an array's meminfo for the duration of a call (no incref/decref per view).
"""

from __future__ import annotations

import operator

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import errors
from numba.extending import lower_builtin, type_callable

from .simd import float_to_half_ir, half_to_float_ir, lowered_in_place

# geometry columns of one rotate item: heads, then (offset, sB, sS, sH, sD) of x and of out, copy_tail (a separate
# output), stream (a separate output large enough for non-temporal stores, see rotation.STREAM_MIN_BYTES)
GEO_HEADS, GEO_X, GEO_OUT, GEO_COPY_TAIL, GEO_STREAM, GEO_COLUMNS = 0, 1, 6, 11, 12, 13


# -- element loads and stores: flat index, float16 bits converted exactly (integer operations) -----------------
def load(buf, i):
    """buf.flat[i] in the work dtype (float16 bits (uint16) -> float32, float32/float64 unchanged); compiled on a
    C-contiguous buffer, i in 0..size-1 addresses the element directly (no wraparound test in the loops)."""
    value = buf.reshape(-1)[i]
    return np.float32(value.view(np.float16)) if buf.dtype == np.uint16 else value


def store(buf, i, value):
    """buf.flat[i] = value rounded to buf's dtype (float16 bits for a uint16 buffer: via float32, to nearest even)."""
    flat = buf.reshape(-1)
    flat[i] = np.float16(np.float32(value)).view(np.uint16) if buf.dtype == np.uint16 else value


def _element_pointer(context, builder, array_type, array, index_type, index):
    """Pointer to buf.flat[index] of a C-contiguous array; None for another layout (Numba's own indexing then)."""
    if array_type.layout != "C":
        return None
    ary = context.make_array(array_type)(context, builder, array)
    return builder.gep(ary.data, [context.cast(builder, index, index_type, types.intp)], inbounds=True)


def _load_definition(typingctx, buf, i):
    if not (isinstance(buf, types.Array) and (buf.layout == "C" or buf.ndim == 1) and isinstance(i, types.Integer)):
        raise errors.TypingError(f"load reads a C-contiguous or 1-D array at an integer index, got {buf}, {i}")
    half = buf.dtype == types.uint16

    def codegen(context, builder, signature, args):
        ptr = _element_pointer(context, builder, *signature.args[:1], args[0], signature.args[1], args[1])
        value = (builder.load(ptr) if ptr is not None
                 else context.get_function(operator.getitem, buf.dtype(*signature.args))(builder, args))
        return half_to_float_ir(builder, value) if half else value

    return (types.float32 if half else buf.dtype)(buf, i), codegen


def _store_definition(typingctx, buf, i, value):
    if not (isinstance(buf, types.Array) and (buf.layout == "C" or buf.ndim == 1) and isinstance(i, types.Integer)
            and isinstance(value, types.Number)):
        raise errors.TypingError(f"store writes a number into a C-contiguous or 1-D array, got {buf}, {i}, {value}")

    def codegen(context, builder, signature, args):
        array_type, index_type, value_type = signature.args
        if array_type.dtype == types.uint16:
            item = float_to_half_ir(builder, context.cast(builder, args[2], value_type, types.float32))
        else:
            item = context.cast(builder, args[2], value_type, array_type.dtype)
        ptr = _element_pointer(context, builder, array_type, args[0], index_type, args[1])
        if ptr is not None:
            builder.store(item, ptr)
        else:
            setitem = types.none(array_type, index_type, array_type.dtype)
            context.get_function(operator.setitem, setitem)(builder, (args[0], args[1], item))
        return context.get_dummy_value()

    return types.none(buf, i, value), codegen


lowered_in_place(load, _load_definition)
lowered_in_place(store, _store_definition)


# -- index arithmetic ----------------------------------------------------------------------------
def element_offset(offset, stride_b, stride_s, stride_h, b, s, h):
    """Flat index of element (b, s, h, 0): ``offset + b*stride_b + s*stride_s + h*stride_h`` in int64."""
    return np.int64(offset) + np.int64(b) * np.int64(stride_b) + np.int64(s) * np.int64(stride_s) \
        + np.int64(h) * np.int64(stride_h)


def int64_definition(name, combine):
    """The definition of an integer function of int64 values (every argument an integer, cast to int64 first:
    a uint64 loop index wraps as in ``np.int64(i)``), ``combine(builder, values)`` its LLVM instructions."""
    def definition(typingctx, *args):
        for arg in args:
            if not isinstance(arg, types.Integer):
                raise errors.TypingError(f"{name} takes integers, got {arg}")

        def codegen(context, builder, signature, values):
            return combine(builder, [context.cast(builder, v, t, types.int64)
                                     for v, t in zip(values, signature.args)])

        return types.int64(*args), codegen
    return definition


def element_offset_ir(builder, v):
    """The LLVM instructions of :func:`element_offset` on its seven int64 values (offset first)."""
    offset, stride_b, stride_s, stride_h, b, s, h = v
    return builder.add(builder.add(builder.add(offset, builder.mul(b, stride_b)), builder.mul(s, stride_s)),
                       builder.mul(h, stride_h))


def imin(a, b):
    """min(a, b) of two integers, in int64."""
    return np.int64(min(a, b))


def imax(a, b):
    """max(a, b) of two integers, in int64."""
    return np.int64(max(a, b))


# lowered in place, not compiled helpers: a few instructions each (a compiled function of their own, one per
# combination of argument types, cost more first-call time than everything they do)
lowered_in_place(element_offset, int64_definition("element_offset", element_offset_ir))
lowered_in_place(imin, int64_definition("imin", lambda builder, v: builder.select(builder.icmp_signed("<", *v), *v)))
lowered_in_place(imax, int64_definition("imax", lambda builder, v: builder.select(builder.icmp_signed(">", *v), *v)))


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
