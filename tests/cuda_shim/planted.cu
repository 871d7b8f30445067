// planted.cu -- deliberately broken kernels: each sanitizer mode of the host shim must catch its own
// (tests/test_cuda_sanitizers.py). Built only into the shim's test libraries (host.build(planted=True)),
// never into the CuPy backend. Launch with one block of n threads unless said otherwise.
#include "rotary_common.cuh"

// A missing __syncthreads: thread t writes s[t] and reads s[t + 1], which thread t + 1 writes in the
// same phase (ThreadSanitizer: a data race on shared memory).
__global__ void planted_race(float* out, int n) {
    ROTARY_DYNAMIC_SMEM(smem);
    float* s = reinterpret_cast<float*>(smem);
    const int t = threadIdx.x;
    s[t] = (float)t;
    out[t] = t + 1 < n ? s[t + 1] : 0.0f;  // needs a __syncthreads before this read
}

// An off-by-one global read: x has n elements, thread n - 1 reads x[n] (AddressSanitizer on the
// exact-extent copy of x).
__global__ void planted_oob_read(const float* x, float* out, int n) {
    const int t = threadIdx.x;
    if (t < n) out[t] = x[t] + x[t + 1];
}

// A read of shared memory no thread wrote: s has n + 1 slots, threads write s[0..n-1], thread n - 1
// reads s[n] (the two-poison compare: its output follows the poison).
__global__ void planted_unwritten_shared(const float* x, float* out, int n) {
    ROTARY_DYNAMIC_SMEM(smem);
    float* s = reinterpret_cast<float*>(smem);
    const int t = threadIdx.x;
    if (t < n) s[t] = x[t];
    __syncthreads();
    if (t < n) out[t] = s[t + 1];
}

// A __syncthreads inside a branch that only half the threads take (the shim's barrier check).
__global__ void planted_divergent_barrier(float* out, int n) {
    const int t = threadIdx.x;
    if (t < n / 2) __syncthreads();
    out[t] = (float)t;
}

// Blocks that update one global value without atomics: block b reads acc[0] and writes it back plus one
// (ThreadSanitizer with more than one block slot: a race between blocks, as the in-place z update of
// linear_attention.cu was before z_in/z_out).
__global__ void planted_block_race(float* acc, int n) {
    if (threadIdx.x == 0) acc[0] = acc[0] + 1.0f;
    (void)n;
}

// 32-bit offset arithmetic that overflows (UBSan: signed integer overflow), the bug class the kernels'
// 64-bit global offsets avoid: thread t computes t * stride in int.
__global__ void planted_int_overflow(float* out, int stride) {
    const int offset = (int)threadIdx.x * stride;
    if (threadIdx.x == 0) out[0] = (float)offset;
    out[threadIdx.x] = (float)(offset & 1);
}

// A pair rotation written plainly, y = a c - b s (what rope.cu computed before rotary_common.cuh's rotate_pair),
// next to rotate_pair itself: a build with contraction on (-ffp-contract=fast on FMA hardware, as NVRTC's default
// --fmad=true) fuses the plain one into an FMA and so rounds it differently from NumPy; rotate_pair never
// (tests/test_cuda_kernels_cpu.py: the contracted build must show the first and not the second). One block.
__global__ void planted_fused_rotation(const float* a, const float* b, const float* c, const float* s, float* plain,
                                       float* paired, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        plain[i] = a[i] * c[i] - b[i] * s[i];
        float yb;
        rotate_pair<float>(a[i], b[i], c[i], s[i], paired[i], yb);
    }
}
