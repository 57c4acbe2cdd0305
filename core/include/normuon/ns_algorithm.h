// What the two Newton-Schulz algorithms of docs/spec.md section 3.2 do and cost, shared by every backend
// and the benchmarks: when Gram Newton-Schulz applies and restarts, and the FLOPs of each way to iterate.
#pragma once

#include <cstdint>

#include "normuon/options.h"

namespace normuon {

// Gram Newton-Schulz iterates on the m x m Gram matrix of the wide orientation (m <= n); a square matrix
// gains nothing from it and takes the standard iteration (as Dao-AILab/gram-newton-schulz does).
constexpr bool ns_uses_gram(NsAlgorithm algorithm, int64_t rows, int64_t cols) {
  return algorithm == NsAlgorithm::gram && rows != cols;
}

// Restarts (X <- Q X, R <- X X^T, Q <- I) happen before iterations 2, 5, 8, ... (0-based): after the
// second, as the authors' default for 5 iterations, then every third, so that no stretch of a longer
// quintic schedule lets Q grow (a^k on the null space of X) or collect rounding for long.
constexpr bool gram_restarts_before(int iteration) { return iteration >= 2 && (iteration - 2) % 3 == 0; }

// What iteration k (0-based) of an ns_steps Gram run does: every backend's loop and the counts below
// follow it.
struct NsGramIteration {
  bool restart;   // X = Q X and R = sym(X X^T) first
  bool fresh;     // Q = P(Z + a I) (k = 0 or a restart), else Q = P(P(a Q) + sym(Q Z))
  bool update_r;  // R = (Z + a I) R (Z + a I) for the next iteration (not the last, nor before a restart)
};
constexpr NsGramIteration ns_gram_iteration(int k, int steps) {
  const bool restart = k > 0 && gram_restarts_before(k);
  return {restart, k == 0 || restart, k + 1 < steps && !gram_restarts_before(k + 1)};
}

// FLOPs (2 per multiply-add) of orthogonalising one matrix, m = min(rows, cols), n = max(rows, cols).
// The full dense standard iteration: X X^T, (cA) A and B X, every product computed in full. This is the
// "useful" count: the work the standard algorithm defines, whatever a backend actually computes.
constexpr double ns_standard_dense_flops(int64_t rows, int64_t cols, int steps) {
  const double m = static_cast<double>(rows < cols ? rows : cols), n = static_cast<double>(rows < cols ? cols : rows);
  return steps * (4 * m * m * n + 2 * m * m * m);
}

// The products of one Gram run on a non-square matrix: X X^T (m x m x n: the first and one per restart), Q X
// (m x m x n: one per restart and the final one) and the m x m x m ones, per iteration (cR) R, Q Z (after
// the first of a stretch), and R Z, Z (RZ) unless the next iteration restarts or ends.
struct NsGramProducts {
  int gram = 1, apply = 1, square = 0;
};
constexpr NsGramProducts ns_gram_products(int steps) {
  NsGramProducts p;
  for (int k = 0; k < steps; ++k) {
    const NsGramIteration it = ns_gram_iteration(k, steps);
    p.gram += it.restart;
    p.apply += it.restart;
    p.square += (it.fresh ? 1 : 2) + (it.update_r ? 2 : 0);
  }
  return p;
}

// Gram Newton-Schulz with every product in full (what the reference computes). Square matrices: the
// standard count.
constexpr double ns_gram_dense_flops(int64_t rows, int64_t cols, int steps) {
  if (rows == cols) return ns_standard_dense_flops(rows, cols, steps);
  const double m = static_cast<double>(rows < cols ? rows : cols), n = static_cast<double>(rows < cols ? cols : rows);
  const NsGramProducts p = ns_gram_products(steps);
  return 2 * ((p.gram + p.apply) * m * m * n + p.square * m * m * m);
}

inline double ns_dense_flops(NsAlgorithm algorithm, int64_t rows, int64_t cols, int steps) {
  return algorithm == NsAlgorithm::gram ? ns_gram_dense_flops(rows, cols, steps)
                                        : ns_standard_dense_flops(rows, cols, steps);
}

}  // namespace normuon
