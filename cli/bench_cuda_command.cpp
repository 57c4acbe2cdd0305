// `normuon bench-cuda`: the GPU benchmark of the fused CUDA backend (docs/bench-cuda.md). On one device,
// in one process, over one model, it measures the fast CUDA backend three ways (eager with per-phase
// CUDA-event timers, eager without timers, CUDA graph replay), the device's own copy bandwidth and bf16
// GEMM rate, and the per-parameter reference stepping the same device buffers; it reports per phase and
// per step the times, launches, achieved bandwidth and TFLOP/s against those device rates, the lower
// bound of perf-anchors.md section 2.7 computed from them, and verdict lines. Without a GPU it says so on
// stderr and exits 77 (the skip code).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "args.h"
#include "bench_report.h"
#include "commands.h"
#include "model_args.h"
#include "normuon/grad_gen.h"
#include "normuon/layout.h"
#include "normuon/manifest.h"
#include "normuon/presets.h"
#include "reference_backend.h"

#if __has_include("fast_cuda_backend.h")  // on the include path only when the CUDA backend is built
#define NORMUON_BENCH_HAVE_CUDA 1
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "cuda_check.h"
#include "cuda_device.h"
#include "device_buffer.h"
#include "fast_cuda_backend.h"
#endif

namespace normuon::cli {
namespace {

constexpr int kSkipExitCode = 77;  // ctest's and automake's "skipped"

constexpr const char* kHelp = R"(usage: normuon bench-cuda [--preset NAME | --manifest FILE] [--set KEY=VALUE]... [--warmup N]
                          [--repeats N] [--steps N] [--device N] [--grad-dtype f32|bf16] [--seed S]
                          [--copy-mib N] [--gemm-size N] [--csv FILE] [--markdown FILE]
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
  * Newton-Schulz TFLOP/s = newton_schulz_flops() (sum over matrices of ns_steps*(4*m*m*n + 2*m*m*m),
    m = min(rows, cols), n = max) / the phase's median time, as % of the measured bf16 GEMM rate;
    verdict against 50% (the bar is set for gpt-1.3b's shapes);
  * the lower bound of perf-anchors.md section 2.7 with this run's rates:
      bound = NS FLOPs / GEMM rate + minimal elementwise bytes / copy bandwidth,
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
  --csv FILE        also write every number as CSV rows: model,phase,metric,value,unit
  --markdown FILE   also write a self-contained markdown report (device, date, command, tables,
                    verdicts, the full console output), as kept in bench/results/
  --no-reference    skip the reference-cuda measurements
  --quiet           no progress lines and no description of the backend's batches
See docs/bench-cuda.md.)";

#ifdef NORMUON_BENCH_HAVE_CUDA

std::string vformat(const char* fmt, va_list args) {
  va_list copy;
  va_copy(copy, args);
  const int n = std::vsnprintf(nullptr, 0, fmt, copy);
  va_end(copy);
  if (n <= 0) return "";
  std::string out(static_cast<size_t>(n) + 1, '\0');
  std::vsnprintf(out.data(), out.size(), fmt, args);
  out.resize(static_cast<size_t>(n));
  return out;
}

__attribute__((format(printf, 1, 2))) std::string fmt(const char* f, ...) {
  va_list args;
  va_start(args, f);
  std::string s = vformat(f, args);
  va_end(args);
  return s;
}

// Everything the bench prints goes to stdout and into `log`, which the markdown report reproduces.
std::string g_log;
__attribute__((format(printf, 1, 2))) void say(const char* f, ...) {
  va_list args;
  va_start(args, f);
  const std::string s = vformat(f, args);
  va_end(args);
  std::fputs(s.c_str(), stdout);
  std::fflush(stdout);
  g_log += s;
}

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

const char* met(bool ok) { return ok ? "met" : "NOT met"; }

using cuda::DeviceBuffer;
using Clock = std::chrono::steady_clock;

// A CUDA event, owned.
class Event {
 public:
  Event() { NORMUON_CUDA_CHECK(cudaEventCreate(&e_)); }
  ~Event() {
    if (e_) cudaEventDestroy(e_);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  Event(Event&& o) noexcept : e_(o.e_) { o.e_ = nullptr; }
  Event& operator=(Event&&) = delete;
  cudaEvent_t get() const { return e_; }
  void record(cudaStream_t s) { NORMUON_CUDA_CHECK(cudaEventRecord(e_, s)); }

 private:
  cudaEvent_t e_ = nullptr;
};

double elapsed_ms(const Event& a, const Event& b) {
  float ms = 0;
  NORMUON_CUDA_CHECK(cudaEventElapsedTime(&ms, a.get(), b.get()));
  return static_cast<double>(ms);
}

// A stream, owned (non-blocking: it never waits for the legacy default stream).
class Stream {
 public:
  Stream() { NORMUON_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  ~Stream() {
    if (s_) cudaStreamDestroy(s_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

// `samples` timings of `per_sample` calls of enqueue() on `stream`, chained events (the stream never
// drains between samples); returns ms per call for each sample.
template <typename F>
std::vector<double> time_chained(cudaStream_t stream, int64_t samples, int64_t per_sample, F&& enqueue) {
  std::vector<Event> events;
  events.reserve(static_cast<size_t>(samples + 1));
  for (int64_t i = 0; i <= samples; ++i) events.emplace_back();
  events[0].record(stream);
  for (int64_t s = 0; s < samples; ++s) {
    for (int64_t k = 0; k < per_sample; ++k) enqueue();
    events[static_cast<size_t>(s + 1)].record(stream);
  }
  NORMUON_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> out;
  for (int64_t s = 0; s < samples; ++s)
    out.push_back(elapsed_ms(events[static_cast<size_t>(s)], events[static_cast<size_t>(s + 1)]) /
                  static_cast<double>(per_sample));
  return out;
}

// Device-to-device copy bandwidth: bytes read plus bytes written per second (GB/s, 1e9).
struct CopyRate {
  size_t bytes = 0;  // per copy (one buffer)
  std::vector<double> gbps;
  std::string note;  // why the buffer is smaller than asked, if it is
};

CopyRate measure_copy(size_t want_bytes, int64_t warmup, int64_t samples) {
  CopyRate r;
  size_t free_bytes = 0, total_bytes = 0;
  NORMUON_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const size_t margin = size_t{256} << 20;
  const size_t fits = free_bytes > margin ? (free_bytes - margin) / 2 : 0;
  r.bytes = std::min(want_bytes, fits) / (size_t{1} << 20) * (size_t{1} << 20);
  if (r.bytes < want_bytes)
    r.note = fmt("%zu MiB asked, %zu MiB free on the device", want_bytes >> 20, free_bytes >> 20);
  if (r.bytes < (size_t{16} << 20)) throw std::runtime_error("copy bandwidth: not enough device memory (" + r.note + ")");
  const int64_t floats = static_cast<int64_t>(r.bytes / sizeof(float));
  DeviceBuffer<float> src(floats), dst(floats);
  NORMUON_CUDA_CHECK(cudaMemset(src.data(), 0x3c, r.bytes));
  NORMUON_CUDA_CHECK(cudaMemset(dst.data(), 0, r.bytes));
  NORMUON_CUDA_CHECK(cudaDeviceSynchronize());  // the memsets ran on the legacy stream; don't time them
  Stream stream;
  auto copy = [&] {
    NORMUON_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), r.bytes, cudaMemcpyDeviceToDevice, stream.get()));
  };
  for (int64_t i = 0; i < std::max<int64_t>(warmup, 1); ++i) copy();
  // Enough copies per sample for ~20 GB of traffic (about 5-7 ms on an H100/H200), at least 3.
  const int64_t per_sample = std::clamp<int64_t>(static_cast<int64_t>(2e10 / (2.0 * static_cast<double>(r.bytes))), 3, 1000);
  for (double ms : time_chained(stream.get(), samples, per_sample, copy))
    r.gbps.push_back(2.0 * static_cast<double>(r.bytes) / (ms * 1e-3) / 1e9);
  return r;
}

// bf16 GEMM rate through cuBLASLt: D = A B, n x n x n, bf16 inputs and output, fp32 accumulation
// (CUBLAS_COMPUTE_32F, never TF32), the heuristic's first algorithm with a 32 MiB workspace (as the
// Newton-Schulz GEMMs are planned), random operands (zeros run faster and would flatter the rate).
struct GemmRate {
  int64_t n = 0;
  std::vector<double> tflops;
  std::string algo;
};

uint16_t to_bf16_bits(float x) {  // round to nearest even
  uint32_t u = 0;
  std::memcpy(&u, &x, sizeof u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

GemmRate measure_gemm(int64_t n, int64_t warmup, int64_t samples) {
  GemmRate r;
  r.n = n;
  const int64_t elems = n * n;
  std::vector<uint16_t> host(static_cast<size_t>(elems));
  uint64_t state = 0x9e3779b97f4a7c15ull;
  for (auto& h : host) {  // uniform in [-1, 1) from a 64-bit LCG's high bits
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    h = to_bf16_bits(static_cast<float>(static_cast<double>(state >> 40) / 8388608.0 - 1.0));
  }
  DeviceBuffer<uint16_t> a(elems), b(elems), d(elems);
  NORMUON_CUDA_CHECK(cudaMemcpy(a.data(), host.data(), a.bytes(), cudaMemcpyHostToDevice));
  std::reverse(host.begin(), host.end());
  NORMUON_CUDA_CHECK(cudaMemcpy(b.data(), host.data(), b.bytes(), cudaMemcpyHostToDevice));
  const size_t workspace_bytes = size_t{32} << 20;
  DeviceBuffer<unsigned char> workspace(static_cast<int64_t>(workspace_bytes));

  struct Lt {
    cublasLtHandle_t handle = nullptr;
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t layout = nullptr;
    cublasLtMatmulPreference_t pref = nullptr;
    ~Lt() {
      if (pref) cublasLtMatmulPreferenceDestroy(pref);
      if (layout) cublasLtMatrixLayoutDestroy(layout);
      if (desc) cublasLtMatmulDescDestroy(desc);
      if (handle) cublasLtDestroy(handle);
    }
  } lt;
  NORMUON_CUBLAS_CHECK(cublasLtCreate(&lt.handle));
  NORMUON_CUBLAS_CHECK(cublasLtMatmulDescCreate(&lt.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const int32_t op_n = CUBLAS_OP_N;
  NORMUON_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(lt.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_n, sizeof op_n));
  NORMUON_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(lt.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof op_n));
  const uint64_t dim = static_cast<uint64_t>(n);
  NORMUON_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lt.layout, CUDA_R_16BF, dim, dim, n));  // A, B, C, D alike
  NORMUON_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&lt.pref));
  const uint64_t ws = workspace_bytes;
  NORMUON_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(lt.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
  cublasLtMatmulHeuristicResult_t heuristic{};
  int returned = 0;
  NORMUON_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt.handle, lt.desc, lt.layout, lt.layout, lt.layout, lt.layout,
                                                      lt.pref, 1, &heuristic, &returned));
  if (returned < 1 || heuristic.state != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error("cuBLASLt found no algorithm for a " + std::to_string(n) + "^3 bf16 GEMM");
  int32_t algo_id = -1;
  uint32_t tile = 0;
  size_t written = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&heuristic.algo, CUBLASLT_ALGO_CONFIG_ID, &algo_id, sizeof algo_id, &written);
  cublasLtMatmulAlgoConfigGetAttribute(&heuristic.algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &written);
  r.algo = fmt("algo %d, tile %u, workspace %zu", algo_id, tile, heuristic.workspaceSize);

  Stream stream;
  const float alpha = 1.0f, beta = 0.0f;
  auto gemm = [&] {
    NORMUON_CUBLAS_CHECK(cublasLtMatmul(lt.handle, lt.desc, &alpha, a.data(), lt.layout, b.data(), lt.layout, &beta,
                                        d.data(), lt.layout, d.data(), lt.layout, &heuristic.algo, workspace.data(),
                                        workspace_bytes, stream.get()));
  };
  const double flops = 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n);
  for (int64_t i = 0; i < std::max<int64_t>(warmup, 1); ++i) gemm();
  // Enough GEMMs per sample for ~20 TFLOP (about 25 ms on an H100), at least 3.
  const int64_t per_sample = std::clamp<int64_t>(static_cast<int64_t>(2e13 / flops), 3, 1000);
  for (double ms : time_chained(stream.get(), samples, per_sample, gemm)) r.tflops.push_back(flops / (ms * 1e-3) / 1e12);
  return r;
}

std::string version_string(int v) {  // 13000 -> "13.0"
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

// The kernel driver's version line, e.g. "580.159.04", from /proc (empty when not there).
std::string nvidia_driver_version() {
  std::ifstream in("/proc/driver/nvidia/version");
  std::string line;
  if (!std::getline(in, line)) return "";
  // "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Tue ..."
  const auto at = line.find("Module");
  if (at == std::string::npos) return "";
  std::string rest = line.substr(at + 6);
  rest.erase(0, rest.find_first_not_of(' '));
  return rest.substr(0, rest.find(' '));
}

// Bytes each elementwise phase moves per step, from the layout (docs/bench-cuda.md, --help), and the
// minimal elementwise traffic of perf-anchors.md section 2.6/2.7.
struct Traffic {
  int64_t normuon_elements = 0, adamw_elements = 0, stat_elements = 0, matrices = 0;
  double momentum = 0, normalisation = 0, update = 0, adamw = 0;
  double minimal = 0;
  double elementwise() const { return momentum + normalisation + update + adamw; }
};

Traffic count_traffic(const Layout& layout, const Options& options, double grad_bytes) {
  Traffic t;
  for (const LayoutEntry& e : layout.entries) {
    const double n = static_cast<double>(e.numel);
    t.momentum += grad_bytes * n;  // the NaN/Inf scan reads every gradient
    if (e.algorithm == Algorithm::adamw) {
      t.adamw_elements += e.numel;
      t.adamw += n * (grad_bytes + 24);
      t.minimal += n * (grad_bytes + 24);
      continue;
    }
    if (e.numel == 0) continue;
    ++t.matrices;
    t.normuon_elements += e.numel;
    t.stat_elements += e.stat_len;
    const double x = options.groups[e.group].normuon.ns_precision == NsPrecision::bf16 ? 2 : 4;
    const double s = static_cast<double>(e.stat_len);
    t.momentum += n * (grad_bytes + 8 + x);
    t.normalisation += n * x + s * 28;
    t.update += n * (x + 8) + s * 4;
    t.minimal += n * (grad_bytes + 8 + x + x + 8);
  }
  return t;
}

struct PhaseDef {
  const char* label;
  const char* csv;
  double PhaseTimes::*field;
};
const PhaseDef kPhases[] = {{"momentum", "momentum", &PhaseTimes::momentum},
                            {"Newton-Schulz", "newton_schulz", &PhaseTimes::newton_schulz},
                            {"normalisation", "normalisation", &PhaseTimes::normalisation},
                            {"update", "update", &PhaseTimes::update},
                            {"AdamW", "adamw", &PhaseTimes::adamw}};

Summary phase_summary(const std::vector<PhaseTimes>& v, double PhaseTimes::*field) {
  std::vector<double> x;
  for (const auto& p : v) x.push_back(p.*field);
  return summarise(x);
}

Summary other_summary(const std::vector<PhaseTimes>& v) {  // total minus the five phases
  std::vector<double> x;
  for (const auto& p : v)
    x.push_back(std::max(0.0, p.total - (p.momentum + p.newton_schulz + p.normalisation + p.update + p.adamw)));
  return summarise(x);
}

#endif  // NORMUON_BENCH_HAVE_CUDA

}  // namespace

int bench_cuda_command(const Argv& argv) {
  const Args a(argv,
               {"preset", "manifest", "set", "warmup", "repeats", "steps", "device", "grad-dtype", "seed", "copy-mib",
                "gemm-size", "csv", "markdown"},
               {"no-reference", "quiet"});
  if (a.help()) {
    std::puts(kHelp);
    return 0;
  }
  const long long warmup = a.get_int("warmup", 3);
  const long long repeats = a.get_int("repeats", 10);
  const long long steps_per_sample = a.get_int("steps", 10);
  const long long device = a.get_int("device", 0);
  const long long copy_mib = a.get_int("copy-mib", 1024);
  const long long gemm_size = a.get_int("gemm-size", 8192);
  const std::string grad_dtype = a.get("grad-dtype", "f32");
  if (warmup < 0) throw std::invalid_argument("--warmup must be >= 0");
  if (repeats < 1) throw std::invalid_argument("--repeats must be >= 1");
  if (steps_per_sample < 1) throw std::invalid_argument("--steps must be >= 1");
  if (device < 0 || device > 1024) throw std::invalid_argument("--device must be a CUDA device ordinal (0, 1, ...)");
  if (copy_mib < 16) throw std::invalid_argument("--copy-mib must be >= 16");
  if (gemm_size < 256 || gemm_size > 65536) throw std::invalid_argument("--gemm-size must be in 256..65536");
  if (grad_dtype != "f32" && grad_dtype != "bf16") throw std::invalid_argument("--grad-dtype must be f32 or bf16");
  if (a.has("preset") && a.has("manifest")) throw std::invalid_argument("give --preset or --manifest, not both");
  const std::string model = a.has("manifest") ? a.get("manifest", "") : a.get("preset", "gpt2-124m");
  const Manifest manifest = a.has("manifest") ? Manifest::read_csv_file(model) : preset_manifest(model);
  Options options;
  if (!apply_sets(a, options)) return 0;
  const Layout layout = Layout::build(manifest, options);

#ifndef NORMUON_BENCH_HAVE_CUDA
  std::fprintf(stderr, "bench-cuda: no GPU: this build has no CUDA backend (configured with -DNORMUON_BUILD_CUDA=OFF)\n");
  return kSkipExitCode;
#else
  const int dev = static_cast<int>(device);
  if (const std::string reason = cuda::unavailable_reason(dev); !reason.empty()) {
    std::fprintf(stderr, "bench-cuda: no GPU: %s\n", reason.c_str());
    return kSkipExitCode;
  }
  if (const std::string reason = FastCudaBackend::unsupported_reason(layout, options, dev); !reason.empty())
    throw std::invalid_argument("fast-cuda cannot run this model with these options: " + reason);
  NORMUON_CUDA_CHECK(cudaSetDevice(dev));
  const bool quiet = a.flag("quiet");
  const bool bf16_grads = grad_dtype == "bf16";
  const double grad_bytes = bf16_grads ? 2 : 4;
  g_log.clear();

  // ---- header: model, device, software, run
  const Traffic traffic = count_traffic(layout, options, grad_bytes);
  const double ns_flops_layout = [&] {  // for the header only; the backend's own count is used below
    double f = 0;
    for (const LayoutEntry& e : layout.entries) {
      if (e.algorithm != Algorithm::normuon || e.numel == 0) continue;
      const double m = static_cast<double>(std::min(e.rows, e.cols)), n = static_cast<double>(std::max(e.rows, e.cols));
      f += options.groups[e.group].normuon.ns_steps * (4 * m * m * n + 2 * m * m * m);
    }
    return f;
  }();
  int driver = 0, runtime = 0;
  NORMUON_CUDA_CHECK(cudaDriverGetVersion(&driver));
  NORMUON_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  const size_t lt_version = cublasLtGetVersion();
  size_t free_bytes = 0, total_bytes = 0;
  NORMUON_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const std::string device_name = cuda::describe_device(dev);
  const std::string kernel_driver = nvidia_driver_version();
  const std::string software =
      fmt("driver %s(CUDA %s), runtime %s, cuBLASLt %zu.%zu.%zu",
          kernel_driver.empty() ? "" : (kernel_driver + " ").c_str(), version_string(driver).c_str(),
          version_string(runtime).c_str(), lt_version / 10000, (lt_version / 100) % 100, lt_version % 100);
  const std::string date = utc_now("%Y-%m-%d %H:%M UTC");
  const std::string command = command_line(argv);
  std::string ns_precisions;
  for (const auto& g : options.groups)
    if (g.algorithm == Algorithm::normuon)
      ns_precisions += (ns_precisions.empty() ? "" : ", ") + g.name + ": " + to_string(g.normuon.ns_precision) + " (" +
                       to_string(g.normuon.ns_coefficients) + ", " + std::to_string(g.normuon.ns_steps) + " steps)";
  std::string ref_reason = a.flag("no-reference") ? "skipped (--no-reference)" : "";
  if (ref_reason.empty()) {
    const std::string why = ReferenceBackend::unavailable_reason(ReferenceDevice::cuda);
    if (!why.empty()) ref_reason = "unavailable: " + why;
  }
  bool run_reference = ref_reason.empty();

  say("normuon bench-cuda: %s (%zu parameters, %s floats: %s on NorMuon in %zu matrices, %zu shape buckets; %s on "
      "AdamW)\n",
      model.c_str(), layout.entries.size(), with_commas(traffic.normuon_elements + traffic.adamw_elements).c_str(),
      with_commas(traffic.normuon_elements).c_str(), static_cast<size_t>(traffic.matrices), layout.buckets.size(),
      with_commas(traffic.adamw_elements).c_str());
  say("device %d: %s (%.1f GiB free); %s\n", dev, device_name.c_str(), static_cast<double>(free_bytes) / (1 << 30),
      software.c_str());
  say("run: %s; warm-up %lld, repeats %lld, %lld steps per whole-step sample; gradients %s; Newton-Schulz %s\n",
      date.c_str(), warmup, repeats, steps_per_sample, grad_dtype.c_str(),
      ns_precisions.empty() ? "unused" : ns_precisions.c_str());
  say("command: %s\n", command.c_str());
  say("reference-cuda: %s\n", run_reference ? "will run on the same device buffers" : ref_reason.c_str());

  // ---- state: the generator's parameters and step-1 gradients, uploaded once
  FastCudaConfig config;
  config.device = dev;
  config.grad_type = bf16_grads ? cuda::ElemType::bf16 : cuda::ElemType::f32;
  const GradientGenerator generator{static_cast<uint64_t>(a.get_int("seed", 1234)), 0};
  FastCudaBackend fast(layout, options, config);
  cuda::DeviceFlatState& ds = fast.device_state();
  std::unique_ptr<DeviceBuffer<float>> ref_grads;  // fp32 gradients for the reference when fast-cuda reads bf16
  {
    auto host = std::make_unique<FlatState>(layout);
    generator.fill_params(*host);
    generator.fill_gradients(*host, 1);
    ds.upload(*host, fast.stream());
    if (run_reference && bf16_grads) {
      try {
        ref_grads = std::make_unique<DeviceBuffer<float>>(layout.param_floats);
        NORMUON_CUDA_CHECK(cudaMemcpy(ref_grads->data(), host->grads.data(), ref_grads->bytes(), cudaMemcpyHostToDevice));
      } catch (const std::exception& e) {
        run_reference = false;
        ref_reason = std::string("skipped: no room for its fp32 gradient copy (") + e.what() + ")";
        say("reference-cuda: %s\n", ref_reason.c_str());
      }
    }
  }
  const double ns_flops = fast.newton_schulz_flops();
  if (!quiet) say("%s", fast.describe().c_str());

  auto check = [&](const StepResult& r, const char* what) {
    if (r.skipped) throw std::runtime_error(std::string(what) + ": a step was skipped: " + r.reason);
  };

  // ---- 1. eager with per-phase timers
  fast.set_timing(true);
  std::vector<PhaseTimes> fast_phases;
  std::vector<double> enqueue_us;
  for (long long i = 0; i < warmup + repeats; ++i) {
    const auto t0 = Clock::now();
    fast.enqueue_step();
    const auto t1 = Clock::now();
    check(fast.finish_step(options), "fast-cuda");
    if (i < warmup) continue;
    fast_phases.push_back(fast.phase_times());
    enqueue_us.push_back(ms_between(t0, t1) * 1e3);
    if (!quiet) say("fast-cuda eager, timers, step %lld: %.3f ms\n", i - warmup + 1, fast.phase_times().total);
  }
  fast.set_timing(false);

  // ---- 2. eager without timers; 3. CUDA graph
  for (long long i = 0; i < warmup; ++i) fast.enqueue_step();
  check(fast.finish_step(options), "fast-cuda");
  const std::vector<double> eager_ms = time_chained(fast.stream(), repeats, steps_per_sample, [&] { fast.enqueue_step(); });
  check(fast.finish_step(options), "fast-cuda");
  if (!quiet)
    for (size_t i = 0; i < eager_ms.size(); ++i)
      say("fast-cuda eager, sample %zu: %.3f ms per step\n", i + 1, eager_ms[i]);

  fast.capture_graph();
  for (long long i = 0; i < std::max(warmup, 1LL); ++i) fast.replay_graph();  // the first replay uploads it
  check(fast.finish_step(options), "fast-cuda (graph)");
  std::vector<double> graph_launch_us;
  for (long long i = 0; i < repeats; ++i) {  // host cost of one launch, queue empty
    const auto t0 = Clock::now();
    fast.replay_graph();
    graph_launch_us.push_back(ms_between(t0, Clock::now()) * 1e3);
    NORMUON_CUDA_CHECK(cudaStreamSynchronize(fast.stream()));
  }
  const std::vector<double> graph_ms = time_chained(fast.stream(), repeats, steps_per_sample, [&] { fast.replay_graph(); });
  check(fast.finish_step(options), "fast-cuda (graph)");
  if (!quiet)
    for (size_t i = 0; i < graph_ms.size(); ++i) say("fast-cuda graph, sample %zu: %.3f ms per step\n", i + 1, graph_ms[i]);

  // ---- 4. the device's rates, on the same (now warm) device
  const CopyRate copy = measure_copy(static_cast<size_t>(copy_mib) << 20, warmup, repeats);
  const GemmRate gemm = measure_gemm(gemm_size, warmup, repeats);

  // ---- 5. the reference on the same device buffers
  std::vector<double> ref_ms;
  std::vector<PhaseTimes> ref_phases;
  if (run_reference) {
    try {
      NORMUON_CUDA_CHECK(cudaDeviceSynchronize());
      float* grads = bf16_grads ? ref_grads->data() : ds.grads_f32.data();
      FlatTensors t = wrap_flat(layout, ds.params.data(), grads, ds.momentum.data(), ds.row_var.data(),
                                ds.exp_avg.data(), ds.exp_avg_sq.data(), ReferenceDevice::cuda);
      std::vector<uint8_t> has_grad(layout.entries.size(), 1);
      std::vector<int64_t> group_steps(layout.group_names.size(), 0);
      if (!group_steps.empty())
        NORMUON_CUDA_CHECK(cudaMemcpy(group_steps.data(), ds.group_steps.data(), group_steps.size() * sizeof(int64_t),
                                      cudaMemcpyDeviceToHost));
      ReferenceBackend reference(ReferenceDevice::cuda);
      reference.set_timing(false);
      for (long long i = 0; i < warmup + repeats; ++i) {
        NORMUON_CUDA_CHECK(cudaDeviceSynchronize());
        const auto t0 = Clock::now();
        check(reference.step_flat(layout, t, has_grad, group_steps, options), "reference-cuda");
        NORMUON_CUDA_CHECK(cudaDeviceSynchronize());
        const double ms = ms_between(t0, Clock::now());
        if (i < warmup) continue;
        ref_ms.push_back(ms);
        if (!quiet) say("reference-cuda, step %lld: %.3f ms\n", i - warmup + 1, ms);
      }
      reference.set_timing(true);  // its clock synchronises the device at every phase of every parameter
      for (long long i = 0; i < repeats; ++i) {
        NORMUON_CUDA_CHECK(cudaDeviceSynchronize());
        check(reference.step_flat(layout, t, has_grad, group_steps, options), "reference-cuda");
        ref_phases.push_back(reference.phase_times());
        if (!quiet) say("reference-cuda, timers, step %lld: %.3f ms\n", i + 1, reference.phase_times().total);
      }
    } catch (const std::exception& e) {
      static_cast<void>(cudaDeviceSynchronize());  // leave the device usable for what follows
      static_cast<void>(cudaGetLastError());
      run_reference = false;
      ref_reason = std::string("failed: ") + e.what();
      ref_ms.clear();
      ref_phases.clear();
      say("reference-cuda: %s\n", ref_reason.c_str());
    }
  }
  ref_grads.reset();

  // ---- summaries
  struct CsvRow {
    std::string phase, metric;
    double value;
    std::string unit;
  };
  std::vector<CsvRow> csv;
  auto put = [&](const std::string& phase, const std::string& metric, double value, const std::string& unit) {
    csv.push_back({phase, metric, value, unit});
  };
  auto put_summary = [&](const std::string& phase, const std::string& metric, const Summary& s, const std::string& unit) {
    if (s.n == 0) return;
    put(phase, metric + "_median", s.median, unit);
    put(phase, metric + "_min", s.min, unit);
    put(phase, metric + "_max", s.max, unit);
  };

  const Summary copy_s = summarise(copy.gbps), gemm_s = summarise(gemm.tflops);
  const double copy_gbps = copy_s.median, gemm_tflops = gemm_s.median;
  const Summary eager_s = summarise(eager_ms), graph_s = summarise(graph_ms), ref_s = summarise(ref_ms);
  const Summary enqueue_s = summarise(enqueue_us), launch_s = summarise(graph_launch_us);
  const Summary fast_total = phase_summary(fast_phases, &PhaseTimes::total);

  // Phase table.
  say("\n%-16s | %-32s | %-32s | %s\n", "phase (ms)", "fast-cuda eager, timers", "reference-cuda, timers", "ref/fast");
  say("%s\n", std::string(16 + 3 + 32 + 3 + 32 + 3 + 8, '-').c_str());
  std::vector<Summary> fast_phase_s, ref_phase_s;
  for (const PhaseDef& p : kPhases) {
    fast_phase_s.push_back(phase_summary(fast_phases, p.field));
    ref_phase_s.push_back(phase_summary(ref_phases, p.field));
  }
  const Summary fast_other = other_summary(fast_phases), ref_other = other_summary(ref_phases);
  const Summary ref_total = phase_summary(ref_phases, &PhaseTimes::total);
  for (size_t i = 0; i < std::size(kPhases); ++i) {
    say("%-16s | %32s | %32s | %8s\n", kPhases[i].label, ms_cell(fast_phase_s[i]).c_str(), ms_cell(ref_phase_s[i]).c_str(),
        ratio_cell(ref_phase_s[i].median, fast_phase_s[i].median).c_str());
    put_summary(kPhases[i].csv, "fast_eager_timed_ms", fast_phase_s[i], "ms");
    put_summary(kPhases[i].csv, "reference_timed_ms", ref_phase_s[i], "ms");
  }
  say("%-16s | %32s | %32s | %8s\n", "other", ms_cell(fast_other).c_str(), ms_cell(ref_other).c_str(), "");
  say("%-16s | %32s | %32s | %8s\n", "total (timers)", ms_cell(fast_total).c_str(), ms_cell(ref_total).c_str(),
      ratio_cell(ref_total.median, fast_total.median).c_str());
  put_summary("other", "reference_timed_ms", ref_other, "ms");
  put_summary("step", "fast_eager_timed_ms", fast_total, "ms");
  put_summary("step", "reference_timed_ms", ref_total, "ms");
  say("(%lld measured steps each; fast-cuda: CUDA events between the phases, its NaN/Inf scan counted in momentum;\n"
      " reference: host clock with a device synchronisation at every phase of every parameter; \"other\": its\n"
      " NaN/Inf check and group bookkeeping)\n",
      repeats);

  // Whole step.
  say("\n%-28s | %-32s | %s\n", "whole step (ms, no timers)", "median [min - max]", "reference / this");
  say("%s\n", std::string(28 + 3 + 32 + 3 + 16, '-').c_str());
  say("%-28s | %32s | %s\n", "fast-cuda eager", ms_cell(eager_s).c_str(), ratio_cell(ref_s.median, eager_s.median).c_str());
  say("%-28s | %32s | %s\n", "fast-cuda CUDA graph", ms_cell(graph_s).c_str(),
      ratio_cell(ref_s.median, graph_s.median).c_str());
  say("%-28s | %32s | %s\n", "reference-cuda", run_reference ? ms_cell(ref_s).c_str() : "-", "");
  say("(fast-cuda: %lld samples of %lld back-to-back steps between two CUDA events; reference-cuda: host clock\n"
      " with cudaDeviceSynchronize before and after each of %lld steps)\n",
      repeats, steps_per_sample, repeats);
  put_summary("step", "fast_eager_ms", eager_s, "ms");
  put_summary("step", "fast_graph_ms", graph_s, "ms");
  put_summary("step", "reference_ms", ref_s, "ms");
  if (run_reference && eager_s.median > 0 && graph_s.median > 0) {
    put("step", "speedup_eager_vs_reference", ref_s.median / eager_s.median, "x");
    put("step", "speedup_graph_vs_reference", ref_s.median / graph_s.median, "x");
  }

  // Launches.
  const int64_t launches = fast.launches_per_step(), nodes = fast.graph_kernel_nodes();
  say("\nlaunches per step: eager %lld (kernels and cuBLASLt matmuls, counted by the host) + 1 memset;\n"
      "  CUDA graph: 1 graph launch holding %lld kernel nodes (counted in the captured graph)\n",
      static_cast<long long>(launches), static_cast<long long>(nodes));
  say("  host time: enqueue one eager step (timers on, empty queue) %.1f us [%.1f - %.1f]; one graph launch %.1f us "
      "[%.1f - %.1f]\n",
      enqueue_s.median, enqueue_s.min, enqueue_s.max, launch_s.median, launch_s.min, launch_s.max);
  put("step", "launches_per_step_eager", static_cast<double>(launches), "count");
  put("step", "graph_kernel_nodes", static_cast<double>(nodes), "count");
  put("step", "graph_launches_per_step", 1, "count");
  put_summary("step", "host_enqueue_eager_us", enqueue_s, "us");
  put_summary("step", "host_graph_launch_us", launch_s, "us");

  // Device rates.
  say("\ndevice rates measured in this run (median [min - max] over %lld samples):\n", repeats);
  say("  device-to-device copy of %.2f GiB (cudaMemcpyAsync; read + write bytes): %.1f GB/s [%.1f - %.1f]%s\n",
      static_cast<double>(copy.bytes) / (1 << 30), copy_s.median, copy_s.min, copy_s.max,
      copy.note.empty() ? "" : (" (smaller buffer: " + copy.note + ")").c_str());
  say("  bf16 GEMM %lld^3 (cuBLASLt, fp32 accumulation, bf16 output; %s): %.1f TFLOP/s [%.1f - %.1f]\n",
      static_cast<long long>(gemm.n), gemm.algo.c_str(), gemm_s.median, gemm_s.min, gemm_s.max);
  put("machine", "copy_buffer_bytes", static_cast<double>(copy.bytes), "B");
  put_summary("machine", "copy_bandwidth_gbps", copy_s, "GB/s");
  put("machine", "gemm_size", static_cast<double>(gemm.n), "n");
  put_summary("machine", "gemm_bf16_tflops", gemm_s, "TFLOP/s");

  // Elementwise bandwidth, per pass and together.
  struct Pass {
    const char* label;
    const char* csv;
    double bytes;
    double ms;
  };
  const Pass passes[] = {{"momentum (+scan)", "momentum", traffic.momentum, fast_phase_s[0].median},
                         {"normalisation", "normalisation", traffic.normalisation, fast_phase_s[2].median},
                         {"update", "update", traffic.update, fast_phase_s[3].median},
                         {"AdamW", "adamw", traffic.adamw, fast_phase_s[4].median}};
  double pass_bytes = 0, pass_ms = 0;
  say("\nelementwise passes (bytes per step from the layout / the phase's median time; --help has the formulas):\n");
  say("  %-18s | %14s | %10s | %10s | %s\n", "pass", "bytes per step", "ms", "GB/s", "% of copy");
  for (const Pass& p : passes) {
    if (!(p.bytes > 0)) continue;
    pass_bytes += p.bytes;
    pass_ms += p.ms;
    const double gbps = p.ms > 0 ? p.bytes / (p.ms * 1e-3) / 1e9 : 0;
    say("  %-18s | %14s | %10.3f | %10.1f | %.0f%%\n", p.label, with_commas(static_cast<int64_t>(p.bytes)).c_str(), p.ms,
        gbps, copy_gbps > 0 ? 100 * gbps / copy_gbps : 0);
    put(p.csv, "bytes_per_step", p.bytes, "B");
    put(p.csv, "bandwidth_gbps", gbps, "GB/s");
    put(p.csv, "share_of_copy_bandwidth", copy_gbps > 0 ? 100 * gbps / copy_gbps : 0, "%");
  }
  const double elementwise_gbps = pass_ms > 0 ? pass_bytes / (pass_ms * 1e-3) / 1e9 : 0;
  const double elementwise_share = copy_gbps > 0 ? elementwise_gbps / copy_gbps : 0;
  say("  %-18s | %14s | %10.3f | %10.1f | %.0f%%\n", "all four", with_commas(static_cast<int64_t>(pass_bytes)).c_str(),
      pass_ms, elementwise_gbps, 100 * elementwise_share);
  put("elementwise", "bytes_per_step", pass_bytes, "B");
  put("elementwise", "bandwidth_gbps", elementwise_gbps, "GB/s");
  put("elementwise", "share_of_copy_bandwidth", 100 * elementwise_share, "%");

  // Newton-Schulz throughput.
  const double ns_ms = fast_phase_s[1].median;
  const double ns_tflops = ns_ms > 0 && ns_flops > 0 ? ns_flops / (ns_ms * 1e-3) / 1e12 : 0;
  const double ns_share = gemm_tflops > 0 ? ns_tflops / gemm_tflops : 0;
  if (ns_flops > 0) {
    say("\nNewton-Schulz: %.2f TFLOP per step (ns_steps * (4 m^2 n + 2 m^3) per matrix) in %.3f ms = %.1f TFLOP/s"
        " = %.0f%% of the bf16 GEMM rate\n",
        ns_flops / 1e12, ns_ms, ns_tflops, 100 * ns_share);
    if (std::fabs(ns_flops - ns_flops_layout) > 1e-6 * ns_flops)
      say("  (the layout's own count is %.2f TFLOP: the backend's batches differ from the matrices?)\n",
          ns_flops_layout / 1e12);
    put("newton_schulz", "flops_per_step", ns_flops, "FLOP");
    put("newton_schulz", "tflops", ns_tflops, "TFLOP/s");
    put("newton_schulz", "share_of_gemm_rate", 100 * ns_share, "%");
  }

  // The lower bound of perf-anchors.md section 2.7 with this run's rates.
  const double bound_ns_ms = gemm_tflops > 0 ? ns_flops / (gemm_tflops * 1e12) * 1e3 : 0;
  const double bound_mem_ms = copy_gbps > 0 ? traffic.minimal / (copy_gbps * 1e9) * 1e3 : 0;
  const double bound_ms = bound_ns_ms + bound_mem_ms;
  const double graph_ratio = bound_ms > 0 ? graph_s.median / bound_ms : 0;
  const double eager_ratio = bound_ms > 0 ? eager_s.median / bound_ms : 0;
  say("\nlower bound (perf-anchors.md 2.7 with this run's rates): Newton-Schulz %.2f TFLOP / %.1f TFLOP/s = %.3f ms\n"
      "  + minimal elementwise traffic %.3f GB / %.1f GB/s = %.3f ms  =>  %.3f ms per step\n"
      "  whole step: CUDA graph %.3f ms = %.2fx the bound; eager %.3f ms = %.2fx\n",
      ns_flops / 1e12, gemm_tflops, bound_ns_ms, traffic.minimal / 1e9, copy_gbps, bound_mem_ms, bound_ms, graph_s.median,
      graph_ratio, eager_s.median, eager_ratio);
  put("step", "lower_bound_ms", bound_ms, "ms");
  put("step", "lower_bound_newton_schulz_ms", bound_ns_ms, "ms");
  put("step", "lower_bound_elementwise_ms", bound_mem_ms, "ms");
  put("step", "minimal_elementwise_bytes", traffic.minimal, "B");
  put("step", "graph_over_lower_bound", graph_ratio, "x");
  put("step", "eager_over_lower_bound", eager_ratio, "x");

  // Verdicts.
  const bool big = model == "gpt-1.3b";
  const std::string aside = big ? "" : "; the bar is set for gpt-1.3b";
  struct Verdict {
    std::string bar, measured, result;
  };
  std::vector<Verdict> verdicts;
  say("\n");
  {
    const bool ok = elementwise_share >= 0.85;
    say("elementwise passes: %.0f%% of copy bandwidth (bar 85%%: %s)\n", 100 * elementwise_share, met(ok));
    verdicts.push_back({"elementwise passes at least 85% of the device-to-device copy bandwidth",
                        fmt("**%.0f%%** (%.1f GB/s vs %.1f GB/s)", 100 * elementwise_share, elementwise_gbps, copy_gbps),
                        met(ok)});
  }
  if (ns_flops > 0) {
    const bool ok = ns_share >= 0.5;
    say("Newton-Schulz: %.0f%% of the bf16 GEMM rate (bar 50%%: %s%s)\n", 100 * ns_share, met(ok), aside.c_str());
    verdicts.push_back({"Newton-Schulz at least 50% of the bf16 GEMM rate (set for gpt-1.3b)",
                        fmt("**%.0f%%** (%.1f vs %.1f TFLOP/s)", 100 * ns_share, ns_tflops, gemm_tflops), met(ok)});
  }
  {
    const bool ok = graph_ratio > 0 && graph_ratio <= 1.5;
    say("whole step (CUDA graph): %.2fx the lower bound (bar 1.5x: %s%s)\n", graph_ratio, met(ok), aside.c_str());
    verdicts.push_back({"whole step (CUDA graph) within 1.5x of the lower bound (set for gpt-1.3b)",
                        fmt("**%.2fx** (%.3f ms vs %.3f ms)", graph_ratio, graph_s.median, bound_ms), met(ok)});
  }
  if (run_reference && graph_s.median > 0 && eager_s.median > 0) {
    say("whole step: fast-cuda is %.2fx faster than reference-cuda with the CUDA graph, %.2fx eager\n",
        ref_s.median / graph_s.median, ref_s.median / eager_s.median);
    verdicts.push_back({"speed-up over reference-cuda (no bar)",
                        fmt("**%.2fx** with the CUDA graph, %.2fx eager (%.3f ms vs %.3f ms)",
                            ref_s.median / graph_s.median, ref_s.median / eager_s.median, ref_s.median, graph_s.median),
                        "-"});
  } else {
    say("whole step: no comparison with reference-cuda (%s)\n", ref_reason.c_str());
  }
  put("elementwise", "bar_85pct_met", elementwise_share >= 0.85 ? 1 : 0, "bool");
  if (ns_flops > 0) put("newton_schulz", "bar_50pct_met", ns_share >= 0.5 ? 1 : 0, "bool");
  put("step", "bar_1_5x_lower_bound_met", graph_ratio > 0 && graph_ratio <= 1.5 ? 1 : 0, "bool");

  // ---- files
  if (a.has("csv")) {
    const std::string path = a.get("csv", "");
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    if (!out) throw std::runtime_error("cannot write " + path);
    out << "model,phase,metric,value,unit\n";
    for (const CsvRow& r : csv)
      out << csv_field(model) << ',' << r.phase << ',' << r.metric << ',' << fmt("%.6g", r.value) << ',' << r.unit << '\n';
    out.flush();
    if (!out) throw std::runtime_error("write failed: " + path);
    say("wrote %s\n", path.c_str());
  }
  if (a.has("markdown")) {
    const std::string path = a.get("markdown", "");
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    if (!out) throw std::runtime_error("cannot write " + path);
    auto cell = [](const Summary& s) { return s.n ? fmt("%.3f [%.3f - %.3f]", s.median, s.min, s.max) : std::string("-"); };
    out << "# GPU benchmark: " << model << ", " << utc_now("%Y-%m-%d") << "\n\n"
        << "`normuon bench-cuda` (docs/bench-cuda.md): the fused CUDA backend (fast-cuda) eager with per-phase timers,\n"
        << "eager without timers and as a CUDA graph, against the per-parameter reference stepping the same device\n"
        << "buffers, with the device's copy bandwidth and bf16 GEMM rate measured in the same run.\n\n"
        << "| | |\n|---|---|\n"
        << "| device | " << dev << ": " << device_name << " |\n"
        << "| software | " << software << " |\n"
        << "| date | " << date << " |\n"
        << "| command | `" << command << "` |\n"
        << "| model | " << model << ": " << layout.entries.size() << " parameters, "
        << with_commas(traffic.normuon_elements) << " elements in " << traffic.matrices << " NorMuon matrices ("
        << layout.buckets.size() << " shape buckets), " << with_commas(traffic.adamw_elements) << " on AdamW |\n"
        << "| run | warm-up " << warmup << ", repeats " << repeats << ", " << steps_per_sample
        << " steps per whole-step sample; gradients " << grad_dtype << "; Newton-Schulz "
        << (ns_precisions.empty() ? "unused" : ns_precisions) << " |\n"
        << "| reference-cuda | " << (run_reference ? "ran on the same device buffers" : ref_reason) << " |\n\n";
    out << "## Verdicts\n\n| bar | measured | result |\n|---|---|---|\n";
    for (const Verdict& v : verdicts) out << "| " << v.bar << " | " << v.measured << " | " << v.result << " |\n";
    out << "\n## Per phase (ms, median [min - max])\n\n"
        << "| phase | fast-cuda eager, timers | reference-cuda, timers | reference / fast | bytes per step | GB/s | % of copy |\n"
        << "|---|---|---|---|---|---|---|\n";
    for (size_t i = 0; i < std::size(kPhases); ++i) {
      out << "| " << kPhases[i].label << " | " << cell(fast_phase_s[i]) << " | " << cell(ref_phase_s[i]) << " | "
          << ratio_cell(ref_phase_s[i].median, fast_phase_s[i].median) << " | ";
      const Pass* p = nullptr;
      for (const Pass& q : passes)
        if (std::string(q.csv) == kPhases[i].csv) p = &q;
      if (p && p->bytes > 0 && p->ms > 0) {
        const double gbps = p->bytes / (p->ms * 1e-3) / 1e9;
        out << with_commas(static_cast<int64_t>(p->bytes)) << " | " << fmt("%.1f", gbps) << " | "
            << fmt("%.0f%%", copy_gbps > 0 ? 100 * gbps / copy_gbps : 0) << " |\n";
      } else if (i == 1 && ns_flops > 0) {
        out << fmt("%.2f TFLOP", ns_flops / 1e12) << " | " << fmt("%.1f TFLOP/s", ns_tflops) << " | "
            << fmt("%.0f%% of GEMM", 100 * ns_share) << " |\n";
      } else {
        out << "- | - | - |\n";
      }
    }
    out << "| other | " << cell(fast_other) << " | " << cell(ref_other) << " | | | | |\n"
        << "| total (timers) | " << cell(fast_total) << " | " << cell(ref_total) << " | "
        << ratio_cell(ref_total.median, fast_total.median) << " | " << with_commas(static_cast<int64_t>(pass_bytes))
        << " (elementwise) | " << fmt("%.1f", elementwise_gbps) << " | " << fmt("%.0f%%", 100 * elementwise_share)
        << " |\n\n";
    out << "## Whole step (ms, no timers)\n\n| | median [min - max] | reference / this | this / lower bound |\n"
        << "|---|---|---|---|\n"
        << "| fast-cuda eager | " << cell(eager_s) << " | " << ratio_cell(ref_s.median, eager_s.median) << " | "
        << fmt("%.2fx", eager_ratio) << " |\n"
        << "| fast-cuda CUDA graph | " << cell(graph_s) << " | " << ratio_cell(ref_s.median, graph_s.median) << " | "
        << fmt("%.2fx", graph_ratio) << " |\n"
        << "| reference-cuda | " << (run_reference ? cell(ref_s) : "-") << " | | |\n"
        << "| lower bound (perf-anchors.md 2.7) | " << fmt("%.3f", bound_ms) << " | | |\n\n";
    out << "## Launches per step\n\n| | count |\n|---|---|\n"
        << "| eager: kernels and cuBLASLt matmuls (host-counted) | " << launches << " (+1 memset) |\n"
        << "| CUDA graph: kernel nodes in the captured graph | " << nodes << " |\n"
        << "| CUDA graph: launches per step | 1 |\n"
        << "| host time to enqueue one eager step (us) | " << fmt("%.1f", enqueue_s.median) << " |\n"
        << "| host time of one graph launch (us) | " << fmt("%.1f", launch_s.median) << " |\n\n";
    out << "## Device rates measured in this run\n\n| | median [min - max] |\n|---|---|\n"
        << "| device-to-device copy, " << fmt("%.2f GiB", static_cast<double>(copy.bytes) / (1 << 30))
        << ", read + write bytes | " << fmt("%.1f [%.1f - %.1f] GB/s", copy_s.median, copy_s.min, copy_s.max) << " |\n"
        << "| bf16 GEMM " << gemm.n << "^3, cuBLASLt, fp32 accumulation (" << gemm.algo << ") | "
        << fmt("%.1f [%.1f - %.1f] TFLOP/s", gemm_s.median, gemm_s.min, gemm_s.max) << " |\n\n";
    out << "## Lower bound (perf-anchors.md section 2.7, this run's rates)\n\n"
        << fmt("Newton-Schulz %.2f TFLOP / %.1f TFLOP/s = %.3f ms, plus the minimal elementwise traffic %.3f GB / "
               "%.1f GB/s = %.3f ms: **%.3f ms** per step. The CUDA-graph step takes %.3f ms, %.2fx the bound.\n\n",
               ns_flops / 1e12, gemm_tflops, bound_ns_ms, traffic.minimal / 1e9, copy_gbps, bound_mem_ms, bound_ms,
               graph_s.median, graph_ratio);
    out << "## Full output\n\n```text\n" << g_log << "```\n";
    out.flush();
    if (!out) throw std::runtime_error("write failed: " + path);
    say("wrote %s\n", path.c_str());
  }
  return 0;
#endif
}

}  // namespace normuon::cli
