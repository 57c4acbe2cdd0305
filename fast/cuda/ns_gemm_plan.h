// The three cuBLASLt GEMMs of one Newton-Schulz iteration (docs/spec.md section 3.2): transposes,
// layouts and which buffer each operand is. Plain C++ (no CUDA), so tests check it on any machine.
//
// GEMM layouts. cuBLASLt is column-major, and a row-major R x C matrix in memory is the column-major
// C x R matrix (ld = C), i.e. its transpose. Let s = min(rows, cols), l = max(rows, cols); the spec
// iterates on the wide s x l matrix X. Every GEMM is D = alpha op(A) op(B) + beta C with m x n outputs.
//
// Wide (rows = s <= cols = l): memory holds Z = X^T, column-major l x s, ld = l.
//   gram   A = X X^T = Z^T Z      T,N  m=s n=s k=l   A:Z (l x s, ld l)  B:Z (l x s, ld l)  C=D:A (s x s, ld s)
//   square B = c A A + b A        N,N  m=s n=s k=s   A:A  B:A  C:A  D:B, all (s x s, ld s)
//   apply  X'^T = (B X)^T + a X^T = Z B^T + a Z
//                                 N,T  m=l n=s k=s   A:Z (l x s, ld l)  B:B (s x s, ld s)  C:Z  D:Z' (l x s, ld l)
//   Z' in memory is X' row-major, the stored orientation.
// Tall (rows = l > cols = s): memory holds W = M^T = X (M is the stored l x s matrix), column-major
// s x l, ld = s.
//   gram   A = W W^T              N,T  m=s n=s k=l   A:W (s x l, ld s)  B:W (s x l, ld s)  C=D:A (s x s, ld s)
//   square as above
//   apply  W' = B W + a W         N,N  m=s n=l k=s   A:B (s x s, ld s)  B:W (s x l, ld s)  C:W  D:W' (s x l, ld s)
//   W' in memory is the row-major l x s matrix W'^T, the stored orientation.
// B^T (not B) in the wide apply keeps the algebra exact even where the computed A is not bit-symmetric.
#pragma once

#include <cstdint>

namespace normuon::cuda {

// The buffers of one iteration: the current X, the Gram matrix A and B = b A + c A A.
enum class NsOperand { x, gram, b };

struct NsMatrixSpec {
  int64_t rows, cols, ld;  // column-major, as cuBLASLt reads it (before op)
  NsOperand operand;
};

// D = alpha op(A) op(B) + beta C; D has C's layout. An x D is the next X buffer (the apply's output).
struct NsGemmSpec {
  bool trans_a, trans_b;
  NsMatrixSpec a, b, c;
  NsOperand d;
};

struct NsGemmPlan {
  NsGemmSpec gram, square, apply;
  int64_t s, l;
  bool tall;  // rows > cols
};

// For rows, cols >= 1.
NsGemmPlan ns_gemm_plan(int64_t rows, int64_t cols);

// Batch stride of an operand's layout: x buffers hold the stored matrices, gram and b the s x s ones.
inline int64_t ns_batch_stride(NsOperand o, int64_t x_stride, int64_t gram_stride) {
  return o == NsOperand::x ? x_stride : gram_stride;
}

// Base pointers of one iteration's buffers; next receives X' (the X buffers ping-pong).
template <typename P>
struct NsBuffers {
  P x, next, gram, b;
};

template <typename P>
struct NsGemmPointers {
  P a, b, c, d;
};

template <typename P>
P ns_operand_pointer(NsOperand o, const NsBuffers<P>& buf) {
  return o == NsOperand::x ? buf.x : o == NsOperand::gram ? buf.gram : buf.b;
}

// The a, b, c, d pointers of one GEMM of the plan.
template <typename P>
NsGemmPointers<P> ns_gemm_pointers(const NsGemmSpec& g, const NsBuffers<P>& buf) {
  return {ns_operand_pointer(g.a.operand, buf), ns_operand_pointer(g.b.operand, buf),
          ns_operand_pointer(g.c.operand, buf), g.d == NsOperand::x ? buf.next : ns_operand_pointer(g.d, buf)};
}

}  // namespace normuon::cuda
