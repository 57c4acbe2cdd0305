// The spec's per-element rules (docs/spec.md sections 1, 3 and 4), written once for the reference on the
// CPU and on CUDA: every rounding is explicit, every multiply-add that the spec fuses is an fma, and
// nothing else is fused. Compiled with -ffp-contract=off (host) and -fmad=false (nvcc), these functions
// give the same bits on every processor and device.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define NORMUON_SPEC_FN __host__ __device__ inline
#else
#define NORMUON_SPEC_FN inline
#endif

namespace normuon::spec {

NORMUON_SPEC_FN float fma(float x, float y, float z) { return fmaf(x, y, z); }  // one rounding
NORMUON_SPEC_FN float sqrt(float x) { return sqrtf(x); }  // IEEE, correctly rounded (CUDA: -prec-sqrt)

// fp32 -> bf16 -> fp32, to nearest even; every NaN becomes the quiet 0x7fc0 (as torch's conversion).
NORMUON_SPEC_FN float round_bf16(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    u = 0x7fc00000u;
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
  }
  float r;
  memcpy(&r, &u, sizeof r);
  return r;
}

// P: the Newton-Schulz working precision (section 3.2).
NORMUON_SPEC_FN float P(float x, bool bf16) { return bf16 ? round_bf16(x) : x; }

// torch's lerp (section 1): the weight decides which end anchors the fma.
NORMUON_SPEC_FN float lerp(float a, float b, float w) {
  const float d = b - a;
  return fabsf(w) < 0.5f ? fma(w, d, a) : fma(w - 1.0f, d, b);
}

// One step of the AdamW recursion of section 4 on one element; the scalars are rounded to fp32 once, on
// the host (AdamWScalars::of).
struct AdamWScalars {
  bool decay;
  float decay_factor;     // fp32(1 - lr wd)
  float w1;               // fp32(1 - beta1)
  float beta2;            // fp32(beta2)
  float one_minus_beta2;  // fp32(1 - beta2)
  float bc2_sqrt;         // fp32(sqrt(1 - beta2^t))
  float eps;              // fp32(eps)
  float neg_step_size;    // fp32(-lr / (1 - beta1^t))
};
NORMUON_SPEC_FN void adamw_element(float& p, float g, float& m, float& v, const AdamWScalars& s) {
  if (s.decay) p = p * s.decay_factor;             // p.mul_(1 - lr wd)
  m = lerp(m, g, s.w1);                            // m.lerp_(g, 1 - beta1)
  v = fma(s.one_minus_beta2 * g, g, v * s.beta2);  // v.mul_(beta2).addcmul_(g, g, 1 - beta2)
  const float denom = sqrt(v) / s.bc2_sqrt + s.eps;
  p = p + (s.neg_step_size * m) / denom;           // p.addcdiv_(m, denom, -step_size)
}

// NorMuon steps 1-2 on one element: the momentum, and U (the Newton-Schulz input).
NORMUON_SPEC_FN float momentum_element(float& M, float g, float w1, float beta1, bool nesterov) {
  M = lerp(M, g, w1);
  return nesterov ? lerp(g, M, beta1) : M;
}

// NorMuon step 6: the inverse square root of one entry of v.
NORMUON_SPEC_FN float inverse_scale(float v, float denom_eps, bool eps_add) {
  return eps_add ? 1.0f / (sqrt(v) + denom_eps) : 1.0f / sqrt(v > denom_eps ? v : denom_eps);
}

// NorMuon steps 7-11 on one element of p, given O, its statistic's inverse scale s, the renormalisation
// ratio rho and the shape factor kappa. wd_mode: 0 none, 1 decoupled, 2 cautious (lr_wd = fp32(lr wd),
// decay_factor = fp32(1 - lr wd)).
NORMUON_SPEC_FN float normalised_element(float o, float s, float rho, float kappa) { return ((o * s) * rho) * kappa; }
NORMUON_SPEC_FN float normuon_param(float p, float u, int wd_mode, float decay_factor, float lr_wd, float neg_lr) {
  if (wd_mode == 1) p = p * decay_factor;
  if (wd_mode == 2) p = p - (p * (u * p >= 0.0f ? 1.0f : 0.0f)) * lr_wd;
  return fma(neg_lr, u, p);  // p.add_(update, -lr)
}

}  // namespace normuon::spec
