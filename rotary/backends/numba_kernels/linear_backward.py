"""The backward of linear attention with RoPE on the ``numba`` backend: the ``linear_attention_backward``
primitive (contract in ``rotary.backends``; formulas in :mod:`rotary.backends.numpy_linear_backward`).

One task per (batch row, k/v head) with its G q heads, ranges of tasks on the backend's thread pool
(:func:`rotary.backends.numba_runtime.run_tasks`, as the forward: a ``nogil`` kernel, no parfor to compile).
Causal, per task: a forward sweep over chunks of C tokens keeps the state (S, z) before each chunk (float64,
(T / C) m dv per task), then a reverse sweep per chunk, with a = phi(q), b = phi(k), hats rotated, gamma^j the
decay's powers (exponents 0..C only)::

    z_i = gamma^(i+1) z_in + sum_{j<=i} gamma^(i-j) b_j        N_i = gamma^(i+1) â_i S_in + sum_{j<=i} P_ij v_j
    P_ij = gamma^(i-j) â_i . b̂_j,   gN_i = g_i / (a_i . z_i + eps),   gD_i = -(gN_i . N_i) / (a_i . z_i + eps)
    W_ij = gamma^(i-j) gN_i . v_j   (j <= i)
    dâ_i = gamma^(i+1) S_in gN_i + sum_j W_ij b̂_j          da_i = R_i^T dâ_i + gD_i z_i           dq = phi'(q) da
    db̂_j = sum_h sum_i W_ij â_i + gamma^(n-1-j) P v_j
    db_j = R_j^T db̂_j + sum_h sum_i gamma^(i-j) gD_i a_i + gamma^(n-1-j) Q
    dv_j = sum_h sum_i P_ij gN_i + gamma^(n-1-j) P^T b̂_j
    P <- gamma^n P + sum_h sum_i gamma^(i+1) â_i gN_i^T,     Q <- gamma^n Q + sum_h sum_i gamma^(i+1) gD_i a_i

(P, Q: the gradient at the state after the chunk, from ``grad_state`` on.) Non-causal: (S, z) over every
token, then dq per q head and (P, Q) summed, then dk, dv from them. Every product and sum is in float64
(buffers, carries): a first kernel written for correctness; the forward's register-tiled work-dtype
products are the speed work left (issue 45). Feature maps are :func:`.simd.feature` (the forward's bits),
phi'(x) = 1 for x > 0, else phi(x) for elu + 1 and 0 for relu.
"""

from __future__ import annotations


import numpy as np
from numba import njit
from numba.extending import register_jitable

from ..feature_maps import CODES as FEATURE_MAPS
from .simd import KERNEL_JIT, feature

_IDENTITY, _ELU = FEATURE_MAPS["identity"], FEATURE_MAPS["elu"]   # compile-time constants of the kernels


@register_jitable
def power(powers, b, hk, j, decayed):
    """gamma^j of task (b, hk) (float64 powers (B, Hk, C + 1)); 1 without decay."""
    return powers[b, hk, j] if decayed else 1.0


@register_jitable
def load_features(x, b, t0, n, h, cos, sin, rows, half, rotary_dim, interleaved, feature_map, phi, slope, hat):
    """Rows t0 .. t0+n-1 of x[b, :, h, :]: phi (float64), phi' and R_p phi into phi[:n], slope[:n], hat[:n]."""
    m = phi.shape[1]
    for i in range(n):
        for j in range(m):
            xv = x[b, t0 + i, h, j]
            f = feature(xv, feature_map)
            phi[i, j] = f
            if feature_map == _IDENTITY or xv > 0:
                slope[i, j] = 1.0
            elif feature_map == _ELU:
                slope[i, j] = f
            else:
                slope[i, j] = 0.0
        rotate_row(phi, i, hat, i, cos, sin, rows[b if rows.shape[0] > 1 else 0, t0 + i], half, rotary_dim,
                   interleaved, 1.0)


@register_jitable
def rotate_row(x, i, y, yi, cos, sin, row, half, rotary_dim, interleaved, sign):
    """y[yi] = R x[i] with table row ``row`` (sign = -1: R^T, the sine negated): pairs (p, p + half) or
    (2p, 2p + 1), ``y_a = x_a c - x_b s``, ``y_b = x_b c + x_a s``; features past rotary_dim copied."""
    step, second = (2, 1) if interleaved else (1, half)
    for p in range(half):
        c, s = cos[row, p], sign * sin[row, p]
        a = p * step
        xa, xb = x[i, a], x[i, a + second]
        y[yi, a] = xa * c - xb * s
        y[yi, a + second] = xb * c + xa * s
    for j in range(rotary_dim, x.shape[1]):
        y[yi, j] = x[i, j]


@njit(nogil=True, **KERNEL_JIT)
def linear_backward_tasks(q, k, v, go, cos, sin, rows, state_s, state_z, grad_s, grad_z, dq, dk, dv, d_s, d_z,
                          half, rotary_dim, interleaved, causal, feature_map, eps, chunk, groups, powers, decayed,
                          normalize, first, last):
    """Tasks first..last-1 (task = b * Hk + hk) of the backward; see the module docstring. q, k, v, go: C-contiguous
    (B, T, H or Hk, m or dv) float32/float64; dq, dk, dv float64 of their shapes; state_s, state_z, grad_s, grad_z,
    d_s, d_z float64 (B, Hk, m, dv) / (B, Hk, m); powers float64 (B, Hk, chunk + 1) (read when ``decayed``)."""
    B, T, H, m = q.shape
    Hk, dvd = k.shape[2], v.shape[3]
    n_chunks = (T + chunk - 1) // chunk
    bf, bsl, bh = np.zeros((chunk, m)), np.zeros((chunk, m)), np.zeros((chunk, m))
    af, asl, ah = np.zeros((chunk, m)), np.zeros((chunk, m)), np.zeros((chunk, m))
    vc, gN, num = np.zeros((chunk, dvd)), np.zeros((chunk, dvd)), np.zeros((chunk, dvd))
    gD = np.zeros(chunk)
    z_rows = np.zeros((chunk, m))
    scores, W = np.zeros((chunk, chunk)), np.zeros((chunk, chunk))
    dah, dbh, dbf, tmp = np.zeros((chunk, m)), np.zeros((chunk, m)), np.zeros((chunk, m)), np.zeros((1, m))
    dvc = np.zeros((chunk, dvd))
    S_starts = np.zeros((n_chunks if causal else 1, m, dvd))
    z_starts = np.zeros((n_chunks if causal else 1, m))
    S, z = np.zeros((m, dvd)), np.zeros(m)
    P, Q, P_add, Q_add = np.zeros((m, dvd)), np.zeros(m), np.zeros((m, dvd)), np.zeros(m)
    for task in range(first, last):
        b, hk = task // Hk, task % Hk
        S[:, :] = state_s[b, hk]
        z[:] = state_z[b, hk]
        P[:, :] = grad_s[b, hk]
        Q[:] = grad_z[b, hk]
        for c in range(n_chunks):                                   # the state before each chunk / over all
            t0 = c * chunk
            n = min(chunk, T - t0)
            if causal:
                S_starts[c] = S
                z_starts[c] = z
            load_features(k, b, t0, n, hk, cos, sin, rows, half, rotary_dim, interleaved, feature_map, bf, bsl, bh)
            keep = power(powers, b, hk, n, decayed) if causal else 1.0
            for r in range(m):
                z[r] *= keep
                for col in range(dvd):
                    S[r, col] *= keep
            for j in range(n):
                w = power(powers, b, hk, n - 1 - j, decayed) if causal else 1.0
                for r in range(m):
                    x = w * bh[j, r]
                    z[r] += w * bf[j, r]
                    for col in range(dvd):
                        S[r, col] += x * v[b, t0 + j, hk, col]
        if not causal:
            for g in range(groups):                                 # queries: dq and (P, Q)
                h = hk * groups + g
                for c in range(n_chunks):
                    t0 = c * chunk
                    n = min(chunk, T - t0)
                    load_features(q, b, t0, n, h, cos, sin, rows, half, rotary_dim, interleaved, feature_map, af,
                                  asl, ah)
                    for i in range(n):
                        t = t0 + i
                        den, gd = 1.0, 0.0
                        if normalize:
                            den = eps
                            for r in range(m):
                                den += af[i, r] * z[r]
                            for col in range(dvd):
                                acc = 0.0
                                for r in range(m):
                                    acc += ah[i, r] * S[r, col]
                                gd -= go[b, t, h, col] * acc
                            gd /= den * den
                        for col in range(dvd):
                            gN[i, col] = go[b, t, h, col] / den
                        for r in range(m):
                            acc = 0.0
                            for col in range(dvd):
                                acc += S[r, col] * gN[i, col]
                                P[r, col] += ah[i, r] * gN[i, col]
                            dah[i, r] = acc
                            Q[r] += gd * af[i, r]
                        rotate_row(dah, i, tmp, 0, cos, sin, rows[b if rows.shape[0] > 1 else 0, t], half, rotary_dim,
                                   interleaved, -1.0)
                        for r in range(m):
                            dq[b, t, h, r] = (tmp[0, r] + gd * z[r]) * asl[i, r]
            for c in range(n_chunks):                               # keys and values from (P, Q)
                t0 = c * chunk
                n = min(chunk, T - t0)
                load_features(k, b, t0, n, hk, cos, sin, rows, half, rotary_dim, interleaved, feature_map, bf, bsl,
                              bh)
                for j in range(n):
                    t = t0 + j
                    for r in range(m):
                        acc = 0.0
                        for col in range(dvd):
                            acc += P[r, col] * v[b, t, hk, col]
                        dbh[j, r] = acc
                    for col in range(dvd):
                        acc = 0.0
                        for r in range(m):
                            acc += P[r, col] * bh[j, r]
                        dv[b, t, hk, col] = acc
                    rotate_row(dbh, j, tmp, 0, cos, sin, rows[b if rows.shape[0] > 1 else 0, t], half, rotary_dim,
                               interleaved, -1.0)
                    for r in range(m):
                        dk[b, t, hk, r] = (tmp[0, r] + Q[r]) * bsl[j, r]
        else:
            for c in range(n_chunks - 1, -1, -1):
                t0 = c * chunk
                n = min(chunk, T - t0)
                S_in, z_in = S_starts[c], z_starts[c]
                load_features(k, b, t0, n, hk, cos, sin, rows, half, rotary_dim, interleaved, feature_map, bf, bsl,
                              bh)
                for j in range(n):
                    for col in range(dvd):
                        vc[j, col] = v[b, t0 + j, hk, col]
                        dvc[j, col] = 0.0
                    for r in range(m):
                        dbh[j, r] = 0.0
                        dbf[j, r] = 0.0
                P_add[:, :] = 0.0
                Q_add[:] = 0.0
                if normalize:
                    for i in range(n):
                        for r in range(m):
                            acc = power(powers, b, hk, i + 1, decayed) * z_in[r]
                            for j in range(i + 1):
                                acc += power(powers, b, hk, i - j, decayed) * bf[j, r]
                            z_rows[i, r] = acc
                for g in range(groups):
                    h = hk * groups + g
                    load_features(q, b, t0, n, h, cos, sin, rows, half, rotary_dim, interleaved, feature_map, af,
                                  asl, ah)
                    for i in range(n):
                        inter = power(powers, b, hk, i + 1, decayed)
                        for j in range(i + 1):
                            acc = 0.0
                            for r in range(m):
                                acc += ah[i, r] * bh[j, r]
                            scores[i, j] = acc * power(powers, b, hk, i - j, decayed)
                        for col in range(dvd):
                            acc = 0.0
                            for r in range(m):
                                acc += ah[i, r] * S_in[r, col]
                            acc *= inter
                            for j in range(i + 1):
                                acc += scores[i, j] * vc[j, col]
                            num[i, col] = acc
                        den, gd = 1.0, 0.0
                        if normalize:
                            den = eps
                            for r in range(m):
                                den += af[i, r] * z_rows[i, r]
                        for col in range(dvd):
                            gN[i, col] = go[b, t0 + i, h, col] / den
                            gd -= gN[i, col] * num[i, col]
                        gD[i] = gd / den if normalize else 0.0
                        for j in range(i + 1):
                            acc = 0.0
                            for col in range(dvd):
                                acc += gN[i, col] * vc[j, col]
                            W[i, j] = acc * power(powers, b, hk, i - j, decayed)
                        for r in range(m):
                            acc = 0.0
                            for col in range(dvd):
                                acc += S_in[r, col] * gN[i, col]
                                P_add[r, col] += inter * ah[i, r] * gN[i, col]
                            acc *= inter
                            for j in range(i + 1):
                                acc += W[i, j] * bh[j, r]
                            dah[i, r] = acc
                            Q_add[r] += inter * gD[i] * af[i, r]
                        rotate_row(dah, i, tmp, 0, cos, sin, rows[b if rows.shape[0] > 1 else 0, t0 + i], half,
                                   rotary_dim, interleaved, -1.0)
                        for r in range(m):
                            dq[b, t0 + i, h, r] = (tmp[0, r] + gD[i] * z_rows[i, r]) * asl[i, r]
                    for j in range(n):
                        for i in range(j, n):
                            w, s = W[i, j], scores[i, j]
                            wd = power(powers, b, hk, i - j, decayed) * gD[i]
                            for r in range(m):
                                dbh[j, r] += w * ah[i, r]
                                dbf[j, r] += wd * af[i, r]
                            for col in range(dvd):
                                dvc[j, col] += s * gN[i, col]
                keep = power(powers, b, hk, n, decayed)
                for j in range(n):                                  # the later chunks' and the state out's terms
                    w = power(powers, b, hk, n - 1 - j, decayed)
                    for r in range(m):
                        acc = 0.0
                        for col in range(dvd):
                            acc += P[r, col] * vc[j, col]
                        dbh[j, r] += w * acc
                        dbf[j, r] += w * Q[r]
                    for col in range(dvd):
                        acc = 0.0
                        for r in range(m):
                            acc += P[r, col] * bh[j, r]
                        dv[b, t0 + j, hk, col] = dvc[j, col] + w * acc
                    rotate_row(dbh, j, tmp, 0, cos, sin, rows[b if rows.shape[0] > 1 else 0, t0 + j], half, rotary_dim,
                               interleaved, -1.0)
                    for r in range(m):
                        dk[b, t0 + j, hk, r] = (tmp[0, r] + dbf[j, r]) * bsl[j, r]
                for r in range(m):
                    Q[r] = keep * Q[r] + Q_add[r]
                    for col in range(dvd):
                        P[r, col] = keep * P[r, col] + P_add[r, col]
        d_s[b, hk] = P
        d_z[b, hk] = Q


# -- the backend's primitive ---------------------------------------------------------------------------------
def linear_attention_backward(q, k, v, cos, sin, rows, grad_o, *, rotary_dim, layout, causal, feature_map, eps, chunk,
                              state, decay=None, normalize=True, grad_state=None):
    """(dq, dk, dv, dstate) of the ``linear_attention`` primitive (contract in ``rotary.backends``) by
    :func:`linear_backward_tasks`: one task per (batch row, k/v head) on the backend's thread pool."""
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

    def data(x):
        return _runtime.readonly_c(x if x.dtype == work else x.astype(work))

    def state64(x, shape):
        return _runtime.readonly_c(np.zeros(shape) if x is None else np.asarray(x, np.float64).reshape(shape))

    qc, kc, vc, gc = data(q), data(k), data(v), data(grad_o)
    cos64, sin64 = _runtime.readonly_c(np.asarray(cos, np.float64)), _runtime.readonly_c(np.asarray(sin, np.float64))
    rows = _runtime.readonly_c(np.asarray(rows, np.int64))
    S0, z0 = (None, None) if state is None else state
    gS, gz = (None, None) if grad_state is None else grad_state
    s_shape, z_shape = (B, Hk, m, dvd), (B, Hk, m)
    args_state = (state64(S0, s_shape), state64(z0, z_shape), state64(gS, s_shape), state64(gz, z_shape))
    dq, dk, dv = np.zeros((B, T, H, m)), np.zeros((B, T, Hk, m)), np.zeros((B, T, Hk, dvd))
    d_s, d_z = np.zeros(s_shape), np.zeros(z_shape)
    step = max(1, min(int(chunk), T)) if T else 1
    powers = _runtime.readonly(decay_powers(np.asarray(decay, np.float64), step)) if decayed else _NO_POWERS
    if B * Hk and T:
        _runtime.run_tasks(linear_backward_tasks, (
            qc, kc, vc, gc, cos64, sin64, rows, *args_state, dq, dk, dv, d_s, d_z, rotary_dim // 2, rotary_dim,
            layout == "interleaved", bool(causal), FEATURE_MAPS[feature_map], float(eps), step, H // Hk, powers,
            decayed, bool(normalize)), B * Hk)
    elif B * Hk:
        d_s[...], d_z[...] = args_state[2], args_state[3]
    dstate = None if state is None else (d_s.astype(work, copy=False), d_z.astype(work, copy=False))
    return dq.astype(q.dtype, copy=False), dk.astype(k.dtype, copy=False), dv.astype(v.dtype, copy=False), dstate


_NO_POWERS = np.ones((1, 1, 1))
_NO_POWERS.flags.writeable = False
