#include "normuon/engine.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>

#include "normuon/low_precision.h"
#include "normuon/row_runs.h"

namespace normuon {

Engine::Engine(const Manifest& manifest, const Options& options, const BackendFactory& make_backend)
    : options_(options),
      layout_(std::make_unique<Layout>(Layout::build(manifest, options))),
      table_(*layout_),
      state_(*layout_),
      backend_(make_backend(*layout_, options_)) {
  if (!backend_) throw std::logic_error("Engine: the backend factory returned no backend");
}

void Engine::set_backend(const BackendFactory& make_backend) {
  std::unique_ptr<TableBackend> next = make_backend(*layout_, options_);
  if (!next) throw std::logic_error("Engine: the backend factory returned no backend");
  backend_ = std::move(next);
}

std::vector<std::string> Engine::fixed_fields() const {
  std::vector<std::string> out{"reduce_axis"};
  for (auto& f : backend_->fixed_fields())
    if (std::find(out.begin(), out.end(), f) == out.end()) out.push_back(f);
  return out;
}

void Engine::set_group(size_t group, const std::vector<std::pair<std::string, FieldValue>>& values) {
  Options next = options_;
  next.set_group(group, values);  // checks every value; throws naming GROUP.FIELD
  const GroupOptions& g = next.groups[group];
  if (g.algorithm == Algorithm::normuon)
    for (const std::string& field : fixed_fields()) {
      const FieldValue was = options_.get(group, field), now = next.get(group, field);
      if (was != now) {
        const auto text = [](const FieldValue& v) {
          if (const auto* s = std::get_if<std::string>(&v)) return "'" + *s + "'";
          if (const auto* b = std::get_if<bool>(&v)) return std::string(*b ? "true" : "false");
          std::ostringstream out;
          out << std::get<double>(v);
          return out.str();
        };
        throw std::invalid_argument("option '" + g.name + "." + field + "': it was " + text(was) +
                                    " when the optimizer was built and decides its " +
                                    (field == "reduce_axis" ? std::string("layout") : backend_name() + " plan") +
                                    "; it cannot become " + text(now));
      }
    }
  options_ = std::move(next);
}

void Engine::refresh_master(int e) {
  const LayoutEntry& le = layout_->entries[e];
  if (le.master_offset < 0) return;  // fp32: the tensor is the master
  const TensorRef& p = table_.params[e];
  std::vector<float> now(static_cast<size_t>(le.numel));
  widen_rows(p.data, le.dtype, p.runs, 0, now.data(), le.numel);
  float* master = state_.master(e);
  bool rounded_master = true;
  for (int64_t i = 0; i < le.numel && rounded_master; ++i) {
    uint16_t low = 0;
    narrow(&master[i], &low, le.dtype, 1);
    rounded_master = widen_one(&low, le.dtype, 0) == now[static_cast<size_t>(i)];
  }
  if (!rounded_master) std::copy(now.begin(), now.end(), master);
}

StepResult Engine::step(const float* grad_scale, const float* found_inf) {
  if (found_inf && *found_inf != 0) return StepResult{true, kFoundInfReason};
  const std::string reason = table_.invalid_reason();
  if (!reason.empty()) throw std::invalid_argument(reason);
  return backend_->step(state_, table_, options_, grad_scale);
}

void Engine::set_steps(const std::vector<int64_t>& group_steps, const std::vector<int64_t>& entry_steps) {
  if (group_steps.size() != layout_->group_names.size())
    throw std::invalid_argument(std::to_string(group_steps.size()) + " group steps for " +
                                std::to_string(layout_->group_names.size()) + " groups");
  for (int64_t t : group_steps)
    if (t < 0) throw std::invalid_argument("a group step is negative: " + std::to_string(t));
  std::vector<int64_t> entries = entry_steps.empty() ? entry_steps_from_groups(*layout_, group_steps) : entry_steps;
  const std::string reason = entry_steps_invalid_reason(*layout_, group_steps, entries);
  if (!reason.empty()) throw std::invalid_argument("entry_steps: " + reason);
  state_.group_steps = group_steps;
  state_.entry_steps = std::move(entries);
}

MemoryReport Engine::memory_report() const {
  const Layout& l = *layout_;
  MemoryReport r;
  r.state_bytes = 4 * (l.normuon_floats + l.stat_floats + 2 * l.adam_floats);
  r.master_bytes = 4 * l.master_floats;
  r.workspace_bytes = backend_->workspace_bytes();
  return r;
}

}  // namespace normuon
