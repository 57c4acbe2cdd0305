// The elementwise steps of Newton-Schulz on the CPU (docs/spec.md section 3.2), on one matrix's working
// copy in its precision P: fp32 (float) or bf16 (Bf16, the upper 16 bits of an fp32, rounded to nearest
// even). Between the GEMMs they are a fifth of the iteration's time when left to the baseline ISA; each is
// one vectorised pass (multiversion.h), with every element rounded as the scalar formula says: the results
// are the same bits on every ISA.
#pragma once

#include <cstdint>

#include "normuon/low_precision.h"

namespace normuon::fast {

using Bf16 = uint16_t;

// One element of the working copy: widening is exact, rounding into it is P (bf16: low_precision.h's,
// torch's rounding, every NaN 0x7fc0).
inline float ns_widen(float x) { return x; }
inline float ns_widen(Bf16 b) { return bf16_to_float(b); }
inline void ns_round_into(float& d, float x) { d = x; }
inline void ns_round_into(Bf16& d, float x) { d = float_to_bf16(x); }
template <typename T>
inline float ns_round(float x) {  // P(x) in T's precision
  T t;
  ns_round_into(t, x);
  return ns_widen(t);
}

// X = P(U), or P(U)^T when `transpose` (U rows x cols as stored, X then cols x rows); U and X apart.
void ns_load(const float* u, float* x, int64_t rows, int64_t cols, bool transpose);
void ns_load(const float* u, Bf16* x, int64_t rows, int64_t cols, bool transpose);
// O = X, or X^T when `transpose` (X rows x cols, O then cols x rows). Neither overlaps the other.
void ns_store(const float* x, float* o, int64_t rows, int64_t cols, bool transpose);
void ns_store(const Bf16* x, float* o, int64_t rows, int64_t cols, bool transpose);

// sum of x[i]^2 in double, in a fixed order (eight interleaved partial sums, then added in turn).
double ns_sum_squares(const float* x, int64_t n);
double ns_sum_squares(const Bf16* x, int64_t n);

// x = P(x / d)
void ns_divide(float* x, float d, int64_t n);
void ns_divide(Bf16* x, float d, int64_t n);
// d = P(c a); d is not a.
void ns_scale(float* d, const float* a, float c, int64_t n);
void ns_scale(Bf16* d, const Bf16* a, float c, int64_t n);
// d = P(P(s a) + g); d is neither a nor g.
void ns_scaled_add(float* d, const float* a, const float* g, float s, int64_t n);
void ns_scaled_add(Bf16* d, const Bf16* a, const Bf16* g, float s, int64_t n);
// x = P(P(s x) + g); g is not x.
void ns_scaled_add_in_place(float* x, const float* g, float s, int64_t n);
void ns_scaled_add_in_place(Bf16* x, const Bf16* g, float s, int64_t n);

}  // namespace normuon::fast
