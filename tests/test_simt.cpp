// The SIMT emulator itself (simt/simt.h): builtins, block barriers and warp shuffles give CUDA's results,
// and what CUDA leaves undefined (divergent barriers, shuffles with exited lanes) is caught, as is code
// whose result depends on the order threads run in.
#define BOOST_TEST_MODULE simt
#include <boost/test/unit_test.hpp>

#include "simt.h"  // first: the CUDA builtins for the kernels below

#include <cstdint>
#include <numeric>
#include <vector>

namespace {

// Every thread writes its global index.
__global__ void indices_kernel(int* out) { out[blockIdx.x * blockDim.x + threadIdx.x] = static_cast<int>(blockIdx.x * 1000 + threadIdx.x); }

// A block sum as the step's kernels do it: a shared-memory tree with __syncthreads(), then a warp
// reduction with shuffles.
__global__ void block_sum_kernel(const double* in, double* out) {
  __shared__ double shared[128];
  shared[threadIdx.x] = in[blockIdx.x * blockDim.x + threadIdx.x];
  __syncthreads();
  for (unsigned half = blockDim.x / 2; half >= 32; half /= 2) {
    if (threadIdx.x < half) shared[threadIdx.x] += shared[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x < 32) {
    double x = shared[threadIdx.x];
    for (int offset = 16; offset > 0; offset /= 2) x += __shfl_down_sync(0xffffffffu, x, offset);
    if (threadIdx.x == 0) out[blockIdx.x] = x;
  }
}

__global__ void xor_kernel(int* out) {
  int x = static_cast<int>(threadIdx.x);
  x = __shfl_xor_sync(0xffffffffu, x, 1);
  out[threadIdx.x] = x;
}

__global__ void divergent_barrier_kernel() {
  if (threadIdx.x == 5) return;
  __syncthreads();
}

__global__ void shuffle_after_exit_kernel(int* out) {
  if (threadIdx.x == 3) return;
  out[threadIdx.x] = __shfl_down_sync(0xffffffffu, static_cast<int>(threadIdx.x), 1);
}

__global__ void partial_mask_kernel(int* out) {
  out[threadIdx.x] = __shfl_down_sync(0xffffu, static_cast<int>(threadIdx.x), 1);  // not emulated
}

// A race: each thread reads its neighbour's slot without a barrier between the write and the read.
__global__ void racy_kernel(int* out) {
  __shared__ int slots[64];
  slots[threadIdx.x] = static_cast<int>(threadIdx.x) + 1;
  out[threadIdx.x] = slots[(threadIdx.x + 1) % 64];
}

}  // namespace

BOOST_AUTO_TEST_CASE(builtins_index_every_thread_of_every_block) {
  for (const simt::Schedule order : {simt::Schedule::forward, simt::Schedule::reverse}) {
    simt::set_schedule(order);
    std::vector<int> out(3 * 96, -1);
    simt::launch(indices_kernel, 3, 96, out.data());
    for (int b = 0; b < 3; ++b)
      for (int t = 0; t < 96; ++t) BOOST_TEST(out[static_cast<size_t>(b * 96 + t)] == b * 1000 + t);
  }
  simt::set_schedule(simt::Schedule::forward);
  BOOST_CHECK_THROW(simt::builtins(), simt::Error);  // outside a kernel
}

BOOST_AUTO_TEST_CASE(barriers_and_shuffles_give_cudas_results) {
  std::vector<double> in(2 * 128);
  std::iota(in.begin(), in.end(), 1.0);
  std::vector<double> out(2, 0);
  simt::launch(block_sum_kernel, 2, 128, static_cast<const double*>(in.data()), out.data());
  BOOST_TEST(out[0] == 128.0 * 129 / 2);
  BOOST_TEST(out[1] == 256.0 * 257 / 2 - 128.0 * 129 / 2);

  std::vector<int> x(64, -1);
  simt::launch(xor_kernel, 1, 64, x.data());
  for (int t = 0; t < 64; ++t) BOOST_TEST(x[static_cast<size_t>(t)] == (t ^ 1));
}

BOOST_AUTO_TEST_CASE(undefined_behaviour_is_an_error) {
  BOOST_CHECK_THROW(simt::launch(divergent_barrier_kernel, 1, 64), simt::Error);
  std::vector<int> out(32, 0);
  BOOST_CHECK_THROW(simt::launch(shuffle_after_exit_kernel, 1, 32, out.data()), simt::Error);
  BOOST_CHECK_THROW(simt::launch(indices_kernel, 1, 2048, out.data()), simt::Error);  // too many threads
  BOOST_CHECK_THROW(simt::launch(partial_mask_kernel, 1, 32, out.data()), simt::Error);  // thrown inside a fiber
  // The emulator is usable again after an error.
  std::vector<int> ok(32, -1);
  simt::launch(indices_kernel, 1, 32, ok.data());
  BOOST_TEST(ok[31] == 31);
}

BOOST_AUTO_TEST_CASE(an_order_dependent_kernel_differs_between_schedules) {
  std::vector<int> forward(64), reverse(64);
  simt::set_schedule(simt::Schedule::forward);
  simt::launch(racy_kernel, 1, 64, forward.data());
  simt::set_schedule(simt::Schedule::reverse);
  simt::launch(racy_kernel, 1, 64, reverse.data());
  simt::set_schedule(simt::Schedule::forward);
  BOOST_TEST(forward != reverse);
}

BOOST_AUTO_TEST_CASE(launches_are_counted) {
  std::vector<int> out(32);
  const int64_t before = simt::launches();
  simt::launch(indices_kernel, 1, 32, out.data());
  simt::launch(indices_kernel, 1, 32, out.data());
  BOOST_TEST(simt::launches() - before == 2);
}
