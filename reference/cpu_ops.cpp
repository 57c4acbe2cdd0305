#include "cpu_ops.h"

#include <algorithm>

#include "spec_gemm.h"

namespace normuon::spec {
namespace {
// Below this many elements a loop stays on the calling thread: a parallel region costs more, and its idle
// team spins (OpenMP), taking the processor from whatever runs next.
constexpr int64_t kParallelFrom = 1 << 20;
}  // namespace

float* CpuOps::scratch(int slot, int64_t n) {
  std::vector<float>& s = slots_[slot];
  if (static_cast<int64_t>(s.size()) < n) s.resize(static_cast<size_t>(n));
  return s.data();
}

int64_t CpuOps::held_bytes() const {
  size_t bytes = sums_.capacity() * sizeof(double);
  for (const std::vector<float>& s : slots_) bytes += s.capacity() * sizeof(float);
  return static_cast<int64_t>(bytes);
}

void CpuOps::gemm(const float* A, const float* B, float* C, int64_t m, int64_t k, int64_t n, bool bf16) {
  spec::gemm(A, B, C, m, k, n, bf16);
}

void CpuOps::gemm_abt(const float* A, const float* B, float* C, int64_t m, int64_t k, int64_t n, bool bf16) {
  spec::gemm_abt(A, B, C, m, k, n, bf16);
}

void CpuOps::transpose(const float* src, float* dst, int64_t rows, int64_t cols) {
  constexpr int64_t tile = 32;
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelFrom)
  for (int64_t i0 = 0; i0 < rows; i0 += tile)
    for (int64_t j0 = 0; j0 < cols; j0 += tile)
      for (int64_t i = i0; i < std::min(rows, i0 + tile); ++i)
        for (int64_t j = j0; j < std::min(cols, j0 + tile); ++j) dst[j * rows + i] = src[i * cols + j];
}

void CpuOps::scale_add(const float* x, float s, const float* y, float* out, int64_t n, bool bf16) {
  if (y) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelFrom)
    for (int64_t i = 0; i < n; ++i) out[i] = P(P(s * x[i], bf16) + y[i], bf16);
  } else {
#pragma omp parallel for simd schedule(static) if (n >= kParallelFrom)
    for (int64_t i = 0; i < n; ++i) out[i] = P(s * x[i], bf16);
  }
}

void CpuOps::divide(float* x, int64_t n, float d, bool bf16) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelFrom)
  for (int64_t i = 0; i < n; ++i) x[i] = P(x[i] / d, bf16);
}

double CpuOps::sum_squares(const float* x, int64_t rows, int64_t cols) {
  sums_.assign(static_cast<size_t>(rows), 0.0);
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelFrom)
  for (int64_t i = 0; i < rows; ++i) {
    double row = 0;
    for (int64_t j = 0; j < cols; ++j) row += static_cast<double>(x[i * cols + j]) * x[i * cols + j];
    sums_[i] = row;
  }
  double total = 0;
  for (int64_t i = 0; i < rows; ++i) total += sums_[i];
  return total;
}

void CpuOps::mirror_lower(float* C, int64_t m) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = i + 1; j < m; ++j) C[i * m + j] = C[j * m + i];
}

void CpuOps::set_diagonal(const float* Z, float a, float* Q, int64_t m, bool bf16) {
  std::copy(Z, Z + m * m, Q);
  for (int64_t i = 0; i < m; ++i) Q[i * m + i] = P(Z[i * m + i] + a, bf16);
}

void CpuOps::momentum(float* M, const float* g, float* U, int64_t n, float w1, float beta1, bool nesterov) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelFrom)
  for (int64_t i = 0; i < n; ++i) U[i] = momentum_element(M[i], g[i], w1, beta1, nesterov);
}

void CpuOps::second_moment(const float* O, float* v, int64_t rows, int64_t cols, bool per_row, float w2) {
  if (per_row) {
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelFrom)
    for (int64_t i = 0; i < rows; ++i) {
      double sum = 0;
      for (int64_t j = 0; j < cols; ++j) sum += static_cast<double>(O[i * cols + j]) * O[i * cols + j];
      v[i] = lerp(v[i], static_cast<float>(sum / static_cast<double>(cols)), w2);
    }
  } else {  // each column summed down its rows, in row order
    sums_.assign(static_cast<size_t>(cols), 0.0);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) sums_[j] += static_cast<double>(O[i * cols + j]) * O[i * cols + j];
    for (int64_t j = 0; j < cols; ++j) v[j] = lerp(v[j], static_cast<float>(sums_[j] / static_cast<double>(rows)), w2);
  }
}

void CpuOps::inverse_scales(const float* v, float* s, int64_t n, float denom_eps, bool eps_add) {
  for (int64_t i = 0; i < n; ++i) s[i] = inverse_scale(v[i], denom_eps, eps_add);
}

double CpuOps::normalised_sum_squares(const float* O, const float* s, int64_t rows, int64_t cols, bool per_row) {
  sums_.assign(static_cast<size_t>(rows), 0.0);
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelFrom)
  for (int64_t i = 0; i < rows; ++i) {
    double row = 0;
    for (int64_t j = 0; j < cols; ++j) {
      const float u = O[i * cols + j] * (per_row ? s[i] : s[j]);
      row += static_cast<double>(u) * u;
    }
    sums_[i] = row;
  }
  double total = 0;
  for (int64_t i = 0; i < rows; ++i) total += sums_[i];
  return total;
}

void CpuOps::apply(const float* O, const float* s, float* p, int64_t rows, int64_t cols, bool per_row, float rho,
                   float kappa, int wd_mode, float decay_factor, float lr_wd, float neg_lr) {
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelFrom)
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      const int64_t e = i * cols + j;
      const float u = normalised_element(O[e], per_row ? s[i] : s[j], rho, kappa);
      p[e] = normuon_param(p[e], u, wd_mode, decay_factor, lr_wd, neg_lr);
    }
}

void CpuOps::adamw(float* p, const float* g, float* m, float* v, int64_t n, const AdamWScalars& s) {
#pragma omp parallel for schedule(static) if (n >= kParallelFrom)
  for (int64_t i = 0; i < n; ++i) adamw_element(p[i], g[i], m[i], v[i], s);
}

}  // namespace normuon::spec
