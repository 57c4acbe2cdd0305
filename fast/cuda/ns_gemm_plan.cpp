#include "ns_gemm_plan.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace normuon::cuda {

NsGemmPlan ns_gemm_plan(int64_t rows, int64_t cols) {
  if (rows < 1 || cols < 1)
    throw std::invalid_argument("ns_gemm_plan: " + std::to_string(rows) + "x" + std::to_string(cols) +
                                " has no elements");
  NsGemmPlan p{};
  p.tall = rows > cols;
  p.s = std::min(rows, cols);
  p.l = std::max(rows, cols);
  const int64_t s = p.s, l = p.l;
  const NsMatrixSpec gram{s, s, s, NsOperand::gram};
  const NsMatrixSpec bmat{s, s, s, NsOperand::b};
  p.square = {false, false, bmat, gram, {s, s, s, NsOperand::t}};  // T = C A (C in the B buffer)
  if (!p.tall) {
    const NsMatrixSpec z{l, s, l, NsOperand::x};  // Z = X^T, column-major l x s
    p.gram = {true, false, z, z, gram};                          // A = Z^T Z
    p.apply = {false, true, z, bmat, {l, s, l, NsOperand::u}};  // U^T = Z B^T
  } else {
    const NsMatrixSpec w{s, l, s, NsOperand::x};  // W = X, column-major s x l
    p.gram = {false, true, w, w, gram};                           // A = W W^T
    p.apply = {false, false, bmat, w, {s, l, s, NsOperand::u}};  // U = B W
  }
  return p;
}

}  // namespace normuon::cuda
