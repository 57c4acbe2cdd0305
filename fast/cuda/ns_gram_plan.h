// Gram Newton-Schulz on the fast CUDA backend (docs/spec.md section 3.2), the host side: which GEMMs a
// run makes and on which buffers, and what each iteration does (restart, fresh Q, R updated). The run
// itself (ns_run.cuh) and its launch count both follow from ns_gram_iteration (ns_algorithm.h, shared
// with every backend), so they agree.
// Plain C++ (no CUDA), so tests check it on any machine.
//
// The spec's loop on the wide s x l matrix X, with the buffers that hold each value (P rounds to the
// working precision, sym(C) keeps C's lower triangle and mirrors it):
//   R = sym(X X^T)                        GEMM gram into R, mirrored in place by the next kernel
//   C = P(c_0 R)                          (same kernel)
//   per iteration k:
//     restart: X = Q X, R = sym(X X^T), C = P(c_k R)
//     T  = C R                            GEMM
//     Z  = P(P(b R) + sym(T))             kernel; fresh (k = 0 or restart): also Q = P(Z + a I)
//     T  = Q Z,  T2 = R Z                 GEMMs: Q Z unless fresh, R Z when R is updated
//     Q  = P(P(a Q) + sym(T)),  RZ = P(P(a R) + sym(T2))     one kernel, RZ in the C buffer
//     T  = Z RZ                           GEMM, when R is updated
//     R  = P(P(a RZ) + sym(T)),  C = P(c_{k+1} R)            one kernel, C over RZ
//   X = Q X
// Every symmetric product (X X^T and the s x s ones) is computed as its lower panels (ns_gemm_plan.h)
// and mirrored by the elementwise kernel that reads it (lower triangle wins, as the spec's sym), so
// every buffer a GEMM reads is exactly symmetric.
//
// GEMM layouts: those of the standard plan (ns_gemm_plan.h), with other operands. X X^T is the gram GEMM,
// every s x s product the square GEMM's layout (N,N, s x s, ld s), X = Q X the apply GEMM with Q as the
// s x s operand (Q is symmetric, so the wide plan's Q^T is Q). X moves between the x and u buffers with
// every X = Q X (cuBLASLt cannot write over an input); u has x's stride, so the layouts are the same.
#pragma once

#include "normuon/ns_algorithm.h"
#include "ns_gemm_plan.h"

namespace normuon::cuda {

// The X = Q X GEMMs of a run: one per restart and the final one.
int ns_gram_applies(int steps);

// Kernels and GEMMs of one run of a non-empty Gram batch (ns_run.cuh): the two norm kernels, X X^T and
// its mirror, then per iteration as above, and the final X = Q X; every symmetric product is `panels`
// GEMMs. 35 for 5 steps with one panel.
int ns_gram_launches(int steps, int panels = 1);

// The GEMMs of a run, as operands of the standard plan's layouts. Buffers: gram holds R, b holds C and
// then RZ, t and t2 the products.
struct NsGramPlan {
  NsGemmSpec gram_x, gram_u;              // R = X X^T with X in x or in u     (layout of plan.gram)
  NsGemmSpec c_r, q_z, r_z, z_rz;         // T = C R, T = Q Z, T2 = R Z, T = Z RZ (layout of plan.square)
  NsGemmSpec apply_x_to_u, apply_u_to_x;  // X = Q X from one X buffer into the other (layout of plan.apply)
};
NsGramPlan ns_gram_plan(const NsGemmPlan& plan);

}  // namespace normuon::cuda
