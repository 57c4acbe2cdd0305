// The spec GEMM's blocked driver (spec_gemm.h), written once over a vector type and included by one
// source file per instruction set, each compiled for it. Everything here has internal linkage, so the
// per-ISA copies never merge at link time.
//
// Each C element is one fma chain in increasing k, whatever the blocking: an Mr x NR tile keeps its chains
// in registers over a block of KC steps of k, stores the fp32 accumulators and reloads them for the next
// block (exact). Threads own whole column panels, so no element is ever split between threads.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kKc = 256;  // k steps per block: the packed B panel stays in L1, the packed A block in L2
constexpr int kNv = 2;        // vectors per tile row

// V: the vector type's traits: reg, W (floats per reg), Mr (rows per tile: 2 Mr accumulators and 3 more
// registers must fit the register file), zero(), load(p), store(p, r), bcast(x), fma(a, b, c) (c + a b
// with one rounding).
//
// One Mr x (kNv W) tile of C over kc steps of k: ap is the A block packed k-major (ap[k Mr + r]), bp the
// B panel packed (bp[k kNv W + j]); c (row stride ldc) holds the accumulators of the earlier blocks.
template <class V>
inline void tile(const float* ap, const float* bp, float* c, int64_t ldc, int64_t kc, bool first) {
  typename V::reg acc[V::Mr][kNv];
  for (int r = 0; r < V::Mr; ++r)
    for (int v = 0; v < kNv; ++v) acc[r][v] = first ? V::zero() : V::load(c + r * ldc + v * V::W);
  for (int64_t k = 0; k < kc; ++k) {
    typename V::reg b[kNv];
    for (int v = 0; v < kNv; ++v) b[v] = V::load(bp + k * kNv * V::W + v * V::W);
    for (int r = 0; r < V::Mr; ++r) {
      const typename V::reg x = V::bcast(ap[k * V::Mr + r]);
      for (int v = 0; v < kNv; ++v) acc[r][v] = V::fma(x, b[v], acc[r][v]);
    }
  }
  for (int r = 0; r < V::Mr; ++r)
    for (int v = 0; v < kNv; ++v) V::store(c + r * ldc + v * V::W, acc[r][v]);
}

// The column panels [begin, end) of thread t of `threads`, balanced by the tiles each computes (with
// lower_only, a panel starting at column j0 skips the row blocks above it).
inline std::pair<int64_t, int64_t> panel_share(int64_t panels, int64_t nr, int64_t mr, int64_t row_blocks,
                                                bool lower_only, int t, int threads) {
  auto tiles = [&](int64_t p) { return lower_only ? row_blocks - std::min(row_blocks, p * nr / mr) : row_blocks; };
  int64_t total = 0;
  for (int64_t p = 0; p < panels; ++p) total += tiles(p);
  int64_t begin = 0, end = 0, seen = 0;
  for (int64_t p = 0; p < panels; ++p) {  // a panel goes to the thread in whose share its first tile falls
    const int owner = static_cast<int>(total > 0 ? seen * threads / total : 0);
    seen += tiles(p);
    if (owner < t) begin = p + 1;
    if (owner <= t) end = p + 1;
  }
  return {begin, std::max(begin, end)};
}

// C = A B (B given as k x n) or A B^T (b_rows: B given as n x k) without the final rounding (the caller
// applies P). lower_only: only the tiles that reach the lower triangle are computed (X X^T, whose upper
// triangle the caller mirrors: fma is commutative, so element (j, i) is element (i, j)'s very chain).
// One parallel region: each thread owns whole column panels and runs all their k blocks.
template <class V>
void gemm_chains(const float* A, const float* B, bool b_rows, float* C, int64_t m, int64_t K, int64_t n,
                 bool lower_only) {
  constexpr int64_t nr = kNv * V::W, mr = V::Mr;
  const int64_t panels = (n + nr - 1) / nr, row_blocks = (m + mr - 1) / mr;
  if (K == 0) {
    std::fill(C, C + m * n, 0.0f);
    return;
  }
  const bool parallel = static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(K) >= 1 << 21;
#pragma omp parallel if (parallel)
  {
    const auto [p_begin, p_end] =
        panel_share(panels, nr, mr, row_blocks, lower_only, omp_get_thread_num(), omp_get_num_threads());
    if (p_begin < p_end) {
      const int64_t b_first = lower_only ? p_begin * nr / mr : 0;  // no tile of these panels lies above
      std::vector<float> ap(static_cast<size_t>(row_blocks * mr * std::min(kKc, K)));
      std::vector<float> bp(static_cast<size_t>(kKc * nr));
      std::vector<float> edge(static_cast<size_t>(mr * nr));  // a tile that runs past m or n
      for (int64_t k0 = 0; k0 < K; k0 += kKc) {
        const int64_t kc = std::min(kKc, K - k0);
        const bool first = k0 == 0;
        for (int64_t b = b_first; b < row_blocks; ++b)  // A's block, k-major per tile of rows; rows past m are 0
          for (int64_t k = 0; k < kc; ++k)
            for (int64_t r = 0; r < mr; ++r) {
              const int64_t i = b * mr + r;
              ap[(b * kc + k) * mr + r] = i < m ? A[i * K + k0 + k] : 0.0f;
            }
        for (int64_t p = p_begin; p < p_end; ++p) {
          const int64_t j0 = p * nr, cols = std::min(nr, n - j0);
          if (b_rows) {  // B^T's rows j0.. are the panel's columns
            for (int64_t j = 0; j < nr; ++j)
              for (int64_t k = 0; k < kc; ++k) bp[k * nr + j] = j < cols ? B[(j0 + j) * K + k0 + k] : 0.0f;
          } else {
            for (int64_t k = 0; k < kc; ++k)
              for (int64_t j = 0; j < nr; ++j) bp[k * nr + j] = j < cols ? B[(k0 + k) * n + j0 + j] : 0.0f;
          }
          for (int64_t b = lower_only ? j0 / mr : 0; b < row_blocks; ++b) {
            const int64_t i0 = b * mr, rows = std::min(mr, m - i0);
            const float* a = ap.data() + b * kc * mr;
            float* c = C + i0 * n + j0;
            if (rows == mr && cols == nr) {
              tile<V>(a, bp.data(), c, n, kc, first);
            } else {  // through a full tile; the padding's chains are discarded
              for (int64_t r = 0; r < rows && !first; ++r) std::copy(c + r * n, c + r * n + cols, edge.data() + r * nr);
              tile<V>(a, bp.data(), edge.data(), nr, kc, first);
              for (int64_t r = 0; r < rows; ++r) std::copy(edge.data() + r * nr, edge.data() + r * nr + cols, c + r * n);
            }
          }
        }
      }
    }
  }
}

}  // namespace
