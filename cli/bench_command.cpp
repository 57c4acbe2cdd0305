// `normuon bench`: parses its flags and runs the old-vs-new comparison of bench/cpu_bench.h.
#include <cstdio>
#include <stdexcept>
#include <string>

#include "args.h"
#include "commands.h"
#include "cpu_bench.h"
#include "model_args.h"
#include "normuon/layout.h"

namespace normuon::cli {
namespace {

constexpr const char* kHelp = R"(usage: normuon bench [--preset NAME | --manifest FILE] [--warmup N] [--repeats N] [--threads N]
                     [--set KEY=VALUE]... [--fast-ns-algorithm ALG] [--seed S] [--csv FILE] [--quiet]

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
step; Newton-Schulz GFLOP/s, useful (the full standard iteration's FLOPs) and actual (what each
backend computes), and the fast backend's Newton-Schulz alone with each ns_algorithm (standard, gram);
the load average; and two verdict lines: the whole-step speed-up against the 3x bar (2.5x for a fast
Gram step against the reference's standard one) and the AdamW bandwidth against the 60%-of-triad bar.
Run it on an otherwise idle machine.

  --preset NAME | --manifest FILE   the model (default: preset tiny)
  --threads N      threads of BOTH backends and of the triad (at::set_num_threads for the reference,
                   the fast backend's OpenMP team); default: one per processor this process
                   may use (its affinity mask), within its cgroup CPU quota
  --set KEY=VALUE  hyper-parameters and knobs, as for `normuon run` (the same for both backends, but
                   for --fast-ns-algorithm)
  --fast-ns-algorithm standard|gram
                   the fast backend alone runs this Newton-Schulz algorithm; the reference keeps --set's
                   (default standard). `--fast-ns-algorithm gram` times Gram Newton-Schulz against the
                   official iteration side by side (bar 2.5x); the parameters then differ by design
  --seed S         gradient generator seed (default 1234)
  --csv FILE       also write every number as CSV (one row per backend per phase/metric)
  --quiet          no per-step progress and no backend description; the tables and verdicts remain
See docs/bench.md.)";

}  // namespace

int bench_command(const Argv& argv) {
  const Args a(argv, {"preset", "manifest", "warmup", "repeats", "threads", "set", "fast-ns-algorithm", "csv", "seed"},
               {"quiet"});
  if (a.help()) {
    std::puts(kHelp);
    return 0;
  }
  if (const std::string reason = bench::cpu_bench_unavailable_reason(); !reason.empty())
    throw std::runtime_error(reason);
  bench::CpuBenchConfig config;
  config.warmup = a.get_int("warmup", 1);
  config.repeats = a.get_int("repeats", 5);
  const long long threads = a.get_int("threads", 0);
  if (config.warmup < 0) throw std::invalid_argument("--warmup must be >= 0");
  if (config.repeats < 1) throw std::invalid_argument("--repeats must be >= 1");
  if (threads < 0) throw std::invalid_argument("--threads must be >= 0 (0: one per processor)");
  config.threads = static_cast<int>(threads);
  config.quiet = a.flag("quiet");
  config.model = a.has("manifest") ? a.get("manifest", "") : a.get("preset", "tiny");

  const Manifest manifest = model_manifest(a);
  Options options;
  if (!apply_sets(a, options)) return 0;
  const Layout layout = Layout::build(manifest, options);
  config.seed = static_cast<uint64_t>(a.get_int("seed", 1234));
  if (a.has("fast-ns-algorithm")) {
    try {
      config.fast_ns_algorithm = parse_ns_algorithm(a.get("fast-ns-algorithm", ""));
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string("--fast-ns-algorithm: ") + e.what());
    }
  }

  bench::Transcript console;
  const bench::CpuBenchResult result = bench::run_cpu_bench(layout, options, config, console);
  bench::print_cpu_bench(result, console);
  if (a.has("csv")) {
    const std::string path = a.get("csv", "");
    bench::write_cpu_bench_csv(result, path);
    console.say("wrote %s\n", path.c_str());
  }
  return 0;
}

}  // namespace normuon::cli
