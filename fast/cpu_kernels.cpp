#include "cpu_kernels.h"

#include <chrono>
#include <cmath>
#include <cstring>

#include "multiversion.h"

namespace normuon::fast {
namespace {

// torch's lerp (ATen Lerp.h): the weight decides which end anchors the fma.
inline float lerp(float a, float b, float w) {
  return std::fabs(w) < 0.5f ? std::fma(w, b - a, a) : std::fma(w - 1.0f, b - a, b);
}

inline float P(float x, bool bf16) { return bf16 ? round_bf16(x) : x; }

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

NORMUON_MULTIVERSION
void momentum_nesterov(float* M, const float* g, float* U, int64_t n, float w1, float beta1, bool nesterov) {
  if (nesterov) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float m = lerp(M[i], g[i], w1);
      M[i] = m;
      U[i] = lerp(g[i], m, beta1);
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float m = lerp(M[i], g[i], w1);
      M[i] = m;
      U[i] = m;
    }
  }
}

NORMUON_MULTIVERSION
void adamw(float* p, const float* g, float* m, float* v, int64_t n, const AdamWScalars& s) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float pi = s.decay ? p[i] * s.decay_factor : p[i];        // param.mul_(1 - lr*wd)
    const float mi = lerp(m[i], gi, s.w1);                          // exp_avg.lerp_(g, 1 - beta1)
    const float vi = std::fma(s.one_minus_beta2 * gi, gi, v[i] * s.beta2);  // mul_(beta2).addcmul_(g, g, 1 - beta2)
    const float denom = std::sqrt(vi) / s.bc2_sqrt + s.eps;         // (sqrt(v) / bc2_sqrt).add_(eps)
    p[i] = pi + (s.neg_step_size * mi) / denom;                     // addcdiv_(m, denom, -step_size)
    m[i] = mi;
    v[i] = vi;
  }
}

NORMUON_MULTIVERSION
void divide_round(float* x, int64_t n, float d, bool bf16) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] = P(x[i] / d, bf16);
}

NORMUON_MULTIVERSION
bool all_finite(const float* x, int64_t n) {
  uint32_t nonfinite = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, sizeof u);
    nonfinite |= static_cast<uint32_t>((u & 0x7f800000u) == 0x7f800000u);  // exponent all ones: Inf or NaN
  }
  return nonfinite == 0;
}

NORMUON_MULTIVERSION
void normuon_finalize(const float* O, float* p, const RowRuns& p_runs, float* v, int64_t rows, int64_t cols,
                      const NorMuonScalars& s, double* col_sums, float* inv_scale, NorMuonPassTimes* times) {
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t stat_len = s.stats_per_row ? rows : cols;
  // Pass 1: sums of squares along the statistics axis and in total, in double.
  double total = 0;
  if (!s.stats_per_row)
    for (int64_t j = 0; j < cols; ++j) col_sums[j] = 0;
  for (int64_t i = 0; i < rows; ++i) {
    const float* o = O + i * cols;
    double row = 0;
    if (s.stats_per_row) {
      for (int64_t j = 0; j < cols; ++j) row += static_cast<double>(o[j]) * o[j];
      v[i] = lerp(v[i], static_cast<float>(row / static_cast<double>(cols)), s.w2);
    } else {
      for (int64_t j = 0; j < cols; ++j) {
        const double sq = static_cast<double>(o[j]) * o[j];
        col_sums[j] += sq;
        row += sq;
      }
    }
    total += row;
  }
  if (!s.stats_per_row)
    for (int64_t j = 0; j < cols; ++j) v[j] = lerp(v[j], static_cast<float>(col_sums[j] / static_cast<double>(rows)), s.w2);
  const float nu = static_cast<float>(std::sqrt(total));
  // The inverse square root of the second moment, one per statistic.
  for (int64_t k = 0; k < stat_len; ++k)
    inv_scale[k] = s.eps_add ? 1.0f / (std::sqrt(v[k]) + s.denom_eps) : 1.0f / std::sqrt(std::max(v[k], s.denom_eps));
  // Pass 2: the norm of the normalised update.
  double normalised = 0;
  for (int64_t i = 0; i < rows; ++i) {
    const float* o = O + i * cols;
    double row = 0;
    if (s.stats_per_row) {
      const float si = inv_scale[i];
      for (int64_t j = 0; j < cols; ++j) {
        const float u = o[j] * si;
        row += static_cast<double>(u) * u;
      }
    } else {
      for (int64_t j = 0; j < cols; ++j) {
        const float u = o[j] * inv_scale[j];
        row += static_cast<double>(u) * u;
      }
    }
    normalised += row;
  }
  const float ratio = nu / (static_cast<float>(std::sqrt(normalised)) + s.renorm_eps);
  const auto t1 = std::chrono::steady_clock::now();
  // Pass 3: the update (recomputed with the same roundings), weight decay and the step.
  for (int64_t i = 0; i < rows; ++i) {
    const float* o = O + i * cols;
    float* w = p + p_runs.at(i * cols);
    const float row_scale = s.stats_per_row ? inv_scale[i] : 0.0f;
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) {
      const float scale = s.stats_per_row ? row_scale : inv_scale[j];
      const float u = ((o[j] * scale) * ratio) * s.kappa;
      float pj = w[j];
      if (s.decay) {
        if (s.wd_mode == 0) pj = pj * s.decay_factor;
        else if (s.wd_mode == 1) pj = pj - (pj * (u * pj >= 0.0f ? 1.0f : 0.0f)) * s.lr_wd;
      }
      w[j] = std::fma(s.neg_lr, u, pj);
    }
  }
  if (times) {
    times->normalisation_ms += std::chrono::duration<double, std::milli>(t1 - t0).count();
    times->update_ms += ms_since(t1);
  }
}

}  // namespace normuon::fast
