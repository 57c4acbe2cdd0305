// The fused elementwise passes of the fast CPU backend. Each mirrors, operation by operation, the
// rounding of the reference's ATen ops (docs/spec.md section 1), so that where the inputs agree the
// results agree bit for bit. Compiled with -ffp-contract=off: every fma here is written out.
#pragma once

#include <cstdint>
#include <cstring>

#include "normuon/row_runs.h"

namespace normuon::fast {

// fp32 -> bf16 (round to nearest even, NaN stays NaN) -> fp32, as c10::BFloat16 does.
inline float round_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return x;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  u &= 0xffff0000u;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// M = lerp(M, g, w1); U = nesterov ? lerp(g, M, beta1) : M.  (w1 = 1 - beta1, both as fp32)
void momentum_nesterov(float* M, const float* g, float* U, int64_t n, float w1, float beta1, bool nesterov);

// torch.optim.AdamW's single-tensor step for n elements, every scalar already rounded to fp32.
struct AdamWScalars {
  bool decay;           // weight_decay != 0
  float decay_factor;   // 1 - lr*wd
  float w1;             // 1 - beta1 (lerp weight)
  float beta2;
  float one_minus_beta2;
  float bc2_sqrt;       // sqrt(1 - beta2^t)
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^t)
};
void adamw(float* p, const float* g, float* m, float* v, int64_t n, const AdamWScalars& s);

// x = P(x / d); `bf16` rounds every result to bf16, else fp32.
void divide_round(float* x, int64_t n, float d, bool bf16);

// No NaN or Inf among x[0, n): the whole range is read (no early exit), so the loop vectorises.
bool all_finite(const float* x, int64_t n);

// NorMuon after Newton-Schulz, for one rows x cols matrix (O as stored): statistics, second moment,
// normalisation, re-norm, shape factor, weight decay and the step. Sequential reductions in double:
// the result does not depend on threads. `col_sums` is scratch of `cols` doubles (per-column stats).
struct NorMuonScalars {
  bool stats_per_row;
  float w2;          // 1 - beta2
  bool eps_add;      // EpsPlacement::add (else clamp)
  float denom_eps, renorm_eps;
  float kappa;       // shape factor
  int wd_mode;       // 0 decoupled, 1 cautious, 2 none
  bool decay;        // weight_decay != 0
  float decay_factor;  // 1 - lr*wd   (decoupled)
  float lr_wd;         // lr*wd       (cautious)
  float neg_lr;
};
struct NorMuonPassTimes {
  double normalisation_ms = 0, update_ms = 0;
};
// p: the parameter's fp32 values, its rows where p_runs says (whole rows: a row is contiguous).
void normuon_finalize(const float* O, float* p, const RowRuns& p_runs, float* v, int64_t rows, int64_t cols,
                      const NorMuonScalars& s, double* col_sums, float* inv_scale, NorMuonPassTimes* times);

}  // namespace normuon::fast
