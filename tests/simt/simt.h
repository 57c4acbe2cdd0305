// A small SIMT emulator: runs CUDA kernel source on the host, so the tests can execute the fused step's
// device code (fast/cuda/*.cuh) on machines without a GPU.
//
// Every CUDA thread of a block is a fiber (ucontext); a block's fibers run one at a time on the calling
// thread and switch only at __syncthreads() and warp shuffles, which are real barriers here. Blocks run
// one after another. The emulator is strict where CUDA leaves behaviour undefined: a __syncthreads()
// that not every thread of the block reaches, or a full-mask shuffle with an exited lane, is an error
// (simt::Error), not a hang. Running the threads and blocks in forward and then in reverse order
// (Schedule) and comparing the results exposes code that depends on the order threads run in.
//
// Include this header before any kernel source: it defines the CUDA builtins the kernels use
// (threadIdx, blockIdx, blockDim, gridDim, __shared__, __syncthreads, __shfl_down_sync,
// __shfl_xor_sync, atomicMin, the _rn intrinsics, min) for a host compiler. Compile with
// -ffp-contract=off so the host rounds like nvcc -fmad=false. Single-threaded: one launch at a time.
#pragma once

#include <cuda_runtime_api.h>
#include <vector_functions.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <type_traits>

namespace simt {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum class Schedule { forward, reverse };  // the order blocks, and threads inside a block, are run in

// Applies to later launches.
void set_schedule(Schedule schedule);

// The builtins of the thread that is running.
struct Builtins {
  uint3 thread_idx, block_idx;
  dim3 block_dim, grid_dim;
};
const Builtins& builtins();

void sync_block();                                        // __syncthreads()
uint64_t exchange_in_warp(uint64_t value, unsigned lane);  // every lane offers `value`, gets lane `lane`'s

// Runs body() as `threads` threads in each of `blocks` blocks (1-D).
void run(int blocks, int threads, const std::function<void()>& body);

// kernel<<<blocks, threads>>>(args...), on the host. Counts launches (launches()).
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), int blocks, int threads, Args... args) {
  run(blocks, threads, [&] { kernel(args...); });
}

int64_t launches();  // since the program started

// A `launch` callable for the device passes of fast/cuda (step_kernels.cuh, ns_run.cuh).
struct Launch {
  template <typename... Params, typename... Args>
  void operator()(void (*kernel)(Params...), int blocks, int threads, Args... args) const {
    launch(kernel, blocks, threads, args...);
  }
};

template <typename T>
T shuffle(unsigned mask, T value, unsigned lane) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "a shuffle moves up to 8 bytes");
  if (mask != 0xffffffffu) throw Error("only full-mask shuffles are emulated");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof value);
  bits = exchange_in_warp(bits, lane);
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

}  // namespace simt

// ---- the CUDA builtins, for a host compiler ------------------------------------------------------------

#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __forceinline__
#undef __launch_bounds__
#define __global__
#define __device__
#define __host__
#define __shared__ static  // one block runs at a time, so a static is the block's shared memory
#define __forceinline__ inline
#define __launch_bounds__(...)

#define threadIdx (::simt::builtins().thread_idx)
#define blockIdx (::simt::builtins().block_idx)
#define blockDim (::simt::builtins().block_dim)
#define gridDim (::simt::builtins().grid_dim)

inline void __syncthreads() { simt::sync_block(); }

template <typename T>
T __shfl_down_sync(unsigned mask, T value, unsigned delta) {
  const unsigned lane = simt::builtins().thread_idx.x % 32;
  return simt::shuffle(mask, value, lane + delta < 32 ? lane + delta : lane);
}

template <typename T>
T __shfl_xor_sync(unsigned mask, T value, unsigned lane_mask) {
  const unsigned lane = simt::builtins().thread_idx.x % 32;
  return simt::shuffle(mask, value, (lane ^ lane_mask) % 32);
}

// Fibers never run at the same time, so a read-modify-write is atomic.
inline unsigned long long atomicMin(unsigned long long* address, unsigned long long value) {
  const unsigned long long old = *address;
  *address = std::min(old, value);
  return old;
}

inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }

using std::isfinite;
using std::min;
