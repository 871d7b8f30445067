// cuda_shim.h -- run CUDA kernel sources on the CPU (test harness only, not a backend).
//
// One host thread per CUDA thread of a block; the blocks of a grid run one after another on the
// same blockDim.x threads. __syncthreads is a C++20 std::barrier across those threads, dynamic
// shared memory is one buffer reused block after block (never zeroed, like the GPU's), and
// blockIdx/threadIdx are thread_local. 1-D grids and blocks only; no warp intrinsics (the kernels
// do not use any). Kernel arguments arrive as `void** args`, one pointer per parameter, exactly
// like cuLaunchKernel's kernelParams, so the Python side builds them from the same launch plan.
// Problems a GPU would fault on or silently misread are reported through `error`: an argument
// count or size that differs from the kernel's parameters, a misaligned vector access (checked in
// rotary_common.cuh's load_vec/store_vec), a write past the requested dynamic shared memory.
#pragma once

#include <barrier>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

struct rotary_shim_dim3 {
    unsigned x, y, z;
};

namespace rotary_shim {
inline thread_local rotary_shim_dim3 block_idx{0, 0, 0};
inline thread_local rotary_shim_dim3 thread_idx{0, 0, 0};
inline rotary_shim_dim3 block_dim{1, 1, 1};
inline rotary_shim_dim3 grid_dim{1, 1, 1};
inline std::barrier<>* block_barrier = nullptr;
inline std::vector<unsigned char> shared_buffer;
inline constexpr std::size_t shared_guard = 64;   // bytes past the requested size, checked after a launch
inline std::mutex error_lock;
inline std::string error;                        // first problem of the last launch ("" if none)

inline unsigned char* dynamic_smem() { return shared_buffer.data(); }

inline void report(const std::string& what) {
    std::lock_guard<std::mutex> guard(error_lock);
    if (error.empty()) error = what;
}

// What a GPU would fault on: a vector access not aligned to its size.
inline void check_aligned(const void* p, std::size_t bytes) {
    if (reinterpret_cast<std::uintptr_t>(p) % bytes)
        report("misaligned " + std::to_string(bytes) + "-byte vector access");
}

template <typename... P, std::size_t... I>
std::tuple<std::decay_t<P>...> unpack(void** args, std::index_sequence<I...>) {
    return std::tuple<std::decay_t<P>...>(*static_cast<std::decay_t<P>*>(args[I])...);
}

// Run kernel<<<grid, block, shared_bytes>>>(args...) to completion. sizes[i] is the byte size of the
// value behind args[i]; a count or size that differs from the kernel's parameters is an error (where a
// real launch would silently read garbage).
template <typename... P>
void launch(void (*kernel)(P...), unsigned grid, unsigned block, std::size_t shared_bytes, void** args,
            const std::size_t* sizes, std::size_t n_args) {
    error.clear();
    const std::size_t expected[] = {sizeof(std::decay_t<P>)..., 0};
    if (n_args != sizeof...(P)) {
        report("kernel takes " + std::to_string(sizeof...(P)) + " arguments, got " + std::to_string(n_args));
        return;
    }
    for (std::size_t i = 0; i < n_args; ++i)
        if (sizes[i] != expected[i]) {
            report("argument " + std::to_string(i) + " has " + std::to_string(sizes[i]) + " bytes, the kernel's " +
                   std::to_string(expected[i]));
            return;
        }
    if (block == 0 || block > 1024 || grid == 0) {
        report("bad launch geometry");
        return;
    }
    const auto values = unpack<P...>(args, std::index_sequence_for<P...>{});
    shared_buffer.assign(shared_bytes + shared_guard, 0xFF);  // NaN garbage: reading it unwritten shows
    block_dim = {block, 1, 1};
    grid_dim = {grid, 1, 1};
    std::barrier<> barrier(block);
    block_barrier = &barrier;
    std::vector<std::thread> threads;
    threads.reserve(block);
    for (unsigned t = 0; t < block; ++t) {
        threads.emplace_back([&, t] {
            thread_idx = {t, 0, 0};
            for (unsigned b = 0; b < grid; ++b) {
                block_idx = {b, 0, 0};
                std::apply(kernel, values);
                barrier.arrive_and_wait();  // the block is done before its shared memory is reused
            }
        });
    }
    for (auto& th : threads) th.join();
    block_barrier = nullptr;
    for (std::size_t i = shared_bytes; i < shared_buffer.size(); ++i)
        if (shared_buffer[i] != 0xFF) {
            report("write past the end of dynamic shared memory");
            break;
        }
}
}  // namespace rotary_shim

#define blockIdx rotary_shim::block_idx
#define threadIdx rotary_shim::thread_idx
#define blockDim rotary_shim::block_dim
#define gridDim rotary_shim::grid_dim
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __restrict__
#define __align__(n) alignas(n)

inline void __syncthreads() { rotary_shim::block_barrier->arrive_and_wait(); }
