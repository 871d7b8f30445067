"""Numba kernels of the ``numba`` backend (imported only by ``rotary.backends.numba``).

Every array reaches a kernel as a flat 1-D buffer plus int64 element offsets and strides (see
:func:`element_offset`), so any strided view (BSHD, BHSD, negative strides, ``out is x``) is read
and written in place, and index arithmetic is int64 whatever the size. float16 data arrives as its
uint16 bit pattern and is converted to float32 in registers (:func:`load` / :func:`store`).

Rotation of pair (a, b) with table values (c, s) of the token's row (s negated for the inverse)::

    y_a = x_a c - x_b s,    y_b = x_b c + x_a s

Pairs are (i, i + half) for layout "half" and (2i, 2i + 1) for "interleaved"; coordinates from
rotary_dim to head_dim are copied. fastmath is off: the results round exactly like the NumPy
reference (one multiply and one add/subtract, no fused multiply-add).

Linear attention (RoFormer eq. 19, a = phi(q), b = phi(k), hats = rotated)::

    o_t = (a_hat_t . (S0 + sum_s b_hat_s v_s^T)) / (a_t . (z0 + sum_s b_s) + eps)

with s <= t (causal) or all s. The causal form runs in chunks of C tokens: per chunk
``N = A_hat S + tril(A_hat B_hat^T) V``, ``D = A z + rowsum(A * cumsum(B))``, then
``S += B_hat^T V``, ``z += sum B``. The chunk products are vectorised row sums written here (no
BLAS call from inside the parallel loop, whose own threads would oversubscribe the cores); the
carried (S, z) are float64.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

FEATURE_MAPS = {"identity": 0, "elu": 1, "relu": 2}

# geometry columns of one rotate item: heads, then (offset, sB, sS, sH, sD) of x and of out, copy_tail
GEO_HEADS, GEO_X, GEO_OUT, GEO_COPY_TAIL, GEO_COLUMNS = 0, 1, 6, 11, 12


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


@overload(load)
def _load_impl(buf, i):
    if buf.dtype == types.uint16:
        return lambda buf, i: _half_bits_to_f32(buf[i])
    return lambda buf, i: buf[i]


@overload(store)
def _store_impl(buf, i, value):
    if buf.dtype == types.uint16:
        def impl(buf, i, value):
            buf[i] = _f32_to_half_bits(np.float32(value))
        return impl

    def impl(buf, i, value):
        buf[i] = value
    return impl


# -- index arithmetic ----------------------------------------------------------------------------
@njit(cache=True)
def element_offset(offset, stride_b, stride_s, stride_h, b, s, h):
    """Flat index of element (b, s, h, 0): ``offset + b*stride_b + s*stride_s + h*stride_h`` in int64."""
    return np.int64(offset) + np.int64(b) * np.int64(stride_b) + np.int64(s) * np.int64(stride_s) \
        + np.int64(h) * np.int64(stride_h)


# -- rotation ------------------------------------------------------------------------------------
@njit(cache=True)
def rotate_vector(x, xi, xsd, o, oi, osd, cos, sin, row, half, rotary_dim, head_dim, interleaved, inverse,
                  copy_tail):
    """Rotate the head vector at x[xi + j*xsd] (j < head_dim) into o[oi + j*osd] with table row ``row``."""
    if interleaved:
        step, second = 2, 1
    else:
        step, second = 1, half
    if xsd == 1 and osd == 1:   # unit stride: slices indexed from 0 with constant steps, loops LLVM vectorises
        xv = x[xi:xi + rotary_dim]
        ov = o[oi:oi + rotary_dim]
        cos_row = cos[row]
        sin_row = sin[row]
        if interleaved:
            for i in range(half):
                c = cos_row[i]
                s = -sin_row[i] if inverse else sin_row[i]
                xa = load(xv, 2 * i)
                xb = load(xv, 2 * i + 1)
                store(ov, 2 * i, xa * c - xb * s)
                store(ov, 2 * i + 1, xb * c + xa * s)
        else:
            for i in range(half):
                c = cos_row[i]
                s = -sin_row[i] if inverse else sin_row[i]
                xa = load(xv, i)
                xb = load(xv, half + i)
                store(ov, i, xa * c - xb * s)
                store(ov, half + i, xb * c + xa * s)
    else:
        for i in range(half):
            c = cos[row, i]
            s = -sin[row, i] if inverse else sin[row, i]
            ia = i * step
            xa = load(x, xi + ia * xsd)
            xb = load(x, xi + (ia + second) * xsd)
            store(o, oi + ia * osd, xa * c - xb * s)
            store(o, oi + (ia + second) * osd, xb * c + xa * s)
    if copy_tail:
        for j in range(rotary_dim, head_dim):
            o[oi + j * osd] = x[xi + j * xsd]


@njit(cache=True)
def rotate_token(t, x, o, geo, cos, sin, rows, seq_len, half, rotary_dim, head_dim, interleaved, inverse):
    """Rotate every head of token t (= b*seq_len + s) of one item; geo: its GEO_COLUMNS int64 values."""
    b = t // seq_len
    s = t - b * seq_len
    row = rows[b if rows.shape[0] > 1 else 0, s]
    xsd = geo[GEO_X + 4]
    osd = geo[GEO_OUT + 4]
    for h in range(geo[GEO_HEADS]):
        xi = element_offset(geo[GEO_X], geo[GEO_X + 1], geo[GEO_X + 2], geo[GEO_X + 3], b, s, h)
        oi = element_offset(geo[GEO_OUT], geo[GEO_OUT + 1], geo[GEO_OUT + 2], geo[GEO_OUT + 3], b, s, h)
        rotate_vector(x, xi, xsd, o, oi, osd, cos, sin, row, half, rotary_dim, head_dim, interleaved, inverse,
                      geo[GEO_COPY_TAIL] != 0)


@njit(parallel=True, cache=True)
def rotate_qk_parallel(xq, oq, xk, ok, geo, cos, sin, rows, n_tokens, seq_len, half, rotary_dim, head_dim,
                       interleaved, inverse):
    """One parallel pass over the tokens: q's heads, then k's heads, with the token's table row."""
    for t in prange(n_tokens):
        rotate_token(t, xq, oq, geo[0], cos, sin, rows, seq_len, half, rotary_dim, head_dim, interleaved, inverse)
        rotate_token(t, xk, ok, geo[1], cos, sin, rows, seq_len, half, rotary_dim, head_dim, interleaved, inverse)


@njit(cache=True)
def rotate_qk_serial(xq, oq, xk, ok, geo, cos, sin, rows, n_tokens, seq_len, half, rotary_dim, head_dim,
                     interleaved, inverse):
    """rotate_qk_parallel on the calling thread (small calls: no thread hand-off)."""
    for t in range(n_tokens):
        rotate_token(t, xq, oq, geo[0], cos, sin, rows, seq_len, half, rotary_dim, head_dim, interleaved, inverse)
        rotate_token(t, xk, ok, geo[1], cos, sin, rows, seq_len, half, rotary_dim, head_dim, interleaved, inverse)


# -- linear attention ----------------------------------------------------------------------------
@intrinsic
def _pow2_f32(typingctx, exponent):
    """2**exponent as float32 for -126 <= exponent <= 127: the bits (exponent + 127) << 23."""
    def codegen(context, builder, signature, args):
        bits = builder.shl(builder.add(args[0], ir.Constant(ir.IntType(32), 127)), ir.Constant(ir.IntType(32), 23))
        return builder.bitcast(bits, ir.FloatType())

    return types.float32(types.int32), codegen


def exp_work(x):
    """exp(x) in x's precision (float64: libm; float32 compiled: see the overload)."""
    return np.exp(x)


@overload(exp_work)
def _exp_work_impl(x):
    if x != types.float32:
        return lambda x: np.exp(x)

    def impl(x):
        """float32 exp that LLVM can vectorise (Cephes expf): x = n ln2 + r, |r| <= ln2/2,
        exp(r) by a degree-7 polynomial, times 2**n; within 2 ulp on [-87, 88] (x clamped there)."""
        x = min(max(x, np.float32(-87.0)), np.float32(88.0))
        n = np.floor(x * np.float32(1.44269504088896341) + np.float32(0.5))
        r = (x - n * np.float32(0.693359375)) + n * np.float32(2.12194440e-4)
        p = np.float32(1.9875691500e-4) * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        p = (p * (r * r) + r) + np.float32(1.0)
        return p * _pow2_f32(np.int32(n))
    return impl


@njit(cache=True)
def feature(x, feature_map):
    """phi(x): 0 identity, 1 elu(x) + 1, 2 relu(x)."""
    if feature_map == 1:
        return x + 1 if x > 0 else exp_work(x)
    if feature_map == 2:
        return x if x > 0 else x * 0
    return x


@njit(cache=True)
def load_features(x, g, b, h, t0, n, cos, sin, rows, half, rotary_dim, interleaved, feature_map, plain, rotated,
                  transpose):
    """plain[i] = phi(x[b, t0+i, h, :]) and its rotation R_{p(t0+i)} plain[i] for i < n.

    The rotated row goes to rotated[i, :] or, with ``transpose``, to rotated[:, i];
    g: (offset, sB, sS, sH, sD) of x.
    """
    m = plain.shape[1]
    for i in range(n):
        base = element_offset(g[0], g[1], g[2], g[3], b, t0 + i, h)
        row_in = plain[i]
        if g[4] == 1:   # unit stride: a slice indexed from 0, a loop LLVM vectorises
            x_row = x[base:base + m]
            for j in range(m):
                row_in[j] = feature(load(x_row, j), feature_map)
        else:
            for j in range(m):
                row_in[j] = feature(load(x, base + j * g[4]), feature_map)
        row = rows[b if rows.shape[0] > 1 else 0, t0 + i]
        cos_row = cos[row]
        sin_row = sin[row]
        for p in range(half):
            ia, ib = (2 * p, 2 * p + 1) if interleaved else (p, p + half)
            xa = row_in[ia]
            xb = row_in[ib]
            ya = xa * cos_row[p] - xb * sin_row[p]
            yb = xb * cos_row[p] + xa * sin_row[p]
            if transpose:
                rotated[ia, i] = ya
                rotated[ib, i] = yb
            else:
                rotated[i, ia] = ya
                rotated[i, ib] = yb
        for j in range(rotary_dim, m):
            if transpose:
                rotated[j, i] = row_in[j]
            else:
                rotated[i, j] = row_in[j]


@njit(cache=True)
def load_rows(x, g, b, h, t0, n, dest):
    """dest[i] = x[b, t0+i, h, :] in the work dtype."""
    for i in range(n):
        base = element_offset(g[0], g[1], g[2], g[3], b, t0 + i, h)
        for j in range(dest.shape[1]):
            dest[i, j] = load(x, base + j * g[4])


@njit(cache=True)
def axpy(alpha, x, y, n):
    """y[:n] += alpha * x[:n] (the vectorised inner loop of every chunk product)."""
    for j in range(n):
        y[j] += alpha * x[j]


@njit(cache=True)
def gemv_rows(coef, rows, y, count, n):
    """y[:n] += sum_{r < count} coef[r] * rows[r, :n], four rows per pass over y (fewer loads/stores of y)."""
    r = 0
    while r + 4 <= count:
        c0, c1, c2, c3 = coef[r], coef[r + 1], coef[r + 2], coef[r + 3]
        x0, x1, x2, x3 = rows[r], rows[r + 1], rows[r + 2], rows[r + 3]
        for j in range(n):
            y[j] += (c0 * x0[j] + c1 * x1[j]) + (c2 * x2[j] + c3 * x3[j])
        r += 4
    while r < count:
        axpy(coef[r], rows[r], y, n)
        r += 1


@njit(cache=True)
def gemv_rows_pair(coef0, coef1, rows, y0, y1, count, n):
    """gemv_rows for two outputs at once: each loaded row of ``rows`` serves y0 and y1."""
    r = 0
    while r + 4 <= count:
        x0, x1, x2, x3 = rows[r], rows[r + 1], rows[r + 2], rows[r + 3]
        a0, a1, a2, a3 = coef0[r], coef0[r + 1], coef0[r + 2], coef0[r + 3]
        b0, b1, b2, b3 = coef1[r], coef1[r + 1], coef1[r + 2], coef1[r + 3]
        for j in range(n):
            y0[j] += (a0 * x0[j] + a1 * x1[j]) + (a2 * x2[j] + a3 * x3[j])
            y1[j] += (b0 * x0[j] + b1 * x1[j]) + (b2 * x2[j] + b3 * x3[j])
        r += 4
    while r < count:
        axpy(coef0[r], rows[r], y0, n)
        axpy(coef1[r], rows[r], y1, n)
        r += 1


@njit(cache=True)
def finish_causal_row(o, g, b, t, h, a_plain_row, k_plain_row, cum, acc, eps):
    """cum += b_t; o[b, t, h] = acc / (a_t . cum + eps) (cum holds z0 + sum of b up to token t, float64)."""
    for j in range(cum.shape[0]):
        cum[j] += k_plain_row[j]
    store_row(o, g, b, t, h, acc, 1.0 / (dot4(a_plain_row, cum) + eps))


@njit(cache=True)
def dot4(x, y):
    """sum_j x[j] y[j] in float64 with four interleaved partial sums (four independent add chains)."""
    n = x.shape[0]
    s0 = s1 = s2 = s3 = 0.0
    j = 0
    while j + 4 <= n:
        s0 += x[j] * np.float64(y[j])
        s1 += x[j + 1] * np.float64(y[j + 1])
        s2 += x[j + 2] * np.float64(y[j + 2])
        s3 += x[j + 3] * np.float64(y[j + 3])
        j += 4
    while j < n:
        s0 += x[j] * np.float64(y[j])
        j += 1
    return (s0 + s1) + (s2 + s3)


@njit(cache=True)
def store_row(o, g, b, t, h, acc, scale):
    """o[b, t, h, :] = acc * scale, rounded to o's dtype."""
    base = element_offset(g[0], g[1], g[2], g[3], b, t, h)
    for j in range(acc.shape[0]):
        store(o, base + j * g[4], acc[j] * scale)


@njit(cache=True)
def linear_attention_head(q, k, v, o, geo, cos, sin, rows, state_s, state_z, new_s, new_z, b, h, seq_len,
                          half, rotary_dim, interleaved, causal, feature_map, eps, chunk):
    """Linear attention of one (batch, head) in chunks of ``chunk`` tokens, (S, z) carried in float64.

    Chunk products are sums of contiguous rows (:func:`gemv_rows`): ``N_i = sum_k A_hat[i,k] S[k] +
    sum_{j<=i} P[i,j] V[j]`` with ``P[i,j] = sum_k A_hat[i,k] B_hat[j,k]`` (only j <= i is formed) and
    ``S[k] += sum_j B_hat[j,k] V[j]``.
    """
    m = state_z.shape[2]
    dv = state_s.shape[3]
    work = cos.dtype
    a_plain = np.empty((chunk, m), work)
    a_hat = np.empty((chunk, m), work)
    k_plain = np.empty((chunk, m), work)
    k_hat_t = np.empty((m, chunk), work)
    values = np.empty((chunk, dv), work)
    scores = np.empty((2, chunk), work)
    acc = np.empty((2, dv), work)
    k_sum = np.empty(m, work)
    carried_s = state_s[b, h].astype(np.float64)
    carried_z = state_z[b, h].astype(np.float64)
    s_work = carried_s.astype(work)
    cum = np.empty(m, np.float64)
    out_geo = geo[3]
    for t0 in range(0, seq_len, chunk):
        n = min(chunk, seq_len - t0)
        load_features(k, geo[1], b, h, t0, n, cos, sin, rows, half, rotary_dim, interleaved, feature_map,
                      k_plain, k_hat_t, True)
        load_rows(v, geo[2], b, h, t0, n, values)
        if causal:
            load_features(q, geo[0], b, h, t0, n, cos, sin, rows, half, rotary_dim, interleaved, feature_map,
                          a_plain, a_hat, False)
            cum[:] = carried_z
            for i in range(0, n - 1, 2):    # two query rows per pass over S, B_hat and V
                acc[:, :] = 0
                scores[:, :] = 0
                gemv_rows_pair(a_hat[i], a_hat[i + 1], s_work, acc[0], acc[1], m, dv)          # A_hat S
                # full rows of scores (whole vectors), then the causal mask keeps j <= i (j <= i + 1)
                gemv_rows_pair(a_hat[i], a_hat[i + 1], k_hat_t, scores[0], scores[1], m, n)
                scores[0, i + 1] = 0
                gemv_rows_pair(scores[0], scores[1], values, acc[0], acc[1], i + 2, dv)
                finish_causal_row(o, out_geo, b, t0 + i, h, a_plain[i], k_plain[i], cum, acc[0], eps)
                finish_causal_row(o, out_geo, b, t0 + i + 1, h, a_plain[i + 1], k_plain[i + 1], cum, acc[1], eps)
            if n % 2:
                i = n - 1
                acc[0, :] = 0
                scores[0, :n] = 0
                gemv_rows(a_hat[i], s_work, acc[0], m, dv)
                gemv_rows(a_hat[i], k_hat_t, scores[0], m, n)
                gemv_rows(scores[0], values, acc[0], n, dv)
                finish_causal_row(o, out_geo, b, t0 + i, h, a_plain[i], k_plain[i], cum, acc[0], eps)
        for kk in range(0, m, 2):                                  # S += B_hat^T V, two rows of S per pass
            acc[:, :] = 0
            if kk + 1 < m:
                gemv_rows_pair(k_hat_t[kk], k_hat_t[kk + 1], values, acc[0], acc[1], n, dv)
            else:
                gemv_rows(k_hat_t[kk], values, acc[0], n, dv)
            for r in range(kk, min(kk + 2, m)):
                s_row = carried_s[r]
                for j in range(dv):
                    s_row[j] += acc[r - kk, j]
                    s_work[r, j] = s_row[j]
        k_sum[:] = 0                                               # z += sum B (chunk sum, then float64)
        for i in range(n):
            k_row = k_plain[i]
            for j in range(m):
                k_sum[j] += k_row[j]
        for j in range(m):
            carried_z[j] += k_sum[j]
    if not causal:
        for t0 in range(0, seq_len, chunk):
            n = min(chunk, seq_len - t0)
            load_features(q, geo[0], b, h, t0, n, cos, sin, rows, half, rotary_dim, interleaved, feature_map,
                          a_plain, a_hat, False)
            for i in range(0, n, 2):
                i1 = min(i + 1, n - 1)    # odd n: the last row twice
                acc[:, :] = 0
                gemv_rows_pair(a_hat[i], a_hat[i1], s_work, acc[0], acc[1], m, dv)
                for r in range(i, i1 + 1):
                    store_row(o, out_geo, b, t0 + r, h, acc[r - i], 1.0 / (dot4(a_plain[r], carried_z) + eps))
    new_s[b, h] = carried_s
    new_z[b, h] = carried_z


@njit(parallel=True, cache=True)
def linear_attention_parallel(q, k, v, o, geo, cos, sin, rows, state_s, state_z, new_s, new_z, seq_len, half,
                              rotary_dim, interleaved, causal, feature_map, eps, chunk):
    """Parallel over batch x heads; geo: (4, 5) int64 (offset, sB, sS, sH, sD) of q, k, v, o."""
    n_heads = state_s.shape[1]
    for task in prange(state_s.shape[0] * n_heads):
        b = task // n_heads
        linear_attention_head(q, k, v, o, geo, cos, sin, rows, state_s, state_z, new_s, new_z, b,
                              task - b * n_heads, seq_len, half, rotary_dim, interleaved, causal, feature_map,
                              eps, chunk)
