#include "reference_backend.h"

#include "normuon/ns_algorithm.h"
#include "normuon/ns_coefficients.h"
#include "normuon/step_prologue.h"

#include <chrono>
#include <cmath>
#include <optional>
#include <stdexcept>
#include <type_traits>

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

// The spec's fp32 sqrt is IEEE's (correctly rounded), as CUDA's sqrtf and std::sqrt are. libtorch 2.x takes
// it on the CPU through a vectorised approximation (torch 2.11: 17% of fp32 results 1 ULP off, at every CPU
// capability), which made the reference, not the backends it judges, leave the spec. A faithful double sqrt
// rounded once to fp32 is the correctly rounded fp32 sqrt (the exact root of an fp32 never lies that close
// to a midpoint; checked on every fp32 in [0.5, 2)), so the CPU takes that path.
at::Tensor ieee_sqrt(const at::Tensor& x) {
  return x.is_cpu() ? x.to(at::kDouble).sqrt().to(x.scalar_type()) : x.sqrt();
}

// Frobenius norm accumulated in double, rounded once to fp32 (a 0-d fp32 tensor on x's device).
at::Tensor norm_in_double(const at::Tensor& x) { return x.to(at::kDouble).square().sum().sqrt().to(at::kFloat); }

// ---- cuBLAS settings for the spec's GEMMs -------------------------------------------------------------
// The spec wants fp32 GEMMs in fp32 and bf16 GEMMs with fp32 accumulation. On CUDA, torch may instead use
// TF32 for fp32 GEMMs (allow_tf32 / float32_matmul_precision) and, from torch 2.0 on, reduced-precision
// reductions for bf16 GEMMs (allow_bf16_reduced_precision_reduction, on by default). Both are turned off
// for the duration of a Newton-Schulz call. The bf16 knob's API differs between torch versions (absent in
// 1.13, bool in 2.0-2.6, an enum after), so it is reached through overloads that compile against each.
inline bool allows_reduced_precision(bool allowed) { return allowed; }
template <typename E, typename = std::enable_if_t<std::is_enum<E>::value>>
bool allows_reduced_precision(E option) {
  return static_cast<int>(option) == 0;  // CuBLASReductionOption::AllowReducedPrecisionWithSplitK
}
template <typename Ctx>
auto bf16_reduction_allowed(Ctx& ctx, int) -> decltype(allows_reduced_precision(ctx.allowBF16ReductionCuBLAS())) {
  return allows_reduced_precision(ctx.allowBF16ReductionCuBLAS());
}
template <typename Ctx>
bool bf16_reduction_allowed(Ctx&, long) {  // torch without the knob: bf16 GEMMs accumulate in fp32
  return false;
}
template <typename Ctx>
auto set_bf16_reduction(Ctx& ctx, bool allow, int) -> decltype(ctx.setAllowBF16ReductionCuBLAS(allow), void()) {
  ctx.setAllowBF16ReductionCuBLAS(allow);
}
template <typename Ctx>
void set_bf16_reduction(Ctx&, bool, long) {}

class SpecGemmGuard {
 public:
  explicit SpecGemmGuard(bool on_cuda) {
    if (!on_cuda) return;
    no_tf32_.emplace();  // thread-local override, restored by its destructor
    at::Context& ctx = at::globalContext();
    if (bf16_reduction_allowed(ctx, 0)) {
      set_bf16_reduction(ctx, false, 0);
      restore_bf16_ = true;
    }
  }
  ~SpecGemmGuard() {
    if (restore_bf16_) set_bf16_reduction(at::globalContext(), true, 0);
  }
  SpecGemmGuard(const SpecGemmGuard&) = delete;
  SpecGemmGuard& operator=(const SpecGemmGuard&) = delete;

 private:
  std::optional<at::NoTF32Guard> no_tf32_;
  bool restore_bf16_ = false;
};

// Gram Newton-Schulz (docs/spec.md section 3.2) on the normalised wide X (m < n): R = X X^T, Q collects
// the polynomial, X <- Q X only at a restart and at the end. Every m x m product is symmetric in exact
// arithmetic; its lower triangle (one dot product per element, rounded once) is kept and mirrored, as a
// symmetric GEMM computes it.
template <typename Round, typename Gemm>
at::Tensor gram_iteration(at::Tensor X, const NorMuonHyper& h, const Round& P, const Gemm& gemm) {
  const int64_t m = X.size(0);
  const at::Tensor lower = at::ones({m, m}, X.options().dtype(at::kBool)).tril();
  auto sym = [&lower](const at::Tensor& c) { return at::where(lower, c, c.t()); };
  at::Tensor R = sym(gemm(X, X.t())), Q;
  for (int k = 0; k < h.ns_steps; ++k) {
    const NsGramIteration does = ns_gram_iteration(k, h.ns_steps);
    if (does.restart) {
      X = gemm(Q, X);
      R = sym(gemm(X, X.t()));
    }
    const NsTriple& co = ns_triple(h.ns_coefficients, k);
    const at::Tensor Z = P(P(co.b * R) + sym(gemm(P(co.c * R), R)));  // the standard B, on R
    if (does.fresh) {
      Q = Z.clone();
      Q.diagonal().add_(co.a);  // Q = Z + a I: only the diagonal changes (off it, Z + 0 would flip -0)
      Q = P(Q);
    } else {
      Q = P(P(co.a * Q) + sym(gemm(Q, Z)));  // Q (Z + a I)
    }
    if (does.update_r) {  // R <- (Z + a I) R (Z + a I)
      const at::Tensor RZ = P(P(co.a * R) + sym(gemm(R, Z)));
      R = P(P(co.a * RZ) + sym(gemm(Z, RZ)));
    }
  }
  return gemm(Q, X);
}

}  // namespace

at::Tensor newton_schulz(const at::Tensor& update, const NorMuonHyper& h) {
  if (h.ns_coefficients == NsCoefficients::polar_express && h.ns_steps > kPolarExpressSteps)
    throw std::invalid_argument("ns_steps=" + std::to_string(h.ns_steps) +
                                " but the Polar Express schedule has 5 coefficient triples");
  const SpecGemmGuard gemm_guard(update.is_cuda());
  // P rounds to the working precision. Values are held in fp32 tensors; in bf16 mode every elementwise
  // result is computed in fp32 from bf16 values and rounded (torch's opmath), and GEMMs run in bf16 with
  // fp32 accumulation. Coefficients therefore enter as fp32 values, as on CUDA.
  const bool bf16 = h.ns_precision == NsPrecision::bf16;
  auto P = [bf16](const at::Tensor& x) { return bf16 ? x.to(at::kBFloat16).to(at::kFloat) : x; };
  auto gemm = [bf16, &P](const at::Tensor& x, const at::Tensor& y) {
    if (!bf16) return at::mm(x, y);
    // torch 1.13's CPU bf16 mm accumulates in bf16 for products of at most 16^3 multiply-adds (a plain
    // loop, not oneDNN); the spec says fp32 accumulation, which fp32 mm of the bf16 values gives exactly.
    // Kept on CUDA as well: there it is the same spec result (bf16 products are exact in fp32, TF32 is
    // off), and one code path keeps the CPU and CUDA references structurally identical.
    if (x.size(0) * x.size(1) * y.size(1) <= 16 * 16 * 16) return P(at::mm(x, y));
    return at::mm(x.to(at::kBFloat16), y.to(at::kBFloat16)).to(at::kFloat);
  };
  at::Tensor X = P(update.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true));
  const bool tall = X.size(0) > X.size(1);
  if (tall) X = X.t();  // iterate on the wide orientation: X X^T is the smaller Gram matrix
  const at::Tensor norm = P(X.norm());
  const at::Tensor denom = h.ns_coefficients == NsCoefficients::quintic
                               ? P(norm + h.ns_eps)
                               : P(P(norm * kPolarExpressSafety) + h.ns_eps);
  X = P(X / denom);
  if (ns_uses_gram(h.ns_algorithm, X.size(0), X.size(1))) {
    X = gram_iteration(X, h, P, gemm);
  } else {
    for (int k = 0; k < h.ns_steps; ++k) {
      const NsTriple& co = ns_triple(h.ns_coefficients, k);
      const at::Tensor A = gemm(X, X.t());
      const at::Tensor B = P(P(co.b * A) + gemm(P(co.c * A), A));  // (c*A) @ A, as the official `c * A @ A`
      X = P(P(co.a * X) + gemm(B, X));
    }
  }
  if (tall) X = X.t();
  return X;
}

void normuon_update(at::Tensor p, const at::Tensor& g, at::Tensor M, at::Tensor v, const NorMuonHyper& h,
                    bool stats_per_row, PhaseTimes* times) {
  PhaseClock clock(times, p.device());
  const int64_t rows = p.size(0), cols = p.size(1);
  // 1-2. momentum (EMA) and the Nesterov blend; never hand M itself to Newton-Schulz.
  M.lerp_(g, 1 - h.beta1);
  at::Tensor U = h.nesterov ? g.lerp(M, h.beta1) : M.clone();
  clock.lap(&PhaseTimes::momentum);
  // 3. orthogonalise, back to fp32.
  at::Tensor O = newton_schulz(U, h).contiguous();
  clock.lap(&PhaseTimes::newton_schulz);
  // 4. statistics along the neuron axis, accumulated in double.
  const int64_t reduce_dim = stats_per_row ? 1 : 0;
  at::Tensor nu = norm_in_double(O);
  at::Tensor r = O.to(at::kDouble).square().mean(reduce_dim).to(at::kFloat);
  // 5-6. second moment (no bias correction: it cancels in the re-norm) and its inverse square root.
  v.lerp_(r, 1 - h.beta2);
  at::Tensor s = h.eps_placement == EpsPlacement::add ? ieee_sqrt(v).add_(h.denom_eps).reciprocal()
                                                      : ieee_sqrt(v.clamp_min(h.denom_eps)).reciprocal();
  // 7-9. normalise, restore the Frobenius norm, apply the shape factor.
  at::Tensor update = O * (stats_per_row ? s.unsqueeze(1) : s.unsqueeze(0));
  at::Tensor nu_normalised = norm_in_double(update);
  update.mul_(nu / (nu_normalised + h.renorm_eps));
  update.mul_(lr_scale_factor(h.lr_scale, rows, cols));
  clock.lap(&PhaseTimes::normalisation);
  // 10. weight decay.
  switch (h.weight_decay_mode) {
    case WeightDecayMode::decoupled:
      if (h.weight_decay != 0) p.mul_(1 - h.lr * h.weight_decay);
      break;
    case WeightDecayMode::cautious:
      if (h.weight_decay != 0) {
        at::Tensor mask = (update * p).ge(0).to(at::kFloat);
        p.sub_(p * mask * (h.lr * h.weight_decay));
      }
      break;
    case WeightDecayMode::none: break;
  }
  // 11. the step.
  p.add_(update, -h.lr);
  clock.lap(&PhaseTimes::update);
}

void adamw_update(at::Tensor p, const at::Tensor& g, at::Tensor m, at::Tensor v, const AdamWHyper& h, int64_t t,
                  PhaseTimes* times) {
  PhaseClock clock(times, p.device());
  if (h.weight_decay != 0) p.mul_(1 - h.lr * h.weight_decay);
  m.lerp_(g, 1 - h.beta1);
  v.mul_(h.beta2).addcmul_(g, g, 1 - h.beta2);
  const double bias_correction1 = 1 - std::pow(h.beta1, static_cast<double>(t));
  const double bias_correction2 = 1 - std::pow(h.beta2, static_cast<double>(t));
  const double step_size = h.lr / bias_correction1;
  const double bias_correction2_sqrt = std::sqrt(bias_correction2);
  at::Tensor denom = (ieee_sqrt(v) / bias_correction2_sqrt).add_(h.eps);
  p.addcdiv_(m, denom, -step_size);
  clock.lap(&PhaseTimes::adamw);
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
void run_parameters(const Layout& layout, const FlatTensors& t, const std::vector<uint8_t>& has_grad,
                    const std::vector<int64_t>& entry_steps, const Options& options, PhaseTimes* times) {
  for (size_t i = 0; i < layout.entries.size(); ++i) {
    const LayoutEntry& e = layout.entries[i];
    if (!has_grad[i] || e.numel == 0) continue;  // untouched, state not advanced
    const GroupOptions& group = options.groups[e.group];
    at::Tensor p = slot(t.params, e.offset, e.shape, e.numel);
    at::Tensor g = slot(t.grads, e.offset, e.shape, e.numel);
    if (e.algorithm == Algorithm::normuon) {
      normuon_update(p, g, slot(t.momentum, e.offset, e.shape, e.numel),
                     slot(t.row_var, e.stat_offset, {e.stat_len}, e.stat_len), group.normuon, e.stats_per_row,
                     times);
    } else {
      adamw_update(p, g, slot(t.exp_avg, e.adam_offset, e.shape, e.numel),
                   slot(t.exp_avg_sq, e.adam_offset, e.shape, e.numel), group.adamw, entry_steps[i], times);
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
  // hasCUDART: the CUDA part of libtorch is loaded; hasCUDA: and it sees at least one device.
  if (!at::globalContext().hasCUDART())
    return "this libtorch was built without CUDA (or its CUDA library is not loaded)";
  if (!at::hasCUDA()) return "no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES)";
  return "";
}

ReferenceBackend::ReferenceBackend(ReferenceDevice device) : device_(device) {
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
  run_parameters(layout, t, has_grad, entry_steps, options, timing_ ? &times_ : nullptr);
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
    run_parameters(layout, host, state.has_grad, state.entry_steps, options, timing_ ? &times_ : nullptr);
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
