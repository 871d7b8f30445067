// rotary_common.cuh -- types and helpers shared by the rotary CUDA kernels.
//
// The kernels are compiled three ways from the same text:
//   * NVRTC through cupy.RawModule (the user path; compiled lazily per device),
//   * nvcc (tests/test_nvrtc.py compiles each file standalone and reports ptxas registers),
//   * the host C++ compiler through tests/cuda_shim/cuda_shim.h (tests run them on the CPU).
// So this file avoids CUDA headers (cuda_fp16.h is not on NVRTC's search path in pip installs),
// warp intrinsics and early returns before __syncthreads.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define ROTARY_ON_DEVICE 1
#define ROTARY_FN __device__ __forceinline__
#define ROTARY_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
// a register cap for `blocks` resident blocks of at most `threads` threads (nothing on the host shim)
#define ROTARY_LAUNCH_BOUNDS(threads, blocks) __launch_bounds__(threads, blocks)
#else
#include <cmath>
#include <cstring>
#define ROTARY_FN inline
#define ROTARY_DYNAMIC_SMEM(name) unsigned char* name = rotary_shim::dynamic_smem()
#define ROTARY_LAUNCH_BOUNDS(threads, blocks)
#endif

typedef long long i64;

// fp16 / bf16 storage types: 16 bits, converted to and from float32 (all arithmetic is fp32).
struct rotary_half { unsigned short bits; };
struct rotary_bfloat16 { unsigned short bits; };

ROTARY_FN float bits_to_float(unsigned int u) {
#ifdef ROTARY_ON_DEVICE
    return __uint_as_float(u);
#else
    float f;
    std::memcpy(&f, &u, 4);
    return f;
#endif
}

ROTARY_FN unsigned int float_to_bits(float f) {
#ifdef ROTARY_ON_DEVICE
    return __float_as_uint(f);
#else
    unsigned int u;
    std::memcpy(&u, &f, 4);
    return u;
#endif
}

// Correctly rounded single operations: each rounded on its own, never contracted into an FMA, so a kernel
// written with them gives the NumPy reference's bits. On the device the __*_rn intrinsics, which nvcc/NVRTC never
// fuse (a plain `a * b - c * d` may become an fma.rn under NVRTC's default --fmad=true). On the host (the test
// shim) the product or sum passes through an empty asm that the compiler cannot see into, so it is a rounded
// value in a register even when the shim is built with -ffp-contract=fast -mfma (tests/test_cuda_kernels_cpu.py
// builds it that way to prove the kernels never depend on the contraction setting). rint rounds half to even.
#ifdef ROTARY_ON_DEVICE
ROTARY_FN float rn_mul(float a, float b) { return __fmul_rn(a, b); }
ROTARY_FN float rn_add(float a, float b) { return __fadd_rn(a, b); }
ROTARY_FN float rn_sub(float a, float b) { return __fsub_rn(a, b); }
ROTARY_FN float rn_div(float a, float b) { return __fdiv_rn(a, b); }
ROTARY_FN double rn_mul(double a, double b) { return __dmul_rn(a, b); }
ROTARY_FN double rn_add(double a, double b) { return __dadd_rn(a, b); }
ROTARY_FN double rn_sub(double a, double b) { return __dsub_rn(a, b); }
ROTARY_FN double rn_div(double a, double b) { return __ddiv_rn(a, b); }
ROTARY_FN float rn_abs(float x) { return fabsf(x); }
ROTARY_FN double rn_abs(double x) { return fabs(x); }
ROTARY_FN float rn_rint(float x) { return rintf(x); }
ROTARY_FN double rn_rint(double x) { return rint(x); }
ROTARY_FN float rn_floor(float x) { return floorf(x); }
ROTARY_FN double rn_floor(double x) { return floor(x); }
#else
// the value as it is, rounded and in a register: no multiply-add can be fused across it
template <typename W> ROTARY_FN W rn_opaque(W x) {
#if defined(__x86_64__) || defined(__i386__)
    asm("" : "+x"(x));
#elif defined(__aarch64__)
    asm("" : "+w"(x));
#else
    volatile W v = x;
    x = v;
#endif
    return x;
}
template <typename W> ROTARY_FN W rn_mul(W a, W b) { return rn_opaque(a * b); }
template <typename W> ROTARY_FN W rn_add(W a, W b) { return rn_opaque(a + b); }
template <typename W> ROTARY_FN W rn_sub(W a, W b) { return rn_opaque(a - b); }
template <typename W> ROTARY_FN W rn_div(W a, W b) { return a / b; }
template <typename W> ROTARY_FN W rn_abs(W x) { return std::fabs(x); }
template <typename W> ROTARY_FN W rn_rint(W x) { return std::rint(x); }
template <typename W> ROTARY_FN W rn_floor(W x) { return std::floor(x); }
#endif

// The pair rotation, the one every kernel uses (rope.cu, kv_cache.cu, linear_attention.cu): with the pair's table
// values (c, s), y_a = x_a c - x_b s and y_b = x_b c + x_a s, each product and each sum rounded on its own in W, as
// NumPy computes `x_a * c - x_b * s` (rotary.backends.array_api.rotate_pairs). So a key the KV cache writes and
// the same key rotated by rotary.apply have the same bits on every device and compiler setting.
template <typename W> ROTARY_FN void rotate_pair(W xa, W xb, W c, W s, W& ya, W& yb) {
    ya = rn_sub(rn_mul(xa, c), rn_mul(xb, s));
    yb = rn_add(rn_mul(xb, c), rn_mul(xa, s));
}

ROTARY_FN float load_float(float x) { return x; }
ROTARY_FN double load_float(double x) { return x; }
ROTARY_FN float load_float(rotary_bfloat16 x) { return bits_to_float(((unsigned int)x.bits) << 16); }
ROTARY_FN float load_float(rotary_half x) {
#ifdef ROTARY_ON_DEVICE
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
#else
    _Float16 h;
    std::memcpy(&h, &x.bits, 2);
    return (float)h;
#endif
}

template <typename T> struct Store;
template <> struct Store<float> { static ROTARY_FN float from(float x) { return x; } };
template <> struct Store<double> { static ROTARY_FN double from(double x) { return x; } };
template <> struct Store<rotary_half> {
    static ROTARY_FN rotary_half from(float x) {
        rotary_half r;
#ifdef ROTARY_ON_DEVICE
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
#else
        _Float16 h = (_Float16)x;  // round to nearest even, like cvt.rn
        std::memcpy(&r.bits, &h, 2);
#endif
        return r;
    }
};
template <> struct Store<rotary_bfloat16> {
    // round to nearest even; NaN stays a (quiet) NaN with its sign
    static ROTARY_FN rotary_bfloat16 from(float x) {
        unsigned int u = float_to_bits(x);
        rotary_bfloat16 r;
        if ((u & 0x7fffffffu) > 0x7f800000u) {
            r.bits = (unsigned short)((u >> 16) | 0x0040u);
        } else {
            r.bits = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        }
        return r;
    }
};

// V consecutive elements moved as one aligned access (16 bytes at most).
template <typename T, int V> struct alignas(sizeof(T) * V) Vec { T v[V]; };

template <typename T, int V> ROTARY_FN void load_vec(const T* p, T (&dst)[V]) {
#ifndef ROTARY_ON_DEVICE
    rotary_shim::check_aligned(p, sizeof(Vec<T, V>));
#endif
    const Vec<T, V> chunk = *reinterpret_cast<const Vec<T, V>*>(p);
#pragma unroll
    for (int i = 0; i < V; ++i) dst[i] = chunk.v[i];
}

template <typename T, int V> ROTARY_FN void store_vec(T* p, const T (&src)[V]) {
#ifndef ROTARY_ON_DEVICE
    rotary_shim::check_aligned(p, sizeof(Vec<T, V>));
#endif
    Vec<T, V> chunk;
#pragma unroll
    for (int i = 0; i < V; ++i) chunk.v[i] = src[i];
    *reinterpret_cast<Vec<T, V>*>(p) = chunk;
}

ROTARY_FN int imin(int a, int b) { return a < b ? a : b; }
