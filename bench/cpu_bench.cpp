#include "cpu_bench.h"

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <stdexcept>

#include "alloc_counter.h"
#include "busy_process.h"
#include "machine_info.h"
#include "normuon/grad_gen.h"
#include "normuon/ns_algorithm.h"
#include "op_counter.h"
#include "reference_backend.h"
#include "streaming_triad.h"

// Defined by the build where the fast backend is built. (Not __has_include: the bench's include path holds
// fast/ for multiversion.h whether or not the backend is built, so its header is always found.)
#ifdef NORMUON_HAVE_FAST_CPU
#include "fast_cpu_backend.h"
#include "newton_schulz.h"
#include "thread_budget.h"
#include "work_pool.h"
#endif

namespace normuon::bench {
namespace {

// GFLOP/s of `flops` done in `ms`; 0 without a time.
double gflop_per_s(double flops, double ms) { return ms > 0 ? flops / (ms * 1e-3) / 1e9 : 0; }

}  // namespace

std::string cpu_bench_unavailable_reason() {
#ifdef NORMUON_HAVE_FAST_CPU
  return "";
#else
  return "this build has no fast backend (configured with -DNORMUON_BUILD_FAST_CPU=OFF): nothing to compare the "
         "reference with";
#endif
}

CpuBenchResult run_cpu_bench(const Layout& layout, const Options& options, const CpuBenchConfig& config,
                             Transcript& log) {
#ifndef NORMUON_HAVE_FAST_CPU
  (void)layout, (void)options, (void)config, (void)log;
  throw std::runtime_error(cpu_bench_unavailable_reason());
#else
  using Clock = std::chrono::steady_clock;
  if (config.warmup < 0 || config.repeats < 1 || config.threads < 0)
    throw std::invalid_argument("run_cpu_bench: needs warmup >= 0, repeats >= 1 and threads >= 0");
  CpuBenchResult r;
  r.model = config.model;
  r.threads = config.threads > 0 ? config.threads : fast::default_threads();
  r.repeats = config.repeats;
  const int threads = r.threads;
  const GradientGenerator generator{config.seed, 0};
  Options fast_options = options;  // the reference's, or with another Newton-Schulz algorithm
  if (config.fast_ns_algorithm)
    for (auto& g : fast_options.groups) g.normuon.ns_algorithm = *config.fast_ns_algorithm;
  r.reference_ns = ns_algorithms_of(layout, options);
  r.fast_ns = ns_algorithms_of(layout, fast_options);

  // The fast backend (and the oneDNN probe below) first, before any libtorch call.
  FastCpuBackend fast(layout, fast_options, threads);
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
  // On a pool of the same threads, so that each batch is split as the step splits it.
  fast::WorkPool probe_pool(threads);
  std::unique_ptr<fast::BatchedNewtonSchulz> probe;
  if (!probe_shapes.empty()) probe = std::make_unique<fast::BatchedNewtonSchulz>(probe_shapes, probe_pool);

  at::set_num_threads(threads);
  ReferenceBackend reference;
  reference.set_timing(true);
  fast.set_timing(true);

  FlatState ref_state(layout);
  generator.fill_params(ref_state);
  FlatState fast_state = ref_state;

  int64_t normuon_params = 0;
  for (const auto& e : layout.entries) {
    if (e.algorithm == Algorithm::adamw) {
      r.adamw_params += e.numel;
      continue;
    }
    normuon_params += e.numel;
    // Every NorMuon matrix, every step: the bench never leaves a gradient out.
    const NorMuonHyper& h = options.groups[e.group].normuon;
    r.ns_flops += ns_standard_dense_flops(e.rows, e.cols, h.ns_steps);
    r.ns_reference_flops += ns_dense_flops(h.ns_algorithm, e.rows, e.cols, h.ns_steps);
    r.reference_gram_matrices += ns_uses_gram(h.ns_algorithm, e.rows, e.cols);
    r.fast_gram_matrices += ns_uses_gram(fast_options.groups[e.group].normuon.ns_algorithm, e.rows, e.cols);
  }
  std::string ns_precisions;
  for (const auto& g : options.groups)
    if (g.algorithm == Algorithm::normuon)
      ns_precisions += (ns_precisions.empty() ? "" : ", ") + g.name + ": " + to_string(g.normuon.ns_algorithm) +
                       " " + to_string(g.normuon.ns_precision) + " (" + to_string(g.normuon.ns_coefficients) + ", " +
                       std::to_string(g.normuon.ns_steps) + " steps)";
  if (!r.same_algorithms() && !ns_precisions.empty())
    ns_precisions += "; the fast backend runs " + r.fast_ns + " instead";

  r.allocations_counted = allocation_counting_active();
  log.say("normuon bench: %s (%zu parameters, %s floats: %s on NorMuon in %zu shape buckets, %s on AdamW)\n",
          r.model.c_str(), layout.entries.size(), with_commas(normuon_params + r.adamw_params).c_str(),
          with_commas(normuon_params).c_str(), layout.buckets.size(), with_commas(r.adamw_params).c_str());
  log.say("machine: %s, %d processors; threads %d (reference: at::get_num_threads() = %d; fast: %d)\n",
          cpu_model().c_str(), omp_get_num_procs(), threads, at::get_num_threads(), fast.threads());
  log.say("run: %s; warm-up %lld, repeats %lld, interleaved reference/fast; Newton-Schulz %s\n", utc_now().c_str(),
          static_cast<long long>(config.warmup), static_cast<long long>(config.repeats),
          ns_precisions.empty() ? "unused" : ns_precisions.c_str());
  r.load_before = load_average();
  if (!config.quiet) log.say("%s", fast.describe().c_str());

  StreamingTriad triad(r.adamw_params, threads);  // sized like the AdamW region
  r.triad_floats = triad.size();
  r.triad_runs = triad.runs();

  auto feed = [&](int64_t step) {  // the same gradients into both states
    generator.fill_gradients(ref_state, step);
    std::copy(ref_state.grads.data(), ref_state.grads.data() + ref_state.grads.size(), fast_state.grads.data());
    fast_state.has_grad = ref_state.has_grad;
  };
  auto timed_step = [&](Backend& backend, FlatState& state, const Options& o) {
    CpuStepSample s;
    const uint64_t allocs0 = allocation_count();
    const double cpu0 = process_cpu_ms();
    const auto t0 = Clock::now();
    const StepResult result = backend.step(state, o);
    const auto t1 = Clock::now();
    s.cpu_ms = process_cpu_ms() - cpu0;
    s.allocations = static_cast<double>(allocation_count() - allocs0);
    if (result.skipped) throw std::runtime_error(backend.name() + ": " + result.reason);
    s.wall_ms = ms_between(t0, t1);
    s.phases = backend.phase_times();
    return s;
  };

  const int64_t timed_steps = config.warmup + config.repeats;
  for (int64_t i = 0; i < timed_steps; ++i) {
    const int64_t step = i + 1;
    feed(step);
    const CpuStepSample ref_sample = timed_step(reference, ref_state, options);
    const CpuStepSample fast_sample = timed_step(fast, fast_state, fast_options);
    const double t = triad.best_ms();
    const bool measured = i >= config.warmup;
    if (measured) {
      r.reference.push_back(ref_sample);
      r.fast.push_back(fast_sample);
      r.triad_ms.push_back(t);
    }
    if (!config.quiet)
      log.say("step %lld (%s): reference %.3f ms, fast %.3f ms; triad %.3f ms\n", static_cast<long long>(step),
              measured ? "measured" : "warm-up", ref_sample.wall_ms, fast_sample.wall_ms, t);
  }

  // One more step of each, not timed: the ATen operator count (the callback slows the reference down).
  feed(timed_steps + 1);
  r.steps = timed_steps + 1;
  {
    const AtenOpCounter op_counter;
    reference.step(ref_state, options);
    r.aten_ops_top_level = op_counter.top_level();
    r.aten_ops_dispatched = op_counter.dispatched();
  }
  fast.step(fast_state, fast_options);
  r.elementwise_passes = fast.counters().elementwise_passes;
  r.gemm_calls = fast.counters().gemm_calls;

  // oneDNN's allocations in one Newton-Schulz pass over the fast backend's batches (after one untimed
  // pass). The inputs are this step's gradients of the NorMuon matrices, orthogonalised in place: the
  // gradients are not used again.
  if (probe) {
    std::vector<std::vector<const float*>> in(probe_batches.size());
    std::vector<std::vector<float*>> out(probe_batches.size());
    for (size_t b = 0; b < probe_batches.size(); ++b)
      for (int e : probe_batches[b].entries) {
        in[b].push_back(fast_state.grad(e));
        out[b].push_back(fast_state.grad(e));
      }
    std::vector<fast::NsWork> work(probe_batches.size());
    // One Newton-Schulz pass over every batch with options `o`, all batches in one run as the step runs
    // them (small batches may be shared out a matrix per thread together: ns_keeps_the_pool_busy).
    auto pass = [&](const Options& o) {
      for (size_t b = 0; b < probe_batches.size(); ++b)
        work[b] = {static_cast<int>(b), in[b].data(), out[b].data(), &o.groups[probe_batches[b].group].normuon};
      probe->run(work.data(), static_cast<int>(work.size()));
    };
    pass(fast_options);  // untimed
    const int64_t gemm0 = probe->gemm_calls();
    const uint64_t allocs0 = allocation_count();
    pass(fast_options);
    r.onednn_allocations = static_cast<double>(allocation_count() - allocs0);
    r.onednn_gemm_calls = probe->gemm_calls() - gemm0;

    // Newton-Schulz alone, each algorithm, on the same batches: its time and what it computes.
    for (NsAlgorithm algorithm : {NsAlgorithm::standard, NsAlgorithm::gram}) {
      Options o = fast_options;
      for (auto& g : o.groups) g.normuon.ns_algorithm = algorithm;
      CpuBenchResult::NsAlone alone;
      alone.algorithm = to_string(algorithm);
      pass(o);  // warm-up
      for (int64_t i = 0; i < config.repeats; ++i) {
        const double macs0 = probe->multiply_adds();
        const auto t0 = Clock::now();
        pass(o);
        alone.ms.push_back(ms_between(t0, Clock::now()));
        alone.actual_flops = 2 * (probe->multiply_adds() - macs0);
      }
      const auto& groups = fast_options.groups;
      const bool as_the_step = std::all_of(groups.begin(), groups.end(), [&](const GroupOptions& g) {
        return g.algorithm != Algorithm::normuon || g.normuon.ns_algorithm == algorithm;
      });
      if (as_the_step) r.ns_fast_flops = alone.actual_flops;
      r.ns_alone.push_back(std::move(alone));
    }
  }

  // Under contention: a busy process beside the run (a shared machine). The run's threads and one
  // thread, on copies of the state, fed the same gradients; one untimed step each first.
  {
    FlatState crowded = fast_state, single = fast_state;
    FastCpuBackend one_thread(layout, fast_options, 1);
    const BusyProcess busy;
    for (int64_t i = 0; i <= config.repeats; ++i) {
      generator.fill_gradients(crowded, timed_steps + 2 + i);
      std::copy(crowded.grads.data(), crowded.grads.data() + crowded.grads.size(), single.grads.data());
      single.has_grad = crowded.has_grad;
      const double many = timed_step(fast, crowded, fast_options).wall_ms,
                   one = timed_step(one_thread, single, fast_options).wall_ms;
      if (i == 0) continue;
      r.contended_ms.push_back(many);
      r.contended_one_thread_ms.push_back(one);
    }
  }

  // Sanity: both backends did the same work (`normuon compare` checks agreement properly).
  for (int64_t i = 0; i < ref_state.params.size(); ++i)
    r.max_param_diff =
        std::max(r.max_param_diff, static_cast<double>(std::fabs(ref_state.params[i] - fast_state.params[i])));
  r.load_after = load_average();
  return r;
#endif
}

CpuBenchSummary summarise_cpu_bench(const CpuBenchResult& r) {
  CpuBenchSummary s;
  auto add_row = [&](const std::string& name, const std::string& csv_name, auto value) {
    std::vector<double> ref, fast;
    for (const auto& x : r.reference) ref.push_back(value(x));
    for (const auto& x : r.fast) fast.push_back(value(x));
    s.rows.push_back({name, csv_name, summarise(ref), summarise(fast)});
  };
  add_row("momentum", "momentum", [](const CpuStepSample& x) { return x.phases.momentum; });
  add_row("Newton-Schulz", "newton_schulz", [](const CpuStepSample& x) { return x.phases.newton_schulz; });
  add_row("normalisation", "normalisation", [](const CpuStepSample& x) { return x.phases.normalisation; });
  add_row("update", "update", [](const CpuStepSample& x) { return x.phases.update; });
  add_row("AdamW", "adamw", [](const CpuStepSample& x) { return x.phases.adamw; });
  add_row("other", "other", [](const CpuStepSample& x) { return other_ms(x.phases); });
  add_row("total (timers)", "total", [](const CpuStepSample& x) { return x.phases.total; });
  add_row("whole step (CPU)", "whole_step_cpu", [](const CpuStepSample& x) { return x.cpu_ms; });
  add_row("whole step (wall)", "whole_step", [](const CpuStepSample& x) { return x.wall_ms; });

  std::vector<double> ref_allocs, fast_allocs;
  for (const auto& x : r.reference) ref_allocs.push_back(x.allocations);
  for (const auto& x : r.fast) fast_allocs.push_back(x.allocations);
  s.reference_allocations = summarise(ref_allocs);
  s.fast_allocations = summarise(fast_allocs);

  // Bandwidths per measured step: the AdamW pass and the triad run right after it. The bar compares like
  // with like, memory traffic (the triad's 16 bytes per element) against the AdamW pass's 28 bytes per
  // parameter, step by step; the STREAM-counted share is reported alongside.
  std::vector<double> adamw_gbps, triad_traffic, triad_stream, share, share_stream;
  for (size_t i = 0; i < r.fast.size() && i < r.triad_ms.size(); ++i) {
    const double ms = r.fast[i].phases.adamw;
    const double gbps = ms > 0 ? 28.0 * static_cast<double>(r.adamw_params) / (ms * 1e-3) / 1e9 : 0;
    adamw_gbps.push_back(gbps);
    triad_traffic.push_back(StreamingTriad::traffic_gbps(r.triad_floats, r.triad_ms[i]));
    triad_stream.push_back(StreamingTriad::stream_gbps(r.triad_floats, r.triad_ms[i]));
    share.push_back(gbps / triad_traffic.back());
    share_stream.push_back(gbps / triad_stream.back());
  }
  s.adamw_gbps = summarise(adamw_gbps);
  s.triad_traffic_gbps = summarise(triad_traffic);
  s.triad_stream_gbps = summarise(triad_stream);
  s.adamw_share = summarise(share);
  s.adamw_share_stream = summarise(share_stream);
  const CpuPhaseRow& whole = s.whole_step();
  s.speedup = whole.fast.median > 0 ? whole.reference.median / whole.fast.median : 0;
  s.contended = summarise(r.contended_ms);
  s.contended_one_thread = summarise(r.contended_one_thread_ms);
  return s;
}

void print_cpu_bench(const CpuBenchResult& r, Transcript& log) {
  const CpuBenchSummary s = summarise_cpu_bench(r);
  log.say("\n%-18s | %-34s | %-34s | %s\n", "phase (ms)", "reference median [min - max]", "fast median [min - max]",
          "reference/fast");
  log.say("%s\n", std::string(18 + 3 + 34 + 3 + 34 + 3 + 14, '-').c_str());
  for (const auto& row : s.rows)
    log.say("%-18s | %34s | %34s | %14s\n", row.name.c_str(), ms_cell(row.reference).c_str(), ms_cell(row.fast).c_str(),
            ratio_cell(row.reference.median, row.fast.median).c_str());
  log.say("(%lld measured steps each; \"other\": NaN/Inf check and bookkeeping outside the five phases;\n"
          " \"CPU\": CPU time of all the process's threads during the step, OpenMP spin-waits included)\n",
          static_cast<long long>(r.repeats));

  const Summary& ref_alloc = s.reference_allocations;
  const Summary& fast_alloc = s.fast_allocations;
  log.say("\nwork per step:\n");
  log.say("  reference: %s ATen operator calls made by its code (%s dispatched in all, nested calls included)\n",
          with_commas(r.aten_ops_top_level).c_str(), with_commas(r.aten_ops_dispatched).c_str());
  log.say("  fast:      %lld elementwise passes, %lld GEMM calls\n", static_cast<long long>(r.elementwise_passes),
          static_cast<long long>(r.gemm_calls));
  log.say("allocations per step (malloc-family calls, all threads; median [min - max]):\n");
  if (!r.allocations_counted) {
    log.say("  not measured: the malloc interposition is not in effect in this build\n");
  } else {
    log.say("  reference: %s [%s - %s]\n", with_commas(static_cast<int64_t>(ref_alloc.median)).c_str(),
            with_commas(static_cast<int64_t>(ref_alloc.min)).c_str(),
            with_commas(static_cast<int64_t>(ref_alloc.max)).c_str());
    log.say("  fast:      %s [%s - %s]", with_commas(static_cast<int64_t>(fast_alloc.median)).c_str(),
            with_commas(static_cast<int64_t>(fast_alloc.min)).c_str(),
            with_commas(static_cast<int64_t>(fast_alloc.max)).c_str());
    if (std::isnan(r.onednn_allocations) || r.onednn_gemm_calls != r.gemm_calls) {
      log.say(" (%lld GEMM calls)\n", static_cast<long long>(r.gemm_calls));
    } else {
      log.say("\n             of which oneDNN's execute(): %.0f (the same Newton-Schulz batches run outside the "
              "step: %lld GEMM calls, %.2f each);\n             the rest of the step: %.0f\n",
              r.onednn_allocations, static_cast<long long>(r.onednn_gemm_calls),
              r.onednn_allocations / static_cast<double>(std::max<int64_t>(r.onednn_gemm_calls, 1)),
              fast_alloc.median - r.onednn_allocations);
    }
  }

  const Summary &triad_traffic = s.triad_traffic_gbps, &triad_stream = s.triad_stream_gbps;
  const Summary &adamw_gbps = s.adamw_gbps, &share = s.adamw_share;
  const CpuPhaseRow& ns_row = s.newton_schulz();
  log.say("\nbandwidth and throughput (%d thread%s; median [min - max] over the measured steps):\n", r.threads,
          r.threads == 1 ? "" : "s");
  log.say("  streaming triad a = b + s*c over %s floats, best of %d runs after each fast step:\n"
          "    %.1f GB/s [%.1f - %.1f] of memory traffic (16 bytes per element, write-allocate included);\n"
          "    %.1f GB/s [%.1f - %.1f] as STREAM counts it (12 bytes per element)\n",
          with_commas(r.triad_floats).c_str(), r.triad_runs, triad_traffic.median, triad_traffic.min,
          triad_traffic.max, triad_stream.median, triad_stream.min, triad_stream.max);
  log.say("  fused AdamW pass: %s parameters x 28 bytes per AdamW phase time: %.1f GB/s [%.1f - %.1f]\n"
          "    = %.0f%% [%.0f%% - %.0f%%] of the triad's traffic in the same step (%.0f%% of its STREAM-counted "
          "figure)\n",
          with_commas(r.adamw_params).c_str(), adamw_gbps.median, adamw_gbps.min, adamw_gbps.max, 100 * share.median,
          100 * share.min, 100 * share.max, 100 * s.adamw_share_stream.median);
  if (r.ns_flops > 0) {
    log.say("  Newton-Schulz in the step: useful %.2f GFLOP per step (the full dense standard iteration); the "
            "reference computes %.2f, fast %.2f\n"
            "    fast %.1f GFLOP/s useful, %.1f actual; reference %.1f useful, %.1f actual\n",
            r.ns_flops / 1e9, r.ns_reference_flops / 1e9, r.ns_fast_flops / 1e9,
            gflop_per_s(r.ns_flops, ns_row.fast.median), gflop_per_s(r.ns_fast_flops, ns_row.fast.median),
            gflop_per_s(r.ns_flops, ns_row.reference.median), gflop_per_s(r.ns_reference_flops, ns_row.reference.median));
    for (const auto& alone : r.ns_alone) {
      const Summary t = summarise(alone.ms);
      log.say("  Newton-Schulz alone, ns_algorithm=%s (fast, the step's batches): %.1f ms [%.1f - %.1f], %.2f GFLOP "
              "computed: %.1f GFLOP/s useful, %.1f actual\n",
              alone.algorithm.c_str(), t.median, t.min, t.max, alone.actual_flops / 1e9,
              gflop_per_s(r.ns_flops, t.median), gflop_per_s(alone.actual_flops, t.median));
    }
  }
  log.say("  after %lld steps the two states' parameters differ by at most %.3g (%s)\n",
          static_cast<long long>(r.steps), r.max_param_diff,
          r.same_algorithms() ? "normuon compare checks them" : "different Newton-Schulz algorithms: not comparable");
  log.say("  load average (1, 5, 15 min) before the run: %s; after: %s\n", r.load_before.c_str(),
          r.load_after.c_str());

  if (r.same_algorithms()) {
    log.say("\nwhole step: fast is %.2fx faster than the reference (bar 3x: %s)\n", s.speedup,
            s.speedup >= 3 ? "met" : "NOT met");
  } else {
    const bool gram_vs_standard = r.fast_ns == "gram" && r.reference_ns == "standard";
    log.say("\nwhole step: fast (ns_algorithm %s) is %.2fx faster than the reference (ns_algorithm %s)%s\n",
            r.fast_ns.c_str(), s.speedup, r.reference_ns.c_str(),
            gram_vs_standard ? (s.speedup >= 2.5 ? " (bar 2.5x: met)" : " (bar 2.5x: NOT met)") : "");
  }
  log.say("fused AdamW: %.0f%% of triad bandwidth (bar 60%%: %s)\n", 100 * share.median,
          share.median >= 0.6 ? "met" : "NOT met");
  if (s.contended.n > 0) {
    const double quiet = s.whole_step().fast.median;
    const double vs_quiet = quiet > 0 ? s.contended.median / quiet : 0;
    const double vs_one = s.contended_one_thread.median > 0 ? s.contended.median / s.contended_one_thread.median : 0;
    log.say("\nunder contention (one busy process beside the run): fast %s ms with %d thread%s, %s ms with one "
            "thread\n", ms_cell(s.contended).c_str(), r.threads, r.threads == 1 ? "" : "s",
            ms_cell(s.contended_one_thread).c_str());
    log.say("contended step: %.2fx the quiet step (bar 2x: %s); %.2fx the one-thread step under the same "
            "contention (bar 1x: %s)\n", vs_quiet, vs_quiet <= 2 ? "met" : "NOT met", vs_one,
            vs_one <= 1 ? "met" : "NOT met");
  }
}

void write_cpu_bench_csv(const CpuBenchResult& r, const std::string& path) {
  const CpuBenchSummary s = summarise_cpu_bench(r);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw std::runtime_error("cannot write " + path);
  const std::string prefix = csv_field(r.model) + "," + std::to_string(r.threads) + ",";
  const std::string n = std::to_string(r.repeats);
  auto row = [&](const std::string& backend, const std::string& metric, const std::string& unit, double median,
                 double lo, double hi, const std::string& samples) {
    out << prefix << backend << ',' << metric << ',' << unit << ',' << format("%.6g", median) << ','
        << format("%.6g", lo) << ',' << format("%.6g", hi) << ',' << samples << '\n';
  };
  out << "model,threads,backend,metric,unit,median,min,max,samples\n";
  for (const auto& p : s.rows) {
    row("reference", p.csv_name, "ms", p.reference.median, p.reference.min, p.reference.max, n);
    row("fast", p.csv_name, "ms", p.fast.median, p.fast.min, p.fast.max, n);
  }
  if (r.allocations_counted) {
    const Summary &ref_alloc = s.reference_allocations, &fast_alloc = s.fast_allocations;
    row("reference", "allocations", "count", ref_alloc.median, ref_alloc.min, ref_alloc.max, n);
    row("fast", "allocations", "count", fast_alloc.median, fast_alloc.min, fast_alloc.max, n);
    if (!std::isnan(r.onednn_allocations))
      row("fast", "onednn_allocations_newton_schulz", "count", r.onednn_allocations, r.onednn_allocations,
          r.onednn_allocations, "1");
  }
  const double top = static_cast<double>(r.aten_ops_top_level), all = static_cast<double>(r.aten_ops_dispatched);
  row("reference", "aten_ops_top_level", "count", top, top, top, "1");
  row("reference", "aten_ops_dispatched", "count", all, all, all, "1");
  const double passes = static_cast<double>(r.elementwise_passes), gemms = static_cast<double>(r.gemm_calls);
  row("fast", "elementwise_passes", "count", passes, passes, passes, "1");
  row("fast", "gemm_calls", "count", gemms, gemms, gemms, "1");
  const Summary &traffic = s.triad_traffic_gbps, &stream = s.triad_stream_gbps, &adamw = s.adamw_gbps,
                &share = s.adamw_share;
  row("machine", "triad_traffic_bandwidth", "GB/s", traffic.median, traffic.min, traffic.max, n);
  row("machine", "triad_stream_bandwidth", "GB/s", stream.median, stream.min, stream.max, n);
  row("fast", "adamw_bandwidth", "GB/s", adamw.median, adamw.min, adamw.max, n);
  row("fast", "adamw_share_of_triad_traffic", "%", 100 * share.median, 100 * share.min, 100 * share.max, n);
  if (r.ns_flops > 0) {
    // GFLOP/s of `flops` per step over the step times t: the fastest step has the highest rate, so min and
    // max swap.
    auto throughput = [&](const std::string& backend, const std::string& metric, double flops, const Summary& t,
                          const std::string& samples) {
      row(backend, metric, "GFLOP/s", gflop_per_s(flops, t.median), gflop_per_s(flops, t.max),
          gflop_per_s(flops, t.min), samples);
    };
    const CpuPhaseRow& ns = s.newton_schulz();
    throughput("reference", "newton_schulz_throughput", r.ns_flops, ns.reference, n);
    throughput("fast", "newton_schulz_throughput", r.ns_flops, ns.fast, n);
    // What each backend computes (the rows above count the useful, full standard iteration's FLOPs).
    throughput("reference", "newton_schulz_actual_throughput", r.ns_reference_flops, ns.reference, n);
    throughput("fast", "newton_schulz_actual_throughput", r.ns_fast_flops, ns.fast, n);
    for (const auto& alone : r.ns_alone) {
      const Summary t = summarise(alone.ms);
      const std::string metric = "ns_" + alone.algorithm + "_alone";
      const std::string k = std::to_string(alone.ms.size());
      row("fast", metric, "ms", t.median, t.min, t.max, k);
      throughput("fast", metric + "_useful_throughput", r.ns_flops, t, k);
      throughput("fast", metric + "_actual_throughput", alone.actual_flops, t, k);
    }
  }
  row("fast/reference", "whole_step_speedup", "x", s.speedup, s.speedup, s.speedup, n);
  // Which iteration each backend ran (--fast-ns-algorithm): its NorMuon matrices on Gram Newton-Schulz.
  const double ref_gram = static_cast<double>(r.reference_gram_matrices);
  const double fast_gram = static_cast<double>(r.fast_gram_matrices);
  row("reference", "ns_gram_matrices", "count", ref_gram, ref_gram, ref_gram, "1");
  row("fast", "ns_gram_matrices", "count", fast_gram, fast_gram, fast_gram, "1");
  if (s.contended.n > 0) {
    row("fast", "whole_step_contended", "ms", s.contended.median, s.contended.min, s.contended.max, n);
    row("fast_one_thread", "whole_step_contended", "ms", s.contended_one_thread.median, s.contended_one_thread.min,
        s.contended_one_thread.max, n);
  }
  out.flush();
  if (!out) throw std::runtime_error("write failed: " + path);
}

}  // namespace normuon::bench
