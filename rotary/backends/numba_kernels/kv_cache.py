"""KV-cache kernels of the ``numba`` backend: the ``append_kv`` and ``paged_attention`` primitives
(contract in :mod:`rotary.backends`, reference in :mod:`rotary.backends.kv_entries`).

Append: per token (serial or parallel over the tokens by the rotation's size rule, an append sized as a decode call),
per k/v head, the key is rotated in registers in the work dtype (``y_a = x_a c - x_b s``, ``y_b = x_b c + x_a s``,
:func:`.rotation.rotate_pairs_to`: one multiply and one add or subtract per term, no fused multiply-add,
fastmath off) and written into its slot, rounded once to the entries' dtype; the value is copied (a token's keys,
then its values: two runs of contiguous lines; the next token's lines asked for ahead, for writing: decode-sized
appends write fresh lines: 37-38 us against 44-50 without, serial, B=32 x 8 heads x 128 fp32). A token whose slot
is negative (padding) is skipped, and never prefetched. int8 entries (:func:`quantize_head`): the head's work values
go to a small buffer first (its amax is needed before any entry), then ``scale = amax / 127`` and
``entry = clip(rint(w / scale), -127, 127)`` (``w`` itself when scale is 0), so entries and scales equal the
reference's bit for bit.

Attention: one task per (sequence, k/v head), the q rows of its GQA group (and of its queries: q is packed, sequence
i's queries the rows ``q_starts[i] .. q_starts[i + 1] - 1``, so prefill chunks and decode tokens of several sequences
come in one call) in blocks of ROW_BLOCK rows against blocks of KEY_BLOCK keys read through the block table where
they lie (no gather): scores ``cap(<q fold, k>)`` (q rotated at its table row when the call gives a rotation, as
FlashInfer fuses RoPE, and scaled, once into a work buffer; int8 keys: the dot with the entries times the scale), an
online softmax per row in the work dtype (float32, float64 for float64 caches), values accumulated by multiply-adds
(fused where the CPU has FMA: results match the reference to rounding, not bit for bit). Each row sees the keys of its
own range (causal: ``p <= it`` and ``it - p < window``), so a masked key is never read into a row.

The arithmetic is tiled for the vector unit (AVX-512: 16 float32 lanes). Scores come ``max(4, lanes)`` keys at a
time: four keys' dot products accumulate in four vectors, which are folded pairwise (:func:`vfold`) into one vector
of the tile's scores, instead of a horizontal sum per key. Four q rows that read the same keys (a query's GQA group in
a decode step) are scored and accumulated together, so each key and value vector is loaded once for the four rows
(:func:`tile_scores_rows`, :func:`add_weighted_rows`): a key's entries lie ``kv_heads * head_dim`` entries from the
next key's, 4 KiB apart in vLLM's layout at 8 x 128 float32, so a block's keys share a few first-level cache sets
and a row-by-row pass read them again from the second level. The weights ``exp(s - max)`` are taken a vector at a
time (:func:`.simd.vexp`, a few ulp).

Memory: each block's lines are read before it is computed, by demand loads in address order (:func:`touch_keys`,
:func:`touch_rows`, :func:`.simd.touch_read`), which the hardware prefetchers follow at about the read limit; the
block is then computed from the second-level cache (a block of 32 keys x 8 heads x 128 float32 is 256 KiB of K+V;
int8 entries come in blocks of INT8_KEY_BLOCK keys).
Software prefetches of the next block (the kernel before) each held a first-level miss buffer and trained no hardware
prefetcher, and the computation hid little of the memory time: one thread 12-14 GB/s that way, 19-21 GB/s touched
(32 sequences x 1000 keys, 8 x 128 float32, GQA 4, Zen 4 VM; the same from the caches: 37-44 GB/s; a plain read:
33-40 GB/s). When the (sequence, split) tasks are enough for the threads (``numba_kv``'s rule: a decode step's
sequence counts as one task, and one long sequence is split), a sequence's task takes every k/v head block by block
(``all_heads``): it reads the block's pages whole (a key's heads lie side by side: 4 KiB a key at 8 x 128 float32)
and, where its rows come in fours of one key range (GQA groups a multiple of 4), computes in address order too:
:func:`tile_scores_heads` scores four keys of every head in turn, :func:`add_weighted_heads` adds HEAD_CHUNK keys'
values head after head, each row's operations those of a head-by-head pass (the same bits). A task per k/v head
touches its head's 512-byte rows of a block (4 KiB apart), then computes them.

Split-K (flash-decoding): a call may cut each sequence's keys into ``splits`` contiguous parts of whole KEY_BLOCKs
(:func:`split_keys`: the range the sequence's rows read, from its first query's first key to its last key), one task
per (sequence, k/v head, split), so one long sequence or few k/v heads keep every thread busy. A split's task runs
the same :func:`attend_task` on the keys of its part (each row's range clipped to it) and leaves its unnormalized
accumulator and (max, sum) per q row in a work-dtype workspace; :func:`combine_task` then merges the splits by
log-sum-exp (``m = max m_s``, ``l = sum l_s exp(m_s - m)``, ``o = sum acc_s exp(m_s - m) / l`` over the splits whose
``l_s`` is not 0; a row no split gave a key gets 0, as with one split). ``splits == 1`` writes o directly.

Buffers as in :mod:`.common`: flat 1-D C-contiguous buffers with int64 offsets and strides, float16 as its
uint16 bits (converted by :func:`.common.load` / :func:`.common.store`, :func:`load_as`, :func:`vload_as`).
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import errors
from numba.extending import register_jitable

from .common import borrowed, element_offset, imax, imin, load, store
from .rotation import rotate_pairs_stream, rotate_pairs_to
from .simd import (KERNEL_JIT, Vec, _flat_pointer, half_to_float_ir, is_aligned16, lanes, line_items, lowered_in_place,
                   prefetch_write, store_fence, touch_read, vadd, vcopy_flat, vdeinterleave, vector_items, vexp, vload,
                   vmadd, vmax_lanes, vmul, vsplat, vstore, vstore_stream16, vsub, vsum_pairwise, vzeros)

#: q rows (queries x heads of one GQA group) one task holds at a time: their scaled q, accumulators and scores
#: stay in the first-level cache (16 x 128 float32: 8 KiB each)
ROW_BLOCK = 16
#: keys per block of float entries (the online softmax rescales the accumulators once per block), and the unit a
#: split's keys are rounded to
KEY_BLOCK = 32
#: keys per block of int8 entries: a quarter of float32's bytes for the same arithmetic, so longer blocks (fewer
#: passes of the softmax's per-block work; 64 against 32, 8 x 128, GQA 4, 2 threads, bench_decode_step A/B: 5-6 %
#: faster, where float32 entries in blocks of 64 were 6 % slower)
INT8_KEY_BLOCK = 64
#: keys a row of the scores', weights' and block scales' buffers holds (the longest block)
BLOCK_ROW = max(KEY_BLOCK, INT8_KEY_BLOCK)
#: keys whose values a task taking every k/v head adds to its rows' accumulators head after head
#: (:func:`add_weighted_heads`: a chunk's values are read in address order, each row's 4 x 4 accumulator vectors loaded
#: and stored once per head and chunk)
HEAD_CHUNK = 8
#: geometry columns of k and v in :func:`append_kv_serial`: element offset, then strides of token, head, coordinate
GEO_OFFSET, GEO_T, GEO_H, GEO_D = 0, 1, 2, 3


# -- entries of any dtype in the work dtype ------------------------------------------------------------------
_ENTRY_DTYPES = (types.int8, types.uint16, types.float32, types.float64)


def _convert_ir(builder, value, source, target, target_type):
    """LLVM conversion of an entry value (scalar or vector) of numba dtype ``source`` to float ``target``:
    int8 exactly (sitofp), float16 bits exactly (:func:`.simd.half_to_float_ir`), float32 widened."""
    if source == types.int8:
        return builder.sitofp(value, target_type)
    if source == types.uint16:
        value = half_to_float_ir(builder, value)
        return value if target == types.float32 else builder.fpext(value, target_type)
    if source == target:
        return value
    return builder.fpext(value, target_type) if target == types.float64 else builder.fptrunc(value, target_type)


def _check_entries(buf, like, what):
    if not (isinstance(buf, types.Array) and buf.layout == "C" and buf.dtype in _ENTRY_DTYPES
            and isinstance(like, types.Array) and like.dtype in (types.float32, types.float64)):
        raise errors.TypingError(f"{what} reads a C-contiguous int8 / float16-bits / float array into a float32 or "
                                 f"float64 one, got {buf}, {like}")


def load_as(buf, i, like):
    """buf.flat[i] as a number of like's dtype (float32/float64): int8 entries, float16 bits and floats exactly
    (float32 to float64 widened)."""
    value = buf.reshape(-1)[i]
    if buf.dtype == np.uint16:
        value = value.view(np.float16)
    return like.dtype.type(value)


def _load_as_definition(typingctx, buf, i, like):
    _check_entries(buf, like, "load_as")

    def codegen(context, builder, signature, args):
        ptr = _flat_pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        return _convert_ir(builder, builder.load(ptr), buf.dtype, like.dtype, context.get_value_type(like.dtype))

    return like.dtype(buf, i, like), codegen


def vload_as(buf, i, like):
    """The vector buf.flat[i : i + lanes(like)] in like's dtype (float32/float64), converted as :func:`load_as`."""
    part = buf.reshape(-1)[i:i + lanes(like)]
    if buf.dtype == np.uint16:
        part = part.view(np.float16)
    return part.astype(like.dtype)


def _vload_as_definition(typingctx, buf, i, like):
    _check_entries(buf, like, "vload_as")
    vec = Vec(like.dtype)

    def codegen(context, builder, signature, args):
        ptr = _flat_pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        raw_type = ir.VectorType(context.get_value_type(buf.dtype), vec.lanes)
        raw = builder.load(builder.bitcast(ptr, raw_type.as_pointer()), align=buf.dtype.bitwidth // 8)
        return _convert_ir(builder, raw, buf.dtype, like.dtype, context.get_value_type(vec))

    return vec(buf, i, like), codegen


lowered_in_place(load_as, _load_as_definition)
lowered_in_place(vload_as, _vload_as_definition)


# -- append ------------------------------------------------------------------------------------------------------
@register_jitable(inline="always")
def rotate_head(x, xi, xsd, dst, di, cos, sin, row, half, rotary_dim, offset, head_dim, interleaved):
    """dst.flat[di : di + head_dim] = the head x.flat[xi + j * xsd] (j < head_dim) with the pairs of
    [offset, offset + rotary_dim) rotated by table row ``row`` in the work dtype and every value rounded once to
    dst's dtype (dst: the entries, or a work-dtype buffer); the other coordinates converted (the same dtype: copied
    bit for bit). A unit-stride head rotates whole registers of pairs first (:func:`.rotation.rotate_pairs_to`)."""
    done = 0
    if xsd == 1:
        done = rotate_pairs_to(x, xi + offset, dst, di + offset, cos, sin, row, half, interleaved, interleaved,
                               False)
    step, second = (2, 1) if interleaved else (1, half)
    for i in range(done, half):
        c, s = cos[row, i], sin[row, i]
        ia = offset + i * step
        xa = load(x, xi + ia * xsd)
        xb = load(x, xi + (ia + second) * xsd)
        store(dst, di + ia, xa * c - xb * s)
        store(dst, di + ia + second, xb * c + xa * s)
    convert_head(x, xi, xsd, dst, di, 0, offset)
    convert_head(x, xi, xsd, dst, di, offset + rotary_dim, head_dim)


@register_jitable(inline="always")
def norm_head(x, xi, xsd, dst, di, norm, head_dim):
    """dst[di + j] = (x_j * inv) * weight[j] for the head x_j = x.flat[xi + j * xsd] (j < head_dim) in the work dtype
    (dst's): the per-head RMSNorm (Qwen3's q_norm / k_norm), ``norm = (weight, eps, head_dim)`` with eps and
    head_dim in the work dtype, ``inv = 1 / sqrt(sum_j x_j^2 / head_dim + eps)``."""
    weight, eps, d = norm
    ss = eps - eps
    for j in range(head_dim):
        a = load(x, xi + j * xsd)
        dst[di + j] = a
        ss += a * a
    inv = (d / d) / np.sqrt(ss / d + eps)
    for j in range(head_dim):
        dst[di + j] = (dst[di + j] * inv) * weight[j]


@register_jitable(inline="always")
def copy_head(x, xi, xsd, dst, di, start, stop):
    """dst.flat[di + j] = x.flat[xi + j * xsd] for start <= j < stop, x and dst of one dtype: the bits copied, a
    register at a time for a unit-stride head."""
    j = start
    if xsd == 1:
        width = vector_items(x)
        while j + width <= stop:
            vcopy_flat(x, xi + j, dst, di + j)
            j += width
    for jj in range(j, stop):
        dst[di + jj] = x[xi + jj * xsd]


@register_jitable(inline="always")
def convert_head(x, xi, xsd, dst, di, start, stop):
    """dst.flat[di + j] = x.flat[xi + j * xsd] for start <= j < stop, converted to dst's dtype through the work
    dtype (:func:`.common.load` / :func:`.common.store`; float16 bits round-trip exactly)."""
    for j in range(start, stop):
        store(dst, di + j, load(x, xi + j * xsd))


@register_jitable
def quantize_head(w, dst, di, scales, si, head_dim, limit):
    """int8 entries dst.flat[di : di + head_dim] and scales[si] of the work values w[:head_dim] (the reference's
    formulas in w's dtype: amax = max |w|, scale = amax / limit, entry = clip(rint(w / scale), -limit, limit),
    the division by 1 where scale is 0)."""
    amax = abs(w[0])
    for j in range(1, head_dim):
        a = abs(w[j])
        if a > amax:
            amax = a
    scale = amax / limit
    safe = scale if scale > 0 else limit / limit
    for j in range(head_dim):
        y = np.rint(w[j] / safe)
        if y > limit:
            y = limit
        elif y < -limit:
            y = -limit
        dst[di + j] = np.int8(y)
    scales[si] = scale


@register_jitable
def stream_normed_keys(k, ki, ksh, k_ent, e, cos, sin, row, heads, head_dim, half, interleaved, norm):
    """The keys of a streamed token (:func:`append_token`) with a ``norm``: each unit-stride head normed
    (:func:`norm_head`) into a buffer, then rotated from it by non-temporal stores into k_ent.flat[e + h * head_dim ..]
    (a function of its own: inlined, the norm's branch would be typed for calls without one)."""
    normed = np.empty(head_dim, cos.dtype)
    for h in range(heads):
        norm_head(k, ki + h * ksh, 1, normed, 0, norm, head_dim)
        rotate_pairs_stream(normed, 0, k_ent, e + h * head_dim, cos, sin, row, half, interleaved, False)


@register_jitable(inline="always")
def stream_values(v, vi, vsh, v_ent, e, heads, head_dim):
    """v_ent.flat[e + h * head_dim + j] = the unit-stride value heads v.flat[vi + h * vsh + j], by non-temporal
    stores (:func:`.simd.vstore_stream16`; a head whole registers)."""
    width = vector_items(v_ent)
    for h in range(heads):
        for j in range(0, head_dim, width):
            vstore_stream16(v_ent, e + h * head_dim + j, vload(v, vi + h * vsh + j))


@register_jitable
def append_token(t, k, v, geo, k_ent, v_ent, k_scale, v_scale, cos, sin, rows, slots, heads, head_dim, half,
                 rotary_dim, offset, interleaved, int8_limit, float_entries, stream, norm, unnormed):
    """Token t: every head's key (normed first when ``norm`` = (weight, eps, head_dim) is given: :func:`norm_head`)
    rotated at table row rows[t] into slot slots[t] of k_ent, its value into v_ent
    (nothing when slots[t] < 0: a padding token): int8 entries with their scales (``int8_limit``: the format's
    limit, 127, in the work dtype; ``float_entries`` None), or entries of k's dtype (``int8_limit`` None;
    ``float_entries`` True). The glue sets the markers from the format's row of ``kv_entries.KV_FORMATS`` (its code);
    Numba prunes the branch whose marker is None before typing (an argument of type None), so each format compiles
    only its own branch; so for ``norm`` (None or a tuple) and ``unnormed`` (True or None: the other). ``stream``
    True (the glue's marker: float entries of k's float32 / float64, unit-stride heads whose every coordinate is
    rotated, a head whole registers) writes the token by non-temporal stores where its rows are 16-byte aligned
    (:func:`.rotation.rotate_pairs_stream`, :func:`stream_values`); None: plain stores."""
    row, slot = rows[t], slots[t]
    if slot < 0:   # a padding token: nothing of it read or written
        return
    ki = element_offset(geo[0, GEO_OFFSET], geo[0, GEO_T], 0, 0, t, 0, 0)
    vi = element_offset(geo[1, GEO_OFFSET], geo[1, GEO_T], 0, 0, t, 0, 0)
    ksh, ksd, vsh, vsd = geo[0, GEO_H], geo[0, GEO_D], geo[1, GEO_H], geo[1, GEO_D]
    e = slot * heads * head_dim
    if stream is not None and is_aligned16(k_ent, e) and is_aligned16(v_ent, e):   # (a head is whole registers)
        # the token's entries written around the caches (then ordered by a fence): a decode step's slots are lines
        # nobody has read lately (a new row of each sequence, pages apart), which plain stores read before they write
        # them, at half a copy's speed (32 tokens x 8 heads x 128 float32, the serial kernel: 24 us a step against 12
        # for NumPy's copy; 12 this way). Each key rotated as rotate_head rotates it: the same bits.
        if norm is not None:
            stream_normed_keys(k, ki, ksh, k_ent, e, cos, sin, row, heads, head_dim, half, interleaved, norm)
        if unnormed is not None:
            for h in range(heads):
                rotate_pairs_stream(k, ki + h * ksh, k_ent, e + h * head_dim, cos, sin, row, half, interleaved, False)
        stream_values(v, vi, vsh, v_ent, e, heads, head_dim)
        store_fence()
        return
    if t + 1 < slots.shape[0] and slots[t + 1] >= 0:   # the next token's entries asked for (writing): their lines
        nxt = slots[t + 1] * heads * head_dim         # come while this one works
        for j in range(0, heads * head_dim, line_items(k_ent)):
            prefetch_write(k_ent, nxt + j)
            prefetch_write(v_ent, nxt + j)
    if int8_limit is not None:
        w = np.empty(head_dim, k_scale.dtype)
        normed = np.empty(head_dim, k_scale.dtype)   # the normed key (with a norm)
        for h in range(heads):
            e = slot * heads + h
            if norm is not None:
                norm_head(k, ki + h * ksh, ksd, normed, 0, norm, head_dim)
                rotate_head(normed, 0, 1, w, 0, cos, sin, row, half, rotary_dim, offset, head_dim, interleaved)
            if unnormed is not None:
                rotate_head(k, ki + h * ksh, ksd, w, 0, cos, sin, row, half, rotary_dim, offset, head_dim, interleaved)
            quantize_head(w, k_ent, e * head_dim, k_scale, e, head_dim, int8_limit)
            convert_head(v, vi + h * vsh, vsd, w, 0, 0, head_dim)
            quantize_head(w, v_ent, e * head_dim, v_scale, e, head_dim, int8_limit)
    if float_entries is not None:
        if norm is not None:
            normed = np.empty(head_dim, k_scale.dtype)
            for h in range(heads):
                norm_head(k, ki + h * ksh, ksd, normed, 0, norm, head_dim)
                rotate_head(normed, 0, 1, k_ent, (slot * heads + h) * head_dim, cos, sin, row, half, rotary_dim,
                            offset, head_dim, interleaved)
        if unnormed is not None:
            for h in range(heads):
                rotate_head(k, ki + h * ksh, ksd, k_ent, (slot * heads + h) * head_dim, cos, sin, row, half,
                            rotary_dim, offset, head_dim, interleaved)
        for h in range(heads):
            copy_head(v, vi + h * vsh, vsd, v_ent, (slot * heads + h) * head_dim, 0, head_dim)


@njit(parallel=True, **KERNEL_JIT)
def append_kv_parallel(k, v, geo, k_ent, v_ent, k_scale, v_scale, cos, sin, rows, slots, n_tokens, heads, head_dim,
                       half, rotary_dim, offset, interleaved, int8_limit, float_entries, stream, norm, unnormed):
    """The append of n_tokens tokens, one parallel pass over the tokens (:func:`append_token`). k, v: flat buffers
    with geo (2, 4) int64: (offset, token, head, coordinate strides) of k and of v; k_ent, v_ent: the flat
    entries (slots, heads, head_dim); k_scale, v_scale: the flat scales (slots, heads) in the work dtype (any
    work-dtype arrays for float entries); rows, slots: int64 (n_tokens,), slots[t] < 0 a padding token (skipped);
    int8_limit, float_entries: which format of entries (:func:`append_token`); stream: True or None (non-temporal
    stores, :func:`append_token`); norm: None, or the keys' per-head RMSNorm (weight, eps, head_dim)
    (:func:`norm_head`), and unnormed True or None (the other; append_token's markers)."""
    for t in prange(n_tokens):
        append_token(np.int64(t), k, v, geo, k_ent, v_ent, k_scale, v_scale, cos, sin, rows, slots, heads,
                     head_dim, half, rotary_dim, offset, interleaved, int8_limit, float_entries, stream, norm, unnormed)


@njit(**KERNEL_JIT)
def append_kv_serial(k, v, geo, k_ent, v_ent, k_scale, v_scale, cos, sin, rows, slots, n_tokens, heads, head_dim,
                     half, rotary_dim, offset, interleaved, int8_limit, float_entries, stream, norm, unnormed):
    """append_kv_parallel on the calling thread (decode-sized calls: no thread hand-off)."""
    k, v, geo, k_ent, v_ent = borrowed(k), borrowed(v), borrowed(geo), borrowed(k_ent), borrowed(v_ent)
    k_scale, v_scale, cos, sin = borrowed(k_scale), borrowed(v_scale), borrowed(cos), borrowed(sin)
    rows, slots = borrowed(rows), borrowed(slots)
    for t in range(n_tokens):
        append_token(t, k, v, geo, k_ent, v_ent, k_scale, v_scale, cos, sin, rows, slots, heads, head_dim, half,
                     rotary_dim, offset, interleaved, int8_limit, float_entries, stream, norm, unnormed)


# -- attention ---------------------------------------------------------------------------------------------------
@register_jitable(inline="always")
def dot_entries(qs, qi, entries, ei, head_dim):
    """sum_j qs[qi + j] entries.flat[ei + j] in qs's dtype (two vector accumulators, added, then the lanes by halves,
    then the coordinates past the last whole pair of vectors)."""
    width = lanes(qs)
    full = head_dim - head_dim % (2 * width)
    acc0, acc1 = vzeros(qs), vzeros(qs)
    for j in range(0, full, 2 * width):
        acc0 = vmadd(acc0, vload(qs, qi + j), vload_as(entries, ei + j, qs))
        acc1 = vmadd(acc1, vload(qs, qi + j + width), vload_as(entries, ei + j + width, qs))
    total = vsum_pairwise(vadd(acc0, acc1))
    for j in range(full, head_dim):
        total += qs[qi + j] * load_as(entries, ei + j, qs)
    return total


@register_jitable
def vfold(x, y):
    """The pairs of lanes of x ++ y added: lane j < lanes/2 is x[2j] + x[2j+1], lane lanes/2 + j is y[2j] + y[2j+1].
    Folding vectors a_0, a_1, ... pairwise, level by level, ends in one vector whose lane j is the sum of a_j's
    lanes: the horizontal sums of ``lanes`` dot products in lanes - 1 folds (2 shuffles and an add each)."""
    even, odd = vdeinterleave(x, y)
    return vadd(even, odd)


@register_jitable(inline="always")
def dot_four(qs, qi, entries, e0, e1, e2, e3, head_dim):
    """The dot products of qs[qi : qi + head_dim] with four keys (entries.flat[e : e + head_dim]) over the
    coordinates of whole vectors, as two folded vectors (vfold(a0, a1), vfold(a2, a3)) of the four
    accumulators a_k (q loaded once per vector for the four keys: four independent chains of multiply-adds)."""
    width = lanes(qs)
    a0, a1, a2, a3 = vzeros(qs), vzeros(qs), vzeros(qs), vzeros(qs)
    for c in range(0, head_dim - head_dim % width, width):
        x = vload(qs, qi + c)
        a0 = vmadd(a0, x, vload_as(entries, e0 + c, qs))
        a1 = vmadd(a1, x, vload_as(entries, e1 + c, qs))
        a2 = vmadd(a2, x, vload_as(entries, e2 + c, qs))
        a3 = vmadd(a3, x, vload_as(entries, e3 + c, qs))
    return vfold(a0, a1), vfold(a2, a3)


@register_jitable(inline="always")
def fold_groups(parts, pi, groups, width):
    """The vector of a tile's scores from its ``groups`` folded four-key sums parts[pi + g * width ..] (g < groups):
    one group is the tile (lanes 4), two or four are folded pairwise (lanes 8, 16)."""
    if groups == 1:
        return vload(parts, pi)
    if groups == 2:
        return vfold(vload(parts, pi), vload(parts, pi + width))
    return vfold(vfold(vload(parts, pi), vload(parts, pi + width)),
                 vfold(vload(parts, pi + 2 * width), vload(parts, pi + 3 * width)))


@register_jitable
def tile_scores(scores, si, qs, qi, entries, bases, t_lo, t_hi, head_dim, parts):
    """scores[si + j] = <qs[qi : qi + head_dim], key j> for the keys j of the whole tiles t_lo..t_hi-1 of a block
    (key j's entries at bases[j]), ``tile`` = max(4, lanes) keys at a time: :func:`dot_four` per four keys, each
    four's two vectors folded into one (kept in ``parts``), the tile's folded into one vector of its ``lanes``
    scores (lanes 16: 15 folds for 16 dots, against 4 shuffles and adds per dot alone), then the coordinates past
    the last whole vector added key by key. (One call a block: each call of a compiled function counts its array
    arguments' references, atomic operations that cost as much as a tile's folds.)"""
    width = lanes(qs)
    full = head_dim - head_dim % width
    groups = imax(1, width // 4)
    for b0 in range(t_lo, t_hi, imax(4, width)):
        at = si + b0
        for g in range(groups):
            e = b0 + 4 * g
            x, y = dot_four(qs, qi, entries, bases[e], bases[e + 1], bases[e + 2], bases[e + 3], head_dim)
            if width == 2:   # two keys a vector: x and y are the sums
                vstore(scores, at, x)
                vstore(scores, at + 2, y)
            else:
                vstore(parts, g * width, vfold(x, y))
        if width > 2:
            vstore(scores, at, fold_groups(parts, 0, groups, width))
        for j in range(imax(4, width) if full < head_dim else 0):
            total = scores[at + j]
            for c in range(full, head_dim):
                total += qs[qi + c] * load_as(entries, bases[b0 + j] + c, qs)
            scores[at + j] = total


@register_jitable(inline="always")
def dot_rows_four(qs, qi, entries, e0, e1, e2, e3, head_dim):
    """For four q rows (qs[qi + r * head_dim ..], r < 4) and four keys (entries.flat[e_k ..]): per row r the
    vector vfold(vfold(a_r0, a_r1), vfold(a_r2, a_r3)) of its accumulators a_rk over the coordinates of whole
    vectors (each key vector loaded once for the four rows: 16 independent chains of multiply-adds)."""
    width = lanes(qs)
    a00, a01, a02, a03 = vzeros(qs), vzeros(qs), vzeros(qs), vzeros(qs)
    a10, a11, a12, a13 = vzeros(qs), vzeros(qs), vzeros(qs), vzeros(qs)
    a20, a21, a22, a23 = vzeros(qs), vzeros(qs), vzeros(qs), vzeros(qs)
    a30, a31, a32, a33 = vzeros(qs), vzeros(qs), vzeros(qs), vzeros(qs)
    for c in range(0, head_dim - head_dim % width, width):
        k0, k1 = vload_as(entries, e0 + c, qs), vload_as(entries, e1 + c, qs)
        k2, k3 = vload_as(entries, e2 + c, qs), vload_as(entries, e3 + c, qs)
        x = vload(qs, qi + c)
        a00, a01, a02, a03 = vmadd(a00, x, k0), vmadd(a01, x, k1), vmadd(a02, x, k2), vmadd(a03, x, k3)
        x = vload(qs, qi + head_dim + c)
        a10, a11, a12, a13 = vmadd(a10, x, k0), vmadd(a11, x, k1), vmadd(a12, x, k2), vmadd(a13, x, k3)
        x = vload(qs, qi + 2 * head_dim + c)
        a20, a21, a22, a23 = vmadd(a20, x, k0), vmadd(a21, x, k1), vmadd(a22, x, k2), vmadd(a23, x, k3)
        x = vload(qs, qi + 3 * head_dim + c)
        a30, a31, a32, a33 = vmadd(a30, x, k0), vmadd(a31, x, k1), vmadd(a32, x, k2), vmadd(a33, x, k3)
    return (vfold(vfold(a00, a01), vfold(a02, a03)), vfold(vfold(a10, a11), vfold(a12, a13)),
            vfold(vfold(a20, a21), vfold(a22, a23)), vfold(vfold(a30, a31), vfold(a32, a33)))


@register_jitable
def tile_scores_rows(scores, si, qs, qi, entries, bases, t_lo, t_hi, head_dim, parts):
    """:func:`tile_scores` for four q rows at once (row r's q at qs[qi + r * head_dim], its scores at
    scores[si + r * BLOCK_ROW]; lanes >= 4): :func:`dot_rows_four` per four keys, folded per row into one vector of
    the tile's ``lanes`` scores."""
    width = lanes(qs)
    full = head_dim - head_dim % width
    groups = width // 4
    for b0 in range(t_lo, t_hi, width):
        at = si + b0
        for g in range(groups):
            e = b0 + 4 * g
            g0, g1, g2, g3 = dot_rows_four(qs, qi, entries, bases[e], bases[e + 1], bases[e + 2], bases[e + 3],
                                           head_dim)
            vstore(parts, g * width, g0)
            vstore(parts, (groups + g) * width, g1)
            vstore(parts, (2 * groups + g) * width, g2)
            vstore(parts, (3 * groups + g) * width, g3)
        for r in range(4):
            vstore(scores, at + r * BLOCK_ROW, fold_groups(parts, r * groups * width, groups, width))
        for r in range(4 if full < head_dim else 0):
            for j in range(width):
                total = scores[at + r * BLOCK_ROW + j]
                for c in range(full, head_dim):
                    total += qs[qi + r * head_dim + c] * load_as(entries, bases[b0 + j] + c, qs)
                scores[at + r * BLOCK_ROW + j] = total


@register_jitable(inline="always")
def load_four(buf, i, width):
    """The four vectors buf[i ..], buf[i + width ..], buf[i + 2 width ..], buf[i + 3 width ..]."""
    return vload(buf, i), vload(buf, i + width), vload(buf, i + 2 * width), vload(buf, i + 3 * width)


@register_jitable(inline="always")
def store_four(buf, i, width, a, b, c, d):
    """buf[i ..], buf[i + width ..], buf[i + 2 width ..], buf[i + 3 width ..] = a, b, c, d."""
    vstore(buf, i, a)
    vstore(buf, i + width, b)
    vstore(buf, i + 2 * width, c)
    vstore(buf, i + 3 * width, d)


@register_jitable(inline="always")
def add_weighted_rows(acc, ai, weights, wi, entries, bases, eoff, first, last, head_dim):
    """:func:`add_weighted` for four rows at once (row r: acc[ai + r * head_dim ..] with the weights
    weights[wi + r * BLOCK_ROW + j]; key j's values at bases[j] + eoff): each value vector loaded once for the four
    rows, four vectors of each row in registers through the keys (16 independent chains), then one vector per row,
    then the last coordinates."""
    width = lanes(acc)
    full = head_dim - head_dim % width
    quads = full - full % (4 * width)
    r1, r2, r3 = ai + head_dim, ai + 2 * head_dim, ai + 3 * head_dim
    for c in range(0, quads, 4 * width):
        t00, t01, t02, t03 = load_four(acc, ai + c, width)
        t10, t11, t12, t13 = load_four(acc, r1 + c, width)
        t20, t21, t22, t23 = load_four(acc, r2 + c, width)
        t30, t31, t32, t33 = load_four(acc, r3 + c, width)
        for j in range(first, last + 1):
            e = load(bases, j) + eoff + c
            v0, v1 = vload_as(entries, e, acc), vload_as(entries, e + width, acc)
            v2, v3 = vload_as(entries, e + 2 * width, acc), vload_as(entries, e + 3 * width, acc)
            w = vsplat(load(weights, wi + j))
            t00, t01, t02, t03 = vmadd(t00, w, v0), vmadd(t01, w, v1), vmadd(t02, w, v2), vmadd(t03, w, v3)
            w = vsplat(load(weights, wi + BLOCK_ROW + j))
            t10, t11, t12, t13 = vmadd(t10, w, v0), vmadd(t11, w, v1), vmadd(t12, w, v2), vmadd(t13, w, v3)
            w = vsplat(load(weights, wi + 2 * BLOCK_ROW + j))
            t20, t21, t22, t23 = vmadd(t20, w, v0), vmadd(t21, w, v1), vmadd(t22, w, v2), vmadd(t23, w, v3)
            w = vsplat(load(weights, wi + 3 * BLOCK_ROW + j))
            t30, t31, t32, t33 = vmadd(t30, w, v0), vmadd(t31, w, v1), vmadd(t32, w, v2), vmadd(t33, w, v3)
        store_four(acc, ai + c, width, t00, t01, t02, t03)
        store_four(acc, r1 + c, width, t10, t11, t12, t13)
        store_four(acc, r2 + c, width, t20, t21, t22, t23)
        store_four(acc, r3 + c, width, t30, t31, t32, t33)
    for c in range(quads, full, width):
        t0, t1, t2, t3 = vload(acc, ai + c), vload(acc, r1 + c), vload(acc, r2 + c), vload(acc, r3 + c)
        for j in range(first, last + 1):
            v = vload_as(entries, load(bases, j) + eoff + c, acc)
            t0 = vmadd(t0, vsplat(load(weights, wi + j)), v)
            t1 = vmadd(t1, vsplat(load(weights, wi + BLOCK_ROW + j)), v)
            t2 = vmadd(t2, vsplat(load(weights, wi + 2 * BLOCK_ROW + j)), v)
            t3 = vmadd(t3, vsplat(load(weights, wi + 3 * BLOCK_ROW + j)), v)
        vstore(acc, ai + c, t0)
        vstore(acc, r1 + c, t1)
        vstore(acc, r2 + c, t2)
        vstore(acc, r3 + c, t3)
    for r in range(4):
        for c in range(full, head_dim):
            x = acc[ai + r * head_dim + c]
            for j in range(first, last + 1):
                x += weights[wi + r * BLOCK_ROW + j] * load_as(entries, bases[j] + eoff + c, acc)
            acc[ai + r * head_dim + c] = x


@register_jitable(inline="always")
def weigh_row(scores, w, a, b, t_lo, t_hi, rr, m, den, acc, head_dim, k_scales, v_scales, si, quantized, softcap,
              zero):
    """Row rr's scores of keys a..b of a block (scores[w + j], computed over the whole tiles t_lo..t_hi-1) turned
    into its weights by the online softmax: k's scales (the block's, k_scales[si + j]) and the softcap applied, the
    tiles' other keys masked to -inf, the new maximum, the row's sum and accumulator rescaled, weights exp(s - max)
    (times v's scales v_scales[si + j])."""
    width = lanes(scores)
    if quantized:
        for t0 in range(t_lo, t_hi, width):
            vstore(scores, w + t0, vmul(vload(scores, w + t0), vload(k_scales, si + t0)))
    if softcap != zero:
        for j in range(a, b + 1):
            scores[w + j] = math.tanh(scores[w + j]) * softcap
    for j in range(t_lo, a):   # the tiles' keys outside the row's range weigh exp(-inf) = 0
        scores[w + j] = -np.inf
    for j in range(b + 1, t_hi):
        scores[w + j] = -np.inf
    old = m[rr]
    top = old
    for t0 in range(t_lo, t_hi, width):
        x = vmax_lanes(vload(scores, w + t0))
        if x > top:
            top = x
    safe = top if top != -np.inf else zero   # every score so far -inf: exps of 0, not NaN
    if old != top:
        alpha = zero + math.exp(old - safe)   # (the work dtype in plain Python too: math.exp gives a float)
        den[rr] *= alpha
        scale_row(acc, rr * head_dim, alpha, head_dim)
    total = den[rr]
    shift = vsplat(safe)
    for t0 in range(t_lo, t_hi, width):
        weights = vexp(vsub(vload(scores, w + t0), shift))
        total += vsum_pairwise(weights)
        vstore(scores, w + t0, vmul(weights, vload(v_scales, si + t0)) if quantized else weights)
    den[rr] = total
    m[rr] = top


@register_jitable(inline="always")
def add_weighted(acc, ai, weights, wi, entries, bases, first, last, head_dim):
    """acc[ai : ai + head_dim] += sum_{first <= j <= last} weights[wi + j] entries.flat[bases[j] : + head_dim]
    (key j of a block): eight vectors of acc at a time in registers through the keys (eight independent chains of
    multiply-adds: with four, each key waited on the last one's), then four, then one at a time, then the
    coordinates past the last whole vector."""
    width = lanes(acc)
    full = head_dim - head_dim % width
    octets = full - full % (8 * width)
    quads = full - full % (4 * width)
    for c in range(0, octets, 8 * width):
        t0, t1, t2, t3 = load_four(acc, ai + c, width)
        t4, t5, t6, t7 = load_four(acc, ai + c + 4 * width, width)
        for j in range(first, last + 1):
            w, e = vsplat(load(weights, wi + j)), load(bases, j) + c
            t0 = vmadd(t0, w, vload_as(entries, e, acc))
            t1 = vmadd(t1, w, vload_as(entries, e + width, acc))
            t2 = vmadd(t2, w, vload_as(entries, e + 2 * width, acc))
            t3 = vmadd(t3, w, vload_as(entries, e + 3 * width, acc))
            t4 = vmadd(t4, w, vload_as(entries, e + 4 * width, acc))
            t5 = vmadd(t5, w, vload_as(entries, e + 5 * width, acc))
            t6 = vmadd(t6, w, vload_as(entries, e + 6 * width, acc))
            t7 = vmadd(t7, w, vload_as(entries, e + 7 * width, acc))
        store_four(acc, ai + c, width, t0, t1, t2, t3)
        store_four(acc, ai + c + 4 * width, width, t4, t5, t6, t7)
    for c in range(octets, quads, 4 * width):
        t0, t1, t2, t3 = load_four(acc, ai + c, width)
        for j in range(first, last + 1):
            w, e = vsplat(load(weights, wi + j)), load(bases, j) + c
            t0 = vmadd(t0, w, vload_as(entries, e, acc))
            t1 = vmadd(t1, w, vload_as(entries, e + width, acc))
            t2 = vmadd(t2, w, vload_as(entries, e + 2 * width, acc))
            t3 = vmadd(t3, w, vload_as(entries, e + 3 * width, acc))
        store_four(acc, ai + c, width, t0, t1, t2, t3)
    for c in range(quads, full, width):
        total = vload(acc, ai + c)
        for j in range(first, last + 1):
            total = vmadd(total, vsplat(load(weights, wi + j)), vload_as(entries, load(bases, j) + c, acc))
        vstore(acc, ai + c, total)
    for c in range(full, head_dim):
        x = acc[ai + c]
        for j in range(first, last + 1):
            x += weights[wi + j] * load_as(entries, bases[j] + c, acc)
        acc[ai + c] = x


@register_jitable(inline="always")
def scale_row(acc, ai, factor, head_dim):
    """acc[ai : ai + head_dim] *= factor."""
    width = lanes(acc)
    full = head_dim - head_dim % width
    f = vsplat(factor)
    for j in range(0, full, width):
        vstore(acc, ai + j, vmul(vload(acc, ai + j), f))
    for j in range(full, head_dim):
        acc[ai + j] *= factor


@register_jitable(inline="always")
def block_bases(bases, block_table, i, k0, k1, page_size, kv_heads, h, head_dim):
    """bases[p - k0] = flat index of entry (slot of key p, h, 0) for the keys k0..k1-1 of sequence i (one division
    per block; software prefetch of these rows measured no faster: the hardware's own streams suffice)."""
    page = k0 // page_size
    at = k0 - page * page_size
    for j in range(k1 - k0):
        bases[j] = ((block_table[i, page] * page_size + at) * kv_heads + h) * head_dim
        at += 1
        if at == page_size:
            page, at = page + 1, 0


@register_jitable(inline="always")
def block_scales(k_scales, v_scales, k_scale, v_scale, block_table, i, k0, k1, page_size, kv_heads, h):
    """k_scales[p - k0], v_scales[p - k0] = the int8 scales of key p's (slot, h) for the keys k0..k1-1 of sequence i,
    1 for the rest of the block's tiles (read once per block for all its rows, multiplied a vector at a time)."""
    page = k0 // page_size
    at = k0 - page * page_size
    for j in range(k1 - k0):
        x = (block_table[i, page] * page_size + at) * kv_heads + h
        k_scales[j], v_scales[j] = k_scale[x], v_scale[x]
        at += 1
        if at == page_size:
            page, at = page + 1, 0
    for j in range(k1 - k0, BLOCK_ROW):
        k_scales[j], v_scales[j] = 1.0, 1.0


@register_jitable
def block_scales_heads(k_scales, v_scales, k_scale, v_scale, block_table, i, k0, k1, page_size, kv_heads):
    """:func:`block_scales` of every k/v head hh (k_scales[hh * BLOCK_ROW + p - k0], v_scales likewise), read in
    address order (a key's heads side by side)."""
    page = k0 // page_size
    at = k0 - page * page_size
    for j in range(k1 - k0):
        x = (block_table[i, page] * page_size + at) * kv_heads
        for hh in range(kv_heads):
            k_scales[hh * BLOCK_ROW + j], v_scales[hh * BLOCK_ROW + j] = k_scale[x + hh], v_scale[x + hh]
        at += 1
        if at == page_size:
            page, at = page + 1, 0
    for hh in range(kv_heads):
        for j in range(k1 - k0, BLOCK_ROW):
            k_scales[hh * BLOCK_ROW + j], v_scales[hh * BLOCK_ROW + j] = 1.0, 1.0


@register_jitable
def touch_keys(k_ent, v_ent, block_table, i, k0, k1, page_size, key_items):
    """Read every cache line of the keys and values k0..k1-1 of sequence i, all their k/v heads (``key_items``
    entries a key, contiguous), in address order, a key's line and then its value's (:func:`.simd.touch_read`): two
    plain streaming reads that the hardware prefetchers follow, so the block's lines come at about the read limit
    before it is computed (K and V side by side: ~5 % faster than K's block, then V's)."""
    step = line_items(k_ent)
    page = k0 // page_size
    at = k0 - page * page_size
    for _ in range(k1 - k0):
        base = (block_table[i, page] * page_size + at) * key_items
        for c in range(0, key_items, step):
            touch_read(k_ent, base + c)
            touch_read(v_ent, base + c)
        at += 1
        if at == page_size:
            page, at = page + 1, 0


@register_jitable(inline="always")
def touch_rows(k_ent, v_ent, bases, n, head_dim):
    """Read every cache line of keys and values bases[j] .. bases[j] + head_dim - 1 (j < n: one k/v head's rows of a
    block), a key's line and then its value's (:func:`.simd.touch_read`; demand loads, not software prefetches: the
    hardware prefetchers follow them)."""
    step = line_items(k_ent)
    for j in range(n):
        for c in range(0, head_dim, step):
            touch_read(k_ent, bases[j] + c)
            touch_read(v_ent, bases[j] + c)


@register_jitable
def tile_scores_heads(scores, qs, entries, bases, t_lo, t_hi, head_dim, parts, heads, rb, rr):
    """:func:`tile_scores_rows` for the four rows rr .. rr + 3 of every k/v head hh (row state s = hh * rb + r: q at
    qs[s * head_dim], scores at scores[s * BLOCK_ROW]; key j of head hh at bases[j] + hh * head_dim), in address
    order: per four keys, every head's entries in turn (a key's heads lie side by side), folded per head and row
    (``parts``: heads x 4 rows x lanes / 4 groups vectors). The same operations as tile_scores_rows head by head:
    the same bits."""
    width = lanes(qs)
    full = head_dim - head_dim % width
    groups = width // 4
    for b0 in range(t_lo, t_hi, width):
        for g in range(groups):
            e = b0 + 4 * g
            e0, e1, e2, e3 = bases[e], bases[e + 1], bases[e + 2], bases[e + 3]
            for hh in range(heads):
                off, pi = hh * head_dim, hh * 4 * groups * width
                g0, g1, g2, g3 = dot_rows_four(qs, (hh * rb + rr) * head_dim, entries, e0 + off, e1 + off, e2 + off,
                                               e3 + off, head_dim)
                vstore(parts, pi + g * width, g0)
                vstore(parts, pi + (groups + g) * width, g1)
                vstore(parts, pi + (2 * groups + g) * width, g2)
                vstore(parts, pi + (3 * groups + g) * width, g3)
        for hh in range(heads):
            at, pi, qi = (hh * rb + rr) * BLOCK_ROW + b0, hh * 4 * groups * width, (hh * rb + rr) * head_dim
            for r in range(4):
                vstore(scores, at + r * BLOCK_ROW, fold_groups(parts, pi + r * groups * width, groups, width))
            for r in range(4 if full < head_dim else 0):
                for j in range(width):
                    total = scores[at + r * BLOCK_ROW + j]
                    for c in range(full, head_dim):
                        total += qs[qi + r * head_dim + c] * load_as(entries, bases[b0 + j] + hh * head_dim + c, qs)
                    scores[at + r * BLOCK_ROW + j] = total


@register_jitable
def add_weighted_heads(acc, weights, entries, bases, first, last, head_dim, heads, rb, rr):
    """:func:`add_weighted_rows` for the four rows rr .. rr + 3 of every k/v head hh (row state s = hh * rb + r), the
    keys first..last HEAD_CHUNK at a time, every head's values of a chunk in turn (address order). Each row's sums
    still run key after key: the same bits as head by head."""
    for j0 in range(first, last + 1, HEAD_CHUNK):
        j1 = imin(last, j0 + HEAD_CHUNK - 1)
        for hh in range(heads):
            s = hh * rb + rr
            add_weighted_rows(acc, s * head_dim, weights, s * BLOCK_ROW, entries, bases, hh * head_dim, j0, j1,
                              head_dim)


@register_jitable
def attend_rows_heads(scores, qs, k_ent, v_ent, bases, a, b, head_dim, parts, heads, rb, rr, m, den, acc, k_scales,
                      v_scales, quantized, softcap, zero):
    """The four rows rr .. rr + 3 of every k/v head (row state hh * rb + r) against keys a..b of a block
    (:func:`tile_scores_heads`, :func:`weigh_row`, :func:`add_weighted_heads`; nothing when b < a)."""
    if a > b:
        return
    tile = imax(4, lanes(qs))
    t_lo, t_hi = a - a % tile, b - b % tile + tile   # the whole tiles that hold the keys
    tile_scores_heads(scores, qs, k_ent, bases, t_lo, t_hi, head_dim, parts, heads, rb, rr)
    for hh in range(heads):
        for r in range(hh * rb + rr, hh * rb + rr + 4):
            weigh_row(scores, r * BLOCK_ROW, a, b, t_lo, t_hi, r, m, den, acc, head_dim, k_scales, v_scales,
                      hh * BLOCK_ROW, quantized, softcap, zero)
    add_weighted_heads(acc, scores, v_ent, bases, a, b, head_dim, heads, rb, rr)


@register_jitable(inline="always")
def split_keys(length, count, window, causal, split, splits):
    """(first, last): the keys of split ``split`` of ``splits`` of a sequence of ``length`` keys whose ``count``
    queries are its last positions: the keys its rows read (causal: from the first query's window on, else all),
    cut into ``splits`` parts of ceil(keys / splits) keys rounded up to whole KEY_BLOCKs; a part past the last key
    is empty (last < first)."""
    first = imax(0, length - count - window + 1) if causal else np.int64(0)
    keys = imax(0, length - first)
    per = ((keys + splits - 1) // splits + KEY_BLOCK - 1) // KEY_BLOCK * KEY_BLOCK
    lo = first + split * per
    return lo, imin(length - 1, lo + per - 1)


@register_jitable
def attend_task(task, split, q, o, part_o, part_ml, k_ent, v_ent, k_scale, v_scale, block_table, seq_lens, q_starts,
                page_size, q_heads, kv_heads, head_dim, fold, softcap, zero, window, causal, quantized, cos, sin,
                q_rows, half, rotary_dim, offset, interleaved, splits, all_heads, norm, unnormed):
    """Task = i * kv_heads + h: the queries of sequence i, q's rows q_starts[i] .. q_starts[i + 1] - 1 (q, o flat
    (T, q_heads, head_dim)), in the q heads h*G .. h*G+G-1 (G = q_heads // kv_heads) against its keys and values
    of k/v head h, key p in slot block_table[i, p // page_size] * page_size + p % page_size; query j of the c_i at
    position seq_lens[i] - c_i + j. ``zero``: 0 in the work dtype (k_scale's dtype: the scales, or a work-dtype
    array when not ``quantized``). ``rotary_dim > 0``: q row r is rotated as it is loaded, in the work dtype, at table
    row ``q_rows[r]`` (:func:`rotate_head`, the append's rotation of a key), then scaled by ``fold``; normed first
    when ``norm`` = (weight, eps, head_dim) is given (:func:`norm_head`, as the append norms a key).
    ``splits > 1``: only the keys of part ``split`` (:func:`split_keys`), and the row's accumulator (not divided)
    goes to part_o[(r * splits + split) * head_dim ..], its (max, sum) to part_ml[(r * splits + split) * 2 ..]
    (r = row * q_heads + q head; a row without a key in the part: sum 0), for :func:`combine_task`.
    ``all_heads`` (the caller's choice when there are enough sequences for the threads): a sequence whose rows fit
    one row block is taken whole by its task for k/v head 0, every head block by block (a block's pages read whole,
    in address order, then computed from the caches: each key's heads lie side by side, where a task per head strides
    through every page once per head); its other heads' tasks return at once."""
    i = task // kv_heads
    h = task - i * kv_heads
    groups = q_heads // kv_heads
    length = seq_lens[i]
    q0 = q_starts[i]
    count = q_starts[i + 1] - q0
    n_rows = count * groups
    if n_rows <= 0:
        return
    heads_here = kv_heads if all_heads and n_rows <= ROW_BLOCK else 1
    if heads_here > 1 and h > 0:
        return   # the sequence's task for k/v head 0 takes this head
    k_lo, k_hi = split_keys(length, count, window, causal, split, splits)
    if k_hi < k_lo and splits > 1:   # a part past the last key: every row's sum 0, nothing else read
        for hh in range(h, h + heads_here):
            for r in range(n_rows):
                j = r // groups
                part_ml[(((q0 + j) * q_heads + hh * groups + r - j * groups) * splits + split) * 2 + 1] = zero
        return
    rb = imin(n_rows, ROW_BLOCK)
    n_state = heads_here * rb   # row state s = hh * rb + rr: row rr of the row block in head h + hh
    work = k_scale.dtype
    qs = np.empty(n_state * head_dim, work)
    acc = np.empty(n_state * head_dim, work)
    scores = np.empty(n_state * BLOCK_ROW, work)
    m = np.empty(n_state, work)
    den = np.empty(n_state, work)
    lo = np.empty(n_state, np.int64)
    hi = np.empty(n_state, np.int64)
    bases = np.empty(BLOCK_ROW, np.int64)
    width = lanes(qs)
    # every head's rows in address order (tile_scores_heads) when the task takes every head and its rows come in
    # fours of one key range (a query's GQA group: groups a multiple of 4)
    sweep = heads_here > 1 and groups % 4 == 0 and width >= 4
    parts = np.empty((heads_here if sweep else 1) * width * width if width > 2 else 0, work)   # folded fours
    k_scales = np.empty(heads_here * BLOCK_ROW if quantized else 0, work)
    v_scales = np.empty(heads_here * BLOCK_ROW if quantized else 0, work)
    tile = imax(4, width)   # keys scored together (tile_scores)
    block = INT8_KEY_BLOCK if quantized else KEY_BLOCK   # keys a block (a split's keys are whole KEY_BLOCKs)
    for r0 in range(0, n_rows, rb):
        nr = imin(rb, n_rows - r0)
        first, last = length, np.int64(-1)
        for hh in range(heads_here):
            for rr in range(nr):
                s = hh * rb + rr
                j = (r0 + rr) // groups
                qi = (((q0 + j) * q_heads) + (h + hh) * groups + (r0 + rr - j * groups)) * head_dim
                if norm is not None:   # normed into qs, then rotated there
                    norm_head(q, qi, 1, qs, s * head_dim, norm, head_dim)
                    if rotary_dim > 0:
                        rotate_head(qs, s * head_dim, 1, qs, s * head_dim, cos, sin, q_rows[q0 + j], half, rotary_dim,
                                    offset, head_dim, interleaved)
                    for c in range(head_dim):
                        qs[s * head_dim + c] = qs[s * head_dim + c] * fold
                        acc[s * head_dim + c] = zero
                elif unnormed is not None and rotary_dim > 0:
                    rotate_head(q, qi, 1, qs, s * head_dim, cos, sin, q_rows[q0 + j], half, rotary_dim, offset,
                                head_dim, interleaved)
                    for c in range(head_dim):
                        qs[s * head_dim + c] = qs[s * head_dim + c] * fold
                        acc[s * head_dim + c] = zero
                else:
                    for c in range(head_dim):
                        qs[s * head_dim + c] = load(q, qi + c) * fold
                        acc[s * head_dim + c] = zero
                if causal:
                    at = length - count + j   # the query's position
                    hi[s], lo[s] = imin(at, k_hi), imax(k_lo, at - window + 1)
                else:
                    hi[s], lo[s] = k_hi, k_lo
                first, last = imin(first, lo[s]), imax(last, hi[s])
                m[s] = -np.inf
                den[s] = zero
        for k0 in range(first, last + 1, block):
            k1 = imin(last + 1, k0 + block)
            for hh in range(1 if sweep else heads_here):
                hd = h + hh
                block_bases(bases, block_table, i, k0, k1, page_size, kv_heads, hd, head_dim)
                if sweep:   # the block's pages read whole, then every head's rows computed from the caches
                    touch_keys(k_ent, v_ent, block_table, i, k0, k1, page_size, kv_heads * head_dim)
                else:   # the head's rows of the block read, then computed
                    touch_rows(k_ent, v_ent, bases, k1 - k0, head_dim)
                for j in range(k1 - k0, BLOCK_ROW):   # a last tile's keys past the block: read, masked, never weighed
                    bases[j] = bases[0]
                if quantized and sweep:
                    block_scales_heads(k_scales, v_scales, k_scale, v_scale, block_table, i, k0, k1, page_size,
                                       kv_heads)
                elif quantized:
                    block_scales(k_scales, v_scales, k_scale, v_scale, block_table, i, k0, k1, page_size, kv_heads, hd)
                if sweep:
                    for rr in range(0, nr, 4):   # fours of rows of one range (a query's group): alike in every head
                        attend_rows_heads(scores, qs, k_ent, v_ent, bases, imax(lo[rr], k0) - k0,
                                          imin(hi[rr], k1 - 1) - k0, head_dim, parts, heads_here, rb, rr, m, den, acc,
                                          k_scales, v_scales, quantized, softcap, zero)
                else:
                    rr = hh * rb
                    while rr < hh * rb + nr:
                        a, b = imax(lo[rr], k0) - k0, imin(hi[rr], k1 - 1) - k0   # the row's keys in this block
                        rows = 1   # four rows of one key range (a query's GQA group) share each key and value
                        # vector read
                        if width >= 4 and rr + 4 <= hh * rb + nr and lo[rr + 1] == lo[rr] and lo[rr + 2] == lo[rr] \
                                and lo[rr + 3] == lo[rr] and hi[rr + 1] == hi[rr] and hi[rr + 2] == hi[rr] \
                                and hi[rr + 3] == hi[rr]:
                            rows = 4
                        if a <= b:
                            w = rr * BLOCK_ROW
                            t_lo, t_hi = a - a % tile, b - b % tile + tile   # the whole tiles that hold the keys
                            if rows == 4:   # scores
                                tile_scores_rows(scores, w, qs, rr * head_dim, k_ent, bases, t_lo, t_hi, head_dim,
                                                 parts)
                            else:
                                tile_scores(scores, w, qs, rr * head_dim, k_ent, bases, t_lo, t_hi, head_dim, parts)
                            for r in range(rr, rr + rows):
                                weigh_row(scores, r * BLOCK_ROW, a, b, t_lo, t_hi, r, m, den, acc, head_dim, k_scales,
                                          v_scales, 0, quantized, softcap, zero)
                            if rows == 4:
                                add_weighted_rows(acc, rr * head_dim, scores, w, v_ent, bases, 0, a, b, head_dim)
                            else:
                                add_weighted(acc, rr * head_dim, scores, w, v_ent, bases, a, b, head_dim)
                        rr += rows
        for hh in range(heads_here):
            for rr in range(nr):
                s = hh * rb + rr
                j = (r0 + rr) // groups
                r = (q0 + j) * q_heads + (h + hh) * groups + (r0 + rr - j * groups)
                if splits > 1:   # the part's accumulator and (max, sum), merged by combine_task
                    at = (r * splits + split) * head_dim
                    for c in range(head_dim):
                        part_o[at + c] = acc[s * head_dim + c]
                    part_ml[(r * splits + split) * 2] = m[s]
                    part_ml[(r * splits + split) * 2 + 1] = den[s]
                    continue
                d = den[s] if den[s] != zero else math.exp(zero)   # 1: no key seen gives 0 (the reference's rule)
                for c in range(head_dim):
                    store(o, r * head_dim + c, acc[s * head_dim + c] / d)


@register_jitable
def combine_task(task, o, part_o, part_ml, q_starts, q_heads, kv_heads, head_dim, zero, splits):
    """The splits of task i * kv_heads + h's rows (sequence i's queries in the q heads of k/v head h) merged by
    log-sum-exp into o: over the splits s whose sum l_s is not 0, m = max m_s, w_s = exp(m_s - m),
    o = sum_s w_s acc_s / sum_s w_s l_s; 0 when no split has a key (a split's acc is not read then)."""
    i = task // kv_heads
    h = task - i * kv_heads
    groups = q_heads // kv_heads
    q0 = q_starts[i]
    n_rows = (q_starts[i + 1] - q0) * groups
    if n_rows <= 0:
        return
    total = np.empty(head_dim, part_o.dtype)
    for rr in range(n_rows):
        j = rr // groups
        r = (q0 + j) * q_heads + h * groups + (rr - j * groups)
        ml = r * splits * 2
        top, seen = zero, False   # the largest max of the splits with keys (in the work dtype)
        for s in range(splits):
            if part_ml[ml + 2 * s + 1] != zero and (not seen or part_ml[ml + 2 * s] > top):
                top, seen = part_ml[ml + 2 * s], True
        for c in range(head_dim):
            total[c] = zero
        den = zero
        for s in range(splits):
            l_s = part_ml[ml + 2 * s + 1]
            if l_s == zero:
                continue
            weight = zero + math.exp(part_ml[ml + 2 * s] - top)
            den += weight * l_s
            at = (r * splits + s) * head_dim
            for c in range(head_dim):
                total[c] += weight * part_o[at + c]
        d = den if den != zero else math.exp(zero)   # no key in any split: 0 (total is 0)
        for c in range(head_dim):
            store(o, r * head_dim + c, total[c] / d)


@njit(parallel=True, **KERNEL_JIT)
def paged_attention_parallel(q, o, part_o, part_ml, k_ent, v_ent, k_scale, v_scale, block_table, seq_lens, q_starts,
                             page_size, q_heads, kv_heads, head_dim, fold, softcap, zero, window, causal, quantized,
                             cos, sin, q_rows, half, rotary_dim, offset, interleaved, splits, all_heads, norm, unnormed):
    """Attention of n sequences' queries over their pages, one parallel pass over the (sequence, k/v head, split)
    tasks (:func:`attend_task`), then (splits > 1) one over the (sequence, k/v head) pairs merging the splits
    (:func:`combine_task`); q, o: flat packed (T, q_heads, head_dim), C order, sequence i's queries the rows
    q_starts[i] .. q_starts[i + 1] - 1; part_o (T * q_heads * splits * head_dim,) and part_ml
    (T * q_heads * splits * 2,): the work-dtype workspace of the splits (any work-dtype arrays when splits == 1);
    k_ent, v_ent: flat entries (slots, kv_heads, head_dim); k_scale, v_scale: flat scales in the work dtype (any
    work-dtype arrays when not ``quantized``); block_table (n, W), seq_lens (n,) and q_starts (n + 1,) int64; fold:
    the scale (over softcap when there is one); softcap: 0 for none; window: the causal window (a huge number for
    none); cos, sin (R, half) work-dtype tables and q_rows (T,) int64: q's rotation when rotary_dim > 0 (pairs of
    ``layout`` interleaved or half in [offset, offset + rotary_dim)); norm: None, or q's per-head RMSNorm (weight,
    eps, head_dim) (:func:`norm_head`), and unnormed True or None (the other: a marker, as the append's). Tasks are
    numbered split-major (split s of
    every pair, then s + 1), so the parts of one sequence's keys land on different threads."""
    n_pairs = seq_lens.shape[0] * kv_heads
    for task in prange(n_pairs * splits):
        split = np.int64(task) // n_pairs
        attend_task(np.int64(task) - split * n_pairs, split, q, o, part_o, part_ml, k_ent, v_ent, k_scale, v_scale,
                    block_table, seq_lens, q_starts, page_size, q_heads, kv_heads, head_dim, fold, softcap, zero,
                    window, causal, quantized, cos, sin, q_rows, half, rotary_dim, offset, interleaved, splits,
                    all_heads, norm, unnormed)
    if splits > 1:
        for task in prange(n_pairs):
            combine_task(np.int64(task), o, part_o, part_ml, q_starts, q_heads, kv_heads, head_dim, zero, splits)


@njit(**KERNEL_JIT)
def paged_attention_serial(q, o, part_o, part_ml, k_ent, v_ent, k_scale, v_scale, block_table, seq_lens, q_starts,
                           page_size, q_heads, kv_heads, head_dim, fold, softcap, zero, window, causal, quantized, cos,
                           sin, q_rows, half, rotary_dim, offset, interleaved, splits, all_heads, norm, unnormed):
    """paged_attention_parallel on the calling thread (small calls)."""
    q, o, part_o, part_ml = borrowed(q), borrowed(o), borrowed(part_o), borrowed(part_ml)
    k_ent, v_ent, k_scale, v_scale = borrowed(k_ent), borrowed(v_ent), borrowed(k_scale), borrowed(v_scale)
    block_table, seq_lens, q_starts = borrowed(block_table), borrowed(seq_lens), borrowed(q_starts)
    cos, sin, q_rows = borrowed(cos), borrowed(sin), borrowed(q_rows)
    n_pairs = seq_lens.shape[0] * kv_heads
    for split in range(splits):
        for task in range(n_pairs):
            attend_task(task, split, q, o, part_o, part_ml, k_ent, v_ent, k_scale, v_scale, block_table, seq_lens,
                        q_starts, page_size, q_heads, kv_heads, head_dim, fold, softcap, zero, window, causal,
                        quantized, cos, sin, q_rows, half, rotary_dim, offset, interleaved, splits, all_heads, norm, unnormed)
    if splits > 1:
        for task in range(n_pairs):
            combine_task(task, o, part_o, part_ml, q_starts, q_heads, kv_heads, head_dim, zero, splits)
