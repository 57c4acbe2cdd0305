// Device code of batched Newton-Schulz (docs/spec.md section 3.2) besides the GEMMs: the normalisation
// X = P(X / P(||X|| + eps)) in two deterministic kernels, and the elementwise step on X of an iteration.
// The symmetric kernel is in ns_sym_kernels.cuh, the order of a run in ns_run.cuh. Included by
// newton_schulz_cuda.cu and by the tests' host emulation of the step (tests/simt), so the code the tests
// run is this code.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "normuon/ns_coefficients.h"
#include "ns_batch_geometry.h"

namespace normuon::cuda::ns_device {
namespace {  // internal linkage: the library and the tests' emulation each get their own copy

__device__ __forceinline__ int64_t ceil_div(int64_t x, int64_t m) { return (x + m - 1) / m; }

// Block blockIdx.x's share of a slicing: its matrix and its groups of kNsVec elements, [begin, end).
struct SliceGroups {
  int64_t matrix, begin, end;
};
__device__ __forceinline__ SliceGroups slice_groups(const NsSlicing& sl) {
  const int64_t matrix = blockIdx.x / sl.slices, slice = blockIdx.x % sl.slices;
  const int64_t begin = slice * sl.groups_per_slice;
  return {matrix, begin, min(begin + sl.groups_per_slice, ceil_div(sl.n, kNsVec))};
}

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }

// P: round to the working precision (RNE), identity in fp32.
__device__ __forceinline__ float round_p(float x, const __nv_bfloat16*) {
  return __bfloat162float(__float2bfloat16_rn(x));
}
__device__ __forceinline__ float round_p(float x, const float*) { return x; }

__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&v)[kNsVec]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < kNsVec / 2; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void load8(const float* p, float (&v)[kNsVec]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void store8(__nv_bfloat16* p, const float (&v)[kNsVec]) {
  uint4 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < kNsVec / 2; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}
__device__ __forceinline__ void store8(float* p, const float (&v)[kNsVec]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
__device__ __forceinline__ void store1(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ void store1(float* p, float x) { *p = x; }

__device__ __forceinline__ double warp_sum(double x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Block sum in a fixed order (the same tree every launch); the result is valid in thread 0.
__device__ double block_sum(double x) {
  __shared__ double warps[kNsThreads / 32];
  x = warp_sum(x);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warps[warp] = x;
  __syncthreads();
  double total = 0;
  if (warp == 0) total = warp_sum(lane < kNsThreads / 32 ? warps[lane] : 0.0);
  return total;
}

// Kernel 1: block (matrix, slice) writes the sum of squares of its slice, in double, to partials.
// A slice is a run of whole 8-element groups; the matrix's last group may be partial.
template <typename T>
__global__ void __launch_bounds__(kNsThreads)
    ns_norm_partials(const T* __restrict__ x, NsSlicing sl, double* __restrict__ partials) {
  const SliceGroups my = slice_groups(sl);
  const T* xm = x + my.matrix * sl.stride;
  const int64_t n = sl.n;
  double acc = 0;
  for (int64_t g = my.begin + threadIdx.x; g < my.end; g += kNsThreads) {
    const int64_t e = g * kNsVec;
    if (e + kNsVec <= n) {
      float v[kNsVec];
      load8(xm + e, v);
#pragma unroll
      for (int i = 0; i < kNsVec; ++i) acc = fma(static_cast<double>(v[i]), static_cast<double>(v[i]), acc);
    } else {
      for (int64_t i = e; i < n; ++i) {
        const double f = to_float(xm[i]);
        acc = fma(f, f, acc);
      }
    }
  }
  const double total = block_sum(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// Kernel 2: every block of a matrix re-sums that matrix's partials in the same fixed order (so all agree),
// forms denom = P(norm + eps) or P(P(1.02 norm) + eps), and writes X = P(X / denom) over its slice, into
// `out` (x itself, or another X-shaped buffer: Gram Newton-Schulz starts where its last X = Q X ends).
template <typename T>
__global__ void __launch_bounds__(kNsThreads)
    ns_normalise(const T* x, T* out, NsSlicing sl, const double* __restrict__ partials, float eps, float safety,
                 int polar) {
  __shared__ float denom_shared;
  const SliceGroups my = slice_groups(sl);
  if (threadIdx.x < 32) {
    const double* pm = partials + my.matrix * sl.slices;
    double sq = 0;
    for (int i = threadIdx.x; i < sl.slices; i += 32) sq += pm[i];
    sq = warp_sum(sq);
    if (threadIdx.x == 0) {
      const T* tag = nullptr;
      const float norm = round_p(static_cast<float>(sqrt(sq)), tag);
      // Explicit _rn ops: two roundings as written, never contracted into an fma (fp32 mode has no P).
      const float denom = polar ? round_p(__fadd_rn(round_p(__fmul_rn(norm, safety), tag), eps), tag)
                                : round_p(__fadd_rn(norm, eps), tag);
      denom_shared = denom;
    }
  }
  __syncthreads();
  const float denom = denom_shared;
  const T* xm = x + my.matrix * sl.stride;
  T* om = out + my.matrix * sl.stride;  // may be xm: each element is read and written by one thread
  const int64_t n = sl.n;
  for (int64_t g = my.begin + threadIdx.x; g < my.end; g += kNsThreads) {
    const int64_t e = g * kNsVec;
    if (e + kNsVec <= n) {
      float v[kNsVec];
      load8(xm + e, v);
#pragma unroll
      for (int i = 0; i < kNsVec; ++i) v[i] = __fdiv_rn(v[i], denom);  // a true division, as the reference
      store8(om + e, v);  // stores round to bf16 (RNE) in bf16 mode: X = P(X / denom)
    } else {
      for (int64_t i = e; i < n; ++i) store1(om + i, __fdiv_rn(to_float(xm[i]), denom));
    }
  }
}

// Kernel 3, the elementwise step on X of an iteration: D = P(P(coef A) + T) over the slices of every
// matrix. The products round as the reference's ops do (explicit _rn, never an fma); D may be A (in place:
// each element is read and written by the same thread).
template <typename T>
__global__ void __launch_bounds__(kNsThreads)
    ns_combine(T* d, const T* a, const T* __restrict__ t, NsSlicing sl, float coef) {
  const SliceGroups my = slice_groups(sl);
  const int64_t base = my.matrix * sl.stride;
  const int64_t n = sl.n;
  const T* tag = nullptr;
  for (int64_t g = my.begin + threadIdx.x; g < my.end; g += kNsThreads) {
    const int64_t e = base + g * kNsVec;
    if (g * kNsVec + kNsVec <= n) {
      float v[kNsVec], w[kNsVec];
      load8(a + e, v);
      load8(t + e, w);
#pragma unroll
      for (int i = 0; i < kNsVec; ++i) v[i] = __fadd_rn(round_p(__fmul_rn(coef, v[i]), tag), w[i]);
      store8(d + e, v);  // rounds to bf16 (RNE) in bf16 mode: the outer P
    } else {
      for (int64_t i = e; i < base + n; ++i)
        store1(d + i, __fadd_rn(round_p(__fmul_rn(coef, to_float(a[i])), tag), to_float(t[i])));
    }
  }
}

}  // namespace
}  // namespace normuon::cuda::ns_device
