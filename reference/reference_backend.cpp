#include "reference_backend.h"

#include "cpu_ops.h"
#include "normuon/step_prologue.h"
#include "spec_steps.h"
#ifdef NORMUON_REFERENCE_CUDA
#include "cuda_ops.h"
#endif

#include <chrono>
#include <memory>
#include <optional>
#include <stdexcept>

namespace normuon {
namespace {

// Waits for the work queued on the device's current stream (CUDA ops are asynchronous: a host clock
// read means nothing without it). Through c10's device-guard interface, so no CUDA header is needed.
void synchronize(const at::Device& device) {
  if (device.is_cpu()) return;
  const c10::impl::DeviceGuardImplInterface* impl = c10::impl::getDeviceGuardImpl(device.type());
  impl->synchronizeStream(impl->getStream(device));
}

// Adds the time since the last lap to a phase, when timing (times != nullptr). On a device, each
// reading first waits for the device, so a phase gets the time its kernels took.
class PhaseClock {
 public:
  PhaseClock(PhaseTimes* times, const at::Device& device) : times_(times), device_(device) {
    if (!times_) return;
    synchronize(device_);
    last_ = std::chrono::steady_clock::now();
  }
  void lap(double PhaseTimes::*phase) {
    if (!times_) return;
    synchronize(device_);
    const auto now = std::chrono::steady_clock::now();
    times_->*phase += std::chrono::duration<double, std::milli>(now - last_).count();
    last_ = now;
  }

 private:
  PhaseTimes* times_;
  at::Device device_;
  std::chrono::steady_clock::time_point last_;
};

}  // namespace

// The spec's arithmetic runs on the device's primitives (spec_steps.h): CpuOps here, CudaOps where the
// CUDA reference is built. ATen only holds the tensors.
class ReferencePrimitives {
 public:
  template <class Body>
  void with(const at::Device& device, const Body& body) {
    if (device.is_cpu()) return body(cpu_);
#ifdef NORMUON_REFERENCE_CUDA
    if (device.is_cuda()) {
      if (!cuda_) cuda_ = std::make_unique<spec::CudaOps>();
      return body(*cuda_);
    }
#endif
    throw std::invalid_argument("the reference has no kernels for device " + device.str() + " in this build");
  }

 private:
  spec::CpuOps cpu_;
#ifdef NORMUON_REFERENCE_CUDA
  std::unique_ptr<spec::CudaOps> cuda_;
#endif
};

namespace {

ReferencePrimitives& shared_primitives() {  // for the per-tensor entry points the tests call
  static thread_local ReferencePrimitives primitives;
  return primitives;
}

float* floats(const at::Tensor& t, const char* what) {
  if (t.scalar_type() != at::kFloat || !t.is_contiguous())
    throw std::invalid_argument(std::string("reference: '") + what + "' must be a contiguous fp32 tensor");
  return t.data_ptr<float>();
}

void check_matrix(const at::Tensor& t, const char* what) {
  if (t.dim() != 2) throw std::invalid_argument(std::string("reference: '") + what + "' must be 2-D");
}

void normuon_on(ReferencePrimitives& primitives, at::Tensor& p, const at::Tensor& g, at::Tensor& M, at::Tensor& v,
                const NorMuonHyper& h, bool stats_per_row, bool transposed, PhaseTimes* times) {
  check_matrix(p, "p");
  const int64_t rows = p.size(0), cols = p.size(1);
  for (const at::Tensor* x : std::initializer_list<const at::Tensor*>{&g, &M})
    if (x->sizes() != p.sizes()) throw std::invalid_argument("reference: p, g and M must have one shape");
  if (v.numel() != (stats_per_row ? rows : cols))
    throw std::invalid_argument("reference: v has " + std::to_string(v.numel()) + " entries for a " +
                                std::to_string(rows) + "x" + std::to_string(cols) + " matrix");
  PhaseClock clock(times, p.device());
  primitives.with(p.device(), [&](auto& ops) {
    spec::normuon_update(ops, floats(p, "p"), floats(g, "g"), floats(M, "M"), floats(v, "v"), rows, cols, h,
                         stats_per_row, transposed, clock);
  });
}

void adamw_on(ReferencePrimitives& primitives, at::Tensor& p, const at::Tensor& g, at::Tensor& m, at::Tensor& v,
              const AdamWHyper& h, int64_t t, PhaseTimes* times) {
  for (const at::Tensor* x : std::initializer_list<const at::Tensor*>{&g, &m, &v})
    if (x->numel() != p.numel()) throw std::invalid_argument("reference: p, g, m and v must have one size");
  PhaseClock clock(times, p.device());
  primitives.with(p.device(), [&](auto& ops) {
    ops.adamw(floats(p, "p"), floats(g, "g"), floats(m, "m"), floats(v, "v"), p.numel(), spec::adamw_scalars(h, t));
  });
  clock.lap(&PhaseTimes::adamw);
}

}  // namespace

at::Tensor newton_schulz(const at::Tensor& update, const NorMuonHyper& h) {
  check_matrix(update, "update");
  const at::Tensor U = update.to(at::kFloat).contiguous();
  at::Tensor O = at::empty_like(U);
  shared_primitives().with(U.device(), [&](auto& ops) {
    spec::newton_schulz(ops, U.data_ptr<float>(), O.data_ptr<float>(), U.size(0), U.size(1), h);
  });
  return O;
}

void normuon_update(at::Tensor p, const at::Tensor& g, at::Tensor M, at::Tensor v, const NorMuonHyper& h,
                    bool stats_per_row, PhaseTimes* times, bool transposed) {
  normuon_on(shared_primitives(), p, g, M, v, h, stats_per_row, transposed, times);
}

void adamw_update(at::Tensor p, const at::Tensor& g, at::Tensor m, at::Tensor v, const AdamWHyper& h, int64_t t,
                  PhaseTimes* times) {
  adamw_on(shared_primitives(), p, g, m, v, h, t, times);
}

// ---- devices and flat tensors ------------------------------------------------------------------------

const char* to_string(ReferenceDevice d) { return d == ReferenceDevice::cuda ? "cuda" : "cpu"; }

namespace {

at::DeviceType device_type(ReferenceDevice d) { return d == ReferenceDevice::cuda ? at::kCUDA : at::kCPU; }

// A view of `numel` floats at `offset` of a flat tensor, shaped like the parameter (no copy).
at::Tensor slot(const at::Tensor& flat, int64_t offset, const std::vector<int64_t>& shape, int64_t numel) {
  return flat.narrow(0, offset, numel).view(shape);
}

// The per-parameter loop every entry point shares, after the prologue (steps already advanced). AdamW's
// bias corrections use the parameter's own step count (spec section 5).
void run_parameters(ReferencePrimitives& primitives, const Layout& layout, const FlatTensors& t,
                    const std::vector<uint8_t>& has_grad, const std::vector<int64_t>& entry_steps,
                    const Options& options, PhaseTimes* times) {
  for (size_t i = 0; i < layout.entries.size(); ++i) {
    const LayoutEntry& e = layout.entries[i];
    if (!has_grad[i] || e.numel == 0) continue;  // untouched, state not advanced
    const GroupOptions& group = options.groups[e.group];
    at::Tensor p = slot(t.params, e.offset, e.shape, e.numel);
    at::Tensor g = slot(t.grads, e.offset, e.shape, e.numel);
    if (e.algorithm == Algorithm::normuon) {
      at::Tensor M = slot(t.momentum, e.offset, e.shape, e.numel);
      at::Tensor v = slot(t.row_var, e.stat_offset, {e.stat_len}, e.stat_len);
      normuon_on(primitives, p, g, M, v, group.normuon, e.stats_per_row, e.transposed, times);
    } else {
      at::Tensor m = slot(t.exp_avg, e.adam_offset, e.shape, e.numel);
      at::Tensor v = slot(t.exp_avg_sq, e.adam_offset, e.shape, e.numel);
      adamw_on(primitives, p, g, m, v, group.adamw, entry_steps[i], times);
    }
  }
}

// begin_step (core/src/step_prologue.cpp) for flat tensors on any device: the same checks, messages and
// advance of the group and entry steps. The whole gradient buffer is checked first (one device sync); only when something
// in it is not finite (possibly padding between slots, which doesn't count) is each parameter checked,
// in layout order, to find the first bad element the way find_nonfinite_gradient does.
std::optional<StepResult> begin_flat_step(const Layout& layout, const at::Tensor& grads,
                                          const std::vector<uint8_t>& has_grad, std::vector<int64_t>& group_steps,
                                          std::vector<int64_t>& entry_steps, const Options& options) {
  if (options.groups.size() != layout.group_names.size())
    throw std::invalid_argument("the options define " + std::to_string(options.groups.size()) +
                                " groups but the layout was built with " + std::to_string(layout.group_names.size()));
  if (!at::isfinite(grads).all().item<bool>()) {
    for (size_t i = 0; i < layout.entries.size(); ++i) {
      const LayoutEntry& e = layout.entries[i];
      if (!has_grad[i] || e.numel == 0) continue;
      const at::Tensor g = grads.narrow(0, e.offset, e.numel);
      const at::Tensor bad = at::nonzero(at::logical_not(at::isfinite(g)));
      if (bad.size(0) == 0) continue;
      const int64_t element = bad[0][0].item<int64_t>();
      return nonfinite_gradient(e.name, g[element].item<float>(), element, group_steps[e.group] + 1,
                                options.nonfinite);
    }
  }
  for (size_t g = 0; g < layout.group_names.size(); ++g)
    for (size_t i = 0; i < layout.entries.size(); ++i)
      if (has_grad[i] && layout.entries[i].group == static_cast<int>(g)) {
        ++group_steps[g];
        break;
      }
  for (size_t i = 0; i < layout.entries.size(); ++i)
    if (has_grad[i] && layout.entries[i].numel > 0) ++entry_steps[i];
  return std::nullopt;
}

void check_flat(const char* what, const at::Tensor& t, int64_t size, at::DeviceType type) {
  const std::string name = std::string("step_flat: tensor '") + what + "'";
  if (!t.defined()) throw std::invalid_argument(name + " is undefined");
  if (t.scalar_type() != at::kFloat || t.dim() != 1 || !t.is_contiguous())
    throw std::invalid_argument(name + " must be a contiguous 1-D fp32 tensor");
  if (t.numel() != size)
    throw std::invalid_argument(name + " has " + std::to_string(t.numel()) + " elements, the layout needs " +
                                std::to_string(size));
  if (t.device().type() != type)
    throw std::invalid_argument(name + " is on " + t.device().str() + ", the backend runs on " +
                                c10::DeviceTypeName(type, /*lower_case=*/true));
}

}  // namespace

FlatTensors wrap_flat(const Layout& layout, float* params, float* grads, float* momentum, float* row_var,
                      float* exp_avg, float* exp_avg_sq, ReferenceDevice device) {
  const std::string reason = ReferenceBackend::unavailable_reason(device);
  if (!reason.empty())
    throw std::invalid_argument(std::string("wrap_flat: device ") + to_string(device) + " is unavailable: " + reason);
  const at::TensorOptions fp32 = at::TensorOptions().dtype(at::kFloat).device(device_type(device));
  // Non-empty buffers are wrapped where they live (from_blob finds the CUDA device from the pointer);
  // empty ones (a layout without NorMuon or AdamW parameters) get a 0-element tensor on that device.
  struct Slot {
    const char* what;
    float* data;
    int64_t size;
    at::Tensor* out;
  };
  FlatTensors t;
  const Slot slots[] = {{"params", params, layout.param_floats, &t.params},
                        {"grads", grads, layout.param_floats, &t.grads},
                        {"momentum", momentum, layout.normuon_floats, &t.momentum},
                        {"row_var", row_var, layout.stat_floats, &t.row_var},
                        {"exp_avg", exp_avg, layout.adam_floats, &t.exp_avg},
                        {"exp_avg_sq", exp_avg_sq, layout.adam_floats, &t.exp_avg_sq}};
  std::optional<at::Device> where;
  for (const Slot& s : slots) {
    if (s.size == 0) continue;
    if (!s.data) throw std::invalid_argument(std::string("wrap_flat: '") + s.what + "' is null");
    *s.out = at::from_blob(s.data, {s.size}, fp32);
    if (!where) where = s.out->device();
  }
  for (const Slot& s : slots)
    if (s.size == 0) *s.out = at::empty({0}, where ? fp32.device(*where) : fp32);
  return t;
}

// ---- the backend -------------------------------------------------------------------------------------

std::string ReferenceBackend::unavailable_reason(ReferenceDevice device) {
  if (device == ReferenceDevice::cpu) return "";
#ifndef NORMUON_REFERENCE_CUDA
  return "this build has no CUDA reference kernels (it was configured without the CUDA toolkit)";
#endif
  // hasCUDART: the CUDA part of libtorch is loaded; hasCUDA: and it sees at least one device.
  if (!at::globalContext().hasCUDART())
    return "this libtorch was built without CUDA (or its CUDA library is not loaded)";
  if (!at::hasCUDA()) return "no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES)";
  return "";
}

ReferenceBackend::ReferenceBackend(ReferenceDevice device)
    : device_(device), primitives_(std::make_shared<ReferencePrimitives>()) {
  const std::string reason = unavailable_reason(device);
  if (!reason.empty())
    throw std::invalid_argument(std::string("backend reference-") + to_string(device) + " is unavailable: " + reason);
}

std::string ReferenceBackend::name() const { return std::string("reference-") + to_string(device_); }

StepResult ReferenceBackend::step_flat(const Layout& layout, FlatTensors& t, const std::vector<uint8_t>& has_grad,
                                       std::vector<int64_t>& group_steps, std::vector<int64_t>& entry_steps,
                                       const Options& options) {
  const auto start = std::chrono::steady_clock::now();
  const at::DeviceType type = device_type(device_);
  check_flat("params", t.params, layout.param_floats, type);
  check_flat("grads", t.grads, layout.param_floats, type);
  check_flat("momentum", t.momentum, layout.normuon_floats, type);
  check_flat("row_var", t.row_var, layout.stat_floats, type);
  check_flat("exp_avg", t.exp_avg, layout.adam_floats, type);
  check_flat("exp_avg_sq", t.exp_avg_sq, layout.adam_floats, type);
  // One device for everything that is used (0-element tensors are never touched).
  for (const at::Tensor* x : {&t.grads, &t.momentum, &t.row_var, &t.exp_avg, &t.exp_avg_sq})
    if (x->numel() > 0 && t.params.numel() > 0 && x->device() != t.params.device())
      throw std::invalid_argument("step_flat: the flat tensors are on different devices (" + t.params.device().str() +
                                  ", " + x->device().str() + ")");
  if (has_grad.size() != layout.entries.size())
    throw std::invalid_argument("step_flat: " + std::to_string(has_grad.size()) + " has_grad flags for " +
                                std::to_string(layout.entries.size()) + " parameters");
  if (group_steps.size() != layout.group_names.size())
    throw std::invalid_argument("step_flat: " + std::to_string(group_steps.size()) + " group steps for " +
                                std::to_string(layout.group_names.size()) + " groups");
  if (entry_steps.size() != layout.entries.size())
    throw std::invalid_argument("step_flat: " + std::to_string(entry_steps.size()) + " entry steps for " +
                                std::to_string(layout.entries.size()) + " parameters");

  times_ = PhaseTimes{};
  if (auto skipped = begin_flat_step(layout, t.grads, has_grad, group_steps, entry_steps, options)) return *skipped;
  run_parameters(*primitives_, layout, t, has_grad, entry_steps, options, timing_ ? &times_ : nullptr);
  if (timing_) {
    synchronize(t.params.device());
    times_.total = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  }
  return {};
}

StepResult ReferenceBackend::step(FlatState& state, const Options& options) {
  const auto start = std::chrono::steady_clock::now();
  const Layout& layout = *state.layout;
  FlatTensors host = wrap_flat(layout, state.params.data(), state.grads.data(), state.momentum.data(),
                               state.row_var.data(), state.exp_avg.data(), state.exp_avg_sq.data(),
                               ReferenceDevice::cpu);
  if (device_ == ReferenceDevice::cpu) {
    // In place on views of the state's buffers: what it writes is exactly what a state file saves.
    times_ = PhaseTimes{};
    if (auto skipped = begin_step(state, options)) return *skipped;
    run_parameters(*primitives_, layout, host, state.has_grad, state.entry_steps, options,
                   timing_ ? &times_ : nullptr);
    if (timing_)
      times_.total = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    return {};
  }

  // cuda: host -> device, the step there, device -> host. The device copies are kept between steps.
  at::Tensor* dev[] = {&staged_.params, &staged_.grads, &staged_.momentum,
                       &staged_.row_var, &staged_.exp_avg, &staged_.exp_avg_sq};
  at::Tensor* src[] = {&host.params, &host.grads, &host.momentum, &host.row_var, &host.exp_avg, &host.exp_avg_sq};
  bool fits = have_staged_ && staged_fingerprint_ == layout.fingerprint;
  for (int k = 0; fits && k < 6; ++k) fits = dev[k]->numel() == src[k]->numel();
  if (!fits) {
    const at::TensorOptions fp32 = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA);
    for (int k = 0; k < 6; ++k) *dev[k] = at::empty({src[k]->numel()}, fp32);
    staged_fingerprint_ = layout.fingerprint;
    have_staged_ = true;
  }
  for (int k = 0; k < 6; ++k) dev[k]->copy_(*src[k]);
  const StepResult result = step_flat(layout, staged_, state.has_grad, state.group_steps, state.entry_steps, options);
  if (!result.skipped) {  // grads are read only: everything else comes back (copy_ to host memory waits)
    for (int k = 0; k < 6; ++k)
      if (k != 1) src[k]->copy_(*dev[k]);
  }
  if (timing_)
    times_.total = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace normuon
