// The cross-check of a candidate backend against the reference: both are driven from the same state
// with the same generated gradients, and after every step every parameter and every state tensor is
// compared (max abs error, max relative error, ULP distance, norm-wise error) against a per-kind,
// per-precision tolerance. Two modes (docs/compare.md):
//   resync        after each check the reference's parameters, state and step counters are copied into the
//                 candidate, so every step is judged from identical inputs and errors do not compound
//                 (as bitsandbytes' optimizer tests do against torch.optim);
//   free_running  both run on their own, and the report is the drift after N steps.
// Backend-independent: it takes Backend& (no libtorch here).
#pragma once

#include <array>
#include <initializer_list>
#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "normuon/backend.h"
#include "normuon/flat_state.h"
#include "normuon/grad_gen.h"
#include "normuon/layout.h"
#include "normuon/options.h"

namespace normuon {

// ---- element metrics -------------------------------------------------------------------------------

// Distance between two floats in units in the last place, through the monotonic mapping of the float
// bits onto the integers (+0 and -0 both map to 0, so they are 0 apart; the smallest subnormals on
// either side of zero are 2 apart). Two NaNs (any payload) are 0 apart; a NaN against a number is
// kUlpNaN. Inf is one ULP above the largest finite float.
constexpr int64_t kUlpNaN = INT64_MAX;
int64_t ulp_distance(float a, float b);

// Floor of the denominator of the relative error: |a - e| / max(|e|, kRelFloor). The smallest normal
// float, so a zero or subnormal expected value still gives a finite (and, for any real difference, huge)
// relative error. Informational: no tolerance is set on it (norm-wise and ULP errors are the criteria).
constexpr double kRelFloor = 1.1754943508222875e-38;

// Errors of one tensor (`actual` against `expected`, n elements).
struct TensorError {
  double max_abs = 0;              // max |a - e| (a NaN against a number, or Inf against finite: +inf)
  double max_rel = 0;              // max |a - e| / max(|e|, kRelFloor)
  double normwise = 0;             // ||a - e||_2 / ||e||_2 (0 when both are 0; ||a||_2 / kRelFloor when e = 0)
  int64_t max_ulp = 0;             // max ulp_distance(a, e)
  int64_t worst_element = -1;      // flat index of the largest |a - e| (first on ties; -1 when none differ)
  float expected = 0, actual = 0;  // at worst_element
  int64_t elements_differing = 0;  // elements with ulp_distance > 0
  bool bit_identical = true;       // every element's bits equal (so -0 vs +0 differs here, not in ULPs)
};
TensorError compare_tensor(const float* expected, const float* actual, int64_t n);

// ---- tensor kinds and tolerances ---------------------------------------------------------------------

enum class TensorKind { normuon_param, momentum, row_var, adamw_param, exp_avg, exp_avg_sq };
constexpr int kNumTensorKinds = 6;
const char* to_string(TensorKind);

// A tensor is within tolerance when every element is within max_ulp ULPs of the reference, or a bounded
// error metric is within its bound (a bound of 0 is unused). Exact kinds use all zeros: equal values
// (+0/-0 and NaN/NaN count as equal). The kinds that go through the Newton-Schulz GEMMs use a norm-wise
// bound: row_var on TensorError::normwise, NorMuon parameters on the error relative to the reference's
// update (TensorRecord::update_rel), which unlike ||a - e|| / ||e|| does not grow with the learning rate
// or the lr_scale rule.
struct Tolerance {
  double normwise = 0;    // bound on TensorError::normwise
  double update_rel = 0;  // bound on TensorRecord::update_rel (NorMuon parameters)
  int64_t max_ulp = 0;
  bool exact() const { return normwise == 0 && update_rel == 0 && max_ulp == 0; }
  bool accepts(const TensorError& e, double update_error) const {
    return e.max_ulp <= max_ulp || (normwise > 0 && e.normwise <= normwise) ||
           (update_rel > 0 && update_error <= update_rel);
  }
  // How close to the bound: the smallest metric/bound of the bounded metrics (<= 1 passes); for an exact
  // tolerance 0 when equal and +inf otherwise.
  double ratio(const TensorError& e, double update_error) const;
  std::string describe() const;  // "exact", "normwise <= 0.05", "update error <= 0.1"
};

enum class CompareMode { resync, free_running };
const char* to_string(CompareMode);
CompareMode parse_compare_mode(const std::string&);  // "resync" | "free" | "free_running"

// The tolerance of each tensor kind for each group (Options::groups order, = layout group order): the
// NorMuon kinds depend on the group's ns_precision; free-running bounds are drift bounds. Values and
// their justification: docs/compare.md.
struct Tolerances {
  std::vector<std::array<Tolerance, kNumTensorKinds>> per_group;
  const Tolerance& of(int group, TensorKind kind) const { return per_group.at(group)[static_cast<int>(kind)]; }
  // Multiplies every non-exact bound (for experiments and the --tolerance-scale flag).
  void scale(double factor);
  // In every group, holds `kinds` to `normwise` (and nothing else) instead of their bounds: elementwise
  // kinds computed by kernels that round differently from the spec (torch's CUDA kernels).
  void hold_to_normwise(std::initializer_list<TensorKind> kinds, double normwise);
};
std::array<Tolerance, kNumTensorKinds> tolerances_for(NsPrecision precision, CompareMode mode);
Tolerances for_options(const Options& options, CompareMode mode = CompareMode::resync);

// The reference on CUDA is torch's CUDA kernels, which round AdamW differently from the spec (section 4:
// the division by sqrt(bc2) goes through a reciprocal, addcmul contracts), a few ULP per element; the
// spec's exact AdamW is the fast backends' (fast-cuda is bit-exact). For that candidate the AdamW
// parameter and exp_avg_sq are held to this norm-wise bound instead (measured on an H100: 7.5e-8 and
// 6.1e-8 in resync mode); exp_avg and the NorMuon momentum stay exact, as they came out.
constexpr double kTorchCudaAdamwNormwise = 1e-6;
void relax_for_torch_cuda_kernels(Tolerances& t);

// ---- reports -----------------------------------------------------------------------------------------

// One compared tensor of one step.
struct TensorRecord {
  int64_t step = 0;
  int entry = -1;
  TensorKind kind = TensorKind::normuon_param;
  std::string name;  // the parameter's name, or "<param>.<suffix>" for a state tensor
  int64_t numel = 0;
  TensorError error;
  // NorMuon parameters only: ||a - e|| / ||e - e_base||, the error relative to the reference's update over
  // the compared span. e_base is the reference's parameter before the step in resync mode (so this is the
  // relative error of the step's update itself) and before the first step in free-running mode (the drift
  // relative to the distance travelled). 0 when a == e; +inf when a != e but the reference didn't move.
  double update_rel = 0;
  Tolerance tolerance;
  double ratio = 0;  // tolerance.ratio(error, update_rel)
  bool ok = true;
};

// The first element beyond tolerance: where, both values, and the tensor's errors.
struct Divergence {
  int64_t step = 0;
  std::string param;
  std::string tensor;  // the parameter's name or "<param>.<suffix>"
  TensorKind kind = TensorKind::normuon_param;
  int64_t element = -1;  // flat row-major index inside the tensor (-1: not an element, see `what`)
  float expected = 0, actual = 0;
  double abs_error = 0;
  int64_t ulp = 0;
  double normwise = 0;
  double update_rel = 0;  // NorMuon parameters: TensorRecord::update_rel
  Tolerance tolerance;
  std::string what;  // non-element divergences: a skipped step, a group or entry step counter that differs
  std::string describe() const;
};

// Worst errors of one tensor kind (over a step, or over a run).
struct KindSummary {
  int64_t tensors = 0;  // compared
  int64_t bit_identical = 0;
  int64_t failures = 0;
  double worst_normwise = 0;
  double worst_max_abs = 0;
  double worst_max_rel = 0;
  int64_t worst_ulp = 0;
  double worst_update_rel = 0;  // NorMuon parameters only
  std::string worst_tensor;     // the tensor with the worst normwise error (empty while all are 0)
  int64_t worst_step = 0;
  double worst_ratio = 0;  // the closest call: max of TensorRecord::ratio
  std::string worst_ratio_tensor;
  int64_t worst_ratio_step = 0;
  Tolerance tolerance;  // of the worst-ratio tensor (or of the first one added)
  void add(const TensorRecord& r);
  void merge(const KindSummary& other);
};

struct StepReport {
  int64_t step = 0;
  bool reference_skipped = false, candidate_skipped = false;
  std::array<KindSummary, kNumTensorKinds> kinds;
  int64_t tensors = 0, bit_identical = 0, failures = 0;
  std::optional<Divergence> first_divergence;  // the first in layout order this step
  std::vector<TensorRecord> records;           // every compared tensor, layout order
  bool ok() const { return failures == 0; }
};

// Everything over a run: the verdict, the first divergence of the run, worst errors per kind.
struct RunSummary {
  CompareMode mode = CompareMode::resync;
  int64_t steps = 0;
  int64_t parameters = 0;
  int64_t tensors_per_step = 0;
  int64_t tensors = 0, bit_identical = 0, failures = 0;
  std::array<KindSummary, kNumTensorKinds> kinds;
  std::optional<Divergence> first_divergence;
  bool passed() const { return failures == 0; }
  double worst_normwise() const;     // over all kinds
  TensorKind tightest_kind() const;  // the kind of the largest worst_ratio (the closest call)
};

// ---- the comparator ----------------------------------------------------------------------------------

class Comparator {
 public:
  // The layout must outlive the comparator; tolerances default to for_options(options, mode).
  Comparator(const Layout& layout, Options options, GradientGenerator generator, CompareMode mode);

  // One step: fills the same gradients into both states (generated into ref_state, copied into cand_state),
  // steps both backends, compares every parameter and state tensor of every entry, the group steps and
  // the entry steps, records the worst errors, and in resync mode then copies the reference's parameters,
  // state and steps into cand_state (into its existing buffers).
  StepReport step(Backend& reference, FlatState& ref_state, Backend& candidate, FlatState& cand_state, int64_t step);

  // Compares without stepping (e.g. both states just loaded from files); `step` labels the report. Adds
  // to the run summary's counts (not to its steps). `params_base` gives update_rel: the base parameters
  // of the NorMuon part of the param buffer (its first normuon_floats values); without it the NorMuon
  // parameters must be equal (update_rel is +inf for any difference).
  StepReport check(FlatState& ref_state, FlatState& cand_state, int64_t step, const float* params_base = nullptr);

  // Copies params, momentum, row_var, exp_avg, exp_avg_sq, group_steps and entry_steps of `from` into `to`
  // in place.
  static void sync(const FlatState& from, FlatState& to);

  const RunSummary& summary() const { return summary_; }
  const Tolerances& tolerances() const { return tolerances_; }
  void set_tolerances(Tolerances t) { tolerances_ = std::move(t); }
  Options& options() { return options_; }  // may change between steps (schedulers), not the layout's knobs
  CompareMode mode() const { return mode_; }

 private:
  const Layout& layout_;
  Options options_;
  GradientGenerator generator_;
  CompareMode mode_;
  Tolerances tolerances_;
  // The reference's NorMuon parameters (the buffer's prefix) before the step (resync) or the first step (free).
  AlignedBuffer base_;
  bool have_base_ = false;
  RunSummary summary_;
};

// ---- output ------------------------------------------------------------------------------------------

// A table of the worst errors per tensor kind, with the tolerances and the verdict.
std::string summary_table(const RunSummary& summary);
// One line for a step: worst normwise per kind and the bit-identical count.
std::string step_line(const StepReport& report);
// The verdict: "cross-check PASSED: ..." or "cross-check FAILED: ... first divergence: ...".
std::string verdict_line(const RunSummary& summary);

// Per step and tensor errors as CSV (fields quoted by libcsv's csv_write where needed):
// step,tensor,param_index,kind,numel,max_abs,max_rel,max_ulp,normwise,update_rel,worst_element,
// expected,actual,elements_differing,bit_identical,tol_normwise,tol_update_rel,tol_ulp,ratio,ok
void write_errors_csv_header(std::ostream& out);
void write_errors_csv_rows(std::ostream& out, const std::vector<TensorRecord>& records);

}  // namespace normuon
