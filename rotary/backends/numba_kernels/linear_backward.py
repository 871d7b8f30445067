"""The backward of linear attention with RoPE on the ``numba`` backend: the ``linear_attention_backward``
primitive (contract in ``rotary.backends``; formulas in :mod:`rotary.backends.numpy_linear_backward`).

One task per (batch row, k/v head) with its G q heads, ranges of tasks on the backend's thread pool
(:func:`rotary.backends.numba_runtime.run_tasks`, as the forward: a ``nogil`` kernel, no parfor to compile).
The chunk products are the forward's register tiles (:func:`.linear_attention.madd_tile` in the work dtype:
float32 for float32 / float16 input), its feature loads (:func:`.linear_attention.load_features`: phi, the
rotated rows and their transpose) and buffers; as there, the carried sums (the state S, z of the forward
sweep, the reverse state P, Q), the rows of z and the denominators are float64, everything else inside a chunk
is work dtype. Element-wise work runs as SIMD vectors (:mod:`.simd`) in helpers called once per chunk (a call
per row cost more than the row's work), and large gradients are written by non-temporal stores (as the forward
writes o), their rows on cache-line boundaries.

Causal, per task, with a = phi(q), b = phi(k), hats rotated, chunks of C tokens, gamma^j the decay's powers
(exponents 0..C only), i the row of a query and j of a key inside the chunk:

1. forward sweep: the state before each chunk, S_in^T (work dtype, (T / C) dv m per task) and z_in (float64),
   S <- gamma^n S + (B̂ . gamma^(n-1-j))^T V (one tiled product per chunk, carried in float64);
2. reverse sweep, chunk by chunk from the last, (P, Q) the gradient at the state after the chunk (from
   ``grad_state`` on), per q head h of the group::

       z_i = gamma z_(i-1) + b_i (from z_in)          gN = G / (a_i . z_i + eps)  (rows)
       W = tril(gN V^T) . Gamma                       Pt = triu(B̂ Â^T) . Gamma^T  (Pt = P^T, no P formed)
       X = gamma^(i+1) gN S_in^T                      gD_i = -(â_i . X_i + sum_j Pt_ji W'_ij) / (a_i . z_i + eps)
       dÂ = X + W B̂                                   da = R^T dÂ + gD z          dq = phi'(q) da
       dB̂ += W^T Â        dV += Pt gN         P_add += Â^T (gamma^(i+1) gN)      Q_add += sum_i gamma^(i+1) gD_i a_i
       db_j += sum_(i>=j) gamma^(i-j) gD_i a_i        (a reverse recurrence over the rows)

   (W' = W without its decay factors: gN_i . N_i = â_i . X_i + sum_j P_ij (gN_i . v_j), so the numerator N
   is never recomputed), then per k/v head::

       dB̂ += (gamma^(n-1-j) V) P^T     dV += (gamma^(n-1-j) B̂) P     db_j += gamma^(n-1-j) Q
       dk = phi'(k) (R^T dB̂ + db)      P <- gamma^n P + P_add          Q <- gamma^n Q + Q_add

   Triangular products cover the tiles that hold the triangle only: W's and Pt's row blocks the columns up to
   the block's last row (from its first), to the vector (:func:`row_tiles`: the edge tile one vector wide where
   that covers it), W B̂ the depth up to it, W^T Â and Pt gN the depth from the block's first row
   (:func:`shifted`: a view whose rows start that many columns later); gD's sum over the triangle of Pt * W^T
   by vectors from the diagonal's (:func:`diagonal_dots`).

Non-causal (no decay): (S, z) over every token, then per q head and chunk X = gN S^T = dÂ, gD_i = -(â_i . X_i) /
(a_i . z + eps) and (P, Q) summed (per chunk into the float64 carry), then dB̂ = V P^T, dV = B̂ P, db = Q.

phi'(x) from phi(x) alone: 1 for identity; min(phi, 1) for elu + 1 (x + 1 > 1 for x > 0, exp(x) <= 1 else);
[phi > 0] for relu. Non-finite data is not kept from earlier tokens' gradients (the forward's guard of the
intra-chunk product has no counterpart here: a NaN anywhere in a chunk may reach its other rows' gradients).
"""

from __future__ import annotations

import weakref

import numpy as np
from numba import njit
from numba.extending import register_jitable

from ..feature_maps import CODES as FEATURE_MAPS
from .common import borrowed, element_offset, imin, store
from .linear_attention import (TILE_ROWS, aligned_zeros, keep_alive, load_features, load_values,
                               madd_tile, madd_tile_narrow, next_load, padded, streams, tile_width, transpose_rows)
from .rotation import rotate_pairs_simd
from .simd import (KERNEL_JIT, is_aligned, lanes, store_fence, vadd, vload, vload_widened, vmadd, vmul, vsplat, vstore,
                   vstore_stream, vsum, vzeros)

_IDENTITY, _ELU = FEATURE_MAPS["identity"], FEATURE_MAPS["elu"]   # compile-time constants of the kernels


def shifted(a, k0, rows):
    """The C-contiguous (rows, a.shape[1]) view of a's buffer from flat element k0 on: ``shifted(a, k0, r)[i, k]
    = a[i, k0 + k]`` for k0 + k < a.shape[1] (a matrix product over depth k0.. of a's rows, as the tiles'
    ``a`` operand); a C-contiguous with at least k0 + rows * a.shape[1] elements (a spare row)."""
    flat = a.reshape(-1)
    return flat[k0:k0 + rows * a.shape[1]].reshape((rows, a.shape[1]))


shifted = register_jitable(shifted)


@register_jitable
def product(a, b, c, row0, rows, col0, cols, depth, accumulate):
    """c[row0:rows, col0:cols] (+)= a[row0:rows, :depth] @ b[:depth, col0:cols] in whole register tiles
    (:func:`.linear_attention.madd_tile`; the buffers padded for that)."""
    width = tile_width(c)
    for i0 in range(row0, rows, TILE_ROWS):
        for j0 in range(col0, cols, width):
            madd_tile(a, b, c, i0, j0, depth, accumulate)


@register_jitable
def row_tiles(a, b, c, i0, col0, cols, depth):
    """c[i0:i0 + TILE_ROWS, col0:cols] = a[i0:, :depth] @ b[:depth, col0:cols] (col0 a multiple of the lanes) in
    :func:`.linear_attention.madd_tile` tiles, the last one :func:`.linear_attention.madd_tile_narrow` (one
    vector wide) where one vector covers the columns left: a triangle's edge computed to the vector, not to
    the two-vector tile (a sixth less of the chunk's triangular products)."""
    width = lanes(c)
    fresh = np.bool_(False)
    j0 = col0
    while j0 < cols:
        if cols - j0 > width:
            madd_tile(a, b, c, i0, j0, depth, fresh)
            j0 += 2 * width
        else:
            madd_tile_narrow(a, b, c, i0, j0, depth, fresh)
            j0 += width


@register_jitable
def diagonal_dots(pt, wt, out, n):
    """out[0, i] = sum_(j <= i) pt[j, i] wt[j, i] for i < n, j ascending (columns as vectors from the first
    whole vector at or after the diagonal; the few before it one by one: pt and wt hold other values there);
    out's row padded to whole vectors."""
    width = lanes(out)
    zero = vzeros(out)
    row = out[0]
    for i in range(0, n, width):
        vstore(out, i, zero)
    ps, ws = pt.shape[1], wt.shape[1]
    for j in range(n):
        first = imin(j + (width - j % width) % width, n)
        for i in range(j, first):
            row[i] += pt[j, i] * wt[j, i]
        for i in range(first, n, width):
            vstore(out, i, vmadd(vload(out, i), vload(pt, j * ps + i), vload(wt, j * ws + i)))


@register_jitable
def row_dots(x, y, out, n, m):
    """out[0, i] = x[i, :m] . y[i, :m] for i < n, in the work dtype (lanes-wide partial sums, then across lanes, then
    the last m % lanes terms)."""
    width = lanes(x)
    full = m - m % width
    xm, ym = x.shape[1], y.shape[1]
    for i in range(n):
        acc = vzeros(x)
        for j in range(0, full, width):
            acc = vmadd(acc, vload(x, i * xm + j), vload(y, i * ym + j))
        total = vsum(acc)
        for j in range(full, m):
            total += x[i, j] * y[i, j]
        out[0, i] = total


@register_jitable
def slopes(f, sl, n, m, feature_map):
    """sl[i, :m] = phi'(x) from f[i, :m] = phi(x), i < n: 1 (identity), min(f, 1) (elu + 1), [f > 0] (relu)."""
    for i in range(n):
        fr, sr = f[i], sl[i]
        if feature_map == _ELU:
            for r in range(m):
                sr[r] = fr[r] if fr[r] < 1 else 1
        elif feature_map == _IDENTITY:
            for r in range(m):
                sr[r] = 1
        else:
            for r in range(m):
                sr[r] = 1 if fr[r] > 0 else 0


@register_jitable
def grad_rows(d, g, b, t0, n, h, src, ur, cos, sin, rows, rb, half, rotary_dim, interleaved, extra, coef, sl, m,
              with_extra, stream):
    """d[b, t0 + i, h, :m] = (R_i^T src[i] + coef[0, i] extra[i]) * sl[i] for i < n (``with_extra`` False: without
    the second term), rounded to d's dtype (g: d's geometry; d's work dtype is src's). ``stream``
    (:func:`.linear_attention.streams`): rows of whole vectors at aligned addresses by non-temporal stores."""
    width = lanes(ur)
    full = m - m % width
    row = ur[0]
    step, second = (2, 1) if interleaved else (1, half)
    for i in range(n):
        row_t = rows[rb, t0 + i]                    # ur[0] = R^T src[i]: the inverse rotation, the rest copied
        done = rotate_pairs_simd(src, i * src.shape[1], ur, 0, cos, sin, row_t, half, interleaved, True)
        for p in range(done, half):
            c, s = cos[row_t, p], -sin[row_t, p]
            a = p * step
            xa, xb = src[i, a], src[i, a + second]
            row[a] = xa * c - xb * s
            row[a + second] = xb * c + xa * s
        for j in range(rotary_dim, m):
            row[j] = src[i, j]
        e0, s0 = i * extra.shape[1], i * sl.shape[1]
        cv = vsplat(coef[0, i])
        for r in range(0, full, width):
            x = vload(ur, r)
            if with_extra:
                x = vmadd(x, cv, vload(extra, e0 + r))
            vstore(ur, r, vmul(x, vload(sl, s0 + r)))
        for r in range(full, m):
            x = row[r]
            if with_extra:
                x += coef[0, i] * extra[i, r]
            row[r] = x * sl[i, r]
        base = element_offset(g[0], g[1], g[2], g[3], b, t0 + i, h)
        if stream and g[4] == 1 and full == m and is_aligned(d, base):
            for r in range(0, m, width):
                vstore_stream(d, base + r, vload(ur, r))
        elif g[4] == 1:
            for r in range(0, full, width):
                vstore(d, base + r, vload(ur, r))
            for r in range(full, m):
                store(d, base + r, row[r])
        else:
            for r in range(m):
                store(d, base + r * g[4], row[r])


@register_jitable
def store_rows(d, g, b, t0, n, h, src, cols, stream):
    """d[b, t0 + i, h, :cols] = src[i, :cols] for i < n, rounded to d's dtype (src's work dtype is d's; ``stream``
    as in :func:`grad_rows`)."""
    width = lanes(src)
    full = cols - cols % width
    for i in range(n):
        base = element_offset(g[0], g[1], g[2], g[3], b, t0 + i, h)
        s0 = i * src.shape[1]
        if stream and g[4] == 1 and full == cols and is_aligned(d, base):
            for c in range(0, cols, width):
                vstore_stream(d, base + c, vload(src, s0 + c))
        elif g[4] == 1:
            for c in range(0, full, width):
                vstore(d, base + c, vload(src, s0 + c))
            for c in range(full, cols):
                store(d, base + c, src[i, c])
        else:
            for c in range(cols):
                store(d, base + c * g[4], src[i, c])


@register_jitable
def scale_rows(x, factors, n, cols):
    """x[i, :cols] *= factors[0, i] for i < n (whole vectors: x's rows padded)."""
    width = lanes(x)
    for i in range(n):
        f = vsplat(factors[0, i])
        x0 = i * x.shape[1]
        for c in range(0, cols, width):
            vstore(x, x0 + c, vmul(vload(x, x0 + c), f))


@register_jitable
def scaled_rows(x, factors, out, n, cols):
    """out[i, :cols] = x[i, :cols] * factors[0, i] for i < n (whole vectors: rows padded)."""
    width = lanes(x)
    for i in range(n):
        f = vsplat(factors[0, i])
        x0, o0 = i * x.shape[1], i * out.shape[1]
        for c in range(0, cols, width):
            vstore(out, o0 + c, vmul(vload(x, x0 + c), f))


@register_jitable
def zero_rows(x, n):
    """x[:n, :] = 0 (whole vectors: rows padded)."""
    width = lanes(x)
    zero = vzeros(x)
    for i in range(n):
        for c in range(0, x.shape[1], width):
            vstore(x, i * x.shape[1] + c, zero)


@register_jitable
def z_recurrence(z0, row0, f, z_rows, z_work, n, m, gamma, decayed):
    """z_rows[i] = gamma z_rows[i - 1] + f[i] from z0[row0] (float64 rows; ``decayed`` False: gamma not applied) and
    z_work[i] the same rows in the work dtype, i < n (float64 vectors, f widened exactly; one call per chunk, the
    loops here)."""
    width = lanes(z_rows)
    full = m - m % width
    gv = vsplat(gamma)
    zm = z_rows.shape[1]
    for j in range(0, full, width):
        a = vload(z0, row0 * z0.shape[1] + j)
        vstore(z_rows, j, vadd(vmul(a, gv) if decayed else a, vload_widened(f[0], j)))
    for j in range(full, m):
        z_rows[0, j] = (z0[row0, j] * gamma if decayed else z0[row0, j]) + f[0, j]
    for i in range(1, n):
        fr = f[i]
        for j in range(0, full, width):
            a = vload(z_rows, (i - 1) * zm + j)
            vstore(z_rows, i * zm + j, vadd(vmul(a, gv) if decayed else a, vload_widened(fr, j)))
        for j in range(full, m):
            a = z_rows[i - 1, j]
            z_rows[i, j] = (a * gamma if decayed else a) + f[i, j]
    for i in range(n):
        zr, zw = z_rows[i], z_work[i]
        for r in range(m):
            zw[r] = zr[r]


@register_jitable
def sum_rows64(z, f, n, m, gamma, decayed):
    """z = gamma z + f[i] for i < n in turn (z float64 (m,), f work dtype rows widened exactly; ``decayed`` False:
    gamma not applied)."""
    width = lanes(z)
    full = m - m % width
    gv = vsplat(gamma)
    for i in range(n):
        fr = f[i]
        for j in range(0, full, width):
            a = vload(z, j)
            vstore(z, j, vadd(vmul(a, gv) if decayed else a, vload_widened(fr, j)))
        for j in range(full, m):
            z[j] = (z[j] * gamma if decayed else z[j]) + f[i, j]


@register_jitable
def carry_row(x, y, factor, n, scaled):
    """x[:n] = x[:n] * factor + y[:n] (``scaled`` False: x unscaled): x float64 (1-D), y work dtype (1-D) widened
    exactly; float64 vectors, the last n % lanes one by one."""
    width = lanes(x)
    full = n - n % width
    fv = vsplat(factor)
    for j in range(0, full, width):
        a = vload(x, j)
        vstore(x, j, vadd(vmul(a, fv) if scaled else a, vload_widened(y, j)))
    for j in range(full, n):
        x[j] = (x[j] * factor if scaled else x[j]) + y[j]


@register_jitable
def inverse_denominators(f, z, z_row_step, inv, n, m, eps):
    """inv[0, i] = 1 / (f[i] . z[i * z_row_step] + eps) for i < n (f work dtype widened exactly, z float64 rows,
    z_row_step 0: one z for every row; inv work dtype): the sum as the forward's :func:`.linear_attention.dot_f64`
    forms it (float64 vectors, then across lanes, then the last m % lanes terms), one call per chunk."""
    width = lanes(z)
    full = m - m % width
    zm = z.shape[1] * z_row_step
    for i in range(n):
        fr = f[i]
        acc = vzeros(z)
        for j in range(0, full, width):
            acc = vmadd(acc, vload_widened(fr, j), vload(z, i * zm + j))
        total = vsum(acc)
        for j in range(full, m):
            total += np.float64(f[i, j]) * z[i * z_row_step, j]
        inv[0, i] = 1.0 / (total + eps)


@register_jitable
def reverse_terms(f, gd, pw_w, gamma_w, decayed, q_add, rec, dbf, n, m):
    """The chunk's terms of gD (work dtype, i < n rows, m features in whole vectors: rows padded)::

        q_add += sum_i gamma^(i+1) gD_i f_i        dbf[j] += sum_(i>=j) gamma^(i-j) gD_i f_i  (a reverse recurrence)
    """
    width = lanes(f)
    gv = vsplat(gamma_w)
    zero = vzeros(f)
    for r in range(0, m, width):
        vstore(rec, r, zero)
    for i in range(n - 1, -1, -1):
        g = vsplat(gd[0, i])
        gi = vsplat(gd[0, i] * pw_w[0, i + 1])
        f0, d0 = i * f.shape[1], i * dbf.shape[1]
        for r in range(0, m, width):
            a = vload(f, f0 + r)
            vstore(q_add, r, vmadd(vload(q_add, r), gi, a))
            x = vload(rec, r)
            x = vmadd(vmul(x, gv) if decayed else x, g, a)
            vstore(rec, r, x)
            vstore(dbf, d0 + r, vadd(vload(dbf, d0 + r), x))


@register_jitable
def load_queries(q, go, geo, b, h, t0, n, cos, sin, rows, half, rotary_dim, interleaved, feature_map, qf, q_rows,
                 q_hat_t, qsl, gn, dvd, dvw, inv, z, z_row_step, normalize, eps, after):
    """The q side of one chunk of q head h: phi(q) to qf, its rotation to q_rows and q_hat_t (transposed), phi'(q)
    to qsl, grad_o's rows to gn and, with ``normalize``, the inverse denominators to inv (z, z_row_step as in
    :func:`inverse_denominators`) and gN = gn * inv in place; ``after``: the next load's rows (prefetched)."""
    m = qf.shape[1]
    load_features(q, geo[0], b, h, t0, n, cos, sin, rows, half, rotary_dim, interleaved, feature_map, qf, q_rows,
                  q_hat_t, np.bool_(True), after)
    load_values(go, geo[3], b, h, t0, n, gn, dvd, after)
    slopes(qf, qsl, n, m, feature_map)
    if normalize:
        inverse_denominators(qf, z, z_row_step, inv, n, m, eps)
        scale_rows(gn, inv, n, dvw)


@register_jitable(inline="always")   # a few instructions: inlined, no compile of its own
def earlier_load(h, first_h, end_h, t, n, chunk):
    """(head, first token, rows) of the load after rows t.. of head h in a walk over heads first_h..end_h-1
    inside each chunk of ``chunk`` tokens (this one: n rows), chunks from the last to the first (the reverse
    sweep's order; chunk starts are multiples of ``chunk``): the next head's rows of this chunk, or the first
    head's rows of the chunk before (0 rows before the first). The prefetch hint of
    :func:`.linear_attention.load_features`."""
    if h + 1 < end_h:
        return np.int64(h + 1), np.int64(t), np.int64(n)
    if t == 0:
        return np.int64(first_h), np.int64(0), np.int64(0)
    return np.int64(first_h), np.int64(t - chunk), np.int64(chunk)


@register_jitable
def transposed(src, dest, n):
    """:func:`.linear_attention.transpose_rows` (inlined there) as a function of its own here."""
    transpose_rows(src, dest, n)


@register_jitable
def to_work(src, dest, dest_t, m, dv):
    """dest[:m, :dv] = src (float64 (m, dv)) in the work dtype, and dest_t[:dv, :m] its transpose (whole-register
    transposes, :func:`.linear_attention.transpose_rows`; dest's padding columns are zeros)."""
    for r in range(m):
        sr, dr = src[r], dest[r]
        for c in range(dv):
            dr[c] = sr[c]
    transposed(dest, dest_t, m)


@register_jitable
def carry(x64, chunk_sum, factor, m, dv, scaled):
    """x64 = factor x64 + chunk_sum (float64 (m, dv); the chunk's work-dtype sum (m, >= dv) widened exactly;
    ``scaled`` False: factor not applied)."""
    width = lanes(x64)
    full = dv - dv % width
    fv = vsplat(factor)
    for r in range(m):
        cr = chunk_sum[r]
        for j in range(0, full, width):
            a = vload(x64, r * dv + j)
            vstore(x64, r * dv + j, vadd(vmul(a, fv) if scaled else a, vload_widened(cr, j)))
        for j in range(full, dv):
            a = x64[r, j]
            x64[r, j] = (a * factor if scaled else a) + chunk_sum[r, j]


@njit(nogil=True, **KERNEL_JIT)
def linear_backward_tasks(q, k, v, go, dq, dk, dv, geo, cos, sin, rows, state_s, state_z, grad_s, grad_z, d_s, d_z,
                          seq_len, half, rotary_dim, interleaved, causal, feature_map, eps, chunk, groups, powers,
                          decayed, normalize, chunk_s, chunk_z, first, last):
    """Tasks first..last-1 (task = b * Hk + hk) of the backward; see the module docstring. q, k, v, go, dq, dk, dv:
    flat buffers of one dtype (float16 as uint16 bits) with their (7, 5) int64 geometry rows (offset, sB, sS, sH,
    sD) in that order; cos, sin work dtype; rows (1 or B, T) int64; state_s, state_z, grad_s, grad_z
    (B, Hk, m, dv) / (B, Hk, m) and d_s, d_z (written) work dtype; powers float64 (B, Hk, chunk + 1) (read when
    ``decayed``). ``chunk_s``, ``chunk_z`` (causal; None: swept here): the states before each chunk that the
    forward kept (``linear_attention.keep_chunk_state``: S_in^T per chunk in this kernel's padded tiles, z_in
    float64), read in place of step 1's sweep."""
    n_heads, m, dvd = state_s.shape[1], state_s.shape[2], state_s.shape[3]
    keep = (q, k, v, go, dq, dk, dv, geo, cos, sin, rows, state_s, state_z, grad_s, grad_z, d_s, d_z, powers)
    q, k, v, go, dq, dk, dv = borrowed(q), borrowed(k), borrowed(v), borrowed(go), borrowed(dq), borrowed(dk), \
        borrowed(dv)
    geo, cos, sin, rows = borrowed(geo), borrowed(cos), borrowed(sin), borrowed(rows)
    work = cos.dtype
    width = tile_width(cos[0])
    cp, mw, dvw = padded(chunk, width), padded(m, width), padded(dvd, width)
    n_chunks = (seq_len + chunk - 1) // chunk
    saved_n = n_chunks if causal and chunk_s is None else 1   # (the forward's states, when given, are read in place)
    # work-dtype chunk buffers, padded to whole tiles (2-D, 64-byte aligned: the forward's aligned_zeros). The
    # rotated rows (k_rows, q_rows) are load_features' scratch: rows of mw, the tiles' b operands as they are
    kf_o, k_rows_o, k_hat_t_o = aligned_zeros(cp, m, work), aligned_zeros(cp, mw, work), aligned_zeros(mw, cp, work)
    ksl_o, kw_o = aligned_zeros(cp, mw, work), aligned_zeros(cp, mw, work)
    vals_o, vt_o, vw_o = aligned_zeros(cp, dvw, work), aligned_zeros(dvw, cp, work), aligned_zeros(cp, dvw, work)
    qf_o, q_rows_o, q_hat_t_o = aligned_zeros(cp, m, work), aligned_zeros(cp, mw, work), aligned_zeros(mw, cp, work)
    qsl_o, gn_o, gns_o = aligned_zeros(cp, mw, work), aligned_zeros(cp, dvw, work), aligned_zeros(cp, dvw, work)
    w_o, wt_o, pt_o = aligned_zeros(cp, cp, work), aligned_zeros(cp + 1, cp, work), aligned_zeros(cp + 1, cp, work)
    x_o, dkh_o, dvv_o = aligned_zeros(cp, mw, work), aligned_zeros(cp, mw, work), aligned_zeros(cp, dvw, work)
    s_chunk_o, p_add_o = aligned_zeros(mw, dvw, work), aligned_zeros(mw, dvw, work)
    s_work_o = aligned_zeros(mw, dvw, work)
    p_work_o, p_t_o = aligned_zeros(mw, dvw, work), aligned_zeros(dvw, mw, work)
    dbf_o, z_work_o, qw_o = aligned_zeros(cp, mw, work), aligned_zeros(cp, mw, work), aligned_zeros(1, mw, work)
    ur_o, rowsw_o, vecw_o = aligned_zeros(1, mw, work), aligned_zeros(4, cp, work), aligned_zeros(2, mw, work)
    saved_o = aligned_zeros(saved_n * dvw, mw, work)                 # S_in^T of every chunk (causal), or S^T
    pw_w_o = aligned_zeros(4, chunk + 1, work)   # gamma^j, gamma^(n-1-j) of a chunk, gamma^(j+1), gamma^(chunk-j)
    # float64: the carries (S, z, P, Q), the z rows and the denominators, as the forward's
    s64_o, p64_o = aligned_zeros(m, dvd, np.float64), aligned_zeros(m, dvd, np.float64)
    z_starts_o, z_rows_o = aligned_zeros(saved_n, m, np.float64), aligned_zeros(cp, m, np.float64)
    vec64_o, pw_o = aligned_zeros(2, m, np.float64), aligned_zeros(1, chunk + 1, np.float64)
    kf, k_rows, k_hat_t, ksl, kw = borrowed(kf_o), borrowed(k_rows_o), borrowed(k_hat_t_o), borrowed(ksl_o), \
        borrowed(kw_o)
    vals, vt, vw = borrowed(vals_o), borrowed(vt_o), borrowed(vw_o)
    qf, q_rows, q_hat_t, qsl = borrowed(qf_o), borrowed(q_rows_o), borrowed(q_hat_t_o), borrowed(qsl_o)
    gn, gns, W, Wt, Pt = borrowed(gn_o), borrowed(gns_o), borrowed(w_o), borrowed(wt_o), borrowed(pt_o)
    X, dkh, dvv, dbf, z_work = borrowed(x_o), borrowed(dkh_o), borrowed(dvv_o), borrowed(dbf_o), borrowed(z_work_o)
    s_chunk, p_add, p_work, p_t = borrowed(s_chunk_o), borrowed(p_add_o), borrowed(p_work_o), borrowed(p_t_o)
    s_work, q_w = borrowed(s_work_o), borrowed(qw_o)
    ur, rows_w, vec_w, saved = borrowed(ur_o), borrowed(rowsw_o), borrowed(vecw_o), borrowed(saved_o)
    pw_w, pw = borrowed(pw_w_o), borrowed(pw_o)
    S64, P64, z_starts, z_rows = borrowed(s64_o), borrowed(p64_o), borrowed(z_starts_o), borrowed(z_rows_o)
    vec64 = borrowed(vec64_o)
    zc, Q = vec64[0], vec64[1]
    inv, ones, gdot, gD_w = rows_w[0:1], rows_w[1:2], rows_w[2:3], rows_w[3:4]   # per row of a chunk
    for i in range(cp):
        ones[0, i] = 1
    wvec, one_w = lanes(ones), ones[0, 0]
    tail_w, inter_w, rev_w = pw_w[1:2], pw_w[2:3], pw_w[3:4]
    q_add, rec = vec_w[0], vec_w[1]
    fresh, accumulate, as_rows, as_columns = np.bool_(False), np.bool_(True), np.bool_(False), np.bool_(True)
    per_batch = rows.shape[0] > 1
    # large gradients (much larger than the caches) written by non-temporal stores, as the forward writes o
    stream_q, stream_k, stream_v = streams(dq, ur[0]), streams(dk, ur[0]), streams(dv, ur[0])
    for task in range(first, last):
        b, hk = task // n_heads, task % n_heads
        rb = b if per_batch else 0
        for j in range(chunk + 1):
            pw[0, j] = powers[b, hk, j] if decayed else 1.0
            pw_w[0, j] = pw[0, j]
        for j in range(chunk + 1):
            rev_w[0, j] = pw_w[0, chunk - j]
        for j in range(chunk):
            inter_w[0, j] = pw_w[0, j + 1]
        gamma = pw[0, 1]
        for r in range(m):
            zc[r] = state_z[b, hk, r]
            Q[r] = grad_z[b, hk, r]
            for c in range(dvd):
                S64[r, c] = state_s[b, hk, r, c]
                P64[r, c] = grad_s[b, hk, r, c]
        # 1. the forward sweep: the state before each chunk (causal) or over every token; the forward's own when it
        # kept them
        states, starts = saved, z_starts
        if chunk_s is not None and causal:
            states, starts = chunk_s[b, hk], chunk_z[b, hk]
        for c in range(n_chunks if chunk_s is None or not causal else 0):
            t0 = c * chunk
            n = imin(chunk, seq_len - t0)
            if causal:
                for r in range(m):
                    z_starts[c, r] = zc[r]
                to_work(S64, s_work, saved[c * dvw:(c + 1) * dvw], m, dvd)
            after = next_load(hk, hk, hk + 1, t0, chunk, seq_len)
            load_features(k, geo[1], b, hk, t0, n, cos, sin, rows, half, rotary_dim, interleaved, feature_map, kf,
                          k_rows, k_hat_t, as_columns, after)
            load_values(v, geo[2], b, hk, t0, n, vals, dvd, after)
            sum_rows64(zc, kf, n, m, gamma, decayed)
            if decayed:
                for j in range(n):
                    tail_w[0, j] = pw_w[0, n - 1 - j]
                for r in range(m):
                    for j in range(n):
                        k_hat_t[r, j] *= tail_w[0, j]
            product(k_hat_t, vals, s_chunk, 0, m, 0, dvd, n, fresh)
            carry(S64, s_chunk, pw[0, n], m, dvd, decayed)
        if not causal:
            for r in range(m):
                z_starts[0, r] = zc[r]
            to_work(S64, s_work, saved, m, dvd)
        to_work(P64, p_work, p_t, m, dvd)
        if causal:
            # 2. the reverse sweep
            for c in range(n_chunks - 1, -1, -1):
                t0 = c * chunk
                n = imin(chunk, seq_len - t0)
                sv = states[c * dvw:(c + 1) * dvw]
                after = earlier_load(hk, hk, hk + 1, t0, n, chunk)
                load_features(k, geo[1], b, hk, t0, n, cos, sin, rows, half, rotary_dim, interleaved, feature_map,
                              kf, k_hat_t, k_rows, as_rows, after)
                load_values(v, geo[2], b, hk, t0, n, vals, dvd, after)
                slopes(kf, ksl, n, m, feature_map)
                transposed(vals, vt, n)
                if decayed:
                    for j in range(n):
                        tail_w[0, j] = pw_w[0, n - 1 - j]
                    scaled_rows(vals, tail_w, vw, n, dvw)
                    scaled_rows(k_rows, tail_w, kw, n, mw)
                if normalize:
                    z_recurrence(starts, c, kf, z_rows, z_work, n, m, gamma, decayed)
                zero_rows(dkh, cp)
                zero_rows(dvv, cp)
                zero_rows(dbf, cp)
                for r in range(mw):
                    q_add[r] = 0
                for g in range(groups):
                    h = hk * groups + g
                    after = earlier_load(h, hk * groups, (hk + 1) * groups, t0, n, chunk)
                    load_queries(q, go, geo, b, h, t0, n, cos, sin, rows, half, rotary_dim, interleaved, feature_map,
                                 qf, q_rows, q_hat_t, qsl, gn, dvd, dvw, inv, z_rows, 1, normalize, eps, after)
                    # W = tril(gN V^T) . Gamma, then W^T
                    for i0 in range(0, n, TILE_ROWS):
                        end = imin(i0 + TILE_ROWS, n)
                        row_tiles(gn, vt, W, i0, 0, end, dvd)
                        for i in range(i0, end):
                            wr = W[i]
                            for j in range(i + 1, end):
                                wr[j] = 0
                            if decayed:
                                off = chunk - i
                                for j in range(i + 1):
                                    wr[j] *= rev_w[0, off + j]
                    transposed(W, Wt, n)
                    # Pt = triu(B̂ Â^T) (the decay after the gD sums, which pair it with the decayed W)
                    for j0 in range(0, n, TILE_ROWS):
                        row_tiles(k_rows, q_hat_t, Pt, j0, j0 - j0 % wvec, n, m)
                        for j in range(j0, imin(j0 + TILE_ROWS, n)):
                            pr = Pt[j]
                            for i in range(j0, j):
                                pr[i] = 0
                    # X = gamma^(i+1) gN S_in^T
                    product(gn, sv, X, 0, n, 0, m, dvd, fresh)
                    if decayed:
                        scale_rows(X, inter_w, n, mw)
                    if normalize:
                        diagonal_dots(Pt, Wt, gdot, n)
                        row_dots(q_rows, X, gD_w, n, m)
                        for i in range(n):
                            gD_w[0, i] = -(gD_w[0, i] + gdot[0, i]) * inv[0, i]
                    if decayed:
                        for j in range(n):
                            pr = Pt[j]
                            for i in range(j, n):
                                pr[i] *= pw_w[0, i - j]
                    # dÂ = X + W B̂ (the depth of each row block up to its last row), then dq
                    for i0 in range(0, n, TILE_ROWS):
                        end = imin(i0 + TILE_ROWS, n)
                        for j0 in range(0, m, width):
                            madd_tile(W, k_rows, X, i0, j0, end, accumulate)
                    grad_rows(dq, geo[4], b, t0, n, h, X, ur, cos, sin, rows, rb, half, rotary_dim, interleaved,
                              z_work, gD_w, qsl, m, normalize, stream_q)
                    # dB̂ += W^T Â, dV += Pt gN (the depth of each row block from its first row)
                    for j0 in range(0, n, TILE_ROWS):
                        wt_s, pt_s = shifted(Wt, j0, cp), shifted(Pt, j0, cp)
                        qh_s, gn_s = q_rows[j0:], gn[j0:]
                        for c0 in range(0, m, width):
                            madd_tile(wt_s, qh_s, dkh, j0, c0, n - j0, accumulate)
                        for c0 in range(0, dvd, width):
                            madd_tile(pt_s, gn_s, dvv, j0, c0, n - j0, accumulate)
                    # the reverse state's chunk terms
                    if decayed:
                        scaled_rows(gn, inter_w, gns, n, dvw)
                        product(q_hat_t, gns, p_add, 0, m, 0, dvd, n, accumulate if g > 0 else fresh)
                    else:
                        product(q_hat_t, gn, p_add, 0, m, 0, dvd, n, accumulate if g > 0 else fresh)
                    if normalize:
                        reverse_terms(qf, gD_w, pw_w, pw_w[0, 1], decayed, q_add, rec, dbf, n, m)
                # the later chunks' and the state out's terms, then dk, dv
                product(vw if decayed else vals, p_t, dkh, 0, n, 0, m, dvd, accumulate)
                product(kw if decayed else k_rows, p_work, dvv, 0, n, 0, dvd, m, accumulate)
                for r in range(m):
                    q_w[0, r] = Q[r]
                for j in range(n):
                    wv = vsplat(tail_w[0, j] if decayed else one_w)
                    for r in range(0, mw, wvec):
                        vstore(dbf, j * mw + r, vmadd(vload(dbf, j * mw + r), wv, vload(q_w, r)))
                grad_rows(dk, geo[5], b, t0, n, hk, dkh, ur, cos, sin, rows, rb, half, rotary_dim, interleaved,
                          dbf, ones, ksl, m, True, stream_k)
                store_rows(dv, geo[6], b, t0, n, hk, dvv, dvd, stream_v)
                carry_row(Q, q_add, pw[0, n], m, decayed)
                carry(P64, p_add, pw[0, n], m, dvd, decayed)
                to_work(P64, p_work, p_t, m, dvd)
        else:
            # 2'. non-causal: dq and (P, Q) from the whole (S, z), then dk, dv from them
            z_all = z_starts[0:1]
            for i in range(cp):   # (the z rows of grad_rows: one z for every row)
                for r in range(m):
                    z_work[i, r] = z_all[0, r]
            for c in range(n_chunks):
                t0 = c * chunk
                n = imin(chunk, seq_len - t0)
                for r in range(mw):
                    q_add[r] = 0
                for g in range(groups):
                    h = hk * groups + g
                    after = next_load(h, hk * groups, (hk + 1) * groups, t0, chunk, seq_len)
                    load_queries(q, go, geo, b, h, t0, n, cos, sin, rows, half, rotary_dim, interleaved, feature_map,
                                 qf, q_rows, q_hat_t, qsl, gn, dvd, dvw, inv, z_all, 0, normalize, eps, after)
                    product(gn, saved, X, 0, n, 0, m, dvd, fresh)
                    if normalize:
                        row_dots(q_rows, X, gD_w, n, m)
                        for i in range(n):
                            gD_w[0, i] = -gD_w[0, i] * inv[0, i]
                        reverse_terms(qf, gD_w, pw_w, pw_w[0, 1], False, q_add, rec, dbf, n, m)
                    grad_rows(dq, geo[4], b, t0, n, h, X, ur, cos, sin, rows, rb, half, rotary_dim, interleaved,
                              z_work, gD_w, qsl, m, normalize, stream_q)
                    product(q_hat_t, gn, p_add, 0, m, 0, dvd, n, accumulate if g > 0 else fresh)
                carry_row(Q, q_add, 1.0, m, False)
                carry(P64, p_add, 1.0, m, dvd, False)
            to_work(P64, p_work, p_t, m, dvd)
            for j in range(cp):
                for r in range(m):
                    dbf[j, r] = Q[r]
            for c in range(n_chunks):
                t0 = c * chunk
                n = imin(chunk, seq_len - t0)
                after = next_load(hk, hk, hk + 1, t0, chunk, seq_len)
                load_features(k, geo[1], b, hk, t0, n, cos, sin, rows, half, rotary_dim, interleaved, feature_map,
                              kf, k_hat_t, k_rows, as_rows, after)
                load_values(v, geo[2], b, hk, t0, n, vals, dvd, after)
                slopes(kf, ksl, n, m, feature_map)
                product(vals, p_t, dkh, 0, n, 0, m, dvd, fresh)
                product(k_rows, p_work, dvv, 0, n, 0, dvd, m, fresh)
                grad_rows(dk, geo[5], b, t0, n, hk, dkh, ur, cos, sin, rows, rb, half, rotary_dim, interleaved,
                          dbf, ones, ksl, m, True, stream_k)
                store_rows(dv, geo[6], b, t0, n, hk, dvv, dvd, stream_v)
        for r in range(m):
            d_z[b, hk, r] = Q[r]
            for col in range(dvd):
                d_s[b, hk, r, col] = P64[r, col]
    store_fence()   # the non-temporal stores ordered before whatever the caller does next
    keep_alive((kf_o, k_rows_o, k_hat_t_o, ksl_o, kw_o, vals_o, vt_o, vw_o, qf_o, q_rows_o, q_hat_t_o, qsl_o, gn_o,
                gns_o, w_o, wt_o, pt_o, x_o, dkh_o, dvv_o, s_chunk_o, p_add_o, s_work_o, qw_o, p_work_o, p_t_o, dbf_o,
                z_work_o, ur_o, rowsw_o, vecw_o, saved_o, pw_w_o, s64_o, p64_o, z_starts_o, z_rows_o, vec64_o, pw_o,
                keep))


# -- the backend's primitive ---------------------------------------------------------------------------------
class ChunkStates:
    """The states before each chunk that a causal forward kept for its backward (``keep_chunk_states=True``): ``s``
    (B, Hk, chunks * dvw, mw) S_in^T in the work dtype, in :func:`linear_backward_tasks`' padded tiles (zeros in the
    padding), ``z`` (B, Hk, chunks, m) float64, and ``key``, the call they belong to: (B, T, Hk, m, dv, chunk,
    work dtype).

    Their buffers come from a small pool of the buffers of earlier states no longer referenced (a training step's
    forward then writes memory the previous step's used, instead of faulting in new pages: ~20 % of the forward
    at 4 MB): at most :data:`POOL_PER_SHAPE` per shape, :data:`POOL_SHAPES` shapes."""

    __slots__ = ("s", "z", "key", "__weakref__")

    def __init__(self, key):
        from ..numba_runtime import aligned_empty
        from .simd import VECTOR_BYTES

        B, T, Hk, m, dv, chunk, work = key
        width = 2 * VECTOR_BYTES // np.dtype(work).itemsize   # linear_attention.tile_width of the work dtype
        chunks = -(-T // chunk)
        self.key = key
        shapes = ((B, Hk, chunks * -(-dv // width) * width, -(-m // width) * width), (B, Hk, chunks, m))
        try:
            self.s, self.z = _POOL.get((shapes, np.dtype(work).str), []).pop()
        except IndexError:   # (none free; list.pop is atomic: no two states get one buffer from any thread)
            self.s, self.z = aligned_empty(shapes[0], work), np.empty(shapes[1], np.float64)
            if shapes[0][2] != chunks * dv or shapes[0][3] != m:
                self.s[...] = 0   # the padding the tiles read (the forward writes the rest, and never the padding)
        weakref.finalize(self, _give_back, (shapes, np.dtype(work).str), self.s, self.z)


#: the pool of :class:`ChunkStates` buffers: at most this many free buffers per shape ...
POOL_PER_SHAPE = 2
#: ... and this many shapes (the oldest shape's buffers dropped first)
POOL_SHAPES = 4
_POOL: dict = {}


def _give_back(key, s, z):
    """A collected :class:`ChunkStates`' buffers back to the pool (within its bounds)."""
    free = _POOL.pop(key, [])
    if len(free) < POOL_PER_SHAPE:
        free.append((s, z))
    _POOL[key] = free   # (the most recent shape last)
    while len(_POOL) > POOL_SHAPES:
        del _POOL[next(iter(_POOL))]


def linear_attention_backward(q, k, v, cos, sin, rows, grad_o, *, rotary_dim, layout, causal, feature_map, eps, chunk,
                              state, decay=None, normalize=True, grad_state=None, chunk_states=None):
    """(dq, dk, dv, dstate) of the ``linear_attention`` primitive (contract in ``rotary.backends``) by
    :func:`linear_backward_tasks`: one task per (batch row, k/v head) on the backend's thread pool; q, k, v,
    grad_o read where they lie (any strides, float16 as its bits), dq, dk, dv written in their dtypes.
    ``chunk_states``: a causal forward's :class:`ChunkStates` of the same call, read in place of the forward sweep
    (a ValueError when they belong to another call's shapes or chunk)."""
    from .. import numba_runtime as _runtime
    from ..numpy_linear import decay_powers
    from ..numpy_linear_backward import check_backward_args

    decayed = check_backward_args(q, k, v, grad_o, feature_map=feature_map, causal=causal, decay=decay)
    B, T, H, m = q.shape
    Hk, dvd = k.shape[2], v.shape[3]
    work = np.float64 if q.dtype == np.float64 else np.float32

    def state_arg(x, shape):
        if x is None:
            return _runtime.readonly_c(np.zeros(shape, work))
        return _runtime.readonly_c(np.ascontiguousarray(np.asarray(x).reshape(shape), dtype=work))

    S0, z0 = (None, None) if state is None else state
    gS, gz = (None, None) if grad_state is None else grad_state
    s_shape, z_shape = (B, Hk, m, dvd), (B, Hk, m)
    args_state = (state_arg(S0, s_shape), state_arg(z0, z_shape), state_arg(gS, s_shape), state_arg(gz, z_shape))
    aligned_empty = _runtime.aligned_empty   # rows on cache-line boundaries: large gradients are streamed

    dq, dk, dv = (aligned_empty(shape, q.dtype) for shape in ((B, T, H, m), (B, T, Hk, m), (B, T, Hk, dvd)))
    d_s, d_z = np.empty(s_shape, work), np.empty(z_shape, work)
    step = max(1, min(int(chunk), T)) if T else 1
    kept = (None, None)
    if chunk_states is not None and causal:
        if type(chunk_states) is not ChunkStates or chunk_states.key != (B, T, Hk, m, dvd, step, np.dtype(work)):
            raise ValueError("chunk_states belong to another call: a causal forward of these q, k, v shapes, chunk "
                             f"{step} and work dtype {np.dtype(work).name} keeps them (keep_chunk_states=True)")
        kept = (chunk_states.s, chunk_states.z)
    if B * Hk and T:
        cos = _runtime.readonly_c(cos if cos.dtype == work else np.asarray(cos, work))
        sin = _runtime.readonly_c(sin if sin.dtype == work else np.asarray(sin, work))
        rows = _runtime.readonly_c(np.asarray(rows, np.int64))
        powers = _runtime.readonly(decay_powers(np.asarray(decay, np.float64), step)) if decayed else _NO_POWERS
        if grad_o.dtype != q.dtype:   # (one dtype for every buffer; its rows are read in the work dtype anyway)
            grad_o = grad_o.astype(q.dtype)
        bufs, geo = _runtime.flat_buffers((q, k, v, grad_o, dq, dk, dv))
        for buf in bufs[:4]:
            buf.flags.writeable = False   # one compiled signature for read-only and writable inputs
        _runtime.run_tasks(linear_backward_tasks, (
            *bufs, geo, cos, sin, rows, *args_state, d_s, d_z, T, rotary_dim // 2, rotary_dim,
            layout == "interleaved", bool(causal), FEATURE_MAPS[feature_map], float(eps), step, H // Hk, powers,
            decayed, bool(normalize), *kept), B * Hk)
    else:
        dq[...], dk[...], dv[...] = 0, 0, 0
        d_s[...], d_z[...] = args_state[2], args_state[3]
    dstate = None if state is None else (d_s, d_z)
    return dq, dk, dv, dstate


_NO_POWERS = np.ones((1, 1, 1))
_NO_POWERS.flags.writeable = False
