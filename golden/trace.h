// Golden traces: per step and parameter, a row of statistics that pins the optimizer's semantics
// (norms of the parameter and its state, the update's norm and per-row RMS range, sampled elements and a
// bit hash). Backend-independent: computed from the shared FlatState. Stored as CSV (libcsv).
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "normuon/backend.h"
#include "normuon/grad_gen.h"
#include "normuon/options.h"

namespace normuon {

// The numeric columns of a trace row, in CSV order after step, param and algorithm.
const std::vector<std::string>& trace_value_columns();

struct TraceRow {
  int64_t step = 0;
  std::string param;
  std::string algorithm;
  std::vector<double> values;  // trace_value_columns() order
  uint64_t param_hash = 0;     // FNV-1a of the parameter's fp32 bits
};

// Everything that decides a golden trace. standard() is the committed configuration: the tiny preset,
// 20 steps, seed 1234, a parameter missing its gradient every 7th step, weight decay 0.1 in both groups.
struct GoldenSpec {
  std::string preset = "tiny";
  int64_t steps = 20;
  GradientGenerator generator;
  Options options;
  static GoldenSpec standard();
};

// Runs spec.steps steps of `backend` from the generator's initial parameters; one row per step and param.
// `layout` must be Layout::build(preset_manifest(spec.preset), spec.options), the one `backend` serves.
std::vector<TraceRow> make_trace(Backend& backend, const Layout& layout, const GoldenSpec& spec);
// The same, for a backend that is not tied to a layout (the reference).
std::vector<TraceRow> make_trace(Backend& backend, const GoldenSpec& spec);

// Rows for one step: `before` is the parameter buffer before the step, `after` the state after it.
void append_trace_rows(std::vector<TraceRow>& rows, int64_t step, const float* params_before, const FlatState& after);

void write_trace_csv(std::ostream& out, const std::vector<TraceRow>& rows);
std::vector<TraceRow> read_trace_csv(const std::string& path);  // throws std::runtime_error naming line/column

// The bound of each value column (trace_value_columns() order) when the trace comes from another platform's
// kernels: the error |golden - actual| divided by the column's scale for that parameter (the largest
// |golden| value of the column over the parameter's rows). A different bf16 GEMM summation order (a GPU,
// another BLAS) moves a NorMuon trajectory by noise that stays far below these bounds, while every
// semantic knob moves some column far above them (docs/golden.md "On another platform").
const std::vector<double>& cross_platform_bounds();

// Per value: |golden - actual| <= atol + rtol * max(|golden|, |actual|); hashes compared only when exact.
// cross_platform: instead (rtol, atol and exact are then unused), each value within its column's
// cross_platform_bounds(), the counts exactly.
struct TraceTolerance {
  double rtol = 1e-6;
  double atol = 1e-12;
  bool exact = false;           // bitwise: every value and hash equal
  bool cross_platform = false;  // another platform's rounding: scaled errors within cross_platform_bounds()
};

struct TraceComparison {
  int64_t rows_compared = 0;
  int64_t mismatches = 0;        // values (and hashes) outside the tolerance
  double max_rel_error = 0;      // over all values
  std::string first_mismatch;    // "step 3, param 'x', column 'p_norm': golden ... actual ..."
  // cross_platform only: the largest error as a fraction of its column's bound (infinite for a value that
  // must match exactly and does not, a NaN, or rows that do not line up), and where; the same per column.
  double worst_bound_fraction = 0;
  std::string worst;             // "step 3, param 'x', column 'p_norm'"
  std::vector<double> worst_by_column;  // trace_value_columns() order
  bool ok() const { return mismatches == 0; }
};

TraceComparison compare_traces(const std::vector<TraceRow>& golden, const std::vector<TraceRow>& actual,
                               const TraceTolerance& tolerance);

}  // namespace normuon
