// kv_cache.cu -- KV-cache append: rotate k, quantize k and v (or cast), write both into their cache slots.
//
// The reference is rotary.backends.kv_entries.append_kv; every result here is bit for bit the same. Token t
// (of n_tokens) with table row r = rows[t] goes to slot slots[t]; for each k/v head h, with pairs i < rotary_dim/2
// of the layout at offset o ("half": (o+i, o+i+rotary_dim/2); "interleaved": (o+2i, o+2i+1)):
//     w_a = x_a cos[r, i] - x_b sin[r, i]
//     w_b = x_b cos[r, i] + x_a sin[r, i]            (W: float32, float64 for double; rotary_common.cuh's
//                                                     rotate_pair, as rope.cu: each product and sum rounded on
//                                                     its own, never an FMA)
// the coordinates outside [o, o + rotary_dim) pass through, and v is taken as it is (in W). Entries:
//     KIND 0 (the cache's dtype):  k_out = T(w), v_out = v (copied)
//     KIND 1 ("int8"), 2 ("float8_e4m3"), per (token, head):
//         amax = max_d |w_d|, scale = amax / LIMIT (127; 448), y = w / scale if scale > 0 else w,
//         entry = clip(rint(y), -127, 127) as int8   |   the float8_e4m3fn bits of y (round to nearest even,
//         magnitudes above 464 NaN, as ml_dtypes), scale -> k_scale / v_scale[slot, h] (W)
// k_out / v_out (P, heads, head_dim) and the scales (P, heads) are C-contiguous; k and v (n_tokens, heads,
// head_dim) have any strides (64-bit element strides). slots[t] < 0 marks a padding token: nothing of it is read
// (k, v, rows[t], its table row) or written. The other slots must be distinct and < P (the caller checks).
//
// Launch geometry (rotary.backends.cupy.kv_append_geometry): grid.x = ceil(n_tokens / tokens_per_block); a
// block takes tokens_per_block tokens, i.e. rows = tokens_per_block * 2 * heads (token, k|v, head) rows of
// head_dim values. Its threads form groups of `group` consecutive threads, one (token, k|v, head) row per
// group, blockDim.x / group rows at a time; a thread walks the row's units lane, lane + group, ... (a unit:
// one rotated pair, or one unrotated coordinate). Quantized kinds: each thread keeps the amax of its units,
// the group reduces them in shared memory (a tree over `group` partials, any group size; dynamic shared
// memory = blockDim.x * sizeof(W), written by every thread before it is read), and the thread computes its
// units again (the same operations: the same bits) to write the entries. No warp intrinsics: the host shim
// runs the same text. KIND 0 needs no shared memory and no barrier.
#include "rotary_common.cuh"

// The quantizers' operations are rotary_common.cuh's rn_* (each correctly rounded on its own).

// max that keeps a NaN (NumPy's max propagates it); max is exact, so the reduction order never matters
template <typename W> ROTARY_FN W kv_max(W m, W x) { return (x > m || x != x) ? x : m; }

// the entry type of each kind: the storage type, int8, or the uint8 bits of float8_e4m3fn
template <typename T, int KIND> struct KvEntry { typedef T type; };
template <typename T> struct KvEntry<T, 1> { typedef signed char type; };
template <typename T> struct KvEntry<T, 2> { typedef unsigned char type; };

// float8_e4m3fn bits of x, round to nearest even (sign, 4 exponent bits with bias 7, 3 mantissa bits; no
// infinities; S.1111.111 is NaN). |x| > 464 (past the tie between 448 and the NaN pattern), inf and NaN give
// NaN with x's sign, as ml_dtypes' astype(float8_e4m3fn) does.
ROTARY_FN unsigned char fp8_e4m3_bits(float x) {
    const unsigned int u = float_to_bits(x);
    const unsigned int sign = (u >> 24) & 0x80u;
    const unsigned int a = u & 0x7fffffffu;
    if (a > 0x43e80000u) return (unsigned char)(sign | 0x7fu);   // > 464, inf, NaN
    if (a < 0x3c800000u) {                                       // < 2^-6: subnormal (8 rounds up to 2^-6)
        const float q = rn_rint(rn_mul(bits_to_float(a), 512.0f));   // exact product, then half to even
        return (unsigned char)(sign | (unsigned int)q);
    }
    const unsigned int rebiased = a - (120u << 23);              // exponent bias 127 -> 7
    const unsigned int rounded = (rebiased + 0x7ffffu + ((rebiased >> 20) & 1u)) >> 20;
    return (unsigned char)(sign | rounded);
}

template <int KIND, typename W> struct KvQuant;
template <typename W> struct KvQuant<1, W> {
    static ROTARY_FN W limit() { return W(127); }
    static ROTARY_FN signed char entry(W w, W scale) {
        W y = rn_rint(scale > W(0) ? rn_div(w, scale) : w);
        y = y < W(-127) ? W(-127) : (y > W(127) ? W(127) : y);
        return (signed char)(y == y ? (int)y : 0);   // NaN: 0 (NumPy leaves it undefined)
    }
};
template <typename W> struct KvQuant<2, W> {
    static_assert(sizeof(W) == 4, "float8_e4m3 entries are quantized from float32 work values");
    static ROTARY_FN W limit() { return W(448); }
    static ROTARY_FN unsigned char entry(W w, W scale) { return fp8_e4m3_bits(scale > W(0) ? rn_div(w, scale) : w); }
};

// Unit u of a k row: one rotated pair (u < half) or one unrotated coordinate. Sets the element indices
// and work values (n = 2 for a pair, 1 otherwise).
template <typename T, typename W>
ROTARY_FN int kv_k_unit(const T* x, i64 sd, int u, int half, int offset, int rotary_dim, int interleaved,
                        const W* c_row, const W* s_row, int (&idx)[2], W (&val)[2]) {
    if (u < half) {
        idx[0] = offset + (interleaved ? 2 * u : u);
        idx[1] = offset + (interleaved ? 2 * u + 1 : u + half);
        rotate_pair<W>(load_float(x[idx[0] * sd]), load_float(x[idx[1] * sd]), c_row[u], s_row[u], val[0], val[1]);
        return 2;
    }
    const int j = u - half;
    idx[0] = j < offset ? j : j + rotary_dim;
    val[0] = load_float(x[idx[0] * sd]);
    return 1;
}

template <typename T, typename W, int KIND>
__global__ void kv_append(
    const T* k, i64 kst, i64 ksh, i64 ksd, const T* v, i64 vst, i64 vsh, i64 vsd,
    const W* cos_table, const W* sin_table, const i64* rows, const i64* slots,
    typename KvEntry<T, KIND>::type* k_out, typename KvEntry<T, KIND>::type* v_out, W* k_scale, W* v_scale,
    i64 n_tokens, int heads, int head_dim, int rotary_dim, int offset, int interleaved, int group,
    int tokens_per_block) {
    typedef typename KvEntry<T, KIND>::type E;
    ROTARY_DYNAMIC_SMEM(smem);
    W* red = reinterpret_cast<W*>(smem);   // [blockDim.x] amax partials (KIND != 0)
    const int half = rotary_dim / 2;
    const int tid = threadIdx.x;
    const int lane = tid % group;
    const int per_round = blockDim.x / group;   // rows at a time; threads past per_round * group idle
    const int row_in_round = tid / group;
    const i64 t0 = (i64)blockIdx.x * tokens_per_block;
    const i64 left = n_tokens - t0;
    const int n_here = left < tokens_per_block ? (int)left : tokens_per_block;
    const int rows_here = n_here * 2 * heads;
    const int k_units = half + (head_dim - rotary_dim);

    for (int first = 0; first < rows_here; first += per_round) {   // the same trip count in every thread
        const int r = first + row_in_round;
        const bool active = row_in_round < per_round && r < rows_here;
        int h = 0, units = 0;
        bool is_v = false;
        i64 t = 0, slot = 0, row = 0, sd = 1;
        const T* x = k;
        if (active) {
            const int tl = r / (2 * heads);
            const int rem = r - tl * 2 * heads;
            is_v = rem >= heads;
            h = is_v ? rem - heads : rem;
            t = t0 + tl;
            slot = slots[t];
        }
        const bool live = active && slot >= 0;   // a padding token (slot < 0): nothing of it read or written
        if (live) {
            row = rows[t];
            x = is_v ? v + t * vst + h * vsh : k + t * kst + h * ksh;
            sd = is_v ? vsd : ksd;
            units = is_v ? head_dim : k_units;
        } else {
            slot = 0;
        }
        E* out = (is_v ? v_out : k_out) + (slot * heads + h) * (i64)head_dim;
        const W* c_row = cos_table + row * half;
        const W* s_row = sin_table + row * half;
        int idx[2];
        W val[2];
        if constexpr (KIND == 0) {
            for (int u = lane; u < units; u += group) {
                if (is_v || u >= half) {   // copied as it is (v, unrotated coordinates)
                    const int d = is_v ? u : (u - half < offset ? u - half : u - half + rotary_dim);
                    out[d] = x[d * sd];
                } else {
                    kv_k_unit<T, W>(x, sd, u, half, offset, rotary_dim, interleaved, c_row, s_row, idx, val);
                    out[idx[0]] = Store<T>::from(val[0]);
                    out[idx[1]] = Store<T>::from(val[1]);
                }
            }
        } else {
            W amax = W(0);
            for (int u = lane; u < units; u += group) {
                int n = 1;
                if (is_v) val[0] = load_float(x[u * sd]);
                else n = kv_k_unit<T, W>(x, sd, u, half, offset, rotary_dim, interleaved, c_row, s_row, idx, val);
                for (int j = 0; j < n; ++j) amax = kv_max(amax, rn_abs(val[j]));
            }
            red[tid] = amax;
            __syncthreads();
            for (int step = 1; step < group; step *= 2) {
                if (lane % (2 * step) == 0 && lane + step < group && row_in_round < per_round)
                    red[tid] = kv_max(red[tid], red[tid + step]);
                __syncthreads();
            }
            const W scale = rn_div(red[tid - lane], KvQuant<KIND, W>::limit());
            for (int u = lane; u < units; u += group) {
                int n = 1;
                if (is_v) {
                    idx[0] = u;
                    val[0] = load_float(x[u * sd]);
                } else {
                    n = kv_k_unit<T, W>(x, sd, u, half, offset, rotary_dim, interleaved, c_row, s_row, idx, val);
                }
                for (int j = 0; j < n; ++j)
                    out[idx[j]] = (E)KvQuant<KIND, W>::entry(val[j], scale);
            }
            if (live && lane == 0) (is_v ? v_scale : k_scale)[slot * heads + h] = scale;
            __syncthreads();   // every group has read its amax before the next round overwrites red
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// paged_attention -- softmax attention of packed queries over each sequence's pages where they lie (the
// paged_attention capability; rotary.backends has the contract). Sequence i (of n) holds keys 0 .. seq_lens[i] - 1,
// key p in slot block_table[i, p / page_size] * page_size + p % page_size; its queries are q's rows q_starts[i] ..
// q_starts[i + 1] - 1 (c of them, a prefill chunk or a decode step, mixed freely in one launch), query j at position
// pos = seq_lens[i] - c + j. A block finds its sequence by a binary search over q_starts (the last i with
// q_starts[i] <= its row; empty sequences are passed over). Query head hq reads k/v head hq / (q_heads / kv_heads).
// Keys seen: p <= pos (causal; also pos - p < window when window > 0), every p < seq_lens[i] otherwise. With
// fold = scale / softcap (scale without softcap): x_p = <fold q, k_p>, x_p = softcap tanh(x_p) with softcap,
// o = sum_p softmax(x)_p v_p, in W with entries dequantized on the fly (entry * scale of its (slot, head); float8
// bits decoded exactly), an online softmax over tiles of `tile` keys. A row that sees no key, and a q row outside
// q_starts[0] .. q_starts[n] - 1, gets 0. o is C-contiguous (T, q_heads, head_dim) in T. The tables are the
// caller's device arrays, read as they are (not range-checked).
//
// Launch geometry (rotary.backends.cupy.plan_paged_attention): one block per (q row, q head), grid.x = T * q_heads,
// any blockDim.x; tile <= blockDim.x. Dynamic shared memory (W elements, then i64): q[head_dim] | acc[head_dim] |
// p[tile] | red[blockDim.x] | slot[tile]. Per tile: thread t < n_tile scores key t (its slot read from the block
// table once), the block reduces the tile's max, exponentiates, reduces the sum, and each thread rescales and
// accumulates its own output coordinates d = tid, tid + blockDim.. (The q heads of a GQA group read their keys
// in separate blocks.)
#ifdef ROTARY_ON_DEVICE
ROTARY_FN float kv_exp(float x) { return expf(x); }
ROTARY_FN double kv_exp(double x) { return exp(x); }
ROTARY_FN float kv_tanh(float x) { return tanhf(x); }
ROTARY_FN double kv_tanh(double x) { return tanh(x); }
ROTARY_FN double kv_neg_inf(double) { return __longlong_as_double((long long)0xfff0000000000000ull); }
#else
ROTARY_FN double kv_neg_inf(double) {
    const unsigned long long u = 0xfff0000000000000ull;
    double d;
    std::memcpy(&d, &u, 8);
    return d;
}
template <typename W> ROTARY_FN W kv_exp(W x) { return std::exp(x); }
template <typename W> ROTARY_FN W kv_tanh(W x) { return std::tanh(x); }
#endif

ROTARY_FN float kv_neg_inf(float) { return bits_to_float(0xff800000u); }

// the float32 value of float8_e4m3fn bits (exact: rotary.backends.kv_entries.FP8_VALUES)
ROTARY_FN float fp8_e4m3_value(unsigned char b) {
    const unsigned int e = (b >> 3) & 15u, m = b & 7u, sign = (unsigned int)(b >> 7) << 31;
    if (e == 15u && m == 7u) return bits_to_float(sign | 0x7fc00000u);
    if (e == 0u) return bits_to_float(sign | float_to_bits(rn_mul((float)m, 0x1p-9f)));
    return bits_to_float(sign | ((e + 120u) << 23) | (m << 20));
}

// entry d of a (slot, head) row, dequantized into W
template <typename T, typename W, int KIND> struct KvLoad;
template <typename T, typename W> struct KvLoad<T, W, 0> {
    static ROTARY_FN W at(const T* row, int d, W) { return load_float(row[d]); }
};
template <typename T, typename W> struct KvLoad<T, W, 1> {
    static ROTARY_FN W at(const signed char* row, int d, W scale) { return rn_mul(W(row[d]), scale); }
};
template <typename T, typename W> struct KvLoad<T, W, 2> {
    static ROTARY_FN W at(const unsigned char* row, int d, W scale) { return rn_mul(W(fp8_e4m3_value(row[d])), scale); }
};

// red[0] = op over red[0 .. blockDim.x) (all threads; each has written its red[tid]); red[0] read after return
template <bool MAX, typename W> ROTARY_FN void kv_block_reduce(W* red, int tid, int nthreads) {
    __syncthreads();
    for (int step = 1; step < nthreads; step *= 2) {
        if (tid % (2 * step) == 0 && tid + step < nthreads)
            red[tid] = MAX ? kv_max(red[tid], red[tid + step]) : rn_add(red[tid], red[tid + step]);
        __syncthreads();
    }
}

// the sequence of packed q row `row`: the last i < n with q_starts[i] <= row (q_starts non-decreasing, n > 0,
// q_starts[0] <= row < q_starts[n]: then q_starts[i + 1] > row, sequence i holds the row)
ROTARY_FN i64 kv_sequence_of(const i64* q_starts, i64 n, i64 row) {
    i64 lo = 0, hi = n;
    while (hi - lo > 1) {
        const i64 mid = lo + (hi - lo) / 2;
        if (q_starts[mid] <= row) lo = mid;
        else hi = mid;
    }
    return lo;
}

template <typename T, typename W, int KIND>
__global__ void paged_attention(
    const T* q, i64 qst, i64 qsh, i64 qsd, T* o,
    const typename KvEntry<T, KIND>::type* k_store, const typename KvEntry<T, KIND>::type* v_store,
    const W* k_scale, const W* v_scale, const i64* block_table, i64 table_width, i64 page_size,
    const i64* seq_lens, const i64* q_starts, i64 n_seqs, int q_heads, int kv_heads, int head_dim, W fold,
    W softcap, i64 window, int causal, int tile) {
    typedef typename KvEntry<T, KIND>::type E;
    ROTARY_DYNAMIC_SMEM(smem);
    W* qs = reinterpret_cast<W*>(smem);
    W* acc = qs + head_dim;
    W* p = acc + head_dim;
    W* red = p + tile;
    const int nthreads = blockDim.x;
    const int w_bytes = (2 * head_dim + tile + nthreads) * (int)sizeof(W);
    i64* slot_of = reinterpret_cast<i64*>(smem + (w_bytes + 7) / 8 * 8);   // [tile] (slot, head) of each key
    const int tid = threadIdx.x;
    const i64 block = blockIdx.x;
    const int hq = (int)(block % q_heads);
    const i64 qrow_index = block / q_heads;
    const int hk = hq / (q_heads / kv_heads);
    // every thread finds the same sequence (a few cached reads; no barrier needed before the key loop)
    const bool covered = n_seqs > 0 && qrow_index >= q_starts[0] && qrow_index < q_starts[n_seqs];
    const i64 i = covered ? kv_sequence_of(q_starts, n_seqs, qrow_index) : 0;
    i64 lo = 0, hi = -1;   // the keys seen: lo .. hi (none when hi < lo)
    if (covered) {
        const i64 length = seq_lens[i];
        const i64 pos = length - (q_starts[i + 1] - q_starts[i]) + (qrow_index - q_starts[i]);
        hi = causal ? pos : length - 1;
        lo = (causal && window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;
    }
    const T* qrow = q + qrow_index * qst + hq * qsh;
    for (int d = tid; d < head_dim; d += nthreads) {
        qs[d] = rn_mul(load_float(qrow[d * qsd]), fold);
        acc[d] = W(0);
    }
    const W neg_inf = kv_neg_inf(W(0));
    W m = neg_inf, l = W(0);
    __syncthreads();
    for (i64 base = lo; base <= hi; base += tile) {   // the same trip count in every thread
        const int n_tile = hi - base + 1 < tile ? (int)(hi - base + 1) : tile;
        for (int t = tid; t < n_tile; t += nthreads) {
            const i64 key = base + t;
            const i64 slot = block_table[i * table_width + key / page_size] * page_size + key % page_size;
            const i64 e = slot * kv_heads + hk;
            slot_of[t] = e;
            const E* krow = k_store + e * head_dim;
            const W ks = KIND == 0 ? W(1) : k_scale[e];
            W x = W(0);
            for (int d = 0; d < head_dim; ++d) x = rn_add(x, rn_mul(qs[d], KvLoad<T, W, KIND>::at(krow, d, ks)));
            p[t] = softcap > W(0) ? rn_mul(softcap, kv_tanh(x)) : x;
        }
        W part = neg_inf;
        __syncthreads();
        for (int t = tid; t < n_tile; t += nthreads) part = kv_max(part, p[t]);
        red[tid] = part;
        kv_block_reduce<true, W>(red, tid, nthreads);
        const W m_new = kv_max(m, red[0]);
        __syncthreads();   // red[0] read by all before the sum reuses red
        W sum = W(0);
        for (int t = tid; t < n_tile; t += nthreads) {
            const W w = kv_exp(rn_sub(p[t], m_new));
            p[t] = w;
            sum = rn_add(sum, w);
        }
        red[tid] = sum;
        kv_block_reduce<false, W>(red, tid, nthreads);   // its first barrier also publishes p
        const W corr = m == neg_inf ? W(0) : kv_exp(rn_sub(m, m_new));
        l = rn_add(rn_mul(l, corr), red[0]);
        m = m_new;
        for (int d = tid; d < head_dim; d += nthreads) {
            W a = rn_mul(acc[d], corr);
            for (int t = 0; t < n_tile; ++t) {
                const i64 e = slot_of[t];
                const W vs = KIND == 0 ? W(1) : v_scale[e];
                a = rn_add(a, rn_mul(p[t], KvLoad<T, W, KIND>::at(v_store + e * head_dim, d, vs)));
            }
            acc[d] = a;
        }
        __syncthreads();   // p, slot_of and red[0] read by all before the next tile
    }
    T* orow = o + (qrow_index * (i64)q_heads + hq) * head_dim;
    for (int d = tid; d < head_dim; d += nthreads)   // l == 0: no key seen
        orow[d] = Store<T>::from(l > W(0) ? rn_div(acc[d], l) : W(0));
}
