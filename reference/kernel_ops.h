// The reference's primitives as kernels (the Ops of spec_steps.h), over a Device policy that runs them:
// CudaRuntime on a GPU (cuda_ops.cu), the SIMT emulator on the host in the tests. So the host logic of the
// CUDA reference, launches and sums included, is the code the tests check against the CPU reference.
//
// Device (static members only): alloc(bytes), release(ptr), to_host(dst, src, bytes),
// launch(what, kernel, blocks, threads, args...) which returns when the kernel is done.
// Member definitions: kernel_ops_impl.h (needs the kernels, so a CUDA or emulated build).
#pragma once

#include <cstdint>
#include <vector>

#include "spec_ops.h"

namespace normuon::spec {

template <class Device>
class KernelOps {
 public:
  KernelOps() = default;
  ~KernelOps();
  KernelOps(const KernelOps&) = delete;
  KernelOps& operator=(const KernelOps&) = delete;

  float* scratch(int slot, int64_t n);  // device memory, at least n floats, reused (slots 0..7)

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
  double rows_sum(const float* x, const float* s, bool per_row, int64_t rows, int64_t cols);
  void product(const float* A, const float* B, float* C, int64_t m, int64_t k, int64_t n, bool b_rows, bool bf16);

  float* slots_[8] = {};
  int64_t slot_sizes_[8] = {};
  double* sums_ = nullptr;  // one per row, on the device
  int64_t sums_size_ = 0;
  std::vector<double> host_sums_;
};

}  // namespace normuon::spec
