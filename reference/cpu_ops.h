// The reference's primitives on the CPU (the Ops of spec_steps.h): plain loops with the roundings of
// spec_ops.h and the spec GEMM. Loops over independent elements, rows or columns may run on several
// OpenMP threads; every sum runs in one fixed order, so the bits never depend on the thread count.
#pragma once

#include <cstdint>
#include <vector>

#include "spec_ops.h"

namespace normuon::spec {

class CpuOps {
 public:
  float* scratch(int slot, int64_t n);  // at least n floats, reused between calls (slots 0..7)
  int64_t held_bytes() const;           // the scratch and partial sums held now

  void gemm(const float* A, const float* B, float* C, int64_t m, int64_t k, int64_t n, bool bf16);
  void gemm_abt(const float* A, const float* B, float* C, int64_t m, int64_t k, int64_t n, bool bf16);
  void transpose(const float* src, float* dst, int64_t rows, int64_t cols);
  void scale_add(const float* x, float s, const float* y, float* out, int64_t n, bool bf16);
  void divide(float* x, int64_t n, float d, bool bf16);
  double sum_squares(const float* x, int64_t rows, int64_t cols);
  void mirror_lower(float* C, int64_t m);
  void set_diagonal(const float* Z, float a, float* Q, int64_t m, bool bf16);

  void momentum(float* M, const float* g, float* U, int64_t n, float w1, float beta1, bool nesterov);
  void second_moment(const float* O, float* v, int64_t rows, int64_t cols, bool per_row, float w2);
  void inverse_scales(const float* v, float* s, int64_t n, float denom_eps, bool eps_add);
  double normalised_sum_squares(const float* O, const float* s, int64_t rows, int64_t cols, bool per_row);
  void apply(const float* O, const float* s, float* p, int64_t rows, int64_t cols, bool per_row, float rho,
             float kappa, int wd_mode, float decay_factor, float lr_wd, float neg_lr);
  void adamw(float* p, const float* g, float* m, float* v, int64_t n, const AdamWScalars& s);

 private:
  std::vector<float> slots_[8];
  std::vector<double> sums_;  // per-row or per-column partial sums
};

}  // namespace normuon::spec
