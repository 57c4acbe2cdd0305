// The three cuBLASLt GEMMs of one Newton-Schulz iteration (docs/spec.md section 3.2): transposes,
// layouts and which buffer each operand is. Plain C++ (no CUDA), so tests check it on any machine.
//
// An iteration, as the spec rounds it (P rounds to the working precision):
//   A = P(X X^T)                      GEMM "gram"
//   C = P(c A)                        elementwise, into the B buffer
//   T = P(C A)                        GEMM "square"   (the official `c * A @ A` is (c*A) @ A)
//   B = P(P(b A) + T)                 elementwise, into the B buffer
//   U = P(B X)                        GEMM "apply"
//   X = P(P(a X) + U)                 elementwise, in place
// Every GEMM is D = op(A) op(B) (alpha 1, beta 0, C = D), rounded once to the working precision.
//
// GEMM layouts. cuBLASLt is column-major, and a row-major R x C matrix in memory is the column-major
// C x R matrix (ld = C), i.e. its transpose. Let s = min(rows, cols), l = max(rows, cols); the spec
// iterates on the wide s x l matrix X. The s x s buffers are written by cuBLASLt or elementwise from its
// outputs, so their column-major views hold A, C, T and B themselves.
// Wide (rows = s <= cols = l): memory holds Z = X^T, column-major l x s, ld = l.
//   gram   A = X X^T = Z^T Z          T,N  m=s n=s k=l   A:Z (l x s, ld l)  B:Z  D:gram (s x s, ld s)
//   square T = C A                    N,N  m=s n=s k=s   A:C (the B buffer)  B:A  D:T, all s x s, ld s
//   apply  U^T = (B X)^T = Z B^T      N,T  m=l n=s k=s   A:Z (l x s, ld l)  B:B (s x s)  D:U (l x s, ld l)
//   U in memory is B X row-major, X's stored orientation.
// Tall (rows = l > cols = s): memory holds W = M^T = X (M is the stored l x s matrix), column-major
// s x l, ld = s.
//   gram   A = W W^T                  N,T  m=s n=s k=l   A:W (s x l, ld s)  B:W  D:gram (s x s, ld s)
//   square as above
//   apply  U = B W                    N,N  m=s n=l k=s   A:B (s x s)  B:W (s x l, ld s)  D:U (s x l, ld s)
//   U in memory is the row-major l x s matrix U^T, the stored orientation.
// B^T (not B) in the wide apply keeps the algebra exact even where the computed A is not bit-symmetric.
//
// Symmetric products (docs/spec.md section 3.2). X X^T and C A are symmetric, so the run computes only
// their lower triangle, in column panels (../symmetric_panels.h): panel (c0, w) is the GEMM of rows
// [c0, s) and columns [c0, c0 + w) of D, the same dot products as the full GEMM's, written where the full
// GEMM writes them (ld s), with its operands read from offsets into the same buffers. The elementwise
// kernel that reads the product mirrors it (ns_sym_kernels.cuh). With p panels the products cost
// (p + 1) / 2p of the full ones.
#pragma once

#include <cstdint>
#include <vector>

#include "../symmetric_panels.h"

namespace normuon::cuda {

// The buffers of one iteration: X; the Gram matrix A; the s x s buffer that holds C = P(c A) and then
// B; the GEMM products T (s x s) and U (X's layout). Gram Newton-Schulz (ns_gram_plan.h) also uses the
// s x s buffers Q, Z and a second product T2, and holds X in x or u.
enum class NsOperand { x, gram, b, t, u, q, z, t2 };

struct NsMatrixSpec {
  int64_t rows, cols, ld;  // column-major, as cuBLASLt reads it (before op)
  NsOperand operand;
  int64_t offset = 0;  // elements from the start of each matrix of the operand's buffer (a panel's corner)
};

// D = op(A) op(B); D is also cuBLASLt's C (beta = 0).
struct NsGemmSpec {
  bool trans_a, trans_b;
  NsMatrixSpec a, b, d;
};

struct NsGemmPlan {
  NsGemmSpec gram, square, apply;
  int64_t s, l;
  bool tall;  // rows > cols
};

// For rows, cols >= 1.
NsGemmPlan ns_gemm_plan(int64_t rows, int64_t cols);

// The GEMM of one lower panel of the symmetric s x s product `full` (X X^T or an s x s product: m = n = s):
// rows [c0, s) and columns [c0, c0 + width) of D, op(A)'s rows [c0, s), op(B)'s columns [c0, c0 + width).
NsGemmSpec ns_panel_gemm(const NsGemmSpec& full, const fast::SymmetricPanel& panel);

// Panel width for symmetric products of s x s over `count` matrices, when the caller leaves it to the
// backend: the narrowest of ceil(s / 8), ceil(s / 4) and ceil(s / 2), rounded up to a multiple of 128 (so
// up to 8 panels, the last one narrower), whose last, smallest panel
//  - still gives the GPU kNsMinPanelTiles output tiles of 128 x 128 over the batch, and
//  - stays compute-bound: a panel re-reads its operands, so a narrow one does little arithmetic per byte.
//    Its GEMM (r x w, inner dimension k; 2-byte operands and output) does r w k / (r k + w k + r w) FLOPs
//    per byte; the last panel (r = w) of the s x s products (k = s, the lowest of Newton-Schulz's
//    products) must reach kNsPanelMinIntensity, well above the dense-bf16 balance of the GPUs served
//    (H100 about 295 FLOP per byte, H200 about 206, B200 about 280).
// Else s: one panel, the full product. Chosen on paper; `bench-cuda --ns-panel-width` measures others.
constexpr int64_t kNsMinPanelTiles = 128;
constexpr double kNsPanelMinIntensity = 450;
int64_t ns_auto_panel_width(int64_t s, int64_t count);
// FLOPs per byte of a panel GEMM of r x w with inner dimension k (2-byte operands and output).
double ns_panel_intensity(int64_t r, int64_t w, int64_t k);

// The lower panels of an s x s product: `width` (0: ns_auto_panel_width) in [ceil(s / kNsMaxPanels), s],
// so that a tiny width cannot plan thousands of GEMMs.
constexpr int64_t kNsMaxPanels = 64;
std::vector<fast::SymmetricPanel> ns_panels(int64_t s, int64_t count, int64_t width);

// The alignment (bytes, a power of two up to 256) cuBLASLt may assume for an operand `offset` elements
// into a matrix whose buffer and batch stride are 256-byte aligned (cudaMalloc; kNsStrideAlign).
uint32_t ns_operand_alignment(int64_t offset, int64_t element_bytes);

// Batch stride of an operand's buffer: x and u hold X-shaped matrices, the others s x s ones.
inline int64_t ns_batch_stride(NsOperand o, int64_t x_stride, int64_t gram_stride) {
  return o == NsOperand::x || o == NsOperand::u ? x_stride : gram_stride;
}

// Base pointers of a batch's buffers (P: a pointer type, or anything naming a buffer).
template <typename P>
struct NsBuffers {
  P x, gram, b, t, u;
  P q{}, z{}, t2{};  // Gram Newton-Schulz only
};

template <typename P>
P ns_operand_pointer(NsOperand o, const NsBuffers<P>& buf) {
  switch (o) {
    case NsOperand::x: return buf.x;
    case NsOperand::gram: return buf.gram;
    case NsOperand::b: return buf.b;
    case NsOperand::t: return buf.t;
    case NsOperand::q: return buf.q;
    case NsOperand::z: return buf.z;
    case NsOperand::t2: return buf.t2;
    case NsOperand::u: break;
  }
  return buf.u;
}

template <typename P>
struct NsGemmPointers {
  P a, b, d;
};

// The a, b, d buffers of one GEMM of the plan (each operand's offset is the caller's to add).
template <typename P>
NsGemmPointers<P> ns_gemm_pointers(const NsGemmSpec& g, const NsBuffers<P>& buf) {
  return {ns_operand_pointer(g.a.operand, buf), ns_operand_pointer(g.b.operand, buf),
          ns_operand_pointer(g.d.operand, buf)};
}

}  // namespace normuon::cuda
