// rope.cu -- rotate q and k (any strides, GQA head counts) by RoPE in one launch.
//
// For each token t = b * seq_len + s, table row r = rows[(rows_batched ? b : 0) * seq_len + s] and
// each pair i < rotary_dim / 2 (layout "half": (i, i + rotary_dim/2); "interleaved": (2i, 2i+1)):
//     y_a = x_a cos[r, i] - x_b sin[r, i]
//     y_b = x_b cos[r, i] + x_a sin[r, i]            (sin negated when inverse != 0)
// computed in W (float32, or float64 for double data) by rotary_common.cuh's rotate_pair: each product and sum
// rounded on its own, never fused into an FMA (NumPy's bits; the KV cache's kv_append rotates keys the same). Pairs are read in the layout INTERLEAVED names and
// written in the one OUT_INTERLEAVED names (default: the same; the other one for out_pairs, where y is never x:
// y_a goes to output coordinate i / 2i, y_b to i + rotary_dim/2 / 2i+1). Coordinates >= rotary_dim are
// copied when copy_tail != 0 (out is not x). Two tensors (q and k) share one launch; tensor 1 may have 0 heads.
//
// Launch geometry (rotary.backends.cupy.rotate_geometry): grid.x = ceil(n_tokens / tokens_per_block),
// one block per tile of tokens (linear in tokens, no seq x batch grid), any blockDim.x, dynamic
// shared memory = tokens_per_block * (4 * 8 + 2 * (rotary_dim/2) * sizeof(W)) bytes. The block first
// stages, per token, the four base offsets and the fp32 cos/sin row (read once, shared by all heads
// of q and k), then its threads walk the work units of the tile: per head rotary_dim/(2V) units of
// V pairs (two V-wide vector accesses each) and, when copying, (head_dim-rotary_dim)/tail_v tail units.
// A thread loads both members of its pairs before storing, so out == x (in place) is safe.
// V > 1 requires (checked by the launcher): unit stride along head_dim, strides and pointers
// aligned to V elements, (rotary_dim/2) % V == 0. All global offsets are 64-bit.
#include "rotary_common.cuh"

template <typename T, typename W, int V, bool INTERLEAVED, bool OUT_INTERLEAVED>
ROTARY_FN void rotate_unit(const T* x, T* y, i64 xsd, i64 ysd, int i0, int half, const W* c, const W* s) {
    // lo/hi: the two V-element groups of this unit (half: a and b members; interleaved: 2V consecutive),
    // read at x's offsets (INTERLEAVED) and written at y's (OUT_INTERLEAVED)
    const i64 lo_off = INTERLEAVED ? 2 * (i64)i0 : (i64)i0;
    const i64 hi_off = INTERLEAVED ? 2 * (i64)i0 + V : (i64)i0 + half;
    const i64 out_lo = OUT_INTERLEAVED ? 2 * (i64)i0 : (i64)i0;
    const i64 out_hi = OUT_INTERLEAVED ? 2 * (i64)i0 + V : (i64)i0 + half;
    T e[2 * V];
    if (V > 1) {
        T lo[V], hi[V];
        load_vec<T, V>(x + lo_off, lo);
        load_vec<T, V>(x + hi_off, hi);
#pragma unroll
        for (int j = 0; j < V; ++j) {
            e[j] = lo[j];
            e[V + j] = hi[j];
        }
    } else {
        e[0] = x[lo_off * xsd];
        e[1] = x[hi_off * xsd];
    }
#pragma unroll
    for (int p = 0; p < V; ++p) {
        const int ia = INTERLEAVED ? 2 * p : p;       // index in e of the pair's a member
        const int ib = INTERLEAVED ? 2 * p + 1 : V + p;
        W ya, yb;
        rotate_pair<W>(load_float(e[ia]), load_float(e[ib]), c[i0 + p], s[i0 + p], ya, yb);
        e[ia] = Store<T>::from(ya);
        e[ib] = Store<T>::from(yb);
    }
    if (OUT_INTERLEAVED != INTERLEAVED) {   // pair p's a and b members move to their places in y's layout
        T f[2 * V];
#pragma unroll
        for (int p = 0; p < V; ++p) {
            f[OUT_INTERLEAVED ? 2 * p : p] = e[INTERLEAVED ? 2 * p : p];
            f[OUT_INTERLEAVED ? 2 * p + 1 : V + p] = e[INTERLEAVED ? 2 * p + 1 : V + p];
        }
#pragma unroll
        for (int j = 0; j < 2 * V; ++j) e[j] = f[j];
    }
    if (V > 1) {
        T lo[V], hi[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
            lo[j] = e[j];
            hi[j] = e[V + j];
        }
        store_vec<T, V>(y + out_lo, lo);
        store_vec<T, V>(y + out_hi, hi);
    } else {
        y[out_lo * ysd] = e[0];
        y[out_hi * ysd] = e[1];
    }
}

template <typename T, int V>
ROTARY_FN void copy_unit(const T* x, T* y, i64 xsd, i64 ysd, int e0, int tail_v) {
    if (V > 1 && tail_v == V) {
        T buf[V];
        load_vec<T, V>(x + e0, buf);
        store_vec<T, V>(y + e0, buf);
    } else {
        y[(i64)e0 * ysd] = x[(i64)e0 * xsd];
    }
}

template <typename T, typename W, int V, bool INTERLEAVED, bool OUT_INTERLEAVED = INTERLEAVED>
__global__ void rope_rotate(
    const T* x0, T* y0, i64 heads0, i64 xsb0, i64 xss0, i64 xsh0, i64 xsd0,
    i64 ysb0, i64 yss0, i64 ysh0, i64 ysd0, int copy_tail0,
    const T* x1, T* y1, i64 heads1, i64 xsb1, i64 xss1, i64 xsh1, i64 xsd1,
    i64 ysb1, i64 yss1, i64 ysh1, i64 ysd1, int copy_tail1,
    const W* cos_table, const W* sin_table, const i64* rows, int rows_batched,
    i64 n_tokens, i64 seq_len, int head_dim, int rotary_dim, int tail_v, int inverse,
    int tokens_per_block) {
    ROTARY_DYNAMIC_SMEM(smem);
    const int half = rotary_dim / 2;
    i64* base = reinterpret_cast<i64*>(smem);                      // [tokens][4] x0, y0, x1, y1 offsets
    W* cos_row = reinterpret_cast<W*>(base + 4 * tokens_per_block);  // [tokens][half]
    W* sin_row = cos_row + (i64)tokens_per_block * half;              // [tokens][half], sign applied
    const i64 t0 = (i64)blockIdx.x * tokens_per_block;
    const i64 left = n_tokens - t0;
    const int n_here = left < tokens_per_block ? (int)left : tokens_per_block;
    const int tid = threadIdx.x;
    const int nthreads = blockDim.x;
    const W sign = inverse ? W(-1) : W(1);

    for (int tl = tid; tl < n_here; tl += nthreads) {
        const i64 t = t0 + tl;
        const i64 b = t / seq_len;
        const i64 s = t - b * seq_len;
        base[4 * tl + 0] = b * xsb0 + s * xss0;
        base[4 * tl + 1] = b * ysb0 + s * yss0;
        base[4 * tl + 2] = b * xsb1 + s * xss1;
        base[4 * tl + 3] = b * ysb1 + s * yss1;
    }
    for (int e = tid; e < n_here * half; e += nthreads) {
        const int tl = e / half;
        const int i = e - tl * half;
        const i64 t = t0 + tl;
        const i64 b = t / seq_len;
        const i64 s = t - b * seq_len;
        const i64 row = rows[(rows_batched ? b : 0) * seq_len + s];
        cos_row[e] = cos_table[row * half + i];
        sin_row[e] = sign * sin_table[row * half + i];
    }
    __syncthreads();

    const int rot_units = half / V;
    const int tail_len = head_dim - rotary_dim;
    const int per_head0 = rot_units + (copy_tail0 ? tail_len / tail_v : 0);
    const int per_head1 = rot_units + (copy_tail1 ? tail_len / tail_v : 0);
    const int units0 = (int)heads0 * per_head0;
    const int per_token = units0 + (int)heads1 * per_head1;
    for (int u = tid; u < n_here * per_token; u += nthreads) {
        const int tl = u / per_token;
        int r = u - tl * per_token;
        const bool second = r >= units0;
        if (second) r -= units0;
        const int per_head = second ? per_head1 : per_head0;
        const int head = r / per_head;
        const int w = r - head * per_head;
        const T* x = second ? x1 + base[4 * tl + 2] + head * xsh1 : x0 + base[4 * tl] + head * xsh0;
        T* y = second ? y1 + base[4 * tl + 3] + head * ysh1 : y0 + base[4 * tl + 1] + head * ysh0;
        const i64 xsd = second ? xsd1 : xsd0;
        const i64 ysd = second ? ysd1 : ysd0;
        if (w < rot_units) {
            rotate_unit<T, W, V, INTERLEAVED, OUT_INTERLEAVED>(x, y, xsd, ysd, w * V, half, cos_row + (i64)tl * half,
                                                               sin_row + (i64)tl * half);
        } else {
            copy_unit<T, V>(x, y, xsd, ysd, rotary_dim + (w - rot_units) * tail_v, tail_v);
        }
    }
}
