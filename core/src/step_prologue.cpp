#include "normuon/step_prologue.h"

#include <sstream>
#include <stdexcept>

namespace normuon {

std::optional<StepResult> begin_step(FlatState& state, const Options& options) {
  const Layout& layout = *state.layout;
  if (options.groups.size() != layout.group_names.size())
    throw std::invalid_argument("the options define " + std::to_string(options.groups.size()) +
                                " groups but the layout was built with " + std::to_string(layout.group_names.size()));
  int64_t element = -1;
  const int bad = find_nonfinite_gradient(state, &element);
  if (bad >= 0) {
    const LayoutEntry& e = layout.entries[bad];
    return nonfinite_gradient(e.name, state.grad(bad)[element], element, state.group_steps[e.group] + 1,
                              options.nonfinite);
  }
  for (size_t g = 0; g < layout.group_names.size(); ++g)
    for (size_t i = 0; i < layout.entries.size(); ++i)
      if (state.has_grad[i] && layout.entries[i].group == static_cast<int>(g)) {
        ++state.group_steps[g];
        break;
      }
  return std::nullopt;
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
