// One optimizer, native: the layout, the options, the state, the backend and every counter, behind one
// API whatever the device (docs/python.md). Bindings and the Python optimizer ask it; they keep no copy of
// its rules or counters. The caller binds its own tensors into table() (table mode, param_table.h) and
// calls step().
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
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
  // A host backend steps at once: the state's buffers and counters are its own, and it returns the
  // verdict (or throws under nonfinite=error, before anything changes).
  virtual StepResult step(TableState& state, const ParamTable& table, const Options& options,
                          const float* grad_scale) = 0;
  virtual int64_t workspace_bytes() const = 0;
  // Fields whose value the backend planned from at construction (besides reduce_axis, which shaped the
  // layout): they may not change afterwards.
  virtual std::vector<std::string> fixed_fields() const { return {}; }
};

// One of the optimizer's fp32 buffers, in host or device memory.
struct BufferView {
  std::string name;  // masters, momentum, row_var, exp_avg, exp_avg_sq
  float* data = nullptr;
  int64_t size = 0;  // elements
  bool device = false;
};

// The buffers of a state that has them by the names of TableState (a TableState, the CUDA backend's
// device state), as views.
template <typename State>
std::vector<BufferView> state_buffers(State& s, bool device) {
  auto view = [device](const char* name, auto& b) { return BufferView{name, b.data(), b.size(), device}; };
  return {view("masters", s.masters), view("momentum", s.momentum), view("row_var", s.row_var),
          view("exp_avg", s.exp_avg), view("exp_avg_sq", s.exp_avg_sq)};
}

// A backend on a device (CUDA): it owns the state, the masters and its own copy of the counters in device
// memory, and a step is enqueued; its verdict is read later (DeviceTableBackend::verdict). The engine keeps
// the counters on the host as well (the AdamW bias corrections are computed there, host-exact) and
// rolls them back when a step turns out to have been skipped. Its step() is never called.
class DeviceTableBackend : public TableBackend {
 public:
  StepResult step(TableState&, const ParamTable&, const Options&, const float*) override {
    throw std::logic_error(name() + ": a device backend enqueues steps (Engine::step)");
  }
  // One step over `table`, after the counters in `state` (the host's; its buffers are empty). grad_scale,
  // found_inf: a gradient scaler's, in device memory, or nullptr. Throws std::invalid_argument on a bad
  // table before anything is enqueued.
  virtual void enqueue(const TableState& state, const ParamTable& table, const Options& options,
                       const float* grad_scale, const float* found_inf) = 0;
  // The verdict of the last step enqueued (waiting for that step only): {} when it ran; skipped with
  // kFoundInfReason when the scaler's found_inf was set; a NaN/Inf gradient as nonfinite_gradient says
  // (skipped, or std::runtime_error). A skipped step changed nothing on the device, its counters included.
  virtual StepResult verdict(const Options& options) = 0;
  // The host's counters were set: the device's copy follows, behind the work already enqueued.
  virtual void set_steps(const TableState& state) = 0;
  // Entry e's parameter was written from outside: its device master follows (refresh_master's rule).
  virtual void refresh_master(int e, const ParamTable& table) = 0;
  virtual std::vector<BufferView> buffers() = 0;
  // Later work goes to this stream (a cudaStream_t; the caller's current one).
  virtual void set_stream(void* stream) = 0;
};

// When a device step's verdict reaches the host: in step() (one wait for that step) or at the next step()
// or settle() (no wait: the step changed nothing on the device either way).
enum class Verdict { sync, deferred };

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
  std::vector<std::string> fixed_fields() const;  // layout_fields() and the backend's
  static std::vector<std::string> layout_fields() { return {"reduce_axis"}; }  // they shape the layout

  // The caller's tensors: bind addresses here before step(). Parameters whose values were written from
  // outside since the last step get their masters again through refresh_master().
  ParamTable& table() { return table_; }
  // Entry e's parameter was written from outside: a bf16 / fp16 one's master is read from it again, unless
  // the parameter still holds the master rounded, bit for bit (a model reloaded after the optimizer: the master keeps
  // its low bits). Nothing for fp32 parameters, which are their own masters.
  void refresh_master(int e);

  // One step over the bound table. grad_scale: a gradient scaler's scale, or nullptr; found_inf: its
  // verdict, or nullptr: nonzero skips the step (kFoundInfReason), changing nothing. Both in the
  // backend's memory (the device's for a device backend). Counters advance as the spec says (section 5)
  // unless the step is skipped. On a device backend the step is enqueued: the verdict returned is this
  // step's (Verdict::sync) or the previous one's (deferred), and the counters are rolled back when a step
  // turns out skipped.
  StepResult step(const float* grad_scale = nullptr, const float* found_inf = nullptr);
  // The pending device step's verdict now ({} when none is pending): rolls its counters back if it was
  // skipped; throws as step() would under nonfinite=error. Done first by everything that reads or sets
  // the counters or the state for the caller (set_steps).
  StepResult settle();
  bool pending() const { return pending_; }
  void set_verdict(Verdict verdict) { verdict_ = verdict; }
  Verdict verdict() const { return verdict_; }
  bool on_device() const { return device_ != nullptr; }
  // A device backend's stream for later work (nothing for a host backend).
  void set_stream(void* stream);

  const std::vector<int64_t>& group_steps() const { return state_.group_steps; }
  const std::vector<int64_t>& entry_steps() const { return state_.entry_steps; }
  // Both at once, checked before anything is written (after settle()); entry_steps empty: each at its
  // group's counter.
  void set_steps(const std::vector<int64_t>& group_steps, const std::vector<int64_t>& entry_steps = {});

  // The host state: the buffers of a host backend, the counters of either (a device backend's buffers
  // are its own: buffers()).
  TableState& state() { return state_; }
  // Every buffer of the optimizer's own, wherever it lives (the counters: group_steps(), entry_steps()).
  std::vector<BufferView> buffers() { return device_ ? device_->buffers() : state_buffers(state_, false); }
  MemoryReport memory_report() const;

 private:
  Options options_;
  std::unique_ptr<Layout> layout_;  // stable address: the table, state and backend point at it
  ParamTable table_;
  std::unique_ptr<TableBackend> backend_;
  DeviceTableBackend* device_ = nullptr;  // backend_, when it is a device backend
  TableState state_;                      // after backend_: a device backend's has no buffers
  Verdict verdict_ = Verdict::sync;
  bool pending_ = false;  // a device step enqueued whose verdict is not read yet
  std::vector<int64_t> group_steps_before_, entry_steps_before_;  // its counters before it

  static std::unique_ptr<TableBackend> checked(std::unique_ptr<TableBackend> backend);
};

}  // namespace normuon
