// `normuon compare`: the cross-check of the fast backend against the reference (compare/comparator.h).
#include "commands.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <stdexcept>

#include "args.h"
#include "model_args.h"
#include "comparator.h"
#include "normuon/grad_gen.h"
#include "normuon/layout.h"
#include "normuon/manifest.h"
#include "normuon/presets.h"
#include "reference_backend.h"
#include "selector.h"

namespace normuon::cli {

int compare_command(const Argv& argv) {
  const Args a(argv,
               {"preset", "manifest", "steps", "seed", "missing-grad-period", "set", "mode", "csv", "progress-every",
                "candidate", "tolerance-scale", "device"},
               {"quiet"});
  if (a.help()) {
    std::puts(R"(usage: normuon compare [--preset NAME | --manifest FILE] [--steps N] [--seed S]
                       [--missing-grad-period K] [--set KEY=VALUE]... [--mode resync|free]
                       [--csv FILE] [--progress-every N] [--quiet]
                       [--candidate fast|reference] [--device cpu|cuda] [--tolerance-scale F]

Cross-checks the fast backend against the reference: both start from the same parameters (default: the
tiny preset), get the same deterministic gradients every step (default 50 steps, seed 1234, each
parameter missing its gradient one step in 7), and after every step every parameter and every state
tensor (momentum, row_var, exp_avg, exp_avg_sq) is compared: max abs error, max relative error, ULP
distance and norm-wise error ||fast - ref|| / ||ref||.

--mode resync (default) copies the reference's parameters and state into the fast backend's state after
each check, so each step is judged from identical inputs and errors do not compound; --mode free lets
both run on their own and reports the drift (NorMuon parameters: relative to the distance travelled).

Tolerances (docs/compare.md): momentum and every AdamW tensor exact; NorMuon parameters (error relative
to the reference's update) and row_var (norm-wise) within bounds that depend on normuon.ns_precision:
bf16 0.1 and 0.05, fp32 0.01 and 0.01.
--tolerance-scale multiplies the non-exact bounds. --csv writes per step and tensor errors.
--candidate reference cross-checks the reference against itself (determinism).
--device cuda runs the candidate on the GPU (fast-cuda or reference-cuda) against the CPU reference.
reference-cuda is torch's CUDA kernels, a few ULP off the spec's AdamW: its AdamW parameters and exp_avg_sq
are held to normwise <= 1e-6 instead of bit equality (fast-cuda stays exact).
Prints the first divergence beyond tolerance (step, parameter, tensor, element, both values);
exit status 1 when the check fails.)");
    return 0;
  }
  const Manifest manifest = model_manifest(a);
  const GradientGenerator generator{static_cast<uint64_t>(a.get_int("seed", 1234)),
                                    static_cast<int>(a.get_int("missing-grad-period", 7))};
  const int64_t steps = a.get_int("steps", 50);
  if (steps < 0) throw std::invalid_argument("--steps must be >= 0");
  const CompareMode mode = parse_compare_mode(a.get("mode", "resync"));
  Options options;
  if (!apply_sets(a, options)) return 0;
  const Layout layout = Layout::build(manifest, options);
  const bool quiet = a.flag("quiet");

  // The candidate first: the fast backend sizes its threads before anything touches libtorch.
  const BackendChoice choice = parse_backend_choice(a.get("candidate", "fast"), "--candidate");
  if (choice == BackendChoice::automatic) throw std::invalid_argument("--candidate: name fast or reference");
  const DeviceChoice device = parse_device_choice(a.get("device", "cpu"), "--device");
  std::unique_ptr<Backend> candidate = make_backend(choice, layout, options, device);
  ReferenceBackend reference;

  FlatState ref_state(layout), cand_state(layout);
  generator.fill_params(ref_state);
  Comparator::sync(ref_state, cand_state);

  Comparator comparator(layout, options, generator, mode);
  if (choice == BackendChoice::reference && device == DeviceChoice::cuda) {  // torch's CUDA AdamW rounding
    Tolerances t = comparator.tolerances();
    relax_for_torch_cuda_kernels(t);
    comparator.set_tolerances(t);
  }
  if (a.has("tolerance-scale")) {
    const double f = a.get_double("tolerance-scale", 1.0);
    if (!(f > 0)) throw std::invalid_argument("--tolerance-scale must be > 0");
    Tolerances t = comparator.tolerances();
    t.scale(f);
    comparator.set_tolerances(t);
  }
  std::ofstream csv;
  if (a.has("csv")) {
    csv.open(a.get("csv", ""), std::ios::binary | std::ios::trunc);
    if (!csv) throw std::runtime_error("cannot write " + a.get("csv", ""));
    write_errors_csv_header(csv);
  }
  if (!quiet)
    std::printf("compare: %s vs %s, %lld parameters (%zu NorMuon, %zu AdamW), %lld steps, mode %s, layout %s\n",
                candidate->name().c_str(), reference.name().c_str(), static_cast<long long>(layout.entries.size()),
                layout.entries.size() - layout.adamw_entries.size(), layout.adamw_entries.size(),
                static_cast<long long>(steps), to_string(mode), layout.fingerprint_hex().c_str());

  const int64_t every = a.get_int("progress-every", steps <= 50 ? 1 : std::max<int64_t>(1, steps / 20));
  if (every < 1) throw std::invalid_argument("--progress-every must be >= 1");
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t step = 1; step <= steps; ++step) {
    const StepReport report = comparator.step(reference, ref_state, *candidate, cand_state, step);
    if (csv.is_open()) write_errors_csv_rows(csv, report.records);
    if (!quiet && (step % every == 0 || step == steps || !report.ok())) std::printf("%s\n", step_line(report).c_str());
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (csv.is_open()) {
    csv.flush();
    if (!csv) throw std::runtime_error("write failed: " + a.get("csv", ""));
  }
  const RunSummary& summary = comparator.summary();
  if (!quiet) std::printf("%s", summary_table(summary).c_str());
  std::printf("%s (%.2f s)\n", verdict_line(summary).c_str(), seconds);
  return summary.passed() ? 0 : 1;
}

}  // namespace normuon::cli
