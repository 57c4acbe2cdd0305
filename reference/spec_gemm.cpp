#include "spec_gemm.h"

#include <cstdlib>
#include <stdexcept>
#include <string>

#include "spec_ops.h"

#if defined(__aarch64__)
#include <arm_neon.h>
#endif

#include "spec_gemm_kernel.h"

namespace normuon::spec {

#if defined(__x86_64__)
void gemm_chains_avx512(const float* A, const float* B, bool b_rows, float* C, int64_t m, int64_t k, int64_t n,
                        bool lower_only);
void gemm_chains_avx2(const float* A, const float* B, bool b_rows, float* C, int64_t m, int64_t k, int64_t n,
                      bool lower_only);
#endif

namespace {

struct Scalar {  // any processor: std::fma is exact everywhere (in hardware or in libm)
  using reg = float;
  static constexpr int W = 1;
  static constexpr int Mr = 6;
  static reg zero() { return 0.0f; }
  static reg load(const float* p) { return *p; }
  static void store(float* p, reg r) { *p = r; }
  static reg bcast(float x) { return x; }
  static reg fma(reg a, reg b, reg c) { return std::fma(a, b, c); }
};

#if defined(__aarch64__)
struct Neon {  // vfmaq_f32 is fused (FMLA)
  using reg = float32x4_t;
  static constexpr int W = 4;
  static constexpr int Mr = 8;  // 16 accumulators of 32 registers
  static reg zero() { return vdupq_n_f32(0.0f); }
  static reg load(const float* p) { return vld1q_f32(p); }
  static void store(float* p, reg r) { vst1q_f32(p, r); }
  static reg bcast(float x) { return vdupq_n_f32(x); }
  static reg fma(reg a, reg b, reg c) { return vfmaq_f32(c, a, b); }
};
#endif

GemmIsa best_available() {
#if defined(__x86_64__)
  if (gemm_isa_available(GemmIsa::avx512)) return GemmIsa::avx512;
  if (gemm_isa_available(GemmIsa::avx2)) return GemmIsa::avx2;
#elif defined(__aarch64__)
  return GemmIsa::neon;
#endif
  return GemmIsa::scalar;
}

GemmIsa chosen_isa() {
  const char* env = std::getenv("NORMUON_REFERENCE_ISA");
  if (!env || !*env) return best_available();
  for (GemmIsa isa : {GemmIsa::scalar, GemmIsa::avx2, GemmIsa::avx512, GemmIsa::neon}) {
    if (std::string(env) != to_string(isa)) continue;
    if (!gemm_isa_available(isa))
      throw std::invalid_argument(std::string("NORMUON_REFERENCE_ISA=") + env + ": this processor has no " + env);
    return isa;
  }
  throw std::invalid_argument(std::string("NORMUON_REFERENCE_ISA=") + env +
                              ": expected scalar, avx2, avx512 or neon");
}

}  // namespace

const char* to_string(GemmIsa isa) {
  switch (isa) {
    case GemmIsa::avx2: return "avx2";
    case GemmIsa::avx512: return "avx512";
    case GemmIsa::neon: return "neon";
    case GemmIsa::scalar: break;
  }
  return "scalar";
}

bool gemm_isa_available(GemmIsa isa) {
  switch (isa) {
    case GemmIsa::scalar: return true;
#if defined(__x86_64__)
    case GemmIsa::avx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case GemmIsa::avx512: return __builtin_cpu_supports("avx512f");
#elif defined(__aarch64__)
    case GemmIsa::neon: return true;
#endif
    default: return false;
  }
}

GemmIsa gemm_isa() {
  static const GemmIsa isa = chosen_isa();
  return isa;
}

void gemm_on(GemmIsa isa, const float* A, const float* B, bool b_rows, float* C, int64_t m, int64_t k, int64_t n,
             bool bf16) {
  if (!gemm_isa_available(isa))
    throw std::invalid_argument(std::string("spec gemm: this processor cannot run ") + to_string(isa));
  // X X^T: only the lower triangle's chains, mirrored (the same bits as computing both).
  const bool lower_only = b_rows && A == B && m == n;
  switch (isa) {
#if defined(__x86_64__)
    case GemmIsa::avx512: gemm_chains_avx512(A, B, b_rows, C, m, k, n, lower_only); break;
    case GemmIsa::avx2: gemm_chains_avx2(A, B, b_rows, C, m, k, n, lower_only); break;
#elif defined(__aarch64__)
    case GemmIsa::neon: gemm_chains<Neon>(A, B, b_rows, C, m, k, n, lower_only); break;
#endif
    default: gemm_chains<Scalar>(A, B, b_rows, C, m, k, n, lower_only); break;
  }
  if (lower_only)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = i + 1; j < n; ++j) C[i * n + j] = C[j * n + i];
  if (bf16)
    for (int64_t i = 0; i < m * n; ++i) C[i] = round_bf16(C[i]);
}

void gemm(const float* A, const float* B, float* C, int64_t m, int64_t k, int64_t n, bool bf16) {
  gemm_on(gemm_isa(), A, B, false, C, m, k, n, bf16);
}

void gemm_abt(const float* A, const float* B, float* C, int64_t m, int64_t k, int64_t n, bool bf16) {
  gemm_on(gemm_isa(), A, B, true, C, m, k, n, bf16);
}

}  // namespace normuon::spec
