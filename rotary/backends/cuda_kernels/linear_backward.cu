// linear_backward.cu -- the backward of linear attention with RoPE in the numerator (linear_attention.cu's
// forward; formulas and the NumPy reference in rotary/backends/numpy_linear_backward.py).
//
// a = phi(q), b = phi(k), â = R a, b̂ = R b, gamma the head's decay (1 without), (S0, z0) the carried state,
// (G_S, G_z) the gradient at the state out, g = dL/do. Per (batch, k/v head), q head h of its group:
//     gN_t = g_t / (a_t . z_t + eps)     gD_t = -(gN_t . N_t) / (a_t . z_t + eps)   (normalize = 0: gN = g, gD = 0)
//     P = dL/dS (reverse state, from G_S),  Q = dL/dz (from G_z)
//     dâ_t = S_t gN_t   da_t = R_t^T dâ_t + gD_t z_t   dq = phi'(q) da
//     db̂_s = P_s v_s    db_s = R_s^T db̂_s + Q_s        dk = phi'(k) db     dv_s = P_s^T b̂_s
//     dS0 = gamma P_0,  dz0 = gamma Q_0   (sums over the G q heads of the group for k, v, P, Q)
//
// Two kernels, launched one after the other (rotary.backends.cupy.plan_linear_attention_backward):
//
// linear_backward_chunked: one block per (batch, k/v head, dv tile of width dv_tile), chunks of `chunk` tokens.
//   1. forward sweep: the state S (m x tile) and z before each chunk, saved to s_saved / z_saved (global, W):
//          S <- gamma^L S + (B̂ . gamma^(L-1-j))^T V,   z <- the decayed recurrence z_t = gamma z_(t-1) + b_t
//   2. reverse sweep, chunks from the last, P (m x tile, from G_S) the gradient at the state after the chunk:
//          Zr_t = gamma Zr_(t-1) + b_t (from z_in)                        dB = (V . gamma^(L-1-j)) P^T
//          dV = (B̂ . gamma^(L-1-j)) P                                     P <- gamma^L P
//          per q head: gN = G / (A . Zr + eps)   X = gamma^(i+1) gN S_in^T   Wr = tril(gN V^T)
//                      Sc = tril(Â B̂^T) . Gamma    gdot_i = Â_i . X_i + sum_j Sc_ij Wr_ij (= gN_i . N_i, this tile's
//                      columns)   W = Wr . Gamma   dÂ = X + W B̂   dB += W^T Â   dV += Sc^T gN
//                      P += Â^T (gamma^(i+1) gN)
//      (Gamma_ij = gamma^(i-j), j <= i.) dV is this tile's columns of dv (written); dÂ, dB and gdot are sums over
//      dv, so each tile writes its part (dA_part, dB_part, gdot_part: one slice per tile, no atomics) and tile 0
//      the denominators a . z (den_out); dS0 = P at the end.
//   non-causal: S, z over all tokens, then per q head and chunk X = gN S^T = dÂ, gdot = Â . X, P += Â^T gN; then
//      dB = V P^T, dV = B̂ P per chunk.
//   Shared memory (W elements, rotary.backends.cupy.linear_backward_shared_bytes):
//      A, B, X, dB, Zr: chunk x mp | V, G, dV: chunk x dtp | S, P: m x dtp | Sc, W: chunk x (chunk + 1) |
//      den, gdot: chunk | z: m | pw: chunk + 1            (mp = m | 1, dtp = dv_tile | 1)
//
// linear_backward_finish: one block per (batch, k/v head), chunks of `chunk` tokens (its own chunk), summing the
//   tiles' parts: gD_t = -(sum gdot) / (den_t + eps) (kept in gD_buf), dq = phi'(q) (R^T sum dA_part + gD z_t)
//   with z_t recomputed (a per-feature recurrence over the chunk's rows of phi(k) in shared memory); then chunks
//   from the last: U_t = sum_h gD_t a_t, the reverse recurrence R_t = U_t + gamma R_(t+1) from G_z (Q_s = R_s,
//   dz0 = gamma R_0), dk = phi'(k) (R^T sum dB_part + R_t). Non-causal: z over every token,
//   Q = G_z + sum_t U_t for every s, dz0 = Q.
//   Shared memory: Zr / U: chunk x mp, z / Q: m.
//
// Inputs are read-only; every buffer the finish kernel reads is written by the chunked kernel first. Products are
// linear_attention.cu's register tiles (mma_tile; 4x4, or 2x2 when that leaves threads idle), the pair rotation is
// rotary_common.cuh's rotate_pair (R^T: the table's sine negated).
#include "rotary_common.cuh"
#include "linear_attention.cu"

// out(i, j) = sum_k X[i*xr + k*xk] Y[k*yk + j*yc] for i < nr, j < nc, handed to epi(i, j, value). TRI 0: k < K;
// 1: k <= i (and k < K; the CAUSAL skip of mma_tile); 2: k >= the first row of i's tile (the terms between it and i
// must be zeros of X: an upper-triangular product whose X holds zeros below the diagonal).
template <int TILE, int TRI, typename W, typename F>
ROTARY_FN void lb_tiles(const W* X, int xr, int xk, const W* Y, int yk, int yc, int nr, int nc, int K, F epi,
                        int tid, int nthreads) {
    const int tr = (nr + TILE - 1) / TILE, tc = (nc + TILE - 1) / TILE;
    for (int tile = tid; tile < tr * tc; tile += nthreads) {
        const int r = (tile / tc) * TILE, c = (tile % tc) * TILE;
        W acc[TILE][TILE];
        zero_tile<TILE>(acc);
        if constexpr (TRI == 1)
            mma_tile<TILE, W, true>(acc, X, xr, xk, Y, yk, yc, r, c, nr, nc, imin(K, r + TILE));
        else if constexpr (TRI == 2)
            mma_tile<TILE, W>(acc, X + r * xk, xr, xk, Y + r * yk, yk, yc, r, c, nr, nc, K - r);
        else
            mma_tile<TILE, W>(acc, X, xr, xk, Y, yk, yc, r, c, nr, nc, K);
#pragma unroll
        for (int i = 0; i < TILE; ++i)
#pragma unroll
            for (int j = 0; j < TILE; ++j)
                if (r + i < nr && c + j < nc) epi(r + i, c + j, acc[i][j]);
    }
}

template <int TRI, typename W, typename F>
ROTARY_FN void lb_product(const W* X, int xr, int xk, const W* Y, int yk, int yc, int nr, int nc, int K, F epi,
                          int tid, int nthreads) {
    if (wide_tiles(((nr + 3) / 4) * ((nc + 3) / 4), nthreads))
        lb_tiles<4, TRI>(X, xr, xk, Y, yk, yc, nr, nc, K, epi, tid, nthreads);
    else
        lb_tiles<2, TRI>(X, xr, xk, Y, yk, yc, nr, nc, K, epi, tid, nthreads);
}

// causal_scores (linear_attention.cu) with the tile width chosen as there
template <typename W>
ROTARY_FN void lb_scores(W* P, int pp, const W* A, const W* B, int stride, int L, int m, const W* pw, int tid,
                         int nthreads) {
    const int nt4 = (L + 3) / 4;
    if (wide_tiles(nt4 * nt4, nthreads))
        causal_scores<4>(P, pp, A, B, stride, L, m, pw, tid, nthreads);
    else
        causal_scores<2>(P, pp, A, B, stride, L, m, pw, tid, nthreads);
}

// phi'(x) = d phi / dx: identity 1; elu + 1: 1 for x > 0, else phi(x); relu: [x > 0] (NaN: elu NaN, relu 0)
template <typename W> ROTARY_FN W feature_slope(W x, int feature_map) {
    if (feature_map == 0 || x > W(0)) return W(1);
    return feature_map == 2 ? W(0) : feature<W>(x, feature_map);
}

// features of unit u of a row: u < half, the pair (ia, ib) of the layout; else the unrotated feature ia
// (ib = -1) rotary_dim + u - half
ROTARY_FN void unit_features(int u, int half, int rotary_dim, int interleaved, int& ia, int& ib) {
    if (u < half) {
        ia = interleaved ? 2 * u : u;
        ib = interleaved ? 2 * u + 1 : u + half;
    } else {
        ia = rotary_dim + u - half;
        ib = -1;
    }
}

template <typename T, typename W>
__global__ void linear_backward_chunked(
    const T* q, i64 qsb, i64 qss, i64 qsh, i64 qsd,
    const T* k, i64 ksb, i64 kss, i64 ksh, i64 ksd,
    const T* v, i64 vsb, i64 vss, i64 vsh, i64 vsd,
    const T* go, i64 gsb, i64 gss, i64 gsh, i64 gsd,
    T* dv_out, i64 dsb, i64 dss, i64 dsh, i64 dsd,
    const W* state_s, const W* z_in, const W* grad_s, W* d_state_s,
    W* s_saved, W* z_saved, W* dA_part, W* dB_part, W* gdot_part, W* den_out,
    const W* cos_table, const W* sin_table, const i64* rows, int rows_batched,
    i64 seq_len, int n_batch, int n_heads, int groups, int m, int dv, int rotary_dim, int interleaved, int causal,
    int feature_map, W eps, int chunk, int dv_tile, const W* powers, int powers_stride, int decayed, int normalize) {
    ROTARY_DYNAMIC_SMEM(smem);
    const int mp = m | 1, dtp = dv_tile | 1, pp = chunk + 1, half = rotary_dim / 2;
    W* A = reinterpret_cast<W*>(smem);
    W* B = A + chunk * mp;
    W* X = B + chunk * mp;
    W* DB = X + chunk * mp;
    W* Zr = DB + chunk * mp;
    W* Vs = Zr + chunk * mp;
    W* G = Vs + chunk * dtp;
    W* DV = G + chunk * dtp;
    W* S = DV + chunk * dtp;
    W* P = S + m * dtp;
    W* Sc = P + m * dtp;
    W* Wm = Sc + chunk * pp;
    W* den = Wm + chunk * pp;
    W* gd = den + chunk;
    W* z = gd + chunk;
    W* pw = z + m;
    const int tid = threadIdx.x, nthreads = blockDim.x;
    const int n_tiles = (dv + dv_tile - 1) / dv_tile;
    const int tile = blockIdx.x % n_tiles;
    const i64 bh = blockIdx.x / n_tiles;  // (batch, k/v head)
    const i64 b = bh / n_heads;
    const int hk = (int)(bh - b * n_heads);
    const int n_q = n_heads * groups;
    const int c_lo = tile * dv_tile;
    const int width = imin(dv_tile, dv - c_lo);
    const i64 n_chunks = (seq_len + chunk - 1) / chunk;
    const i64* row_base = rows + (rows_batched ? b * seq_len : 0);
    const W* dpw = decayed ? pw : nullptr;
    // this tile's slice of the parts: (tile, b, t, head, .)
    W* dA_t = dA_part + (i64)tile * n_batch * seq_len * n_q * m;
    W* dB_t = dB_part + (i64)tile * n_batch * seq_len * n_heads * m;
    W* gd_t = gdot_part + (i64)tile * n_batch * seq_len * n_q;
    W* zs = z_saved + (bh * n_tiles + tile) * n_chunks * m;

    for (int e = tid; e < m * width; e += nthreads) {
        const int j = e / width, c = e - j * width;
        S[j * dtp + c] = state_s[bh * m * dv + (i64)j * dv + c_lo + c];
        P[j * dtp + c] = grad_s[bh * m * dv + (i64)j * dv + c_lo + c];
    }
    for (int j = tid; j < m; j += nthreads) z[j] = z_in[bh * m + j];
    for (int j = tid; j <= chunk; j += nthreads) pw[j] = decayed ? powers[bh * powers_stride + j] : W(1);
    __syncthreads();
    const W gamma = pw[1];
    const T* kb = k + b * ksb + hk * ksh;
    const T* vb = v + b * vsb + hk * vsh + c_lo * vsd;

    // 1. forward sweep: the state before each chunk (causal, saved), or over every token (non-causal)
    for (i64 cc = 0; cc < n_chunks; ++cc) {
        const i64 c0 = cc * chunk;
        const int L = (int)(seq_len - c0 < chunk ? seq_len - c0 : chunk);
        if (causal) {
            W* sv = s_saved + (bh * n_chunks + cc) * m * dv + c_lo;
            for (int e = tid; e < m * width; e += nthreads) {
                const int j = e / width, c = e - j * width;
                sv[(i64)j * dv + c] = S[j * dtp + c];
            }
            for (int j = tid; j < m; j += nthreads) zs[cc * m + j] = z[j];
        }
        load_features<T, W>(B, mp, kb + c0 * kss, kss, ksd, L, m, feature_map, tid, nthreads);
        for (int e = tid; e < L * width; e += nthreads) {
            const int t = e / width, c = e - t * width;
            Vs[t * dtp + c] = (W)load_float(vb[(c0 + t) * vss + c * vsd]);
        }
        __syncthreads();
        for (int j = tid; j < m; j += nthreads) {
            W run = z[j];
            for (int t = 0; t < L; ++t) run = decayed ? run * gamma + B[t * mp + j] : run + B[t * mp + j];
            z[j] = run;
        }
        __syncthreads();
        rotate_rows(B, mp, L, half, interleaved, cos_table, sin_table, row_base + c0, tid, nthreads);
        __syncthreads();
        if (decayed) {
            for (int e = tid; e < L * m; e += nthreads) {
                const int t = e / m, j = e - t * m;
                B[t * mp + j] *= pw[L - 1 - t];
            }
            __syncthreads();
        }
        const W factor = decayed ? pw[L] : W(1);
        if (wide_tiles(((m + 3) / 4) * ((width + 3) / 4), nthreads))
            update_state<4>(S, dtp, B, mp, Vs, L, m, width, factor, tid, nthreads);
        else
            update_state<2>(S, dtp, B, mp, Vs, L, m, width, factor, tid, nthreads);
        __syncthreads();
    }

    if (causal) {
        // 2. reverse sweep
        for (i64 cc = n_chunks - 1; cc >= 0; --cc) {
            const i64 c0 = cc * chunk;
            const int L = (int)(seq_len - c0 < chunk ? seq_len - c0 : chunk);
            const W* sv = s_saved + (bh * n_chunks + cc) * m * dv + c_lo;
            for (int e = tid; e < m * width; e += nthreads) {
                const int j = e / width, c = e - j * width;
                S[j * dtp + c] = sv[(i64)j * dv + c];
            }
            for (int j = tid; j < m; j += nthreads) z[j] = zs[cc * m + j];
            load_features<T, W>(B, mp, kb + c0 * kss, kss, ksd, L, m, feature_map, tid, nthreads);
            for (int e = tid; e < L * width; e += nthreads) {
                const int t = e / width, c = e - t * width;
                Vs[t * dtp + c] = (W)load_float(vb[(c0 + t) * vss + c * vsd]);
            }
            __syncthreads();
            if (normalize)  // Zr_t: z after token t of the chunk
                for (int j = tid; j < m; j += nthreads) {
                    W run = z[j];
                    for (int t = 0; t < L; ++t) {
                        run = decayed ? run * gamma + B[t * mp + j] : run + B[t * mp + j];
                        Zr[t * mp + j] = run;
                    }
                }
            __syncthreads();
            rotate_rows(B, mp, L, half, interleaved, cos_table, sin_table, row_base + c0, tid, nthreads);
            __syncthreads();
            // the later chunks' and the state out's terms: dB = (gamma^(L-1-j) V) P^T, dV = (gamma^(L-1-j) B̂) P
            lb_product<0>(Vs, dtp, 1, P, 1, dtp, L, m, width,
                          [&](int j, int r, W x) { DB[j * mp + r] = decayed ? x * pw[L - 1 - j] : x; }, tid, nthreads);
            lb_product<0>(B, mp, 1, P, dtp, 1, L, width, m,
                          [&](int j, int c, W x) { DV[j * dtp + c] = decayed ? x * pw[L - 1 - j] : x; }, tid, nthreads);
            __syncthreads();
            if (decayed)
                for (int e = tid; e < m * width; e += nthreads) {
                    const int j = e / width, c = e - j * width;
                    P[j * dtp + c] *= pw[L];
                }
            for (int g = 0; g < groups; ++g) {
                const int h = hk * groups + g;
                load_features<T, W>(A, mp, q + b * qsb + h * qsh + c0 * qss, qss, qsd, L, m, feature_map, tid,
                                    nthreads);
                const T* gb = go + b * gsb + h * gsh + c_lo * gsd + c0 * gss;
                for (int e = tid; e < L * width; e += nthreads) {
                    const int t = e / width, c = e - t * width;
                    G[t * dtp + c] = (W)load_float(gb[t * gss + c * gsd]);
                }
                __syncthreads();
                if (normalize)
                    for (int t = tid; t < L; t += nthreads) {
                        W d = W(0);
                        for (int j = 0; j < m; ++j) d += A[t * mp + j] * Zr[t * mp + j];
                        den[t] = d;
                        if (tile == 0) den_out[(b * seq_len + c0 + t) * n_q + h] = d;
                    }
                __syncthreads();
                rotate_rows(A, mp, L, half, interleaved, cos_table, sin_table, row_base + c0, tid, nthreads);
                if (normalize)
                    for (int e = tid; e < L * width; e += nthreads) {
                        const int t = e / width, c = e - t * width;
                        G[t * dtp + c] = G[t * dtp + c] / (den[t] + eps);
                    }
                __syncthreads();
                // X = gamma^(i+1) gN S_in^T, Wr = tril(gN V^T), Sc = tril(Â B̂^T) . Gamma
                lb_product<0>(G, dtp, 1, S, 1, dtp, L, m, width,
                              [&](int i, int r, W x) { X[i * mp + r] = decayed ? x * pw[i + 1] : x; }, tid, nthreads);
                lb_scores(Wm, pp, G, Vs, dtp, L, width, (const W*)nullptr, tid, nthreads);
                lb_scores(Sc, pp, A, B, mp, L, m, dpw, tid, nthreads);
                __syncthreads();
                // gdot_i = gN_i . N_i (this tile's columns), then W = Wr . Gamma (each thread its rows)
                for (int i = tid; i < L; i += nthreads) {
                    if (normalize) {
                        W s = W(0);
                        for (int r = 0; r < m; ++r) s += A[i * mp + r] * X[i * mp + r];
                        for (int j = 0; j <= i; ++j) s += Sc[i * pp + j] * Wm[i * pp + j];
                        gd_t[(b * seq_len + c0 + i) * n_q + h] = s;
                    }
                    if (decayed)
                        for (int j = 0; j <= i; ++j) Wm[i * pp + j] *= pw[i - j];
                }
                __syncthreads();
                // dÂ = X + W B̂ (this tile's part), dB += W^T Â, dV += Sc^T gN
                W* da = dA_t + ((b * seq_len + c0) * n_q + h) * m;
                const i64 da_row = (i64)n_q * m;
                lb_product<1>(Wm, pp, 1, B, mp, 1, L, m, L,
                              [&](int i, int r, W x) { da[i * da_row + r] = X[i * mp + r] + x; }, tid, nthreads);
                lb_product<2>(Wm, 1, pp, A, mp, 1, L, m, L,
                              [&](int j, int r, W x) { DB[j * mp + r] += x; }, tid, nthreads);
                lb_product<2>(Sc, 1, pp, G, dtp, 1, L, width, L,
                              [&](int j, int c, W x) { DV[j * dtp + c] += x; }, tid, nthreads);
                __syncthreads();
                if (decayed) {
                    for (int e = tid; e < L * width; e += nthreads) {
                        const int t = e / width, c = e - t * width;
                        G[t * dtp + c] *= pw[t + 1];
                    }
                    __syncthreads();
                }
                // P += Â^T (gamma^(i+1) gN)
                lb_product<0>(A, 1, mp, G, dtp, 1, m, width, L,
                              [&](int r, int c, W x) { P[r * dtp + c] += x; }, tid, nthreads);
                __syncthreads();
            }
            W* db = dB_t + ((b * seq_len + c0) * n_heads + hk) * m;
            for (int e = tid; e < L * m; e += nthreads) {
                const int t = e / m, r = e - t * m;
                db[(i64)t * n_heads * m + r] = DB[t * mp + r];
            }
            T* dvb = dv_out + b * dsb + hk * dsh + c_lo * dsd + c0 * dss;
            for (int e = tid; e < L * width; e += nthreads) {
                const int t = e / width, c = e - t * width;
                dvb[t * dss + c * dsd] = Store<T>::from(DV[t * dtp + c]);
            }
            __syncthreads();
        }
    } else {
        // 2'. non-causal: dÂ = gN S^T and P over every query, then dB = V P^T, dV = B̂ P
        for (int g = 0; g < groups; ++g) {
            const int h = hk * groups + g;
            for (i64 c0 = 0; c0 < seq_len; c0 += chunk) {
                const int L = (int)(seq_len - c0 < chunk ? seq_len - c0 : chunk);
                load_features<T, W>(A, mp, q + b * qsb + h * qsh + c0 * qss, qss, qsd, L, m, feature_map, tid,
                                    nthreads);
                const T* gb = go + b * gsb + h * gsh + c_lo * gsd + c0 * gss;
                for (int e = tid; e < L * width; e += nthreads) {
                    const int t = e / width, c = e - t * width;
                    G[t * dtp + c] = (W)load_float(gb[t * gss + c * gsd]);
                }
                __syncthreads();
                if (normalize)
                    for (int t = tid; t < L; t += nthreads) {
                        W d = W(0);
                        for (int j = 0; j < m; ++j) d += A[t * mp + j] * z[j];
                        den[t] = d;
                        if (tile == 0) den_out[(b * seq_len + c0 + t) * n_q + h] = d;
                    }
                __syncthreads();
                rotate_rows(A, mp, L, half, interleaved, cos_table, sin_table, row_base + c0, tid, nthreads);
                if (normalize)
                    for (int e = tid; e < L * width; e += nthreads) {
                        const int t = e / width, c = e - t * width;
                        G[t * dtp + c] = G[t * dtp + c] / (den[t] + eps);
                    }
                __syncthreads();
                W* da = dA_t + ((b * seq_len + c0) * n_q + h) * m;
                const i64 da_row = (i64)n_q * m;
                lb_product<0>(G, dtp, 1, S, 1, dtp, L, m, width, [&](int i, int r, W x) {
                    X[i * mp + r] = x;
                    da[i * da_row + r] = x;
                }, tid, nthreads);
                __syncthreads();
                if (normalize)
                    for (int i = tid; i < L; i += nthreads) {
                        W s = W(0);
                        for (int r = 0; r < m; ++r) s += A[i * mp + r] * X[i * mp + r];
                        gd_t[(b * seq_len + c0 + i) * n_q + h] = s;
                    }
                lb_product<0>(A, 1, mp, G, dtp, 1, m, width, L,
                              [&](int r, int c, W x) { P[r * dtp + c] += x; }, tid, nthreads);
                __syncthreads();
            }
        }
        for (i64 c0 = 0; c0 < seq_len; c0 += chunk) {
            const int L = (int)(seq_len - c0 < chunk ? seq_len - c0 : chunk);
            load_features<T, W>(B, mp, kb + c0 * kss, kss, ksd, L, m, feature_map, tid, nthreads);
            for (int e = tid; e < L * width; e += nthreads) {
                const int t = e / width, c = e - t * width;
                Vs[t * dtp + c] = (W)load_float(vb[(c0 + t) * vss + c * vsd]);
            }
            __syncthreads();
            rotate_rows(B, mp, L, half, interleaved, cos_table, sin_table, row_base + c0, tid, nthreads);
            __syncthreads();
            W* db = dB_t + ((b * seq_len + c0) * n_heads + hk) * m;
            const i64 db_row = (i64)n_heads * m;
            lb_product<0>(Vs, dtp, 1, P, 1, dtp, L, m, width,
                          [&](int j, int r, W x) { db[j * db_row + r] = x; }, tid, nthreads);
            T* dvb = dv_out + b * dsb + hk * dsh + c_lo * dsd + c0 * dss;
            lb_product<0>(B, mp, 1, P, dtp, 1, L, width, m,
                          [&](int j, int c, W x) { dvb[j * dss + c * dsd] = Store<T>::from(x); }, tid, nthreads);
            __syncthreads();
        }
    }

    for (int e = tid; e < m * width; e += nthreads) {
        const int j = e / width, c = e - j * width;
        d_state_s[bh * m * dv + (i64)j * dv + c_lo + c] = P[j * dtp + c];
    }
}

template <typename T, typename W>
__global__ void linear_backward_finish(
    const T* q, i64 qsb, i64 qss, i64 qsh, i64 qsd,
    const T* k, i64 ksb, i64 kss, i64 ksh, i64 ksd,
    T* dq, i64 esb, i64 ess, i64 esh, i64 esd,
    T* dk, i64 fsb, i64 fss, i64 fsh, i64 fsd,
    const W* z_in, const W* grad_z, W* d_z,
    const W* dA_part, const W* dB_part, const W* gdot_part, const W* den_in, W* gD_buf,
    const W* cos_table, const W* sin_table, const i64* rows, int rows_batched,
    i64 seq_len, int n_batch, int n_heads, int groups, int m, int rotary_dim, int interleaved, int causal,
    int feature_map, W eps, int chunk, int n_tiles, const W* powers, int powers_stride, int decayed, int normalize) {
    ROTARY_DYNAMIC_SMEM(smem);
    const int mp = m | 1, half = rotary_dim / 2, n_units = half + (m - rotary_dim);
    W* Zr = reinterpret_cast<W*>(smem);  // z rows (forward walk), U / R rows (reverse walk)
    W* z = Zr + chunk * mp;              // z, then Q
    const int tid = threadIdx.x, nthreads = blockDim.x;
    const i64 bh = blockIdx.x;
    const i64 b = bh / n_heads;
    const int hk = (int)(bh - b * n_heads);
    const int n_q = n_heads * groups;
    const W gamma = decayed ? powers[bh * powers_stride + 1] : W(1);
    const i64* row_base = rows + (rows_batched ? b * seq_len : 0);
    const i64 n_chunks = (seq_len + chunk - 1) / chunk;
    const i64 a_tile = (i64)n_batch * seq_len * n_q * m, b_tile = (i64)n_batch * seq_len * n_heads * m;
    const i64 g_tile = (i64)n_batch * seq_len * n_q;
    const T* kb = k + b * ksb + hk * ksh;

    for (int j = tid; j < m; j += nthreads) z[j] = z_in[bh * m + j];
    __syncthreads();
    if (!causal && normalize)  // z over every token
        for (i64 c0 = 0; c0 < seq_len; c0 += chunk) {
            const int L = (int)(seq_len - c0 < chunk ? seq_len - c0 : chunk);
            load_features<T, W>(Zr, mp, kb + c0 * kss, kss, ksd, L, m, feature_map, tid, nthreads);
            __syncthreads();
            for (int j = tid; j < m; j += nthreads) {
                W run = z[j];
                for (int t = 0; t < L; ++t) run += Zr[t * mp + j];
                z[j] = run;
            }
            __syncthreads();
        }

    // dq, chunks forwards
    for (i64 c0 = 0; c0 < seq_len; c0 += chunk) {
        const int L = (int)(seq_len - c0 < chunk ? seq_len - c0 : chunk);
        if (causal && normalize) {
            load_features<T, W>(Zr, mp, kb + c0 * kss, kss, ksd, L, m, feature_map, tid, nthreads);
            __syncthreads();
            for (int j = tid; j < m; j += nthreads) {
                W run = z[j];
                for (int t = 0; t < L; ++t) {
                    run = decayed ? run * gamma + Zr[t * mp + j] : run + Zr[t * mp + j];
                    Zr[t * mp + j] = run;
                }
                z[j] = run;
            }
            __syncthreads();
        }
        for (int g = 0; g < groups; ++g) {
            const int h = hk * groups + g;
            for (int e = tid; e < L * n_units; e += nthreads) {
                const int t = e / n_units, u = e - t * n_units;
                const i64 tok = (b * seq_len + c0 + t) * n_q + h;
                W gD = W(0);
                if (normalize) {
                    W s = W(0);
                    for (int p = 0; p < n_tiles; ++p) s += gdot_part[p * g_tile + tok];
                    gD = -(s / (den_in[tok] + eps));
                    if (u == 0) gD_buf[tok] = gD;
                }
                int ia, ib;
                unit_features(u, half, rotary_dim, interleaved, ia, ib);
                W xa = W(0), xb = W(0);
                for (int p = 0; p < n_tiles; ++p) {
                    xa += dA_part[p * a_tile + tok * m + ia];
                    if (ib >= 0) xb += dA_part[p * a_tile + tok * m + ib];
                }
                if (ib >= 0) {
                    const i64 row = row_base[c0 + t];
                    rotate_pair<W>(xa, xb, cos_table[row * half + u], -sin_table[row * half + u], xa, xb);
                }
                const T* qr = q + b * qsb + h * qsh + (c0 + t) * qss;
                T* out = dq + b * esb + h * esh + (c0 + t) * ess;
                const W* zr = causal ? Zr + t * mp : z;
                if (normalize) xa += gD * zr[ia];
                out[ia * esd] = Store<T>::from(xa * feature_slope<W>((W)load_float(qr[ia * qsd]), feature_map));
                if (ib >= 0) {
                    if (normalize) xb += gD * zr[ib];
                    out[ib * esd] = Store<T>::from(xb * feature_slope<W>((W)load_float(qr[ib * qsd]), feature_map));
                }
            }
        }
        __syncthreads();
    }

    // dk, chunks backwards (non-causal: Q summed over every token first)
    for (int j = tid; j < m; j += nthreads) z[j] = grad_z[bh * m + j];
    __syncthreads();
    for (int pass = causal ? 1 : 0; pass < 2; ++pass) {
        for (i64 cc = n_chunks - 1; cc >= 0; --cc) {
            const i64 c0 = cc * chunk;
            const int L = (int)(seq_len - c0 < chunk ? seq_len - c0 : chunk);
            if (causal || pass == 0) {
                for (int e = tid; e < L * m; e += nthreads) {  // U_t = sum_h gD_t a_t
                    const int t = e / m, j = e - t * m;
                    W s = W(0);
                    for (int g = 0; normalize && g < groups; ++g) {
                        const int h = hk * groups + g;
                        const i64 tok = (b * seq_len + c0 + t) * n_q + h;
                        s += gD_buf[tok] * feature<W>((W)load_float(q[b * qsb + h * qsh + (c0 + t) * qss + j * qsd]),
                                                      feature_map);
                    }
                    Zr[t * mp + j] = s;
                }
                __syncthreads();
                for (int j = tid; j < m; j += nthreads) {
                    W run = z[j];
                    if (causal) {  // R_t = U_t + gamma R_(t+1); z holds gamma R of the chunk after
                        for (int t = L - 1; t >= 0; --t) {
                            const W r = Zr[t * mp + j] + run;
                            Zr[t * mp + j] = r;
                            run = decayed ? gamma * r : r;
                        }
                    } else {
                        for (int t = 0; t < L; ++t) run += Zr[t * mp + j];
                    }
                    z[j] = run;
                }
                __syncthreads();
            }
            if (pass == 1) {
                for (int e = tid; e < L * n_units; e += nthreads) {
                    const int t = e / n_units, u = e - t * n_units;
                    const i64 tok = (b * seq_len + c0 + t) * n_heads + hk;
                    int ia, ib;
                    unit_features(u, half, rotary_dim, interleaved, ia, ib);
                    W xa = W(0), xb = W(0);
                    for (int p = 0; p < n_tiles; ++p) {
                        xa += dB_part[p * b_tile + tok * m + ia];
                        if (ib >= 0) xb += dB_part[p * b_tile + tok * m + ib];
                    }
                    if (ib >= 0) {
                        const i64 row = row_base[c0 + t];
                        rotate_pair<W>(xa, xb, cos_table[row * half + u], -sin_table[row * half + u], xa, xb);
                    }
                    const W* qr = causal ? Zr + t * mp : z;
                    const T* kr = kb + (c0 + t) * kss;
                    T* out = dk + b * fsb + hk * fsh + (c0 + t) * fss;
                    xa += qr[ia];
                    out[ia * fsd] = Store<T>::from(xa * feature_slope<W>((W)load_float(kr[ia * ksd]), feature_map));
                    if (ib >= 0) {
                        xb += qr[ib];
                        out[ib * fsd] = Store<T>::from(xb * feature_slope<W>((W)load_float(kr[ib * ksd]), feature_map));
                    }
                }
                __syncthreads();
            }
        }
    }
    for (int j = tid; j < m; j += nthreads) d_z[bh * m + j] = z[j];
}
