// `normuon bench-cuda`: parses its flags and runs the GPU benchmark of bench/cuda_bench.h. Without a
// GPU (or in a build without the CUDA backend) it says so on stderr and exits 77 (the skip code).
#include <cstdio>
#include <stdexcept>
#include <string>

#include "args.h"
#include "commands.h"
#include "cuda_bench.h"
#include "model_args.h"
#include "normuon/layout.h"
#include "normuon/manifest.h"
#include "normuon/presets.h"

namespace normuon::cli {
namespace {

constexpr int kSkipExitCode = 77;  // ctest's and automake's "skipped"

constexpr const char* kHelp = R"(usage: normuon bench-cuda [--preset NAME | --manifest FILE] [--set KEY=VALUE]... [--warmup N]
                          [--repeats N] [--steps N] [--device N] [--grad-dtype f32|bf16] [--seed S]
                          [--copy-mib N] [--gemm-size N] [--ns-panel-width W] [--csv FILE] [--markdown FILE]
                          [--no-reference] [--quiet]

GPU benchmark of the fused CUDA backend (fast-cuda) on one model, on one CUDA device, in one process.
It is a benchmark, not a test: a missed bar is reported, never an error. Without a usable GPU it prints
"bench-cuda: no GPU: <reason>" on stderr and exits 77 (skipped).

What it runs, in this order (the state: the gradient generator's parameters and step-1 gradients,
uploaded once; every step re-uses those gradients):
  1. fast-cuda eager with per-phase timers (set_timing: CUDA events between the phases, read by
     finish_step after each step): --warmup steps, then --repeats measured steps.
  2. fast-cuda eager, timers off: --repeats samples, each --steps back-to-back steps between two CUDA
     events (no synchronisation inside a sample); time per step = sample / --steps.
  3. fast-cuda CUDA graph: one step captured after the eager steps, then --warmup replays and --repeats
     samples of --steps replays, timed like 2.
  4. the device's rates: a device-to-device cudaMemcpyAsync of --copy-mib MiB (default 1024, less if it
     does not fit) and a --gemm-size cubed bf16 GEMM (default 8192; cuBLASLt, fp32 accumulation, bf16
     output), --repeats samples each after a warm-up.
  5. reference-cuda (the per-parameter ATen reference) stepping the same device buffers (wrapped, not
     copied): --warmup + --repeats steps with timers off (cudaDeviceSynchronize before and after, host
     clock), then --repeats steps with its per-phase timers. Skipped with --no-reference or when libtorch
     has no CUDA (the reason is printed).

What it reports (times: median [min - max] over the samples):
  * per phase (momentum incl. the NaN/Inf scan, Newton-Schulz, normalisation, update, AdamW) and in
    total: fast-cuda eager-with-timers and reference-with-timers times, and reference / fast;
  * whole step without timers: fast-cuda eager, fast-cuda CUDA graph, reference-cuda, and speed-ups;
  * launches per step: the backend's host count (launches_per_step: kernels and cuBLASLt matmuls) and
    the kernel nodes of the captured graph (graph_kernel_nodes); with the graph, 1 launch per step;
    and the host time to enqueue one eager step and to launch the graph once;
  * bandwidth of the elementwise passes: bytes per step from the layout / the phase's median time, as
    % of the measured copy bandwidth (read + write bytes counted). With G = gradient bytes (4 f32,
    2 bf16), X = Newton-Schulz element bytes of the matrix's group (2 bf16, 4 fp32), Nm = NorMuon
    elements, Na = AdamW elements, S = statistics elements (second-moment entries):
      momentum       G*(Nm+Na) (NaN/Inf scan of every gradient) + Nm*(G + 4 + 4 + X)
                     (read g, M; write M and U = P(momentum) in the Newton-Schulz input)
      normalisation  Nm*X (read O) + S*28 (write and read the double sums; read, write row_var;
                     write the inverse scale)
      update         Nm*(X + 4 + 4) + S*4 (read O, p; write p; read the inverse scales)
      AdamW          Na*(G + 12 + 12) (read g, p, m, v; write p, m, v: 28 with f32 gradients)
    verdict: all four passes together (their bytes / their summed times) against 85% of the copy;
  * Newton-Schulz TFLOP/s two ways, each / the phase's median time and as % of the measured bf16 GEMM
    rate, labelled with the run's ns_algorithm (--set ns_algorithm=standard|gram; m = min(rows, cols),
    n = max, summed over the NorMuon matrices):
      useful  the full dense standard iteration's FLOPs, ns_steps*(4*m*m*n + 2*m*m*m), whatever runs
      actual  what the run computes (newton_schulz_flops()): its algorithm's products, the symmetric
              ones (X X^T, (cA) A; Gram's m x m products) as their lower panels (--ns-panel-width);
              printed with the share of the same algorithm with every product in full (the useful
              count with standard; with gram 8*m*m*n + 28*m*m*m for 5 steps on a non-square matrix,
              ns_dense_flops, spec section 3.2; the standard count on a square one)
    verdicts: actual against 50% (how well the kernels use the GEMM engine); useful against issue 15's
    targets, at least 60% with ns_algorithm=standard and above 100% with gram (each judged only by a
    run with that algorithm; the bars are set for gpt-1.3b's shapes);
  * the lower bound (docs/bench-cuda.md) with this run's rates:
      bound = actual NS FLOPs / GEMM rate + minimal elementwise bytes / copy bandwidth,
      minimal bytes = Nm*(G + 4 + 4 + X + X + 4 + 4) + Na*(G + 24)
    (read g, M; write M, U; read O, p; write p: 22 B per element with bf16 gradients and bf16
    Newton-Schulz, as in section 2.6; no scan pass, statistics from the GEMM epilogue), and the whole
    step's ratio to it (CUDA graph; eager too); verdict against 1.5x (the bar is set for gpt-1.3b).

Options:
  --preset NAME | --manifest FILE   the model (default: preset gpt2-124m; `normuon presets` lists them)
  --set KEY=VALUE   hyper-parameters and knobs, as for `normuon run` (both backends get the same)
  --warmup N        unmeasured steps before each measured series (default 3; lazy module loading,
                    cuBLASLt's first calls, the graph's first upload, libtorch's caching allocator)
  --repeats N       measured steps / samples of each series (default 10)
  --steps N         steps between the two events of one whole-step sample (default 10)
  --device N        CUDA device ordinal (default 0)
  --grad-dtype T    f32 (default) or bf16: the dtype fast-cuda reads gradients in (bf16 gives the
                    reference its own fp32 copy of the same gradients)
  --seed S          gradient generator seed (default 1234)
  --copy-mib N      size of the copy-bandwidth buffer (default 1024 MiB; two are allocated)
  --gemm-size N     the square bf16 GEMM of the rate measurement (default 8192)
  --ns-panel-width W  width of the column panels Newton-Schulz's symmetric products are computed in
                    (default 0: the backend's choice, up to 8 panels where the batch fills the GPU; a
                    width >= m computes each in one GEMM, still mirrored). Each element is the same dot
                    product either way (summed in the order of its GEMM's cuBLASLt algorithm); run it
                    twice to see what the panels save
  --csv FILE        also write every number as CSV rows: model,phase,metric,value,unit
  --markdown FILE   also write a self-contained markdown report (device, date, command, tables,
                    verdicts, the full console output), as kept in bench/results/
  --no-reference    skip the reference-cuda measurements
  --quiet           no progress lines and no description of the backend's batches
See docs/bench-cuda.md.)";

// The command line as a shell would take it back (arguments with odd characters single-quoted).
std::string command_line(const Argv& args) {
  std::string out = "normuon bench-cuda";
  for (const std::string& a : args) {
    out += ' ';
    if (!a.empty() && a.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_=.,/:+@%") ==
                          std::string::npos) {
      out += a;
      continue;
    }
    out += '\'';
    for (char c : a) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
    out += '\'';
  }
  return out;
}

}  // namespace

int bench_cuda_command(const Argv& argv) {
  const Args a(argv,
               {"preset", "manifest", "set", "warmup", "repeats", "steps", "device", "grad-dtype", "seed", "copy-mib",
                "gemm-size", "ns-panel-width", "csv", "markdown"},
               {"no-reference", "quiet"});
  if (a.help()) {
    std::puts(kHelp);
    return 0;
  }
  bench::CudaBenchConfig config;
  config.warmup = a.get_int("warmup", 3);
  config.repeats = a.get_int("repeats", 10);
  config.steps_per_sample = a.get_int("steps", 10);
  const long long device = a.get_int("device", 0);
  config.copy_mib = a.get_int("copy-mib", 1024);
  config.gemm_size = a.get_int("gemm-size", 8192);
  config.grad_dtype = a.get("grad-dtype", "f32");
  config.ns_panel_width = a.get_int("ns-panel-width", 0);
  if (config.ns_panel_width < 0) throw std::invalid_argument("--ns-panel-width must be 0 (the backend's choice) or positive");
  if (config.warmup < 0) throw std::invalid_argument("--warmup must be >= 0");
  if (config.repeats < 1) throw std::invalid_argument("--repeats must be >= 1");
  if (config.steps_per_sample < 1) throw std::invalid_argument("--steps must be >= 1");
  if (device < 0 || device > 1024) throw std::invalid_argument("--device must be a CUDA device ordinal (0, 1, ...)");
  if (config.copy_mib < 16) throw std::invalid_argument("--copy-mib must be >= 16");
  if (config.gemm_size < 256 || config.gemm_size > 65536) throw std::invalid_argument("--gemm-size must be in 256..65536");
  if (config.grad_dtype != "f32" && config.grad_dtype != "bf16")
    throw std::invalid_argument("--grad-dtype must be f32 or bf16");
  if (a.has("preset") && a.has("manifest")) throw std::invalid_argument("give --preset or --manifest, not both");
  config.model = a.has("manifest") ? a.get("manifest", "") : a.get("preset", "gpt2-124m");
  const Manifest manifest = a.has("manifest") ? Manifest::read_csv_file(config.model) : preset_manifest(config.model);
  Options options;
  if (!apply_sets(a, options)) return 0;
  const Layout layout = Layout::build(manifest, options);

  config.device = static_cast<int>(device);
  if (const std::string reason = bench::cuda_bench_unavailable_reason(config.device); !reason.empty()) {
    std::fprintf(stderr, "bench-cuda: no GPU: %s\n", reason.c_str());
    return kSkipExitCode;
  }
  config.quiet = a.flag("quiet");
  config.reference = !a.flag("no-reference");
  config.command = command_line(argv);
  config.seed = static_cast<uint64_t>(a.get_int("seed", 1234));

  bench::Transcript console;
  const bench::CudaBenchResult result = bench::run_cuda_bench(layout, options, config, console);
  bench::print_cuda_bench(result, console);
  if (a.has("csv")) {
    const std::string path = a.get("csv", "");
    bench::write_cuda_bench_csv(result, path);
    console.say("wrote %s\n", path.c_str());
  }
  if (a.has("markdown")) {
    const std::string path = a.get("markdown", "");
    bench::write_cuda_bench_markdown(result, console.text(), path);
    console.say("wrote %s\n", path.c_str());
  }
  return 0;
}

}  // namespace normuon::cli
