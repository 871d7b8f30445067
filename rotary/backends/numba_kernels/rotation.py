"""Rotation kernels of the ``numba`` backend (the counterpart of ``cuda_kernels/rope.cu``).

Rotation of pair (a, b) with table values (c, s) of the token's row (s negated for the inverse)::

    y_a = x_a c - x_b s,    y_b = x_b c + x_a s

Pairs are (i, i + half) for layout "half" and (2i, 2i + 1) for "interleaved"; the kernels read them in one
layout (``interleaved``) and write them in one (``out_interleaved``: the same, or the other one for ``out_pairs``,
never in place); coordinates from rotary_dim to head_dim are copied. A separate output of at least STREAM_MIN_BYTES is written by
non-temporal stores where its head vectors are 16-byte aligned (:func:`rotate_pairs_stream`), by its own parallel
kernel (:func:`rotate_qk_streamed`). fastmath is
off: the results round exactly like the NumPy reference (one multiply and one add/subtract, no fused
multiply-add). Buffers, offsets and float16 bits as in :mod:`.common`.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from numba.extending import overload, register_jitable

from .common import GEO_COPY_TAIL, GEO_HEADS, GEO_OUT, GEO_STREAM, GEO_X, borrowed, element_offset, load, store
from .simd import (KERNEL_JIT, VECTOR_BYTES, _work_dtype, is_aligned16, lanes, line_items, neg_if, prefetch_write,
                   store_fence, vadd, vcopy_flat, vdeinterleave, vector_items, vinterleave, vload, vmul, vstore,
                   vstore_stream16, vsub)

# -- rotation ------------------------------------------------------------------------------------
# The rotation loops index the flat buffers and the 2-D tables directly, never through slices or row views
# (see :func:`.common.borrowed` for what a view costs). Unit-stride vectors rotate a whole SIMD register of
# pairs at a time (:func:`rotate_pairs_simd`; :func:`rotate_pairs_to` writes another pair layout): loads of a
# block come before its stores, so ``out is x`` runs vectorised too (LLVM's own vectoriser fell back to scalar
# code there: x and out alias).

#: how many heads ahead a separate output's lines are prefetched for writing (see rotate_token)
PREFETCH_HEADS = 2
#: a separate output from this size on (one array, bytes) is written by non-temporal stores by the parallel kernel
#: where its head vectors are 16-byte aligned: larger than the caches, its lines are then not read before they are
#: written (Llama-8B prefill into out= buffers, q 64 MiB and k 16 MiB: 5.2-7.2 -> 3.3-5.0 ms, AMD EPYC Zen 4);
#: smaller outputs are written through the caches, where whatever reads them next finds them
STREAM_MIN_BYTES = 1 << 24


def rotate_pairs_simd(x, xi, o, oi, cos, sin, row, half, interleaved, inverse):
    """Rotate the first whole registers of pairs of the unit-stride vector x.flat[xi:] into o.flat[oi:] with
    table row ``row``, exactly as the scalar loop of :func:`rotate_token` does (same products and sums, float16
    via float32); returns how many pairs it did. Each block is loaded before it is stored, so o may be x."""
    return rotate_pairs_to(x, xi, o, oi, cos, sin, row, half, interleaved, interleaved, inverse)


def rotate_pairs_stream(x, xi, o, oi, cos, sin, row, half, interleaved, inverse):
    """:func:`rotate_pairs_simd` writing o by non-temporal stores (around the caches: no read of o's lines
    before they are written); o's vectors must start on 16-byte boundaries (:func:`.simd.is_aligned16`),
    the stores ordered by a :func:`.simd.store_fence` after them."""
    return rotate_pairs_to(x, xi, o, oi, cos, sin, row, half, interleaved, interleaved, inverse)


def rotate_pairs_to(x, xi, o, oi, cos, sin, row, half, interleaved, out_interleaved, inverse):
    """:func:`rotate_pairs_simd` reading the pairs in the layout ``interleaved`` says and writing them in the one
    ``out_interleaved`` says (``out_pairs``; o is never x then): pairs are read a register at a time in their
    layout (interleaved: :func:`.simd.vdeinterleave` of two registers) and written in theirs (interleaved:
    :func:`.simd.vinterleave`), the same products and sums."""
    done = half - half % lanes(cos)
    step, second = (2, 1) if interleaved else (1, half)
    ostep, osecond = (2, 1) if out_interleaved else (1, half)
    for p in range(done):   # (the Python form: pair by pair)
        c, s = cos[row, p], neg_if(sin[row, p], inverse)
        xa, xb = load(x, xi + p * step), load(x, xi + p * step + second)
        store(o, oi + p * ostep, xa * c - xb * s)
        store(o, oi + p * ostep + osecond, xb * c + xa * s)
    return done


def rotate_pairs_stream_to(x, xi, o, oi, cos, sin, row, half, interleaved, out_interleaved, inverse):
    """:func:`rotate_pairs_to` writing o by non-temporal stores (as :func:`rotate_pairs_stream`)."""
    return rotate_pairs_to(x, xi, o, oi, cos, sin, row, half, interleaved, out_interleaved, inverse)


def _rotate_pairs_overload(stream, mixed=False):
    """The overload of rotate_pairs_simd (``stream`` False) or rotate_pairs_stream (True): one body, two stores;
    ``mixed``: of rotate_pairs_to / rotate_pairs_stream_to (an output layout of its own, a branch more per
    register: the same-layout functions keep their own loop)."""
    def overload_impl(x, xi, o, oi, cos, sin, row, half, interleaved, inverse):
        n = VECTOR_BYTES // (_work_dtype(x.dtype).bitwidth // 8)
        put = vstore_stream16 if stream else vstore

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

    def overload_mixed(x, xi, o, oi, cos, sin, row, half, interleaved, out_interleaved, inverse):
        n = VECTOR_BYTES // (_work_dtype(x.dtype).bitwidth // 8)
        put = vstore_stream16 if stream else vstore

        def impl(x, xi, o, oi, cos, sin, row, half, interleaved, out_interleaved, inverse):
            table = np.int64(row) * cos.shape[1]
            done = half - half % n
            for i in range(0, done, n):
                c = vload(cos, table + i)
                s = neg_if(vload(sin, table + i), inverse)
                if interleaved:
                    xa, xb = vdeinterleave(vload(x, xi + 2 * i), vload(x, xi + 2 * i + n))
                else:
                    xa = vload(x, xi + i)
                    xb = vload(x, xi + half + i)
                ya = vsub(vmul(xa, c), vmul(xb, s))
                yb = vadd(vmul(xb, c), vmul(xa, s))
                if out_interleaved:
                    lo, hi = vinterleave(ya, yb)
                    put(o, oi + 2 * i, lo)
                    put(o, oi + 2 * i + n, hi)
                else:
                    put(o, oi + i, ya)
                    put(o, oi + half + i, yb)
            return done
        return impl
    return overload_mixed if mixed else overload_impl


# inlined where they are called: no call per vector
overload(rotate_pairs_simd, inline="always")(_rotate_pairs_overload(False))
overload(rotate_pairs_stream, inline="always")(_rotate_pairs_overload(True))
overload(rotate_pairs_to, inline="always")(_rotate_pairs_overload(False, mixed=True))
overload(rotate_pairs_stream_to, inline="always")(_rotate_pairs_overload(True, mixed=True))


@register_jitable
def rotate_token(t, x, o, geo, item, cos, sin, rows, shift, seq_len, half, rotary_dim, head_dim, interleaved,
                 out_interleaved, inverse, streams):
    """Rotate every head of token t (= b*seq_len + s) of item ``item`` with table row rows[b or 0, s] + shift;
    geo[item]: its GEO_COLUMNS int64 values; pairs read in the layout ``interleaved`` says, written in the one
    ``out_interleaved`` says. Unit-stride heads: whole registers of pairs
    (:func:`rotate_pairs_simd`; :func:`rotate_pairs_to` for another output layout), then the scalar loop for the rest (strided heads: all of it), then the
    coordinates rotary_dim..head_dim-1 copied (separate outputs). ``streams`` None: never by non-temporal
    stores (the serial and parallel kernels: Numba prunes that branch before typing), else
    (:func:`rotate_qk_streamed`) where geo says so, every pair is in a register and the token's head vectors are 16-byte aligned.

    A separate output's lines are otherwise asked for (for writing) PREFETCH_HEADS heads ahead: fetched one
    store miss at a time, decode size (32 tokens x 40 heads x 128, fp32) took 28-31 us into separate outputs
    against ~17 in place; 20-23 with the prefetch. The geometry is read into locals once per token (the
    stores into o could alias geo as far as the compiler knows)."""
    b = t // seq_len
    s = t - b * seq_len
    row = rows[b if rows.shape[0] > 1 else 0, s] + shift
    heads = geo[item, GEO_HEADS]
    xsh, xsd = geo[item, GEO_X + 3], geo[item, GEO_X + 4]
    osh, osd = geo[item, GEO_OUT + 3], geo[item, GEO_OUT + 4]
    copy_tail = geo[item, GEO_COPY_TAIL] != 0 and rotary_dim < head_dim
    xi = element_offset(geo[item, GEO_X], geo[item, GEO_X + 1], geo[item, GEO_X + 2], 0, b, s, 0)
    oi = element_offset(geo[item, GEO_OUT], geo[item, GEO_OUT + 1], geo[item, GEO_OUT + 2], 0, b, s, 0)
    unit = xsd == 1 and osd == 1
    done = 0
    if streams is not None:
        if (unit and half % lanes(cos) == 0 and geo[item, GEO_STREAM] != 0 and not copy_tail and is_aligned16(o, oi)
                and is_aligned16(o, oi + osh)):
            for h in range(heads):
                if out_interleaved == interleaved:
                    rotate_pairs_stream(x, xi + h * xsh, o, oi + h * osh, cos, sin, row, half, interleaved, inverse)
                else:
                    rotate_pairs_stream_to(x, xi + h * xsh, o, oi + h * osh, cos, sin, row, half, interleaved,
                                           out_interleaved, inverse)
            store_fence()
            return
    ahead = PREFETCH_HEADS if geo[item, GEO_COPY_TAIL] != 0 else heads   # in place: the lines just read
    line = line_items(o)
    if unit:
        for h in range(heads):
            if h + ahead < heads:
                for j in range(0, 2 * half, line):
                    prefetch_write(o, oi + (h + ahead) * osh + j)
            if out_interleaved == interleaved:
                done = rotate_pairs_simd(x, xi + h * xsh, o, oi + h * osh, cos, sin, row, half, interleaved, inverse)
            else:
                done = rotate_pairs_to(x, xi + h * xsh, o, oi + h * osh, cos, sin, row, half, interleaved,
                                       out_interleaved, inverse)
        if done == half and not copy_tail:
            return
    width = vector_items(x)
    step, second = (2, 1) if interleaved else (1, half)
    ostep, osecond = (2, 1) if out_interleaved else (1, half)
    for h in range(heads):   # the pairs past the whole registers (strided heads: all), the tail
        xh, oh = xi + h * xsh, oi + h * osh
        for i in range(done, half):
            c = cos[row, i]
            sn = neg_if(sin[row, i], inverse)
            ia, oa = i * step, i * ostep
            xa = load(x, xh + ia * xsd)
            xb = load(x, xh + (ia + second) * xsd)
            store(o, oh + oa * osd, xa * c - xb * sn)
            store(o, oh + (oa + osecond) * osd, xb * c + xa * sn)
        if copy_tail:   # a register at a time where the heads are unit-stride (element by element was 5x slower)
            j = rotary_dim
            while unit and j + width <= head_dim:
                vcopy_flat(x, xh + j, o, oh + j)
                j += width
            for jj in range(j, head_dim):
                o[oh + jj * osd] = x[xh + jj * xsd]


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
                    out_interleaved, inverse, streams):
    """Token t of q (geometry item 0), then of k (item 1)."""
    q_item, k_item = np.int64(0), np.int64(1)   # not literals: one compiled rotate_token for both
    rotate_token(t, xq, oq, geo, q_item, cos, sin, rows, shift, seq_len, half, rotary_dim, head_dim, interleaved,
                 out_interleaved, inverse, streams)
    rotate_token(t, xk, ok, geo, k_item, cos, sin, rows, shift, seq_len, half, rotary_dim, head_dim, interleaved,
                 out_interleaved, inverse, streams)


@njit(parallel=True, **KERNEL_JIT)
def rotate_qk_parallel(xq, oq, xk, ok, geo, cos, sin, rows, shift, n_tokens, seq_len, half, rotary_dim, head_dim,
                       interleaved, out_interleaved, inverse):
    """One parallel pass over the tokens: q's heads, then k's, with the token's table row rows[b or 0, s] + shift;
    pairs read in the layout ``interleaved`` says, written in the one ``out_interleaved`` says (another one:
    never in place). Every output is written through the caches (a call whose geometry marks an output for
    non-temporal stores takes :func:`rotate_qk_streamed`). Returns False, writing nothing, when a row lies outside
    the table (a prepared caller passes positions with shift = -table start and grows the table then)."""
    if not rows_in_table(rows, shift, cos.shape[0]):
        return False
    for t in prange(n_tokens):
        # t as int64: the parfor's loop index is uint64, and its body is typed before and after the parfor
        # pass; both int64, one compiled rotate_token serves both (uint64 compiled a second, ~0.8 s)
        rotate_qk_token(np.int64(t), xq, oq, xk, ok, geo, cos, sin, rows, shift, seq_len, half, rotary_dim,
                        head_dim, interleaved, out_interleaved, inverse, None)
    return True


@njit(parallel=True, **KERNEL_JIT)
def rotate_qk_streamed(xq, oq, xk, ok, geo, cos, sin, rows, shift, n_tokens, seq_len, half, rotary_dim, head_dim,
                       interleaved, out_interleaved, inverse):
    """:func:`rotate_qk_parallel` writing the outputs geo marks (GEO_STREAM: a separate output of at least
    STREAM_MIN_BYTES) by non-temporal stores where a token's head vectors are 16-byte aligned (rotate_token).
    A kernel of its own: compiled into rotate_qk_parallel, the stream path, never taken at decode size, made
    the decode call 7 % slower (32 x 1 token, 32/8 heads x 128, fp32: 15.1 -> 14.0 us, same process) and its
    first compile 5 s longer."""
    if not rows_in_table(rows, shift, cos.shape[0]):
        return False
    streams = np.bool_(True)
    for t in prange(n_tokens):
        rotate_qk_token(np.int64(t), xq, oq, xk, ok, geo, cos, sin, rows, shift, seq_len, half, rotary_dim,
                        head_dim, interleaved, out_interleaved, inverse, streams)
    return True


@njit(**KERNEL_JIT)
def rotate_qk_serial(xq, oq, xk, ok, geo, cos, sin, rows, shift, n_tokens, seq_len, half, rotary_dim, head_dim,
                     interleaved, out_interleaved, inverse):
    """rotate_qk_parallel on the calling thread (small calls: no thread hand-off)."""
    xq, oq, xk, ok, geo = borrowed(xq), borrowed(oq), borrowed(xk), borrowed(ok), borrowed(geo)
    cos, sin, rows = borrowed(cos), borrowed(sin), borrowed(rows)
    if not rows_in_table(rows, shift, cos.shape[0]):
        return False
    for t in range(n_tokens):
        rotate_qk_token(t, xq, oq, xk, ok, geo, cos, sin, rows, shift, seq_len, half, rotary_dim, head_dim,
                        interleaved, out_interleaved, inverse, None)
    return True


