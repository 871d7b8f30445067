"""The backward of linear attention with RoPE on the ``numba`` backend: the ``linear_attention_backward``
primitive (contract in ``rotary.backends``; formulas in :mod:`rotary.backends.numpy_linear_backward`).

One task per (batch row, k/v head) with its G q heads, ranges of tasks on the backend's thread pool
(:func:`rotary.backends.numba_runtime.run_tasks`, as the forward: a ``nogil`` kernel, no parfor to compile).
The chunk products are the forward's register tiles (:func:`.linear_attention.madd_tile` in the work dtype:
float32 for float32 / float16 input), its feature loads (:func:`.linear_attention.load_features`: phi, the
rotated rows and their transpose) and buffers; as there, the carried sums (the state S, z of the forward
sweep, the reverse state P, Q) and the denominators are float64, everything inside a chunk is work dtype.

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
       dB̂ += W^T Â        dV += Pt gN                 P_add += Â^T (gamma^(i+1) gN)     Q_add += sum_i gamma^(i+1) gD_i a_i
       db_j += sum_(i>=j) gamma^(i-j) gD_i a_i        (a reverse recurrence over the rows, float64)

   (W' = W without its decay factors: gN_i . N_i = â_i . X_i + sum_j P_ij (gN_i . v_j), so the numerator N
   is never recomputed), then per k/v head::

       dB̂ += (gamma^(n-1-j) V) P^T     dV += (gamma^(n-1-j) B̂) P     db_j += gamma^(n-1-j) Q
       dk = phi'(k) (R^T dB̂ + db)      P <- gamma^n P + P_add          Q <- gamma^n Q + Q_add

   Triangular products cover the tiles that hold the triangle only: W's and Pt's row blocks the columns up to
   the block's last row (from its first), W B̂ the depth up to it, W^T Â and Pt gN the depth from the block's
   first row (:func:`shifted`: a view whose rows start that many columns later).

Non-causal (no decay): (S, z) over every token, then per q head and chunk X = gN S^T = dÂ, gD_i = -(â_i . X_i) /
(a_i . z + eps) and (P, Q) summed (per chunk into the float64 carry), then dB̂ = V P^T, dV = B̂ P, db = Q.

phi'(x) from phi(x) alone: 1 for identity; min(phi, 1) for elu + 1 (x + 1 > 1 for x > 0, exp(x) <= 1 else);
[phi > 0] for relu. Non-finite data is not kept from earlier tokens' gradients (the forward's guard of the
intra-chunk product has no counterpart here: a NaN anywhere in a chunk may reach its other rows' gradients).
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.extending import register_jitable

from ..feature_maps import CODES as FEATURE_MAPS
from .common import borrowed, element_offset, imin, load, store
from .linear_attention import (NO_NEXT_LOAD, TILE_ROWS, aligned_zeros, keep_alive, load_features, load_values,
                               madd_tile, padded, tile_width, transpose_rows)
from .rotation import rotate_pairs_simd
from .simd import KERNEL_JIT, lanes, vload, vmadd, vsum, vzeros

_IDENTITY, _ELU = FEATURE_MAPS["identity"], FEATURE_MAPS["elu"]   # compile-time constants of the kernels


@register_jitable
def slope(f, feature_map):
    """phi'(x) from f = phi(x): 1 (identity), min(f, 1) (elu + 1), 1 if f > 0 else 0 (relu)."""
    if feature_map == _IDENTITY:
        return 1.0
    if feature_map == _ELU:
        return f if f < 1.0 else 1.0
    return 1.0 if f > 0 else 0.0


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
def dot_work(x, xi, y, yi, n):
    """sum_{j < n} x.flat[xi + j] y.flat[yi + j] in the work dtype (lanes-wide partial sums, then across lanes)."""
    width = lanes(x)
    full = n - n % width
    acc = vzeros(x)
    for j in range(0, full, width):
        acc = vmadd(acc, vload(x, xi + j), vload(y, yi + j))
    total = vsum(acc)
    for j in range(full, n):
        total += x.reshape(-1)[xi + j] * y.reshape(-1)[yi + j]
    return total


@register_jitable
def unrotate_row(x, i, out, cos, sin, row, half, rotary_dim, interleaved):
    """out[0, :m] = R^T x[i, :m] (table row ``row``: the inverse rotation; features past rotary_dim copied)."""
    m = out.shape[1]
    done = rotate_pairs_simd(x, i * x.shape[1], out, 0, cos, sin, row, half, interleaved, True)
    step, second = (2, 1) if interleaved else (1, half)
    for p in range(done, half):
        c, s = cos[row, p], -sin[row, p]
        a = p * step
        xa, xb = x[i, a], x[i, a + second]
        out[0, a] = xa * c - xb * s
        out[0, a + second] = xb * c + xa * s
    for j in range(rotary_dim, m):
        out[0, j] = x[i, j]


@register_jitable
def store_grad(d, g, b, t, h, ur, extra, extra_row, coef, feats, feats_row, m, feature_map):
    """d[b, t, h, :m] = (ur[0, :m] + coef * extra[extra_row, :m]) * phi'(feats[feats_row, :m]) rounded to d's
    dtype (g: d's geometry; ``coef`` 0 leaves extra unread)."""
    base = element_offset(g[0], g[1], g[2], g[3], b, t, h)
    step = g[4]
    if coef != 0:
        for r in range(m):
            store(d, base + r * step, (ur[0, r] + coef * extra[extra_row, r]) * slope(feats[feats_row, r], feature_map))
    else:
        for r in range(m):
            store(d, base + r * step, ur[0, r] * slope(feats[feats_row, r], feature_map))


@register_jitable
def store_rows(d, g, b, t0, n, h, src, cols):
    """d[b, t0 + i, h, :cols] = src[i, :cols] for i < n, rounded to d's dtype."""
    for i in range(n):
        base = element_offset(g[0], g[1], g[2], g[3], b, t0 + i, h)
        for c in range(cols):
            store(d, base + c * g[4], src[i, c])


@register_jitable
def transposed(src, dest, n):
    """:func:`.linear_attention.transpose_rows` (inlined there) as a function of its own here."""
    transpose_rows(src, dest, n)


@register_jitable
def to_work(src, dest, dest_t, m, dv):
    """dest[:m, :dv] = src (float64 (m, dv)) and dest_t[:dv, :m] its transpose, in the work dtype."""
    for r in range(m):
        for c in range(dv):
            x = src[r, c]
            dest[r, c] = x
            dest_t[c, r] = x


@njit(nogil=True, **KERNEL_JIT)
def linear_backward_tasks(q, k, v, go, dq, dk, dv, geo, cos, sin, rows, state_s, state_z, grad_s, grad_z, d_s, d_z,
                          seq_len, half, rotary_dim, interleaved, causal, feature_map, eps, chunk, groups, powers,
                          decayed, normalize, first, last):
    """Tasks first..last-1 (task = b * Hk + hk) of the backward; see the module docstring. q, k, v, go, dq, dk, dv:
    flat buffers (float16 as uint16 bits) with their (7, 5) int64 geometry rows (offset, sB, sS, sH, sD) in that
    order; cos, sin work dtype; rows (1 or B, T) int64; state_s, state_z, grad_s, grad_z (B, Hk, m, dv) / (B, Hk, m)
    and d_s, d_z (written) work dtype; powers float64 (B, Hk, chunk + 1) (read when ``decayed``)."""
    n_heads, m, dvd = state_s.shape[1], state_s.shape[2], state_s.shape[3]
    keep = (q, k, v, go, dq, dk, dv, geo, cos, sin, rows, state_s, state_z, grad_s, grad_z, d_s, d_z, powers)
    q, k, v, go, dq, dk, dv = borrowed(q), borrowed(k), borrowed(v), borrowed(go), borrowed(dq), borrowed(dk), \
        borrowed(dv)
    geo, cos, sin, rows = borrowed(geo), borrowed(cos), borrowed(sin), borrowed(rows)
    work = cos.dtype
    width = tile_width(cos[0])
    cp, mw, dvw = padded(chunk, width), padded(m, width), padded(dvd, width)
    n_chunks = (seq_len + chunk - 1) // chunk
    saved_n = n_chunks if causal else 1
    # work-dtype chunk buffers, padded to whole tiles (2-D, 64-byte aligned: the forward's aligned_zeros)
    kf_o, k_rows_o, k_hat_t_o = aligned_zeros(cp, m, work), aligned_zeros(cp, m, work), aligned_zeros(mw, cp, work)
    kh_o, kw_o = aligned_zeros(cp, mw, work), aligned_zeros(cp, m, work)
    vals_o, vt_o, vw_o = aligned_zeros(cp, dvw, work), aligned_zeros(dvw, cp, work), aligned_zeros(cp, dvw, work)
    qf_o, q_rows_o, q_hat_t_o = aligned_zeros(cp, m, work), aligned_zeros(cp, m, work), aligned_zeros(mw, cp, work)
    qh_o, gn_o, gns_o = aligned_zeros(cp, mw, work), aligned_zeros(cp, dvw, work), aligned_zeros(cp, dvw, work)
    w_o, wt_o, pt_o = aligned_zeros(cp, cp, work), aligned_zeros(cp + 1, cp, work), aligned_zeros(cp + 1, cp, work)
    x_o, dkh_o, dvv_o = aligned_zeros(cp, mw, work), aligned_zeros(cp, mw, work), aligned_zeros(cp, dvw, work)
    s_chunk_o, p_add_o = aligned_zeros(mw, dvw, work), aligned_zeros(mw, dvw, work)
    p_work_o, p_t_o = aligned_zeros(mw, dvw, work), aligned_zeros(dvw, mw, work)
    ur_o, gdot_o = aligned_zeros(1, mw, work), aligned_zeros(1, cp, work)
    saved_o = aligned_zeros(saved_n * dvw, mw, work)                 # S_in^T of every chunk (causal), or S^T
    pw_w_o, pw_rev_o = aligned_zeros(1, chunk + 1, work), aligned_zeros(1, chunk + 1, work)
    # float64: the carries, denominators, the z rows and the db rows of the reverse recurrence
    s64_o, p64_o = aligned_zeros(m, dvd, np.float64), aligned_zeros(m, dvd, np.float64)
    z_starts_o, z_rows_o = aligned_zeros(saved_n, m, np.float64), aligned_zeros(cp, m, np.float64)
    dbf_o, vec64_o = aligned_zeros(cp, m, np.float64), aligned_zeros(4, m, np.float64)   # z, Q, Q_add, recurrence
    rowv_o, pw_o = aligned_zeros(3, cp, np.float64), aligned_zeros(1, chunk + 1, np.float64)   # inv, gD, -
    kf, k_rows, k_hat_t, kh, kw = borrowed(kf_o), borrowed(k_rows_o), borrowed(k_hat_t_o), borrowed(kh_o), \
        borrowed(kw_o)
    vals, vt, vw = borrowed(vals_o), borrowed(vt_o), borrowed(vw_o)
    qf, q_rows, q_hat_t, qh = borrowed(qf_o), borrowed(q_rows_o), borrowed(q_hat_t_o), borrowed(qh_o)
    gn, gns, W, Wt, Pt = borrowed(gn_o), borrowed(gns_o), borrowed(w_o), borrowed(wt_o), borrowed(pt_o)
    X, dkh, dvv = borrowed(x_o), borrowed(dkh_o), borrowed(dvv_o)
    s_chunk, p_add, p_work, p_t = borrowed(s_chunk_o), borrowed(p_add_o), borrowed(p_work_o), borrowed(p_t_o)
    ur, gdot, saved = borrowed(ur_o), borrowed(gdot_o), borrowed(saved_o)
    pw_w, pw_rev, pw = borrowed(pw_w_o), borrowed(pw_rev_o), borrowed(pw_o)
    S64, P64, z_starts, z_rows = borrowed(s64_o), borrowed(p64_o), borrowed(z_starts_o), borrowed(z_rows_o)
    dbf, vec64, rowv = borrowed(dbf_o), borrowed(vec64_o), borrowed(rowv_o)
    zc, Q, q_add, rec = vec64[0], vec64[1], vec64[2], vec64[3]
    inv, gD = rowv[0], rowv[1]
    fresh, accumulate, as_columns = np.bool_(False), np.bool_(True), np.bool_(True)
    per_batch = rows.shape[0] > 1
    for task in range(first, last):
        b, hk = task // n_heads, task % n_heads
        rb = b if per_batch else 0
        for j in range(chunk + 1):
            pw[0, j] = powers[b, hk, j] if decayed else 1.0
            pw_w[0, j] = pw[0, j]
        for j in range(chunk + 1):
            pw_rev[0, j] = pw_w[0, chunk - j]
        gamma = pw[0, 1]
        for r in range(m):
            zc[r] = state_z[b, hk, r]
            Q[r] = grad_z[b, hk, r]
            for c in range(dvd):
                S64[r, c] = state_s[b, hk, r, c]
                P64[r, c] = grad_s[b, hk, r, c]
        # 1. the forward sweep: the state before each chunk (causal) or over every token
        for c in range(n_chunks):
            t0 = c * chunk
            n = imin(chunk, seq_len - t0)
            if causal:
                sv = saved[c * dvw:(c + 1) * dvw]
                for r in range(m):
                    z_starts[c, r] = zc[r]
                    for col in range(dvd):
                        sv[col, r] = S64[r, col]
            load_features(k, geo[1], b, hk, t0, n, cos, sin, rows, half, rotary_dim, interleaved, feature_map, kf,
                          k_rows, k_hat_t, as_columns, NO_NEXT_LOAD)
            load_values(v, geo[2], b, hk, t0, n, vals, dvd, NO_NEXT_LOAD)
            for i in range(n):
                if decayed:
                    for r in range(m):
                        zc[r] = zc[r] * gamma + kf[i, r]
                else:
                    for r in range(m):
                        zc[r] += kf[i, r]
            if decayed:
                for r in range(m):
                    for j in range(n):
                        k_hat_t[r, j] *= pw_w[0, n - 1 - j]
            product(k_hat_t, vals, s_chunk, 0, m, 0, dvd, n, fresh)
            keep_n = pw[0, n]
            for r in range(m):
                for col in range(dvd):
                    S64[r, col] = S64[r, col] * keep_n + s_chunk[r, col] if decayed else S64[r, col] + s_chunk[r, col]
        if not causal:
            for r in range(m):
                z_starts[0, r] = zc[r]
                for col in range(dvd):
                    saved[col, r] = S64[r, col]
        to_work(P64, p_work, p_t, m, dvd)
        if causal:
            # 2. the reverse sweep
            for c in range(n_chunks - 1, -1, -1):
                t0 = c * chunk
                n = imin(chunk, seq_len - t0)
                sv = saved[c * dvw:(c + 1) * dvw]
                load_features(k, geo[1], b, hk, t0, n, cos, sin, rows, half, rotary_dim, interleaved, feature_map,
                              kf, k_rows, k_hat_t, as_columns, NO_NEXT_LOAD)
                load_values(v, geo[2], b, hk, t0, n, vals, dvd, NO_NEXT_LOAD)
                transposed(vals, vt, n)
                for i in range(n):
                    w_i = pw_w[0, n - 1 - i]
                    for r in range(m):
                        kh[i, r] = k_rows[i, r]
                        if decayed:
                            kw[i, r] = k_rows[i, r] * w_i
                    if decayed:
                        for col in range(dvd):
                            vw[i, col] = vals[i, col] * w_i
                if normalize:
                    for r in range(m):
                        rec[r] = z_starts[c, r]
                    for i in range(n):
                        for r in range(m):
                            rec[r] = rec[r] * gamma + kf[i, r] if decayed else rec[r] + kf[i, r]
                            z_rows[i, r] = rec[r]
                for i in range(cp):
                    for r in range(mw):
                        dkh[i, r] = 0
                    for col in range(dvw):
                        dvv[i, col] = 0
                    for r in range(m):
                        dbf[i, r] = 0.0
                for r in range(m):
                    q_add[r] = 0.0
                for g in range(groups):
                    h = hk * groups + g
                    load_features(q, geo[0], b, h, t0, n, cos, sin, rows, half, rotary_dim, interleaved, feature_map,
                                  qf, q_rows, q_hat_t, as_columns, NO_NEXT_LOAD)
                    load_values(go, geo[3], b, h, t0, n, gn, dvd, NO_NEXT_LOAD)
                    for i in range(n):
                        for r in range(m):
                            qh[i, r] = q_rows[i, r]
                        if normalize:
                            den = eps
                            for r in range(m):
                                den += np.float64(qf[i, r]) * z_rows[i, r]
                            inv[i] = 1.0 / den
                            for col in range(dvd):
                                gn[i, col] = gn[i, col] * inv[i]
                    # W = tril(gN V^T) . Gamma, then W^T
                    for i0 in range(0, n, TILE_ROWS):
                        end = imin(i0 + TILE_ROWS, n)
                        for j0 in range(0, end, width):
                            madd_tile(gn, vt, W, i0, j0, dvd, fresh)
                        for i in range(i0, end):
                            for j in range(i + 1, end):
                                W[i, j] = 0
                            if decayed:
                                for j in range(i + 1):
                                    W[i, j] *= pw_rev[0, chunk - i + j]
                    transposed(W, Wt, n)
                    # Pt = triu(B̂ Â^T) (the decay after the gD sums, which pair it with the decayed W)
                    for j0 in range(0, n, TILE_ROWS):
                        for i0 in range(j0 - j0 % width, n, width):
                            madd_tile(k_rows, q_hat_t, Pt, j0, i0, m, fresh)
                        for j in range(j0, imin(j0 + TILE_ROWS, n)):
                            for i in range(j0, j):
                                Pt[j, i] = 0
                    # X = gamma^(i+1) gN S_in^T
                    product(gn, sv, X, 0, n, 0, m, dvd, fresh)
                    if decayed:
                        for i in range(n):
                            f = pw_w[0, i + 1]
                            for r in range(m):
                                X[i, r] *= f
                    if normalize:
                        for i in range(n):
                            gdot[0, i] = 0
                        for j in range(n):
                            for i in range(j, n):
                                gdot[0, i] += Pt[j, i] * Wt[j, i]
                        for i in range(n):
                            gD[i] = -(np.float64(dot_work(q_rows, i * m, X, i * mw, m)) + np.float64(gdot[0, i])) \
                                * inv[i]
                    if decayed:
                        for j in range(n):
                            for i in range(j, n):
                                Pt[j, i] *= pw_w[0, i - j]
                    # dÂ = X + W B̂ (the depth of each row block up to its last row), then dq
                    for i0 in range(0, n, TILE_ROWS):
                        end = imin(i0 + TILE_ROWS, n)
                        for j0 in range(0, m, width):
                            madd_tile(W, kh, X, i0, j0, end, accumulate)
                    for i in range(n):
                        unrotate_row(X, i, ur, cos, sin, rows[rb, t0 + i], half, rotary_dim, interleaved)
                        store_grad(dq, geo[4], b, t0 + i, h, ur, z_rows, i, gD[i] if normalize else 0.0, qf, i, m,
                                   feature_map)
                    # dB̂ += W^T Â, dV += Pt gN (the depth of each row block from its first row)
                    for j0 in range(0, n, TILE_ROWS):
                        wt_s, pt_s = shifted(Wt, j0, cp), shifted(Pt, j0, cp)
                        qh_s, gn_s = qh[j0:], gn[j0:]
                        for c0 in range(0, m, width):
                            madd_tile(wt_s, qh_s, dkh, j0, c0, n - j0, accumulate)
                        for c0 in range(0, dvd, width):
                            madd_tile(pt_s, gn_s, dvv, j0, c0, n - j0, accumulate)
                    # the reverse state's chunk terms
                    if decayed:
                        for i in range(n):
                            f = pw_w[0, i + 1]
                            for col in range(dvd):
                                gns[i, col] = gn[i, col] * f
                        product(q_hat_t, gns, p_add, 0, m, 0, dvd, n, accumulate if g > 0 else fresh)
                    else:
                        product(q_hat_t, gn, p_add, 0, m, 0, dvd, n, accumulate if g > 0 else fresh)
                    if normalize:
                        for r in range(m):
                            rec[r] = 0.0
                        for i in range(n - 1, -1, -1):
                            gd = gD[i]
                            f = pw[0, i + 1] * gd
                            for r in range(m):
                                a_r = np.float64(qf[i, r])
                                q_add[r] += f * a_r
                                rec[r] = rec[r] * gamma + gd * a_r if decayed else rec[r] + gd * a_r
                                dbf[i, r] += rec[r]
                # the later chunks' and the state out's terms, then dk, dv
                product(vw if decayed else vals, p_t, dkh, 0, n, 0, m, dvd, accumulate)
                product(kw if decayed else k_rows, p_work, dvv, 0, n, 0, dvd, m, accumulate)
                for j in range(n):
                    w_j = pw[0, n - 1 - j]
                    for r in range(m):
                        dbf[j, r] += w_j * Q[r]
                    unrotate_row(dkh, j, ur, cos, sin, rows[rb, t0 + j], half, rotary_dim, interleaved)
                    store_grad(dk, geo[5], b, t0 + j, hk, ur, dbf, j, 1.0, kf, j, m, feature_map)
                store_rows(dv, geo[6], b, t0, n, hk, dvv, dvd)
                keep_n = pw[0, n]
                for r in range(m):
                    Q[r] = Q[r] * keep_n + q_add[r]
                    for col in range(dvd):
                        P64[r, col] = P64[r, col] * keep_n + p_add[r, col]
                to_work(P64, p_work, p_t, m, dvd)
        else:
            # 2'. non-causal: dq and (P, Q) from the whole (S, z), then dk, dv from them
            for c in range(n_chunks):
                t0 = c * chunk
                n = imin(chunk, seq_len - t0)
                for r in range(m):
                    q_add[r] = 0.0
                for g in range(groups):
                    h = hk * groups + g
                    load_features(q, geo[0], b, h, t0, n, cos, sin, rows, half, rotary_dim, interleaved, feature_map,
                                  qf, q_rows, q_hat_t, as_columns, NO_NEXT_LOAD)
                    load_values(go, geo[3], b, h, t0, n, gn, dvd, NO_NEXT_LOAD)
                    if normalize:
                        for i in range(n):
                            den = eps
                            for r in range(m):
                                den += np.float64(qf[i, r]) * z_starts[0, r]
                            inv[i] = 1.0 / den
                            for col in range(dvd):
                                gn[i, col] = gn[i, col] * inv[i]
                    product(gn, saved, X, 0, n, 0, m, dvd, fresh)
                    for i in range(n):
                        gd = 0.0
                        if normalize:
                            gd = -np.float64(dot_work(q_rows, i * m, X, i * mw, m)) * inv[i]
                            for r in range(m):
                                q_add[r] += gd * np.float64(qf[i, r])
                        unrotate_row(X, i, ur, cos, sin, rows[rb, t0 + i], half, rotary_dim, interleaved)
                        store_grad(dq, geo[4], b, t0 + i, h, ur, z_starts, 0, gd, qf, i, m, feature_map)
                    product(q_hat_t, gn, p_add, 0, m, 0, dvd, n, accumulate if g > 0 else fresh)
                for r in range(m):
                    Q[r] += q_add[r]
                    for col in range(dvd):
                        P64[r, col] += p_add[r, col]
            to_work(P64, p_work, p_t, m, dvd)
            for c in range(n_chunks):
                t0 = c * chunk
                n = imin(chunk, seq_len - t0)
                load_features(k, geo[1], b, hk, t0, n, cos, sin, rows, half, rotary_dim, interleaved, feature_map,
                              kf, k_rows, k_hat_t, as_columns, NO_NEXT_LOAD)
                load_values(v, geo[2], b, hk, t0, n, vals, dvd, NO_NEXT_LOAD)
                product(vals, p_t, dkh, 0, n, 0, m, dvd, fresh)
                product(k_rows, p_work, dvv, 0, n, 0, dvd, m, fresh)
                for j in range(n):
                    for r in range(m):
                        dbf[j, r] = Q[r]
                    unrotate_row(dkh, j, ur, cos, sin, rows[rb, t0 + j], half, rotary_dim, interleaved)
                    store_grad(dk, geo[5], b, t0 + j, hk, ur, dbf, j, 1.0, kf, j, m, feature_map)
                store_rows(dv, geo[6], b, t0, n, hk, dvv, dvd)
        for r in range(m):
            d_z[b, hk, r] = Q[r]
            for col in range(dvd):
                d_s[b, hk, r, col] = P64[r, col]
    keep_alive((kf_o, k_rows_o, k_hat_t_o, kh_o, kw_o, vals_o, vt_o, vw_o, qf_o, q_rows_o, q_hat_t_o, qh_o, gn_o,
                gns_o, w_o, wt_o, pt_o, x_o, dkh_o, dvv_o, s_chunk_o, p_add_o, p_work_o, p_t_o, ur_o, gdot_o,
                saved_o, pw_w_o, pw_rev_o, s64_o, p64_o, z_starts_o, z_rows_o, dbf_o, vec64_o, rowv_o, pw_o, keep))


# -- the backend's primitive ---------------------------------------------------------------------------------
def linear_attention_backward(q, k, v, cos, sin, rows, grad_o, *, rotary_dim, layout, causal, feature_map, eps, chunk,
                              state, decay=None, normalize=True, grad_state=None):
    """(dq, dk, dv, dstate) of the ``linear_attention`` primitive (contract in ``rotary.backends``) by
    :func:`linear_backward_tasks`: one task per (batch row, k/v head) on the backend's thread pool; q, k, v,
    grad_o read where they lie (any strides, float16 as its bits), dq, dk, dv written in their dtypes."""
    from .. import numba_runtime as _runtime
    from ..numpy_linear import decay_powers

    if feature_map not in FEATURE_MAPS:
        raise ValueError(f"feature_map must be one of {tuple(FEATURE_MAPS)}, got {feature_map!r}")
    B, T, H, m = q.shape
    Hk, dvd = k.shape[2], v.shape[3]
    if Hk == 0 or H % Hk:
        raise ValueError(f"q's heads ({H}) must be a multiple of k's ({Hk})")
    if tuple(grad_o.shape) != (B, T, H, dvd):
        raise ValueError(f"grad_o must have o's shape {(B, T, H, dvd)}, got {tuple(grad_o.shape)}")
    decayed = decay is not None and bool(np.any(np.asarray(decay) != 1))
    if decayed and not causal:
        raise ValueError("decay < 1 needs causal=True (as the forward)")
    work = np.float64 if q.dtype == np.float64 else np.float32

    def state_arg(x, shape):
        if x is None:
            return _runtime.readonly_c(np.zeros(shape, work))
        return _runtime.readonly_c(np.ascontiguousarray(np.asarray(x).reshape(shape), dtype=work))

    S0, z0 = (None, None) if state is None else state
    gS, gz = (None, None) if grad_state is None else grad_state
    s_shape, z_shape = (B, Hk, m, dvd), (B, Hk, m)
    args_state = (state_arg(S0, s_shape), state_arg(z0, z_shape), state_arg(gS, s_shape), state_arg(gz, z_shape))
    dq, dk, dv = np.empty((B, T, H, m), q.dtype), np.empty((B, T, Hk, m), k.dtype), np.empty((B, T, Hk, dvd), v.dtype)
    d_s, d_z = np.empty(s_shape, work), np.empty(z_shape, work)
    step = max(1, min(int(chunk), T)) if T else 1
    if B * Hk and T:
        cos = _runtime.readonly_c(cos if cos.dtype == work else np.asarray(cos, work))
        sin = _runtime.readonly_c(sin if sin.dtype == work else np.asarray(sin, work))
        rows = _runtime.readonly_c(np.asarray(rows, np.int64))
        powers = _runtime.readonly(decay_powers(np.asarray(decay, np.float64), step)) if decayed else _NO_POWERS
        bufs, geo = _runtime.flat_buffers((q, k, v, grad_o, dq, dk, dv))
        for buf in bufs[:4]:
            buf.flags.writeable = False   # one compiled signature for read-only and writable inputs
        _runtime.run_tasks(linear_backward_tasks, (
            *bufs, geo, cos, sin, rows, *args_state, d_s, d_z, T, rotary_dim // 2, rotary_dim,
            layout == "interleaved", bool(causal), FEATURE_MAPS[feature_map], float(eps), step, H // Hk, powers,
            decayed, bool(normalize)), B * Hk)
    else:
        dq[...], dk[...], dv[...] = 0, 0, 0
        d_s[...], d_z[...] = args_state[2], args_state[3]
    dstate = None if state is None else (d_s, d_z)
    return dq, dk, dv, dstate


_NO_POWERS = np.ones((1, 1, 1))
_NO_POWERS.flags.writeable = False
