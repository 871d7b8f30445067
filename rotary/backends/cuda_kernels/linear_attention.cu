// linear_attention.cu -- linear attention with RoPE in the numerator (RoFormer eq. 19), chunked, with GQA,
// an optional per-head decay gamma (RetNet retention / simple gated linear attention) and an optional
// denominator.
//
// a_t = phi(q_t), b_t = phi(k_t) (phi: 0 identity, 1 elu+1, 2 relu), â = R_p a, b̂ = R_p b (pairs of
// the layout below rotary_dim; the rest pass through). q has H = groups * Hk heads; q head h reads k/v
// head h / groups. With the carried state (S, z) of the k/v head and D_ts = gamma^(t-s) (1 without decay):
//     causal:      o_t = (â_t . (gamma^(t+1) S + sum_{s<=t} D_ts b̂_s v_s^T)) / (a_t . (gamma^(t+1) z + sum_{s<=t} D_ts b_s) + eps)
//     non-causal:  o_t = (â_t . (S + sum_s b̂_s v_s^T)) / (a_t . (z + sum_s b_s) + eps)          (no decay)
// (t counted from the call's first token; normalize = 0: the numerator alone.) S is read from and
// written back to state_s (each dv tile owns its columns); z is read from z_in (never written: other
// tiles of the same head read it) and written to z_out by tile 0.
//
// One block per (batch, k/v head, dv tile of width dv_tile): grid.x = B * Hk * ceil(dv / dv_tile); any
// blockDim.x. The tile's state S (m x dv_tile) and z (m) stay in shared memory in W (fp32, or fp64
// for double data) for the whole sequence, which the block walks in chunks of `chunk` tokens; the k/v
// chunk is loaded once and serves the group's q heads. Powers gamma^j (j = 0..chunk) come per head from
// `powers` (host float64, rounded to W): every exponent is in 0..chunk, so no gamma^-t overflows.
//     causal, per chunk:  Zr_t = gamma Zr_(t-1) + b_t (Zr_(-1) = z),  z = Zr_(L-1)
//                         per q head: P = tril(Â B̂^T) * D,  N = gamma^(t+1) Â S + P V,  O = N / (rowsum(A * Zr) + eps)
//                         S = gamma^L S + (B̂ * gamma^(L-1-t))^T V
//     non-causal:         pass 1 accumulates S, z over all chunks; pass 2 writes O = Â S / (A z + eps) per q head.
// Products are 4x4 (or, when that leaves threads idle, 2x2) register tiles over shared-memory operands. Shared memory (W elements), see
// rotary.backends.cupy.linear_attention_shared_bytes:
//     A, B, Zr: chunk x mp  |  V: chunk x dtp  |  S: m x dtp  |  P: chunk x (chunk + 1)  |  den: chunk  |  z: m  |  pw: chunk + 1
// with mp = m | 1 and dtp = dv_tile | 1 (odd row strides avoid bank conflicts on column walks).
#include "rotary_common.cuh"

// acc[i][j] = sum_{k<K} X[(r+i)*xr + k*xk] * Y[k*yk + (c+j)*yc]; rows/cols past nr/nc are clamped
// (their results are discarded by the caller). CAUSAL: row r+i skips the terms k > r+i (a causal product's
// later tokens) instead of multiplying their zero weights: 0 * NaN is NaN, which carried a later token's
// NaN/inf value into earlier rows of the chunk; the kept terms are added in the same order as before.
template <int TILE, typename W, bool CAUSAL = false>
ROTARY_FN void mma_tile(W (&acc)[TILE][TILE], const W* X, int xr, int xk, const W* Y, int yk, int yc,
                        int r, int c, int nr, int nc, int K) {
    int xo[TILE], yo[TILE];
#pragma unroll
    for (int i = 0; i < TILE; ++i) {
        xo[i] = imin(r + i, nr - 1) * xr;
        yo[i] = imin(c + i, nc - 1) * yc;
    }
    for (int k = 0; k < K; ++k) {
        W xv[TILE], yv[TILE];
#pragma unroll
        for (int i = 0; i < TILE; ++i) {
            xv[i] = X[xo[i] + k * xk];
            yv[i] = Y[k * yk + yo[i]];
        }
#pragma unroll
        for (int i = 0; i < TILE; ++i)
#pragma unroll
            for (int j = 0; j < TILE; ++j)
                if (!CAUSAL || k <= r + i) acc[i][j] += xv[i] * yv[j];
    }
}

template <int TILE, typename W> ROTARY_FN void zero_tile(W (&acc)[TILE][TILE]) {
#pragma unroll
    for (int i = 0; i < TILE; ++i)
#pragma unroll
        for (int j = 0; j < TILE; ++j) acc[i][j] = W(0);
}

// Feature maps, the bits of rotary.backends.feature_maps (its docstring has the formulas; codes 0 identity,
// 1 elu + 1, 2 relu). Every operation of feature_exp is rounded on its own (rotary_common.cuh's rn_*: __fmul_rn & co.
// on the device, which nvcc/NVRTC never fuse into FMAs; the host shim builds with -ffp-contract=off), constants are
// the work type's nearest values as hex literals, 2**n comes from exponent bits.
#ifdef ROTARY_ON_DEVICE
ROTARY_FN double fm_bits_to_double(long long u) { return __longlong_as_double(u); }
#else
ROTARY_FN double fm_bits_to_double(long long u) {
    double d;
    std::memcpy(&d, &u, 8);
    return d;
}
#endif

// exp(x), x in [-87, 0] used (clamped to [-87, 88]): Cephes expf, n = floor(x log2e + 1/2), r = x - n ln2
// (ln2 in two parts), p = ((P(r) r^2) + r) + 1 (degree 7), times 2**n. Not for NaN (the caller keeps it).
ROTARY_FN float feature_exp(float x) {
    float c = x < -87.0f ? -87.0f : x;
    c = c > 88.0f ? 88.0f : c;
    const float n = rn_floor(rn_add(rn_mul(c, 0x1.715476p+0f), 0.5f));
    const float r = rn_add(rn_sub(c, rn_mul(n, 0x1.63p-1f)), rn_mul(n, 0x1.bd0106p-13f));
    float p = rn_add(rn_mul(0x1.a0d2cep-13f, r), 0x1.6e879cp-10f);
    p = rn_add(rn_mul(p, r), 0x1.111210p-7f);
    p = rn_add(rn_mul(p, r), 0x1.555382p-5f);
    p = rn_add(rn_mul(p, r), 0x1.555554p-3f);
    p = rn_add(rn_mul(p, r), 0x1p-1f);
    p = rn_add(rn_add(rn_mul(p, rn_mul(r, r)), r), 1.0f);
    return rn_mul(p, bits_to_float((unsigned int)((int)n + 127) << 23));
}

// exp(x), x in [-708, 0] used (clamped to [-708, 709]): the same scheme, P = 1/13!, ..., 1/2! (degree 13).
ROTARY_FN double feature_exp(double x) {
    double c = x < -708.0 ? -708.0 : x;
    c = c > 709.0 ? 709.0 : c;
    const double n = rn_floor(rn_add(rn_mul(c, 0x1.71547652b82fep+0), 0.5));
    const double r = rn_add(rn_sub(c, rn_mul(n, 0x1.62e4p-1)), rn_mul(n, -0x1.7f7d1cf79abcap-20));
    double p = rn_add(rn_mul(0x1.6124613a86d09p-33, r), 0x1.1eed8eff8d898p-29);
    p = rn_add(rn_mul(p, r), 0x1.ae64567f544e4p-26);
    p = rn_add(rn_mul(p, r), 0x1.27e4fb7789f5cp-22);
    p = rn_add(rn_mul(p, r), 0x1.71de3a556c734p-19);
    p = rn_add(rn_mul(p, r), 0x1.a01a01a01a01ap-16);
    p = rn_add(rn_mul(p, r), 0x1.a01a01a01a01ap-13);
    p = rn_add(rn_mul(p, r), 0x1.6c16c16c16c17p-10);
    p = rn_add(rn_mul(p, r), 0x1.1111111111111p-7);
    p = rn_add(rn_mul(p, r), 0x1.5555555555555p-5);
    p = rn_add(rn_mul(p, r), 0x1.5555555555555p-3);
    p = rn_add(rn_mul(p, r), 0x1p-1);
    p = rn_add(rn_add(rn_mul(p, rn_mul(r, r)), r), 1.0);
    return rn_mul(p, fm_bits_to_double((long long)((long long)n + 1023) << 52));
}

ROTARY_FN float feature_exp_lo(float) { return -87.0f; }
ROTARY_FN double feature_exp_lo(double) { return -708.0; }

// phi(x): identity x; elu + 1: x + 1 (x > 0), x (NaN), +0 (x < -87 / -708, -inf too), else feature_exp(x);
// relu: x (x > 0 or NaN), else +0 (relu(-0) = +0)
template <typename W> ROTARY_FN W feature(W x, int feature_map) {
    if (feature_map == 0 || x != x) return x;
    if (x > W(0)) return feature_map == 1 ? x + W(1) : x;
    if (feature_map == 2 || x < feature_exp_lo(x)) return W(0);
    return feature_exp(x);
}

// dst[t][j] = phi(src[t][j]) for t < L, j < m (unrotated), row stride mp.
template <typename T, typename W>
ROTARY_FN void load_features(W* dst, int mp, const T* src, i64 sst, i64 ssd, int L, int m, int feature_map,
                             int tid, int nthreads) {
    for (int e = tid; e < L * m; e += nthreads) {
        const int t = e / m;
        const int j = e - t * m;
        dst[t * mp + j] = feature<W>((W)load_float(src[t * sst + j * ssd]), feature_map);
    }
}

// Rotate rows t < L of X (row stride mp) in place by the RoPE angle of token (c0 + t) (rotate_pair: the rounding
// of every kernel's pair rotation).
template <typename W>
ROTARY_FN void rotate_rows(W* X, int mp, int L, int half, int interleaved, const W* cos_table,
                           const W* sin_table, const i64* row_of, int tid, int nthreads) {
    for (int e = tid; e < L * half; e += nthreads) {
        const int t = e / half;
        const int i = e - t * half;
        const i64 row = row_of[t];
        const W c = cos_table[row * half + i];
        const W s = sin_table[row * half + i];
        const int ia = interleaved ? 2 * i : i;
        const int ib = interleaved ? 2 * i + 1 : i + half;
        rotate_pair<W>(X[t * mp + ia], X[t * mp + ib], c, s, X[t * mp + ia], X[t * mp + ib]);
    }
}

// TILE x TILE register tiles: 4 when there are at least as many 4x4 tiles as threads, else 2 (more
// threads busy on small products, e.g. O = ÂS + PV of a short chunk).
ROTARY_FN bool wide_tiles(int n_tiles4, int nthreads) { return n_tiles4 >= nthreads; }

// S[j][c] = factor S[j][c] + sum_{t<L} B̂[t][j] V[t][c]   (m x width; factor 1: a plain add)
template <int TILE, typename W>
ROTARY_FN void update_state(W* S, int dtp, const W* B, int mp, const W* Vs, int L, int m, int width, W factor,
                            int tid, int nthreads) {
    const int tr = (m + TILE - 1) / TILE, tc = (width + TILE - 1) / TILE;
    for (int tile = tid; tile < tr * tc; tile += nthreads) {
        const int r = (tile / tc) * TILE, c = (tile % tc) * TILE;
        W acc[TILE][TILE];
        zero_tile<TILE>(acc);
        mma_tile<TILE>(acc, B, 1, mp, Vs, dtp, 1, r, c, m, width, L);
#pragma unroll
        for (int i = 0; i < TILE; ++i)
#pragma unroll
            for (int j = 0; j < TILE; ++j)
                if (r + i < m && c + j < width) {
                    W& x = S[(r + i) * dtp + c + j];
                    x = factor == W(1) ? x + acc[i][j] : x * factor + acc[i][j];
                }
    }
}

// z[j] += sum_{t<L} B[t][j]
template <typename W>
ROTARY_FN void update_normalizer(W* z, const W* B, int mp, int L, int m, int tid, int nthreads) {
    for (int j = tid; j < m; j += nthreads) {
        W acc = W(0);
        for (int t = 0; t < L; ++t) acc += B[t * mp + j];
        z[j] += acc;
    }
}

// o[t][c] = (gamma^(t+1) Â_t . S[:, c] + [causal] sum_{s<=t} P[t][s] V[s][c]) / (den[t] + eps)
// (pw = nullptr: no gamma factor; normalize = 0: no division)
template <int TILE, typename T, typename W>
ROTARY_FN void write_output(T* o, i64 ost, i64 osd, const W* A, int mp, const W* S, int dtp, const W* P, int pp,
                            const W* Vs, const W* den, W eps, int L, int m, int width, int causal, const W* pw,
                            int normalize, int tid, int nthreads) {
    const int tr = (L + TILE - 1) / TILE, tc = (width + TILE - 1) / TILE;
    for (int tile = tid; tile < tr * tc; tile += nthreads) {
        const int r = (tile / tc) * TILE, c = (tile % tc) * TILE;
        W acc[TILE][TILE];
        zero_tile<TILE>(acc);
        mma_tile<TILE>(acc, A, mp, 1, S, dtp, 1, r, c, L, width, m);
        if (pw != nullptr) {
#pragma unroll
            for (int i = 0; i < TILE; ++i) {
                const W f = pw[imin(r + i, L - 1) + 1];
#pragma unroll
                for (int j = 0; j < TILE; ++j) acc[i][j] *= f;
            }
        }
        if (causal) mma_tile<TILE, W, true>(acc, P, pp, 1, Vs, dtp, 1, r, c, L, width, imin(L, r + TILE));
#pragma unroll
        for (int i = 0; i < TILE; ++i)
#pragma unroll
            for (int j = 0; j < TILE; ++j)
                if (r + i < L && c + j < width)
                    o[(r + i) * ost + (c + j) * osd] =
                        Store<T>::from(normalize ? acc[i][j] / (den[r + i] + eps) : acc[i][j]);
    }
}

// P[t][s] = Â_t . B̂_s for s <= t, 0 above the diagonal, for all t, s < L (tiles above the diagonal
// are zero-filled without computing: write_output may tile P's rows differently)
// (pw != nullptr: P[t][s] *= gamma^(t-s) = pw[t - s])
template <int TILE, typename W>
ROTARY_FN void causal_scores(W* P, int pp, const W* A, const W* B, int mp, int L, int m, const W* pw, int tid,
                             int nthreads) {
    const int nt = (L + TILE - 1) / TILE;
    for (int pt = tid; pt < nt * nt; pt += nthreads) {
        const int tr = pt / nt, tc = pt - tr * nt;
        W acc[TILE][TILE];
        zero_tile<TILE>(acc);
        if (tc <= tr) mma_tile<TILE>(acc, A, mp, 1, B, 1, mp, tr * TILE, tc * TILE, L, L, m);
#pragma unroll
        for (int i = 0; i < TILE; ++i)
#pragma unroll
            for (int j = 0; j < TILE; ++j) {
                const int t = tr * TILE + i, s = tc * TILE + j;
                if (t < L && s < L)
                    P[t * pp + s] = s <= t ? (pw != nullptr ? acc[i][j] * pw[t - s] : acc[i][j]) : W(0);
            }
    }
}

template <typename T, typename W>
__global__ void linear_attention_chunked(
    const T* q, i64 qsb, i64 qss, i64 qsh, i64 qsd,
    const T* k, i64 ksb, i64 kss, i64 ksh, i64 ksd,
    const T* v, i64 vsb, i64 vss, i64 vsh, i64 vsd,
    T* o, i64 osb, i64 oss, i64 osh, i64 osd,
    W* state_s, const W* z_in, W* z_out,
    const W* cos_table, const W* sin_table, const i64* rows, int rows_batched,
    i64 seq_len, int n_heads, int groups, int m, int dv, int rotary_dim, int interleaved, int causal,
    int feature_map, W eps, int chunk, int dv_tile, const W* powers, int powers_stride, int decayed,
    int normalize, const i64* cu_seqlens, int packed) {
    ROTARY_DYNAMIC_SMEM(smem);
    const int mp = m | 1, dtp = dv_tile | 1, pp = chunk + 1, half = rotary_dim / 2;
    W* A = reinterpret_cast<W*>(smem);
    W* B = A + chunk * mp;
    W* Vs = B + chunk * mp;
    W* S = Vs + chunk * dtp;
    W* P = S + m * dtp;
    W* den = P + chunk * pp;
    W* z = den + chunk;
    W* Zr = z + m;
    W* pw = Zr + chunk * mp;
    const int tid = threadIdx.x, nthreads = blockDim.x;
    const int n_tiles = (dv + dv_tile - 1) / dv_tile;
    const int tile = blockIdx.x % n_tiles;
    const i64 bh = blockIdx.x / n_tiles;  // (batch, k/v head); packed: (sequence, k/v head)
    const i64 sb = bh / n_heads;           // the state's batch row (the sequence when packed)
    const int hk = (int)(bh - sb * n_heads);
    // packed (cu_seqlens of n_seq + 1 offsets): sequence sb is tokens cu_seqlens[sb] .. cu_seqlens[sb + 1] - 1
    // of batch row 0; unpacked: batch row sb, tokens 0 .. seq_len - 1
    const i64 b = packed ? 0 : sb;
    const i64 t_first = packed ? cu_seqlens[sb] : 0;
    if (packed) seq_len = cu_seqlens[sb + 1] - t_first;
    const int c_lo = tile * dv_tile;
    const int width = imin(dv_tile, dv - c_lo);
    const i64* row_base = rows + (rows_batched ? b * seq_len : t_first);
    W* Sg = state_s + bh * m * dv;  // (m, dv) of this (b, k/v head)
    const W* dpw = decayed ? pw : nullptr;

    for (int e = tid; e < m * width; e += nthreads) {
        const int j = e / width, c = e - j * width;
        S[j * dtp + c] = Sg[(i64)j * dv + c_lo + c];
    }
    for (int j = tid; j < m; j += nthreads) z[j] = z_in[bh * m + j];
    for (int j = tid; j <= chunk; j += nthreads) pw[j] = decayed ? powers[bh * powers_stride + j] : W(1);
    __syncthreads();
    const W gamma = pw[1];

    q += b * qsb + t_first * qss;
    o += b * osb + t_first * oss;
    const T* kb = k + b * ksb + hk * ksh + t_first * kss;
    const T* vb = v + b * vsb + hk * vsh + c_lo * vsd + t_first * vss;

    // Pass 1 (causal: the only pass; non-causal: accumulate S and z over all tokens).
    for (i64 c0 = 0; c0 < seq_len; c0 += chunk) {
        const int L = (int)(seq_len - c0 < chunk ? seq_len - c0 : chunk);
        load_features<T, W>(B, mp, kb + c0 * kss, kss, ksd, L, m, feature_map, tid, nthreads);
        for (int e = tid; e < L * width; e += nthreads) {
            const int t = e / width, c = e - t * width;
            Vs[t * dtp + c] = (W)load_float(vb[(c0 + t) * vss + c * vsd]);
        }
        __syncthreads();
        if (causal) {
            // Zr[t][j] = z[j] after token t (decayed recurrence), then z = the chunk's last row
            for (int j = tid; j < m; j += nthreads) {
                W run = z[j];
                for (int t = 0; t < L; ++t) {
                    run = decayed ? run * gamma + B[t * mp + j] : run + B[t * mp + j];
                    Zr[t * mp + j] = run;
                }
                z[j] = run;
            }
        } else {
            update_normalizer(z, B, mp, L, m, tid, nthreads);
        }
        __syncthreads();
        rotate_rows(B, mp, L, half, interleaved, cos_table, sin_table, row_base + c0, tid, nthreads);
        __syncthreads();
        for (int g = 0; causal && g < groups; ++g) {
            const int h = hk * groups + g;
            load_features<T, W>(A, mp, q + h * qsh + c0 * qss, qss, qsd, L, m, feature_map, tid,
                                nthreads);
            __syncthreads();
            if (normalize) {
                for (int t = tid; t < L; t += nthreads) {
                    W d = W(0);
                    for (int j = 0; j < m; ++j) d += A[t * mp + j] * Zr[t * mp + j];
                    den[t] = d;
                }
                __syncthreads();
            }
            rotate_rows(A, mp, L, half, interleaved, cos_table, sin_table, row_base + c0, tid, nthreads);
            __syncthreads();
            const int nt4 = (L + 3) / 4;
            if (wide_tiles(nt4 * nt4, nthreads))
                causal_scores<4>(P, pp, A, B, mp, L, m, dpw, tid, nthreads);
            else
                causal_scores<2>(P, pp, A, B, mp, L, m, dpw, tid, nthreads);
            __syncthreads();
            T* ob = o + h * osh + c_lo * osd + c0 * oss;
            if (wide_tiles(((L + 3) / 4) * ((width + 3) / 4), nthreads))
                write_output<4, T, W>(ob, oss, osd, A, mp, S, dtp, P, pp, Vs, den, eps, L, m, width, 1, dpw,
                                      normalize, tid, nthreads);
            else
                write_output<2, T, W>(ob, oss, osd, A, mp, S, dtp, P, pp, Vs, den, eps, L, m, width, 1, dpw,
                                      normalize, tid, nthreads);
            __syncthreads();
        }
        if (decayed) {  // B̂ rows weighted by gamma^(L-1-t) for the state update
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

    // Pass 2 (non-causal): o_t = Â_t S / (A_t . z + eps) with the final S, z, for each q head of the group.
    for (int g = 0; !causal && g < groups; ++g) {
        const int h = hk * groups + g;
        const T* qb = q + h * qsh;
        T* ob = o + h * osh + c_lo * osd;
        for (i64 c0 = 0; c0 < seq_len; c0 += chunk) {
            const int L = (int)(seq_len - c0 < chunk ? seq_len - c0 : chunk);
            load_features<T, W>(A, mp, qb + c0 * qss, qss, qsd, L, m, feature_map, tid, nthreads);
            __syncthreads();
            for (int t = tid; t < L; t += nthreads) {
                W d = W(0);
                for (int j = 0; j < m; ++j) d += A[t * mp + j] * z[j];
                den[t] = d;
            }
            __syncthreads();
            rotate_rows(A, mp, L, half, interleaved, cos_table, sin_table, row_base + c0, tid, nthreads);
            __syncthreads();
            if (wide_tiles(((L + 3) / 4) * ((width + 3) / 4), nthreads))
                write_output<4, T, W>(ob + c0 * oss, oss, osd, A, mp, S, dtp, P, pp, Vs, den, eps, L, m, width, 0,
                                      nullptr, normalize, tid, nthreads);
            else
                write_output<2, T, W>(ob + c0 * oss, oss, osd, A, mp, S, dtp, P, pp, Vs, den, eps, L, m, width, 0,
                                      nullptr, normalize, tid, nthreads);
            __syncthreads();
        }
    }

    for (int e = tid; e < m * width; e += nthreads) {
        const int j = e / width, c = e - j * width;
        Sg[(i64)j * dv + c_lo + c] = S[j * dtp + c];
    }
    if (tile == 0)
        for (int j = tid; j < m; j += nthreads) z_out[bh * m + j] = z[j];
}
