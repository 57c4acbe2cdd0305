// KernelOps' members (kernel_ops.h): included where the kernels compile, by cuda_ops.cu (nvcc) and by the
// emulated tests (tests/simt).
#pragma once

#include "cuda_kernels.cuh"
#include "kernel_ops.h"

namespace normuon::spec {

namespace kernel_ops_detail {
inline unsigned blocks_for(int64_t n) { return static_cast<unsigned>((n + cuda::kThreads - 1) / cuda::kThreads); }
}  // namespace kernel_ops_detail

template <class Device>
KernelOps<Device>::~KernelOps() {
  for (float* s : slots_) Device::release(s);
  Device::release(sums_);
}

template <class Device>
float* KernelOps<Device>::scratch(int slot, int64_t n) {
  if (slot_sizes_[slot] < n) {
    Device::release(slots_[slot]);
    slots_[slot] = nullptr;
    slots_[slot] = static_cast<float*>(Device::alloc(static_cast<size_t>(n) * sizeof(float)));
    slot_sizes_[slot] = n;
  }
  return slots_[slot];
}

template <class Device>
void KernelOps<Device>::product(const float* A, const float* B, float* C, int64_t m, int64_t k, int64_t n, bool b_rows,
                                bool bf16) {
  const int64_t tiles = ((m + cuda::kTile - 1) / cuda::kTile) * ((n + cuda::kTile - 1) / cuda::kTile);
  if (tiles > 0)
    Device::launch("gemm", cuda::gemm_kernel, static_cast<unsigned>(tiles), cuda::kThreads, A, B, C, m, k, n, b_rows,
                   bf16);
}

template <class Device>
void KernelOps<Device>::gemm(const float* A, const float* B, float* C, int64_t m, int64_t k, int64_t n, bool bf16) {
  product(A, B, C, m, k, n, false, bf16);
}

template <class Device>
void KernelOps<Device>::gemm_abt(const float* A, const float* B, float* C, int64_t m, int64_t k, int64_t n,
                                 bool bf16) {
  product(A, B, C, m, k, n, true, bf16);
}

// Elementwise launches: one thread per element (or row, or statistic) of `count`.
#define NORMUON_KERNEL_OPS_RUN(what, kernel, count, ...) \
  if ((count) > 0) Device::launch(what, kernel, kernel_ops_detail::blocks_for(count), cuda::kThreads, __VA_ARGS__)

template <class Device>
void KernelOps<Device>::transpose(const float* src, float* dst, int64_t rows, int64_t cols) {
  NORMUON_KERNEL_OPS_RUN("transpose", cuda::transpose_kernel, rows * cols, src, dst, rows, cols);
}

template <class Device>
void KernelOps<Device>::scale_add(const float* x, float s, const float* y, float* out, int64_t n, bool bf16) {
  NORMUON_KERNEL_OPS_RUN("scale_add", cuda::scale_add_kernel, n, x, s, y, out, n, bf16);
}

template <class Device>
void KernelOps<Device>::divide(float* x, int64_t n, float d, bool bf16) {
  NORMUON_KERNEL_OPS_RUN("divide", cuda::divide_kernel, n, x, n, d, bf16);
}

template <class Device>
double KernelOps<Device>::rows_sum(const float* x, const float* s, bool per_row, int64_t rows, int64_t cols) {
  if (rows == 0) return 0;
  if (sums_size_ < rows) {
    Device::release(sums_);
    sums_ = nullptr;
    sums_ = static_cast<double*>(Device::alloc(static_cast<size_t>(rows) * sizeof(double)));
    sums_size_ = rows;
  }
  NORMUON_KERNEL_OPS_RUN("row sums", cuda::row_squares_kernel, rows, x, s, per_row, sums_, rows, cols);
  host_sums_.resize(static_cast<size_t>(rows));
  Device::to_host(host_sums_.data(), sums_, static_cast<size_t>(rows) * sizeof(double));
  double total = 0;
  for (double r : host_sums_) total += r;  // rows in order, as the CPU reference
  return total;
}

template <class Device>
double KernelOps<Device>::sum_squares(const float* x, int64_t rows, int64_t cols) {
  return rows_sum(x, nullptr, true, rows, cols);
}

template <class Device>
void KernelOps<Device>::mirror_lower(float* C, int64_t m) {
  NORMUON_KERNEL_OPS_RUN("mirror", cuda::mirror_lower_kernel, m * m, C, m);
}

template <class Device>
void KernelOps<Device>::set_diagonal(const float* Z, float a, float* Q, int64_t m, bool bf16) {
  NORMUON_KERNEL_OPS_RUN("diagonal", cuda::set_diagonal_kernel, m * m, Z, a, Q, m, bf16);
}

template <class Device>
void KernelOps<Device>::momentum(float* M, const float* g, float* U, int64_t n, float w1, float beta1, bool nesterov) {
  NORMUON_KERNEL_OPS_RUN("momentum", cuda::momentum_kernel, n, M, g, U, n, w1, beta1, nesterov);
}

template <class Device>
void KernelOps<Device>::second_moment(const float* O, float* v, int64_t rows, int64_t cols, bool per_row, float w2) {
  NORMUON_KERNEL_OPS_RUN("second moment", cuda::second_moment_kernel, per_row ? rows : cols, O, v, rows, cols, per_row,
                         w2);
}

template <class Device>
void KernelOps<Device>::inverse_scales(const float* v, float* s, int64_t n, float denom_eps, bool eps_add) {
  NORMUON_KERNEL_OPS_RUN("inverse scales", cuda::inverse_scales_kernel, n, v, s, n, denom_eps, eps_add);
}

template <class Device>
double KernelOps<Device>::normalised_sum_squares(const float* O, const float* s, int64_t rows, int64_t cols,
                                                 bool per_row) {
  return rows_sum(O, s, per_row, rows, cols);
}

template <class Device>
void KernelOps<Device>::apply(const float* O, const float* s, float* p, int64_t rows, int64_t cols, bool per_row,
                              float rho, float kappa, int wd_mode, float decay_factor, float lr_wd, float neg_lr) {
  NORMUON_KERNEL_OPS_RUN("apply", cuda::apply_kernel, rows * cols, O, s, p, rows, cols, per_row, rho, kappa, wd_mode,
                         decay_factor, lr_wd, neg_lr);
}

template <class Device>
void KernelOps<Device>::adamw(float* p, const float* g, float* m, float* v, int64_t n, const AdamWScalars& s) {
  NORMUON_KERNEL_OPS_RUN("adamw", cuda::adamw_kernel, n, p, g, m, v, n, s);
}

#undef NORMUON_KERNEL_OPS_RUN

}  // namespace normuon::spec
