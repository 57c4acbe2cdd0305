#include "commands.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <stdexcept>

#include "args.h"
#include "model_args.h"
#include "normuon/grad_gen.h"
#include "normuon/layout.h"
#include "normuon/manifest.h"
#include "normuon/presets.h"
#include "normuon/state_file.h"
#include "selector.h"
#include "trace.h"

namespace normuon::cli {
namespace {

using Clock = std::chrono::steady_clock;

std::string default_golden_path() { return std::string(NORMUON_SOURCE_DIR) + "/golden/tiny.csv"; }

// The metadata key in which `normuon run --save` records its own step number: the step of the gradient
// generator, which group step counters can't give back (a group that got no gradient in a step, or a step
// skipped for a non-finite gradient, leaves them behind).
constexpr const char* kRunStepKey = "run_step";

// The step a resumed run continues after: the file's run_step, or for a file without one (saved by a
// version before it, or by another program) the largest group step, as those versions did.
int64_t resumed_run_step(const StateFileContents& file) {
  const std::vector<int64_t>& groups = file.header.group_steps;
  const int64_t largest_group_step = groups.empty() ? 0 : *std::max_element(groups.begin(), groups.end());
  const auto it = file.header.extra_metadata.find(kRunStepKey);
  if (it == file.header.extra_metadata.end()) {
    std::printf("note: %s has no run_step (an older file): resuming after its largest group step\n",
                file.path.c_str());
    return largest_group_step;
  }
  const std::string& text = it->second;
  if (text.empty() || text.size() > 18 || text.find_first_not_of("0123456789") != std::string::npos)
    throw std::invalid_argument("state file '" + file.path + "': metadata \"run_step\" is \"" + text +
                                "\", not a step number");
  const int64_t step = std::stoll(text);
  // A group advances at most once per step, so no group can be ahead of the run.
  if (step < largest_group_step)
    throw std::invalid_argument("state file '" + file.path + "': run_step " + text + " is below its group step " +
                                std::to_string(largest_group_step));
  return step;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int run_command(const Argv& argv) {
  const Args a(argv, {"preset", "manifest", "steps", "seed", "missing-grad-period", "set", "load", "save",
                      "progress-every", "backend", "device"},
               {"quiet"});
  if (a.help()) {
    std::puts(R"(usage: normuon run [--preset NAME | --manifest FILE] [--steps N] [--seed S]
                   [--missing-grad-period K] [--set KEY=VALUE]... [--load FILE] [--save FILE]
                   [--backend auto|fast|reference] [--device cpu|cuda] [--progress-every N] [--quiet]

Runs N optimizer steps (default 20) on a model (default: the tiny preset) with the backend chosen by
--backend, else the NORMUON_BACKEND environment variable, else auto (= the fast backend; a request it
can't serve is an error, never a silent switch to the reference), on the device chosen by --device,
else NORMUON_DEVICE, else cpu (cuda where there is no GPU is an error, not a switch to the CPU),
fed with deterministic synthetic gradients (seeded, counter-based: the same numbers on every machine,
thread count and backend). Prints the routing table summary, progress with per-step time, and a timing
summary. --load resumes from a state file (its hyper-parameters, then --set overrides) at the step after the one it
was saved at (its run_step); --save writes the final state atomically, and its path is checked before
the first step. --progress-every N prints every N-th step (N >= 1; default: every step up to 50 steps,
else every steps/20-th); --quiet prints no progress. Hyper-parameters: --set normuon.lr=0.01, --set weight_decay=0.1 (all
groups), --set nonfinite=skip_step; `normuon run --set help=1` lists every key.)");
    return 0;
  }
  const Manifest manifest = model_manifest(a);
  const GradientGenerator generator{static_cast<uint64_t>(a.get_int("seed", 1234)),
                                    static_cast<int>(a.get_int("missing-grad-period", 0))};
  const int64_t steps = a.get_int("steps", 20);
  if (steps < 0) throw std::invalid_argument("--steps must be >= 0");
  // 0 was a division by zero (SIGFPE) in the progress test below.
  const int64_t every = a.get_int("progress-every", steps <= 50 ? 1 : std::max<int64_t>(1, steps / 20));
  if (every < 1) throw std::invalid_argument("--progress-every must be >= 1 (use --quiet for no progress lines)");
  // A bad --save path fails now, not after every step has run.
  if (a.has("save")) check_state_save_path(a.get("save", ""));

  // One read of --load: the options and the tensors come from the same bytes, even if the file is being
  // replaced meanwhile (reading it twice could combine two versions).
  std::unique_ptr<StateFileContents> loaded;
  Options options;
  if (a.has("load")) {
    loaded = std::make_unique<StateFileContents>(read_state_file(a.get("load", "")));
    options = loaded->header.options;
  }
  if (!apply_sets(a, options)) return 0;
  const Layout layout = Layout::build(manifest, options);
  FlatState state(layout);
  int64_t first_step = 1;
  if (loaded) {
    load_state_file(*loaded, state);
    first_step = 1 + resumed_run_step(*loaded);
    std::printf("resumed from %s at step %lld\n", loaded->path.c_str(), static_cast<long long>(first_step - 1));
    loaded.reset();  // the file's bytes are no longer needed
  } else {
    generator.fill_params(state);
  }
  const std::unique_ptr<Backend> backend_ptr = make_backend(resolve_backend_choice(a.get("backend", "")), layout, options,
                                                              resolve_device_choice(a.get("device", "")));
  Backend& backend = *backend_ptr;
  const bool quiet = a.flag("quiet");
  if (!quiet) std::printf("%sbackend: %s\n", layout.describe().c_str(), backend.name().c_str());

  std::vector<double> step_ms;
  const auto run_start = Clock::now();
  int64_t skipped = 0;
  for (int64_t i = 0; i < steps; ++i) {
    const int64_t step = first_step + i;
    generator.fill_gradients(state, step);
    const auto t0 = Clock::now();
    const StepResult result = backend.step(state, options);
    step_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    if (result.skipped) {
      ++skipped;
      std::printf("step %lld: %s\n", static_cast<long long>(step), result.reason.c_str());
    }
    if (!quiet && ((i + 1) % every == 0 || i + 1 == steps))
      std::printf("step %lld/%lld  %.2f ms  (%s)\n", static_cast<long long>(step),
                  static_cast<long long>(first_step + steps - 1), step_ms.back(), backend.name().c_str());
  }
  const double total_s = std::chrono::duration<double>(Clock::now() - run_start).count();
  if (!step_ms.empty())
    std::printf("%lld steps (%lld skipped) in %.2f s; optimizer step median %.2f ms, min %.2f ms, max %.2f ms\n",
                static_cast<long long>(steps), static_cast<long long>(skipped), total_s, median(step_ms),
                *std::min_element(step_ms.begin(), step_ms.end()), *std::max_element(step_ms.begin(), step_ms.end()));
  if (a.has("save")) {
    save_state_with_metadata(a.get("save", ""), state, options, backend.name(),
                             {{kRunStepKey, std::to_string(first_step + steps - 1)}});
    std::printf("saved state to %s (layout %s)\n", a.get("save", "").c_str(), layout.fingerprint_hex().c_str());
  }
  return 0;
}

int golden_command(const Argv& argv) {
  const Args a(argv, {"file", "steps", "set", "rtol", "atol", "backend", "device"}, {"exact", "cross-platform"});
  const std::string action = a.positionals().empty() ? "" : a.positionals()[0];
  if (a.help() || (action != "make" && action != "verify") || a.positionals().size() != 1) {
    std::printf(R"(usage: normuon golden make|verify [--file PATH] [--steps N] [--set KEY=VALUE]...
                             [--rtol R] [--atol A] [--exact | --cross-platform]
                             [--backend reference|fast] [--device cpu|cuda]

make    runs the golden configuration with the reference backend and writes the trace CSV
        (default %s): the tiny preset, 20 steps, seed 1234, one parameter in 7 missing its
        gradient each step, weight decay 0.1 in both groups, every other knob at its default.
verify  runs the same configuration and compares it with the file, value by value:
        |golden - actual| <= atol + rtol * max(|golden|, |actual|), default rtol 1e-6, atol 1e-12
        (the reference is deterministic, so on the machine that made the file the match is exact;
        the tolerance absorbs only last-bit differences of other compilers and libm; see docs/golden.md).
        --exact also compares the parameter bit hashes. Exit status 1 when the check fails.
        --cross-platform is the check for kernels that round bf16 GEMMs in another order (a GPU,
        the fast backend, another BLAS): each column's error, on that column's scale for the
        parameter, within a bound set far above such noise and far below any semantic change
        (docs/golden.md, "On another platform"); it prints the worst error as a fraction of its bound.
--steps N runs N steps: make writes N steps, verify compares the file's first N steps (a quicker check).
--set changes a knob of the configuration, e.g. to see that a planted semantic change is caught.
--backend picks the backend that verify runs (default reference), --device where (default cpu);
make always uses the reference on the CPU.
)",
                default_golden_path().c_str());
    return a.help() ? 0 : 2;
  }
  GoldenSpec spec = GoldenSpec::standard();
  spec.steps = a.get_int("steps", spec.steps);
  if (!apply_sets(a, spec.options)) return 0;
  const std::string path = a.get("file", default_golden_path());
  TraceTolerance tol;
  tol.rtol = a.get_double("rtol", tol.rtol);
  tol.atol = a.get_double("atol", tol.atol);
  tol.exact = a.flag("exact");
  tol.cross_platform = a.flag("cross-platform");
  if (action == "make" && (a.has("rtol") || a.has("atol") || tol.exact || tol.cross_platform))
    throw std::invalid_argument("--rtol, --atol, --exact and --cross-platform are verify's: make compares nothing");
  if (tol.cross_platform && (tol.exact || a.has("rtol") || a.has("atol")))
    throw std::invalid_argument("--cross-platform has bounds of its own: it takes no --exact, --rtol or --atol");
  const std::string backend_name = action == "make" ? "reference" : a.get("backend", "reference");
  if (action == "make" && a.has("backend") && a.get("backend", "") != "reference")
    throw std::invalid_argument("golden make always uses the reference backend (the oracle)");
  if (action == "make" && a.has("device") && a.get("device", "") != "cpu")
    throw std::invalid_argument("golden make always runs on the CPU (the golden file is the CPU reference's)");
  const Layout layout = Layout::build(preset_manifest(spec.preset), spec.options);
  const std::unique_ptr<Backend> backend = make_backend(parse_backend_choice(backend_name), layout, spec.options,
                                                        parse_device_choice(a.get("device", "cpu"), "--device"));
  const auto t0 = Clock::now();
  const std::vector<TraceRow> rows = make_trace(*backend, layout, spec);
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();

  if (action == "make") {
    const std::string tmp = path + ".tmp";
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      if (!out) throw std::runtime_error("cannot write " + tmp);
      write_trace_csv(out, rows);
      out.flush();
      if (!out) throw std::runtime_error("write failed: " + tmp);
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) throw std::runtime_error("cannot rename " + tmp + " to " + path);
    std::printf("wrote %zu rows (%lld steps of preset %s) to %s in %.2f s\n", rows.size(),
                static_cast<long long>(spec.steps), spec.preset.c_str(), path.c_str(), seconds);
    return 0;
  }
  std::vector<TraceRow> golden = read_trace_csv(path);
  if (a.has("steps"))  // a shorter check: the file's first --steps steps
    golden.erase(std::remove_if(golden.begin(), golden.end(), [&](const TraceRow& r) { return r.step > spec.steps; }),
                 golden.end());
  const TraceComparison cmp = compare_traces(golden, rows, tol);
  char how[320];
  if (tol.cross_platform)
    std::snprintf(how, sizeof how, "cross-platform bounds; worst error %.3g of its bound, at %s", cmp.worst_bound_fraction,
                  cmp.worst.empty() ? "none" : cmp.worst.c_str());
  else
    std::snprintf(how, sizeof how, "max rel. error %.3g; %s", cmp.max_rel_error,
                  tol.exact ? "exact" : ("rtol " + std::to_string(tol.rtol)).c_str());
  if (cmp.ok()) {
    std::printf("golden check PASSED (%s): %lld rows of %s match (%s) in %.2f s\n", backend->name().c_str(),
                static_cast<long long>(cmp.rows_compared), path.c_str(), how, seconds);
    return 0;
  }
  std::printf("golden check FAILED (%s): %lld mismatches in %lld rows of %s (%s)\n  first: %s\n",
              backend->name().c_str(), static_cast<long long>(cmp.mismatches),
              static_cast<long long>(cmp.rows_compared), path.c_str(), how, cmp.first_mismatch.c_str());
  return 1;
}

int inspect_command(const Argv& argv) {
  const Args a(argv, {}, {"no-verify"});
  if (a.help() || a.positionals().size() != 1) {
    std::puts(R"(usage: normuon inspect FILE [--no-verify]

Prints a state file's header (format, version, backend, layout fingerprint, groups and steps,
hyper-parameters) and its tensors with their CRC-32 checksums, each parameter with its own step count
(format version 2: the steps in which it had a gradient), verifying every checksum unless --no-verify.
Exit status 1 (with the reason) for a corrupt, truncated or foreign file.)");
    return a.help() ? 0 : 2;
  }
  const StateFileHeader h = read_state_header(a.positionals()[0], !a.flag("no-verify"));
  std::printf("file:     %s (%llu bytes)\nformat:   %s version %d\nbackend:  %s\nlayout:   %s\ncreated:  %s\n",
              a.positionals()[0].c_str(), static_cast<unsigned long long>(h.file_size), h.format.c_str(), h.version,
              h.backend.c_str(), h.layout_fingerprint.c_str(), h.created_utc.c_str());
  for (size_t g = 0; g < h.group_names.size(); ++g)
    std::printf("group:    %s at step %lld\n", h.group_names[g].c_str(), static_cast<long long>(h.group_steps[g]));
  for (const auto& line : describe(h.options)) std::printf("option:   %s\n", line.c_str());
  std::printf("%zu tensors%s:\n", h.tensors.size(), a.flag("no-verify") ? "" : " (checksums verified)");
  for (const auto& t : h.tensors) {
    const auto steps = h.entry_steps.find(t.name);  // a parameter (version 2): its own step count
    const std::string own = steps == h.entry_steps.end() ? "" : "  (step " + std::to_string(steps->second) + ")";
    std::printf("  %08x  %-4s [%s]  %s%s\n", t.crc32, t.dtype.c_str(), shape_to_string(t.shape).c_str(), t.name.c_str(),
                own.c_str());
  }
  return 0;
}

int presets_command(const Argv& argv) {
  const Args a(argv, {}, {});
  if (a.help()) {
    std::puts("usage: normuon presets\n\nLists the built-in model presets (use them with --preset NAME).");
    return 0;
  }
  for (const auto& p : list_presets()) std::printf("%-12s %s\n", p.name.c_str(), p.description.c_str());
  return 0;
}

int manifest_command(const Argv& argv) {
  const Args a(argv, {"preset", "out"}, {});
  if (a.help()) {
    std::puts(R"(usage: normuon manifest [--preset NAME] [--out FILE]

Writes a preset's parameter manifest (name,shape,dtype,role,group,algorithm) as CSV to FILE or
standard output: a starting point for describing your own model (then use --manifest FILE). A column
transposed (yes|no) may follow: yes marks a matrix stored [in, out] (GPT-2's Conv1D), whose statistics
and shape factor follow its module's [out, in].)");
    return 0;
  }
  const Manifest m = preset_manifest(a.get("preset", "tiny"));
  if (!a.has("out")) {
    m.write_csv(std::cout);
    return 0;
  }
  std::ofstream out(a.get("out", ""), std::ios::binary | std::ios::trunc);
  if (!out) throw std::runtime_error("cannot write " + a.get("out", ""));
  m.write_csv(out);
  return 0;
}

int layout_command(const Argv& argv) {
  const Args a(argv, {"preset", "manifest", "set"}, {});
  if (a.help()) {
    std::puts(R"(usage: normuon layout [--preset NAME | --manifest FILE] [--set KEY=VALUE]...

Prints which parameter goes to NorMuon and which to AdamW, the shape buckets, and the layout
fingerprint that state files must match.)");
    return 0;
  }
  Options options;
  if (!apply_sets(a, options)) return 0;
  std::fputs(Layout::build(model_manifest(a), options).describe().c_str(), stdout);
  return 0;
}

}  // namespace normuon::cli
