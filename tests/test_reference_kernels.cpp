// The CUDA reference's kernels and host logic (reference/kernel_ops_impl.h), run on the host by the SIMT
// emulator, give the CPU reference's bits (docs/reference.md, "The reference on CUDA"): the same spec
// rules, the same chains and sums, whatever the device. On a GPU, `golden verify --device cuda --exact`
// checks the real thing.
#define BOOST_TEST_MODULE reference_kernels
#include <boost/test/unit_test.hpp>

#include "simt.h"
#include "kernel_ops_impl.h"

#include <cstdlib>
#include <cstring>
#include <vector>

#include "cpu_ops.h"
#include "normuon/grad_gen.h"
#include "spec_steps.h"

using namespace normuon;

namespace {

struct SimtHost {  // "device" memory is host memory; kernels run on the emulator
  static void* alloc(size_t bytes) { return std::malloc(bytes); }
  static void release(void* p) { std::free(p); }
  static void to_host(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }
  template <typename... Params, typename... Args>
  static void launch(const char*, void (*kernel)(Params...), unsigned blocks, int threads, Args... args) {
    simt::launch(kernel, static_cast<int>(blocks), threads, args...);
  }
};
using EmulatedOps = spec::KernelOps<SimtHost>;

std::vector<float> gaussian(int64_t n, uint64_t seed, float scale = 1.0f) {
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) x[i] = scale * counter_normal(seed, 0, 0, static_cast<uint64_t>(i));
  return x;
}

// One NorMuon step with each Ops from the same state; returns p, M, v of each.
template <class Ops>
std::vector<float> normuon_run(int64_t rows, int64_t cols, const NorMuonHyper& h, bool per_row) {
  Ops ops;
  std::vector<float> p = gaussian(rows * cols, 1), g = gaussian(rows * cols, 2), M = gaussian(rows * cols, 3, 0.1f);
  std::vector<float> v(static_cast<size_t>(per_row ? rows : cols), 0.5f);
  std::vector<float> U(p.size()), O(p.size());
  spec::NoClock clock;
  for (int step = 0; step < 2; ++step)
    spec::normuon_update(ops, p.data(), g.data(), M.data(), v.data(), rows, cols, h, per_row, false, U.data(),
                         O.data(), clock);
  p.insert(p.end(), M.begin(), M.end());
  p.insert(p.end(), v.begin(), v.end());
  return p;
}

}  // namespace

BOOST_AUTO_TEST_CASE(gemm_kernel_gives_the_cpu_chains_bits) {
  for (bool b_rows : {false, true})
    for (bool bf16 : {false, true}) {
      const int64_t m = 19, k = 37, n = 23;
      std::vector<float> A = gaussian(m * k, 7), B = gaussian(k * n, 8);
      A[5] = 1e-30f;  // products that underflow: the fma chain, not a rounded product, decides
      B[3] = 1e-12f;
      std::vector<float> cpu(static_cast<size_t>(m * n)), emulated(cpu.size());
      spec::CpuOps c;
      EmulatedOps e;
      if (b_rows) {
        c.gemm_abt(A.data(), B.data(), cpu.data(), m, k, n, bf16);
        e.gemm_abt(A.data(), B.data(), emulated.data(), m, k, n, bf16);
      } else {
        c.gemm(A.data(), B.data(), cpu.data(), m, k, n, bf16);
        e.gemm(A.data(), B.data(), emulated.data(), m, k, n, bf16);
      }
      BOOST_TEST(std::memcmp(cpu.data(), emulated.data(), cpu.size() * sizeof(float)) == 0,
                 "b_rows " << b_rows << " bf16 " << bf16);
    }
}

BOOST_AUTO_TEST_CASE(normuon_steps_give_the_cpu_references_bits) {
  struct Case {
    int64_t rows, cols;
    NsPrecision precision;
    NsAlgorithm algorithm;
    bool per_row;
    WeightDecayMode decay;
    EpsPlacement eps;
  };
  const Case cases[] = {
      {12, 20, NsPrecision::bf16, NsAlgorithm::standard, true, WeightDecayMode::decoupled, EpsPlacement::add},
      {20, 12, NsPrecision::bf16, NsAlgorithm::gram, false, WeightDecayMode::cautious, EpsPlacement::clamp},
      {9, 30, NsPrecision::fp32, NsAlgorithm::gram, true, WeightDecayMode::none, EpsPlacement::add},
      {17, 17, NsPrecision::fp32, NsAlgorithm::standard, false, WeightDecayMode::decoupled, EpsPlacement::add},
  };
  for (const Case& c : cases) {
    NorMuonHyper h;
    h.ns_precision = c.precision;
    h.ns_algorithm = c.algorithm;
    h.weight_decay = 0.1;
    h.weight_decay_mode = c.decay;
    h.eps_placement = c.eps;
    h.ns_steps = 5;
    const std::vector<float> cpu = normuon_run<spec::CpuOps>(c.rows, c.cols, h, c.per_row);
    const std::vector<float> emulated = normuon_run<EmulatedOps>(c.rows, c.cols, h, c.per_row);
    BOOST_TEST(std::memcmp(cpu.data(), emulated.data(), cpu.size() * sizeof(float)) == 0,
               c.rows << "x" << c.cols << " case");
  }
}

BOOST_AUTO_TEST_CASE(adamw_gives_the_cpu_references_bits) {
  AdamWHyper h;
  h.weight_decay = 0.01;
  const int64_t n = 1000;
  std::vector<float> p1 = gaussian(n, 1), m1 = gaussian(n, 2, 0.1f), v1 = gaussian(n, 3, 0.01f), g = gaussian(n, 4);
  for (float& x : v1) x = x * x;
  std::vector<float> p2 = p1, m2 = m1, v2 = v1;
  spec::CpuOps c;
  EmulatedOps e;
  for (int64_t t = 1; t <= 3; ++t) {
    c.adamw(p1.data(), g.data(), m1.data(), v1.data(), n, spec::adamw_scalars(h, t));
    e.adamw(p2.data(), g.data(), m2.data(), v2.data(), n, spec::adamw_scalars(h, t));
  }
  BOOST_TEST(std::memcmp(p1.data(), p2.data(), n * sizeof(float)) == 0);
  BOOST_TEST(std::memcmp(m1.data(), m2.data(), n * sizeof(float)) == 0);
  BOOST_TEST(std::memcmp(v1.data(), v2.data(), n * sizeof(float)) == 0);
}
