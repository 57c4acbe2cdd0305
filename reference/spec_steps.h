// The spec's NorMuon and AdamW steps of one parameter (docs/spec.md sections 3 and 4), written once over
// a device's primitives (Ops: CpuOps in cpu_ops.h). Each primitive is a plain loop over elements or a spec
// GEMM chain, so the result is a function of the spec alone: the same bits on every processor, thread
// count and device.
//
// Ops provides, on pointers to its device's memory:
//   float* scratch(slot, n)                     a buffer of n floats, kept for reuse (slots 0..5)
//   gemm(A, B, C, m, k, n, bf16)                C = P(A B), the spec GEMM (spec_gemm.h)
//   gemm_abt(A, B, C, m, k, n, bf16)            C = P(A B^T), B given as n x k: the same chains
//   transpose(src, dst, rows, cols)             dst (cols x rows) = src^T
//   scale_add(x, s, y, out, n, bf16)            out = P(P(s x) + y); y null: out = P(s x)
//   divide(x, n, d, bf16)                       x = P(x / d)
//   sum_squares(x, rows, cols) -> double        sum over rows in order of each row's sum, in double
//   mirror_lower(C, m)                          C[i,j] = C[j,i] for i < j
//   set_diagonal(Z, a, Q, m, bf16)              Q = Z, then Q[i,i] = P(Z[i,i] + a)
//   momentum(M, g, U, n, w1, beta1, nesterov)   steps 1-2
//   second_moment(O, v, rows, cols, per_row, w2)  steps 4-5: v = lerp(v, fp32(mean of O^2), w2)
//   inverse_scales(v, s, n, denom_eps, eps_add)    step 6
//   normalised_sum_squares(O, s, rows, cols, per_row) -> double   step 8's sum
//   apply(O, s, p, rows, cols, per_row, rho, kappa, wd_mode, decay_factor, lr_wd, neg_lr)   steps 7-11
//   adamw(p, g, m, v, n, scalars)               section 4
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "normuon/backend.h"
#include "normuon/ns_algorithm.h"
#include "normuon/ns_coefficients.h"
#include "normuon/options.h"
#include "spec_ops.h"

namespace normuon::spec {

// The fp32 norm of section 3.2: the double sum of squares (sum_squares' order), its double sqrt rounded
// to fp32; the caller applies P.
inline float fp32_norm(double sum_of_squares) { return static_cast<float>(std::sqrt(sum_of_squares)); }

// Gram Newton-Schulz on the normalised wide X (m < n): section 3.2. Every m x m product is computed in
// full and its lower triangle mirrored (sym). Returns where the result is: X or scratch 2.
template <class Ops>
const float* gram_iteration(Ops& ops, float* X, int64_t m, int64_t n, const NorMuonHyper& h) {
  const bool bf16 = h.ns_precision == NsPrecision::bf16;
  const int64_t mm = m * m;
  float* Xq = ops.scratch(2, m * n);  // Q X, then the next X
  float* R = ops.scratch(3, mm);
  float* Q = ops.scratch(4, mm);
  float* work = ops.scratch(5, 4 * mm);
  float *Z = work, *T = work + mm, *U = work + 2 * mm, *RZ = work + 3 * mm;
  auto gram = [&] {  // R = sym(X X^T)
    ops.gemm_abt(X, X, R, m, n, m, bf16);
    ops.mirror_lower(R, m);
  };
  auto affine = [&](const float* A, float a, const float* B, float* out) {  // out = P(P(a A) + sym(A B))
    ops.gemm(A, B, T, m, m, m, bf16);
    ops.mirror_lower(T, m);
    ops.scale_add(A, a, T, out, mm, bf16);
  };
  gram();
  for (int k = 0; k < h.ns_steps; ++k) {
    const NsGramIteration does = ns_gram_iteration(k, h.ns_steps);
    if (does.restart) {
      ops.gemm(Q, X, Xq, m, m, n, bf16);  // X = Q X
      std::swap(X, Xq);
      gram();
    }
    const NsTriple& co = ns_triple(h.ns_coefficients, k);
    ops.scale_add(R, static_cast<float>(co.c), nullptr, U, mm, bf16);  // P(c R)
    ops.gemm(U, R, T, m, m, m, bf16);
    ops.mirror_lower(T, m);
    ops.scale_add(R, static_cast<float>(co.b), T, Z, mm, bf16);  // Z = P(P(b R) + sym(P(c R) R))
    if (does.fresh) {
      ops.set_diagonal(Z, static_cast<float>(co.a), Q, m, bf16);  // Q = Z + a I
    } else {
      ops.gemm(Q, Z, T, m, m, m, bf16);  // Q = P(P(a Q) + sym(Q Z))
      ops.mirror_lower(T, m);
      ops.scale_add(Q, static_cast<float>(co.a), T, Q, mm, bf16);
    }
    if (does.update_r) {  // R = (Z + a I) R (Z + a I)
      affine(R, static_cast<float>(co.a), Z, RZ);
      ops.gemm(Z, RZ, T, m, m, m, bf16);
      ops.mirror_lower(T, m);
      ops.scale_add(RZ, static_cast<float>(co.a), T, R, mm, bf16);
    }
  }
  ops.gemm(Q, X, Xq, m, m, n, bf16);  // the result, Q X
  return Xq;
}

// NS(U) of section 3.2: U (rows x cols) in, O (rows x cols) out, fp32 values of the working precision.
template <class Ops>
void newton_schulz(Ops& ops, const float* U, float* O, int64_t rows, int64_t cols, const NorMuonHyper& h) {
  if (h.ns_coefficients == NsCoefficients::polar_express && h.ns_steps > kPolarExpressSteps)
    throw std::invalid_argument("ns_steps=" + std::to_string(h.ns_steps) +
                                " but the Polar Express schedule has 5 coefficient triples");
  const bool bf16 = h.ns_precision == NsPrecision::bf16;
  const bool tall = rows > cols;
  const int64_t m = tall ? cols : rows, n = tall ? rows : cols, size = m * n;
  if (size == 0) return;
  // X = P(U), on the wide orientation; scratch 0 holds U^T or the rounded copy, scratch 1 is X.
  float* X = ops.scratch(1, size);
  if (tall) {
    float* Ut = ops.scratch(0, size);
    ops.transpose(U, Ut, rows, cols);
    ops.scale_add(Ut, 1.0f, nullptr, X, size, bf16);
  } else {
    ops.scale_add(U, 1.0f, nullptr, X, size, bf16);
  }
  const float nrm = P(fp32_norm(ops.sum_squares(X, m, n)), bf16);
  const float eps = static_cast<float>(h.ns_eps);
  const float denom = h.ns_coefficients == NsCoefficients::quintic
                          ? P(nrm + eps, bf16)
                          : P(P(nrm * static_cast<float>(kPolarExpressSafety), bf16) + eps, bf16);
  ops.divide(X, size, denom, bf16);
  const float* result = X;
  if (ns_uses_gram(h.ns_algorithm, m, n)) {
    result = gram_iteration(ops, X, m, n, h);
  } else {
    float* A = ops.scratch(3, m * m);
    float* B = ops.scratch(4, m * m);
    float* T = ops.scratch(5, std::max(m * m, size));
    for (int k = 0; k < h.ns_steps; ++k) {
      const NsTriple& co = ns_triple(h.ns_coefficients, k);
      ops.gemm_abt(X, X, A, m, n, m, bf16);                               // A = X X^T
      ops.scale_add(A, static_cast<float>(co.c), nullptr, B, m * m, bf16);  // P(c A)
      ops.gemm(B, A, T, m, m, m, bf16);                                   // P(c A) A
      ops.scale_add(A, static_cast<float>(co.b), T, B, m * m, bf16);      // B = P(P(b A) + P(c A) A)
      ops.gemm(B, X, T, m, m, n, bf16);                                   // B X
      ops.scale_add(X, static_cast<float>(co.a), T, X, size, bf16);       // X = P(P(a X) + B X)
    }
  }
  if (tall)
    ops.transpose(result, O, m, n);
  else
    ops.scale_add(result, 1.0f, nullptr, O, size, false);
}

// One NorMuon step of one matrix (section 3.1), in place on p, M and v (length rows or cols); U and O are
// rows x cols buffers of the caller's (the stored shape; transposed: the module's is cols x rows).
// clock.lap(&PhaseTimes::phase) closes each phase.
template <class Ops, class Clock>
void normuon_update(Ops& ops, float* p, const float* g, float* M, float* v, int64_t rows, int64_t cols,
                    const NorMuonHyper& h, bool per_row, bool transposed, float* U, float* O, Clock& clock) {
  const int64_t size = rows * cols;
  ops.momentum(M, g, U, size, static_cast<float>(1 - h.beta1), static_cast<float>(h.beta1), h.nesterov);
  clock.lap(&PhaseTimes::momentum);
  newton_schulz(ops, U, O, rows, cols, h);
  clock.lap(&PhaseTimes::newton_schulz);
  const float nu = fp32_norm(ops.sum_squares(O, rows, cols));
  ops.second_moment(O, v, rows, cols, per_row, static_cast<float>(1 - h.beta2));
  float* s = U;  // U is no longer needed: the inverse scales go there
  ops.inverse_scales(v, s, per_row ? rows : cols, static_cast<float>(h.denom_eps),
                     h.eps_placement == EpsPlacement::add);
  const float nu_normalised = fp32_norm(ops.normalised_sum_squares(O, s, rows, cols, per_row));
  const float rho = nu / (nu_normalised + static_cast<float>(h.renorm_eps));
  // kappa on the module's [out, in]: a transposed matrix's is its stored shape swapped.
  const float kappa = static_cast<float>(transposed ? lr_scale_factor(h.lr_scale, cols, rows)
                                                    : lr_scale_factor(h.lr_scale, rows, cols));
  clock.lap(&PhaseTimes::normalisation);
  int wd_mode = 0;
  if (h.weight_decay != 0 && h.weight_decay_mode == WeightDecayMode::decoupled) wd_mode = 1;
  if (h.weight_decay != 0 && h.weight_decay_mode == WeightDecayMode::cautious) wd_mode = 2;
  ops.apply(O, s, p, rows, cols, per_row, rho, kappa, wd_mode, static_cast<float>(1 - h.lr * h.weight_decay),
            static_cast<float>(h.lr * h.weight_decay), static_cast<float>(-h.lr));
  clock.lap(&PhaseTimes::update);
}

// A clock for steps whose phases are not timed.
struct NoClock {
  void lap(double PhaseTimes::*) {}
};

// normuon_update with U and O in the ops' scratch slots 6 and 7 (Newton-Schulz takes 0..5).
template <class Ops, class Clock = NoClock>
void normuon_update(Ops& ops, float* p, const float* g, float* M, float* v, int64_t rows, int64_t cols,
                    const NorMuonHyper& h, bool per_row, bool transposed, Clock&& clock = Clock{}) {
  normuon_update(ops, p, g, M, v, rows, cols, h, per_row, transposed, ops.scratch(6, rows * cols),
                 ops.scratch(7, rows * cols), clock);
}

// The fp32 scalars of one AdamW step at the parameter's own step count t (section 4).
inline AdamWScalars adamw_scalars(const AdamWHyper& h, int64_t t) {
  const double bc1 = 1 - std::pow(h.beta1, static_cast<double>(t));
  const double bc2 = 1 - std::pow(h.beta2, static_cast<double>(t));
  AdamWScalars s;
  s.decay = h.weight_decay != 0;
  s.decay_factor = static_cast<float>(1 - h.lr * h.weight_decay);
  s.w1 = static_cast<float>(1 - h.beta1);
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta2 = static_cast<float>(1 - h.beta2);
  s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  s.eps = static_cast<float>(h.eps);
  s.neg_step_size = static_cast<float>(-(h.lr / bc1));
  return s;
}

}  // namespace normuon::spec
