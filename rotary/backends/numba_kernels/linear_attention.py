"""Linear-attention kernels of the ``numba`` backend (the counterpart of ``cuda_kernels/linear_attention.cu``).

Linear attention (RoFormer eq. 19, a = phi(q), b = phi(k), hats = rotated)::

    o_t = (a_hat_t . (S0 + sum_s b_hat_s v_s^T)) / (a_t . (z0 + sum_s b_s) + eps)

with s <= t (causal) or all s. The causal form runs in chunks of C tokens: per chunk
``N = A_hat S + tril(A_hat B_hat^T) V``, ``D = A z + rowsum(A * cumsum(B))``, then
``S += B_hat^T V``, ``z += sum B``. The chunk products are register-tiled matrix products written
here (:func:`madd_tile` on :class:`Vec` values, one SIMD register each; no BLAS call from inside the
parallel loop, whose own threads would oversubscribe the cores), with fused multiply-adds where the
CPU has FMA (:func:`vmadd`; the rotation above stays unfused). Chunk products sum in the work
dtype; the carried S, z and the denominators are float64.

Buffers, offsets and float16 bits as in :mod:`.common`; feature rows are rotated by the rotation
kernel's :func:`.rotation.rotate_pairs_simd`.
"""

from __future__ import annotations

import operator

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils, errors
from numba.extending import lower_builtin, register_jitable, type_callable
from numba.np.arrayobj import populate_array

from ..feature_maps import CODES as FEATURE_MAPS
from .common import borrowed, element_offset, element_offset_ir, imax, imin, int64_definition, load, store
from .rotation import rotate_pairs_simd
from .simd import (KERNEL_JIT, VECTOR_BYTES, Vec, emit_prefetch, feature, is_aligned, lanes, lowered_in_place,
                   store_fence, vadd, vany_nan, vload, vload_widened, vmadd, vsplat, vstore, vstore_stream, vsub, vsum,
                   vtranspose, vzeros)

#: rows of one register tile of :func:`madd_tile` (two vectors wide, :func:`tile_width`): 8 with AVX-512 (16
#: accumulators of its 32 registers: each row of b loaded from the second-level cache serves 8 rows, half
#: the b traffic of 4), else 4 (8 of 16 registers). A function of VECTOR_BYTES, hence of the features that key
#: Numba's cache.
TILE_ROWS = 8 if VECTOR_BYTES == 64 else 4


# -- linear attention: buffers -------------------------------------------------------------------------------
def keep_alive(arrays):
    """A use of each array of the tuple ``arrays``: Numba releases a variable after its last use, so a call
    at the end of a kernel keeps the owners of borrowed views alive until then (typed and lowered in place)."""
    return len(arrays)


@type_callable(keep_alive)
def _type_keep_alive(context):
    def typer(arrays):
        if isinstance(arrays, types.BaseTuple):
            return types.intp
    return typer


@lower_builtin(keep_alive, types.BaseTuple)
def _lower_keep_alive(context, builder, signature, args):
    return context.get_constant(types.intp, len(signature.args[0]))


def aligned_zeros(rows, cols, dtype):
    """np.zeros((rows, cols), dtype) starting on a 64-byte (cache line) boundary (Numba's own arrays start on
    32-byte boundaries, where every AVX-512 load and store of a row of the chunk buffers split across two
    cache lines). Compiled: one aligned NRT allocation and a memset (MemoryError when it fails)."""
    flat = np.zeros(rows * cols + 16, dtype)   # 16 elements: >= 64 bytes of slack
    start = (-flat.ctypes.data % 64) // flat.itemsize
    return flat[start:start + rows * cols].reshape((rows, cols))


def _aligned_zeros_definition(typingctx, rows, cols, dtype):
    element = getattr(dtype, "dtype", None) or getattr(dtype, "instance_type", None)
    if not (isinstance(rows, types.Integer) and isinstance(cols, types.Integer) and isinstance(element, types.Float)):
        raise errors.TypingError(f"aligned_zeros takes (rows, cols, float dtype), got ({rows}, {cols}, {dtype})")
    array = types.Array(element, 2, "C")

    def codegen(context, builder, signature, args):
        n_rows, n_cols = (context.cast(builder, value, typ, types.intp) for value, typ in zip(args[:2], signature.args))
        item = context.get_constant(types.intp, context.get_abi_sizeof(context.get_data_type(element)))
        nbytes = builder.mul(builder.mul(n_rows, n_cols), item)
        meminfo = context.nrt.meminfo_alloc_aligned(builder, size=nbytes, align=64)
        data = context.nrt.meminfo_data(builder, meminfo)
        cgutils.memset(builder, data, nbytes, 0)
        out = context.make_array(array)(context, builder)
        populate_array(out, data=builder.bitcast(data, out.data.type), shape=[n_rows, n_cols],
                       strides=[builder.mul(n_cols, item), item], itemsize=item, meminfo=meminfo)
        return out._getvalue()

    return array(rows, cols, dtype), codegen


def padded(n, multiple):
    """n (>= 0) rounded up to a multiple of ``multiple`` (> 0), in int64."""
    return np.int64((n + multiple - 1) // multiple * multiple)


def _padded_ir(builder, values):
    n, multiple = values
    one = ir.Constant(n.type, 1)
    return builder.mul(builder.sdiv(builder.sub(builder.add(n, multiple), one), multiple), multiple)


def tile_width(row):
    """Columns of one register tile of :func:`madd_tile`: two vectors (32 float32 / 16 float64 with AVX-512)."""
    return 2 * lanes(row)


def _tile_width_definition(typingctx, row):
    width = 2 * VECTOR_BYTES // (row.dtype.bitwidth // 8)
    return types.intp(row), lambda context, builder, signature, args: context.get_constant(types.intp, width)


lowered_in_place(aligned_zeros, _aligned_zeros_definition)
lowered_in_place(padded, int64_definition("padded", _padded_ir))
lowered_in_place(tile_width, _tile_width_definition)


# -- linear attention: register tiles ---------------------------------------------------------------------
def madd_tile(a, b, c, i0, j0, depth, accumulate):
    """One register tile of a matrix product, TILE_ROWS rows by two vectors (w = :func:`tile_width`)::

        c[i0+r, j0:j0+w] = (c[i0+r, j0:j0+w] if accumulate else 0) + sum_{k < depth} a[i0+r, k] b[k, j0:j0+w]

    for r < TILE_ROWS, the sum in k order in the work dtype (fused multiply-adds where the CPU has FMA).
    a, b, c: 2-D C-contiguous; the caller keeps the tile's rows and columns inside the (padded) buffers."""
    _madd_tile_py(a, b, c, i0, j0, depth, accumulate, tile_width(c))


def madd_tile_narrow(a, b, c, i0, j0, depth, accumulate):
    """:func:`madd_tile` one vector wide (w = :func:`.simd.lanes`: 16 float32 with AVX-512): the triangle's edge
    tiles, where a second vector would compute columns the product does not need."""
    _madd_tile_py(a, b, c, i0, j0, depth, accumulate, lanes(c))


def _madd_tile_py(a, b, c, i0, j0, depth, accumulate, w):
    rows = TILE_ROWS
    acc = c[i0:i0 + rows, j0:j0 + w].copy() if accumulate else np.zeros((rows, w), c.dtype)
    for k in range(depth):
        acc += a[i0:i0 + rows, k:k + 1] * b[k, j0:j0 + w]
    c[i0:i0 + rows, j0:j0 + w] = acc


def _madd_tile_definition(typingctx, a, b, c, i0, j0, depth, accumulate, vectors=2):
    """``vectors`` * TILE_ROWS vector accumulators kept in registers through the loop over k (allocas LLVM
    promotes): each ``vectors`` vectors loaded from b serve every row, each broadcast of a[i0+r, k] ``vectors``."""
    if not all(isinstance(x, types.Array) and x.ndim == 2 and x.layout == "C" and x.dtype == c.dtype
               and c.dtype in (types.float32, types.float64) for x in (a, b, c)):
        raise errors.TypingError(f"madd_tile takes three 2-D C-contiguous float arrays of one dtype, got {a}, {b}, {c}")
    vec = Vec(c.dtype)

    def codegen(context, builder, signature, args):
        intp, n, item = context.get_value_type(types.intp), vec.lanes, c.dtype.bitwidth // 8
        vec_type = context.get_value_type(vec)
        arrays = [context.make_array(t)(context, builder, v) for t, v in zip(signature.args[:3], args[:3])]
        lda, ldb, ldc = (cgutils.unpack_tuple(builder, ary.shape)[1] for ary in arrays)
        i0_, j0_, depth_ = (context.cast(builder, v, t, types.intp) for v, t in zip(args[3:6], signature.args[3:6]))
        flag = context.cast(builder, args[6], signature.args[6], types.boolean)

        def vec_ptr(ary, index):
            return builder.bitcast(builder.gep(ary.data, [index], inbounds=True), vec_type.as_pointer())

        slots = []
        for r in range(TILE_ROWS):
            row = builder.add(builder.mul(builder.add(i0_, ir.Constant(intp, r)), ldc), j0_)
            for h in range(vectors):
                slot = cgutils.alloca_once(builder, vec_type)
                ptr = vec_ptr(arrays[2], builder.add(row, ir.Constant(intp, h * n)))
                builder.store(builder.select(flag, builder.load(ptr, align=item),
                                             ir.Constant(vec_type, [0.0] * n)), slot)
                slots.append((slot, ptr))
        with cgutils.for_range(builder, depth_) as loop:
            b_row = builder.add(builder.mul(loop.index, ldb), j0_)
            bs = [builder.load(vec_ptr(arrays[1], builder.add(b_row, ir.Constant(intp, h * n))), align=item)
                  for h in range(vectors)]
            for r in range(TILE_ROWS):
                a_ptr = builder.gep(arrays[0].data, [builder.add(builder.mul(builder.add(i0_, ir.Constant(intp, r)), lda),
                                                                 loop.index)], inbounds=True)
                x = builder.load(a_ptr)
                x = builder.shuffle_vector(builder.insert_element(ir.Constant(vec_type, ir.Undefined), x,
                                                                  ir.Constant(ir.IntType(32), 0)),
                                           ir.Constant(vec_type, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), n), [0] * n))
                for h in range(vectors):
                    slot = slots[vectors * r + h][0]
                    product = builder.fmul(x, bs[h], flags=("contract",))
                    builder.store(builder.fadd(builder.load(slot), product, flags=("contract",)), slot)
        for slot, ptr in slots:
            builder.store(builder.load(slot), ptr, align=item)
        return context.get_dummy_value()

    return types.none(a, b, c, i0, j0, depth, accumulate), codegen


lowered_in_place(madd_tile, _madd_tile_definition)
lowered_in_place(madd_tile_narrow, lambda *args: _madd_tile_definition(*args, vectors=1))


@register_jitable
def matmul_tiles(a, b, c, rows, depth, cols):
    """c[:rows, :cols] = a[:rows, :depth] @ b[:depth, :cols] by :func:`madd_tile` (rows and cols rounded up
    to whole tiles: the buffers are padded for that)."""
    width = tile_width(c)
    for i0 in range(0, rows, TILE_ROWS):
        for j0 in range(0, cols, width):
            madd_tile(a, b, c, i0, j0, depth, np.bool_(False))   # a run-time bool: no literal version


@register_jitable
def dot_f64(x, y, n):
    """sum_{j < n} x[j] y[j] in float64 (lanes-wide partial sums of float64 vectors, then across lanes, then the
    last n % lanes terms); x: float32 (each element widened exactly) or float64, y: float64."""
    width = VECTOR_BYTES // 8
    full = n - n % width
    acc = vzeros(y)
    for j in range(0, full, width):
        acc = vmadd(acc, vload_widened(x, j), vload(y, j))
    total = vsum(acc)
    for j in range(full, n):
        total += np.float64(x[j]) * y[j]
    return total


@register_jitable
def causal_row(num_row, a_row, s_work, scores_row, values, inter, i, m, dv):
    """Row i of the causal chunk product again, tokens j <= i only, when the tiled product gave it a
    non-finite entry: the tile also multiplies row i's zero weights of tokens j > i (its block's later
    rows) into their values, and 0 * NaN = NaN leaked a later token's NaN/inf into earlier outputs.
    ``inter`` is the decay factor of the carried state's term (1 without decay)."""
    for c in range(dv):
        acc = 0.0
        for r in range(m):
            acc += a_row[r] * s_work[r, c]
        acc *= inter
        for j in range(i + 1):
            acc += scores_row[j] * values[j, c]
        num_row[c] = acc


@register_jitable(inline="always")
def row_finite(row, n):
    """Whether row[:n] holds no NaN or inf (x - x is 0 exactly for finite x, NaN for inf and NaN: lanes-wide
    partial sums, tested for a NaN lane by one compare, the columns past the last whole vector one by one).
    row: contiguous, float32 or float64."""
    width = lanes(row)
    full = n - n % width
    acc = vzeros(row)
    for c in range(0, full, width):
        x = vload(row, c)
        acc = vadd(acc, vsub(x, x))
    total = 0.0
    for c in range(full, n):
        total += row[c] - row[c]
    return not vany_nan(acc) and total == 0


@register_jitable(inline="always")   # one call site: inlined, no compile of its own
def rotate_features(x, xi, y, yi, cos, sin, row, first, half, rotary_dim, m, interleaved):
    """y.flat[yi:yi+m] = R x.flat[xi:xi+m] for one feature row from pair ``first`` on (the pairs before it done by
    SIMD), table row ``row``: on each pair ``y_a = x_a c - x_b s``, ``y_b = x_b c + x_a s`` (pairs (p, p + half)
    or (2p, 2p + 1)), y_j = x_j from rotary_dim on. Flat indices, no row views (nothing to reference-count)."""
    step, second = (2, 1) if interleaved else (1, half)
    for p in range(first, half):
        c, s = cos[row, p], sin[row, p]
        a = p * step
        xa, xb = load(x, xi + a), load(x, xi + a + second)
        store(y, yi + a, xa * c - xb * s)
        store(y, yi + a + second, xb * c + xa * s)
    for j in range(rotary_dim, m):
        store(y, yi + j, load(x, xi + j))


#: rows the linear-attention row loops fetch ahead of use. One head's rows are H*d elements apart, a
#: stride the hardware prefetcher does not follow, and a row's work leaves no room in the reorder
#: buffer for the next row's loads: without it each row waited out a memory latency.
PREFETCH_ROWS = 4


def prefetch_row(x, g, b, t, h, length, write):
    """Prefetch the cache lines of x[b, t, h, :length] (g: offset and strides of x), for writing if ``write``
    (a literal True or False); a hint, never a fault (nothing in pure Python). Compiled, lowered in place
    (:func:`_prefetch_row_definition`): no function of its own to compile per array type."""


def _prefetch_row_definition(typingctx, x, g, b, t, h, length, write):
    """A line per 64 bytes from element (b, t, h, 0) over the row's span ``(length - 1) * g[4] + 1`` (none if
    the stride is negative), and the last element's line: a row not starting on a line boundary (NumPy
    aligns to 16 bytes) reaches into one line more, where its last vector load waited."""
    if not isinstance(write, types.BooleanLiteral):
        raise errors.TypingError(f"prefetch_row's write must be a literal True or False, got {write}")
    step = 64 // (x.dtype.bitwidth // 8)          # elements per 64-byte cache line

    def codegen(context, builder, signature, args):
        x_type, g_type = signature.args[:2]
        getitem = context.get_function(operator.getitem, g_type.dtype(g_type, types.intp))
        geometry = [context.cast(builder, getitem(builder, (args[1], context.get_constant(types.intp, k))),
                                 g_type.dtype, types.int64) for k in range(5)]
        indices = [context.cast(builder, v, typ, types.int64) for v, typ in zip(args[2:5], signature.args[2:5])]
        base = element_offset_ir(builder, [*geometry[:4], *indices])
        n = context.cast(builder, args[5], signature.args[5], types.int64)
        one = ir.Constant(ir.IntType(64), 1)
        span = builder.add(builder.mul(builder.sub(n, one), geometry[4]), one)
        with cgutils.for_range_slice(builder, ir.Constant(ir.IntType(64), 0), span,
                                     ir.Constant(ir.IntType(64), step), intp=ir.IntType(64)) as (j, _):
            emit_prefetch(context, builder, x_type, args[0], types.int64, builder.add(base, j), write.literal_value)
        with builder.if_then(builder.icmp_signed(">", span, ir.Constant(ir.IntType(64), 0))):
            last = builder.sub(builder.add(base, span), one)
            emit_prefetch(context, builder, x_type, args[0], types.int64, last, write.literal_value)
        return context.get_dummy_value()

    return types.none(x, g, b, t, h, length, write), codegen


lowered_in_place(prefetch_row, _prefetch_row_definition)


@register_jitable(inline="always")   # a few instructions in the row loops: inlined, no compile of its own
def prefetch_ahead(x, g, b, t0, i, n, h, length, ahead):
    """In a row loop ``for i in range(-ahead, n)``: prefetch row t0 + i + ahead of x when it is one of the
    n rows (the first ``ahead`` iterations, i < 0, only prefetch)."""
    if 0 <= i + ahead < n:
        prefetch_row(x, g, b, t0 + i + ahead, h, length, False)


@register_jitable(inline="always")   # a few instructions: inlined, no compile of its own
def next_load(h, first_h, end_h, t, chunk, t_end):
    """(head, first token, rows) of the load after rows t.. of head h in a walk over heads first_h..end_h-1
    inside each chunk of ``chunk`` tokens, chunk after chunk up to token t_end: the next head's rows of
    this chunk, or the first head's rows of the next chunk (0 rows after the last)."""
    if h + 1 < end_h:
        return h + 1, t, imin(chunk, t_end - t)
    return first_h, t + chunk, imax(0, imin(chunk, t_end - t - chunk))


#: the row loads' prefetch of the next load's rows (:func:`next_load`) when there is none
NO_NEXT_LOAD = (np.int64(0), np.int64(0), np.int64(0))


@register_jitable(inline="always")
def transpose_rows(src, dest, n):
    """dest[j, i] = src[i, j] for i < n, j < src.shape[1]: whole lanes x lanes blocks in registers
    (:func:`.simd.vtranspose`) where the buffers hold them (rows of src and columns of dest padded past n:
    the block's extra columns of dest are scratch), the rest in blocks of 8 rows (each dest line written 8
    values at a time)."""
    m = src.shape[1]
    block = lanes(src)
    limit = imin(src.shape[0], dest.shape[1])   # rows of src readable, columns of dest writable as scratch
    full_rows = padded(n, block) if padded(n, block) <= limit else n - n % block
    full_cols = m - m % block
    s_stride, d_stride = src.shape[1], dest.shape[1]
    for i0 in range(0, full_rows, block):
        for j0 in range(0, full_cols, block):
            vtranspose(src, i0 * s_stride + j0, s_stride, dest, j0 * d_stride + i0, d_stride)
    for i0 in range(0, n, 8):                   # the columns past the whole blocks, every row
        end = imin(i0 + 8, n)
        for j in range(full_cols, m):
            for i in range(i0, end):
                dest[j, i] = src[i, j]
    for i in range(full_rows, n):               # the rows past the whole blocks (buffers without padding)
        for j in range(full_cols):
            dest[j, i] = src[i, j]


@register_jitable
def load_features(x, g, b, h, t0, n, cos, sin, rows, half, rotary_dim, interleaved, feature_map, phi, scratch,
                  rotated, transpose, after):
    """phi(x[b, t0+i, h, :]) for i < n to phi[i, :m] (work dtype: the plain features, widened exactly where
    float64 sums read them) and its rotation R_{p(t0+i)} phi(...) to rotated[i, :m] or, with ``transpose``,
    to rotated[:m, i] (rotated into scratch[i] first; scratch: the shape of phi).

    Unit-stride rows go through SIMD (:func:`.simd.feature` on vectors, :func:`rotate_pairs_simd`), bit for bit the scalar
    forms; rows ahead are prefetched, and with each row i the row i of the next load of x, ``after`` =
    (head, first token, rows) from :func:`next_load`: a whole head's work before it is used, where rows
    a few ahead arrived late (the load waited out most of a memory latency). g: (offset, sB, sS, sH, sD) of x.
    """
    m = phi.shape[1]
    width = lanes(phi)
    vector_end = m - m % width if g[4] == 1 else 0
    next_h, next_t, next_n = after
    for i in range(-PREFETCH_ROWS, n):
        prefetch_ahead(x, g, b, t0, i, n, h, m, PREFETCH_ROWS)
        if i < 0:
            continue
        if i < next_n:
            prefetch_row(x, g, b, next_t + i, next_h, m, False)
        base = element_offset(g[0], g[1], g[2], g[3], b, t0 + i, h)
        for j in range(0, vector_end, width):
            vstore(phi, i * m + j, feature(vload(x, base + j), feature_map))
        for j in range(vector_end, m):
            phi[i, j] = feature(load(x, base + j * g[4]), feature_map)
    out = scratch if transpose else rotated     # transposed below
    for i in range(n):
        row = rows[b if rows.shape[0] > 1 else 0, t0 + i]
        oi = i * out.shape[1]
        done = rotate_pairs_simd(phi, i * m, out, oi, cos, sin, row, half, interleaved, False)
        rotate_features(phi, i * m, out, oi, cos, sin, row, done, half, rotary_dim, m, interleaved)
    if transpose:
        transpose_rows(scratch, rotated, n)


@register_jitable
def load_values(x, g, b, h, t0, n, dest, dv, after):
    """dest[i, :dv] = x[b, t0+i, h, :] in the work dtype for i < n (rows fetched 4x further ahead than in
    load_features: a row's copy is short; the next load's rows ``after`` as there)."""
    ahead = 4 * PREFETCH_ROWS
    next_h, next_t, next_n = after
    for i in range(-ahead, n):
        prefetch_ahead(x, g, b, t0, i, n, h, dv, ahead)
        if i < 0:
            continue
        if i < next_n:
            prefetch_row(x, g, b, next_t + i, next_h, dv, False)
        base = element_offset(g[0], g[1], g[2], g[3], b, t0 + i, h)
        if g[4] == 1:
            for j in range(dv):
                dest[i, j] = load(x, base + j)
        else:
            for j in range(dv):
                dest[i, j] = load(x, base + j * g[4])


@register_jitable
def store_row(o, g, b, t, h, acc, dv, scale, stream):
    """o[b, t, h, :] = acc[:dv] * scale, rounded to o's dtype. With ``stream`` (o in the work dtype, a unit-stride
    row of whole vectors at an aligned address), acc is scaled in place (the same rounding: one product,
    rounded to o's dtype) and written by non-temporal stores: no read of o's lines before they are written.
    """
    base = element_offset(g[0], g[1], g[2], g[3], b, t, h)
    width = lanes(acc)
    if stream and g[4] == 1 and dv % width == 0 and is_aligned(o, base):
        for j in range(dv):
            acc[j] = acc[j] * scale
        for j in range(0, dv, width):
            vstore_stream(o, base + j, vload(acc, j))
    elif g[4] == 1:
        for j in range(dv):
            store(o, base + j, acc[j] * scale)
    else:
        for j in range(dv):
            store(o, base + j * g[4], acc[j] * scale)


def streams(o, acc):
    """Whether the kernels write o by non-temporal stores (:func:`store_row`): o in the work dtype of acc
    (not float16 bits) and at least ``STREAM_MIN_BYTES`` (a result much larger than the caches, read back
    later, if at all). Compiled: a constant per type combined with the size test."""
    return o.dtype == acc.dtype and o.size * o.itemsize >= STREAM_MIN_BYTES


#: outputs from this size on are written by non-temporal stores (see :func:`store_row`)
STREAM_MIN_BYTES = 1 << 22


def _streams_definition(typingctx, o, acc):
    """A constant False unless o is in acc's dtype, then ``o.shape[0] * itemsize >= STREAM_MIN_BYTES``."""
    def codegen(context, builder, signature, args):
        if o.dtype != acc.dtype:
            return context.get_constant(types.boolean, False)
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        size = builder.mul(builder.extract_value(ary.shape, 0), context.get_constant(types.intp, o.dtype.bitwidth // 8))
        return builder.icmp_signed(">=", size, context.get_constant(types.intp, STREAM_MIN_BYTES))

    return types.boolean(o, acc), codegen


lowered_in_place(streams, _streams_definition)


@register_jitable(inline="always")   # one call site: inlined, no compile of its own
def add_state(carried_s, s_work, s_chunk, m, dv, factor, powers):
    """S = factor S + B_hat^T V of one chunk: carried_s (float64) = factor carried_s + s_chunk (work dtype),
    s_work = carried_s in the work dtype (factor = gamma^n with decay, else 1 and not applied: powers is None,
    the kernel's marker of a call without decay, see :func:`linear_attention_tasks`)."""
    for r in range(m):
        carried_row, work_row, chunk_row = carried_s[r], s_work[r], s_chunk[r]
        if powers is not None:
            for j in range(dv):
                carried_row[j] = carried_row[j] * factor + chunk_row[j]
                work_row[j] = carried_row[j]
        else:
            for j in range(dv):
                carried_row[j] += chunk_row[j]
                work_row[j] = carried_row[j]


@register_jitable
def keep_chunk_state(states, starts, c, s_work, carried_z, m, dv):
    """The state before chunk c, for the backward: states[c * dvw + j, r] = s_work[r, j] (S^T, dvw = the rows
    per chunk: states' rows / chunks), starts[c, r] = carried_z[r]."""
    dvw = states.shape[0] // starts.shape[0]
    for r in range(m):
        starts[c, r] = carried_z[r]
    for j in range(dv):   # row by row of the (large) states: their lines written whole, one after another
        row = states[c * dvw + j]
        for r in range(m):
            row[r] = s_work[r, j]


@njit(nogil=True, **KERNEL_JIT)
def linear_attention_tasks(q, k, v, o, geo, cos, sin, rows, state_s, state_z, new_s, new_z, seq_len, half,
                           rotary_dim, interleaved, causal, feature_map, eps, chunk, groups, powers, normalize,
                           cu_seqlens, chunk_s, chunk_z, first, last):
    """Linear attention of tasks first..last-1 (task = b * Hk + hk: one batch row, one k/v head and its
    ``groups`` q heads hk*G .. hk*G+G-1), in chunks of ``chunk`` tokens, (S, z) carried in float64 (the tasks of
    one batch row walked chunk by chunk, every head inside a chunk: the rows of a token range are read
    together, 15-25 % faster than head by head, whose rows lie H*d elements apart); without
    the GIL (the glue runs ranges of tasks on a few Python threads: no parfor, whose compilation took most
    of the first-call time). geo: (4, 5) int64 (offset, sB, sS, sH, sD) of q, k, v, o.

    Per chunk (rows t0..t0+n, hats rotated, products in the work dtype by :func:`madd_tile`; gamma^j =
    powers[b, hk, j]; without decay powers is None, gamma^j = 1 and not applied)::

        z_i = gamma z_(i-1) + b_i                               (float64 recurrence over the chunk's rows)
        for each q head:
            P = tril(A_hat B_hat^T) * gamma^(i-j)               (row blocks of TILE_ROWS: columns j < the block's end)
            N = gamma^(i+1) A_hat S + P V                       (one accumulator tile, in that order)
            o_i = N_i / (a_i . z_i + eps)                       (float64 denominator; N_i alone without normalize)
        S = gamma^n S + (B_hat * gamma^(n-1-j))^T V              (chunk product in the work dtype, carried in float64)

    Every power has an exponent in 0..n: exact for gamma near 0 and 1. Non-causal (no decay): (S, z) over all
    chunks first, then ``o_i = (A_hat S)_i / (a_i . z + eps)`` per q head. Buffers are padded to whole
    register tiles with zeros (columns) so every tile is full width; no task writes a padding column, so
    the buffers serve every task of the range. A packed batch (cu_seqlens of N + 1 offsets, else empty):
    task = n * Hk + hk runs sequence n, tokens cu_seqlens[n] .. cu_seqlens[n + 1] - 1 of batch row 0, with
    state n (sb below; sb = b unpacked).

    ``chunk_s``, ``chunk_z`` (causal, unpacked; None: not kept): the state before each chunk c, for the backward
    (:mod:`.linear_backward` reads them instead of sweeping again): chunk_s[b, hk, c * dvw + j, r] = S_in[r, j]
    (S^T in the work dtype, as carried into the chunk; rows of the padded dv, columns of the padded m: the
    backward's tiles, its zero padding left as it is) and chunk_z[b, hk, c, r] = z_in[r] (float64).

    ``powers`` None marks a call without decay and ``causal`` is True or None (never False): Numba prunes the
    branches that test them before typing, so each signature compiles only its own loops.
    """
    n_heads = state_s.shape[1]
    keep = (q, k, v, o, geo, cos, sin, rows, powers, state_s, state_z, new_s, new_z)
    # borrowed (meminfo-less) arguments, as the parfor gufunc's were: helper calls then cost no atomic
    # incref/decref; the caller's references keep the arrays alive for the whole call
    q, k, v, o, geo = borrowed(q), borrowed(k), borrowed(v), borrowed(o), borrowed(geo)
    cos, sin, rows = borrowed(cos), borrowed(sin), borrowed(rows)   # powers: read by element only
    state_s, state_z, new_s, new_z = borrowed(state_s), borrowed(state_z), borrowed(new_s), borrowed(new_z)
    packed = cu_seqlens.shape[0] > 0
    m = state_z.shape[2]
    dv = state_s.shape[3]
    work = cos.dtype
    width = tile_width(cos[0])
    cp, dvp, mp = padded(chunk, width), padded(dv, width), padded(m, TILE_ROWS)
    m_f64 = padded(m, VECTOR_BYTES // 8)
    # every buffer 2-D from aligned_zeros (lowered in place: an aligned NRT allocation and a memset each; NumPy's
    # np.zeros compiled its allocation and fill per dtype, ~0.4 s of the first call)
    k_rotated_own = aligned_zeros(cp, m, work)      # k's rotated rows before their transposition
    k_rotated = borrowed(k_rotated_own)
    z_rows_own = aligned_zeros(cp, m_f64, np.float64)   # z after each row of the chunk (causal)
    z_rows = borrowed(z_rows_own)
    a_hat_own = aligned_zeros(cp, m, work)
    a_hat = borrowed(a_hat_own)
    phi_own = aligned_zeros(cp, m, work)           # phi(k), then phi(q) of the chunk's rows, work dtype
    phi = borrowed(phi_own)
    k_hat_t_own = aligned_zeros(mp, cp, work)
    k_hat_t = borrowed(k_hat_t_own)
    values_own = aligned_zeros(cp, dvp, work)
    values = borrowed(values_own)
    scores_own = aligned_zeros(cp, cp, work)
    scores = borrowed(scores_own)
    num_own = aligned_zeros(cp, dvp, work)
    num = borrowed(num_own)
    s_chunk_own = aligned_zeros(mp, dvp, work)
    s_chunk = borrowed(s_chunk_own)
    # the carried state of every head of a run of tasks (see below), one block of rows per head
    span = imin(last - first, n_heads)
    s_work_own = aligned_zeros(span * m, dvp, work)
    s_work_all = borrowed(s_work_own)
    carried_s_own = aligned_zeros(span * m, dv, np.float64)
    carried_s_all = borrowed(carried_s_own)
    carried_z_own = aligned_zeros(span, m_f64, np.float64)
    carried_z_all = borrowed(carried_z_own)
    pw_own = aligned_zeros(span, chunk + 1, np.float64)   # gamma^j, float64
    pw_all = borrowed(pw_own)
    pw_work_own = aligned_zeros(span, chunk + 1, work)
    pw_work_all = borrowed(pw_work_own)
    out_geo = geo[3]
    stream = streams(o, num[0])   # a large output: written by non-temporal stores (store_row)
    # run-time bools, not literal constants: one compiled madd_tile and load_features serve every call site
    fresh, accumulate = np.bool_(False), np.bool_(True)
    as_rows, as_columns = np.bool_(False), np.bool_(True)
    task = first
    while task < last:
        # a run of tasks of one batch row (or packed sequence): k/v heads hk0 .. hk0 + heads - 1, walked chunk by
        # chunk with every head inside a chunk, so the rows of all these heads of a token range are read (and o's
        # written) together: contiguous spans of memory, where one head's rows alone lie H*d elements apart
        sb = task // n_heads
        hk0 = task - sb * n_heads
        heads = imin(n_heads - hk0, last - task)
        task += heads
        b, t_first, length = sb, 0, seq_len
        if packed:
            b, t_first, length = 0, cu_seqlens[sb], cu_seqlens[sb + 1] - cu_seqlens[sb]
        for r in range(heads):
            hk = hk0 + r
            pw, pw_work = pw_all[r], pw_work_all[r]
            for j in range(chunk + 1):
                pw[j] = powers[sb, hk, j] if powers is not None else 1.0
                pw_work[j] = pw[j]
            for j in range(m):
                carried_z_all[r, j] = state_z[sb, hk, j]
                for c in range(dv):
                    carried_s_all[r * m + j, c] = state_s[sb, hk, j, c]
                    s_work_all[r * m + j, c] = carried_s_all[r * m + j, c]
        for t0 in range(0, length, chunk):
            n = imin(chunk, length - t0)
            for r in range(heads):
                hk = hk0 + r
                carried_s, s_work = carried_s_all[r * m:(r + 1) * m], s_work_all[r * m:(r + 1) * m]
                carried_z, pw, pw_work = carried_z_all[r], pw_all[r], pw_work_all[r]
                gamma = pw[1]
                if chunk_s is not None:   # the state before this chunk, kept for the backward
                    keep_chunk_state(chunk_s[sb, hk], chunk_z[sb, hk], t0 // chunk, s_work, carried_z, m, dv)
                kv_after = next_load(hk, hk0, hk0 + heads, t_first + t0, chunk, t_first + length)
                load_features(k, geo[1], b, hk, t_first + t0, n, cos, sin, rows, half, rotary_dim, interleaved,
                              feature_map, phi, k_rotated, k_hat_t, as_columns, kv_after)
                load_values(v, geo[2], b, hk, t_first + t0, n, values, dv, kv_after)
                for i in range(n):
                    k_row = phi[i]                           # phi(k), widened exactly in the sums
                    if powers is not None:
                        for j in range(m):
                            carried_z[j] = carried_z[j] * gamma + k_row[j]
                    else:
                        for j in range(m):
                            carried_z[j] += k_row[j]
                    if causal is not None and normalize:
                        z_row = z_rows[i]
                        for j in range(m):
                            z_row[j] = carried_z[j]
                if causal is not None:   # (pruned before typing in the non-causal version)
                    for g in range(groups):
                        h = hk * groups + g
                        q_after = next_load(h, hk0 * groups, (hk0 + heads) * groups, t_first + t0, chunk, t_first + length)
                        load_features(q, geo[0], b, h, t_first + t0, n, cos, sin, rows, half, rotary_dim,
                                      interleaved, feature_map, phi, k_rotated, a_hat, as_rows, q_after)
                        for i0 in range(0, n, TILE_ROWS):
                            end = imin(i0 + TILE_ROWS, n)                 # rows i0..end-1 see tokens j < end
                            for i in range(end, imin(end + TILE_ROWS, n) if not stream else 0):   # next block's rows
                                prefetch_row(o, out_geo, b, t_first + t0 + i, h, dv, True)
                            for j0 in range(0, end, width):
                                madd_tile(a_hat, k_hat_t, scores, i0, j0, m, fresh)
                            for i in range(i0, end):
                                for j in range(i + 1, end):
                                    scores[i, j] = 0
                                if powers is not None:
                                    for j in range(i + 1):
                                        scores[i, j] *= pw_work[i - j]
                            for j0 in range(0, dv, width):
                                madd_tile(a_hat, s_work, num, i0, j0, m, fresh)
                                if powers is not None:
                                    for i in range(i0, end):
                                        num_row = num[i]
                                        for j in range(j0, j0 + width):
                                            num_row[j] *= pw_work[i + 1]
                                madd_tile(scores, values, num, i0, j0, end, accumulate)
                            for i in range(i0, end):
                                if not row_finite(num[i], dv):   # a later token's NaN/inf must not reach row i
                                    causal_row(num[i], a_hat[i], s_work, scores[i], values,
                                               pw_work[i + 1] if powers is not None else 1.0, i, m, dv)
                                scale = 1.0 / (dot_f64(phi[i], z_rows[i], m) + eps) if normalize else 1.0
                                store_row(o, out_geo, b, t_first + t0 + i, h, num[i], dv, scale, stream)
                if powers is not None:
                    for rr in range(m):
                        kt_row = k_hat_t[rr]
                        for j in range(n):
                            kt_row[j] *= pw_work[n - 1 - j]
                matmul_tiles(k_hat_t, values, s_chunk, m, n, dv)
                add_state(carried_s, s_work, s_chunk, m, dv, pw[n], powers)
        if causal is None:   # the non-causal outputs, from the whole (S, z) (pruned in the causal version)
            for t0 in range(0, length, chunk):
                n = imin(chunk, length - t0)
                for r in range(heads):
                    s_work, carried_z = s_work_all[r * m:(r + 1) * m], carried_z_all[r]
                    for g in range(groups):
                        h = (hk0 + r) * groups + g
                        q_after = next_load(h, hk0 * groups, (hk0 + heads) * groups, t_first + t0, chunk, t_first + length)
                        load_features(q, geo[0], b, h, t_first + t0, n, cos, sin, rows, half, rotary_dim,
                                      interleaved, feature_map, phi, k_rotated, a_hat, as_rows, q_after)
                        matmul_tiles(a_hat, s_work, num, n, m, dv)
                        for i in range(n):
                            if i + PREFETCH_ROWS < n and not stream:
                                prefetch_row(o, out_geo, b, t_first + t0 + i + PREFETCH_ROWS, h, dv, True)
                            scale = 1.0 / (dot_f64(phi[i], carried_z, m) + eps) if normalize else 1.0
                            store_row(o, out_geo, b, t_first + t0 + i, h, num[i], dv, scale, stream)
        # element loops, not slice assignments: an array-to-slice assignment compiles Numba's shape-mismatch
        # error message (f-strings, str, join: ~8 s of the first call's compile time)
        for r in range(heads):
            for j in range(m):
                new_z[sb, hk0 + r, j] = carried_z_all[r, j]
                for c in range(dv):
                    new_s[sb, hk0 + r, j, c] = carried_s_all[r * m + j, c]
    store_fence()   # the non-temporal stores ordered before whatever the caller does next
    keep_alive((k_rotated_own, z_rows_own, a_hat_own, k_hat_t_own, values_own, scores_own, num_own,
                s_chunk_own, s_work_own, carried_s_own, carried_z_own, pw_own, pw_work_own, phi_own, keep))


@register_jitable
def step_state_update(old, new, b_hat, v_row, a_hat, acc, gamma, decayed):
    """new = gamma old + b_hat v^T (gamma not applied without decay) and acc[g] += sum_j a_hat[g, j] new[j]
    for an (m, dv) state, one pass over it.

    Row by row, a vector of columns at a time: each row of S is read once, its update written to S' and
    added into the (L1-resident) accumulators while in registers. Per element the scalar form's operations
    in its order: ``new[j, c] = old[j, c] * gamma + b_j v_c`` (as ``b_j v_c + old gamma``: the same two
    products, one add), ``acc[g, c] += a[g, j] new[j, c]`` for j ascending; the columns past the last whole
    vector run that scalar form.
    """
    m, dv = old.shape
    groups = a_hat.shape[0]
    # meminfo-less views (the caller holds the arrays): the per-row views below cost no atomic refcounts
    old, new, b_hat, v_row, a_hat, acc = (borrowed(old), borrowed(new), borrowed(b_hat), borrowed(v_row),
                                          borrowed(a_hat), borrowed(acc))
    width = lanes(v_row)
    full = dv - dv % width
    gv = vsplat(gamma)
    zero = vzeros(v_row)
    for j in range(m):
        old_row, new_row = old[j], new[j]
        bj = vsplat(b_hat[j])
        if groups == 1:   # the common case as its own loop: LLVM keeps everything but the vectors out of it
            acc_g, aj = acc[0], vsplat(a_hat[0, j])
            if decayed:
                for c in range(0, full, width):
                    x = vmadd(vmadd(zero, bj, vload(v_row, c)), vload(old_row, c), gv)
                    vstore(new_row, c, x)
                    vstore(acc_g, c, vmadd(vload(acc_g, c), aj, x))
            else:
                for c in range(0, full, width):
                    x = vmadd(vload(old_row, c), bj, vload(v_row, c))
                    vstore(new_row, c, x)
                    vstore(acc_g, c, vmadd(vload(acc_g, c), aj, x))
        else:
            for c in range(0, full, width):
                if decayed:
                    x = vmadd(vmadd(zero, bj, vload(v_row, c)), vload(old_row, c), gv)
                else:
                    x = vmadd(vload(old_row, c), bj, vload(v_row, c))
                vstore(new_row, c, x)
            for g in range(groups):
                acc_g, aj = acc[g], vsplat(a_hat[g, j])
                for c in range(0, full, width):
                    vstore(acc_g, c, vmadd(vload(acc_g, c), aj, vload(new_row, c)))
        bs = b_hat[j]
        for c in range(full, dv):
            new_row[c] = old_row[c] * gamma + bs * v_row[c] if decayed else old_row[c] + bs * v_row[c]
        for g in range(groups):
            aj, acc_g = a_hat[g, j], acc[g]
            for c in range(full, dv):
                acc_g[c] += aj * new_row[c]


@njit(**KERNEL_JIT)
def linear_attention_step(q, k, v, o, geo, cos, sin, rows, state_s, state_z, new_s, new_z, half, rotary_dim,
                          interleaved, feature_map, eps, groups, powers, decayed, normalize):
    """One token per sequence (decode), on the calling thread: per (batch, k/v head), one pass over S::

        S' = gamma S + b_hat v^T,  z' = gamma z + b,  o_h = (a_hat_h . S') / (a_h . z' + eps)  (h in the group)

    Row j of S is read, updated, written to S' and added into the group's outputs while it is in L1
    (work dtype throughout, unit-stride loops LLVM vectorises; no float64 copy of the state).
    """
    n_batch, n_kv, m, dv = state_s.shape
    work = cos.dtype
    keep = (q, k, v, o, geo, cos, sin, rows, state_s, state_z, new_s, new_z, powers)
    # borrowed (meminfo-less) arguments: the per-head views and helper calls cost no atomic refcounts
    q, k, v, o, geo, cos, sin, rows = (borrowed(q), borrowed(k), borrowed(v), borrowed(o), borrowed(geo),
                                       borrowed(cos), borrowed(sin), borrowed(rows))
    state_s, state_z, new_s, new_z, powers = (borrowed(state_s), borrowed(state_z), borrowed(new_s),
                                              borrowed(new_z), borrowed(powers))
    # token 0, one token, rows: run-time values, not literal constants, so the helpers below reuse the versions
    # the chunk kernel compiled (a literal argument would compile a version of each of its own)
    t0, one = np.int64(0), np.int64(1)
    b_plain_own = aligned_zeros(one, m, work)       # phi(k) and phi(q) of each head of the group (work dtype)
    b_plain = borrowed(b_plain_own)
    b_hat_own = aligned_zeros(one, m, work)
    b_hat = borrowed(b_hat_own)
    a_plain_own = aligned_zeros(groups, m, work)
    a_plain = borrowed(a_plain_own)
    a_hat_own = aligned_zeros(groups, m, work)
    a_hat = borrowed(a_hat_own)
    vals_own = aligned_zeros(one, dv, work)
    vals = borrowed(vals_own)
    acc_own = aligned_zeros(groups, dv, work)
    acc = borrowed(acc_own)
    phi_own = aligned_zeros(one, m, work)
    phi = borrowed(phi_own)
    as_rows = np.bool_(False)
    for b in range(n_batch):
        for hk in range(n_kv):
            gamma = powers[b, hk, 1] if decayed else 1.0
            phi[0, 0] = gamma
            gw = phi[0, 0]                              # gamma in the work dtype
            load_features(k, geo[1], b, hk, t0, one, cos, sin, rows, half, rotary_dim, interleaved, feature_map,
                          b_plain, phi, b_hat, as_rows, NO_NEXT_LOAD)
            load_values(v, geo[2], b, hk, t0, one, vals, dv, NO_NEXT_LOAD)
            for g in range(groups):
                load_features(q, geo[0], b, hk * groups + g, t0, one, cos, sin, rows, half, rotary_dim, interleaved,
                              feature_map, a_plain[g:g + 1], phi, a_hat[g:g + 1], as_rows, NO_NEXT_LOAD)
                acc_row = acc[g]
                for c in range(dv):
                    acc_row[c] = 0
            step_state_update(state_s[b, hk], new_s[b, hk], b_hat[0], vals[0], a_hat, acc, gw, decayed)
            for j in range(m):
                new_z[b, hk, j] = state_z[b, hk, j] * gamma + b_plain[0, j] if decayed else \
                    state_z[b, hk, j] + b_plain[0, j]
            for g in range(groups):
                scale = 1.0
                if normalize:
                    den = 0.0
                    for j in range(m):
                        den += a_plain[g, j] * np.float64(new_z[b, hk, j])
                    scale = 1.0 / (den + eps)
                store_row(o, geo[3], b, t0, hk * groups + g, acc[g], dv, scale, as_rows)   # as_rows: False
    keep_alive((b_plain_own, b_hat_own, a_plain_own, a_hat_own, vals_own, acc_own, phi_own, keep[0], keep[3],
                keep[8], keep[10]))
