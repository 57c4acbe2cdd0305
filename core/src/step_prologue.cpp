#include "normuon/step_prologue.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>

#include "normuon/low_precision.h"
#include "normuon/row_runs.h"

namespace normuon {

std::optional<StepResult> begin_step(StepOperands& ops, const Options& options, bool gradients_checked) {
  const Layout& layout = *ops.layout;
  if (options.groups.size() != layout.group_names.size())
    throw std::invalid_argument("the options define " + std::to_string(options.groups.size()) +
                                " groups but the layout was built with " + std::to_string(layout.group_names.size()));
  float chunk[256];
  for (size_t e = 0; e < layout.entries.size() && !ops.grad_scale && !gradients_checked; ++e) {
    const ParamOperand& op = ops.params[e];
    if (!op.grad) continue;
    const int64_t numel = layout.entries[e].numel;
    for (int64_t begin = 0; begin < numel; begin += 256) {
      const int64_t n = std::min<int64_t>(256, numel - begin);
      widen_rows(op.grad, op.grad_dtype, op.grad_runs, begin, chunk, n);
      for (int64_t k = 0; k < n; ++k)
        if (!std::isfinite(chunk[k])) {
          const LayoutEntry& le = layout.entries[e];
          const int64_t element = ops.table ? ops.table->caller_element(static_cast<int>(e), begin + k) : begin + k;
          return nonfinite_gradient(le.name, chunk[k], element, ops.group_steps[le.group] + 1, options.nonfinite);
        }
    }
  }
  advance_steps(layout, [&](size_t e) { return ops.params[e].grad != nullptr; }, ops.group_steps, ops.entry_steps);
  return std::nullopt;
}

std::optional<StepResult> begin_step(FlatState& state, const Options& options) {
  StepOperands ops;
  ops.bind(state);
  return begin_step(ops, options);
}

StepResult nonfinite_gradient(const std::string& param, float value, int64_t element, int64_t step,
                              NonFinitePolicy policy) {
  std::ostringstream msg;
  msg << "step " << step << ": gradient of '" << param << "' holds " << value << " at element " << element;
  if (policy == NonFinitePolicy::error)
    throw std::runtime_error(msg.str() + " (nothing was changed; set nonfinite=skip_step to skip such steps)");
  return StepResult{true, msg.str() + "; step skipped"};
}

}  // namespace normuon
