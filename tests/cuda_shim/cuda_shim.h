// cuda_shim.h -- run CUDA kernel sources on the CPU (test harness only, not a backend).
//
// One host thread per CUDA thread of a block; the blocks of a grid run one after another on the
// same blockDim.x threads. __syncthreads is a C++20 std::barrier across those threads, dynamic
// shared memory is one buffer reused block after block (never zeroed, like the GPU's), and
// blockIdx/threadIdx are thread_local. 1-D grids and blocks only; no warp intrinsics (the kernels
// do not use any). Kernel arguments arrive as `void** args`, one pointer per parameter, exactly
// like cuLaunchKernel's kernelParams, so the Python side builds them from the same launch plan.
#pragma once

#include <barrier>
#include <cstddef>
#include <cstring>
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

inline unsigned char* dynamic_smem() { return shared_buffer.data(); }

template <typename... P, std::size_t... I>
std::tuple<std::decay_t<P>...> unpack(void** args, std::index_sequence<I...>) {
    return std::tuple<std::decay_t<P>...>(*static_cast<std::decay_t<P>*>(args[I])...);
}

// Run kernel<<<grid, block, shared_bytes>>>(args...) to completion.
template <typename... P>
void launch(void (*kernel)(P...), unsigned grid, unsigned block, std::size_t shared_bytes, void** args) {
    const auto values = unpack<P...>(args, std::index_sequence_for<P...>{});
    shared_buffer.assign(shared_bytes + 16, 0xA5);  // garbage, not zeros
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
