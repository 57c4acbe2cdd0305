// The symmetric elementwise kernel of Newton-Schulz (docs/spec.md section 3.2), both algorithms: every
// symmetric product (X X^T, C A; Gram's s x s products) is computed as its lower triangle only
// (ns_gemm_plan.h), and this kernel is the elementwise step that reads it. Included by
// newton_schulz_cuda.cu and by the tests' host emulation (tests/simt), like ns_kernels.cuh.
//
// The kernel computes each element of the lower triangle (i >= j) from the GEMM product's own lower
// element, rounds as the spec does, and writes it at (i, j) and at (j, i): the spec's sym (lower triangle
// wins) folded into the elementwise step that reads the product, so no launch is spent on mirroring.
// Its other inputs are symmetric (every s x s buffer a kernel writes is), so it reads only lower tiles,
// and writes the upper ones through shared memory; every access is coalesced. In place is safe: a
// lower element is read and written by one thread, and no one reads an upper element.
#pragma once

#include "ns_kernels.cuh"

namespace normuon::cuda::ns_device {
namespace {  // internal linkage, as ns_kernels.cuh

// out = P(P(coef a) + sym(t)), or out = sym(t) (already rounded: a GEMM output) when a is null. Unused
// when out is null. t is a GEMM product; a, when given, an exactly symmetric buffer.
template <typename T>
struct SymLane {
  const T* a;
  const T* t;
  T* out;
  float coef;
};

// What lane 0's (rounded) value v also writes: nothing, P(coef v) (C = P(c R)), or v + coef rounded on
// the diagonal and v itself off it (Q = P(Z + a I): off the diagonal Z + 0 would turn -0 into +0).
enum : int { kSymFollowNone = 0, kSymFollowScaled = 1, kSymFollowPlusDiagonal = 2 };
template <typename T>
struct SymFollow {
  T* out;
  int mode;
  float coef;
};

// Lower tile p (0-based, row by row: (0,0), (1,0), (1,1), (2,0), ...) as its tile row and column.
__device__ __forceinline__ void lower_tile(int64_t p, int64_t& row, int64_t& col) {
  int64_t r = static_cast<int64_t>((sqrt(8.0 * static_cast<double>(p) + 1.0) - 1.0) / 2.0);
  while (r * (r + 1) / 2 > p) --r;  // the double estimate can be one off either way
  while ((r + 1) * (r + 2) / 2 <= p) ++r;
  row = r;
  col = p - r * (r + 1) / 2;
}

template <typename T>
__device__ __forceinline__ float sym_lane_value(const SymLane<T>& l, int64_t e) {
  const T* tag = nullptr;
  const float t = to_float(l.t[e]);
  if (!l.a) return t;
  // Explicit _rn ops: the spec's roundings as written, never contracted into an fma.
  return round_p(__fadd_rn(round_p(__fmul_rn(l.coef, to_float(l.a[e])), tag), t), tag);
}

template <typename T>
__device__ __forceinline__ float sym_follow_value(const SymFollow<T>& f, float v, bool diagonal) {
  const T* tag = nullptr;
  if (f.mode == kSymFollowScaled) return round_p(__fmul_rn(f.coef, v), tag);
  return diagonal ? round_p(__fadd_rn(v, f.coef), tag) : v;
}

// One block per (matrix, lower tile): the elements (i, j), i >= j, of the tile are computed where they
// lie (phase 1, coalesced along i), and written again at (j, i), i > j, from shared memory (phase 2,
// coalesced along j). Column-major s x s matrices: element (i, j) at i + j s.
template <typename T>
__global__ void __launch_bounds__(kNsThreads)
    ns_sym_combine(SymLane<T> l0, SymLane<T> l1, SymFollow<T> f, NsSymTiling tl) {
  __shared__ float tile[3][kNsSymTile][kNsSymTile + 1];  // lane 0, lane 1, follow; +1: no bank conflicts
  constexpr int kRows = kNsThreads / kNsSymTile;
  const int64_t matrix = blockIdx.x / tl.tiles;
  int64_t tile_row = 0, tile_col = 0;
  lower_tile(blockIdx.x % tl.tiles, tile_row, tile_col);
  const int64_t s = tl.s, base = matrix * tl.stride;
  const int64_t i0 = tile_row * kNsSymTile, j0 = tile_col * kNsSymTile;
  const int lane = threadIdx.x % kNsSymTile, first = threadIdx.x / kNsSymTile;
  const bool follow = f.mode != kSymFollowNone;

  const int64_t i = i0 + lane;
  for (int c = first; c < kNsSymTile; c += kRows) {
    const int64_t j = j0 + c;
    if (i >= s || j > i) continue;  // j < s follows from j <= i < s
    const int64_t e = base + i + j * s;
    if (l0.out) {
      const float v = sym_lane_value(l0, e);
      store1(l0.out + e, v);
      tile[0][lane][c] = v;
      if (follow) {
        const float w = sym_follow_value(f, v, i == j);
        store1(f.out + e, w);
        tile[2][lane][c] = w;
      }
    }
    if (l1.out) {
      const float v = sym_lane_value(l1, e);
      store1(l1.out + e, v);
      tile[1][lane][c] = v;
    }
  }
  __syncthreads();
  const int64_t j = j0 + lane;
  for (int r = first; r < kNsSymTile; r += kRows) {
    const int64_t ii = i0 + r;
    if (ii >= s || j >= ii) continue;  // the strictly lower elements, mirrored
    const int64_t e = base + j + ii * s;
    if (l0.out) {
      store1(l0.out + e, tile[0][r][lane]);
      if (follow) store1(f.out + e, tile[2][r][lane]);
    }
    if (l1.out) store1(l1.out + e, tile[1][r][lane]);
  }
}

}  // namespace
}  // namespace normuon::cuda::ns_device
