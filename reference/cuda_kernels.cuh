// The CUDA reference's kernels: each thread computes its elements with the rules of spec_ops.h, in the
// order the CPU reference uses, so the two give the same bits. Plain kernels, 1-D launches, no atomics and
// no reduction trees (a sum is one thread's loop): this is the oracle, not the fast path. Included by
// cuda_ops.cu and, on the host, by the tests through the SIMT emulator (tests/simt).
#pragma once

#include <cstdint>

#include "spec_ops.h"

namespace normuon::spec::cuda {

constexpr int kThreads = 256;  // per block, every kernel
constexpr int kTile = 16;      // the GEMM's square tile (kTile * kTile == kThreads)

// C (m x n) = P(A B): each thread one element of a 16 x 16 tile, its fma chain in increasing k (tiles
// of k staged through shared memory in order). b_rows: B is given as n x k (A B^T).
__global__ void gemm_kernel(const float* A, const float* B, float* C, int64_t m, int64_t K, int64_t n, bool b_rows,
                            bool bf16) {
  __shared__ float As[kTile][kTile];
  __shared__ float Bs[kTile][kTile];
  const int64_t tiles_n = (n + kTile - 1) / kTile;
  const int64_t ti = static_cast<int64_t>(blockIdx.x) / tiles_n, tj = static_cast<int64_t>(blockIdx.x) % tiles_n;
  const int tx = static_cast<int>(threadIdx.x) % kTile, ty = static_cast<int>(threadIdx.x) / kTile;
  const int64_t i = ti * kTile + ty, j = tj * kTile + tx;
  float acc = 0.0f;
  for (int64_t k0 = 0; k0 < K; k0 += kTile) {
    const int64_t ka = k0 + tx, kb = k0 + ty, jb = tj * kTile + tx;
    As[ty][tx] = i < m && ka < K ? A[i * K + ka] : 0.0f;
    Bs[ty][tx] = jb < n && kb < K ? (b_rows ? B[jb * K + kb] : B[kb * n + jb]) : 0.0f;
    __syncthreads();
    const int steps = K - k0 < kTile ? static_cast<int>(K - k0) : kTile;
    for (int k = 0; k < steps; ++k) acc = fma(As[ty][k], Bs[k][tx], acc);
    __syncthreads();
  }
  if (i < m && j < n) C[i * n + j] = P(acc, bf16);
}

__global__ void transpose_kernel(const float* src, float* dst, int64_t rows, int64_t cols) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (e < rows * cols) dst[(e % cols) * rows + e / cols] = src[e];
}

__global__ void scale_add_kernel(const float* x, float s, const float* y, float* out, int64_t n, bool bf16) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (e < n) out[e] = y ? P(P(s * x[e], bf16) + y[e], bf16) : P(s * x[e], bf16);
}

__global__ void divide_kernel(float* x, int64_t n, float d, bool bf16) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (e < n) x[e] = P(x[e] / d, bf16);
}

// sums[i] = the double sum of row i's squares, in column order; with s (per_row or per column), of the
// normalised values (O s)^2 (step 8).
__global__ void row_squares_kernel(const float* x, const float* s, bool per_row, double* sums, int64_t rows,
                                   int64_t cols) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= rows) return;
  double sum = 0;
  for (int64_t j = 0; j < cols; ++j) {
    const float u = s ? x[i * cols + j] * (per_row ? s[i] : s[j]) : x[i * cols + j];
    sum += static_cast<double>(u) * u;
  }
  sums[i] = sum;
}

__global__ void mirror_lower_kernel(float* C, int64_t m) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t i = e / m, j = e % m;
  if (e < m * m && i < j) C[e] = C[j * m + i];
}

__global__ void set_diagonal_kernel(const float* Z, float a, float* Q, int64_t m, bool bf16) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (e < m * m) Q[e] = e / m == e % m ? P(Z[e] + a, bf16) : Z[e];
}

__global__ void momentum_kernel(float* M, const float* g, float* U, int64_t n, float w1, float beta1, bool nesterov) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (e < n) U[e] = momentum_element(M[e], g[e], w1, beta1, nesterov);
}

// Steps 4-5: one thread per statistic, its sum of squares in double in index order.
__global__ void second_moment_kernel(const float* O, float* v, int64_t rows, int64_t cols, bool per_row, float w2) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t count = per_row ? cols : rows;
  if (k >= (per_row ? rows : cols)) return;
  double sum = 0;
  for (int64_t t = 0; t < count; ++t) {
    const float o = per_row ? O[k * cols + t] : O[t * cols + k];
    sum += static_cast<double>(o) * o;
  }
  v[k] = lerp(v[k], static_cast<float>(sum / static_cast<double>(count)), w2);
}

__global__ void inverse_scales_kernel(const float* v, float* s, int64_t n, float denom_eps, bool eps_add) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (e < n) s[e] = inverse_scale(v[e], denom_eps, eps_add);
}

__global__ void apply_kernel(const float* O, const float* s, float* p, int64_t rows, int64_t cols, bool per_row,
                             float rho, float kappa, int wd_mode, float decay_factor, float lr_wd, float neg_lr) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (e >= rows * cols) return;
  const float u = normalised_element(O[e], per_row ? s[e / cols] : s[e % cols], rho, kappa);
  p[e] = normuon_param(p[e], u, wd_mode, decay_factor, lr_wd, neg_lr);
}

__global__ void adamw_kernel(float* p, const float* g, float* m, float* v, int64_t n, AdamWScalars s) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (e < n) adamw_element(p[e], g[e], m[e], v[e], s);
}

}  // namespace normuon::spec::cuda
