// The benchmark library (bench/): the CPU old-vs-new run on tiny end to end (both backends measured,
// the work counted, the states still agreeing, the report and the CSV complete), and the GPU report's
// arithmetic and files on made-up samples (it needs no GPU). No timing is checked.
#define BOOST_TEST_MODULE bench
#include <boost/test/unit_test.hpp>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "cpu_bench.h"
#include "cuda_bench.h"
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

  const CpuBenchSummary s = summarise_cpu_bench(r);
  BOOST_REQUIRE_EQUAL(s.rows.size(), 9u);
  BOOST_TEST(s.newton_schulz().name == "Newton-Schulz");
  BOOST_TEST(s.whole_step().csv_name == "whole_step");
  BOOST_TEST(s.whole_step().fast.median == r.fast[0].wall_ms);
  BOOST_TEST(s.speedup == r.reference[0].wall_ms / r.fast[0].wall_ms);
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
                          "fast_one_thread/whole_step_contended"})
    BOOST_TEST(rows.count(key) == 1u, key);
  BOOST_TEST(lines.size() == 1 + 18 + 24);
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
  r.ns_flops = r.ns_flops_layout = 50e12;
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
  BOOST_REQUIRE_EQUAL(s.verdicts.size(), 3u);  // no speed-up without the reference
  BOOST_TEST(s.verdicts[0].result == "NOT met");
  BOOST_TEST(s.verdicts[1].result == "met");
  BOOST_TEST(s.verdicts[2].result == "met");

  Transcript log(nullptr);
  print_cuda_bench(r, log);
  BOOST_TEST(contains(log.text(), "elementwise passes: 50% of copy bandwidth (bar 85%: NOT met)\n"));
  BOOST_TEST(contains(log.text(), "Newton-Schulz: 83% of the bf16 GEMM rate (bar 50%: met)\n"));
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
