// kv_cache.cu -- KV-cache append: rotate k, quantize k and v (or cast), write both into their cache slots; and
// paged attention over the cache (one block per GQA group, split-K with a log-sum-exp combine: the second half).
//
// The reference is rotary.backends.kv_entries.append_kv; every result here is bit for bit the same. Token t
// (of n_tokens) with table row r = rows[t] goes to slot slots[t]; for each k/v head h, with pairs i < rotary_dim/2
// of the layout at offset o ("half": (o+i, o+i+rotary_dim/2); "interleaved": (o+2i, o+2i+1)):
//     w_a = x_a cos[r, i] - x_b sin[r, i]
//     w_b = x_b cos[r, i] + x_a sin[r, i]            (W: float32, float64 for double; rotary_common.cuh's
//                                                     rotate_pair, as rope.cu: each product and sum rounded on
//                                                     its own, never an FMA)
// the coordinates outside [o, o + rotary_dim) pass through, and v is taken as it is (in W). With the per-head
// RMSNorm (kv_append<T, W, KIND, true>: Qwen3 / Gemma 3's k_norm, before the rotation; weight norm_weight, eps
// norm_eps, both unread by kv_append<T, W, KIND> = <..., false>) each key head x is first, in W,
//     x_d <- (x_d * inv) * weight[d],   inv = 1 / sqrt(ss / head_dim + eps),   ss = sum_d x_d^2
// (every coordinate normed, the rotated pairs and the ones that pass through; v never; each product and sum
// rounded on its own, ss summed by the row's group in a fixed tree: deterministic, not NumPy's pairwise order,
// so within rounding of the reference rather than its bits). Entries:
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
// units again (the same operations: the same bits) to write the entries. With NORM the group first reduces
// its k row's sum of squares the same way (ss partials over coordinates lane, lane + group, ...; the same shared
// memory, also for KIND 0), every thread of the group then holds inv. No warp intrinsics: the host shim runs the
// same text. KIND 0 without NORM needs no shared memory and no barrier.
#include "rotary_common.cuh"

// The quantizers' operations are rotary_common.cuh's rn_* (each correctly rounded on its own).

// max that keeps a NaN (NumPy's max propagates it); max is exact, so the reduction order never matters
template <typename W> ROTARY_FN W kv_max(W m, W x) { return (x > m || x != x) ? x : m; }

struct KvMaxOp { template <typename W> ROTARY_FN W operator()(W a, W b) const { return kv_max(a, b); } };
struct KvSumOp { template <typename W> ROTARY_FN W operator()(W a, W b) const { return rn_add(a, b); } };

// red[tid - lane] = op over the `group` partials red[tid - lane .. tid - lane + group) (each thread wrote its own
// red[tid] before; groups of consecutive threads, any group size, a fixed tree: the same result on every run).
// Threads with in_group false (idle ones) take no part in the sums. Every thread of the block calls it (barriers).
template <typename W, typename Op>
ROTARY_FN void kv_group_reduce(W* red, int tid, int lane, int group, bool in_group, Op op) {
    __syncthreads();
    for (int step = 1; step < group; step *= 2) {
        if (lane % (2 * step) == 0 && lane + step < group && in_group) red[tid] = op(red[tid], red[tid + step]);
        __syncthreads();
    }
}

// RMSNorm: the factor 1 / sqrt(ss / n + eps) of a head whose squares sum to ss (each operation rounded on its own)
#ifdef ROTARY_ON_DEVICE
ROTARY_FN float kv_sqrt(float x) { return __fsqrt_rn(x); }
ROTARY_FN double kv_sqrt(double x) { return __dsqrt_rn(x); }
#else
template <typename W> ROTARY_FN W kv_sqrt(W x) { return std::sqrt(x); }
#endif
template <typename W> ROTARY_FN W kv_rms_inv(W ss, int n, W eps) {
    return rn_div(W(1), kv_sqrt(rn_add(rn_div(ss, W(n)), eps)));
}

// coordinate d of a row in W; normed (x * inv) * weight[d] when norm (a uniform flag: without it, the load alone)
template <typename T, typename W>
ROTARY_FN W kv_load(const T* x, i64 sd, int d, const W* weight, W inv, int norm) {
    const W v = load_float(x[d * sd]);
    return norm ? rn_mul(rn_mul(v, inv), weight[d]) : v;
}

// this thread's part of the sum of squares of a row's coordinates d = first, first + stride, ... < n
template <typename T, typename W> ROTARY_FN W kv_sum_squares(const T* x, i64 sd, int first, int n, int stride) {
    W ss = W(0);
    for (int d = first; d < n; d += stride) {
        const W v = load_float(x[d * sd]);
        ss = rn_add(ss, rn_mul(v, v));
    }
    return ss;
}

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
// and work values (n = 2 for a pair, 1 otherwise); with norm, of the normed row (factor inv, weight).
template <typename T, typename W>
ROTARY_FN int kv_k_unit(const T* x, i64 sd, int u, int half, int offset, int rotary_dim, int interleaved,
                        const W* c_row, const W* s_row, const W* weight, W inv, int norm, int (&idx)[2],
                        W (&val)[2]) {
    if (u < half) {
        idx[0] = offset + (interleaved ? 2 * u : u);
        idx[1] = offset + (interleaved ? 2 * u + 1 : u + half);
        rotate_pair<W>(kv_load<T, W>(x, sd, idx[0], weight, inv, norm), kv_load<T, W>(x, sd, idx[1], weight, inv, norm),
                       c_row[u], s_row[u], val[0], val[1]);
        return 2;
    }
    const int j = u - half;
    idx[0] = j < offset ? j : j + rotary_dim;
    val[0] = kv_load<T, W>(x, sd, idx[0], weight, inv, norm);
    return 1;
}

template <typename T, typename W, int KIND, bool NORM = false>
__global__ void kv_append(
    const T* k, i64 kst, i64 ksh, i64 ksd, const T* v, i64 vst, i64 vsh, i64 vsd,
    const W* cos_table, const W* sin_table, const i64* rows, const i64* slots,
    typename KvEntry<T, KIND>::type* k_out, typename KvEntry<T, KIND>::type* v_out, W* k_scale, W* v_scale,
    i64 n_tokens, int heads, int head_dim, int rotary_dim, int offset, int interleaved, int group,
    int tokens_per_block, const W* norm_weight, W norm_eps) {
    typedef typename KvEntry<T, KIND>::type E;
    ROTARY_DYNAMIC_SMEM(smem);
    W* red = reinterpret_cast<W*>(smem);   // [blockDim.x] amax partials (KIND != 0), ss partials (NORM)
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
        W inv = W(1);
        if constexpr (NORM) {   // the k row's sum of squares over its group, then inv in each of its threads
            red[tid] = live && !is_v ? kv_sum_squares<T, W>(x, sd, lane, head_dim, group) : W(0);
            kv_group_reduce(red, tid, lane, group, row_in_round < per_round, KvSumOp());
            if (live && !is_v) inv = kv_rms_inv(red[tid - lane], head_dim, norm_eps);
            __syncthreads();   // every group has read its sum before red is written again
        }
        if constexpr (KIND == 0) {
            for (int u = lane; u < units; u += group) {
                if (is_v || u >= half) {   // v, unrotated coordinates: copied as they are (normed: in W)
                    const int d = is_v ? u : (u - half < offset ? u - half : u - half + rotary_dim);
                    if (is_v || !NORM) out[d] = x[d * sd];
                    else out[d] = Store<T>::from(kv_load<T, W>(x, sd, d, norm_weight, inv, 1));
                } else {
                    kv_k_unit<T, W>(x, sd, u, half, offset, rotary_dim, interleaved, c_row, s_row, norm_weight, inv,
                                    NORM, idx, val);
                    out[idx[0]] = Store<T>::from(val[0]);
                    out[idx[1]] = Store<T>::from(val[1]);
                }
            }
        } else {
            W amax = W(0);
            for (int u = lane; u < units; u += group) {
                int n = 1;
                if (is_v) val[0] = load_float(x[u * sd]);
                else n = kv_k_unit<T, W>(x, sd, u, half, offset, rotary_dim, interleaved, c_row, s_row, norm_weight,
                                         inv, NORM, idx, val);
                for (int j = 0; j < n; ++j) amax = kv_max(amax, rn_abs(val[j]));
            }
            red[tid] = amax;
            kv_group_reduce(red, tid, lane, group, row_in_round < per_round, KvMaxOp());
            const W scale = rn_div(red[tid - lane], KvQuant<KIND, W>::limit());
            for (int u = lane; u < units; u += group) {
                int n = 1;
                if (is_v) {
                    idx[0] = u;
                    val[0] = load_float(x[u * sd]);
                } else {
                    n = kv_k_unit<T, W>(x, sd, u, half, offset, rotary_dim, interleaved, c_row, s_row, norm_weight,
                                        inv, NORM, idx, val);
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
// q_starts[i] <= its row; empty sequences are passed over). Query head hq reads k/v head hq / G (G = q_heads /
// kv_heads). Keys seen: p <= pos (causal; also pos - p < window when window > 0), every p < seq_lens[i] otherwise;
// no other key (nor its table entry: pages before a window may be -1) is read. With fold = scale / softcap (scale
// without softcap): x_p = <fold q, k_p>, x_p = softcap tanh(x_p) with softcap, o = sum_p softmax(x)_p v_p, in W
// with entries dequantized in registers (entry * scale of its (slot, head); float8 bits decoded exactly), an online
// softmax over tiles of `tile` keys. A row that sees no key, and a q row outside q_starts[0] .. q_starts[n] - 1,
// gets 0. o is C-contiguous (T, q_heads, head_dim) in T. The tables are the caller's device arrays, read as they
// are (not range-checked). rotary_dim > 0: q is rotated as it is read (FlashInfer's fused RoPE), row r at table row
// q_rows[r] of q_cos / q_sin ((R, rotary_dim / 2) in W), pairs of the layout in rot_offset .. rot_offset +
// rotary_dim by rotate_pair in W (the append's rotation of a key); rotary_dim 0: q comes rotated (tables unread).
// has_norm: each q head is RMS-normed as it is read, before its rotation and the fold (Qwen3 / Gemma 3's q_norm):
// q_d <- (q_d * inv) * norm_weight[d], inv = 1 / sqrt(ss / head_dim + norm_eps), ss = sum_d q_d^2 in W (the append's
// k norm; the head's tpg softmax threads sum ss in a tree, its first thread puts inv in hv before the tile loop).
//
// One block per (q row, kv head, head chunk, split) (rotary.backends.cupy.paged_attention_geometry): the block
// takes the gb <= heads_per_block (<= KV_HEADS) q heads hq0 .. hq0 + gb - 1 of its kv head's GQA group (a group of
// more than KV_HEADS heads takes several head chunks) and reads each key and value of its key range once for all
// of them. Split s of `splits` takes keys lo + s * per .. lo + (s + 1) * per - 1 of the row's range lo .. hi, per =
// ceil((hi - lo + 1) / splits) rounded up to whole tiles (a split past hi has no key). Per tile of N = tile keys:
//   A. the tile's k and v rows are copied as raw entries into shared memory (16-byte loads, KV_STAGE_UNROLL in
//      flight per thread, when every row is 16-byte aligned: vec; else entry by entry, zero-padded to whole 16-byte
//      chunks); their slots and scales were looked up during the previous tile (double-buffered);
//   B. scores: nthreads / N threads per key, each over every (nthreads / N)-th 16-byte chunk of the key, the
//      chunk dequantized once in registers and multiplied with the gb q rows (fold q in shared memory) -> partial
//      scores sp[h][g][t] (times the key's scale);
//   P. softmax: nthreads / gb threads per q head sum a key's partials (softcap), reduce the tile max through
//      shared memory (every thread of the head reads its head's partial maxima), rescale: p = exp(x - m_new),
//      corr = exp(m_old - m_new) for the accumulators; each thread keeps its own part of l;
//   D. P.V: nthreads / nc key groups (nc = ceil(D / CV) chunks of CV entries), thread (group, chunk) accumulates
//      acc[g][0 .. CV) += p[g][t] * scale_t * v_t[chunk] for its keys and all gb heads, in registers.
// After the last tile the key groups' accumulators and the l parts are summed in shared memory; o = acc / l with
// splits == 1, else (acc, m, l) of the split go to part_o (rows, q_heads, splits, D) and part_ml (rows, q_heads,
// splits, 2) for paged_attention_combine. Dynamic shared memory: kv_attention_layout (the plan computes the same).
// No warp intrinsics and no early return (the host shim runs the same text); every barrier is reached by every
// thread (the tile loop's trip count and gb are the block's).
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

// q heads one block takes at most (a GQA group of more heads takes several blocks, each reading K/V)
constexpr int KV_HEADS = 8;
// threads of a paged_attention block at most (two such blocks per SM: at most 128 registers a thread)
constexpr int KV_MAX_THREADS = 256;

// one 16-byte chunk from global to shared memory (both 16-byte aligned): cp.async on sm_80 and later (nothing held
// in registers, every chunk of the tile in flight at once; complete after kv_copy_wait), else a load and a store
ROTARY_FN void kv_copy16(unsigned char* dst, const unsigned char* src) {
#if defined(ROTARY_ON_DEVICE) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned long long shared_addr;
    asm volatile("cvta.to.shared.u64 %0, %1;" : "=l"(shared_addr) : "l"((unsigned long long)dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((unsigned int)shared_addr),
                 "l"((unsigned long long)src) : "memory");
#else
    unsigned int v[4];
    load_vec<unsigned int, 4>(reinterpret_cast<const unsigned int*>(src), v);
    store_vec<unsigned int, 4>(reinterpret_cast<unsigned int*>(dst), v);
#endif
}

// this thread's kv_copy16 chunks have landed (a barrier after it shows them to the block)
ROTARY_FN void kv_copy_wait() {
#if defined(ROTARY_ON_DEVICE) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// M entries of a run of shared memory (aligned to its M * sizeof(entry) bytes, at most 16) as W values, without the
// entries' scale: exact (every entry value is a W value; float8 NaN stays NaN).
template <typename E, typename W, int KIND, int M> struct KvDecode {   // KIND 0: entries of the data type
    static ROTARY_FN void run(const unsigned char* p, W (&x)[M]) {
        E e[M];
        load_vec<E, M>(reinterpret_cast<const E*>(p), e);
#pragma unroll
        for (int j = 0; j < M; ++j) x[j] = load_float(e[j]);
    }
};
// the value of an int8 entry from its byte plus 128 (0 .. 255): the float 2^23 + (entry + 128) minus 2^23 + 128, exact
ROTARY_FN float kv_int8_value(unsigned int biased) { return bits_to_float(0x4b000000u | biased) - 8388736.0f; }

// the value of float8_e4m3fn bits e: sign to bit 31, exponent and mantissa to bits 20..26 give the value times
// 2^-120 as a float32 (a float32 subnormal for an e4m3 subnormal), then the exact product by 2^120; S.1111.111 is NaN
ROTARY_FN float kv_fp8_value(unsigned int e) {
    const unsigned int sign = (e & 0x80u) << 24;
    if ((e & 0x7fu) == 0x7fu) return bits_to_float(sign | 0x7fc00000u);
    return bits_to_float(sign | ((e & 0x7fu) << 20)) * 0x1p120f;
}

template <typename E, typename W, int KIND, int M> struct KvDecodeBytes {   // int8 / float8 entries
    static ROTARY_FN void run(const unsigned char* p, W (&x)[M]) {
        if constexpr (M % 4 == 0) {   // four to a 32-bit word
            unsigned int w[M / 4];
            load_vec<unsigned int, M / 4>(reinterpret_cast<const unsigned int*>(p), w);
#pragma unroll
            for (int i = 0; i < M / 4; ++i) {
                const unsigned int u = KIND == 1 ? w[i] ^ 0x80808080u : w[i];   // int8: each byte plus 128
#pragma unroll
                for (int b = 0; b < 4; ++b) {
                    const unsigned int byte = (u >> (8 * b)) & 0xffu;
                    x[4 * i + b] = W(KIND == 1 ? kv_int8_value(byte) : kv_fp8_value(byte));
                }
            }
        } else {
            unsigned char e[M];
            load_vec<unsigned char, M>(p, e);
#pragma unroll
            for (int j = 0; j < M; ++j)
                x[j] = W(KIND == 1 ? kv_int8_value((unsigned int)e[j] ^ 0x80u) : kv_fp8_value(e[j]));
        }
    }
};
template <typename E, typename W, int M> struct KvDecode<E, W, 1, M> : KvDecodeBytes<E, W, 1, M> {};
template <typename E, typename W, int M> struct KvDecode<E, W, 2, M> : KvDecodeBytes<E, W, 2, M> {};

// M consecutive W values of shared memory, 16 bytes at a time (p 16-byte aligned, M * sizeof(W) a multiple of 16)
template <typename W, int M> ROTARY_FN void kv_load_w(const W* p, W (&x)[M]) {
    constexpr int V = 16 / (int)sizeof(W);
    static_assert(M % V == 0, "whole 16-byte runs");
#pragma unroll
    for (int i = 0; i < M / V; ++i) {
        W part[V];
        load_vec<W, V>(p + i * V, part);
#pragma unroll
        for (int j = 0; j < V; ++j) x[i * V + j] = part[j];
    }
}

// byte offsets of paged_attention's dynamic shared memory (rotary.backends.cupy.paged_attention_layout: the same)
struct KvAttentionLayout {
    int row_stride;   // bytes per staged row: whole 16-byte chunks, an odd number of them (conflict-free reads)
    int qs, sp, pt, red, hv, scl, slot, total;   // rows (2 * tile staged rows; at the end the key groups' sums) at 0
};
ROTARY_FN int kv_round16(int n) { return (n + 15) / 16 * 16; }
template <int ESZ, int WSZ, int CE, int CV>
ROTARY_FN KvAttentionLayout kv_attention_layout(int head_dim, int threads, int tile, int heads) {
    KvAttentionLayout L;
    const int nck = (head_dim * ESZ + 15) / 16, nc = (head_dim + CV - 1) / CV;
    L.row_stride = (nck % 2 ? nck : nck + 1) * 16;
    const int stage = 2 * tile * L.row_stride, sums = threads / nc * nc * CV * WSZ;
    L.qs = kv_round16(stage > sums ? stage : sums);
    L.sp = L.qs + kv_round16(heads * nck * CE * WSZ);              // q: [heads][nck * CE]
    L.pt = L.sp + kv_round16(threads / tile * heads * tile * WSZ);    // scores: [threads / tile][heads][tile]
    L.red = L.pt + kv_round16(tile * KV_HEADS * WSZ);                 // p: [tile][KV_HEADS]
    L.hv = L.red + kv_round16(threads * WSZ);                       // [threads]
    L.scl = L.hv + kv_round16(3 * heads * WSZ);                     // corr, l, m: [3][heads]
    L.slot = L.scl + kv_round16(4 * tile * WSZ);                    // scales: [2 buffers][k, v][tile]
    L.total = L.slot + 2 * tile * 8;                                // entry rows: [2 buffers][tile] (i64)
    return L;
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

// the entry rows (slot * kv_heads + hk) of keys base .. base + n - 1 and, quantized, their k and v scales
template <typename W, int KIND>
ROTARY_FN void kv_tile_slots(i64 base, int n, const i64* table_row, i64 page_size, int kv_heads, int hk,
                             const W* k_scale, const W* v_scale, i64* slot_of, W* scales, int tile) {
    for (int t = threadIdx.x; t < n; t += blockDim.x) {
        const i64 key = base + t;
        const i64 e = (table_row[key / page_size] * page_size + key % page_size) * kv_heads + hk;
        slot_of[t] = e;
        if constexpr (KIND != 0) {
            scales[t] = k_scale[e];
            scales[tile + t] = v_scale[e];
        }
    }
}

template <typename T, typename W, int KIND>
__global__ void ROTARY_LAUNCH_BOUNDS(KV_MAX_THREADS, 2) paged_attention(
    const T* q, i64 qst, i64 qsh, i64 qsd, T* o, W* part_o, W* part_ml,
    const typename KvEntry<T, KIND>::type* k_store, const typename KvEntry<T, KIND>::type* v_store,
    const W* k_scale, const W* v_scale, const i64* block_table, i64 table_width, i64 page_size,
    const i64* seq_lens, const i64* q_starts, i64 n_seqs, int q_heads, int kv_heads, int head_dim, W fold,
    W softcap, i64 window, int causal, int tile, int heads_per_block, int splits, int vec, const W* q_cos,
    const W* q_sin, const i64* q_rows, int rotary_dim, int rot_offset, int interleaved, const W* norm_weight,
    W norm_eps, int has_norm) {
    typedef typename KvEntry<T, KIND>::type E;
    constexpr int ESZ = (int)sizeof(E), WSZ = (int)sizeof(W);
    constexpr int CE = 16 / ESZ;                                    // entries of a 16-byte chunk (scores)
    constexpr int CB = CE < 8 ? CE : 8;                             // entries decoded at a time (scores)
    constexpr int CV = CE < 16 / WSZ ? CE : 16 / WSZ;               // entries of a P.V chunk (16 bytes of W)
    constexpr int PV = 16 / WSZ;                                    // p values of a 16-byte load
    ROTARY_DYNAMIC_SMEM(smem);
    const int nthreads = blockDim.x, tid = threadIdx.x;
    const int D = head_dim, N = tile, HB = heads_per_block;
    const KvAttentionLayout L = kv_attention_layout<ESZ, WSZ, CE, CV>(D, nthreads, N, HB);
    const int nck = (D * ESZ + 15) / 16, dq = nck * CE, nc = (D + CV - 1) / CV;
    unsigned char* rows = smem;                                     // [2 * N][row_stride]: k rows, v rows
    W* qs = reinterpret_cast<W*>(smem + L.qs);
    W* sp = reinterpret_cast<W*>(smem + L.sp);
    W* pt = reinterpret_cast<W*>(smem + L.pt);
    W* red = reinterpret_cast<W*>(smem + L.red);
    W* hv = reinterpret_cast<W*>(smem + L.hv);
    W* scl = reinterpret_cast<W*>(smem + L.scl);
    i64* slot_of = reinterpret_cast<i64*>(smem + L.slot);

    // the block: (q row, kv head, head chunk, split)
    const int group = q_heads / kv_heads;
    const int chunks = (group + HB - 1) / HB;
    i64 b = blockIdx.x;
    const int split = (int)(b % splits);
    b /= splits;
    const int hc = (int)(b % chunks);
    b /= chunks;
    const int hk = (int)(b % kv_heads);
    const i64 qrow = b / kv_heads;
    const int hq0 = hk * group + hc * HB;
    const int gb = imin(HB, group - hc * HB);

    // the row's keys lo .. hi, then the split's (none when hi < lo); every thread finds the same
    const bool covered = n_seqs > 0 && qrow >= q_starts[0] && qrow < q_starts[n_seqs];
    const i64 i = covered ? kv_sequence_of(q_starts, n_seqs, qrow) : 0;
    i64 lo = 0, hi = -1;
    if (covered) {
        const i64 length = seq_lens[i];
        const i64 pos = length - (q_starts[i + 1] - q_starts[i]) + (qrow - q_starts[i]);
        hi = causal ? pos : length - 1;
        lo = (causal && window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;
    }
    if (hi >= lo) {
        const i64 per = ((hi - lo + 1 + splits - 1) / splits + N - 1) / N * N;
        const i64 first = lo + split * per;
        hi = first + per - 1 < hi ? first + per - 1 : hi;
        lo = first;
    }

    // the threads' roles: staging (chunk my_u of rows my_r, my_r + rp, ...), scores (key my_t, part my_h),
    // softmax (q head my_g, lane my_lane), P.V (key group my_kg, chunk my_c)
    const int units = vec ? nck : dq;
    const int cl = imin(units, nthreads), rp = nthreads / cl;
    const int my_u = tid % cl, my_r = tid / cl;
    const int splitd = nthreads / N, my_t = tid % N, my_h = tid / N;
    const int tpg = nthreads / gb, my_g = tid / tpg, my_lane = tid % tpg;
    const int kgs = nthreads / nc, my_c = tid % nc, my_kg = tid / nc;

    const T* qrow_p = q + qrow * qst;
    const int rot_half = rotary_dim / 2;
    if (has_norm) {   // (uniform) each q head's sum of squares over its tpg threads; hv[g] = its inv until tile 0's P
        red[tid] = my_g < gb ? kv_sum_squares<T, W>(qrow_p + (hq0 + my_g) * qsh, qsd, my_lane, D, tpg) : W(0);
        kv_group_reduce(red, tid, my_lane, tpg, my_g < gb, KvSumOp());
        if (my_g < gb && my_lane == 0) hv[my_g] = kv_rms_inv(red[tid], D, norm_eps);
        __syncthreads();
    }
    for (int x = tid; x < HB * dq; x += nthreads) {
        const int g = x / dq, d = x - g * dq;
        W val = W(0);
        if (g < gb && d < D) {
            const T* qh = qrow_p + (hq0 + g) * qsh;
            const W inv = has_norm ? hv[g] : W(1);
            const int r = d - rot_offset;
            if (r >= 0 && r < rotary_dim) {   // q rotated as it is read (rotary_dim 0: q comes rotated)
                const int p = interleaved ? r / 2 : (r < rot_half ? r : r - rot_half);
                const int da = rot_offset + (interleaved ? 2 * p : p), db = da + (interleaved ? 1 : rot_half);
                const i64 t = q_rows[qrow] * rot_half + p;
                W ya, yb;
                rotate_pair<W>(kv_load<T, W>(qh, qsd, da, norm_weight, inv, has_norm),
                               kv_load<T, W>(qh, qsd, db, norm_weight, inv, has_norm), q_cos[t], q_sin[t], ya, yb);
                val = d == da ? ya : yb;
            } else {
                val = kv_load<T, W>(qh, qsd, d, norm_weight, inv, has_norm);
            }
            val = val * fold;
        }
        qs[x] = val;
    }
    const i64* table_row = block_table + i * table_width;
    if (hi >= lo)
        kv_tile_slots<W, KIND>(lo, hi - lo + 1 < N ? (int)(hi - lo + 1) : N, table_row, page_size, kv_heads, hk,
                               k_scale, v_scale, slot_of, scl, N);
    const W neg_inf = kv_neg_inf(W(0));
    W m_run = neg_inf, l_run = W(0);
    W acc[KV_HEADS][CV];
#pragma unroll
    for (int g = 0; g < KV_HEADS; ++g)
#pragma unroll
        for (int j = 0; j < CV; ++j) acc[g][j] = W(0);
    __syncthreads();   // q and the first tile's slots

    int buf = 0;
    for (i64 base = lo; base <= hi; base += N, buf ^= 1) {   // the same trip count in every thread
        const int n_tile = hi - base + 1 < N ? (int)(hi - base + 1) : N;
        const i64* so = slot_of + buf * N;
        const W* k_sc = scl + buf * 2 * N;
        const W* v_sc = k_sc + N;
        // A: stage the tile's k rows (0 .. n_tile - 1) and v rows (N .. N + n_tile - 1) as raw entries
        if (my_r < rp) {
            if (vec) {
                for (int r = my_r; r < 2 * n_tile; r += rp) {
                    const E* src = r < n_tile ? k_store + so[r] * D : v_store + so[r - n_tile] * D;
                    unsigned char* dst = rows + (r < n_tile ? r : N + r - n_tile) * L.row_stride;
                    for (int c = my_u; c < nck; c += cl)
                        kv_copy16(dst + 16 * c, reinterpret_cast<const unsigned char*>(src) + 16 * c);
                }
                kv_copy_wait();
            } else {
                for (int r = my_r; r < 2 * n_tile; r += rp) {
                    const E* src = r < n_tile ? k_store + so[r] * D : v_store + so[r - n_tile] * D;
                    E* dst = reinterpret_cast<E*>(rows + (r < n_tile ? r : N + r - n_tile) * L.row_stride);
                    for (int d = my_u; d < dq; d += cl) dst[d] = d < D ? src[d] : E();
                }
            }
        }
        __syncthreads();
        // B: partial scores of key my_t over chunks my_h, my_h + splitd, ... for the gb q heads
        if (my_h < splitd && my_t < n_tile) {
            W s[KV_HEADS];
#pragma unroll
            for (int g = 0; g < KV_HEADS; ++g) s[g] = W(0);
            const unsigned char* krow = rows + my_t * L.row_stride;
            for (int c = my_h; c < nck; c += splitd) {
#pragma unroll
                for (int half = 0; half < CE; half += CB) {
                    W x[CB];
                    KvDecode<E, W, KIND, CB>::run(krow + 16 * c + half * ESZ, x);
#pragma unroll
                    for (int g = 0; g < KV_HEADS; ++g) {
                        if (g < gb) {
                            W qv[CB];
                            kv_load_w<W, CB>(qs + g * dq + c * CE + half, qv);
#pragma unroll
                            for (int j = 0; j < CB; ++j) s[g] += qv[j] * x[j];
                        }
                    }
                }
            }
            const W k_s = KIND == 0 ? W(1) : k_sc[my_t];
#pragma unroll
            for (int g = 0; g < KV_HEADS; ++g)
                if (g < gb) sp[(my_h * HB + g) * N + my_t] = s[g] * k_s;
        }
        __syncthreads();
        // P: each head's scores (partials summed, softcap), the tile max, p = exp(x - m_new), corr, l
        W m_part = neg_inf;
        if (my_g < gb) {
            for (int t = my_lane; t < n_tile; t += tpg) {
                W x = sp[my_g * N + t];
                for (int h = 1; h < splitd; ++h) x += sp[(h * HB + my_g) * N + t];
                if (softcap > W(0)) x = softcap * kv_tanh(x);
                sp[my_g * N + t] = x;
                m_part = kv_max(m_part, x);
            }
        }
        red[tid] = m_part;
        __syncthreads();
        if (my_g < gb) {
            W m_tile = neg_inf;
            for (int j = 0; j < tpg; ++j) m_tile = kv_max(m_tile, red[my_g * tpg + j]);
            const W m_new = kv_max(m_run, m_tile);
            const W corr = m_run == neg_inf ? W(0) : kv_exp(m_run - m_new);
            W l_tile = W(0);
            for (int t = my_lane; t < n_tile; t += tpg) {
                const W p = kv_exp(sp[my_g * N + t] - m_new);
                pt[t * KV_HEADS + my_g] = p;
                l_tile += p;
            }
            l_run = l_run * corr + l_tile;
            m_run = m_new;
            if (my_lane == 0) hv[my_g] = corr;
        }
        __syncthreads();
        // D: acc[g] = acc[g] * corr[g] + sum over the key group's keys of p[g][t] * v_scale[t] * v_t[chunk]
        if (my_kg < kgs) {
#pragma unroll
            for (int g = 0; g < KV_HEADS; ++g) {
                if (g < gb) {
                    const W corr = hv[g];
#pragma unroll
                    for (int j = 0; j < CV; ++j) acc[g][j] *= corr;
                }
            }
            for (int t = my_kg; t < n_tile; t += kgs) {
                W x[CV];
                KvDecode<E, W, KIND, CV>::run(rows + (N + t) * L.row_stride + my_c * CV * ESZ, x);
                const W v_s = KIND == 0 ? W(1) : v_sc[t];
#pragma unroll
                for (int g0 = 0; g0 < KV_HEADS; g0 += PV) {
                    if (g0 < gb) {
                        W p[PV];   // (p of heads past gb: not read)
                        kv_load_w<W, PV>(pt + t * KV_HEADS + g0, p);
#pragma unroll
                        for (int g = g0; g < g0 + PV; ++g) {
                            if (g < gb) {
                                const W pv = p[g - g0] * v_s;
#pragma unroll
                                for (int j = 0; j < CV; ++j) acc[g][j] += pv * x[j];
                            }
                        }
                    }
                }
            }
        }
        // the next tile's slots and scales, into the other buffer (its readers finished before this tile's A barrier)
        if (base + N <= hi)
            kv_tile_slots<W, KIND>(base + N, hi - base - N + 1 < N ? (int)(hi - base - N + 1) : N, table_row,
                                   page_size, kv_heads, hk, k_scale, v_scale, slot_of + (buf ^ 1) * N,
                                   scl + (buf ^ 1) * 2 * N, N);
        __syncthreads();   // the tile's shared memory read by all before the next one is staged
    }

    // l of each head (its threads' parts), then per head the key groups' accumulators summed through shared memory
    red[tid] = my_g < gb ? l_run : W(0);
    __syncthreads();
    if (my_g < gb && my_lane == 0) {
        W l = W(0);
        for (int j = 0; j < tpg; ++j) l += red[my_g * tpg + j];
        hv[HB + my_g] = l;
        hv[2 * HB + my_g] = m_run;
    }
    W* sums = reinterpret_cast<W*>(rows);   // [kgs][nc * CV]
    const int sw = nc * CV;
#pragma unroll
    for (int g = 0; g < KV_HEADS; ++g) {
        if (g < gb) {
            if (my_kg < kgs) {
#pragma unroll
                for (int j = 0; j < CV; ++j) sums[my_kg * sw + my_c * CV + j] = acc[g][j];
            }
            __syncthreads();   // (the first also publishes hv's l and m)
            const W l = hv[HB + g];
            const i64 out_row = qrow * q_heads + hq0 + g;
            for (int d = tid; d < D; d += nthreads) {
                W a = W(0);
                for (int k = 0; k < kgs; ++k) a += sums[k * sw + d];
                if (splits == 1) o[out_row * D + d] = Store<T>::from(l != W(0) ? a / l : W(0));   // (NaN stays NaN)
                else part_o[(out_row * splits + split) * D + d] = a;
            }
            if (splits > 1 && tid == 0) {
                part_ml[(out_row * splits + split) * 2] = hv[2 * HB + g];
                part_ml[(out_row * splits + split) * 2 + 1] = l;
            }
            __syncthreads();   // sums read by all before the next head's are written
        }
    }
}

// paged_attention_combine -- the splits of each (q row, q head) merged by log-sum-exp, after a paged_attention
// launch with splits > 1. Split s left acc_s = sum_p exp(x_p - m_s) v_p over its keys, m_s and l_s = sum_p
// exp(x_p - m_s) (l_s = 0: no key); with M = max m_s over the splits with keys and w_s = exp(m_s - M) (0 for a split
// without keys), o = sum_s w_s acc_s / sum_s w_s l_s, or 0 when no split has a key. One block per (q row, q head):
// grid.x = rows * q_heads, any blockDim.x; dynamic shared memory w[splits] (W).
template <typename T, typename W>
__global__ void paged_attention_combine(const W* part_o, const W* part_ml, T* o, int splits, int head_dim) {
    ROTARY_DYNAMIC_SMEM(smem);
    W* w = reinterpret_cast<W*>(smem);
    const int tid = threadIdx.x, nthreads = blockDim.x;
    const i64 r = blockIdx.x;
    const W* ml = part_ml + r * splits * 2;
    W m = kv_neg_inf(W(0));
    for (int s = 0; s < splits; ++s)
        if (ml[2 * s + 1] != W(0)) m = kv_max(m, ml[2 * s]);
    for (int s = tid; s < splits; s += nthreads) w[s] = ml[2 * s + 1] != W(0) ? kv_exp(ml[2 * s] - m) : W(0);
    __syncthreads();
    W l = W(0);
    for (int s = 0; s < splits; ++s) l += w[s] * ml[2 * s + 1];
    const W* acc = part_o + r * splits * head_dim;
    for (int d = tid; d < head_dim; d += nthreads) {
        W a = W(0);
        for (int s = 0; s < splits; ++s) a += w[s] * acc[(i64)s * head_dim + d];
        o[r * head_dim + d] = Store<T>::from(l != W(0) ? a / l : W(0));
    }
}
