"""Rotation kernels of the ``numba`` backend (the counterpart of ``cuda_kernels/rope.cu``).

Rotation of pair (a, b) with table values (c, s) of the token's row (s negated for the inverse)::

    y_a = x_a c - x_b s,    y_b = x_b c + x_a s

Pairs are (i, i + half) for layout "half" and (2i, 2i + 1) for "interleaved"; coordinates from
rotary_dim to head_dim are copied. A separate output of at least STREAM_MIN_BYTES is written by
non-temporal stores where its head vectors are 16-byte aligned (:func:`rotate_heads_stream`). fastmath is off: the results round exactly like the NumPy
reference (one multiply and one add/subtract, no fused multiply-add). Buffers, offsets and float16
bits as in :mod:`.common`.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload, register_jitable

from .common import GEO_COPY_TAIL, GEO_HEADS, GEO_OUT, GEO_STREAM, GEO_X, borrowed, element_offset, load, store
from .simd import (KERNEL_JIT, VECTOR_BYTES, _work_dtype, is_aligned16, neg_if, prefetch_write, store_fence, vadd,
                   vcopy_flat, vdeinterleave, vinterleave, vload, vmul, vstore, vstore_stream16, vsub)

# -- rotation ------------------------------------------------------------------------------------
# The rotation loops index the flat buffers and the 2-D tables directly, never through slices or row
# views (see :func:`.common.borrowed` for what a view costs). Unit-stride vectors rotate a whole SIMD register of pairs at a
# time (:func:`rotate_pairs_simd`): loads of a block come before its stores, so ``out is x`` runs
# vectorised too (LLVM's own vectoriser fell back to scalar code there: x and out alias).


@register_jitable
def rotate_vector(x, xi, xsd, o, oi, osd, cos, sin, row, half, rotary_dim, head_dim, interleaved, inverse,
                  copy_tail, start):
    """Rotate pairs start..half-1 of the head vector at x[xi + j*xsd] (j < head_dim) into o[oi + j*osd] with
    table row ``row`` (the scalar loop: strided heads, and the pairs past :func:`rotate_heads_simd`'s whole
    registers), then copy coordinates rotary_dim..head_dim-1 when ``copy_tail``."""
    if interleaved:
        step, second = 2, 1
    else:
        step, second = 1, half
    for i in range(start, half):
        c = cos[row, i]
        s = neg_if(sin[row, i], inverse)
        ia = i * step
        xa = load(x, xi + ia * xsd)
        xb = load(x, xi + (ia + second) * xsd)
        store(o, oi + ia * osd, xa * c - xb * s)
        store(o, oi + (ia + second) * osd, xb * c + xa * s)
    if copy_tail:
        for j in range(rotary_dim, head_dim):
            o[oi + j * osd] = x[xi + j * xsd]


@register_jitable
def rotate_token(t, x, o, geo, item, cos, sin, rows, shift, seq_len, half, rotary_dim, head_dim, interleaved,
                 inverse, streams):
    """Rotate every head of token t (= b*seq_len + s) of item ``item`` with table row rows[b or 0, s] + shift;
    geo[item]: its GEO_COLUMNS int64 values. ``streams`` None: never by non-temporal stores (the serial
    kernel, whose calls are small: Numba prunes that branch before typing, so it compiles none of it), else
    (the parallel kernel) where geo says so and this token's head vectors are 16-byte aligned.

    The geometry is read into locals once per token and the heads are walked by their stride (the
    stores into o could alias geo as far as the compiler knows, so reads inside the head loop would be
    repeated after every store); the tail copy runs only when there is a tail (rotary_dim < head_dim).
    Together 2.5x faster at decode size (32 tokens x 40 heads x 128) than reading geo per head."""
    b = t // seq_len
    s = t - b * seq_len
    row = rows[b if rows.shape[0] > 1 else 0, s] + shift
    heads = geo[item, GEO_HEADS]
    xsh, xsd = geo[item, GEO_X + 3], geo[item, GEO_X + 4]
    osh, osd = geo[item, GEO_OUT + 3], geo[item, GEO_OUT + 4]
    copy_tail = geo[item, GEO_COPY_TAIL] != 0 and rotary_dim < head_dim
    xi = element_offset(geo[item, GEO_X], geo[item, GEO_X + 1], geo[item, GEO_X + 2], 0, b, s, 0)
    oi = element_offset(geo[item, GEO_OUT], geo[item, GEO_OUT + 1], geo[item, GEO_OUT + 2], 0, b, s, 0)
    done = np.int64(0)   # (not a literal: the strided call below shares the compiled rotate_vector)
    if xsd == 1 and osd == 1:
        # unit-stride heads (the common case): whole registers of pairs, all heads in one call. A separate
        # output: written by non-temporal stores when it is large and every pair is in a register (see above),
        # else its lines are asked for (for writing) PREFETCH_HEADS heads ahead; in place, they are the lines
        # just read
        if streams is not None:
            if (geo[item, GEO_STREAM] != 0 and not copy_tail and simd_covers(x, o, cos, sin, half)
                    and is_aligned16(o, oi) and is_aligned16(o, oi + osh)):
                rotate_heads_stream(x, xi, xsh, o, oi, osh, heads, cos, sin, row, half, interleaved, inverse)
                return
        ahead = PREFETCH_HEADS if geo[item, GEO_COPY_TAIL] != 0 else heads
        done = rotate_heads_simd(x, xi, xsh, o, oi, osh, heads, cos, sin, row, half, interleaved, inverse, ahead)
        if done == half and not copy_tail:
            return
        width = VECTOR_BYTES // x.itemsize
        no_tail = np.bool_(False)   # (strides and flag typed as at the call below: one compiled rotate_vector)
        for h in range(heads):   # the pairs past the whole registers, then (partial rotary into a separate output)
            xh, oh = xi + h * xsh, oi + h * osh   # the coordinates past rotary_dim, a register at a time
            if done < half:
                rotate_vector(x, xh, xsd, o, oh, osd, cos, sin, row, half, rotary_dim, head_dim, interleaved,
                              inverse, no_tail, done)
            if copy_tail:   # (element by element, the tail took 5x the time of a full-rotary call at decode size)
                j = rotary_dim
                while j + width <= head_dim:
                    vcopy_flat(x, xh + j, o, oh + j)
                    j += width
                for jj in range(j, head_dim):
                    o[oh + jj] = x[xh + jj]
        return
    for h in range(heads):   # strided heads (done: 0, an int64 variable, as above)
        rotate_vector(x, xi + h * xsh, xsd, o, oi + h * osh, osd, cos, sin, row, half, rotary_dim, head_dim,
                      interleaved, inverse, copy_tail, done)


@register_jitable
def rows_in_table(rows, shift, table_rows):
    """True when every rows[i, j] + shift is a row of the table (0 <= row < table_rows)."""
    for i in range(rows.shape[0]):
        for j in range(rows.shape[1]):
            row = rows[i, j] + shift
            if row < 0 or row >= table_rows:
                return False
    return True


@register_jitable(inline="always")   # the body of both loops below: inlined
def rotate_qk_token(t, xq, oq, xk, ok, geo, cos, sin, rows, shift, seq_len, half, rotary_dim, head_dim, interleaved,
                    inverse, streams):
    """Token t of q (geometry item 0), then of k (item 1)."""
    q_item, k_item = np.int64(0), np.int64(1)   # not literals: one compiled rotate_token for both
    rotate_token(t, xq, oq, geo, q_item, cos, sin, rows, shift, seq_len, half, rotary_dim, head_dim, interleaved,
                 inverse, streams)
    rotate_token(t, xk, ok, geo, k_item, cos, sin, rows, shift, seq_len, half, rotary_dim, head_dim, interleaved,
                 inverse, streams)


@njit(parallel=True, **KERNEL_JIT)
def rotate_qk_parallel(xq, oq, xk, ok, geo, cos, sin, rows, shift, n_tokens, seq_len, half, rotary_dim, head_dim,
                       interleaved, inverse):
    """One parallel pass over the tokens: q's heads, then k's heads, with the token's table row
    rows[b or 0, s] + shift. Returns False, writing nothing, when a row lies outside the table
    (a prepared caller passes positions with shift = -table start and grows the table then)."""
    if not rows_in_table(rows, shift, cos.shape[0]):
        return False
    streams = np.bool_(True)   # large separate outputs by non-temporal stores (rotate_token)
    for t in prange(n_tokens):
        # t as int64: the parfor's loop index is uint64, and its body is typed before and after the parfor
        # pass; both int64, one compiled rotate_token serves both (uint64 compiled a second, ~0.8 s)
        rotate_qk_token(np.int64(t), xq, oq, xk, ok, geo, cos, sin, rows, shift, seq_len, half, rotary_dim,
                        head_dim, interleaved, inverse, streams)
    return True


@njit(**KERNEL_JIT)
def rotate_qk_serial(xq, oq, xk, ok, geo, cos, sin, rows, shift, n_tokens, seq_len, half, rotary_dim, head_dim,
                     interleaved, inverse):
    """rotate_qk_parallel on the calling thread (small calls: no thread hand-off)."""
    xq, oq, xk, ok, geo = borrowed(xq), borrowed(oq), borrowed(xk), borrowed(ok), borrowed(geo)
    cos, sin, rows = borrowed(cos), borrowed(sin), borrowed(rows)
    if not rows_in_table(rows, shift, cos.shape[0]):
        return False
    for t in range(n_tokens):
        rotate_qk_token(t, xq, oq, xk, ok, geo, cos, sin, rows, shift, seq_len, half, rotary_dim, head_dim,
                        interleaved, inverse, None)
    return True


# -- SIMD rotation of unit-stride heads ------------------------------------------------------------
#: how many heads ahead a separate output's lines are prefetched for writing (see rotate_heads_simd)
PREFETCH_HEADS = 2
#: a separate output from this size on (one array, bytes) is written by non-temporal stores by the parallel kernel
#: where its head vectors are 16-byte aligned: larger than the caches, its lines are then not read before they are
#: written (Llama-8B prefill into out= buffers, q 64 MiB and k 16 MiB: 5.2-7.2 -> 3.3-5.0 ms, AMD EPYC Zen 4);
#: smaller outputs are written through the caches, where whatever reads them next finds them
STREAM_MIN_BYTES = 1 << 24
def rotate_pairs_simd(x, xi, o, oi, cos, sin, row, half, interleaved, inverse):
    """Rotate the first whole registers of pairs of the unit-stride vector x[xi:] into o[oi:], exactly
    as the scalar loop of :func:`rotate_vector` does (same products and sums, float16 via float32);
    returns how many pairs it did (0 when the dtypes do not allow it). Each block is loaded before it
    is stored, so o may be x itself."""
    return 0


def _simd_lanes(x, o, cos, sin) -> int:
    """Pairs per register for these (Numba) array types, 0 when rotate_pairs_simd cannot take them."""
    work = _work_dtype(x.dtype)
    if not (o.dtype == x.dtype and cos.dtype == work and sin.dtype == work and work in (types.float32, types.float64)
            and x.layout == "C" and o.layout == "C" and cos.layout == "C" and sin.layout == "C" and cos.ndim == 2
            and sin.ndim == 2):
        return 0
    return VECTOR_BYTES // (work.bitwidth // 8)


def simd_covers(x, o, cos, sin, half):
    """True when :func:`rotate_pairs_simd` rotates all ``half`` pairs (no scalar remainder)."""
    return False


@overload(simd_covers)
def _simd_covers_impl(x, o, cos, sin, half):
    n = _simd_lanes(x, o, cos, sin)
    if n == 0:
        return lambda x, o, cos, sin, half: False
    return lambda x, o, cos, sin, half: half % n == 0


def rotate_heads_simd(x, xi, xsh, o, oi, osh, heads, cos, sin, row, half, interleaved, inverse, ahead):
    """:func:`rotate_pairs_simd` on the ``heads`` unit-stride vectors x[xi + h*xsh:] into o[oi + h*osh:]
    (h < heads), all with table row ``row``, in one call (a compiled call per head, its arguments passed
    on the stack, cost about as much as rotating a head of 128); returns the pairs done per head.

    Before head h it prefetches (for writing) the output lines of head h + ``ahead`` (none when that is
    past the last head): a separate output's lines are otherwise fetched one store miss at a time, and
    at decode size (32 tokens x 40 heads x 128, fp32) that took the kernel from ~17 us in place to
    28-31 us into separate outputs; 20-23 us with the prefetch two heads ahead (`q.copy(), k.copy()`: 14-15)."""
    return 0


def rotate_pairs_stream(x, xi, o, oi, cos, sin, row, half, interleaved, inverse):
    """:func:`rotate_pairs_simd` writing o by non-temporal stores (around the caches: no read of o's lines
    before they are written); o's vectors must start on 16-byte boundaries (:func:`.simd.is_aligned16`, NumPy's
    alignment: 128-bit non-temporal stores), the stores are ordered by a :func:`.simd.store_fence` after them.
    float16 bits are stored as rotate_pairs_simd does."""
    return 0


def _rotate_pairs_overload(stream):
    """The overload of rotate_pairs_simd (``stream`` False) or rotate_pairs_stream (True): one body, two stores."""
    def overload_impl(x, xi, o, oi, cos, sin, row, half, interleaved, inverse):
        n = _simd_lanes(x, o, cos, sin)
        if n == 0:
            return lambda x, xi, o, oi, cos, sin, row, half, interleaved, inverse: 0
        put = vstore_stream16 if stream and o.dtype in (types.float32, types.float64) else vstore

        def impl(x, xi, o, oi, cos, sin, row, half, interleaved, inverse):
            table = np.int64(row) * cos.shape[1]
            done = half - half % n
            for i in range(0, done, n):
                c = vload(cos, table + i)
                s = neg_if(vload(sin, table + i), inverse)
                if interleaved:
                    xa, xb = vdeinterleave(vload(x, xi + 2 * i), vload(x, xi + 2 * i + n))
                    lo, hi = vinterleave(vsub(vmul(xa, c), vmul(xb, s)), vadd(vmul(xb, c), vmul(xa, s)))
                    put(o, oi + 2 * i, lo)
                    put(o, oi + 2 * i + n, hi)
                else:
                    xa = vload(x, xi + i)
                    xb = vload(x, xi + half + i)
                    put(o, oi + i, vsub(vmul(xa, c), vmul(xb, s)))
                    put(o, oi + half + i, vadd(vmul(xb, c), vmul(xa, s)))
            return done
        return impl
    return overload_impl


# inlined where they are called: no call per vector
overload(rotate_pairs_simd, inline="always")(_rotate_pairs_overload(False))
overload(rotate_pairs_stream, inline="always")(_rotate_pairs_overload(True))


@overload(rotate_heads_simd)
def _rotate_heads_simd_impl(x, xi, xsh, o, oi, osh, heads, cos, sin, row, half, interleaved, inverse, ahead):
    n = _simd_lanes(x, o, cos, sin)
    if n == 0:
        return lambda x, xi, xsh, o, oi, osh, heads, cos, sin, row, half, interleaved, inverse, ahead: 0

    line = 64 // (o.dtype.bitwidth // 8)   # elements per (64-byte) cache line

    def impl(x, xi, xsh, o, oi, osh, heads, cos, sin, row, half, interleaved, inverse, ahead):
        for h in range(heads):
            if h + ahead < heads:
                base = oi + (h + ahead) * osh
                for j in range(0, 2 * half, line):
                    prefetch_write(o, base + j)
            rotate_pairs_simd(x, xi + h * xsh, o, oi + h * osh, cos, sin, row, half, interleaved, inverse)
        return half - half % n
    return impl


def rotate_heads_stream(x, xi, xsh, o, oi, osh, heads, cos, sin, row, half, interleaved, inverse):
    """:func:`rotate_heads_simd` by non-temporal stores (:func:`rotate_pairs_stream`; every head vector of o on
    a 16-byte boundary), then a store fence: no output line is read before it is written."""
    return 0


@overload(rotate_heads_stream)
def _rotate_heads_stream_impl(x, xi, xsh, o, oi, osh, heads, cos, sin, row, half, interleaved, inverse):
    n = _simd_lanes(x, o, cos, sin)
    if n == 0:
        return lambda x, xi, xsh, o, oi, osh, heads, cos, sin, row, half, interleaved, inverse: 0

    def impl(x, xi, xsh, o, oi, osh, heads, cos, sin, row, half, interleaved, inverse):
        for h in range(heads):
            rotate_pairs_stream(x, xi + h * xsh, o, oi + h * osh, cos, sin, row, half, interleaved, inverse)
        store_fence()
        return half - half % n
    return impl
