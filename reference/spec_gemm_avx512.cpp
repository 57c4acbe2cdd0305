// The spec GEMM's chains on AVX-512 (this file is compiled with -mavx512f -mfma; called only where the
// processor has AVX-512F).
#include <immintrin.h>

#include "spec_gemm_kernel.h"

namespace normuon::spec {
namespace {
struct Avx512 {
  using reg = __m512;
  static constexpr int W = 16;
  static constexpr int Mr = 12;  // 24 accumulators of 32 registers
  static reg zero() { return _mm512_setzero_ps(); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg r) { _mm512_storeu_ps(p, r); }
  static reg bcast(float x) { return _mm512_set1_ps(x); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
};
}  // namespace

void gemm_chains_avx512(const float* A, const float* B, bool b_rows, float* C, int64_t m, int64_t k, int64_t n,
                        bool lower_only) {
  gemm_chains<Avx512>(A, B, b_rows, C, m, k, n, lower_only);
}

}  // namespace normuon::spec
