// The spec GEMM's chains on AVX2 with FMA (this file is compiled with -mavx2 -mfma; called only where the
// processor has both).
#include <immintrin.h>

#include "spec_gemm_kernel.h"

namespace normuon::spec {
namespace {
struct Avx2 {
  using reg = __m256;
  static constexpr int W = 8;
  static constexpr int Mr = 6;  // 12 accumulators of 16 registers
  static reg zero() { return _mm256_setzero_ps(); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg r) { _mm256_storeu_ps(p, r); }
  static reg bcast(float x) { return _mm256_set1_ps(x); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
};
}  // namespace

void gemm_chains_avx2(const float* A, const float* B, bool b_rows, float* C, int64_t m, int64_t k, int64_t n,
                        bool lower_only) {
  gemm_chains<Avx2>(A, B, b_rows, C, m, k, n, lower_only);
}

}  // namespace normuon::spec
