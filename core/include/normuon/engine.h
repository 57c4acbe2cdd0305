// One optimizer, native: the layout, the options, the state, the backend and every counter, behind one
// API whatever the device (docs/python.md). Bindings and the Python optimizer ask it; they keep no copy of
// its rules or counters. The caller binds its own tensors into table() (table mode, param_table.h) and
// calls step().
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "normuon/backend.h"
#include "normuon/layout.h"
#include "normuon/manifest.h"
#include "normuon/options.h"
#include "normuon/param_table.h"

namespace normuon {

// What an engine drives: a backend that steps the caller's tensors in place.
class TableBackend {
 public:
  virtual ~TableBackend() = default;
  virtual std::string name() const = 0;
  virtual StepResult step(TableState& state, const ParamTable& table, const Options& options,
                          const float* grad_scale) = 0;
  virtual int64_t workspace_bytes() const = 0;
  // Fields whose value the backend planned from at construction (besides reduce_axis, which shaped the
  // layout): they may not change afterwards.
  virtual std::vector<std::string> fixed_fields() const { return {}; }
};

// Every byte the optimizer holds beyond the caller's tensors, by kind.
struct MemoryReport {
  int64_t state_bytes = 0;      // the spec's state: momentum, second moments, exp_avg, exp_avg_sq
  int64_t master_bytes = 0;     // fp32 masters of bf16 / fp16 parameters
  int64_t workspace_bytes = 0;  // the backend's Newton-Schulz buffers and scratch
};

constexpr const char* kFoundInfReason = "the gradient scaler found inf/NaN gradients; step skipped";

class Engine {
 public:
  using BackendFactory = std::function<std::unique_ptr<TableBackend>(const Layout&, const Options&)>;
  // Validates the manifest and builds the layout from it and the options' groups; `make_backend` builds
  // the backend over them (throwing std::invalid_argument when it cannot serve them).
  Engine(const Manifest& manifest, const Options& options, const BackendFactory& make_backend);

  const Layout& layout() const { return *layout_; }
  const Options& options() const { return options_; }
  std::string backend_name() const { return backend_->name(); }
  // Another backend over the same layout, options and state (another thread count): nothing of the state
  // changes.
  void set_backend(const BackendFactory& make_backend);

  // New values for one group (Options::set_group: all or nothing). A field the layout or the backend's
  // plan was built from (fixed_fields) may be given only with its current value.
  void set_group(size_t group, const std::vector<std::pair<std::string, FieldValue>>& values);
  void set_nonfinite(NonFinitePolicy policy) { options_.nonfinite = policy; }
  std::vector<std::string> fixed_fields() const;  // reduce_axis and the backend's

  // The caller's tensors: bind addresses here before step(). Parameters whose values were written from
  // outside since the last step get their masters again through refresh_master().
  ParamTable& table() { return table_; }
  // Entry e's parameter was written from outside: a bf16 / fp16 one's master is read from it again, unless
  // the parameter still holds the master rounded (a model reloaded after the optimizer: the master keeps
  // its low bits). Nothing for fp32 parameters, which are their own masters.
  void refresh_master(int e);

  // One step over the bound table. grad_scale: a gradient scaler's scale (host memory), or nullptr;
  // found_inf: its verdict, or nullptr: nonzero skips the step (kFoundInfReason), changing nothing.
  // Counters advance as the spec says (section 6) unless the step is skipped.
  StepResult step(const float* grad_scale = nullptr, const float* found_inf = nullptr);

  const std::vector<int64_t>& group_steps() const { return state_.group_steps; }
  const std::vector<int64_t>& entry_steps() const { return state_.entry_steps; }
  // Both at once, checked before anything is written; entry_steps empty: each at its group's counter.
  void set_steps(const std::vector<int64_t>& group_steps, const std::vector<int64_t>& entry_steps = {});

  TableState& state() { return state_; }
  MemoryReport memory_report() const;

 private:
  Options options_;
  std::unique_ptr<Layout> layout_;  // stable address: the table, state and backend point at it
  ParamTable table_;
  TableState state_;
  std::unique_ptr<TableBackend> backend_;
};

}  // namespace normuon
