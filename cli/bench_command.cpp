// `normuon bench`: the old-vs-new performance comparison. The reference (per-parameter ATen) and the
// fast CPU backend run side by side in one process, interleaved step by step on identical copies of the
// same state fed the same generated gradients, with warm-up and repeats; per phase and whole step it
// reports median and min-max of both and their ratio, the work per step (ATen operator calls; passes and
// GEMM calls), malloc-family calls per step, the fused AdamW pass's bandwidth against a streaming triad
// measured in the same run, and the Newton-Schulz GFLOP/s. docs/bench.md explains every number.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "alloc_counter.h"
#include "args.h"
#include "bench_report.h"
#include "model_args.h"
#include "commands.h"
#include "normuon/grad_gen.h"
#include "normuon/layout.h"
#include "normuon/manifest.h"
#include "normuon/presets.h"
#include "reference_backend.h"

#if __has_include("fast_cpu_backend.h")  // the fast backend's include directory exists only when it is built
#define NORMUON_BENCH_HAVE_FAST 1
#include "fast_cpu_backend.h"
#include "newton_schulz.h"
#endif

namespace normuon::cli {
namespace {

using Clock = std::chrono::steady_clock;

#ifdef NORMUON_BENCH_HAVE_FAST

// "model name (family F, model M)" of the first processor in /proc/cpuinfo (virtual machines often
// report a bare "AMD EPYC"; the family tells the generation).
std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, name, family, model;
  auto value = [&line] {
    const auto colon = line.find(':');
    std::string v = colon == std::string::npos ? "" : line.substr(colon + 1);
    v.erase(0, v.find_first_not_of(" \t"));
    return v;
  };
  while (std::getline(in, line) && line.find_first_not_of(" \t") != std::string::npos) {
    if (line.rfind("model name", 0) == 0) name = value();
    else if (line.rfind("cpu family", 0) == 0) family = value();
    else if (line.rfind("model", 0) == 0) model = value();
  }
  if (name.empty()) return "unknown (no model name in /proc/cpuinfo)";
  return family.empty() ? name : name + " (family " + family + ", model " + model + ")";
}

// The 1-, 5- and 15-minute load averages: other work on the machine shows up in every number here.
std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string one, five, fifteen;
  if (!(in >> one >> five >> fifteen)) return "unknown";
  return one + " " + five + " " + fifteen;
}

std::string format(const char* fmt, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, x);
  return buf;
}

double process_cpu_ms() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
}

// ATen operator calls, counted by a RecordFunction callback (FUNCTION scope: every dispatched c10/ATen
// op, on every thread). "Top-level" calls are those not made from inside another op on the same thread,
// i.e. the calls the reference's own code makes; the total includes the ops those call in turn.
std::atomic<int64_t> g_ops_total{0}, g_ops_top{0};
thread_local int t_op_depth = 0;

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction&) {
  g_ops_total.fetch_add(1, std::memory_order_relaxed);
  if (t_op_depth++ == 0) g_ops_top.fetch_add(1, std::memory_order_relaxed);
  return nullptr;
}

void on_op_end(const at::RecordFunction&, at::ObserverContext*) { --t_op_depth; }

class OpCounter {
 public:
  OpCounter() {
    g_ops_total = 0;
    g_ops_top = 0;
    t_op_depth = 0;
    handle_ = at::addGlobalCallback(
        at::RecordFunctionCallback(on_op_start, on_op_end).scopes({at::RecordScope::FUNCTION}));
  }
  ~OpCounter() { at::removeCallback(handle_); }
  OpCounter(const OpCounter&) = delete;
  OpCounter& operator=(const OpCounter&) = delete;

 private:
  at::CallbackHandle handle_;
};

// Streaming triad a[i] = b[i] + s*c[i] over n floats with `threads` OpenMP threads, best of `runs`
// after one untimed run. The arrays are allocated and first-touched once (by the threads that stream
// them) and the triad is run after every fast step, so that it sees the same machine as the AdamW pass
// next to it (memory bandwidth on a shared host changes from minute to minute). Reported two ways: as
// STREAM counts it, 12 bytes per element (read b and c, write a), and as the memory traffic it causes,
// 16 bytes per element (the store to a[] first reads the line: write-allocate). The fused AdamW pass
// writes only lines it has read, so its 28 bytes per parameter are its whole traffic; it is compared
// with the triad's 16-byte figure (the stricter bar).

// Vectorised the way the fast backend's kernels are (fast/cpu_kernels.cpp): AVX-512 where the CPU has it.
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void triad_kernel(float* a, const float* b, const float* c, float s, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}

class StreamingTriad {
 public:
  StreamingTriad(int64_t n, int threads) : n_(std::max<int64_t>(n, 1024)), threads_(threads) {
    const size_t bytes = (static_cast<size_t>(n_) * sizeof(float) + 63) / 64 * 64;
    a_ = static_cast<float*>(std::aligned_alloc(64, bytes));
    b_ = static_cast<float*>(std::aligned_alloc(64, bytes));
    c_ = static_cast<float*>(std::aligned_alloc(64, bytes));
    if (!a_ || !b_ || !c_) {
      release();
      throw std::runtime_error("streaming triad: cannot allocate 3 x " + std::to_string(bytes) + " bytes");
    }
#pragma omp parallel num_threads(threads_)
    {
      int64_t begin = 0, end = 0;
      share(&begin, &end);
      std::fill(a_ + begin, a_ + end, 0.0f);
      std::fill(b_ + begin, b_ + end, 1.0f);
      std::fill(c_ + begin, c_ + end, 2.0f);
    }
    // Enough runs for ~1 GB of traffic on small arrays, at least 5.
    runs_ = static_cast<int>(std::clamp<double>(1e9 / (12.0 * static_cast<double>(n_)), 5, 500));
  }
  ~StreamingTriad() { release(); }
  StreamingTriad(const StreamingTriad&) = delete;
  StreamingTriad& operator=(const StreamingTriad&) = delete;

  int64_t size() const { return n_; }
  int runs() const { return runs_; }
  // Best time of one triad over the runs, in ms.
  double best_ms() {
    double best = std::numeric_limits<double>::infinity();
    for (int run = 0; run <= runs_; ++run) {
      const auto t0 = Clock::now();
#pragma omp parallel num_threads(threads_)
      {
        int64_t begin = 0, end = 0;
        share(&begin, &end);
        triad_kernel(a_ + begin, b_ + begin, c_ + begin, 3.0f, end - begin);
      }
      const double ms = ms_between(t0, Clock::now());
      if (run > 0) best = std::min(best, ms);
    }
    volatile float sink = a_[0] + a_[n_ - 1];  // the stores are observed
    (void)sink;
    return best;
  }
  double stream_gbps(double ms) const { return 12.0 * static_cast<double>(n_) / (ms * 1e-3) / 1e9; }
  double traffic_gbps(double ms) const { return 16.0 * static_cast<double>(n_) / (ms * 1e-3) / 1e9; }

 private:
  // This thread's contiguous share: the same at first touch (so its pages are local) and in the runs.
  void share(int64_t* begin, int64_t* end) const {
    const int64_t team = omp_get_num_threads(), chunk = (n_ + team - 1) / team;
    *begin = std::min(n_, omp_get_thread_num() * chunk);
    *end = std::min(n_, *begin + chunk);
  }
  void release() {
    std::free(a_);
    std::free(b_);
    std::free(c_);
    a_ = b_ = c_ = nullptr;
  }
  int64_t n_;
  int threads_;
  int runs_ = 0;
  float *a_ = nullptr, *b_ = nullptr, *c_ = nullptr;
};

#endif  // NORMUON_BENCH_HAVE_FAST

constexpr const char* kHelp = R"(usage: normuon bench [--preset NAME | --manifest FILE] [--warmup N] [--repeats N] [--threads N]
                     [--set KEY=VALUE]... [--seed S] [--csv FILE] [--quiet]

Old-vs-new performance comparison: the reference backend (per-parameter ATen ops, the "old" path) and
the fast CPU backend (fused multi-tensor passes, batched oneDNN Newton-Schulz) run side by side in one
process, on identical copies of the same state fed the same generated gradients, interleaved
(reference step, fast step, reference step, ...) so that machine noise hits both. The first N steps
(--warmup, default 1) are not measured; the next --repeats (default 5) are.

Prints, per phase (momentum, Newton-Schulz, normalisation, update, AdamW, other) and for the whole
step (wall time, and CPU time of all threads), the median and [min - max] in milliseconds of each
backend and the ratio reference / fast; the work per step (reference: ATen operator calls; fast:
elementwise passes and GEMM calls); malloc-family calls per step of each (and oneDNN's share of the fast
backend's); the fused AdamW pass's bandwidth as a share of a streaming triad run right after every fast
step; Newton-Schulz GFLOP/s; the load average; and two verdict lines: the whole-step speed-up against
the 3x bar and the AdamW bandwidth against the 60%-of-triad bar. Run it on an otherwise idle machine.

  --preset NAME | --manifest FILE   the model (default: preset tiny)
  --threads N      threads of BOTH backends and of the triad (at::set_num_threads for the reference,
                   the fast backend's OpenMP team); default: one per processor
  --set KEY=VALUE  hyper-parameters and knobs, as for `normuon run` (the same for both backends)
  --seed S         gradient generator seed (default 1234)
  --csv FILE       also write every number as CSV (one row per backend per phase/metric)
  --quiet          no per-step progress and no backend description; the tables and verdicts remain
See docs/bench.md.)";

#ifdef NORMUON_BENCH_HAVE_FAST
struct StepSample {
  PhaseTimes phases;
  double wall_ms = 0;
  double cpu_ms = 0;  // CPU time of the whole process (all threads, spin-waits included)
  double allocations = 0;
};

std::vector<double> phase_series(const std::vector<StepSample>& samples, double PhaseTimes::*phase) {
  std::vector<double> v;
  for (const auto& s : samples) v.push_back(s.phases.*phase);
  return v;
}

// Time of a step outside the five phases (NaN/Inf check, group bookkeeping, timer overhead).
std::vector<double> other_series(const std::vector<StepSample>& samples) {
  std::vector<double> v;
  for (const auto& s : samples) {
    const PhaseTimes& p = s.phases;
    v.push_back(std::max(0.0, p.total - (p.momentum + p.newton_schulz + p.normalisation + p.update + p.adamw)));
  }
  return v;
}

#endif  // NORMUON_BENCH_HAVE_FAST

}  // namespace

int bench_command(const Argv& argv) {
  const Args a(argv, {"preset", "manifest", "warmup", "repeats", "threads", "set", "csv", "seed"}, {"quiet"});
  if (a.help()) {
    std::puts(kHelp);
    return 0;
  }
#ifndef NORMUON_BENCH_HAVE_FAST
  throw std::runtime_error("this build has no fast backend (configured with -DNORMUON_BUILD_FAST_CPU=OFF): "
                           "nothing to compare the reference with");
#else
  const long long warmup = a.get_int("warmup", 1);
  const long long repeats = a.get_int("repeats", 5);
  const long long threads_arg = a.get_int("threads", 0);
  if (warmup < 0) throw std::invalid_argument("--warmup must be >= 0");
  if (repeats < 1) throw std::invalid_argument("--repeats must be >= 1");
  if (threads_arg < 0) throw std::invalid_argument("--threads must be >= 0 (0: one per processor)");
  const int threads = threads_arg > 0 ? static_cast<int>(threads_arg) : omp_get_num_procs();
  const bool quiet = a.flag("quiet");
  const std::string model = a.has("manifest") ? a.get("manifest", "") : a.get("preset", "tiny");

  const Manifest manifest = model_manifest(a);
  Options options;
  if (!apply_sets(a, options)) return 0;
  const Layout layout = Layout::build(manifest, options);
  const GradientGenerator generator{static_cast<uint64_t>(a.get_int("seed", 1234)), 0};

  // The fast backend (and the oneDNN probe below) first, before any libtorch call.
  FastCpuBackend fast(layout, options, threads);
  // A probe for oneDNN's own allocations: the fast backend's Newton-Schulz batches (the matrices of one
  // shape bucket and one group, as FastCpuBackend forms them), run through the same batched code with
  // the same threads and knobs outside the step. Its workspace is allocated here, once.
  struct ProbeBatch {
    int group;
    std::vector<int> entries;
  };
  std::vector<ProbeBatch> probe_batches;
  std::vector<fast::NsBatchShape> probe_shapes;
  for (const auto& bucket : layout.buckets) {
    std::map<int, size_t> batch_of_group;
    for (int e : bucket.entries) {
      const int group = layout.entries[e].group;
      const auto [it, inserted] = batch_of_group.emplace(group, probe_batches.size());
      if (inserted) {
        probe_batches.push_back({group, {}});
        probe_shapes.push_back({bucket.rows, bucket.cols, 0});
      }
      probe_batches[it->second].entries.push_back(e);
      ++probe_shapes[it->second].count;
    }
  }
  std::unique_ptr<fast::BatchedNewtonSchulz> probe;
  {
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    if (!probe_shapes.empty()) probe = std::make_unique<fast::BatchedNewtonSchulz>(probe_shapes);
    omp_set_num_threads(saved);
  }

  at::set_num_threads(threads);
  ReferenceBackend reference;
  reference.set_timing(true);
  fast.set_timing(true);

  FlatState ref_state(layout);
  generator.fill_params(ref_state);
  FlatState fast_state = ref_state;

  int64_t normuon_params = 0, adamw_params = 0;
  double ns_flops = 0;  // per step, every NorMuon matrix (all have gradients: no missing-gradient period)
  for (const auto& e : layout.entries) {
    if (e.algorithm == Algorithm::adamw) {
      adamw_params += e.numel;
      continue;
    }
    normuon_params += e.numel;
    const double m = static_cast<double>(std::min(e.rows, e.cols)), n = static_cast<double>(std::max(e.rows, e.cols));
    ns_flops += options.groups[e.group].normuon.ns_steps * (4 * m * m * n + 2 * m * m * m);
  }
  std::string ns_precisions;
  for (const auto& g : options.groups)
    if (g.algorithm == Algorithm::normuon)
      ns_precisions += (ns_precisions.empty() ? "" : ", ") + g.name + ": " + to_string(g.normuon.ns_precision) +
                       " (" + to_string(g.normuon.ns_coefficients) + ", " + std::to_string(g.normuon.ns_steps) +
                       " steps)";

  const bool counting = allocation_counting_active();
  std::printf("normuon bench: %s (%zu parameters, %s floats: %s on NorMuon in %zu shape buckets, %s on AdamW)\n",
              model.c_str(), layout.entries.size(), with_commas(normuon_params + adamw_params).c_str(),
              with_commas(normuon_params).c_str(), layout.buckets.size(), with_commas(adamw_params).c_str());
  std::printf("machine: %s, %d processors; threads %d (reference: at::get_num_threads() = %d; fast: %d)\n",
              cpu_model().c_str(), omp_get_num_procs(), threads, at::get_num_threads(), fast.threads());
  std::printf("run: %s; warm-up %lld, repeats %lld, interleaved reference/fast; Newton-Schulz %s\n",
              utc_now().c_str(), warmup, repeats, ns_precisions.empty() ? "unused" : ns_precisions.c_str());
  const std::string load_before = load_average();
  if (!quiet) std::fputs(fast.describe().c_str(), stdout);
  std::fflush(stdout);

  StreamingTriad triad(adamw_params, threads);  // sized like the AdamW region

  auto feed = [&](int64_t step) {  // the same gradients into both states
    generator.fill_gradients(ref_state, step);
    std::copy(ref_state.grads.data(), ref_state.grads.data() + ref_state.grads.size(), fast_state.grads.data());
    fast_state.has_grad = ref_state.has_grad;
  };
  auto timed_step = [&](Backend& backend, FlatState& state) {
    StepSample s;
    const uint64_t allocs0 = allocation_count();
    const double cpu0 = process_cpu_ms();
    const auto t0 = Clock::now();
    const StepResult result = backend.step(state, options);
    const auto t1 = Clock::now();
    s.cpu_ms = process_cpu_ms() - cpu0;
    s.allocations = static_cast<double>(allocation_count() - allocs0);
    if (result.skipped) throw std::runtime_error(backend.name() + ": " + result.reason);
    s.wall_ms = ms_between(t0, t1);
    s.phases = backend.phase_times();
    return s;
  };

  std::vector<StepSample> ref_samples, fast_samples;
  std::vector<double> triad_ms;  // per measured step, right after the fast step
  const int64_t timed_steps = warmup + repeats;
  for (int64_t i = 0; i < timed_steps; ++i) {
    const int64_t step = i + 1;
    feed(step);
    const StepSample r = timed_step(reference, ref_state);
    const StepSample f = timed_step(fast, fast_state);
    const double t = triad.best_ms();
    const bool measured = i >= warmup;
    if (measured) {
      ref_samples.push_back(r);
      fast_samples.push_back(f);
      triad_ms.push_back(t);
    }
    if (!quiet)
      std::printf("step %lld (%s): reference %.3f ms, fast %.3f ms; triad %.3f ms\n", static_cast<long long>(step),
                  measured ? "measured" : "warm-up", r.wall_ms, f.wall_ms, t);
  }
  std::fflush(stdout);

  // One more step of each, not timed: the ATen operator count (the callback slows the reference down).
  feed(timed_steps + 1);
  {
    const OpCounter op_counter;
    reference.step(ref_state, options);
  }
  const int64_t ops_top = g_ops_top.load(), ops_total = g_ops_total.load();
  fast.step(fast_state, options);
  const FastStepCounters fast_counters = fast.counters();

  // oneDNN's allocations in one Newton-Schulz pass over the fast backend's batches (after one untimed
  // pass). The inputs are this step's gradients of the NorMuon matrices, orthogonalised in place: the
  // gradients are not used again.
  double onednn_allocs = std::numeric_limits<double>::quiet_NaN();
  int64_t onednn_gemms = 0;
  if (probe) {
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    int64_t gemm0 = 0;
    uint64_t allocs0 = 0;
    std::vector<const float*> in;
    std::vector<float*> out;
    for (int pass = 0; pass < 2; ++pass) {
      if (pass == 1) {
        gemm0 = probe->gemm_calls();
        allocs0 = allocation_count();
      }
      for (size_t b = 0; b < probe_batches.size(); ++b) {
        in.clear();
        out.clear();
        for (int e : probe_batches[b].entries) {
          in.push_back(fast_state.grad(e));
          out.push_back(fast_state.grad(e));
        }
        probe->run(static_cast<int>(b), in.data(), out.data(), options.groups[probe_batches[b].group].normuon);
      }
    }
    onednn_allocs = static_cast<double>(allocation_count() - allocs0);
    onednn_gemms = probe->gemm_calls() - gemm0;
    omp_set_num_threads(saved);
  }


  // Sanity: both backends did the same work (`normuon compare` checks agreement properly).
  double max_param_diff = 0;
  for (int64_t i = 0; i < ref_state.params.size(); ++i)
    max_param_diff = std::max(max_param_diff, static_cast<double>(std::fabs(ref_state.params[i] - fast_state.params[i])));

  // The table.
  struct Row {
    std::string name, csv_name;
    Summary ref, fast;
  };
  std::vector<Row> rows;
  auto add_row = [&](const std::string& name, const std::string& csv_name, const std::vector<double>& r,
                     const std::vector<double>& f) { rows.push_back({name, csv_name, summarise(r), summarise(f)}); };
  add_row("momentum", "momentum", phase_series(ref_samples, &PhaseTimes::momentum),
          phase_series(fast_samples, &PhaseTimes::momentum));
  add_row("Newton-Schulz", "newton_schulz", phase_series(ref_samples, &PhaseTimes::newton_schulz),
          phase_series(fast_samples, &PhaseTimes::newton_schulz));
  add_row("normalisation", "normalisation", phase_series(ref_samples, &PhaseTimes::normalisation),
          phase_series(fast_samples, &PhaseTimes::normalisation));
  add_row("update", "update", phase_series(ref_samples, &PhaseTimes::update),
          phase_series(fast_samples, &PhaseTimes::update));
  add_row("AdamW", "adamw", phase_series(ref_samples, &PhaseTimes::adamw), phase_series(fast_samples, &PhaseTimes::adamw));
  add_row("other", "other", other_series(ref_samples), other_series(fast_samples));
  add_row("total (timers)", "total", phase_series(ref_samples, &PhaseTimes::total),
          phase_series(fast_samples, &PhaseTimes::total));
  std::vector<double> ref_wall, fast_wall, ref_cpu, fast_cpu, ref_allocs, fast_allocs;
  for (const auto& s : ref_samples) {
    ref_wall.push_back(s.wall_ms);
    ref_cpu.push_back(s.cpu_ms);
    ref_allocs.push_back(s.allocations);
  }
  for (const auto& s : fast_samples) {
    fast_wall.push_back(s.wall_ms);
    fast_cpu.push_back(s.cpu_ms);
    fast_allocs.push_back(s.allocations);
  }
  add_row("whole step (CPU)", "whole_step_cpu", ref_cpu, fast_cpu);
  add_row("whole step (wall)", "whole_step", ref_wall, fast_wall);
  const Row& whole = rows.back();
  const Row& ns_row = rows[1];

  std::printf("\n%-18s | %-34s | %-34s | %s\n", "phase (ms)", "reference median [min - max]",
              "fast median [min - max]", "reference/fast");
  std::printf("%s\n", std::string(18 + 3 + 34 + 3 + 34 + 3 + 14, '-').c_str());
  for (const auto& r : rows)
    std::printf("%-18s | %34s | %34s | %14s\n", r.name.c_str(), ms_cell(r.ref).c_str(), ms_cell(r.fast).c_str(),
                ratio_cell(r.ref.median, r.fast.median).c_str());
  std::printf("(%lld measured steps each; \"other\": NaN/Inf check and bookkeeping outside the five phases;\n"
              " \"CPU\": CPU time of all the process's threads during the step, OpenMP spin-waits included)\n",
              repeats);

  const Summary ref_alloc = summarise(ref_allocs), fast_alloc = summarise(fast_allocs);
  std::printf("\nwork per step:\n");
  std::printf("  reference: %s ATen operator calls made by its code (%s dispatched in all, nested calls included)\n",
              with_commas(ops_top).c_str(), with_commas(ops_total).c_str());
  std::printf("  fast:      %lld elementwise passes, %lld GEMM calls\n",
              static_cast<long long>(fast_counters.elementwise_passes), static_cast<long long>(fast_counters.gemm_calls));
  std::printf("allocations per step (malloc-family calls, all threads; median [min - max]):\n");
  if (!counting) {
    std::printf("  not measured: the malloc interposition is not in effect in this build\n");
  } else {
    std::printf("  reference: %s [%s - %s]\n", with_commas(static_cast<int64_t>(ref_alloc.median)).c_str(),
                with_commas(static_cast<int64_t>(ref_alloc.min)).c_str(),
                with_commas(static_cast<int64_t>(ref_alloc.max)).c_str());
    std::printf("  fast:      %s [%s - %s]", with_commas(static_cast<int64_t>(fast_alloc.median)).c_str(),
                with_commas(static_cast<int64_t>(fast_alloc.min)).c_str(),
                with_commas(static_cast<int64_t>(fast_alloc.max)).c_str());
    if (std::isnan(onednn_allocs) || onednn_gemms != fast_counters.gemm_calls) {
      std::printf(" (%lld GEMM calls)\n", static_cast<long long>(fast_counters.gemm_calls));
    } else {
      std::printf("\n             of which oneDNN's execute(): %.0f (the same Newton-Schulz batches run outside the "
                  "step: %lld GEMM calls, %.2f each);\n             the rest of the step: %.0f\n",
                  onednn_allocs, static_cast<long long>(onednn_gemms),
                  onednn_allocs / static_cast<double>(std::max<int64_t>(onednn_gemms, 1)), fast_alloc.median - onednn_allocs);
    }
  }

  // Bandwidths per measured step: the AdamW pass and the triad run right after it. The bar compares like
  // with like, memory traffic (the triad's 16 bytes per element) against the AdamW pass's 28 bytes per
  // parameter, step by step; the STREAM-counted share is printed alongside.
  std::vector<double> adamw_gbps_v, triad_traffic_v, triad_stream_v, share_v, share_stream_v;
  for (size_t i = 0; i < fast_samples.size(); ++i) {
    const double ms = fast_samples[i].phases.adamw;
    const double gbps = ms > 0 ? 28.0 * static_cast<double>(adamw_params) / (ms * 1e-3) / 1e9 : 0;
    adamw_gbps_v.push_back(gbps);
    triad_traffic_v.push_back(triad.traffic_gbps(triad_ms[i]));
    triad_stream_v.push_back(triad.stream_gbps(triad_ms[i]));
    share_v.push_back(gbps / triad_traffic_v.back());
    share_stream_v.push_back(gbps / triad_stream_v.back());
  }
  const Summary adamw_gbps = summarise(adamw_gbps_v), triad_traffic = summarise(triad_traffic_v),
                triad_stream = summarise(triad_stream_v), share = summarise(share_v),
                share_stream = summarise(share_stream_v);
  const double adamw_share = share.median;
  std::printf("\nbandwidth and throughput (%d thread%s; median [min - max] over the measured steps):\n", threads,
              threads == 1 ? "" : "s");
  std::printf("  streaming triad a = b + s*c over %s floats, best of %d runs after each fast step:\n"
              "    %.1f GB/s [%.1f - %.1f] of memory traffic (16 bytes per element, write-allocate included);\n"
              "    %.1f GB/s [%.1f - %.1f] as STREAM counts it (12 bytes per element)\n",
              with_commas(triad.size()).c_str(), triad.runs(), triad_traffic.median, triad_traffic.min,
              triad_traffic.max, triad_stream.median, triad_stream.min, triad_stream.max);
  std::printf("  fused AdamW pass: %s parameters x 28 bytes per AdamW phase time: %.1f GB/s [%.1f - %.1f]\n"
              "    = %.0f%% [%.0f%% - %.0f%%] of the triad's traffic in the same step (%.0f%% of its STREAM-counted "
              "figure)\n",
              with_commas(adamw_params).c_str(), adamw_gbps.median, adamw_gbps.min, adamw_gbps.max, 100 * share.median,
              100 * share.min, 100 * share.max, 100 * share_stream.median);
  if (ns_flops > 0)
    std::printf("  Newton-Schulz: %.2f GFLOP per step; fast %.1f GFLOP/s, reference %.1f GFLOP/s\n", ns_flops / 1e9,
                ns_row.fast.median > 0 ? ns_flops / (ns_row.fast.median * 1e-3) / 1e9 : 0,
                ns_row.ref.median > 0 ? ns_flops / (ns_row.ref.median * 1e-3) / 1e9 : 0);
  std::printf("  after %lld steps the two states' parameters differ by at most %.3g (normuon compare checks them)\n",
              static_cast<long long>(timed_steps + 1), max_param_diff);

  std::printf("  load average (1, 5, 15 min) before the run: %s; after: %s\n", load_before.c_str(),
              load_average().c_str());

  const double speedup = whole.fast.median > 0 ? whole.ref.median / whole.fast.median : 0;
  std::printf("\nwhole step: fast is %.2fx faster than the reference (bar 3x: %s)\n", speedup,
              speedup >= 3 ? "met" : "NOT met");
  std::printf("fused AdamW: %.0f%% of triad bandwidth (bar 60%%: %s)\n", 100 * adamw_share,
              adamw_share >= 0.6 ? "met" : "NOT met");

  if (a.has("csv")) {
    const std::string path = a.get("csv", "");
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    if (!out) throw std::runtime_error("cannot write " + path);
    const std::string prefix = csv_field(model) + "," + std::to_string(threads) + ",";
    const std::string n = std::to_string(repeats);
    auto row = [&](const std::string& backend, const std::string& metric, const std::string& unit, double median,
                   double lo, double hi, const std::string& samples) {
      out << prefix << backend << ',' << metric << ',' << unit << ',' << format("%.6g", median) << ','
          << format("%.6g", lo) << ',' << format("%.6g", hi) << ',' << samples << '\n';
    };
    out << "model,threads,backend,metric,unit,median,min,max,samples\n";
    for (const auto& r : rows) {
      row("reference", r.csv_name, "ms", r.ref.median, r.ref.min, r.ref.max, n);
      row("fast", r.csv_name, "ms", r.fast.median, r.fast.min, r.fast.max, n);
    }
    if (counting) {
      row("reference", "allocations", "count", ref_alloc.median, ref_alloc.min, ref_alloc.max, n);
      row("fast", "allocations", "count", fast_alloc.median, fast_alloc.min, fast_alloc.max, n);
      if (!std::isnan(onednn_allocs))
        row("fast", "onednn_allocations_newton_schulz", "count", onednn_allocs, onednn_allocs, onednn_allocs, "1");
    }
    const double top = static_cast<double>(ops_top), all = static_cast<double>(ops_total);
    row("reference", "aten_ops_top_level", "count", top, top, top, "1");
    row("reference", "aten_ops_dispatched", "count", all, all, all, "1");
    const double passes = static_cast<double>(fast_counters.elementwise_passes);
    const double gemms = static_cast<double>(fast_counters.gemm_calls);
    row("fast", "elementwise_passes", "count", passes, passes, passes, "1");
    row("fast", "gemm_calls", "count", gemms, gemms, gemms, "1");
    row("machine", "triad_traffic_bandwidth", "GB/s", triad_traffic.median, triad_traffic.min, triad_traffic.max, n);
    row("machine", "triad_stream_bandwidth", "GB/s", triad_stream.median, triad_stream.min, triad_stream.max, n);
    row("fast", "adamw_bandwidth", "GB/s", adamw_gbps.median, adamw_gbps.min, adamw_gbps.max, n);
    row("fast", "adamw_share_of_triad_traffic", "%", 100 * share.median, 100 * share.min, 100 * share.max, n);
    if (ns_flops > 0) {
      auto gflops = [&](double ms) { return ms > 0 ? ns_flops / (ms * 1e-3) / 1e9 : 0; };
      row("reference", "newton_schulz_throughput", "GFLOP/s", gflops(ns_row.ref.median), gflops(ns_row.ref.max),
          gflops(ns_row.ref.min), n);
      row("fast", "newton_schulz_throughput", "GFLOP/s", gflops(ns_row.fast.median), gflops(ns_row.fast.max),
          gflops(ns_row.fast.min), n);
    }
    row("fast/reference", "whole_step_speedup", "x", speedup, speedup, speedup, n);
    out.flush();
    if (!out) throw std::runtime_error("write failed: " + path);
    std::printf("wrote %s\n", path.c_str());
  }
  return 0;
#endif
}

}  // namespace normuon::cli
