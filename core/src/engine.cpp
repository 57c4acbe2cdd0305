#include "normuon/engine.h"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "normuon/low_precision.h"
#include "normuon/row_runs.h"
#include "normuon/step_prologue.h"

namespace normuon {

std::unique_ptr<TableBackend> Engine::checked(std::unique_ptr<TableBackend> backend) {
  if (!backend) throw std::logic_error("Engine: the backend factory returned no backend");
  return backend;
}

Engine::Engine(const Manifest& manifest, const Options& options, const BackendFactory& make_backend)
    : options_(options),
      layout_(std::make_unique<Layout>(Layout::build(manifest, options))),
      table_(*layout_),
      backend_(checked(make_backend(*layout_, options_))),
      device_(dynamic_cast<DeviceTableBackend*>(backend_.get())),
      state_(*layout_, device_ == nullptr) {}

void Engine::set_backend(const BackendFactory& make_backend) {
  std::unique_ptr<TableBackend> next = checked(make_backend(*layout_, options_));
  if (device_ || dynamic_cast<DeviceTableBackend*>(next.get()))  // the state would stay behind
    throw std::logic_error("Engine::set_backend: only between host backends");
  backend_ = std::move(next);
}

void Engine::set_stream(void* stream) {
  if (device_) device_->set_stream(stream);
}

std::vector<std::string> Engine::fixed_fields() const {
  std::vector<std::string> out = layout_fields();
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
        throw std::invalid_argument("option '" + g.name + "." + field + "' was " + text(was) +
                                    " when the optimizer was built and decides its " +
                                    (field == layout_fields()[0] ? std::string("layout") : backend_name() + " plan") +
                                    "; it cannot become " + text(now));
      }
    }
  options_ = std::move(next);
}

void Engine::refresh_master(int e) {
  const LayoutEntry& le = layout_->entries[e];
  if (le.master_offset < 0) return;  // fp32: the tensor is the master
  if (device_) return device_->refresh_master(e, table_);
  // Chunk by chunk, in the parameter's dtype: does it still hold the master rounded?
  const TensorRef& p = table_.params[e];
  float* master = state_.master(e);
  constexpr int64_t kChunk = 256;
  float now[kChunk];
  uint16_t low[kChunk];
  bool rounded_master = true;
  for (int64_t begin = 0; begin < le.numel && rounded_master; begin += kChunk) {
    const int64_t n = std::min(kChunk, le.numel - begin);
    widen_rows(p.data, le.dtype, p.runs, begin, now, n);
    narrow(master + begin, low, le.dtype, n);
    for (int64_t i = 0; i < n && rounded_master; ++i) {  // bit for bit: -0 is not the master +0
      const float held = widen_one(low, le.dtype, i);
      rounded_master = std::memcmp(&held, &now[i], sizeof held) == 0;
    }
  }
  if (!rounded_master) widen_rows(p.data, le.dtype, p.runs, 0, master, le.numel);
}

StepResult Engine::step(const float* grad_scale, const float* found_inf) {
  const std::string reason = table_.invalid_reason();
  if (!reason.empty()) throw std::invalid_argument(reason);
  if (!device_) {
    if (found_inf && *found_inf != 0) return StepResult{true, kFoundInfReason};
    return backend_->step(state_, table_, options_, grad_scale);
  }
  StepResult earlier = settle();  // the step before, if its verdict is still out (throws: nothing enqueued)
  device_->enqueue(state_, table_, options_, grad_scale, found_inf);
  group_steps_before_ = state_.group_steps;  // into storage kept from earlier steps: nothing allocated
  entry_steps_before_ = state_.entry_steps;
  advance_steps(*layout_, [&](size_t e) { return table_.grads[e].data != nullptr; }, state_.group_steps.data(),
                state_.entry_steps.data());
  pending_ = true;
  return verdict_ == Verdict::sync ? settle() : earlier;
}

StepResult Engine::settle() {
  if (!pending_) return {};
  pending_ = false;
  auto roll_back = [&] {  // the device changed nothing in that step, its counters included
    state_.group_steps = group_steps_before_;
    state_.entry_steps = entry_steps_before_;
  };
  StepResult result;
  try {
    result = device_->verdict(options_);
  } catch (...) {
    roll_back();
    throw;
  }
  if (result.skipped) roll_back();
  return result;
}

void Engine::set_steps(const std::vector<int64_t>& group_steps, const std::vector<int64_t>& entry_steps) {
  std::vector<int64_t> entries = checked_entry_steps(*layout_, group_steps, entry_steps);
  settle();  // a pending verdict would roll the counters back over the ones set here
  state_.group_steps = group_steps;
  state_.entry_steps = std::move(entries);
  if (device_) device_->set_steps(state_);
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
