"""SIMD building blocks of the Numba kernels (imported by the kernel modules of this package only).

:class:`Vec` is an LLVM vector of one register (``VECTOR_BYTES``: 64 with AVX-512, 32 with AVX,
else 16) of float32 or float64, with loads/stores from contiguous rows (:func:`vload`,
:func:`vstore`), :func:`vzeros`, :func:`vsplat`, :func:`vmadd` (``acc + x * y``, fused where the CPU
has FMA: linear attention's products) and :func:`vsum`; plus the flat-buffer loads/stores,
negation and (de)interleaving shuffles the rotation kernel's ``rotate_pairs_simd`` uses; and for
linear attention's row loads the vector feature maps (:func:`vfeature`) and ``llvm.prefetch``
(:data:`prefetch_read`, :data:`prefetch_write`).
"""

from __future__ import annotations

import inspect
import llvmlite.binding as ll
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils, config, errors
from numba.core.imputils import lower_builtin
from numba.extending import intrinsic, models, register_model, type_callable

from .linking import HELPER_PIPELINE


#: jit options of an @overload implementation here and in the kernel modules: no C-callable wrapper (an
#: overload has no Python one already). A wrapper is more code for LLVM to optimise and generate, with the
#: function, in every caller's module; together ~1.7 s of linear attention's first call. Compiled for linking
#: only (:mod:`.linking`: no machine code of its own, which no caller runs).
OVERLOAD_JIT = {"no_cfunc_wrapper": True, "pipeline_class": HELPER_PIPELINE}
#: @njit options of a helper called only from other kernels: cached, no Python or C entry point (as above;
#: the Python wrappers were another ~1.2 s). Calling such a helper from Python crashes the interpreter:
#: tests call them from a jitted function (or test ``.py_func``).
HELPER_JIT = {"cache": True, "no_cpython_wrapper": True, "no_cfunc_wrapper": True, "pipeline_class": HELPER_PIPELINE}
#: @njit options of a helper that allocates nothing (HELPER_JIT without the NRT: no reference counting of the
#: row views it makes, each an incref/decref call on a null meminfo for the kernels' borrowed arrays)
LEAF_JIT = {**HELPER_JIT, "_nrt": False}
#: @njit options of a kernel the backend calls from Python: cached, its Python wrapper but no C-callable one
#: (nothing takes a kernel's address; the wrapper was ~0.1-0.2 s of linear attention's first call)
KERNEL_JIT = {"cache": True, "no_cfunc_wrapper": True}


# -- SIMD vectors for the chunk products -----------------------------------------------------------
def _vector_bytes():
    """Bytes of the widest vector register of the compile target: 64 with AVX-512, 32 with AVX, else 16."""
    features = config.CPU_FEATURES
    if features is None:
        features = "" if config.CPU_NAME not in (None, "host") else ll.get_host_cpu_features().flatten()
    for flag, size in (("+avx512f", 64), ("+avx", 32)):
        if flag in features.split(","):
            return size
    return 16


#: size of one :class:`Vec` in bytes (one register; 16 float32 or 8 float64 lanes with AVX-512)
VECTOR_BYTES = _vector_bytes()


class Vec(types.Type):
    """An LLVM vector of ``VECTOR_BYTES`` bytes of float32 or float64: a value kept in one register.

    Only :func:`vload`, :func:`vstore`, :func:`vsplat`, :func:`vmadd` and :func:`vsum` use it, so
    LLVM sees the register tiles of :func:`madd_tile` as vector values instead of scalars it would
    have to re-vectorise. In pure Python (``py_func``) the same functions work on NumPy arrays.
    """

    def __init__(self, dtype):
        self.dtype = dtype
        self.lanes = VECTOR_BYTES // (dtype.bitwidth // 8)
        super().__init__(name=f"Vec({dtype} x {self.lanes})")


@register_model(Vec)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, ir.VectorType(dmm.lookup(fe_type.dtype).get_value_type(), fe_type.lanes))


def _element_pointer(context, builder, row_type, row, index_type, index):
    ary = context.make_array(row_type)(context, builder, row)
    return builder.gep(ary.data, [context.cast(builder, index, index_type, types.intp)], inbounds=True)


def _check_row(row):
    if not (isinstance(row, types.Array) and row.ndim == 1 and row.layout == "C"
            and row.dtype in (types.float32, types.float64)):
        raise errors.TypingError(f"a contiguous 1-D float32/float64 array is required, got {row}")


@intrinsic
def _vload(typingctx, row, j):
    _check_row(row)
    vec = Vec(row.dtype)

    def codegen(context, builder, signature, args):
        ptr = _element_pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        vec_ptr = builder.bitcast(ptr, context.get_value_type(vec).as_pointer())
        return builder.load(vec_ptr, align=row.dtype.bitwidth // 8)

    return vec(row, j), codegen


@intrinsic
def _vstore(typingctx, row, j, value):
    _check_row(row)

    def codegen(context, builder, signature, args):
        ptr = _element_pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        builder.store(args[2], builder.bitcast(ptr, args[2].type.as_pointer()), align=row.dtype.bitwidth // 8)
        return context.get_dummy_value()

    return types.none(row, j, value), codegen


@intrinsic
def _vsplat(typingctx, x):
    vec = Vec(x)

    def codegen(context, builder, signature, args):
        vec_type = context.get_value_type(vec)
        first = builder.insert_element(ir.Constant(vec_type, ir.Undefined), args[0], ir.Constant(ir.IntType(32), 0))
        lanes0 = ir.Constant(ir.VectorType(ir.IntType(32), vec.lanes), [0] * vec.lanes)
        return builder.shuffle_vector(first, ir.Constant(vec_type, ir.Undefined), lanes0)

    return vec(x), codegen


@intrinsic
def _vmadd(typingctx, acc, x, y):
    def codegen(context, builder, signature, args):
        contract = ("contract",)   # fused where the CPU has FMA, else one multiply and one add
        return builder.fadd(args[0], builder.fmul(args[1], args[2], flags=contract), flags=contract)

    return acc(acc, x, y), codegen


@intrinsic
def _vsum(typingctx, value):
    def codegen(context, builder, signature, args):
        total = builder.extract_element(args[0], ir.Constant(ir.IntType(32), 0))
        for lane in range(1, value.lanes):
            total = builder.fadd(total, builder.extract_element(args[0], ir.Constant(ir.IntType(32), lane)))
        return total

    return value.dtype(value), codegen


@intrinsic
def _vload_widened(typingctx, row, j):
    _check_row(row)
    vec = Vec(types.float64)

    def codegen(context, builder, signature, args):
        ptr = _element_pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        narrow = ir.VectorType(context.get_value_type(row.dtype), vec.lanes)
        value = builder.load(builder.bitcast(ptr, narrow.as_pointer()), align=row.dtype.bitwidth // 8)
        return value if row.dtype == types.float64 else builder.fpext(value, context.get_value_type(vec))

    return vec(row, j), codegen


def vload_widened(row, j):
    """The float64 vector row[j : j + lanes of float64] (row: contiguous 1-D float32, widened exactly, or
    float64)."""
    return row[j:j + VECTOR_BYTES // 8].astype(np.float64)


def lanes(row):
    """Lanes of one vector of row's dtype (16 float32 or 8 float64 with AVX-512)."""
    return VECTOR_BYTES // row.itemsize


def vload(row, j):
    """The vector row[j : j + lanes] (row: contiguous 1-D float32/float64)."""
    return row[j:j + lanes(row)].copy()


def vstore(row, j, value):
    """row[j : j + lanes] = value."""
    row[j:j + value.shape[0]] = value


def vzeros(row):
    """A vector of zeros of row's dtype."""
    return np.zeros(lanes(row), row.dtype)


def vsplat(x):
    """The vector (x, x, ..., x)."""
    return np.full(VECTOR_BYTES // np.asarray(x).itemsize, x)


def vmadd(acc, x, y):
    """acc + x * y lane by lane: a fused multiply-add where the CPU has one (rounded once), else one multiply
    then one add. Matrix products only; the rotation kernel keeps its unfused multiply and add."""
    return acc + x * y


def vsum(value):
    """value[0] + value[1] + ... + value[lanes - 1], left to right."""
    total = value[0]
    for lane in range(1, value.shape[0]):
        total += value[lane]
    return total


def vany_nan(value):
    """Whether some lane of value is NaN (one unordered compare of the vector with itself and a mask test)."""
    return bool(np.isnan(value).any())


def lowered_in_place(python_func, definition):
    """Type and lower compiled calls of ``python_func`` as the intrinsic-style ``definition(typingctx,
    *arg_types) -> (signature, codegen)`` does, emitted at each call site, like :func:`numba.extending.intrinsic`
    (an @overload would compile a function of its own per signature: ~0.05 s each). ``python_func`` stays
    the plain Python function (NumPy semantics) that ``.py_func`` tests run."""
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


def _lanes_definition(typingctx, row):
    count = VECTOR_BYTES // (row.dtype.bitwidth // 8)
    return types.intp(row), lambda context, builder, signature, args: context.get_constant(types.intp, count)


def _vzeros_definition(typingctx, row):
    vec = Vec(row.dtype)

    def codegen(context, builder, signature, args):
        return ir.Constant(context.get_value_type(vec), [0.0] * vec.lanes)

    return vec(row), codegen


def _vany_nan_definition(typingctx, value):
    def codegen(context, builder, signature, args):
        unordered = builder.fcmp_unordered("uno", args[0], args[0])   # <lanes x i1>: true where NaN
        mask = builder.bitcast(unordered, ir.IntType(value.lanes))
        return builder.icmp_unsigned("!=", mask, ir.Constant(ir.IntType(value.lanes), 0))

    return types.boolean(value), codegen


lowered_in_place(lanes, _lanes_definition)
lowered_in_place(vzeros, _vzeros_definition)
lowered_in_place(vany_nan, _vany_nan_definition)
for _func, _intrinsic in ((vload, _vload), (vload_widened, _vload_widened), (vstore, _vstore), (vsplat, _vsplat),
                          (vmadd, _vmadd), (vsum, _vsum)):
    lowered_in_place(_func, _intrinsic._defn)


# -- SIMD rotation of unit-stride head vectors ------------------------------------------------------
def _work_dtype(buf_dtype):
    """The dtype a buffer is computed in: float32 for float16 bits (uint16), else its own."""
    return types.float32 if buf_dtype == types.uint16 else buf_dtype


def _flat_pointer(context, builder, array_type, array, index_type, index):
    """Pointer to element ``index`` of a C-contiguous array counted in its flat (row-major) order."""
    ary = context.make_array(array_type)(context, builder, array)
    return builder.gep(ary.data, [context.cast(builder, index, index_type, types.intp)], inbounds=True)


@intrinsic
def _vload_flat(typingctx, buf, i):
    """The vector buf.flat[i : i + lanes] in the work dtype (float16 bits converted exactly by fpext)."""
    vec = Vec(_work_dtype(buf.dtype))

    def codegen(context, builder, signature, args):
        ptr = _flat_pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        vec_type = context.get_value_type(vec)
        if buf.dtype == types.uint16:
            bits = builder.load(builder.bitcast(ptr, ir.VectorType(ir.IntType(16), vec.lanes).as_pointer()), align=2)
            return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), vec.lanes)), vec_type)
        return builder.load(builder.bitcast(ptr, vec_type.as_pointer()), align=buf.dtype.bitwidth // 8)

    return vec(buf, i), codegen


@intrinsic
def _vstore_flat(typingctx, buf, i, value):
    """buf.flat[i : i + lanes] = value rounded to buf's dtype (float16 bits: fptrunc, to nearest even)."""
    def codegen(context, builder, signature, args):
        ptr = _flat_pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        data = args[2]
        if buf.dtype == types.uint16:
            halves = builder.fptrunc(data, ir.VectorType(ir.HalfType(), value.lanes))
            data = builder.bitcast(halves, ir.VectorType(ir.IntType(16), value.lanes))
            builder.store(data, builder.bitcast(ptr, data.type.as_pointer()), align=2)
        else:
            builder.store(data, builder.bitcast(ptr, data.type.as_pointer()), align=buf.dtype.bitwidth // 8)
        return context.get_dummy_value()

    return types.none(buf, i, value), codegen


def _lane_indices(indices):
    return ir.Constant(ir.VectorType(ir.IntType(32), len(indices)), list(indices))


def _vector_binary(op):
    @intrinsic
    def _binary(typingctx, x, y):
        def codegen(context, builder, signature, args):
            return getattr(builder, op)(args[0], args[1])
        return x(x, y), codegen
    return _binary


_vmul, _vadd, _vsub = _vector_binary("fmul"), _vector_binary("fadd"), _vector_binary("fsub")


def neg_if(x, negate):
    """-x where ``negate`` is true, else x (a float or a :class:`Vec`; compiled without a branch: the sign bits
    XORed with the flag, fneg's bits exactly). A branch there made LLVM copy each loop around it once per flag
    value (apply_qk's rotation: 3372 -> 2182 instructions, and LLVM's time with them)."""
    return -x if negate else x


def _neg_if_definition(typingctx, x, negate):
    dtype, lanes = (x.dtype, x.lanes) if isinstance(x, Vec) else (x, None)
    if not (isinstance(dtype, types.Float) and isinstance(negate, (types.Boolean, types.Integer))):
        raise errors.TypingError(f"neg_if takes a float or a vector and a flag, got {x}, {negate}")

    def codegen(context, builder, signature, args):
        bits = ir.IntType(dtype.bitwidth)
        flag = context.cast(builder, args[1], signature.args[1], types.boolean)
        sign = builder.select(flag, ir.Constant(bits, 1 << (dtype.bitwidth - 1)), ir.Constant(bits, 0))
        if lanes is None:
            return builder.bitcast(builder.xor(builder.bitcast(args[0], bits), sign), args[0].type)
        lanes_type = ir.VectorType(bits, lanes)
        mask = builder.insert_element(ir.Constant(lanes_type, ir.Undefined), sign, ir.Constant(ir.IntType(32), 0))
        mask = builder.shuffle_vector(mask, ir.Constant(lanes_type, ir.Undefined), _lane_indices([0] * lanes))
        return builder.bitcast(builder.xor(builder.bitcast(args[0], lanes_type), mask), args[0].type)

    return x(x, negate), codegen


lowered_in_place(neg_if, _neg_if_definition)


@intrinsic
def _vdeinterleave(typingctx, lo, hi):
    """(even lanes, odd lanes) of the 2 * lanes values lo ++ hi."""
    pair = types.UniTuple(lo, 2)

    def codegen(context, builder, signature, args):
        n = lo.lanes
        even = builder.shuffle_vector(args[0], args[1], _lane_indices([2 * j for j in range(n)]))
        odd = builder.shuffle_vector(args[0], args[1], _lane_indices([2 * j + 1 for j in range(n)]))
        return context.make_tuple(builder, pair, [even, odd])

    return pair(lo, hi), codegen


@intrinsic
def _vinterleave(typingctx, even, odd):
    """(first lanes, last lanes) of even[0], odd[0], even[1], odd[1], ..."""
    pair = types.UniTuple(even, 2)

    def codegen(context, builder, signature, args):
        n = even.lanes
        order = [j // 2 + (n if j % 2 else 0) for j in range(2 * n)]
        lo = builder.shuffle_vector(args[0], args[1], _lane_indices(order[:n]))
        hi = builder.shuffle_vector(args[0], args[1], _lane_indices(order[n:]))
        return context.make_tuple(builder, pair, [lo, hi])

    return pair(even, odd), codegen


# -- SIMD feature maps of linear attention -----------------------------------------------------------
def _constant(llvm_type, value):
    """value as an LLVM constant of a scalar or vector (every lane) type."""
    if isinstance(llvm_type, ir.VectorType):
        return ir.Constant(llvm_type, [value] * llvm_type.count)
    return ir.Constant(llvm_type, value)


def exp_f32_ir(builder, v):
    """exp of a float32 value or vector (Cephes expf): x = min(max(v, -87), 88) with Python's min/max semantics
    (a NaN stays NaN), x = n ln2 + r (|r| <= ln2/2, ln2 in two parts), exp(r) by a degree-7 polynomial, times 2**n
    by its exponent bits; within 2 ulp on [-87, 88]. Straight-line IR LLVM vectorises."""
    vec_type = v.type
    lanes = vec_type.count if isinstance(vec_type, ir.VectorType) else None
    i32 = ir.IntType(32) if lanes is None else ir.VectorType(ir.IntType(32), lanes)
    c = builder.select(builder.fcmp_ordered("<", v, _constant(vec_type, -87.0)), _constant(vec_type, -87.0), v)
    c = builder.select(builder.fcmp_ordered(">", c, _constant(vec_type, 88.0)), _constant(vec_type, 88.0), c)
    floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec_type, [vec_type]),
                                           "llvm.floor.f32" if lanes is None else f"llvm.floor.v{lanes}f32")
    n = builder.call(floor, [builder.fadd(builder.fmul(c, _constant(vec_type, 1.44269504088896341)),
                                          _constant(vec_type, 0.5))])
    r = builder.fadd(builder.fsub(c, builder.fmul(n, _constant(vec_type, 0.693359375))),
                     builder.fmul(n, _constant(vec_type, 2.12194440e-4)))
    p = builder.fadd(builder.fmul(_constant(vec_type, 1.9875691500e-4), r), _constant(vec_type, 1.3981999507e-3))
    for coefficient in (8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = builder.fadd(builder.fmul(p, r), _constant(vec_type, coefficient))
    p = builder.fadd(builder.fadd(builder.fmul(p, builder.fmul(r, r)), r), _constant(vec_type, 1.0))
    bits = builder.shl(builder.add(builder.fptosi(n, i32), _constant(i32, 127)), _constant(i32, 23))
    return builder.fmul(p, builder.bitcast(bits, vec_type))


def relu_ir(builder, v):
    """v where v > 0, else v * 0 (-0.0 for negative v, NaN stays NaN), and -0.0 for -inf (not -inf * 0 = NaN)."""
    zero, neg_zero, neg_inf = (_constant(v.type, value) for value in (0.0, -0.0, float("-inf")))
    below = builder.select(builder.fcmp_ordered("==", v, neg_inf), neg_zero, builder.fmul(v, zero))
    return builder.select(builder.fcmp_ordered(">", v, zero), v, below)


def feature_ir(context, builder, v, dtype, feature_map, feature_map_type):
    """phi(v) of a float value or vector for the run-time ``feature_map``: 0 identity, 1 elu(v) + 1 (v + 1 where
    v > 0, else exp(v): :func:`exp_f32_ir` for float32, Numba's own ``np.exp`` for a float64 value; a float64
    vector has no elu form, see :func:`vfeature_covers`), 2 :func:`relu_ir`."""
    code = context.cast(builder, feature_map, feature_map_type, types.int64)
    other = builder.select(builder.icmp_signed("==", code, ir.Constant(ir.IntType(64), 2)), relu_ir(builder, v), v)
    if dtype == types.float64 and isinstance(v.type, ir.VectorType):
        return other
    with builder.if_else(builder.icmp_signed("==", code, ir.Constant(ir.IntType(64), 1))) as (elu, not_elu):
        with elu:
            if dtype == types.float32:
                e = exp_f32_ir(builder, v)
            else:
                e = context.get_function(np.exp, types.float64(types.float64))(builder, [v])
            positive = builder.fcmp_ordered(">", v, _constant(v.type, 0.0))
            elu_value = builder.select(positive, builder.fadd(v, _constant(v.type, 1.0)), e)
            elu_block = builder.block
        with not_elu:
            not_elu_block = builder.block
    result = builder.phi(v.type)
    result.add_incoming(elu_value, elu_block)
    result.add_incoming(other, not_elu_block)
    return result


def vfeature_covers(row, feature_map):
    """True when :func:`vfeature` has a vector form for this work dtype and feature map."""
    return False


def _vfeature_covers_definition(typingctx, row, feature_map):
    def codegen(context, builder, signature, args):
        if _work_dtype(row.dtype) == types.float32:
            return context.get_constant(types.boolean, True)
        one = context.get_constant(feature_map, 1)
        return builder.icmp_signed("!=", args[1], one)

    if not isinstance(feature_map, types.Integer):
        raise errors.TypingError(f"feature_map must be an integer, got {feature_map}")
    return types.boolean(row, feature_map), codegen


lowered_in_place(vfeature_covers, _vfeature_covers_definition)


def vfeature(x, feature_map):
    """phi(x) lane by lane (0 identity, 1 elu + 1 (float32 only), 2 relu), bit for bit the scalar form. Compiled,
    lowered in place (:func:`feature_ir`)."""
    return x


def _vfeature_definition(typingctx, x, feature_map):
    if not (isinstance(x, Vec) and isinstance(feature_map, types.Integer)):
        raise errors.TypingError(f"vfeature takes a vector and an integer feature map, got {x}, {feature_map}")

    def codegen(context, builder, signature, args):
        return feature_ir(context, builder, args[0], x.dtype, args[1], signature.args[1])

    return x(x, feature_map), codegen


lowered_in_place(vfeature, _vfeature_definition)


# -- software prefetch ---------------------------------------------------------------------------------
def emit_prefetch(context, builder, array_type, array, index_type, index, write):
    """Emit ``llvm.prefetch`` of the cache line of array.flat[index] (C-contiguous), for writing if ``write``."""
    ptr = _flat_pointer(context, builder, array_type, array, index_type, index)
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fn = builder.module.declare_intrinsic("llvm.prefetch", [i8p], ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]))
    # (address, read 0 / write 1, locality 3: keep in all cache levels, data cache)
    builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, int(write)), ir.Constant(i32, 3), ir.Constant(i32, 1)])


def _prefetch_intrinsic(write):
    @intrinsic
    def _prefetch(typingctx, buf, i):
        def codegen(context, builder, signature, args):
            emit_prefetch(context, builder, signature.args[0], args[0], signature.args[1], args[1], write)
            return context.get_dummy_value()

        return types.none(buf, i), codegen
    return _prefetch


#: ``prefetch_read(buf, i)`` / ``prefetch_write(buf, i)``: ask the CPU to bring the cache line of buf.flat[i]
#: in (``llvm.prefetch``, a hint that never faults), for reading / for writing (exclusive state). Intrinsics:
#: compiled code only (callers wrap them in a function with a pure-Python form, see ``prefetch_row``).
prefetch_read, prefetch_write = _prefetch_intrinsic(write=False), _prefetch_intrinsic(write=True)


# -- non-temporal (streaming) stores ------------------------------------------------------------------
def _stream_store_definition(align):
    """The definition of buf.flat[i : i + lanes] = value by a non-temporal store (``!nontemporal``: written around
    the caches, no read for ownership of the line) at an address aligned to ``align`` bytes; the stores are
    weakly ordered until :func:`store_fence`. Below the vector's size (16: NumPy's alignment of its arrays),
    LLVM writes the vector by 128-bit non-temporal stores (MOVNTPS/MOVNTPD), as fast here as whole-vector ones."""
    def definition(typingctx, buf, i, value):
        def codegen(context, builder, signature, args):
            ptr = _flat_pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
            store = builder.store(args[2], builder.bitcast(ptr, args[2].type.as_pointer()), align=align)
            store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
            return context.get_dummy_value()

        return types.none(buf, i, value), codegen
    return definition


def _aligned_definition(nbytes):
    """The definition of: whether the address of buf.flat[i] is a multiple of ``nbytes`` (a power of two)."""
    def definition(typingctx, buf, i):
        def codegen(context, builder, signature, args):
            ptr = _flat_pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
            low = builder.and_(builder.ptrtoint(ptr, ir.IntType(64)), ir.Constant(ir.IntType(64), nbytes - 1))
            return builder.icmp_unsigned("==", low, ir.Constant(ir.IntType(64), 0))

        return types.boolean(buf, i), codegen
    return definition


def _store_fence_definition(typingctx):
    """``sfence`` on x86 (orders the non-temporal stores before every later store), a full fence elsewhere."""
    def codegen(context, builder, signature, args):
        if "x86" in (ll.get_process_triple() or ""):
            fn = builder.module.declare_intrinsic("llvm.x86.sse.sfence", (), ir.FunctionType(ir.VoidType(), []))
            builder.call(fn, [])
        else:
            builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.none(), codegen


def vstore_stream(buf, i, value):
    """buf.flat[i : i + lanes] = value, compiled as a non-temporal store (see ``_stream_store_definition``)."""
    buf.reshape(-1)[i:i + value.shape[0]] = value


def is_aligned(buf, i):
    """Whether the address of buf.flat[i] is a multiple of VECTOR_BYTES."""
    return (buf.ctypes.data + i * buf.itemsize) % VECTOR_BYTES == 0


def store_fence():
    """Orders the non-temporal stores before every later store (nothing to do in pure Python)."""


def vstore_stream16(buf, i, value):
    """buf[i : i + lanes] = value by non-temporal stores at a 16-byte aligned address (see :func:`vstore_stream`)."""
    buf[i:i + len(value)] = value


def is_aligned16(buf, i):
    """Whether buf.flat[i] starts on a 16-byte boundary."""
    return buf[i:].ctypes.data % 16 == 0


def vcopy_flat(src, si, dst, di):
    """dst.flat[di : di + lanes] = src.flat[si : si + lanes], bit for bit (a register of the buffers' own dtype,
    float16 bits too; no index wraparound checks, unlike element indexing, which kept LLVM from vectorising a
    copy loop)."""
    n = VECTOR_BYTES // src.itemsize
    dst[di:di + n] = src[si:si + n]


def _vcopy_flat_definition(typingctx, src, si, dst, di):
    if not (isinstance(src, types.Array) and isinstance(dst, types.Array) and src.dtype == dst.dtype):
        return None
    item = src.dtype.bitwidth // 8

    def codegen(context, builder, signature, args):
        source = _flat_pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        target = _flat_pointer(context, builder, signature.args[2], args[2], signature.args[3], args[3])
        vec_type = ir.VectorType(context.get_value_type(src.dtype), VECTOR_BYTES // item).as_pointer()
        value = builder.load(builder.bitcast(source, vec_type), align=item)
        builder.store(value, builder.bitcast(target, vec_type), align=item)
        return context.get_dummy_value()

    return types.none(src, si, dst, di), codegen


lowered_in_place(vcopy_flat, _vcopy_flat_definition)
lowered_in_place(vstore_stream, _stream_store_definition(VECTOR_BYTES))
lowered_in_place(vstore_stream16, _stream_store_definition(16))
lowered_in_place(is_aligned16, _aligned_definition(16))
lowered_in_place(is_aligned, _aligned_definition(VECTOR_BYTES))
lowered_in_place(store_fence, _store_fence_definition)


# -- register transposition of square blocks -----------------------------------------------------------
def _vtranspose_definition(typingctx, src, si, s_stride, dest, di, d_stride):
    """dest.flat[di + c * d_stride + r] = src.flat[si + r * s_stride + c] for r, c < lanes: one lanes x lanes
    block transposed in registers (lanes loads, log2(lanes) stages of lanes shuffles, lanes stores). At the
    stage of block size s, each 2s x 2s block swaps its upper-right and lower-left s x s blocks."""
    vec = Vec(src.dtype)
    n = vec.lanes

    def codegen(context, builder, signature, args):
        vec_type = context.get_value_type(vec)
        src_ptr = _flat_pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        dest_ptr = _flat_pointer(context, builder, signature.args[3], args[3], signature.args[4], args[4])
        s_stride = context.cast(builder, args[2], signature.args[2], types.intp)
        d_stride = context.cast(builder, args[5], signature.args[5], types.intp)
        align = src.dtype.bitwidth // 8
        rows = []
        for r in range(n):
            ptr = builder.gep(src_ptr, [builder.mul(s_stride, ir.Constant(s_stride.type, r))], inbounds=True)
            rows.append(builder.load(builder.bitcast(ptr, vec_type.as_pointer()), align=align))
        size = 1
        while size < n:
            low = [lane if not lane & size else n + lane - size for lane in range(n)]
            high = [lane + size if not lane & size else n + lane for lane in range(n)]
            for i in range(n):
                if i & size:
                    continue
                a, b = rows[i], rows[i + size]
                rows[i] = builder.shuffle_vector(a, b, _lane_indices(low))
                rows[i + size] = builder.shuffle_vector(a, b, _lane_indices(high))
            size *= 2
        for c in range(n):
            ptr = builder.gep(dest_ptr, [builder.mul(d_stride, ir.Constant(d_stride.type, c))], inbounds=True)
            builder.store(rows[c], builder.bitcast(ptr, vec_type.as_pointer()), align=align)
        return context.get_dummy_value()

    if not (isinstance(src, types.Array) and isinstance(dest, types.Array) and src.dtype == dest.dtype
            and src.dtype in (types.float32, types.float64) and src.layout == "C" and dest.layout == "C"):
        raise errors.TypingError(f"vtranspose takes two C-contiguous float32/float64 arrays, got {src}, {dest}")
    return types.none(src, si, s_stride, dest, di, d_stride), codegen


def vtranspose(src, si, s_stride, dest, di, d_stride):
    """Transpose one lanes x lanes block: dest.flat[di + c * d_stride + r] = src.flat[si + r * s_stride + c]."""
    n = VECTOR_BYTES // src.itemsize
    s, d = src.reshape(-1), dest.reshape(-1)
    for r in range(n):
        for c in range(n):
            d[di + c * d_stride + r] = s[si + r * s_stride + c]


lowered_in_place(vtranspose, _vtranspose_definition)
