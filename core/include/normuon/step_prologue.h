// What every backend does first in a step, so that all of them say and do the same: refuse or skip a
// step with a NaN/Inf gradient before anything changes, then advance the step counter of every group
// that has at least one gradient and the count of every parameter that has one (docs/spec.md section 5).
// The operand form allocates nothing; the FlatState form binds the state's operands first (the
// reference's prologue).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "normuon/backend.h"
#include "normuon/param_table.h"

namespace normuon {

// Throws std::runtime_error (nonfinite=error) or returns a skipped StepResult (nonfinite=skip_step)
// naming the parameter, element and step; otherwise advances the group steps and the entry steps of the
// parameters with a gradient, and returns nullopt.
std::optional<StepResult> begin_step(FlatState& state, const Options& options);
// The same over operands (either mode): each gradient is scanned in its own dtype. gradients_checked:
// the caller has found no NaN/Inf in any gradient with a faster scan of its own (the fast CPU backend's
// parallel one), so this one is skipped; where the caller found one, this scan names the first.
std::optional<StepResult> begin_step(StepOperands& operands, const Options& options, bool gradients_checked = false);

// The counters after a step that ran (spec section 5): every group with at least one gradient advances,
// and every parameter with one, except a 0-element one, whose step does nothing (in table mode an empty
// tensor has no address to tell a gradient by). has_grad(e) says whether layout entry e had one.
template <typename HasGrad>
void advance_steps(const Layout& layout, const HasGrad& has_grad, int64_t* group_steps, int64_t* entry_steps) {
  for (size_t g = 0; g < layout.group_names.size(); ++g)
    for (size_t e = 0; e < layout.entries.size(); ++e)
      if (layout.entries[e].group == static_cast<int>(g) && has_grad(e)) {
        ++group_steps[g];
        break;
      }
  for (size_t e = 0; e < layout.entries.size(); ++e)
    if (has_grad(e) && layout.entries[e].numel > 0) ++entry_steps[e];
}

// A step that found a NaN/Inf gradient, in the words every backend uses: parameter, value, element and
// the step number the step would have had. Throws std::runtime_error under nonfinite=error; returns the
// skipped StepResult under nonfinite=skip_step.
StepResult nonfinite_gradient(const std::string& param, float value, int64_t element, int64_t step,
                              NonFinitePolicy policy);

}  // namespace normuon
