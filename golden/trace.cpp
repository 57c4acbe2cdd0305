#include "trace.h"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>

#include <csv.h>

#include "normuon/layout.h"
#include "normuon/presets.h"

namespace normuon {

const std::vector<std::string>& trace_value_columns() {
  static const std::vector<std::string> columns{
      "has_grad",    "group_step",  "entry_step",  "p_norm",             "p_first",           "p_mid",
      "p_last",      "state1_norm", "state2_norm", "update_norm",        "update_row_rms_min", "update_row_rms_max"};
  return columns;
}

const std::vector<double>& cross_platform_bounds() {
  // Measured (docs/golden.md): between the reference (fma chains in order) and the fast CPU backend, whose
  // bf16 GEMMs sum in another order (oneDNN, or staged fp32 GEMMs), the worst scaled errors over every
  // knob variant are p_norm 3.3e-4 (lr_scale=rms_matching; 1.3e-4 for the others), sampled elements 0.052,
  // state2_norm 9.0e-4, update_norm 2.2e-3, row RMS 0.017; momentum and every AdamW column 0. The bounds
  // leave 1.8x above that on p_norm and 4.5x or more elsewhere; every planted semantic change exceeds one
  // by 2.3x or more (the reference is exact everywhere, so that margin is the same on every machine).
  static const std::vector<double> bounds{
      0,    0,    0,    6e-4,  // the counts exactly; p_norm
      0.25, 0.25, 0.25,        // p_first, p_mid, p_last: single elements, the noisiest
      1e-5, 0.01, 0.01,        // state1_norm (momentum, exp_avg: no GEMM on their path), state2_norm, update_norm
      0.1,  0.1};              // update_row_rms_min, update_row_rms_max
  return bounds;
}

GoldenSpec GoldenSpec::standard() {
  GoldenSpec spec;
  spec.generator.seed = 1234;
  spec.generator.missing_grad_period = 7;
  spec.options.set("normuon.weight_decay", "0.1");
  spec.options.set("adamw.weight_decay", "0.1");
  return spec;
}

namespace {

double norm_of(const float* x, int64_t n) {
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
  return std::sqrt(sum);
}

}  // namespace

void append_trace_rows(std::vector<TraceRow>& rows, int64_t step, const float* params_before, const FlatState& after) {
  const Layout& layout = *after.layout;
  for (int i = 0; i < static_cast<int>(layout.entries.size()); ++i) {
    const LayoutEntry& e = layout.entries[i];
    const float* p = after.param(i);
    const float* before = params_before + e.offset;
    const int64_t n = e.numel;
    // Per-row RMS of the update, rows as stored (a 1-D or scalar parameter is one row).
    const int64_t cols = e.shape.size() == 2 ? e.shape[1] : n;
    const int64_t nrows = cols > 0 ? n / cols : 0;
    double update_sq = 0, row_min = n > 0 ? INFINITY : 0, row_max = 0;
    for (int64_t r = 0; r < nrows; ++r) {
      double row_sq = 0;
      for (int64_t c = 0; c < cols; ++c) {
        const double d = static_cast<double>(p[r * cols + c]) - before[r * cols + c];
        row_sq += d * d;
      }
      update_sq += row_sq;
      const double rms = std::sqrt(row_sq / static_cast<double>(cols));
      row_min = std::min(row_min, rms);
      row_max = std::max(row_max, rms);
    }
    const bool normuon = e.algorithm == Algorithm::normuon;
    const double state1 = normuon ? norm_of(after.momentum.data() + e.offset, n)
                                  : norm_of(after.exp_avg.data() + e.adam_offset, n);
    const double state2 = normuon ? norm_of(after.row_var.data() + e.stat_offset, e.stat_len)
                                  : norm_of(after.exp_avg_sq.data() + e.adam_offset, n);
    TraceRow row;
    row.step = step;
    row.param = e.name;
    row.algorithm = to_string(e.algorithm);
    row.values = {static_cast<double>(after.has_grad[i]),
                  static_cast<double>(after.group_steps[e.group]),
                  static_cast<double>(after.entry_steps[i]),
                  norm_of(p, n),
                  n > 0 ? p[0] : 0.0,
                  n > 0 ? p[n / 2] : 0.0,
                  n > 0 ? p[n - 1] : 0.0,
                  state1,
                  state2,
                  std::sqrt(update_sq),
                  row_min,
                  row_max};
    row.param_hash = fnv1a64(p, static_cast<size_t>(n) * sizeof(float));
    rows.push_back(std::move(row));
  }
}

std::vector<TraceRow> make_trace(Backend& backend, const GoldenSpec& spec) {
  const Layout layout = Layout::build(preset_manifest(spec.preset), spec.options);
  return make_trace(backend, layout, spec);
}

std::vector<TraceRow> make_trace(Backend& backend, const Layout& layout, const GoldenSpec& spec) {
  FlatState state(layout);
  spec.generator.fill_params(state);
  std::vector<TraceRow> rows;
  AlignedBuffer before(layout.param_floats);
  for (int64_t step = 1; step <= spec.steps; ++step) {
    spec.generator.fill_gradients(state, step);
    before = state.params;
    backend.step(state, spec.options);
    append_trace_rows(rows, step, before.data(), state);
  }
  return rows;
}

namespace {

void write_field(std::ostream& out, const std::string& field) {
  // csv_write quotes and escapes a field; it needs at most 2*len+2 bytes.
  std::string buf(field.size() * 2 + 2, '\0');
  const size_t n = csv_write(buf.data(), buf.size(), field.data(), field.size());
  out.write(buf.data(), static_cast<std::streamsize>(n));
}

std::string format_value(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::string format_hash(uint64_t h) {
  char buf[20];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, h);
  return buf;
}

}  // namespace

void write_trace_csv(std::ostream& out, const std::vector<TraceRow>& rows) {
  out << "step,param,algorithm";
  for (const auto& c : trace_value_columns()) out << ',' << c;
  out << ",p_hash\n";
  for (const auto& r : rows) {
    out << r.step << ',';
    write_field(out, r.param);
    out << ',' << r.algorithm;
    for (double v : r.values) out << ',' << format_value(v);
    out << ',' << format_hash(r.param_hash) << '\n';
  }
}

namespace {

struct CsvReader {
  std::vector<std::vector<std::string>> records;
  std::vector<std::string> current;
  static void on_field(void* s, size_t len, void* self) {
    static_cast<CsvReader*>(self)->current.emplace_back(static_cast<const char*>(s), len);
  }
  static void on_record(int, void* self) {
    auto* r = static_cast<CsvReader*>(self);
    r->records.push_back(std::move(r->current));
    r->current.clear();
  }
};

}  // namespace

std::vector<TraceRow> read_trace_csv(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open golden trace '" + path + "'");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  csv_parser parser;
  if (csv_init(&parser, CSV_APPEND_NULL) != 0) throw std::runtime_error("csv_init failed");
  CsvReader reader;
  const bool parsed = csv_parse(&parser, text.data(), text.size(), CsvReader::on_field, CsvReader::on_record,
                                &reader) == text.size() &&
                      csv_fini(&parser, CsvReader::on_field, CsvReader::on_record, &reader) == 0;
  const std::string parse_error = csv_strerror(csv_error(&parser));
  csv_free(&parser);
  if (!parsed) throw std::runtime_error(path + ": malformed CSV (" + parse_error + ")");

  const size_t width = 3 + trace_value_columns().size() + 1;
  if (reader.records.empty() || reader.records[0].size() != width || reader.records[0][0] != "step")
    throw std::runtime_error(path + ": not a golden trace (header must be step,param,algorithm,...,p_hash with " +
                             std::to_string(width) + " columns)");
  std::vector<TraceRow> rows;
  for (size_t line = 1; line < reader.records.size(); ++line) {
    const auto& f = reader.records[line];
    auto where = [&](size_t col) {
      return path + ":" + std::to_string(line + 1) + ": column '" + reader.records[0][std::min(col, width - 1)] + "'";
    };
    if (f.size() != width)
      throw std::runtime_error(where(0) + ": expected " + std::to_string(width) + " fields, got " +
                               std::to_string(f.size()));
    TraceRow row;
    try {
      row.step = std::stoll(f[0]);
    } catch (const std::exception&) {
      throw std::runtime_error(where(0) + ": '" + f[0] + "' is not an integer");
    }
    row.param = f[1];
    row.algorithm = f[2];
    for (size_t c = 3; c + 1 < width; ++c) {
      char* end = nullptr;
      const double v = std::strtod(f[c].c_str(), &end);
      if (f[c].empty() || *end != '\0') throw std::runtime_error(where(c) + ": '" + f[c] + "' is not a number");
      row.values.push_back(v);
    }
    char* end = nullptr;
    row.param_hash = std::strtoull(f[width - 1].c_str(), &end, 16);
    if (f[width - 1].empty() || *end != '\0')
      throw std::runtime_error(where(width - 1) + ": '" + f[width - 1] + "' is not a hex hash");
    rows.push_back(std::move(row));
  }
  return rows;
}

namespace {

// A column's largest |golden| value over each parameter's rows: the cross-platform check's scale.
std::map<std::string, std::vector<double>> column_scales(const std::vector<TraceRow>& golden, size_t columns) {
  std::map<std::string, std::vector<double>> scales;
  for (const TraceRow& g : golden) {
    std::vector<double>& scale = scales[g.param];
    scale.resize(columns, 0.0);
    for (size_t c = 0; c < columns && c < g.values.size(); ++c) scale[c] = std::max(scale[c], std::fabs(g.values[c]));
  }
  return scales;
}

// The cross-platform error of one value as a fraction of its bound: the error on the column's scale, or
// exact where the bound or the scale is 0. Infinite when the values differ there, or for a NaN.
double bound_fraction(double golden, double actual, double column_scale, double bound) {
  const double diff = std::fabs(golden - actual);
  if (std::isnan(diff)) return INFINITY;
  if (bound <= 0 || column_scale <= 0) return diff == 0 ? 0.0 : INFINITY;
  return diff / column_scale / bound;
}

}  // namespace

TraceComparison compare_traces(const std::vector<TraceRow>& golden, const std::vector<TraceRow>& actual,
                               const TraceTolerance& tol) {
  TraceComparison result;
  const auto& columns = trace_value_columns();
  if (tol.cross_platform) result.worst_by_column.assign(columns.size(), 0.0);
  auto note = [&](const std::string& what) {
    ++result.mismatches;
    if (result.first_mismatch.empty()) result.first_mismatch = what;
  };
  auto note_structure = [&](const std::string& what) {  // not a value: the worst of any check
    note(what);
    if (tol.cross_platform && result.worst_bound_fraction < INFINITY) {
      result.worst_bound_fraction = INFINITY;
      result.worst = what;
    }
  };
  if (golden.size() != actual.size())
    note_structure("row count: golden " + std::to_string(golden.size()) + ", actual " + std::to_string(actual.size()));
  const auto scales = tol.cross_platform ? column_scales(golden, columns.size())
                                         : std::map<std::string, std::vector<double>>{};
  for (size_t i = 0; i < std::min(golden.size(), actual.size()); ++i) {
    const TraceRow& g = golden[i];
    const TraceRow& a = actual[i];
    ++result.rows_compared;
    const std::string where = "step " + std::to_string(g.step) + ", param '" + g.param + "'";
    if (g.step != a.step || g.param != a.param || g.algorithm != a.algorithm) {
      note_structure("row " + std::to_string(i + 1) + ": golden is " + where + " (" + g.algorithm + "), actual is step " +
                     std::to_string(a.step) + ", param '" + a.param + "' (" + a.algorithm + ")");
      continue;
    }
    const std::vector<double>* row_scales = tol.cross_platform ? &scales.at(g.param) : nullptr;
    for (size_t c = 0; c < columns.size(); ++c) {
      const double gv = g.values[c], av = a.values[c];
      const double scale = std::max(std::fabs(gv), std::fabs(av));
      const double diff = std::fabs(gv - av);
      if (scale > 0) result.max_rel_error = std::max(result.max_rel_error, diff / scale);
      char buf[200];  // the mismatch's description, written only for a mismatch
      if (tol.cross_platform) {
        const double column_scale = (*row_scales)[c], bound = cross_platform_bounds()[c];
        const double fraction = bound_fraction(gv, av, column_scale, bound);  // never NaN
        result.worst_by_column[c] = std::max(result.worst_by_column[c], fraction);
        if (fraction > result.worst_bound_fraction) {
          result.worst_bound_fraction = fraction;
          result.worst = where + ", column '" + columns[c] + "'";
        }
        if (fraction > 1) {
          std::snprintf(buf, sizeof buf, ", column '%s': golden %.9g, actual %.9g (%.3g of the bound %.3g on the column's scale %.3g)",
                        columns[c].c_str(), gv, av, fraction, bound, column_scale);
          note(where + buf);
        }
      } else if (tol.exact ? std::memcmp(&gv, &av, sizeof gv) != 0 : !(diff <= tol.atol + tol.rtol * scale)) {
        std::snprintf(buf, sizeof buf, ", column '%s': golden %.9g, actual %.9g (rel. error %.3g)", columns[c].c_str(),
                      gv, av, scale > 0 ? diff / scale : 0.0);
        note(where + buf);
      }
    }
    if (tol.exact && !tol.cross_platform && g.param_hash != a.param_hash)
      note(where + ", column 'p_hash': golden " + format_hash(g.param_hash) + ", actual " + format_hash(a.param_hash));
  }
  return result;
}

}  // namespace normuon
