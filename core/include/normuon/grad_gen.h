// Deterministic synthetic gradients and initial parameters. Every value is a pure function of
// (seed, step, parameter index, element index): counter-based, so the result does not depend on the
// thread count, the backend or the order of evaluation, and any backend can be fed the same numbers.
#pragma once

#include <cstdint>

#include "normuon/flat_state.h"

namespace normuon {

struct GradientGenerator {
  uint64_t seed = 1234;
  // When > 0, parameter e has no gradient at step s whenever (s + e) % missing_grad_period == 0, to
  // exercise the "no gradient this step" path. 0: every parameter has a gradient every step.
  int missing_grad_period = 0;

  // Writes grads and has_grad for `step` (1-based). Gradients have per-row gains of 1/4..4 and one
  // "dead" row in 32 with gain 2^-20, so that NorMuon's row normalisation and its epsilons matter.
  void fill_gradients(FlatState& state, int64_t step) const;
  // Initial parameters: N(0, 0.02)-like for matrices and embeddings, 1 for norm weights, 0 for biases.
  void fill_params(FlatState& state) const;

  float gradient(int entry, int64_t step, int64_t element, int64_t cols) const;
};

// A standard-normal-like value (sum of four uniform 16-bit draws, scaled) from a 64-bit counter hash.
float counter_normal(uint64_t a, uint64_t b, uint64_t c, uint64_t d);
uint64_t mix64(uint64_t x);

}  // namespace normuon
