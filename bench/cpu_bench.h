// `normuon bench`, the old-vs-new performance comparison, as a library: the reference (per-parameter
// ATen) and the fast CPU backend run side by side in one process, interleaved step by step on identical
// copies of the same state fed the same generated gradients, with warm-up and repeats. docs/bench.md
// explains every number.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "bench_report.h"
#include "normuon/backend.h"
#include "normuon/layout.h"
#include "normuon/options.h"

namespace normuon::bench {

struct CpuBenchConfig {
  std::string model = "tiny";  // the name printed and written to the CSV: a preset or a manifest path
  int64_t warmup = 1;          // unmeasured steps first
  int64_t repeats = 5;         // measured steps, >= 1
  int threads = 0;             // of both backends and the triad; 0: fast::default_threads()
  uint64_t seed = 1234;        // the gradient generator's
  bool quiet = false;          // no per-step progress and no description of the fast backend's batches
  // When set, the fast backend runs this Newton-Schulz algorithm in every NorMuon group and the reference
  // keeps the options' own: Gram Newton-Schulz against the official (standard) iteration, side by side.
  std::optional<NsAlgorithm> fast_ns_algorithm;
};

struct CpuStepSample {
  PhaseTimes phases;
  double wall_ms = 0;
  double cpu_ms = 0;       // CPU time of the whole process (all threads, spin-waits included)
  double allocations = 0;  // malloc-family calls of every thread during the step
};

// What one run measured. The counts come from one extra, untimed step of each backend.
struct CpuBenchResult {
  std::string model;
  int threads = 0;  // as resolved: never 0
  std::string reference_ns, fast_ns;  // each backend's Newton-Schulz algorithm(s), e.g. "standard"; "" unused
  int64_t reference_gram_matrices = 0, fast_gram_matrices = 0;  // NorMuon matrices that run Gram's iteration
  int64_t repeats = 0;
  int64_t steps = 0;  // steps each backend took: warm-up, measured and the counting step
  int64_t adamw_params = 0;
  // Newton-Schulz FLOPs per step (2 per multiply-add). ns_flops is the "useful" count, the full dense
  // standard iteration's, whatever either backend computes; the others are what each one computes with the
  // run's ns_algorithm: the reference every product in full, the fast backend as its matmuls count them
  // (symmetric products as lower-triangle panels: BatchedNewtonSchulz::multiply_adds).
  double ns_flops = 0, ns_reference_flops = 0, ns_fast_flops = 0;
  // Newton-Schulz alone on the fast backend's batches (outside the step, same threads), per algorithm:
  // median of `repeats` passes after one warm-up pass, and the FLOPs one pass computes.
  struct NsAlone {
    std::string algorithm;
    std::vector<double> ms;
    double actual_flops = 0;
  };
  std::vector<NsAlone> ns_alone;
  std::vector<CpuStepSample> reference, fast;  // the measured steps
  std::vector<double> triad_ms;                // the triad's best time right after each measured fast step
  int64_t triad_floats = 0;
  int triad_runs = 0;
  bool allocations_counted = false;  // false: the malloc interposition is not in effect
  int64_t aten_ops_top_level = 0, aten_ops_dispatched = 0;  // reference
  int64_t elementwise_passes = 0, gemm_calls = 0;           // fast
  // oneDNN's allocations in one Newton-Schulz pass over the fast backend's batches outside the step
  // (NaN when there are none), and the GEMM calls of that pass.
  double onednn_allocations = std::numeric_limits<double>::quiet_NaN();
  int64_t onednn_gemm_calls = 0;
  double max_param_diff = 0;  // between the two states after the run (`normuon compare` checks them)
  bool same_algorithms() const { return reference_ns == fast_ns; }
  // The fast step with a busy process beside it (one spinning process): with the run's threads, and
  // with one thread under the same contention; `repeats` steps each, after the quiet ones.
  std::vector<double> contended_ms, contended_one_thread_ms;
  std::string load_before, load_after;
};

struct CpuPhaseRow {
  std::string name, csv_name;
  Summary reference, fast;
};

// The medians and spreads the report prints.
struct CpuBenchSummary {
  // momentum, Newton-Schulz, normalisation, update, AdamW, other, total (timers), whole step (CPU),
  // whole step (wall)
  std::vector<CpuPhaseRow> rows;
  Summary reference_allocations, fast_allocations;
  Summary triad_traffic_gbps, triad_stream_gbps, adamw_gbps;
  Summary adamw_share, adamw_share_stream;  // fractions of the triad's traffic / STREAM-counted figure
  double speedup = 0;                       // reference / fast, whole-step wall medians
  Summary contended, contended_one_thread;  // whole-step wall times under contention
  const CpuPhaseRow& newton_schulz() const { return rows[1]; }
  const CpuPhaseRow& whole_step() const { return rows.back(); }
};

// Empty when this build can run the benchmark, else why not (no fast CPU backend).
std::string cpu_bench_unavailable_reason();

// Runs it; the header lines and, unless quiet, the progress lines go to `log`. Throws
// std::runtime_error where cpu_bench_unavailable_reason() says why.
CpuBenchResult run_cpu_bench(const Layout& layout, const Options& options, const CpuBenchConfig& config,
                             Transcript& log);

CpuBenchSummary summarise_cpu_bench(const CpuBenchResult& r);

// The table, work and allocation counts, bandwidths and the two verdict lines.
void print_cpu_bench(const CpuBenchResult& r, Transcript& log);

// model,threads,backend,metric,unit,median,min,max,samples (docs/bench.md). Throws when it can't write.
void write_cpu_bench_csv(const CpuBenchResult& r, const std::string& path);

}  // namespace normuon::bench
