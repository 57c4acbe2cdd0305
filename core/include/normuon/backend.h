// What every optimizer backend offers: one step over a FlatState, in place, and where its time went.
#pragma once

#include <cstdint>
#include <string>

#include "normuon/flat_state.h"
#include "normuon/options.h"

namespace normuon {

struct StepResult {
  bool skipped = false;  // NonFinitePolicy::skip_step found a NaN/Inf gradient: nothing changed
  std::string reason;
};

// Wall time of the last step by phase (milliseconds), filled when timing is on. The phases are the
// spec's: momentum + Nesterov, Newton-Schulz, normalisation (statistics, second moment, re-norm),
// update (weight decay and the parameter step), AdamW.
struct PhaseTimes {
  double momentum = 0, newton_schulz = 0, normalisation = 0, update = 0, adamw = 0, total = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;  // written into state files, e.g. "reference-cpu"
  // Reads state.grads and state.has_grad; updates params, state tensors and group_steps. Options may
  // change between steps (schedulers), except what the layout was built from (groups, reduce_axis).
  // Throws std::runtime_error for NaN/Inf under NonFinitePolicy::error before changing anything.
  virtual StepResult step(FlatState& state, const Options& options) = 0;

  // Per-phase timers cost a clock read per phase (per parameter in the reference); off by default.
  void set_timing(bool on) { timing_ = on; }
  const PhaseTimes& phase_times() const { return times_; }

 protected:
  bool timing_ = false;
  PhaseTimes times_;
};

}  // namespace normuon
