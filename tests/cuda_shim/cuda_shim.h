// cuda_shim.h -- run CUDA kernel sources on the CPU (test harness only, not a backend).
//
// One host thread per CUDA thread of a block. The blocks of a grid run on `slots` sets of blockDim.x
// threads (block b on slot b % slots; the blocks of one slot one after another), so with slots > 1
// blocks run concurrently like on a GPU, and ThreadSanitizer sees races between blocks as well as
// between the threads of a block. __syncthreads is a barrier across the threads of a slot that also
// checks every thread reached the same __syncthreads (a divergent barrier is an error, where a GPU
// would hang or silently mis-synchronise). Each slot has its own dynamic shared memory, filled with
// the `poison` byte before every block (like the GPU's, it is never zeroed; a kernel whose output
// changes with the poison reads shared memory it did not write -- host.py's compare mode runs every
// launch under two poisons). blockIdx/threadIdx are thread_local. 1-D grids and blocks only; no warp
// intrinsics and no static __shared__ arrays (the kernels use dynamic shared memory only).
// Kernel arguments arrive as `void** args`, one pointer per parameter, exactly like cuLaunchKernel's
// kernelParams, so the Python side builds them from the same launch plan.
// Problems a GPU would fault on or silently misread are reported through `error`: an argument
// count or size that differs from the kernel's parameters, a misaligned vector access (checked in
// rotary_common.cuh's load_vec/store_vec), a write past the requested dynamic shared memory, a
// divergent __syncthreads. Built with -fsanitize=address, shared memory past the requested size is
// poisoned too (an out-of-bounds read trips ASan) and rotary_shim_alloc poisons its front pad.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <source_location>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define ROTARY_SHIM_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ROTARY_SHIM_ASAN 1
#endif
#endif
#ifdef ROTARY_SHIM_ASAN
#include <sanitizer/asan_interface.h>
#define ROTARY_SHIM_POISON(p, n) __asan_poison_memory_region((p), (n))
#define ROTARY_SHIM_UNPOISON(p, n) __asan_unpoison_memory_region((p), (n))
#else
#define ROTARY_SHIM_POISON(p, n) ((void)(p), (void)(n))
#define ROTARY_SHIM_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

struct rotary_shim_dim3 {
    unsigned x, y, z;
};

namespace rotary_shim {
inline thread_local rotary_shim_dim3 block_idx{0, 0, 0};
inline thread_local rotary_shim_dim3 thread_idx{0, 0, 0};
inline rotary_shim_dim3 block_dim{1, 1, 1};
inline rotary_shim_dim3 grid_dim{1, 1, 1};
inline constexpr std::size_t shared_guard = 64;  // bytes past the requested size, checked after each block
inline std::mutex error_lock;
inline std::string error;  // first problem of the last launch ("" if none)

// Settings (rotary_shim_configure): concurrent block slots and the shared-memory fill byte.
inline unsigned config_slots = 1;
inline unsigned char config_poison = 0xFF;  // 0xFF..: NaN in every float width

inline void report(const std::string& what) {
    std::lock_guard<std::mutex> guard(error_lock);
    if (error.empty()) error = what;
}

// What a GPU would fault on: a vector access not aligned to its size.
inline void check_aligned(const void* p, std::size_t bytes) {
    if (reinterpret_cast<std::uintptr_t>(p) % bytes)
        report("misaligned " + std::to_string(bytes) + "-byte vector access");
}

// The barrier of one slot: all live threads must arrive at the same call site (file:line), else the
// launch reports a divergent __syncthreads and every later wait returns at once (no hang).
class BlockBarrier {
  public:
    explicit BlockBarrier(unsigned n) : live_(n) {}

    void wait(unsigned line, const char* file) {
        std::unique_lock<std::mutex> lock(m_);
        if (broken_) return;
        if (arrived_ == 0) {
            line_ = line;
            file_ = file;
        } else if (line != line_ || std::strcmp(file, file_) != 0) {
            diverge("threads of a block wait at different __syncthreads (" + where(file_, line_) + " and " +
                    where(file, line) + ")");
            return;
        }
        if (++arrived_ == live_) {
            complete();
            return;
        }
        const unsigned long gen = generation_;
        cv_.wait(lock, [&] { return generation_ != gen || broken_; });
    }

    // A thread has run all its blocks: threads still waiting wait at a barrier it never reached.
    void drop() {
        std::lock_guard<std::mutex> lock(m_);
        --live_;
        if (!broken_ && arrived_ > 0 && arrived_ == live_)
            diverge("__syncthreads at " + where(file_, line_) + " not reached by every thread of the block");
    }

    std::function<void()> on_block_end;  // run once per block, by the last thread to finish it
    static constexpr unsigned block_end_line = 0;

  private:
    static std::string where(const char* file, unsigned line) {
        if (line == block_end_line) return "the end of the block";
        const char* base = std::strrchr(file, '/');
        return std::string(base ? base + 1 : file) + ":" + std::to_string(line);
    }
    void diverge(const std::string& what) {
        report("divergent barrier: " + what);
        broken_ = true;
        cv_.notify_all();
    }
    void complete() {
        if (line_ == block_end_line && on_block_end) on_block_end();
        arrived_ = 0;
        ++generation_;
        cv_.notify_all();
    }

    std::mutex m_;
    std::condition_variable cv_;
    unsigned live_, arrived_ = 0, line_ = 0;
    const char* file_ = "";
    unsigned long generation_ = 0;
    bool broken_ = false;
};

struct Slot {
    Slot(unsigned threads, std::size_t bytes) : barrier(threads), shared(bytes + shared_guard) {}
    BlockBarrier barrier;
    std::vector<unsigned char> shared;
};

inline thread_local Slot* current_slot = nullptr;

inline unsigned char* dynamic_smem() { return current_slot->shared.data(); }

inline void fill_shared(Slot& slot, std::size_t bytes) {
    ROTARY_SHIM_UNPOISON(slot.shared.data(), slot.shared.size());
    std::memset(slot.shared.data(), config_poison, slot.shared.size());
    ROTARY_SHIM_POISON(slot.shared.data() + bytes, shared_guard);  // ASan: reading past the end trips
}

inline void check_guard(Slot& slot, std::size_t bytes) {
    ROTARY_SHIM_UNPOISON(slot.shared.data() + bytes, shared_guard);
    for (std::size_t i = bytes; i < slot.shared.size(); ++i)
        if (slot.shared[i] != config_poison) {
            report("write past the end of dynamic shared memory");
            break;
        }
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
    block_dim = {block, 1, 1};
    grid_dim = {grid, 1, 1};
    const unsigned slots = config_slots < 1 ? 1 : (config_slots < grid ? config_slots : grid);
    std::vector<std::unique_ptr<Slot>> slot(slots);
    for (unsigned s = 0; s < slots; ++s) {
        slot[s] = std::make_unique<Slot>(block, shared_bytes);
        Slot* sp = slot[s].get();
        fill_shared(*sp, shared_bytes);
        sp->barrier.on_block_end = [sp, shared_bytes] {  // the block is done: check, then re-poison
            check_guard(*sp, shared_bytes);
            fill_shared(*sp, shared_bytes);
        };
    }
    std::vector<std::thread> threads;
    threads.reserve(static_cast<std::size_t>(slots) * block);
    for (unsigned s = 0; s < slots; ++s)
        for (unsigned t = 0; t < block; ++t) {
            threads.emplace_back([&, s, t] {
                current_slot = slot[s].get();
                thread_idx = {t, 0, 0};
                for (unsigned b = s; b < grid; b += slots) {
                    block_idx = {b, 0, 0};
                    std::apply(kernel, values);
                    current_slot->barrier.wait(BlockBarrier::block_end_line, "");
                }
                current_slot->barrier.drop();
                current_slot = nullptr;
            });
        }
    for (auto& th : threads) th.join();
    for (auto& sp : slot) ROTARY_SHIM_UNPOISON(sp->shared.data(), sp->shared.size());
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
#define __shared__ static_assert(false, "the shim supports dynamic shared memory only");
#define __restrict__
#define __align__(n) alignas(n)

inline void __syncthreads(std::source_location where = std::source_location::current()) {
    rotary_shim::current_slot->barrier.wait(where.line(), where.file_name());
}

// (These extern "C" functions are defined here, not inline: the header goes into one translation unit.)
// Exact-extent copies of global buffers (host.py's guarded launches): n bytes starting at an address
// congruent to `pad` mod 64, so the plan's vector alignment holds. The allocation ends exactly at the end
// of the extent (ASan tracks the requested size to the byte); the pad in front is poisoned under ASan
// (in 8-byte granules, so an underflow of less than 8 bytes into a misaligned pad can go unseen).
extern "C" void* rotary_shim_alloc(std::size_t pad, std::size_t n) {
    void* base = nullptr;
    if (pad >= 64 || posix_memalign(&base, 64, pad + n + (n == 0)) != 0) return nullptr;
    ROTARY_SHIM_POISON(base, pad);
    return static_cast<unsigned char*>(base) + pad;
}

extern "C" void rotary_shim_free(void* data, std::size_t pad) {
    if (data == nullptr) return;
    unsigned char* base = static_cast<unsigned char*>(data) - pad;
    ROTARY_SHIM_UNPOISON(base, pad);
    std::free(base);
}

extern "C" void rotary_shim_configure(unsigned slots, unsigned char poison) {
    rotary_shim::config_slots = slots;
    rotary_shim::config_poison = poison;
}
