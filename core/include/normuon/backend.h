// What every optimizer backend offers: one step over a FlatState, in place.
#pragma once

#include <string>

#include "normuon/flat_state.h"
#include "normuon/options.h"

namespace normuon {

struct StepResult {
  bool skipped = false;  // NonFinitePolicy::skip_step found a NaN/Inf gradient: nothing changed
  std::string reason;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;  // written into state files, e.g. "reference-cpu"
  // Reads state.grads and state.has_grad; updates params, state tensors and group_steps. Options may
  // change between steps (schedulers). Throws std::runtime_error for NaN/Inf under NonFinitePolicy::error
  // before changing anything.
  virtual StepResult step(FlatState& state, const Options& options) = 0;
};

}  // namespace normuon
