#include "comparator.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <ostream>
#include <sstream>
#include <stdexcept>

#include <csv.h>

namespace normuon {

// ---- element metrics -------------------------------------------------------------------------------

namespace {

// Monotonic mapping of float bits onto the integers: non-negative floats keep their bit pattern, negative
// ones are reflected below zero, so -0 and +0 both land on 0 and adjacent floats differ by 1.
int64_t ordered_key(float x) {
  int32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits < 0 ? static_cast<int64_t>(std::numeric_limits<int32_t>::min()) - bits : static_cast<int64_t>(bits);
}

}  // namespace

int64_t ulp_distance(float a, float b) {
  const bool na = std::isnan(a), nb = std::isnan(b);
  if (na || nb) return na && nb ? 0 : kUlpNaN;
  const int64_t d = ordered_key(a) - ordered_key(b);
  return d < 0 ? -d : d;
}

TensorError compare_tensor(const float* expected, const float* actual, int64_t n) {
  TensorError r;
  double diff_sq = 0, ref_sq = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float e = expected[i], a = actual[i];
    if (std::isfinite(e)) ref_sq += static_cast<double>(e) * e;
    if (std::memcmp(&e, &a, sizeof e) == 0) continue;
    r.bit_identical = false;
    const int64_t ulp = ulp_distance(a, e);
    if (ulp == 0) continue;
    ++r.elements_differing;
    r.max_ulp = std::max(r.max_ulp, ulp);
    // A NaN against a number, or an Inf against anything else, is an infinite error.
    const double d = std::isfinite(a) && std::isfinite(e) ? std::fabs(static_cast<double>(a) - e)
                                                          : std::numeric_limits<double>::infinity();
    diff_sq += d * d;
    const double rel = std::isfinite(e) ? d / std::max(std::fabs(static_cast<double>(e)), kRelFloor) : d;
    r.max_rel = std::max(r.max_rel, rel);
    if (d > r.max_abs || r.worst_element < 0) {
      r.max_abs = d;
      r.worst_element = i;
      r.expected = e;
      r.actual = a;
    }
  }
  if (diff_sq > 0) r.normwise = ref_sq > 0 ? std::sqrt(diff_sq) / std::sqrt(ref_sq) : std::sqrt(diff_sq) / kRelFloor;
  return r;
}

namespace {

double diff_norm(const float* x, const float* y, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(x[i]) - y[i];
    s += d * d;
  }
  return std::sqrt(s);
}

}  // namespace

// ---- kinds, modes and tolerances ---------------------------------------------------------------------

const char* to_string(TensorKind k) {
  switch (k) {
    case TensorKind::normuon_param:
      return "normuon_param";
    case TensorKind::momentum:
      return "momentum";
    case TensorKind::row_var:
      return "row_var";
    case TensorKind::adamw_param:
      return "adamw_param";
    case TensorKind::exp_avg:
      return "exp_avg";
    case TensorKind::exp_avg_sq:
      return "exp_avg_sq";
  }
  return "?";
}

const char* to_string(CompareMode m) { return m == CompareMode::resync ? "resync" : "free_running"; }

CompareMode parse_compare_mode(const std::string& text) {
  if (text == "resync") return CompareMode::resync;
  if (text == "free" || text == "free_running" || text == "free-running") return CompareMode::free_running;
  throw std::invalid_argument("unknown compare mode '" + text + "' (choose resync | free)");
}

double Tolerance::ratio(const TensorError& e, double update_error) const {
  if (e.max_ulp <= max_ulp) return 0;
  double r = std::numeric_limits<double>::infinity();
  if (normwise > 0) r = std::min(r, e.normwise / normwise);
  if (update_rel > 0) r = std::min(r, update_error / update_rel);
  return std::isnan(r) ? std::numeric_limits<double>::infinity() : r;
}

namespace {
std::string format_short(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.3g", v);
  return buf;
}
}  // namespace

std::string Tolerance::describe() const {
  if (exact()) return "exact";
  std::string s;
  auto add = [&s](const std::string& part) { s += (s.empty() ? "" : " or ") + part; };
  if (update_rel > 0) add("update error <= " + format_short(update_rel));
  if (normwise > 0) add("normwise <= " + format_short(normwise));
  if (max_ulp > 0) add("<= " + std::to_string(max_ulp) + " ULP");
  return s;
}

void Tolerances::scale(double factor) {
  for (auto& group : per_group)
    for (auto& t : group) {
      t.normwise *= factor;
      t.update_rel *= factor;
    }
}

void Tolerances::hold_to_normwise(std::initializer_list<TensorKind> kinds, double normwise) {
  for (auto& group : per_group)
    for (TensorKind k : kinds) group[static_cast<int>(k)] = Tolerance{normwise, 0, 0};
}

// The bounds (docs/compare.md has the measurements behind them). Momentum and every AdamW tensor are
// elementwise and mirror the reference's rounding op by op (fast/cpu_kernels.h): exact, in both modes
// (the momentum doesn't depend on the parameters, so it stays exact even free-running). NorMuon
// parameters and row_var go through the Newton-Schulz GEMMs, whose blocking differs between the
// reference's per-matrix ATen GEMMs and the fast backend's batched oneDNN ones; a different fp32
// accumulation order flips bf16 roundings (2^-8 relative each) or moves fp32 last bits, and the quintic
// iteration amplifies such differences (3.4445x per iteration along small singular values). Observed
// worst cases, tiny to 2048-wide matrices: bf16 3.3% update error and 1.3% row_var; fp32 0.18% and 0.19%
// (fp32 grows with the matrix size). The bounds are 3 to 5 times those.
// Free-running drift is measured against the distance travelled since the first step, and neither it nor
// row_var's drift ever exceeded the first step's error (both shrink as a run goes on: the steps' errors
// are independent, v's average forgets), so the drift bounds are the same numbers.
std::array<Tolerance, kNumTensorKinds> tolerances_for(NsPrecision precision, CompareMode mode) {
  (void)mode;
  const bool bf16 = precision == NsPrecision::bf16;
  std::array<Tolerance, kNumTensorKinds> t{};  // all exact
  t[static_cast<int>(TensorKind::normuon_param)].update_rel = bf16 ? 0.1 : 0.01;
  t[static_cast<int>(TensorKind::row_var)].normwise = bf16 ? 0.05 : 0.01;
  return t;
}

Tolerances for_options(const Options& options, CompareMode mode) {
  Tolerances t;
  for (const auto& g : options.groups) t.per_group.push_back(tolerances_for(g.normuon.ns_precision, mode));
  return t;
}

void relax_for_torch_cuda_kernels(Tolerances& t) {
  t.hold_to_normwise({TensorKind::adamw_param, TensorKind::exp_avg_sq}, kTorchCudaAdamwNormwise);
}

// ---- reports -----------------------------------------------------------------------------------------

namespace {

std::string format_float(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

std::string format_ulp(int64_t u) { return u == kUlpNaN ? std::string("NaN") : std::to_string(u); }

Divergence divergence_of(const TensorRecord& r, const std::string& param) {
  Divergence d;
  d.step = r.step;
  d.param = param;
  d.tensor = r.name;
  d.kind = r.kind;
  d.element = r.error.worst_element;
  d.expected = r.error.expected;
  d.actual = r.error.actual;
  d.abs_error = r.error.max_abs;
  d.ulp = d.element >= 0 ? ulp_distance(d.actual, d.expected) : 0;
  d.normwise = r.error.normwise;
  d.update_rel = r.update_rel;
  d.tolerance = r.tolerance;
  return d;
}

}  // namespace

std::string Divergence::describe() const {
  std::string s = "step " + std::to_string(step);
  if (!what.empty()) return s + ": " + what;
  s += ", parameter '" + param + "', tensor '" + tensor + "' (" + to_string(kind) + "), element " +
       std::to_string(element) + ": expected " + format_float(expected) + ", actual " + format_float(actual) +
       " (abs error " + format_short(abs_error) + ", " + format_ulp(ulp) + " ULP; tensor normwise error " +
       format_short(normwise);
  if (update_rel > 0) s += ", update error " + format_short(update_rel);
  s += "; tolerance " + tolerance.describe() + ")";
  return s;
}

// One tensor is a summary of one.
void KindSummary::add(const TensorRecord& r) {
  KindSummary one;
  one.tensors = 1;
  one.bit_identical = r.error.bit_identical ? 1 : 0;
  one.failures = r.ok ? 0 : 1;
  one.worst_normwise = r.error.normwise;
  one.worst_max_abs = r.error.max_abs;
  one.worst_max_rel = r.error.max_rel;
  one.worst_ulp = r.error.max_ulp;
  one.worst_update_rel = r.update_rel;
  one.worst_tensor = one.worst_ratio_tensor = r.name;
  one.worst_step = one.worst_ratio_step = r.step;
  one.worst_ratio = r.ratio;
  one.tolerance = r.tolerance;
  merge(one);
}

void KindSummary::merge(const KindSummary& o) {
  if (o.tensors == 0) return;
  if (tensors == 0) tolerance = o.tolerance;
  tensors += o.tensors;
  bit_identical += o.bit_identical;
  failures += o.failures;
  if (o.worst_normwise > worst_normwise || (std::isnan(o.worst_normwise) && !std::isnan(worst_normwise))) {
    worst_normwise = o.worst_normwise;
    worst_tensor = o.worst_tensor;
    worst_step = o.worst_step;
  }
  if (o.worst_ratio > worst_ratio) {
    worst_ratio = o.worst_ratio;
    worst_ratio_tensor = o.worst_ratio_tensor;
    worst_ratio_step = o.worst_ratio_step;
    tolerance = o.tolerance;
  }
  worst_max_abs = std::max(worst_max_abs, o.worst_max_abs);
  worst_max_rel = std::max(worst_max_rel, o.worst_max_rel);
  worst_ulp = std::max(worst_ulp, o.worst_ulp);
  worst_update_rel = std::max(worst_update_rel, o.worst_update_rel);
}

double RunSummary::worst_normwise() const {
  double w = 0;
  for (const auto& k : kinds) w = std::max(w, k.worst_normwise);
  return w;
}

TensorKind RunSummary::tightest_kind() const {
  int best = 0;
  double best_ratio = -1;
  for (int k = 0; k < kNumTensorKinds; ++k) {
    if (kinds[k].tensors == 0 || kinds[k].tolerance.exact()) continue;
    if (kinds[k].worst_ratio > best_ratio) {
      best_ratio = kinds[k].worst_ratio;
      best = k;
    }
  }
  return static_cast<TensorKind>(best);
}

// ---- the comparator ----------------------------------------------------------------------------------

Comparator::Comparator(const Layout& layout, Options options, GradientGenerator generator, CompareMode mode)
    : layout_(layout),
      options_(std::move(options)),
      generator_(generator),
      mode_(mode),
      tolerances_(for_options(options_, mode)),
      base_(layout.normuon_floats) {
  if (tolerances_.per_group.size() != layout.group_names.size())
    throw std::invalid_argument("comparator: the options define " + std::to_string(tolerances_.per_group.size()) +
                                " groups, the layout " + std::to_string(layout.group_names.size()));
  summary_.mode = mode;
  summary_.parameters = static_cast<int64_t>(layout.entries.size());
  summary_.tensors_per_step = 3 * summary_.parameters;
}

void Comparator::sync(const FlatState& from, FlatState& to) {
  if (from.layout->fingerprint != to.layout->fingerprint)
    throw std::invalid_argument("comparator: cannot sync states of different layouts");
  auto copy = [](const AlignedBuffer& src, AlignedBuffer& dst) {
    if (src.size() != dst.size()) throw std::invalid_argument("comparator: buffer sizes differ");
    if (src.size() > 0) std::memcpy(dst.data(), src.data(), static_cast<size_t>(src.size()) * sizeof(float));
  };
  copy(from.params, to.params);
  copy(from.momentum, to.momentum);
  copy(from.row_var, to.row_var);
  copy(from.exp_avg, to.exp_avg);
  copy(from.exp_avg_sq, to.exp_avg_sq);
  if (from.group_steps.size() != to.group_steps.size()) throw std::invalid_argument("comparator: group counts differ");
  std::copy(from.group_steps.begin(), from.group_steps.end(), to.group_steps.begin());
  if (from.entry_steps.size() != to.entry_steps.size()) throw std::invalid_argument("comparator: entry counts differ");
  std::copy(from.entry_steps.begin(), from.entry_steps.end(), to.entry_steps.begin());
}

StepReport Comparator::check(FlatState& ref, FlatState& cand, int64_t step, const float* params_base) {
  if (ref.layout->fingerprint != layout_.fingerprint || cand.layout->fingerprint != layout_.fingerprint)
    throw std::invalid_argument("comparator: a state's layout is not the comparator's");
  const int entries = static_cast<int>(layout_.entries.size());
  StepReport report;
  report.step = step;
  report.records.resize(static_cast<size_t>(3 * entries));

  // Each tensor is compared sequentially (deterministic sums); tensors are spread over threads.
#pragma omp parallel for schedule(dynamic, 1)
  for (int i = 0; i < entries; ++i) {
    const LayoutEntry& e = layout_.entries[i];
    const bool normuon = e.algorithm == Algorithm::normuon;
    TensorRecord* out = &report.records[static_cast<size_t>(3 * i)];
    out[0].kind = normuon ? TensorKind::normuon_param : TensorKind::adamw_param;
    out[0].name = e.name;
    out[0].numel = e.numel;
    out[0].error = compare_tensor(ref.param(i), cand.param(i), e.numel);
    if (params_base && normuon) {
      const double update = diff_norm(ref.param(i), params_base + e.offset, e.numel);
      const double error = diff_norm(ref.param(i), cand.param(i), e.numel);
      out[0].update_rel = error == 0 || std::isnan(error)
                              ? error
                              : (update > 0 ? error / update : std::numeric_limits<double>::infinity());
    } else if (normuon) {  // no base to measure the update against: the parameters must be equal
      out[0].update_rel = out[0].error.elements_differing == 0 ? 0 : std::numeric_limits<double>::infinity();
    }
    const std::vector<StateTensorRef> rs = state_tensors(ref, i), cs = state_tensors(cand, i);
    for (int k = 0; k < 2; ++k) {
      TensorRecord& r = out[1 + k];
      r.kind = normuon ? (k == 0 ? TensorKind::momentum : TensorKind::row_var)
                       : (k == 0 ? TensorKind::exp_avg : TensorKind::exp_avg_sq);
      r.name = rs[k].name;
      r.numel = rs[k].numel;
      r.error = compare_tensor(rs[k].data, cs[k].data, rs[k].numel);
    }
  }

  for (int i = 0; i < entries; ++i) {
    const LayoutEntry& e = layout_.entries[i];
    for (int k = 0; k < 3; ++k) {
      TensorRecord& r = report.records[static_cast<size_t>(3 * i + k)];
      r.step = step;
      r.entry = i;
      r.tolerance = tolerances_.of(e.group, r.kind);
      r.ok = r.tolerance.accepts(r.error, r.update_rel);
      r.ratio = r.tolerance.ratio(r.error, r.update_rel);
      report.kinds[static_cast<int>(r.kind)].add(r);
      ++report.tensors;
      if (r.error.bit_identical) ++report.bit_identical;
      if (!r.ok) {
        ++report.failures;
        if (!report.first_divergence) report.first_divergence = divergence_of(r, e.name);
      }
    }
  }
  for (size_t g = 0; g < ref.group_steps.size(); ++g) {
    if (ref.group_steps[g] == cand.group_steps[g]) continue;
    ++report.failures;
    if (!report.first_divergence) {
      Divergence d;
      d.step = step;
      d.what = "group '" + layout_.group_names[g] + "' step counter: reference " + std::to_string(ref.group_steps[g]) +
               ", candidate " + std::to_string(cand.group_steps[g]);
      report.first_divergence = d;
    }
  }
  for (size_t i = 0; i < ref.entry_steps.size(); ++i) {  // each parameter's own count (AdamW's bias corrections)
    if (ref.entry_steps[i] == cand.entry_steps[i]) continue;
    ++report.failures;
    if (!report.first_divergence) {
      Divergence d;
      d.step = step;
      d.what = "parameter '" + layout_.entries[i].name + "' step count: reference " +
               std::to_string(ref.entry_steps[i]) + ", candidate " + std::to_string(cand.entry_steps[i]);
      report.first_divergence = d;
    }
  }

  summary_.tensors += report.tensors;
  summary_.bit_identical += report.bit_identical;
  summary_.failures += report.failures;
  for (int k = 0; k < kNumTensorKinds; ++k) summary_.kinds[k].merge(report.kinds[k]);
  if (!summary_.first_divergence && report.first_divergence) summary_.first_divergence = report.first_divergence;
  return report;
}

StepReport Comparator::step(Backend& reference, FlatState& ref, Backend& candidate, FlatState& cand, int64_t step) {
  if (ref.layout->fingerprint != layout_.fingerprint || cand.layout->fingerprint != layout_.fingerprint)
    throw std::invalid_argument("comparator: a state's layout is not the comparator's");
  // The same gradients for both: generated once, copied.
  generator_.fill_gradients(ref, step);
  std::memcpy(cand.grads.data(), ref.grads.data(), static_cast<size_t>(ref.grads.size()) * sizeof(float));
  std::copy(ref.has_grad.begin(), ref.has_grad.end(), cand.has_grad.begin());
  // The base of update_rel: the parameters before this step (resync), before the first step (free).
  if (mode_ == CompareMode::resync || !have_base_)
    std::memcpy(base_.data(), ref.params.data(), static_cast<size_t>(base_.size()) * sizeof(float));
  have_base_ = true;

  const StepResult rr = reference.step(ref, options_);
  const StepResult cr = candidate.step(cand, options_);
  StepReport report = check(ref, cand, step, base_.data());
  report.reference_skipped = rr.skipped;
  report.candidate_skipped = cr.skipped;
  ++summary_.steps;
  if (rr.skipped != cr.skipped) {
    ++report.failures;
    ++summary_.failures;
    Divergence d;
    d.step = step;
    d.what = std::string("the ") + (rr.skipped ? "reference" : "candidate") + " skipped the step (" +
             (rr.skipped ? rr.reason : cr.reason) + "), the " + (rr.skipped ? "candidate" : "reference") + " did not";
    // A skip mismatch explains every tensor difference of this step: it goes first.
    report.first_divergence = d;
    if (!summary_.first_divergence || summary_.first_divergence->step == step) summary_.first_divergence = d;
  }
  if (mode_ == CompareMode::resync) sync(ref, cand);
  return report;
}

// ---- output ------------------------------------------------------------------------------------------

std::string summary_table(const RunSummary& s) {
  std::ostringstream out;
  char line[512];
  std::snprintf(line, sizeof line, "%-14s %8s %9s %7s %10s %10s %10s %11s %10s %7s  %s\n", "kind", "tensors",
                "identical", "failed", "normwise", "update err", "max abs", "max rel", "max ULP", "% tol", "tolerance");
  out << line;
  for (int k = 0; k < kNumTensorKinds; ++k) {
    const KindSummary& ks = s.kinds[k];
    if (ks.tensors == 0) continue;
    const bool param = k == static_cast<int>(TensorKind::normuon_param);
    std::snprintf(line, sizeof line, "%-14s %8lld %9lld %7lld %10.3g %10s %10.3g %11.3g %10s %7s  %s\n",
                  to_string(static_cast<TensorKind>(k)), static_cast<long long>(ks.tensors),
                  static_cast<long long>(ks.bit_identical), static_cast<long long>(ks.failures), ks.worst_normwise,
                  param ? format_short(ks.worst_update_rel).c_str() : "-", ks.worst_max_abs, ks.worst_max_rel,
                  format_ulp(ks.worst_ulp).c_str(), format_short(100 * ks.worst_ratio).c_str(),
                  ks.tolerance.describe().c_str());
    out << line;
    if (!ks.worst_ratio_tensor.empty())
      out << "               closest to tolerance: " << ks.worst_ratio_tensor << " at step " << ks.worst_ratio_step
          << "\n";
  }
  return out.str();
}

std::string step_line(const StepReport& r) {
  std::ostringstream out;
  out << "step " << r.step << ": " << r.bit_identical << "/" << r.tensors << " bit-identical";
  for (int k = 0; k < kNumTensorKinds; ++k) {
    const KindSummary& ks = r.kinds[k];
    if (ks.tensors == 0 || ks.bit_identical == ks.tensors) continue;
    out << ", " << to_string(static_cast<TensorKind>(k)) << " normwise " << format_short(ks.worst_normwise);
    if (k == static_cast<int>(TensorKind::normuon_param)) out << " update err " << format_short(ks.worst_update_rel);
  }
  if (r.reference_skipped || r.candidate_skipped)
    out << " (skipped by "
        << (r.reference_skipped && r.candidate_skipped ? "both"
            : r.reference_skipped                      ? "reference"
                                                       : "candidate")
        << ")";
  if (!r.ok()) out << "  FAILED: " << r.failures << " beyond tolerance";
  return out.str();
}

std::string verdict_line(const RunSummary& s) {
  std::ostringstream out;
  const std::string what = std::to_string(s.steps) + " steps (" + to_string(s.mode) + "), " +
                           std::to_string(s.parameters) + " parameters, " + std::to_string(s.tensors_per_step) +
                           " tensors per step";
  if (s.passed()) {
    out << "cross-check PASSED: " << what << ", " << s.bit_identical << " of " << s.tensors
        << " comparisons bit-identical; worst normwise error " << format_short(s.worst_normwise());
    const TensorKind k = s.tightest_kind();
    const KindSummary& ks = s.kinds[static_cast<int>(k)];
    if (ks.worst_ratio > 0)
      out << "; closest to tolerance: " << to_string(k) << " at " << format_short(100 * ks.worst_ratio) << "% of "
          << ks.tolerance.describe() << " (" << ks.worst_ratio_tensor << ", step " << ks.worst_ratio_step << ")";
    return out.str();
  }
  out << "cross-check FAILED: " << what << ", " << s.failures << " of " << s.tensors
      << " comparisons beyond tolerance; first divergence: "
      << (s.first_divergence ? s.first_divergence->describe() : std::string("?"));
  return out.str();
}

namespace {

void write_field(std::ostream& out, const std::string& field) {
  std::string buf(field.size() * 2 + 2, '\0');
  const size_t n = csv_write(buf.data(), buf.size(), field.data(), field.size());
  out.write(buf.data(), static_cast<std::streamsize>(n));
}

std::string g17(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

}  // namespace

void write_errors_csv_header(std::ostream& out) {
  out << "step,tensor,param_index,kind,numel,max_abs,max_rel,max_ulp,normwise,update_rel,worst_element,expected,"
         "actual,elements_differing,bit_identical,tol_normwise,tol_update_rel,tol_ulp,ratio,ok\n";
}

void write_errors_csv_rows(std::ostream& out, const std::vector<TensorRecord>& records) {
  for (const auto& r : records) {
    out << r.step << ',';
    write_field(out, r.name);
    out << ',' << r.entry << ',' << to_string(r.kind) << ',' << r.numel << ',' << g17(r.error.max_abs) << ','
        << g17(r.error.max_rel) << ',' << r.error.max_ulp << ',' << g17(r.error.normwise) << ',' << g17(r.update_rel)
        << ',' << r.error.worst_element << ',' << g17(r.error.expected) << ',' << g17(r.error.actual) << ','
        << r.error.elements_differing << ',' << (r.error.bit_identical ? 1 : 0) << ',' << g17(r.tolerance.normwise)
        << ',' << g17(r.tolerance.update_rel) << ',' << r.tolerance.max_ulp << ',' << g17(r.ratio) << ','
        << (r.ok ? 1 : 0) << '\n';
  }
}

}  // namespace normuon
