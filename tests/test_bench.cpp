// The benchmark library (bench/): the CPU old-vs-new run on tiny end to end (both backends measured,
// the work counted, the states still agreeing, the report and the CSV complete), and the GPU report's
// arithmetic and files on made-up samples and its Newton-Schulz FLOP counts (it needs no GPU). No timing
// is checked.
#define BOOST_TEST_MODULE bench
#include <boost/test/unit_test.hpp>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "cpu_bench.h"
#include "cuda_bench.h"
#include "normuon/layout.h"
#include "normuon/manifest.h"
#include "normuon/presets.h"

using namespace normuon;
using namespace normuon::bench;

namespace {

// A file name of this process's own under the temporary folder, removed at scope exit.
struct TempFile {
  explicit TempFile(const std::string& name)
      : path((std::filesystem::temp_directory_path() / ("normuon-test-bench-" + std::to_string(getpid()) + "-" + name))
                 .string()) {}
  ~TempFile() { std::remove(path.c_str()); }
  std::string path;
};

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::vector<std::string> split(const std::string& line) {
  std::vector<std::string> out(1);
  for (char c : line) {
    if (c == ',') out.emplace_back();
    else out.back().push_back(c);
  }
  return out;
}

bool contains(const std::string& text, const std::string& what) { return text.find(what) != std::string::npos; }

// One tiny run shared by the CPU cases (a few hundred ms).
const CpuBenchResult& tiny_run() {
  static const CpuBenchResult result = [] {
    const Options options;
    const Layout layout = Layout::build(preset_manifest("tiny"), options);
    CpuBenchConfig config;
    config.model = "tiny";
    config.warmup = 0;
    config.repeats = 1;
    config.quiet = true;
    Transcript quiet(nullptr);
    return run_cpu_bench(layout, options, config, quiet);
  }();
  return result;
}

}  // namespace

BOOST_AUTO_TEST_CASE(cpu_bench_measures_both_backends_on_tiny) {
  BOOST_REQUIRE_EQUAL(cpu_bench_unavailable_reason(), "");
  const CpuBenchResult& r = tiny_run();
  BOOST_TEST(r.threads > 0);
  BOOST_TEST(r.steps == 2);  // the measured step and the counting step
  BOOST_REQUIRE_EQUAL(r.reference.size(), 1u);
  BOOST_REQUIRE_EQUAL(r.fast.size(), 1u);
  BOOST_REQUIRE_EQUAL(r.triad_ms.size(), 1u);
  // Under contention (a busy process beside it): one measured step each with the run's threads and one.
  BOOST_REQUIRE_EQUAL(r.contended_ms.size(), 1u);
  BOOST_REQUIRE_EQUAL(r.contended_one_thread_ms.size(), 1u);
  BOOST_TEST(r.contended_ms[0] > 0);
  BOOST_TEST(r.contended_one_thread_ms[0] > 0);
  BOOST_TEST(r.reference[0].wall_ms > 0);
  BOOST_TEST(r.fast[0].wall_ms > 0);
  BOOST_TEST(r.fast[0].phases.newton_schulz > 0);
  BOOST_TEST(r.triad_ms[0] > 0);
  BOOST_TEST(r.elementwise_passes > 0);
  BOOST_TEST(r.gemm_calls > 0);
  BOOST_TEST(r.aten_ops_top_level > 0);
  BOOST_TEST(r.aten_ops_dispatched >= r.aten_ops_top_level);
  BOOST_TEST(r.ns_flops > 0);
  // Useful FLOPs are the dense standard iteration's; the reference computes them all (standard run), the
  // fast backend only the symmetric products' lower triangles (tiny's matrices: 4 panels of 64).
  BOOST_TEST(r.ns_reference_flops == r.ns_flops);
  BOOST_TEST(r.ns_fast_flops > 0.6 * r.ns_flops);
  BOOST_TEST(r.ns_fast_flops < 0.85 * r.ns_flops);
  // Newton-Schulz alone, both algorithms: Gram computes less than the standard iteration.
  BOOST_REQUIRE_EQUAL(r.ns_alone.size(), 2u);
  BOOST_TEST(r.ns_alone[0].algorithm == "standard");
  BOOST_TEST(r.ns_alone[1].algorithm == "gram");
  BOOST_TEST(r.ns_alone[0].actual_flops == r.ns_fast_flops);
  BOOST_TEST(r.ns_alone[1].actual_flops < 0.8 * r.ns_alone[0].actual_flops);
  BOOST_TEST(r.ns_alone[1].ms.size() == static_cast<size_t>(r.repeats));
  BOOST_TEST(r.adamw_params > 0);
  // The interposition is linked into this test as into the tool: a step of the reference allocates.
  BOOST_TEST(r.allocations_counted);
  BOOST_TEST(r.reference[0].allocations > 0);
  // Same state, same gradients, two steps: the two backends still agree.
  BOOST_TEST(std::isfinite(r.max_param_diff));
  BOOST_TEST(r.max_param_diff < 1e-3);
  BOOST_TEST(r.reference_ns == "standard");
  BOOST_TEST(r.fast_ns == "standard");

  const CpuBenchSummary s = summarise_cpu_bench(r);
  BOOST_REQUIRE_EQUAL(s.rows.size(), 9u);
  BOOST_TEST(s.newton_schulz().name == "Newton-Schulz");
  BOOST_TEST(s.whole_step().csv_name == "whole_step");
  BOOST_TEST(s.whole_step().fast.median == r.fast[0].wall_ms);
  BOOST_TEST(s.speedup == r.reference[0].wall_ms / r.fast[0].wall_ms);
}

// --fast-ns-algorithm gram: the fast backend runs Gram, the reference the official iteration.
BOOST_AUTO_TEST_CASE(cpu_bench_times_fast_gram_against_the_reference_standard) {
  const Options options;
  const Layout layout = Layout::build(preset_manifest("tiny"), options);
  CpuBenchConfig config;
  config.warmup = 0;
  config.repeats = 1;
  config.quiet = true;
  config.fast_ns_algorithm = NsAlgorithm::gram;
  Transcript log(nullptr);  // the run's header lines, then the report
  const CpuBenchResult r = run_cpu_bench(layout, options, config, log);
  BOOST_TEST(r.reference_ns == "standard");
  BOOST_TEST(r.fast_ns == "gram");
  BOOST_TEST(!r.same_algorithms());
  BOOST_TEST(r.ns_reference_flops == r.ns_flops);  // the reference computes the full standard iteration
  BOOST_REQUIRE_EQUAL(r.ns_alone.size(), 2u);
  BOOST_TEST(r.ns_fast_flops == r.ns_alone[1].actual_flops);  // the step's fast FLOPs are Gram's
  BOOST_TEST(r.reference_gram_matrices == 0);
  BOOST_TEST(r.fast_gram_matrices > 0);
  BOOST_TEST(r.gemm_calls != tiny_run().gemm_calls);
  // Different algorithms: the states part, but not far (both orthogonalise the same momentum).
  BOOST_TEST(r.max_param_diff > tiny_run().max_param_diff);
  BOOST_TEST(r.max_param_diff < 0.1);

  print_cpu_bench(r, log);
  BOOST_TEST(contains(log.text(), "; the fast backend runs gram instead\n"));
  BOOST_TEST(contains(log.text(), "whole step: fast (ns_algorithm gram) is "));
  BOOST_TEST(contains(log.text(), "faster than the reference (ns_algorithm standard) (bar 2.5x: "));
  BOOST_TEST(contains(log.text(), "different Newton-Schulz algorithms: not comparable"));
  BOOST_TEST(!contains(log.text(), "(bar 3x"));
}

BOOST_AUTO_TEST_CASE(cpu_bench_report_and_csv) {
  const CpuBenchResult& r = tiny_run();
  Transcript log(nullptr);
  print_cpu_bench(r, log);
  BOOST_TEST(contains(log.text(), "work per step:"));
  BOOST_TEST(contains(log.text(), "Newton-Schulz in the step: useful "));
  BOOST_TEST(contains(log.text(), "Newton-Schulz alone, ns_algorithm=standard"));
  BOOST_TEST(contains(log.text(), "Newton-Schulz alone, ns_algorithm=gram"));
  BOOST_TEST(contains(log.text(), "  fast:      " + std::to_string(r.elementwise_passes) + " elementwise passes, " +
                                      std::to_string(r.gemm_calls) + " GEMM calls"));
  BOOST_TEST(!contains(log.text(), "not measured"));
  BOOST_TEST(contains(log.text(), "whole step: fast is "));
  BOOST_TEST(contains(log.text(), "fused AdamW: "));

  const TempFile csv("cpu.csv");
  write_cpu_bench_csv(r, csv.path);
  const std::vector<std::string> lines = read_lines(csv.path);
  BOOST_REQUIRE(!lines.empty());
  BOOST_TEST(lines[0] == "model,threads,backend,metric,unit,median,min,max,samples");
  std::map<std::string, std::vector<std::string>> rows;  // "backend/metric" -> fields
  for (size_t i = 1; i < lines.size(); ++i) {
    const std::vector<std::string> f = split(lines[i]);
    BOOST_REQUIRE_EQUAL(f.size(), 9u);
    BOOST_TEST(f[0] == "tiny");
    BOOST_TEST(f[1] == std::to_string(r.threads));
    BOOST_TEST(rows.emplace(f[2] + "/" + f[3], f).second, "one row per backend and metric: " << lines[i]);
  }
  for (const char* phase : {"momentum", "newton_schulz", "normalisation", "update", "adamw", "other", "total",
                            "whole_step_cpu", "whole_step"}) {
    BOOST_TEST(rows.count(std::string("reference/") + phase) == 1u, phase);
    BOOST_TEST(rows.count(std::string("fast/") + phase) == 1u, phase);
  }
  for (const char* key : {"reference/allocations", "fast/allocations", "fast/onednn_allocations_newton_schulz",
                          "reference/aten_ops_top_level", "reference/aten_ops_dispatched", "fast/elementwise_passes",
                          "fast/gemm_calls", "machine/triad_traffic_bandwidth", "machine/triad_stream_bandwidth",
                          "fast/adamw_bandwidth", "fast/adamw_share_of_triad_traffic",
                          "reference/newton_schulz_throughput", "fast/newton_schulz_throughput",
                          "reference/newton_schulz_actual_throughput", "fast/newton_schulz_actual_throughput",
                          "fast/ns_standard_alone", "fast/ns_standard_alone_useful_throughput",
                          "fast/ns_standard_alone_actual_throughput", "fast/ns_gram_alone",
                          "fast/ns_gram_alone_useful_throughput", "fast/ns_gram_alone_actual_throughput",
                          "fast/reference/whole_step_speedup", "fast/whole_step_contended",
                          "reference/ns_gram_matrices", "fast/ns_gram_matrices",
                          "fast_one_thread/whole_step_contended"})
    BOOST_TEST(rows.count(key) == 1u, key);
  BOOST_TEST(lines.size() == 1 + 18 + 26);
  BOOST_TEST(rows["fast/ns_gram_matrices"][5] == "0");
  BOOST_TEST(rows["fast/gemm_calls"][5] == std::to_string(r.gemm_calls));
  BOOST_TEST(rows["fast/elementwise_passes"][5] == std::to_string(r.elementwise_passes));
}

BOOST_AUTO_TEST_CASE(cpu_bench_report_without_allocation_counts) {
  CpuBenchResult r = tiny_run();
  r.model = "my,model.csv";
  r.allocations_counted = false;
  Transcript log(nullptr);
  print_cpu_bench(r, log);
  BOOST_TEST(contains(log.text(), "  not measured: the malloc interposition is not in effect in this build\n"));
  const TempFile csv("uncounted.csv");
  write_cpu_bench_csv(r, csv.path);
  const std::vector<std::string> lines = read_lines(csv.path);
  BOOST_REQUIRE(lines.size() > 1);
  BOOST_TEST(lines[1].rfind("\"my,model.csv\",", 0) == 0u);  // a comma in the model's name is quoted
  for (const auto& line : lines) BOOST_TEST(!contains(line, "allocations"), line);
}

BOOST_AUTO_TEST_CASE(cuda_bench_report_on_made_up_samples) {
  CudaBenchResult r;
  r.model = "gpt-1.3b";
  r.repeats = 3;
  r.steps_per_sample = 10;
  r.traffic.momentum = 4e9;
  r.traffic.normalisation = 1e9;
  r.traffic.update = 2e9;
  r.traffic.adamw = 3e9;
  r.traffic.minimal = 6e9;
  r.ns_algorithm = "standard";
  r.ns_flops = r.ns_actual_flops = r.ns_dense_flops = 50e12;
  for (int i = 0; i < 3; ++i) {
    r.fast_phases.push_back({4, 100, 1, 2, 3, 111});  // ms
    r.eager_ms.push_back(120);
    r.graph_ms.push_back(118 + i);  // median 119
    r.copy.gbps.push_back(2000);
    r.gemm.tflops.push_back(600);
    r.enqueue_us.push_back(50);
    r.graph_launch_us.push_back(5);
  }
  r.reference_ran = false;
  r.reference_reason = "skipped (--no-reference)";

  const CudaBenchSummary s = summarise_cuda_bench(r);
  BOOST_TEST(s.graph.median == 119);
  // The elementwise passes: 10 GB in 10 ms = 1000 GB/s, half the copy bandwidth.
  BOOST_TEST(s.pass_bytes == 10e9);
  BOOST_TEST(s.pass_ms == 10);
  BOOST_TEST(s.elementwise_share == 0.5, boost::test_tools::tolerance(1e-12));
  // Newton-Schulz: 50 TFLOP in 100 ms = 500 TFLOP/s of 600.
  BOOST_TEST(s.ns_tflops == 500, boost::test_tools::tolerance(1e-12));
  // The bound: 50 TFLOP / 600 TFLOP/s + 6 GB / 2000 GB/s = 83.33 ms + 3 ms.
  BOOST_TEST(s.bound_ms == 50e12 / 600e12 * 1e3 + 3, boost::test_tools::tolerance(1e-12));
  BOOST_TEST(s.graph_ratio == 119 / s.bound_ms, boost::test_tools::tolerance(1e-12));
  BOOST_REQUIRE_EQUAL(s.verdicts.size(), 5u);  // no speed-up without the reference
  BOOST_TEST(s.verdicts[0].result == "NOT met");
  BOOST_TEST(s.verdicts[1].result == "met");
  // Issue 15's targets: standard judged (83% useful >= 60%), gram not measured by a standard run.
  BOOST_TEST(contains(s.verdicts[2].bar, "ns_algorithm=standard at least 60%"));
  BOOST_TEST(s.verdicts[2].result == "met");
  BOOST_TEST(contains(s.verdicts[3].bar, "ns_algorithm=gram above 100%"));
  BOOST_TEST(s.verdicts[3].result == "-");
  BOOST_TEST(s.verdicts[4].result == "met");

  Transcript log(nullptr);
  print_cuda_bench(r, log);
  BOOST_TEST(contains(log.text(), "elementwise passes: 50% of copy bandwidth (bar 85%: NOT met)\n"));
  BOOST_TEST(contains(log.text(), "Newton-Schulz: 83% of the bf16 GEMM rate in actual FLOPs (bar 50%: met)\n"));
  BOOST_TEST(contains(log.text(), "Newton-Schulz, ns_algorithm=standard: 83% of the bf16 GEMM rate in useful FLOPs "
                                  "(bar at least 60%: met)\n"));
  BOOST_TEST(contains(log.text(), "Newton-Schulz, ns_algorithm=gram: not measured: this run uses "
                                  "ns_algorithm=standard (run with --set ns_algorithm=gram)\n"));
  BOOST_TEST(contains(log.text(), "whole step: no comparison with reference-cuda (skipped (--no-reference))\n"));

  const TempFile csv("cuda.csv"), md("cuda.md");
  write_cuda_bench_csv(r, csv.path);
  const std::vector<std::string> lines = read_lines(csv.path);
  BOOST_REQUIRE_EQUAL(lines.size(), 1 + s.csv.size());
  BOOST_TEST(lines[0] == "model,phase,metric,value,unit");
  for (size_t i = 1; i < lines.size(); ++i) BOOST_TEST(split(lines[i]).size() == 5u, lines[i]);
  BOOST_TEST(contains(lines.back(), "gpt-1.3b,step,bar_1_5x_lower_bound_met,1,bool"));
  write_cuda_bench_markdown(r, log.text(), md.path);
  std::ifstream in(md.path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  BOOST_TEST(contains(text, "## Verdicts"));
  BOOST_TEST(contains(text, "## Full output\n\n```text\n" + log.text() + "```\n"));
}

// A gram run: it computes fewer FLOPs than it is credited with (useful), so the two rates part; the 50%
// bar and the lower bound take the actual ones, issue 15's gram target the useful ones.
BOOST_AUTO_TEST_CASE(cuda_bench_report_on_a_made_up_gram_run) {
  CudaBenchResult r;
  r.model = "gpt-1.3b";
  r.repeats = 1;
  r.ns_algorithm = "gram";
  r.ns_flops = 65e12;
  r.ns_actual_flops = r.ns_dense_flops = 36e12;
  r.traffic.minimal = 6e9;
  r.fast_phases.push_back({4, 100, 1, 2, 3, 111});  // ms: Newton-Schulz 100
  r.eager_ms.push_back(120);
  r.graph_ms.push_back(110);
  r.copy.gbps.push_back(2000);
  r.gemm.tflops.push_back(600);
  r.reference_reason = "skipped (--no-reference)";

  const CudaBenchSummary s = summarise_cuda_bench(r);
  // 65 TFLOP useful and 36 actual in 100 ms: 650 and 360 TFLOP/s, 108% and 60% of 600.
  BOOST_TEST(s.ns_tflops == 650, boost::test_tools::tolerance(1e-12));
  BOOST_TEST(s.ns_actual_tflops == 360, boost::test_tools::tolerance(1e-12));
  BOOST_TEST(s.ns_share == 650.0 / 600, boost::test_tools::tolerance(1e-12));
  BOOST_TEST(s.ns_actual_share == 0.6, boost::test_tools::tolerance(1e-12));
  BOOST_TEST(s.bound_ns_ms == 36e12 / 600e12 * 1e3, boost::test_tools::tolerance(1e-12));
  BOOST_REQUIRE_EQUAL(s.verdicts.size(), 5u);
  BOOST_TEST(s.verdicts[2].result == "-");  // standard's target: not this run's algorithm
  BOOST_TEST(contains(s.verdicts[2].measured, "this run uses ns_algorithm=gram"));
  BOOST_TEST(contains(s.verdicts[3].bar, "ns_algorithm=gram above 100%"));
  BOOST_TEST(s.verdicts[3].measured == "**108%** (650.0 useful TFLOP/s vs 600.0)");
  BOOST_TEST(s.verdicts[3].result == "met");
  std::map<std::string, double> csv;
  for (const CudaCsvRow& row : s.csv) csv[row.phase + "/" + row.metric] = row.value;
  BOOST_TEST(csv.at("newton_schulz/flops_per_step") == 65e12);
  BOOST_TEST(csv.at("newton_schulz/actual_flops_per_step") == 36e12);
  BOOST_TEST(csv.at("newton_schulz/actual_share_of_gemm_rate") == 60, boost::test_tools::tolerance(1e-12));
  BOOST_TEST(csv.at("newton_schulz/bar_100pct_gram_met") == 1);
  BOOST_TEST(csv.count("newton_schulz/bar_60pct_standard_met") == 0u);

  Transcript log(nullptr);
  print_cuda_bench(r, log);
  BOOST_TEST(contains(log.text(), "Newton-Schulz, ns_algorithm=gram, 100.000 ms per step (median)"));
  BOOST_TEST(contains(log.text(), "  useful 65.00 TFLOP per step (the full dense standard iteration"));
  BOOST_TEST(contains(log.text(), "  actual 36.00 TFLOP per step (what ns_algorithm=gram computes"));
  BOOST_TEST(!contains(log.text(), "the layout's own actual count"));
  BOOST_TEST(contains(log.text(), "Newton-Schulz, ns_algorithm=gram: 108% of the bf16 GEMM rate in useful FLOPs "
                                  "(bar above 100%: met)\n"));
  BOOST_TEST(contains(log.text(), "Newton-Schulz, ns_algorithm=standard: not measured"));

  // Exactly 100% is not above it; groups that mix the algorithms judge neither target.
  r.ns_flops = 60e12;
  BOOST_TEST(summarise_cuda_bench(r).verdicts[3].result == "NOT met");
  r.ns_algorithm = "gram, standard";  // as ns_algorithms_of names it
  for (const CudaVerdict& v : summarise_cuda_bench(r).verdicts)
    if (contains(v.bar, "ns_algorithm=")) {
      BOOST_TEST(v.result == "-", v.bar);
      BOOST_TEST(contains(v.measured, "mix ns_algorithm values"), v.measured);
    }
}

// Newton-Schulz FLOPs from the layout, per matrix against the formulas written out by hand (m = min side,
// n = max side): useful ns_steps (4 m^2 n + 2 m^3); under gram, 5 steps (restart before iteration 2)
// 8 m^2 n + 28 m^3 and 3 steps 8 m^2 n + 12 m^3; a square matrix keeps the standard count.
BOOST_AUTO_TEST_CASE(cuda_bench_counts_newton_schulz_flops_both_ways) {
  auto matrix = [](int64_t rows, int64_t cols) {
    ParamSpec p;
    p.name = "w" + std::to_string(rows) + "x" + std::to_string(cols);
    p.shape = {rows, cols};
    p.role = Role::matrix;
    return p;
  };
  auto standard = [](double m, double n, int steps) { return steps * (4 * m * m * n + 2 * m * m * m); };
  struct Case {
    int64_t rows, cols;
    int steps;
    double gram;
  };
  const Case cases[] = {{256, 1024, 5, 8.0 * 256 * 256 * 1024 + 28.0 * 256 * 256 * 256},
                        {1024, 256, 5, 8.0 * 256 * 256 * 1024 + 28.0 * 256 * 256 * 256},  // tall: transposed
                        {96, 640, 3, 8.0 * 96 * 96 * 640 + 12.0 * 96 * 96 * 96},
                        {128, 128, 5, standard(128, 128, 5)}};
  for (const Case& c : cases) {
    Manifest manifest;
    manifest.params = {matrix(c.rows, c.cols)};
    for (const char* algorithm : {"standard", "gram"}) {
      Options options;
      options.set("ns_steps", std::to_string(c.steps));
      options.set("ns_algorithm", algorithm);
      const Layout layout = Layout::build(manifest, options);
      const NsFlops f = count_ns_flops(layout, options);
      const double m = static_cast<double>(std::min(c.rows, c.cols)), n = static_cast<double>(std::max(c.rows, c.cols));
      BOOST_TEST(f.useful == standard(m, n, c.steps), c.rows << "x" << c.cols << " " << algorithm);
      BOOST_TEST(f.dense == (std::string(algorithm) == "gram" ? c.gram : f.useful),
                 c.rows << "x" << c.cols << " " << algorithm);
      BOOST_TEST(ns_algorithms_of(layout, options) == algorithm);
    }
  }
  // Two NorMuon groups on different algorithms are named both ways; a group with no matrix names nothing.
  {
    Manifest manifest;
    manifest.params = {matrix(256, 1024), matrix(96, 640)};
    manifest.params[1].group = "fast";
    Options options;
    GroupOptions fast = options.group("normuon");
    fast.name = "fast";
    fast.normuon.ns_algorithm = NsAlgorithm::gram;
    options.groups.push_back(fast);
    BOOST_TEST(ns_algorithms_of(Layout::build(manifest, options), options) == "gram, standard");
    manifest.params = {matrix(256, 1024)};
    BOOST_TEST(ns_algorithms_of(Layout::build(manifest, options), options) == "standard");
  }
  // AdamW parameters count nothing; a model of several matrices sums them.
  Manifest manifest;
  ParamSpec bias;
  bias.name = "bias";
  bias.shape = {1024};
  bias.role = Role::bias;
  manifest.params = {matrix(256, 1024), bias, matrix(96, 640)};
  Options options;
  options.set("ns_algorithm", "gram");
  const NsFlops f = count_ns_flops(Layout::build(manifest, options), options);
  BOOST_TEST(f.useful == standard(256, 1024, 5) + standard(96, 640, 5));
  BOOST_TEST(f.dense == 8.0 * 256 * 256 * 1024 + 28.0 * 256 * 256 * 256 + 8.0 * 96 * 96 * 640 + 28.0 * 96 * 96 * 96);
}
