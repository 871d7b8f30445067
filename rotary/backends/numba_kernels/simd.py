"""SIMD building blocks of the Numba kernels (imported by the kernel modules of this package only).

Each building block is a plain Python function (NumPy semantics: what runs under ``NUMBA_DISABLE_JIT=1``
or when called from Python) whose compiled calls are typed and lowered in place through Numba's documented
extension API (:func:`lowered_in_place`: ``numba.extending.type_callable`` + ``lower_builtin``). Vectors
are :class:`Vec`: one LLVM vector register of ``VECTOR_BYTES`` bytes.

``VECTOR_BYTES`` follows exactly what Numba compiles for (its rule in ``numba/core/codegen.py``, from its
documented settings): the features are ``NUMBA_CPU_FEATURES`` when set, else the host's (``avx*`` off under
``NUMBA_ENABLE_AVX=0``), whatever ``NUMBA_CPU_NAME`` says; 64 bytes with ``+avx512f``, 32 with ``+avx``,
else 16. Numba keys each cached kernel by its signature and (triple, CPU name, features), so a kernel
cached by a process of another vector width is never loaded. Only the kernels are cached (their machine
code holds every helper they call), never a helper on its own.

float16 travels as uint16 bits, converted to and from float32 by integer operations (:func:`half_to_float_ir`,
:func:`float_to_half_ir`: exact, round to nearest even, NumPy's bits for NaN payloads), never LLVM's
``fpext``/``fptrunc`` of ``half``, which become library calls Numba does not link on targets without F16C.
"""

from __future__ import annotations

import inspect

import llvmlite.binding as ll
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils, config, errors
from numba.extending import lower_builtin, models, register_model, type_callable

from .. import feature_maps

#: @njit options of the kernels the backend calls: cached on disk; NumPy's error model (x / 0 is inf or NaN, as
#: in the NumPy backend, never ZeroDivisionError). The helpers are ``register_jitable``: compiled into each caller.
KERNEL_JIT = {"cache": True, "error_model": "numpy"}


def target_features() -> str:
    """The CPU features Numba compiles for: NUMBA_CPU_FEATURES when set, else the host's (``avx*`` off under
    NUMBA_ENABLE_AVX=0); NUMBA_CPU_NAME does not change them (Numba's own rule)."""
    if config.CPU_FEATURES is not None:
        return config.CPU_FEATURES
    try:
        features = ll.get_host_cpu_features()
    except RuntimeError:
        return ""
    if not config.ENABLE_AVX:
        for name in features:
            if name.startswith("avx"):
                features[name] = False
    return features.flatten()


def vector_bytes(features: str) -> int:
    """Bytes of the widest vector register of a target with these features: 64 (avx512f), 32 (avx), else 16."""
    flags = set(features.split(","))
    return 64 if "+avx512f" in flags else 32 if "+avx" in flags else 16


#: size of one :class:`Vec` in bytes (16 float32 or 8 float64 lanes with AVX-512)
VECTOR_BYTES = vector_bytes(target_features())


class Vec(types.Type):
    """An LLVM vector of ``VECTOR_BYTES`` bytes of float32 or float64: a value kept in one register (in pure
    Python, a NumPy array of that many lanes)."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.lanes = VECTOR_BYTES // (dtype.bitwidth // 8)
        super().__init__(name=f"Vec({dtype} x {self.lanes})")


@register_model(Vec)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, ir.VectorType(dmm.lookup(fe_type.dtype).get_value_type(), fe_type.lanes))


def lowered_in_place(python_func, definition):
    """Type and lower compiled calls of ``python_func`` as ``definition(typingctx, *arg_types) -> (signature,
    codegen)`` says (the shape of a ``numba.extending.intrinsic`` definition), emitted at each call site;
    ``python_func`` stays the plain Python function, which is what runs outside compiled code."""
    @type_callable(python_func)
    def _type(context):
        def typer(*args):
            found = definition(context, *args)
            return None if found is None else found[0].return_type
        typer.pysig = inspect.signature(python_func)   # the arguments as python_func names them (no *args)
        return typer

    @lower_builtin(python_func, types.VarArg(types.Any))
    def _lower(context, builder, signature, args):
        return definition(context.typing_context, *signature.args)[1](context, builder, signature, args)

    return python_func


def _work_dtype(buf_dtype):
    """The dtype a buffer is computed in: float32 for float16 bits (uint16), else its own."""
    return types.float32 if buf_dtype == types.uint16 else buf_dtype


def _constant(llvm_type, value):
    """value as an LLVM constant of a scalar or vector (every lane) type."""
    if isinstance(llvm_type, ir.VectorType):
        return ir.Constant(llvm_type, [value] * llvm_type.count)
    return ir.Constant(llvm_type, value)


def _like(value_type, element):
    """``element`` (an LLVM scalar type) in the shape of value_type (itself or a vector of as many lanes)."""
    return ir.VectorType(element, value_type.count) if isinstance(value_type, ir.VectorType) else element


def _flat_pointer(context, builder, array_type, array, index_type, index):
    """Pointer to element ``index`` of a C-contiguous array counted in its flat (row-major) order."""
    ary = context.make_array(array_type)(context, builder, array)
    return builder.gep(ary.data, [context.cast(builder, index, index_type, types.intp)], inbounds=True)


def _lane_indices(indices):
    return ir.Constant(ir.VectorType(ir.IntType(32), len(indices)), list(indices))


def _check_buffer(buf, what):
    if not (isinstance(buf, types.Array) and buf.layout == "C"
            and buf.dtype in (types.float32, types.float64, types.uint16)):
        raise errors.TypingError(f"{what} takes a C-contiguous float32/float64/float16-bits array, got {buf}")


# -- float16 bits <-> float32 ------------------------------------------------------------------------------
def half_to_float_ir(builder, bits):
    """float32 value(s) of float16 bit patterns (i16 or a vector of them), exactly: the exponent and mantissa
    bits moved into place and the exponent rebiased; subnormals renormalised by one exact float subtraction;
    inf and NaN (payload kept) given the all-ones exponent; the sign bit moved."""
    i32 = _like(bits.type, ir.IntType(32))
    f32 = _like(bits.type, ir.FloatType())
    h = builder.zext(bits, i32)
    o = builder.shl(builder.and_(h, _constant(i32, 0x7FFF)), _constant(i32, 13))
    exponent = builder.and_(o, _constant(i32, 0x0F800000))
    o = builder.add(o, _constant(i32, 112 << 23))
    special = builder.icmp_unsigned("==", exponent, _constant(i32, 0x0F800000))
    o = builder.select(special, builder.add(o, _constant(i32, 112 << 23)), o)
    renormal = builder.fsub(builder.bitcast(builder.add(o, _constant(i32, 1 << 23)), f32),
                            builder.bitcast(_constant(i32, 113 << 23), f32))
    o = builder.select(builder.icmp_unsigned("==", exponent, _constant(i32, 0)), builder.bitcast(renormal, i32), o)
    o = builder.or_(o, builder.shl(builder.and_(h, _constant(i32, 0x8000)), _constant(i32, 16)))
    return builder.bitcast(o, f32)


def float_to_half_ir(builder, value):
    """float16 bit patterns (i16 or a vector) of float32 value(s), rounded to nearest even as NumPy does:
    >= 65520 in magnitude to inf; subnormals by one float addition of 0.5 (the hardware's rounding); NaN to
    0x7c00 | payload >> 13 (0x7c01 when that is 0); the sign bit kept."""
    i32 = _like(value.type, ir.IntType(32))
    f32 = _like(value.type, ir.FloatType())
    f = builder.bitcast(value, i32)
    sign = builder.and_(builder.lshr(f, _constant(i32, 16)), _constant(i32, 0x8000))
    a = builder.and_(f, _constant(i32, 0x7FFFFFFF))
    payload = builder.lshr(builder.and_(a, _constant(i32, 0x7FFFFF)), _constant(i32, 13))
    nan = builder.select(builder.icmp_unsigned("==", payload, _constant(i32, 0)), _constant(i32, 0x7C01),
                         builder.or_(payload, _constant(i32, 0x7C00)))
    special = builder.select(builder.icmp_unsigned(">", a, _constant(i32, 0x7F800000)), nan, _constant(i32, 0x7C00))
    magic = _constant(i32, 126 << 23)   # 0.5: its float32 ulp is the float16 subnormals' spacing
    small = builder.sub(builder.bitcast(builder.fadd(builder.bitcast(a, f32), builder.bitcast(magic, f32)), i32),
                        magic)
    odd = builder.and_(builder.lshr(a, _constant(i32, 13)), _constant(i32, 1))
    normal = builder.lshr(builder.add(builder.add(a, _constant(i32, ((15 - 127) << 23) + 0xFFF)), odd),
                          _constant(i32, 13))
    h = builder.select(builder.icmp_unsigned("<", a, _constant(i32, 113 << 23)), small, normal)
    h = builder.select(builder.icmp_unsigned(">=", a, _constant(i32, 143 << 23)), special, h)
    return builder.trunc(builder.or_(h, sign), _like(value.type, ir.IntType(16)))


# -- vectors --------------------------------------------------------------------------------------------
def lanes(buf):
    """Lanes of one vector of buf's work dtype (16 float32 or 8 float64 with AVX-512)."""
    return VECTOR_BYTES // (4 if buf.dtype == np.uint16 else buf.itemsize)


def _lanes_definition(typingctx, buf):
    count = VECTOR_BYTES // (_work_dtype(buf.dtype).bitwidth // 8)
    return types.intp(buf), lambda context, builder, signature, args: context.get_constant(types.intp, count)


def line_items(buf):
    """Elements of buf's own dtype in a 64-byte cache line (compiled: a constant)."""
    return 64 // buf.itemsize


def vector_items(buf):
    """Elements of buf's own dtype in one vector register (compiled: a constant; float16 bits: 2 * lanes)."""
    return VECTOR_BYTES // buf.itemsize


def _items_definition(nbytes):
    def definition(typingctx, buf):
        count = nbytes // (buf.dtype.bitwidth // 8)
        return types.intp(buf), lambda context, builder, signature, args: context.get_constant(types.intp, count)
    return definition


def vload(buf, i):
    """The vector buf.flat[i : i + lanes] in the work dtype (float16 bits widened exactly); buf C-contiguous."""
    flat = buf.reshape(-1)
    part = flat[i:i + lanes(buf)]
    return part.view(np.float16).astype(np.float32) if buf.dtype == np.uint16 else part.copy()


def _vload_definition(typingctx, buf, i):
    _check_buffer(buf, "vload")
    vec = Vec(_work_dtype(buf.dtype))

    def codegen(context, builder, signature, args):
        ptr = _flat_pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        if buf.dtype == types.uint16:
            bits = builder.load(builder.bitcast(ptr, ir.VectorType(ir.IntType(16), vec.lanes).as_pointer()), align=2)
            return half_to_float_ir(builder, bits)
        return builder.load(builder.bitcast(ptr, context.get_value_type(vec).as_pointer()),
                            align=buf.dtype.bitwidth // 8)

    return vec(buf, i), codegen


def vstore(buf, i, value):
    """buf.flat[i : i + lanes] = value rounded to buf's dtype (float16 bits: to nearest even)."""
    flat = buf.reshape(-1)
    flat[i:i + len(value)] = value.astype(np.float16).view(np.uint16) if buf.dtype == np.uint16 else value


def _store_definition(align=None, nontemporal=False):
    """The definition of buf.flat[i : i + lanes] = value (``align``: the address's alignment in bytes, default
    the element's; ``nontemporal``: written around the caches, weakly ordered until :func:`store_fence`)."""
    def definition(typingctx, buf, i, value):
        _check_buffer(buf, "vstore")

        def codegen(context, builder, signature, args):
            ptr = _flat_pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
            data = float_to_half_ir(builder, args[2]) if buf.dtype == types.uint16 else args[2]
            store = builder.store(data, builder.bitcast(ptr, data.type.as_pointer()),
                                  align=align or buf.dtype.bitwidth // 8)
            if nontemporal:
                store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
            return context.get_dummy_value()

        return types.none(buf, i, value), codegen
    return definition


def vstore_stream(buf, i, value):
    """:func:`vstore` by a non-temporal store at a VECTOR_BYTES-aligned address (:func:`is_aligned`)."""
    vstore(buf, i, value)


def vstore_stream16(buf, i, value):
    """:func:`vstore` by non-temporal stores at a 16-byte aligned address (128-bit MOVNTPS/MOVNTPD below the
    vector's size: NumPy aligns its arrays to 16 bytes)."""
    vstore(buf, i, value)


def is_aligned(buf, i):
    """Whether the address of buf.flat[i] is a multiple of VECTOR_BYTES."""
    return (buf.ctypes.data + i * buf.itemsize) % VECTOR_BYTES == 0


def is_aligned16(buf, i):
    """Whether the address of buf.flat[i] is a multiple of 16."""
    return (buf.ctypes.data + i * buf.itemsize) % 16 == 0


def _aligned_definition(nbytes):
    def definition(typingctx, buf, i):
        def codegen(context, builder, signature, args):
            ptr = _flat_pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
            low = builder.and_(builder.ptrtoint(ptr, ir.IntType(64)), ir.Constant(ir.IntType(64), nbytes - 1))
            return builder.icmp_unsigned("==", low, ir.Constant(ir.IntType(64), 0))

        return types.boolean(buf, i), codegen
    return definition


def store_fence():
    """Orders the non-temporal stores before every later store (``sfence`` on x86, else a full fence)."""


def _store_fence_definition(typingctx):
    def codegen(context, builder, signature, args):
        if "x86" in (ll.get_process_triple() or ""):
            builder.call(builder.module.declare_intrinsic("llvm.x86.sse.sfence", (), ir.FunctionType(ir.VoidType(), [])), [])
        else:
            builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.none(), codegen


def vload_widened(row, j):
    """The float64 vector row[j : j + lanes of float64] (row: contiguous float32, widened exactly, or float64)."""
    return row[j:j + VECTOR_BYTES // 8].astype(np.float64)


def _vload_widened_definition(typingctx, row, j):
    _check_buffer(row, "vload_widened")
    vec = Vec(types.float64)

    def codegen(context, builder, signature, args):
        ptr = _flat_pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        narrow = ir.VectorType(context.get_value_type(row.dtype), vec.lanes)
        value = builder.load(builder.bitcast(ptr, narrow.as_pointer()), align=row.dtype.bitwidth // 8)
        return value if row.dtype == types.float64 else builder.fpext(value, context.get_value_type(vec))

    return vec(row, j), codegen


def vzeros(buf):
    """A vector of zeros of buf's work dtype."""
    return np.zeros(lanes(buf), np.float32 if buf.dtype == np.uint16 else buf.dtype)


def _vzeros_definition(typingctx, buf):
    vec = Vec(_work_dtype(buf.dtype))
    return vec(buf), lambda context, builder, signature, args: ir.Constant(context.get_value_type(vec), [0.0] * vec.lanes)


def vsplat(x):
    """The vector (x, x, ..., x) of x's dtype."""
    return np.full(VECTOR_BYTES // np.asarray(x).itemsize, x)


def _vsplat_definition(typingctx, x):
    vec = Vec(x)

    def codegen(context, builder, signature, args):
        vec_type = context.get_value_type(vec)
        first = builder.insert_element(ir.Constant(vec_type, ir.Undefined), args[0], ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(first, ir.Constant(vec_type, ir.Undefined), _lane_indices([0] * vec.lanes))

    return vec(x), codegen


def vmadd(acc, x, y):
    """acc + x * y lane by lane: fused where the CPU has FMA (rounded once), else a multiply then an add. Matrix
    products only (the rotation keeps its unfused multiply and add)."""
    return acc + x * y


def _vmadd_definition(typingctx, acc, x, y):
    def codegen(context, builder, signature, args):
        contract = ("contract",)
        return builder.fadd(args[0], builder.fmul(args[1], args[2], flags=contract), flags=contract)

    return acc(acc, x, y), codegen


def vadd(x, y):
    """x + y lane by lane."""
    return x + y


def vsub(x, y):
    """x - y lane by lane."""
    return x - y


def vmul(x, y):
    """x * y lane by lane."""
    return x * y


def _binary_definition(op):
    def definition(typingctx, x, y):
        return x(x, y), lambda context, builder, signature, args: getattr(builder, op)(args[0], args[1])
    return definition


def vsum(value):
    """value[0] + value[1] + ... + value[lanes - 1], left to right."""
    total = value[0]
    for lane in range(1, value.shape[0]):
        total += value[lane]
    return total


def _vsum_definition(typingctx, value):
    def codegen(context, builder, signature, args):
        total = builder.extract_element(args[0], ir.Constant(ir.IntType(32), 0))
        for lane in range(1, value.lanes):
            total = builder.fadd(total, builder.extract_element(args[0], ir.Constant(ir.IntType(32), lane)))
        return total

    return value.dtype(value), codegen


def vany_nan(value):
    """Whether some lane of value is NaN (compiled: one unordered compare and a mask test)."""
    return bool(np.isnan(value).any())


def _vany_nan_definition(typingctx, value):
    def codegen(context, builder, signature, args):
        mask = builder.bitcast(builder.fcmp_unordered("uno", args[0], args[0]), ir.IntType(value.lanes))
        return builder.icmp_unsigned("!=", mask, ir.Constant(ir.IntType(value.lanes), 0))

    return types.boolean(value), codegen


def neg_if(x, negate):
    """-x where ``negate`` is true, else x (a float or a vector; compiled without a branch: the sign bits XORed
    with the flag, fneg's bits exactly: a branch made LLVM copy each loop around it once per flag value)."""
    return -x if negate else x


def _neg_if_definition(typingctx, x, negate):
    dtype, count = (x.dtype, x.lanes) if isinstance(x, Vec) else (x, None)
    if not (isinstance(dtype, types.Float) and isinstance(negate, (types.Boolean, types.Integer))):
        raise errors.TypingError(f"neg_if takes a float or a vector and a flag, got {x}, {negate}")

    def codegen(context, builder, signature, args):
        bits = ir.IntType(dtype.bitwidth)
        flag = context.cast(builder, args[1], signature.args[1], types.boolean)
        sign = builder.select(flag, ir.Constant(bits, 1 << (dtype.bitwidth - 1)), ir.Constant(bits, 0))
        if count is None:
            return builder.bitcast(builder.xor(builder.bitcast(args[0], bits), sign), args[0].type)
        lanes_type = ir.VectorType(bits, count)
        mask = builder.insert_element(ir.Constant(lanes_type, ir.Undefined), sign, ir.Constant(ir.IntType(32), 0))
        mask = builder.shuffle_vector(mask, ir.Constant(lanes_type, ir.Undefined), _lane_indices([0] * count))
        return builder.bitcast(builder.xor(builder.bitcast(args[0], lanes_type), mask), args[0].type)

    return x(x, negate), codegen


def vdeinterleave(lo, hi):
    """(even lanes, odd lanes) of the 2 * lanes values lo ++ hi."""
    both = np.concatenate((lo, hi))
    return both[0::2].copy(), both[1::2].copy()


def vinterleave(even, odd):
    """(first lanes, last lanes) of even[0], odd[0], even[1], odd[1], ..."""
    both = np.empty(2 * len(even), even.dtype)
    both[0::2], both[1::2] = even, odd
    return both[:len(even)].copy(), both[len(even):].copy()


def _shuffle_pair_definition(order_of):
    """The definition of a pair of vectors shuffled from a, b by ``order_of(lanes)`` (2 * lanes indices)."""
    def definition(typingctx, a, b):
        pair = types.UniTuple(a, 2)

        def codegen(context, builder, signature, args):
            order = order_of(a.lanes)
            first = builder.shuffle_vector(args[0], args[1], _lane_indices(order[:a.lanes]))
            second = builder.shuffle_vector(args[0], args[1], _lane_indices(order[a.lanes:]))
            return context.make_tuple(builder, pair, [first, second])

        return pair(a, b), codegen
    return definition


def vcopy_flat(src, si, dst, di):
    """dst.flat[di : di + lanes] = src.flat[si : si + lanes], bit for bit (a register of the buffers' own dtype,
    float16 bits too)."""
    n = VECTOR_BYTES // src.itemsize
    dst.reshape(-1)[di:di + n] = src.reshape(-1)[si:si + n]


def _vcopy_flat_definition(typingctx, src, si, dst, di):
    if not (isinstance(src, types.Array) and isinstance(dst, types.Array) and src.dtype == dst.dtype):
        raise errors.TypingError(f"vcopy_flat takes two arrays of one dtype, got {src}, {dst}")
    item = src.dtype.bitwidth // 8

    def codegen(context, builder, signature, args):
        source = _flat_pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        target = _flat_pointer(context, builder, signature.args[2], args[2], signature.args[3], args[3])
        vec_type = ir.VectorType(context.get_value_type(src.dtype), VECTOR_BYTES // item).as_pointer()
        builder.store(builder.load(builder.bitcast(source, vec_type), align=item), builder.bitcast(target, vec_type),
                      align=item)
        return context.get_dummy_value()

    return types.none(src, si, dst, di), codegen


def vtranspose(src, si, s_stride, dest, di, d_stride):
    """Transpose one lanes x lanes block: dest.flat[di + c * d_stride + r] = src.flat[si + r * s_stride + c]
    (compiled: lanes loads, log2(lanes) stages of shuffles, lanes stores)."""
    n = lanes(src)
    s, d = src.reshape(-1), dest.reshape(-1)
    for r in range(n):
        for c in range(n):
            d[di + c * d_stride + r] = s[si + r * s_stride + c]


def _vtranspose_definition(typingctx, src, si, s_stride, dest, di, d_stride):
    """At the stage of block size s, each 2s x 2s block swaps its upper-right and lower-left s x s blocks."""
    if not (isinstance(src, types.Array) and isinstance(dest, types.Array) and src.dtype == dest.dtype
            and src.dtype in (types.float32, types.float64) and src.layout == "C" and dest.layout == "C"):
        raise errors.TypingError(f"vtranspose takes two C-contiguous float32/float64 arrays, got {src}, {dest}")
    vec = Vec(src.dtype)
    n = vec.lanes

    def codegen(context, builder, signature, args):
        vec_ptr = context.get_value_type(vec).as_pointer()
        src_ptr = _flat_pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        dest_ptr = _flat_pointer(context, builder, signature.args[3], args[3], signature.args[4], args[4])
        s_step = context.cast(builder, args[2], signature.args[2], types.intp)
        d_step = context.cast(builder, args[5], signature.args[5], types.intp)
        align = src.dtype.bitwidth // 8
        rows = [builder.load(builder.bitcast(builder.gep(src_ptr, [builder.mul(s_step, ir.Constant(s_step.type, r))],
                                                         inbounds=True), vec_ptr), align=align) for r in range(n)]
        size = 1
        while size < n:
            low = [lane if not lane & size else n + lane - size for lane in range(n)]
            high = [lane + size if not lane & size else n + lane for lane in range(n)]
            for i in range(n):
                if not i & size:
                    a, b = rows[i], rows[i + size]
                    rows[i] = builder.shuffle_vector(a, b, _lane_indices(low))
                    rows[i + size] = builder.shuffle_vector(a, b, _lane_indices(high))
            size *= 2
        for c in range(n):
            ptr = builder.gep(dest_ptr, [builder.mul(d_step, ir.Constant(d_step.type, c))], inbounds=True)
            builder.store(rows[c], builder.bitcast(ptr, vec_ptr), align=align)
        return context.get_dummy_value()

    return types.none(src, si, s_stride, dest, di, d_stride), codegen


# -- software prefetch ---------------------------------------------------------------------------------
def emit_prefetch(context, builder, array_type, array, index_type, index, write):
    """Emit ``llvm.prefetch`` of the cache line of array.flat[index] (C-contiguous), for writing if ``write``:
    a hint that never faults."""
    ptr = _flat_pointer(context, builder, array_type, array, index_type, index)
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fn = builder.module.declare_intrinsic("llvm.prefetch", [i8p], ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]))
    # (address, read 0 / write 1, locality 3: keep in all cache levels, data cache)
    builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, int(write)), ir.Constant(i32, 3), ir.Constant(i32, 1)])


def prefetch_write(buf, i):
    """Ask the CPU for the cache line of buf.flat[i], for writing (nothing in pure Python)."""


def prefetch_read(buf, i):
    """Ask the CPU for the cache line of buf.flat[i], for reading (nothing in pure Python)."""


def _prefetch_definition(write):
    def definition(typingctx, buf, i):
        def codegen(context, builder, signature, args):
            emit_prefetch(context, builder, signature.args[0], args[0], signature.args[1], args[1], write)
            return context.get_dummy_value()

        return types.none(buf, i), codegen
    return definition


def touch_read(buf, i):
    """Read the cache line of buf.flat[i] by a demand load whose value is dropped (compiled: a monotonic atomic load
    of the element's bits, which LLVM never removes, a plain load on x86; nothing in pure Python). Demand loads in
    address order train the hardware prefetchers, which then stream the lines after them; software prefetches
    (:func:`prefetch_read`) do not, and each holds a first-level miss buffer until its line comes."""


def _touch_read_definition(typingctx, buf, i):
    if not (isinstance(buf, types.Array) and buf.layout == "C"):
        raise errors.TypingError(f"touch_read takes a C-contiguous array, got {buf}")
    width = buf.dtype.bitwidth

    def codegen(context, builder, signature, args):
        ptr = _flat_pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        builder.load_atomic(builder.bitcast(ptr, ir.IntType(width).as_pointer()), "monotonic", width // 8)
        return context.get_dummy_value()

    return types.none(buf, i), codegen


# -- feature maps of linear attention (rotary.backends.feature_maps: the reference bits) -------------------
def exp_ir(builder, v, dtype):
    """exp of a float32/float64 value or vector by :mod:`rotary.backends.feature_maps`' algorithm, operation by
    operation (Cephes expf; float64 the same scheme, longer polynomial), no flush below LO. Straight-line IR."""
    lo, hi, log2e, l1, l2, poly = feature_maps.EXP_CONSTANTS[str(dtype)]
    vt = v.type
    int_type = _like(vt, ir.IntType(dtype.bitwidth))
    c = builder.select(builder.fcmp_ordered("<", v, _constant(vt, lo)), _constant(vt, lo), v)
    c = builder.select(builder.fcmp_ordered(">", c, _constant(vt, hi)), _constant(vt, hi), c)
    suffix = (f"v{vt.count}" if isinstance(vt, ir.VectorType) else "") + ("f32" if dtype == types.float32 else "f64")
    floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [vt]), f"llvm.floor.{suffix}")
    n = builder.call(floor, [builder.fadd(builder.fmul(c, _constant(vt, log2e)), _constant(vt, 0.5))])
    r = builder.fadd(builder.fsub(c, builder.fmul(n, _constant(vt, l1))), builder.fmul(n, _constant(vt, l2)))
    p = builder.fadd(builder.fmul(_constant(vt, poly[0]), r), _constant(vt, poly[1]))
    for coefficient in poly[2:]:
        p = builder.fadd(builder.fmul(p, r), _constant(vt, coefficient))
    p = builder.fadd(builder.fadd(builder.fmul(p, builder.fmul(r, r)), r), _constant(vt, 1.0))
    bias, shift = (127, 23) if dtype == types.float32 else (1023, 52)
    n_int = builder.fptosi(builder.select(builder.fcmp_unordered("uno", n, n), _constant(vt, 0.0), n), int_type)
    bits = builder.shl(builder.add(n_int, _constant(int_type, bias)), _constant(int_type, shift))
    return builder.fmul(p, builder.bitcast(bits, vt))


def feature_ir(context, builder, v, dtype, code, code_type):
    """phi(v) of a float value or vector for the run-time feature map ``code`` (feature_maps.CODES): identity;
    relu (v if v > 0 or NaN, else +0.0); elu + 1 (v + 1 if v > 0, v if NaN, +0.0 below LO, else :func:`exp_ir`;
    the exp computed only when the code is elu's)."""
    zero = _constant(v.type, 0.0)
    code = context.cast(builder, code, code_type, types.int64)
    relu = builder.select(builder.fcmp_ordered("<=", v, zero), zero, v)
    other = builder.select(builder.icmp_signed("==", code, ir.Constant(ir.IntType(64), feature_maps.CODES["relu"])),
                           relu, v)
    with builder.if_else(builder.icmp_signed("==", code, ir.Constant(ir.IntType(64), feature_maps.CODES["elu"]))) \
            as (elu, not_elu):
        with elu:
            lo = feature_maps.EXP_CONSTANTS[str(dtype)][0]
            e = builder.select(builder.fcmp_ordered("<", v, _constant(v.type, lo)), zero, exp_ir(builder, v, dtype))
            e = builder.select(builder.fcmp_unordered("uno", v, v), v, e)
            elu_value = builder.select(builder.fcmp_ordered(">", v, zero), builder.fadd(v, _constant(v.type, 1.0)), e)
            elu_block = builder.block
        with not_elu:
            not_elu_block = builder.block
    result = builder.phi(v.type)
    result.add_incoming(elu_value, elu_block)
    result.add_incoming(other, not_elu_block)
    return result


def vexp(x):
    """e^x lane by lane for softmax weights: :func:`exp_ir`'s algorithm (a few ulp), 0 below its LO (-87 float32,
    -708 float64: exp's subnormal range flushed, e^-inf = 0), NaN kept."""
    x = np.asarray(x)
    lo = feature_maps.EXP_CONSTANTS[x.dtype.name][0]
    with np.errstate(invalid="ignore"):
        e = feature_maps.exp_ref(x)
        return np.where(x < lo, x.dtype.type(0.0), e)


def _vexp_definition(typingctx, x):
    if not isinstance(x, Vec):
        raise errors.TypingError(f"vexp takes a vector, got {x}")

    def codegen(context, builder, signature, args):
        v, zero = args[0], _constant(args[0].type, 0.0)
        lo = feature_maps.EXP_CONSTANTS[str(x.dtype)][0]
        e = builder.select(builder.fcmp_ordered("<", v, _constant(v.type, lo)), zero, exp_ir(builder, v, x.dtype))
        return builder.select(builder.fcmp_unordered("uno", v, v), v, e)

    return x(x), codegen


def _by_halves(value, combine):
    v = np.array(value)
    n = v.shape[0]
    while n > 1:
        n //= 2
        v = combine(v[:n], v[n:2 * n])
    return v[0]


def vsum_pairwise(value):
    """The sum of a vector's lanes by halves (lanes 0..n/2-1 plus n/2..n-1, and so on: log2(lanes) adds, not
    the lanes-1 dependent ones of :func:`vsum`)."""
    return _by_halves(value, np.add)


def vmax_lanes(value):
    """The largest lane of value, by halves: lane j against lane j + n/2 (``a if a > b else b``), log2(lanes) times
    (with a NaN lane the result is NaN or the largest other lane: softmax weights are NaN either way)."""
    return _by_halves(value, lambda a, b: np.where(a > b, a, b))


def _by_halves_definition(combine_ir):
    """The definition of a reduction of a vector's lanes by halves, ``combine_ir(builder, v, upper)`` a step."""
    def definition(typingctx, value):
        if not isinstance(value, Vec):
            raise errors.TypingError(f"a reduction of lanes takes a vector, got {value}")

        def codegen(context, builder, signature, args):
            v, n = args[0], value.lanes
            undefined = ir.Constant(v.type, ir.Undefined)
            while n > 1:
                n //= 2
                upper = builder.shuffle_vector(v, undefined,
                                               _lane_indices(list(range(n, 2 * n)) + [0] * (value.lanes - n)))
                v = combine_ir(builder, v, upper)
            return builder.extract_element(v, ir.Constant(ir.IntType(32), 0))

        return value.dtype(value), codegen
    return definition


_NAME_OF_CODE = {code: name for name, code in feature_maps.CODES.items()}


def feature(x, feature_map):
    """phi(x) of a float or a vector for the feature map code ``feature_map`` (feature_maps.CODES), the bits of
    :func:`rotary.backends.feature_maps.feature_map`."""
    x = np.asarray(x)
    result = feature_maps.feature_map(x.reshape(-1), _NAME_OF_CODE[int(feature_map)])
    return result[0] if x.ndim == 0 else result


def _feature_definition(typingctx, x, feature_map):
    dtype = x.dtype if isinstance(x, Vec) else x
    if not (dtype in (types.float32, types.float64) and isinstance(feature_map, types.Integer)):
        raise errors.TypingError(f"feature takes a float or vector and an integer feature map, got {x}, {feature_map}")

    def codegen(context, builder, signature, args):
        return feature_ir(context, builder, args[0], dtype, args[1], signature.args[1])

    return x(x, feature_map), codegen


for _func, _definition in (
        (lanes, _lanes_definition), (line_items, _items_definition(64)),
        (vector_items, _items_definition(VECTOR_BYTES)), (vload, _vload_definition), (vstore, _store_definition()),
        (vstore_stream, _store_definition(VECTOR_BYTES, True)), (vstore_stream16, _store_definition(16, True)),
        (is_aligned, _aligned_definition(VECTOR_BYTES)), (is_aligned16, _aligned_definition(16)),
        (store_fence, _store_fence_definition), (vload_widened, _vload_widened_definition),
        (vzeros, _vzeros_definition), (vsplat, _vsplat_definition), (vmadd, _vmadd_definition),
        (vadd, _binary_definition("fadd")), (vsub, _binary_definition("fsub")), (vmul, _binary_definition("fmul")),
        (vsum, _vsum_definition), (vany_nan, _vany_nan_definition), (neg_if, _neg_if_definition),
        (vdeinterleave, _shuffle_pair_definition(lambda n: [2 * j for j in range(n)] + [2 * j + 1 for j in range(n)])),
        (vinterleave, _shuffle_pair_definition(lambda n: [j // 2 + (n if j % 2 else 0) for j in range(2 * n)])),
        (vcopy_flat, _vcopy_flat_definition), (vtranspose, _vtranspose_definition),
        (prefetch_write, _prefetch_definition(True)), (prefetch_read, _prefetch_definition(False)),
        (touch_read, _touch_read_definition), (feature, _feature_definition),
        (vexp, _vexp_definition),
        (vsum_pairwise, _by_halves_definition(lambda builder, v, upper: builder.fadd(v, upper))),
        (vmax_lanes, _by_halves_definition(
            lambda builder, v, upper: builder.select(builder.fcmp_ordered(">", v, upper), v, upper)))):
    lowered_in_place(_func, _definition)
