#include "reference_backend.h"

#include "normuon/ns_coefficients.h"
#include "normuon/step_prologue.h"

#include <chrono>
#include <cmath>
#include <sstream>
#include <stdexcept>

namespace normuon {
namespace {

// Views of the shared flat buffers as ATen tensors: no copy, the reference works on the layout in place.
at::Tensor view(float* data, std::vector<int64_t> shape) {
  return at::from_blob(data, shape, at::TensorOptions().dtype(at::kFloat));
}

// Adds the time since the last lap to a phase, when timing (times != nullptr).
class PhaseClock {
 public:
  explicit PhaseClock(PhaseTimes* times) : times_(times) {
    if (times_) last_ = std::chrono::steady_clock::now();
  }
  void lap(double PhaseTimes::*phase) {
    if (!times_) return;
    const auto now = std::chrono::steady_clock::now();
    times_->*phase += std::chrono::duration<double, std::milli>(now - last_).count();
    last_ = now;
  }

 private:
  PhaseTimes* times_;
  std::chrono::steady_clock::time_point last_;
};

// Frobenius norm accumulated in double, rounded once to fp32 (a 0-d fp32 tensor).
at::Tensor norm_in_double(const at::Tensor& x) { return x.to(at::kDouble).square().sum().sqrt().to(at::kFloat); }

}  // namespace

at::Tensor newton_schulz(const at::Tensor& update, const NorMuonHyper& h) {
  if (h.ns_coefficients == NsCoefficients::polar_express && h.ns_steps > kPolarExpressSteps)
    throw std::invalid_argument("ns_steps=" + std::to_string(h.ns_steps) +
                                " but the Polar Express schedule has 5 coefficient triples");
  // P rounds to the working precision. Values are held in fp32 tensors; in bf16 mode every elementwise
  // result is computed in fp32 from bf16 values and rounded (torch's opmath), and GEMMs run in bf16 with
  // fp32 accumulation. Coefficients therefore enter as fp32 values, as on CUDA.
  const bool bf16 = h.ns_precision == NsPrecision::bf16;
  auto P = [bf16](const at::Tensor& x) { return bf16 ? x.to(at::kBFloat16).to(at::kFloat) : x; };
  auto gemm = [bf16, &P](const at::Tensor& x, const at::Tensor& y) {
    if (!bf16) return at::mm(x, y);
    // torch 1.13's CPU bf16 mm accumulates in bf16 for products of at most 16^3 multiply-adds (a plain
    // loop, not oneDNN); the spec says fp32 accumulation, which fp32 mm of the bf16 values gives exactly.
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
  for (int k = 0; k < h.ns_steps; ++k) {
    const NsTriple& co = ns_triple(h.ns_coefficients, k);
    const at::Tensor A = gemm(X, X.t());
    const at::Tensor B = P(P(co.b * A) + gemm(P(co.c * A), A));  // (c*A) @ A, as the official `c * A @ A`
    X = P(P(co.a * X) + gemm(B, X));
  }
  if (tall) X = X.t();
  return X;
}

void normuon_update(at::Tensor p, const at::Tensor& g, at::Tensor M, at::Tensor v, const NorMuonHyper& h,
                    bool stats_per_row, PhaseTimes* times) {
  PhaseClock clock(times);
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
  at::Tensor s = h.eps_placement == EpsPlacement::add ? v.sqrt().add_(h.denom_eps).reciprocal()
                                                      : v.clamp_min(h.denom_eps).sqrt().reciprocal();
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
  PhaseClock clock(times);
  if (h.weight_decay != 0) p.mul_(1 - h.lr * h.weight_decay);
  m.lerp_(g, 1 - h.beta1);
  v.mul_(h.beta2).addcmul_(g, g, 1 - h.beta2);
  const double bias_correction1 = 1 - std::pow(h.beta1, static_cast<double>(t));
  const double bias_correction2 = 1 - std::pow(h.beta2, static_cast<double>(t));
  const double step_size = h.lr / bias_correction1;
  const double bias_correction2_sqrt = std::sqrt(bias_correction2);
  at::Tensor denom = (v.sqrt() / bias_correction2_sqrt).add_(h.eps);
  p.addcdiv_(m, denom, -step_size);
  clock.lap(&PhaseTimes::adamw);
}

StepResult ReferenceBackend::step(FlatState& state, const Options& options) {
  const auto start = std::chrono::steady_clock::now();
  times_ = PhaseTimes{};
  PhaseTimes* times = timing_ ? &times_ : nullptr;
  const Layout& layout = *state.layout;
  const int n_entries = static_cast<int>(layout.entries.size());
  if (auto skipped = begin_step(state, options)) return *skipped;

  for (int i = 0; i < n_entries; ++i) {
    const LayoutEntry& e = layout.entries[i];
    if (!state.has_grad[i] || e.numel == 0) continue;  // untouched, state not advanced
    const GroupOptions& group = options.groups[e.group];
    at::Tensor p = view(state.param(i), e.shape);
    at::Tensor g = view(state.grad(i), e.shape);
    if (e.algorithm == Algorithm::normuon) {
      normuon_update(p, g, view(state.momentum.data() + e.offset, e.shape),
                     view(state.row_var.data() + e.stat_offset, {e.stat_len}), group.normuon, e.stats_per_row, times);
    } else {
      adamw_update(p, g, view(state.exp_avg.data() + e.adam_offset, e.shape),
                   view(state.exp_avg_sq.data() + e.adam_offset, e.shape), group.adamw, state.group_steps[e.group], times);
    }
  }
  if (timing_) times_.total = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  return {};
}

}  // namespace normuon
