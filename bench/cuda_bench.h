// `normuon bench-cuda`, the GPU benchmark of the fused CUDA backend, as a library (docs/bench-cuda.md).
// On one device, in one process, over one model, it measures the fast CUDA backend three ways (eager
// with per-phase CUDA-event timers, eager without timers, CUDA graph replay), the device's own copy
// bandwidth and bf16 GEMM rate, and the per-parameter reference stepping the same device buffers; the
// report gives per phase and per step the times, launches, achieved bandwidth and TFLOP/s against those
// rates, the lower bound computed from them (docs/bench-cuda.md), and verdict lines. Only
// run_cuda_bench needs the CUDA backend; the report is plain C++ and builds everywhere.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench_report.h"
#include "device_rates.h"
#include "normuon/backend.h"
#include "normuon/layout.h"
#include "normuon/options.h"

namespace normuon::bench {

struct CudaBenchConfig {
  std::string model = "gpt2-124m";  // printed; the bars are set for "gpt-1.3b" (others get an aside)
  std::string command;              // the command line, for the header and the markdown report
  int device = 0;
  int64_t warmup = 3;            // unmeasured steps before each measured series
  int64_t repeats = 10;          // measured steps / samples of each series, >= 1
  int64_t steps_per_sample = 10; // steps between the two events of one whole-step sample, >= 1
  int64_t copy_mib = 1024;       // the copy-bandwidth buffer (two are allocated)
  int64_t gemm_size = 8192;      // the square bf16 GEMM of the rate measurement
  int64_t ns_panel_width = 0;    // FastCudaConfig::ns_panel_width: 0 the backend's choice
  std::string grad_dtype = "f32";  // "f32" or "bf16": the dtype fast-cuda reads gradients in
  uint64_t seed = 1234;
  bool reference = true;  // false: skip the reference-cuda measurements
  bool quiet = false;     // no progress lines and no description of the backend's batches
};

// Bytes each elementwise phase moves per step, from the layout (docs/bench-cuda.md, --help), and the
// minimal elementwise traffic (docs/bench-cuda.md, Lower bound).
struct CudaTraffic {
  int64_t normuon_elements = 0, adamw_elements = 0, stat_elements = 0, matrices = 0;
  double momentum = 0, normalisation = 0, update = 0, adamw = 0;
  double minimal = 0;
};
CudaTraffic count_cuda_traffic(const Layout& layout, const Options& options, double grad_bytes);

// Newton-Schulz FLOPs per step (2 per multiply-add) from the layout, counted two ways (issue 15):
// `useful`, the full dense standard iteration's (ns_standard_dense_flops), whatever the run computes, the
// one scale on which the two algorithms compare; `dense`, what the run's ns_algorithm computes with every
// product in full (ns_dense_flops: Gram's count for non-square matrices under gram). fast-cuda computes
// less: its symmetric products as their lower panels (the backend's own count, newton_schulz_flops()).
struct NsFlops {
  double useful = 0, dense = 0;
};
NsFlops count_ns_flops(const Layout& layout, const Options& options);

// What one run measured (raw samples) and what its header said.
struct CudaBenchResult {
  std::string model, command, grad_dtype, date, device_name, software, ns_precisions;
  int device = 0;
  int64_t warmup = 0, repeats = 0, steps_per_sample = 0;
  size_t parameters = 0, buckets = 0;
  CudaTraffic traffic;
  std::string ns_algorithm;           // ns_algorithms_of(layout, options) (bench_report.h)
  double ns_flops = 0;                // useful FLOPs per step (count_ns_flops)
  double ns_actual_flops = 0;         // actual FLOPs per step: the backend's newton_schulz_flops()
  double ns_dense_flops = 0;          // the same algorithm with every product in full (count_ns_flops)
  std::vector<PhaseTimes> fast_phases;     // 1. eager with per-phase timers
  std::vector<double> enqueue_us;          //    host time to enqueue each of those steps
  std::vector<double> eager_ms;            // 2. eager without timers, ms per step per sample
  std::vector<double> graph_launch_us;     // 3. host time of one graph launch
  std::vector<double> graph_ms;            //    CUDA graph, ms per step per sample
  int64_t launches = 0, graph_nodes = 0;   // per eager step (host-counted); kernel nodes in the graph
  CopyRate copy;                           // 4. the device's rates
  GemmRate gemm;
  bool reference_ran = false;              // 5. the reference on the same device buffers
  std::string reference_reason;            //    why not, when it did not run
  std::vector<double> reference_ms;
  std::vector<PhaseTimes> reference_phases;
};

struct CudaPass {
  std::string label, csv;
  double bytes = 0, ms = 0;  // per step; the phase's median time
};
struct CudaVerdict {
  std::string bar, measured, result;
};
struct CudaCsvRow {
  std::string phase, metric;
  double value = 0;
  std::string unit;
};

// Everything derived from a result: the summaries, rates, the lower bound, verdicts and CSV rows.
struct CudaBenchSummary {
  // momentum (incl. the NaN/Inf scan), Newton-Schulz, normalisation, update, AdamW
  std::vector<Summary> fast_phase, reference_phase;
  Summary fast_other, reference_other, fast_total, reference_total;
  Summary eager, graph, reference;  // whole step without timers
  Summary enqueue_us, graph_launch_us, copy_gbps, gemm_tflops;
  std::vector<CudaPass> passes;  // momentum, normalisation, update, AdamW
  double pass_bytes = 0, pass_ms = 0, elementwise_gbps = 0, elementwise_share = 0;
  // Newton-Schulz's median time, and its rate and share of the bf16 GEMM rate in useful and actual FLOPs.
  double ns_ms = 0, ns_tflops = 0, ns_share = 0, ns_actual_tflops = 0, ns_actual_share = 0;
  double bound_ns_ms = 0, bound_mem_ms = 0, bound_ms = 0, graph_ratio = 0, eager_ratio = 0;
  // The bars (docs/bench-cuda.md), decided once for the console lines, the verdict rows and the CSV.
  bool elementwise_met = false, ns_actual_met = false, ns_target_met = false, bound_met = false;
  std::vector<CudaVerdict> verdicts;
  std::vector<CudaCsvRow> csv;
};

// Empty when the benchmark can run on `device`, else why not (a build without the CUDA backend, no
// driver, no device): the caller reports it as a skip.
std::string cuda_bench_unavailable_reason(int device);

// Runs it; the header and, unless quiet, the progress lines go to `log`. Throws std::invalid_argument
// when fast-cuda cannot run this model with these options.
CudaBenchResult run_cuda_bench(const Layout& layout, const Options& options, const CudaBenchConfig& config,
                               Transcript& log);

CudaBenchSummary summarise_cuda_bench(const CudaBenchResult& r);

// The phase, whole-step, launch, rate, bandwidth and lower-bound tables and the verdict lines.
void print_cuda_bench(const CudaBenchResult& r, Transcript& log);

// model,phase,metric,value,unit. Throws when it can't write.
void write_cuda_bench_csv(const CudaBenchResult& r, const std::string& path);

// A self-contained report (device, date, command, tables, verdicts, and `console`: the full output),
// as kept in bench/results/. Throws when it can't write.
void write_cuda_bench_markdown(const CudaBenchResult& r, const std::string& console, const std::string& path);

}  // namespace normuon::bench
