// The fused CUDA backend on a GPU: the launch count, the cross-check against the reference (every knob,
// even and odd ns_steps, odd shapes, free-running drift, per-step option changes), determinism, state
// files crossing to and from the fast CPU backend, CUDA graph replay against eager steps (options
// changing between replays), no device allocation in a step, phase timing, a caller's stream, NaN/Inf
// gradients (fp32 and bf16; the status sticks until finish_step), bf16 gradients and the bf16 parameter
// copy, parameters without a gradient, and each parameter's own step count for its AdamW bias corrections.
//
// Without a usable GPU the executable prints "SKIPPED: <reason>" and exits with 77, which CTest reports
// as skipped (SKIP_RETURN_CODE). Cases needing the reference or the fast CPU backend are compiled only
// when the build has them (NORMUON_TEST_HAVE_REFERENCE, NORMUON_TEST_HAVE_FAST_CPU).
#define BOOST_TEST_MODULE fast_cuda
#define BOOST_TEST_NO_MAIN
#include <boost/test/unit_test.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "comparator.h"
#include "cuda_device.h"
#include "fast_cuda_backend.h"
#include "normuon/grad_gen.h"
#include "normuon/param_table.h"
#include "normuon/presets.h"
#include "normuon/step_prologue.h"
#include "ns_gram_plan.h"
#include "step_plan.h"
#include "cuda_test_models.h"
#include "drift_case.h"
#include "knob_variants.h"
#include "state_crossing.h"
#include "step_checks.h"
#ifdef NORMUON_TEST_HAVE_REFERENCE
#include "reference_backend.h"
#endif
#ifdef NORMUON_TEST_HAVE_FAST_CPU
#include "fast_cpu_backend.h"
#endif

using namespace normuon;
using namespace normuon::test;

// Skips the whole suite, before any case runs, where there is no GPU to test on.
int main(int argc, char* argv[]) {
  const std::string reason = cuda::unavailable_reason();
  if (!reason.empty()) {
    std::cout << "SKIPPED: " << reason << std::endl;
    return 77;
  }
  std::cout << "GPU: " << cuda::describe_device() << std::endl;
  return boost::unit_test::unit_test_main(&init_unit_test, argc, argv);
}

namespace {

const GradientGenerator kGenerator{1234, 7};  // one parameter in 7 misses its gradient each step

#define CHECK_CUDA(call) check_cuda((call), #call)
void check_cuda(cudaError_t error, const char* call) {
  if (error != cudaSuccess) BOOST_FAIL(call << ": " << cudaGetErrorName(error) << " (" << cudaGetErrorString(error) << ")");
}

bool same_bits(const AlignedBuffer& a, const AlignedBuffer& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(float) * static_cast<size_t>(a.size())) == 0;
}

bool same_bits(const float* a, const float* b, int64_t n) {
  return std::memcmp(a, b, sizeof(float) * static_cast<size_t>(n)) == 0;
}

// Gradients and has_grad of `host` into the backend's device state, on its stream (fp32 gradients).
void upload_gradients(FastCudaBackend& backend, const FlatState& host) {
  cuda::DeviceFlatState& d = backend.device_state();
  BOOST_REQUIRE(d.grad_type() == cuda::ElemType::f32);
  CHECK_CUDA(cudaMemcpyAsync(d.grads_f32.data(), host.grads.data(), d.grads_f32.bytes(), cudaMemcpyHostToDevice,
                             backend.stream()));
  CHECK_CUDA(cudaMemcpyAsync(d.has_grad.data(), host.has_grad.data(), d.has_grad.bytes(), cudaMemcpyHostToDevice,
                             backend.stream()));
  CHECK_CUDA(cudaStreamSynchronize(backend.stream()));  // the host buffers are refilled for the next step
}

FlatState download(FastCudaBackend& backend, const Layout& layout) {
  FlatState s(layout);
  backend.device_state().download(s, backend.stream());
  return s;
}

std::vector<uint16_t> device_params_bf16(FastCudaBackend& backend) {
  const auto& buffer = backend.device_state().params_bf16;
  std::vector<uint16_t> host(static_cast<size_t>(buffer.size()));
  CHECK_CUDA(cudaStreamSynchronize(backend.stream()));
  CHECK_CUDA(cudaMemcpy(host.data(), buffer.data(), buffer.bytes(), cudaMemcpyDeviceToHost));
  return host;
}

// gpt2-124m with only its first `layers` blocks: every matrix shape and the embeddings.
Manifest gpt2_layers(int layers) { return first_layers("gpt2-124m", layers); }

Options with(const std::string& assignment) {
  Options o;
  o.set("weight_decay=0.1");
  if (!assignment.empty()) o.set(assignment);
  return o;
}

// `steps` steps of a fresh backend through Backend::step from the generator's initial parameters.
FlatState run_cuda(const Layout& layout, const Options& options, int64_t steps, const GradientGenerator& gen,
                   const FastCudaConfig& config = {}) {
  FastCudaBackend backend(layout, options, config);
  FlatState state(layout);
  gen.fill_params(state);
  for (int64_t s = 1; s <= steps; ++s) {
    gen.fill_gradients(state, s);
    backend.step(state, options);
  }
  return state;
}

// The launches one step issues, counted from the layout and the options alone (not from StepPlan or the
// backend): per (shape bucket, group) batch of matrices with elements, 2 + (4 + 2p) * ns_steps (norms,
// scaling, p panel GEMMs for each of the two symmetric products, B X and three elementwise kernels an
// iteration; p from ns_panels, checked against hand counts in test_cuda_plan), or Gram's count
// (ns_gram_plan.h, likewise) for a non-square bucket of a group with ns_algorithm=gram; one launch for the step counters, one for the NaN/Inf scan when any
// parameter has elements, four (momentum, statistics, finalize, update) when a NorMuon matrix has
// elements, one when an AdamW parameter has elements. Resetting the status word is a memset, no launch.
int64_t expected_launches(const Layout& layout, const Options& options, int64_t panel_width = 0) {
  bool any_elements = false, adamw_elements = false;
  for (const LayoutEntry& e : layout.entries) {
    if (e.numel == 0) continue;
    any_elements = true;
    adamw_elements = adamw_elements || e.algorithm == Algorithm::adamw;
  }
  // The step counters, the scan, AdamW; per batch (small layouts: one per bucket and group, within the
  // scratch budget) momentum, statistics, finalize and update, then Newton-Schulz's.
  int64_t n = 1 + (any_elements ? 1 : 0) + (adamw_elements ? 1 : 0);
  for (const ShapeBucket& bucket : layout.buckets) {
    if (bucket.rows * bucket.cols == 0) continue;
    std::set<int> groups;
    for (int e : bucket.entries) groups.insert(layout.entries[e].group);
    for (int g : groups) {
      const NorMuonHyper& h = options.groups[static_cast<size_t>(g)].normuon;
      int64_t count = 0;  // the batch: the bucket's matrices in this group
      for (int e : bucket.entries) count += layout.entries[e].group == g;
      const int p = static_cast<int>(cuda::ns_panels(std::min(bucket.rows, bucket.cols), count, panel_width).size());
      n += 4 + (h.ns_algorithm == NsAlgorithm::gram && bucket.rows != bucket.cols
               ? cuda::ns_gram_launches(h.ns_steps, p)
               : 2 + (4 + 2 * p) * static_cast<int64_t>(h.ns_steps));
    }
  }
  return n;
}

// Learning rates, weight decay, lr_scale and Nesterov of every group as a scheduler might set them at `step`.
Options scheduled(const Options& base, int64_t step) {
  Options o = base;
  const double t = static_cast<double>(step);
  const LrScale scales[] = {LrScale::official, LrScale::spectral, LrScale::rms_matching};
  for (GroupOptions& g : o.groups) {
    g.normuon.lr *= 1.0 - 0.05 * t;
    g.adamw.lr *= 1.0 + 0.25 * t;
    g.normuon.weight_decay = 0.05 * static_cast<double>(step % 3);
    g.adamw.weight_decay = 0.02 * static_cast<double>(step % 2);
    g.normuon.lr_scale = scales[step % 3];
    g.normuon.nesterov = step % 4 != 3;
  }
  return o;
}

// A non-blocking stream of the caller's, destroyed last (declare it before the backend that uses it).
struct UserStream {
  cudaStream_t stream = nullptr;
  UserStream() { CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)); }
  ~UserStream() {
    if (stream) cudaStreamDestroy(stream);
  }
  UserStream(const UserStream&) = delete;
  UserStream& operator=(const UserStream&) = delete;
};

}  // namespace

// ---- the backend's own numbers -------------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(launches_per_step_follow_the_layout) {
  // The last case gives the two NorMuon groups different ns_steps, with a bucket ("tall") in both.
  // The panelled variants compute the symmetric products in 5-column panels (several per product).
  for (const std::string variant : {"tiny", "odd shapes", "odd shapes, ns_steps 2 and 3", "tiny gram",
                                    "odd shapes, 5-column panels", "tiny gram, 5-column panels"}) {
    BOOST_TEST_CONTEXT(variant) {
      const bool odd = variant.rfind("odd", 0) == 0;
      const bool gram = variant.rfind("tiny gram", 0) == 0;
      Options options = odd ? odd_options() : with(gram ? "normuon.ns_algorithm=gram" : "");
      if (variant == "odd shapes, ns_steps 2 and 3") {
        options.set("normuon.ns_steps=2");
        options.set("fp32.ns_steps=3");
      }
      FastCudaConfig config;
      if (variant.find("panels") != std::string::npos) config.ns_panel_width = 5;
      const Layout layout = Layout::build(odd ? odd_manifest() : preset_manifest("tiny"), options);
      FastCudaBackend backend(layout, options, config);
      BOOST_TEST_MESSAGE(backend.describe());
      BOOST_TEST(backend.launches_per_step() == expected_launches(layout, options, config.ns_panel_width));
      // Every device byte beyond the state and masters is the plan's (computed on the host).
      BOOST_TEST(backend.workspace_bytes() == cuda::StepPlan::build(layout, options).workspace_bytes());
      BOOST_TEST(backend.newton_schulz_flops() > 0.0);
      BOOST_TEST(backend.name() == "fast-cuda");
      BOOST_TEST(!backend.has_graph());
    }
  }
}

BOOST_AUTO_TEST_CASE(fresh_device_state_holds_the_defaults_of_a_flat_state) {
  // Leave non-zero bytes in memory the allocator is likely to hand out again, so that a buffer the
  // backend forgets to initialise shows.
  void* dirty = nullptr;
  CHECK_CUDA(cudaMalloc(&dirty, size_t{256} << 20));
  CHECK_CUDA(cudaMemset(dirty, 0x5a, size_t{256} << 20));
  CHECK_CUDA(cudaDeviceSynchronize());
  CHECK_CUDA(cudaFree(dirty));
  const Options options = with("");
  Options skip = options;
  skip.set("nonfinite=skip_step");
  const Layout layout = Layout::build(preset_manifest("tiny"), options);
  FastCudaBackend backend(layout, options);
  // Dirty memory need not come back, so check the status word directly too: the constructor sets it,
  // and finish_step() before any step reports a clean step under either policy.
  StepResult result{true, "not set"};
  BOOST_CHECK_NO_THROW(result = backend.finish_step(options));
  BOOST_TEST(!result.skipped);
  BOOST_TEST(result.reason == "");
  result = StepResult{true, "not set"};
  BOOST_CHECK_NO_THROW(result = backend.finish_step(skip));
  BOOST_TEST(!result.skipped);
  BOOST_TEST(result.reason == "");
  const FlatState fresh(layout);  // zeros, group steps 0, every has_grad 1
  const FlatState device = download(backend, layout);
  BOOST_TEST(first_difference(fresh, device) == "");
  std::vector<uint8_t> has_grad(layout.entries.size());
  CHECK_CUDA(cudaMemcpy(has_grad.data(), backend.device_state().has_grad.data(), has_grad.size(), cudaMemcpyDeviceToHost));
  BOOST_TEST(has_grad == fresh.has_grad, "device has_grad is not initialised like FlatState's");
}

// ---- against the reference -----------------------------------------------------------------------------

#ifdef NORMUON_TEST_HAVE_REFERENCE
namespace {

// The comparator over `steps` steps: reference-cpu against fast-cuda from the same initial parameters.
RunSummary cross_check(const Layout& layout, const Options& options, CompareMode mode, int64_t steps,
                       const GradientGenerator& gen = kGenerator, const FastCudaConfig& config = {}) {
  FastCudaBackend candidate(layout, options, config);
  ReferenceBackend reference;
  FlatState ref_state(layout), cand_state(layout);
  gen.fill_params(ref_state);
  Comparator::sync(ref_state, cand_state);
  Comparator comparator(layout, options, gen, mode);
  for (int64_t step = 1; step <= steps; ++step) comparator.step(reference, ref_state, candidate, cand_state, step);
  return comparator.summary();
}

}  // namespace

BOOST_AUTO_TEST_CASE(matches_reference_on_tiny_20_steps) {
  const Options options;
  const Layout layout = Layout::build(preset_manifest("tiny"), options);
  const RunSummary s = cross_check(layout, options, CompareMode::resync, 20);
  log_summary("tiny default, 20 steps resync", s);
  BOOST_TEST(s.passed(), verdict_line(s));
  BOOST_TEST(s.steps == 20);
  BOOST_TEST(s.tensors == 20 * 3 * static_cast<int64_t>(layout.entries.size()));
}

BOOST_AUTO_TEST_CASE(matches_reference_on_tiny_for_every_knob) {
  std::vector<KnobVariant> variants = knob_variants();
  // An even ns_steps leaves the Newton-Schulz output in the input buffer; 1 is a single iteration.
  variants.insert(variants.end(), {{"normuon.ns_steps=4"},
                                   {"normuon.ns_steps=1"},
                                   {"normuon.ns_coefficients=polar_express", "normuon.ns_steps=4"},
                                   // Gram Newton-Schulz (tiny's square matrices take the standard loop)
                                   {"normuon.ns_algorithm=gram"},
                                   {"normuon.ns_algorithm=gram", "normuon.ns_precision=fp32"},
                                   {"normuon.ns_algorithm=gram", "normuon.ns_steps=6"},
                                   {"normuon.ns_algorithm=gram", "normuon.ns_coefficients=polar_express",
                                    "normuon.ns_precision=fp32"}});
  for (const auto& sets : variants) {
    std::string label;
    const Options options = options_with(sets, label);
    BOOST_TEST_CONTEXT(label) {
      const Layout layout = Layout::build(preset_manifest("tiny"), options);
      const RunSummary s = cross_check(layout, options, CompareMode::resync, 10);
      log_summary("tiny " + label + ", 10 steps resync", s);
      BOOST_TEST(s.passed(), verdict_line(s));
    }
  }
}

BOOST_AUTO_TEST_CASE(free_running_drift_on_tiny_stays_bounded) {
  for (const std::string precision : {"bf16", "fp32"}) {
    BOOST_TEST_CONTEXT("ns_precision=" << precision) {
      Options options = with("normuon.ns_precision=" + precision);
      const Layout layout = Layout::build(preset_manifest("tiny"), options);
      const RunSummary s = cross_check(layout, options, CompareMode::free_running, 20);
      log_summary("tiny " + precision + ", 20 steps free-running", s);
      BOOST_TEST(s.passed(), verdict_line(s));
      const Tolerance bound = tolerances_for(options.groups[0].normuon.ns_precision,
                                             CompareMode::free_running)[static_cast<int>(TensorKind::normuon_param)];
      BOOST_TEST(kind(s, TensorKind::normuon_param).worst_update_rel <= bound.update_rel);
    }
  }
}

BOOST_AUTO_TEST_CASE(matches_reference_on_odd_shapes_and_groups) {
  const Options options = odd_options();
  const Layout layout = Layout::build(odd_manifest(), options);
  for (const CompareMode mode : {CompareMode::resync, CompareMode::free_running}) {
    BOOST_TEST_CONTEXT(to_string(mode)) {
      const RunSummary s = cross_check(layout, options, mode, 10);
      log_summary(std::string("odd shapes, 10 steps ") + to_string(mode), s);
      BOOST_TEST(s.passed(), verdict_line(s));
    }
  }
}

// Symmetric products in narrow panels on cuBLASLt, both algorithms, against the reference: 8 columns
// (offsets of 16 or 32 bytes into a matrix) and 7 (offsets down to 2 bytes in bf16), so each panel's GEMM
// runs on an algorithm planned for the alignment it has.
BOOST_AUTO_TEST_CASE(narrow_panels_match_reference_in_both_algorithms) {
  for (const int64_t width : {int64_t{8}, int64_t{7}})
  for (const NsAlgorithm algorithm : {NsAlgorithm::standard, NsAlgorithm::gram}) {
    FastCudaConfig narrow;
    narrow.ns_panel_width = width;
    Options options = odd_options();
    for (GroupOptions& g : options.groups) g.normuon.ns_algorithm = algorithm;
    const Layout layout = Layout::build(odd_manifest(), options);
    BOOST_TEST_CONTEXT(to_string(algorithm) << ", " << width << "-column panels") {
      // More GEMMs (one per panel), fewer FLOPs than the full products of the same layout.
      const FastCudaBackend full(layout, options), panels(layout, options, narrow);
      BOOST_TEST(panels.launches_per_step() > full.launches_per_step());
      BOOST_TEST(panels.newton_schulz_flops() < full.newton_schulz_flops());
      const RunSummary s = cross_check(layout, options, CompareMode::resync, 10, kGenerator, narrow);
      log_summary(std::string("odd shapes, ") + to_string(algorithm) + ", " + std::to_string(width) +
                      "-column panels, 10 steps resync", s);
      BOOST_TEST(s.passed(), verdict_line(s));
    }
  }
}

BOOST_AUTO_TEST_CASE(options_may_change_between_steps) {
  // A scheduler: learning rates, weight decay, lr_scale and Nesterov change at every step; each step is
  // uploaded by set_options() inside step().
  const Options initial = with("");
  const Layout layout = Layout::build(preset_manifest("tiny"), initial);
  FastCudaBackend candidate(layout, initial);
  ReferenceBackend reference;
  FlatState ref_state(layout), cand_state(layout);
  kGenerator.fill_params(ref_state);
  Comparator::sync(ref_state, cand_state);
  Comparator comparator(layout, initial, kGenerator, CompareMode::resync);
  for (int64_t step = 1; step <= 8; ++step) {
    std::ostringstream lr, adam_lr, wd;
    lr.precision(17);
    adam_lr.precision(17);
    wd.precision(17);
    lr << 0.02 * (1.0 - 0.1 * static_cast<double>(step));
    adam_lr << 3e-4 * (1.0 + 0.25 * static_cast<double>(step));
    wd << 0.05 * static_cast<double>(step % 3);
    Options& o = comparator.options();
    o.set("normuon.lr", lr.str());
    o.set("adamw.lr", adam_lr.str());
    o.set("weight_decay", wd.str());
    o.set("normuon.lr_scale", step % 2 ? "official" : "spectral");
    o.set("normuon.nesterov", step % 4 == 3 ? "false" : "true");
    comparator.step(reference, ref_state, candidate, cand_state, step);
  }
  log_summary("tiny with a scheduler, 8 steps resync", comparator.summary());
  BOOST_TEST(comparator.summary().passed(), verdict_line(comparator.summary()));
}
#endif  // NORMUON_TEST_HAVE_REFERENCE

BOOST_AUTO_TEST_CASE(newton_schulz_knobs_are_fixed_at_construction) {
  const Options options = with("");
  const Layout layout = Layout::build(preset_manifest("tiny"), options);
  FastCudaBackend backend(layout, options);
  FlatState state(layout);
  kGenerator.fill_params(state);
  kGenerator.fill_gradients(state, 1);
  const FlatState before = state;
  for (const std::string knob : {"normuon.ns_precision=fp32", "normuon.ns_steps=4", "normuon.ns_eps=1e-6",
                                 "normuon.ns_coefficients=polar_express", "normuon.ns_algorithm=gram"}) {
    Options changed = options;
    changed.set(knob);
    BOOST_CHECK_THROW(backend.set_options(changed), std::invalid_argument);
    BOOST_CHECK_THROW(backend.step(state, changed), std::invalid_argument);
    BOOST_TEST(first_difference(before, state) == "", knob);
  }
  BOOST_TEST(!backend.step(state, options).skipped);  // still usable
}

// ---- determinism ---------------------------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(two_runs_are_bitwise_identical) {
  for (const std::string knob :
       {"", "normuon.ns_precision=fp32", "normuon.reduce_axis=longer_dim", "normuon.ns_algorithm=gram", "odd shapes"}) {
    BOOST_TEST_CONTEXT(knob) {
      const bool odd = knob == "odd shapes";
      const Options options = odd ? odd_options() : with(knob);
      const Layout layout = Layout::build(odd ? odd_manifest() : preset_manifest("tiny"), options);
      const FlatState a = run_cuda(layout, options, 10, kGenerator);
      const FlatState b = run_cuda(layout, options, 10, kGenerator);
      BOOST_TEST(first_difference(a, b) == "");
      FlatState initial(layout);
      kGenerator.fill_params(initial);
      BOOST_TEST(!same_bits(a.params, initial.params));  // it did move
    }
  }
}

// ---- state files across backends -----------------------------------------------------------------------

#ifdef NORMUON_TEST_HAVE_FAST_CPU
BOOST_AUTO_TEST_CASE(state_files_cross_between_cuda_and_cpu) {
  const Options options = with("normuon.ns_precision=fp32");  // the two backends differ in the last bits
  const Layout layout = Layout::build(preset_manifest("tiny"), options);
  constexpr int64_t k = 5, more = 5;
  const std::string file = "fast_cuda_test_state.safetensors";
  // fast-cuda saves after k steps; fast-cpu loads and continues; fast-cuda continues uninterrupted.
  {
    FastCudaBackend cuda_backend(layout, options);
    const RunSummary s = continue_from_file(
        layout, options, kGenerator, cuda_backend,
        [&](const Options& loaded) { return std::make_unique<FastCpuBackend>(layout, loaded); },
        /*saver_is_expected=*/true, file, k, more);
    log_summary("fast-cuda state continued by fast-cpu", s);
    BOOST_TEST(s.passed(), verdict_line(s));
  }
  // fast-cpu saves after k steps; a fresh fast-cuda loads and continues; fast-cpu continues.
  {
    FastCpuBackend cpu_backend(layout, options);
    const RunSummary s = continue_from_file(
        layout, options, kGenerator, cpu_backend,
        [&](const Options& loaded) { return std::make_unique<FastCudaBackend>(layout, loaded); },
        /*saver_is_expected=*/true, file, k, more);
    log_summary("fast-cpu state continued by fast-cuda", s);
    BOOST_TEST(s.passed(), verdict_line(s));
  }
}
#endif  // NORMUON_TEST_HAVE_FAST_CPU

// ---- CUDA graphs ---------------------------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(graph_replay_equals_eager_steps) {
  // Learning rates, weight decay, lr_scale and Nesterov change at every step: set_options() before each
  // eager step and each replay, which reads them from device memory.
  // Gram Newton-Schulz: its own kernels and GEMM sequence, captured as well.
  for (const std::string variant : {"tiny", "odd shapes", "tiny gram"}) {
    BOOST_TEST_CONTEXT(variant) {
      const bool odd = variant == "odd shapes";
      const Options options = odd ? odd_options() : with(variant == "tiny gram" ? "normuon.ns_algorithm=gram" : "");
      const Layout layout = Layout::build(odd ? odd_manifest() : preset_manifest("tiny"), options);
      FlatState initial(layout), grads(layout);
      kGenerator.fill_params(initial);
      FastCudaBackend eager(layout, options), graph(layout, options);
      eager.device_state().upload(initial, eager.stream());
      graph.device_state().upload(initial, graph.stream());
      constexpr int64_t kSteps = 10;
      for (int64_t s = 1; s <= kSteps; ++s) {
        BOOST_TEST_CONTEXT("step " << s) {
          const Options o = scheduled(options, s);
          kGenerator.fill_gradients(grads, s);  // with missing gradients: has_grad is read from the device
          upload_gradients(eager, grads);
          eager.set_options(o);
          eager.enqueue_step();
          BOOST_TEST(!eager.finish_step(o).skipped);
          upload_gradients(graph, grads);
          graph.set_options(o);
          if (s == 1) {  // one eager step first, then capture once
            graph.enqueue_step();
            BOOST_TEST(!graph.finish_step(o).skipped);
            BOOST_REQUIRE_NO_THROW(graph.capture_graph());
            BOOST_REQUIRE(graph.has_graph());
          } else {
            graph.replay_graph();
            BOOST_TEST(!graph.finish_step(o).skipped);
          }
          BOOST_TEST(first_difference(download(eager, layout), download(graph, layout)) == "");
        }
      }
      const FlatState a = download(eager, layout), b = download(graph, layout);
      BOOST_TEST(first_difference(a, b) == "");
      BOOST_TEST(!same_bits(a.params, initial.params));
      BOOST_TEST(a.group_steps[0] == kSteps);
      // The schedule mattered: the same steps under fixed options end elsewhere.
      FastCudaBackend fixed(layout, options);
      fixed.device_state().upload(initial, fixed.stream());
      fixed.set_options(options);
      for (int64_t s = 1; s <= kSteps; ++s) {
        kGenerator.fill_gradients(grads, s);
        upload_gradients(fixed, grads);
        fixed.enqueue_step();
        BOOST_TEST(!fixed.finish_step(options).skipped);
      }
      BOOST_TEST(!same_bits(download(fixed, layout).params, a.params));
      BOOST_TEST(graph.graph_kernel_nodes() >= graph.launches_per_step());
    }
  }
}

namespace {

// The cuBLASLt choices of the Newton-Schulz GEMMs as describe() reports them (algorithm, tile, split-K,
// reduction), without the wave counts and workspace sizes that depend on the batch size.
std::string gemm_choices(const std::string& describe) {
  static const std::regex gemm(R"(((?:gram|square)\d*|apply)\[algo=-?\d+ tile=\d+ splitk=-?\d+ red=\d+)");
  std::string out;
  for (auto it = std::sregex_iterator(describe.begin(), describe.end(), gemm); it != std::sregex_iterator(); ++it)
    out += it->str() + "] ";
  return out;
}

}  // namespace

BOOST_AUTO_TEST_CASE(graph_kernel_nodes_do_not_grow_with_layers) {
  const Options options;
  struct Captured {
    int64_t launches, nodes, ns_launches;
    std::string gemms;
  };
  auto capture = [&options](int layers) {
    const Layout layout = Layout::build(gpt2_layers(layers), options);
    FastCudaBackend backend(layout, options);
    FlatState state(layout);
    kGenerator.fill_params(state);
    kGenerator.fill_gradients(state, 1);
    backend.step(state, options);  // eager first: loads the kernels
    backend.capture_graph();
    const int64_t ns = cuda::StepPlan::build(layout, options).newton_schulz_launches();
    return Captured{backend.launches_per_step(), backend.graph_kernel_nodes(), ns, gemm_choices(backend.describe())};
  };
  const Captured two = capture(2), six = capture(6);
  BOOST_TEST_MESSAGE("2 layers: " << two.launches << " launches, " << two.nodes << " kernel nodes; " << two.gemms);
  BOOST_TEST_MESSAGE("6 layers: " << six.launches << " launches, " << six.nodes << " kernel nodes; " << six.gemms);
  BOOST_TEST(two.launches == six.launches);
  BOOST_TEST(two.launches == 147);  // 3 + 4 batches x (4 elementwise + 2 + 6 x 5)
  // Every launch is at least one kernel; cuBLASLt may add a split-K reduction kernel to a matmul.
  for (const Captured& c : {two, six}) {
    BOOST_TEST(c.nodes >= c.launches);
    BOOST_TEST(c.nodes <= c.launches + c.ns_launches);
  }
  // With the same cuBLASLt choices, the same graph: parameters don't add nodes. (cuBLASLt's heuristic
  // sees the batch count and may choose another split-K for 6 matrices than for 2; then the counts
  // may differ by those reduction kernels and only the bound above applies.)
  if (two.gemms == six.gemms)
    BOOST_TEST(two.nodes == six.nodes);
  else
    BOOST_TEST_MESSAGE("cuBLASLt chose differently for 2 and 6 layers; node counts not compared");
}

BOOST_AUTO_TEST_CASE(no_device_allocation_in_steady_state) {
  const Options options = with("");
  const Layout layout = Layout::build(preset_manifest("tiny"), options);
  FastCudaBackend backend(layout, options);
  FlatState state(layout);
  kGenerator.fill_params(state);
  kGenerator.fill_gradients(state, 1);
  backend.device_state().upload(state, backend.stream());
  backend.set_options(options);
  for (int i = 0; i < 3; ++i) {  // warm-up: lazily loaded kernels, cuBLASLt's first calls
    backend.enqueue_step();
    BOOST_TEST(!backend.finish_step(options).skipped);
  }
  // capture_graph() captures in thread-local mode: a call on this thread that is unsafe during capture
  // (cudaMalloc, cudaFree, a synchronisation) fails it. That proves less than "no allocation": a
  // stream-ordered allocation (cudaMallocAsync) is captured as a memory node instead, and other threads
  // are not watched. Hence the free-memory check over many steps and the look at the nodes below.
  BOOST_REQUIRE_NO_THROW(backend.capture_graph());
  backend.replay_graph();
  BOOST_TEST(!backend.finish_step(options).skipped);
  CHECK_CUDA(cudaDeviceSynchronize());
  size_t free_before = 0, free_after = 0, total = 0;
  CHECK_CUDA(cudaMemGetInfo(&free_before, &total));
  for (int i = 0; i < 20; ++i) backend.enqueue_step();
  for (int i = 0; i < 20; ++i) backend.replay_graph();
  BOOST_TEST(!backend.finish_step(options).skipped);
  CHECK_CUDA(cudaDeviceSynchronize());
  CHECK_CUDA(cudaMemGetInfo(&free_after, &total));
  // Device-wide: anything else on the GPU may allocate or free meanwhile, so only a decrease is an error.
  BOOST_TEST(free_after >= free_before, "free device memory went from " << free_before << " to " << free_after);
  const FlatState after = download(backend, layout);
  BOOST_TEST(after.group_steps[0] == 3 + 1 + 40);

  // Capture one enqueue_step() ourselves (never launched, so the state above stays as it is) and look
  // at every node: no memory allocation or free node.
  cudaGraph_t graph = nullptr;
  CHECK_CUDA(cudaStreamBeginCapture(backend.stream(), cudaStreamCaptureModeThreadLocal));
  try {
    backend.enqueue_step();
  } catch (...) {
    cudaStreamEndCapture(backend.stream(), &graph);
    if (graph) cudaGraphDestroy(graph);
    throw;
  }
  CHECK_CUDA(cudaStreamEndCapture(backend.stream(), &graph));
  BOOST_REQUIRE(graph != nullptr);
  size_t n_nodes = 0;
  CHECK_CUDA(cudaGraphGetNodes(graph, nullptr, &n_nodes));
  std::vector<cudaGraphNode_t> nodes(n_nodes);
  if (n_nodes > 0) CHECK_CUDA(cudaGraphGetNodes(graph, nodes.data(), &n_nodes));
  int64_t kernels = 0, allocs = 0, frees = 0;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type = cudaGraphNodeTypeEmpty;
    CHECK_CUDA(cudaGraphNodeGetType(node, &type));
    kernels += type == cudaGraphNodeTypeKernel ? 1 : 0;
    allocs += type == cudaGraphNodeTypeMemAlloc ? 1 : 0;
    frees += type == cudaGraphNodeTypeMemFree ? 1 : 0;
  }
  CHECK_CUDA(cudaGraphDestroy(graph));
  BOOST_TEST_MESSAGE("one step captured: " << n_nodes << " nodes, " << kernels << " kernels");
  BOOST_TEST(allocs == 0);
  BOOST_TEST(frees == 0);
  BOOST_TEST(kernels >= backend.launches_per_step());
}

// ---- phase timing and the caller's stream ----------------------------------------------------------------

BOOST_AUTO_TEST_CASE(timing_fills_phase_times) {
  const Options options = with("");
  const Layout layout = Layout::build(preset_manifest("tiny"), options);
  FastCudaBackend backend(layout, options);
  FlatState state(layout);
  kGenerator.fill_params(state);
  kGenerator.fill_gradients(state, 1);
  BOOST_TEST(!backend.step(state, options).skipped);  // untimed: loads the kernels
  backend.set_timing(true);
  auto check = [&backend](const char* how) {
    const PhaseTimes& t = backend.phase_times();
    BOOST_TEST_CONTEXT(how) {
      BOOST_TEST(t.total > 0.0);
      BOOST_TEST(t.momentum >= 0.0);
      BOOST_TEST(t.newton_schulz >= 0.0);
      BOOST_TEST(t.normalisation >= 0.0);
      BOOST_TEST(t.update >= 0.0);
      BOOST_TEST(t.adamw >= 0.0);
      const double sum = t.momentum + t.newton_schulz + t.normalisation + t.update + t.adamw;
      BOOST_TEST(std::abs(t.total - sum) <= 1e-6 * t.total + 1e-9, "total " << t.total << ", phases sum to " << sum);
    }
  };
  // Device-resident: an eager enqueue_step(), then finish_step().
  kGenerator.fill_gradients(state, 2);
  upload_gradients(backend, state);
  backend.set_options(options);
  backend.enqueue_step();
  BOOST_TEST(!backend.finish_step(options).skipped);
  check("enqueue_step + finish_step");
  // Through Backend::step.
  backend.device_state().download(state, backend.stream());
  kGenerator.fill_gradients(state, 3);
  BOOST_TEST(!backend.step(state, options).skipped);
  check("step");
}

BOOST_AUTO_TEST_CASE(steps_on_a_callers_stream_equal_steps_on_the_backends_stream) {
  // Steps 1-2 on the backend's own stream, where a graph is captured too; then set_stream() to a stream
  // of the caller's: steps 3-4 through Backend::step, 5-6 device-resident, 7-8 replays of that graph.
  const Options options = odd_options();
  const Layout layout = Layout::build(odd_manifest(), options);
  constexpr int64_t kSteps = 8;
  const FlatState expected = run_cuda(layout, options, kSteps, kGenerator);
  UserStream user;
  FastCudaBackend backend(layout, options);
  FlatState state(layout);
  kGenerator.fill_params(state);
  for (int64_t s = 1; s <= 2; ++s) {
    kGenerator.fill_gradients(state, s);
    BOOST_TEST(!backend.step(state, options).skipped);
  }
  BOOST_REQUIRE_NO_THROW(backend.capture_graph());  // captured, not run
  backend.set_stream(user.stream);
  BOOST_TEST(backend.stream() == user.stream);
  for (int64_t s = 3; s <= 4; ++s) {
    kGenerator.fill_gradients(state, s);
    BOOST_TEST(!backend.step(state, options).skipped);
  }
  for (int64_t s = 5; s <= kSteps; ++s) {
    kGenerator.fill_gradients(state, s);  // gradients only: the device holds the state
    upload_gradients(backend, state);
    backend.set_options(options);
    if (s <= 6)
      backend.enqueue_step();
    else
      backend.replay_graph();
    BOOST_TEST(!backend.finish_step(options).skipped);
  }
  const FlatState actual = download(backend, layout);
  BOOST_TEST(first_difference(expected, actual) == "");
  BOOST_TEST(actual.group_steps[0] == kSteps);
}

// ---- NaN / Inf gradients -------------------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(nonfinite_gradients_change_nothing) {
  const Options options = with("");
  Options skip = options;
  skip.set("nonfinite=skip_step");
  const Layout layout = Layout::build(preset_manifest("tiny"), options);
  const GradientGenerator gen{1234, 0};
  FastCudaBackend backend(layout, options);
  FlatState state(layout);
  gen.fill_params(state);
  for (int64_t s = 1; s <= 2; ++s) {
    gen.fill_gradients(state, s);
    backend.step(state, options);
  }
  const int matrix = layout.find("transformer.h.1.attn.c_proj.weight");
  const int norm = layout.find("transformer.ln_f.weight");  // after the matrix in layout order
  BOOST_REQUIRE(matrix >= 0 && norm > matrix);
  gen.fill_gradients(state, 3);
  const FlatState clean = state;
  state.grad(matrix)[9] = std::numeric_limits<float>::infinity();
  state.grad(matrix)[5] = std::numeric_limits<float>::quiet_NaN();
  state.grad(norm)[2] = -std::numeric_limits<float>::infinity();
  const FlatState before = state;
  // The first bad value in layout order (the matrix, element 5), in begin_step's words.
  const std::string expected_error = prologue_message(state, options);
  const std::string expected_skip = prologue_message(state, skip);
  BOOST_TEST(expected_error.find("transformer.h.1.attn.c_proj.weight") != std::string::npos);
  BOOST_TEST(expected_error.find("element 5") != std::string::npos);

  // Backend::step, nonfinite=error: throws with the same message; host and device state untouched.
  BOOST_CHECK_EXCEPTION(backend.step(state, options), std::runtime_error,
                        [&](const std::runtime_error& e) { return std::string(e.what()) == expected_error; });
  BOOST_TEST(first_difference(before, state) == "");
  BOOST_TEST(first_difference(before, download(backend, layout)) == "");
  // nonfinite=skip_step: skipped with the reason, nothing changed (group steps included).
  const StepResult skipped = backend.step(state, skip);
  BOOST_TEST(skipped.skipped);
  BOOST_TEST(skipped.reason == expected_skip);
  BOOST_TEST(first_difference(before, state) == "");
  BOOST_TEST(first_difference(before, download(backend, layout)) == "");

  // Device-resident: the same through enqueue_step / finish_step.
  upload_gradients(backend, state);
  backend.set_options(skip);
  backend.enqueue_step();
  BOOST_TEST(backend.finish_step(skip).skipped);
  BOOST_TEST(first_difference(before, download(backend, layout)) == "");
  backend.set_options(options);
  backend.enqueue_step();
  BOOST_CHECK_EXCEPTION(backend.finish_step(options), std::runtime_error,
                        [&](const std::runtime_error& e) { return std::string(e.what()) == expected_error; });
  BOOST_TEST(first_difference(before, download(backend, layout)) == "");

  // A replayed graph reads the status too: a bad step changes nothing, the next good one steps.
  upload_gradients(backend, clean);
  backend.enqueue_step();
  BOOST_TEST(!backend.finish_step(options).skipped);
  const FlatState stepped = download(backend, layout);
  BOOST_TEST(stepped.group_steps[0] == before.group_steps[0] + 1);
  backend.capture_graph();
  upload_gradients(backend, state);  // the bad gradients again
  backend.replay_graph();
  BOOST_CHECK_THROW(backend.finish_step(options), std::runtime_error);
  BOOST_TEST(first_difference(stepped, download(backend, layout)) == "");
  upload_gradients(backend, clean);
  backend.replay_graph();
  BOOST_TEST(!backend.finish_step(options).skipped);
  const FlatState replayed = download(backend, layout);
  BOOST_TEST(replayed.group_steps[0] == stepped.group_steps[0] + 1);
  BOOST_TEST(!same_bits(replayed.params, stepped.params));
}

BOOST_AUTO_TEST_CASE(nonfinite_status_sticks_until_finish_step) {
  // finish_step() reports the first bad gradient of any step enqueued since the previous finish_step(),
  // not only of the last one: a NaN step then a clean step, one finish_step(), which throws naming the
  // NaN. The NaN step changed nothing, the clean one stepped: the state equals that of a backend that
  // ran only the clean step. Eagerly and by graph replays.
  const Options options = with("");
  const Layout layout = Layout::build(preset_manifest("tiny"), options);
  const GradientGenerator gen{1234, 0};
  const std::string name = "transformer.h.1.attn.c_proj.weight";
  const int matrix = layout.find(name);
  BOOST_REQUIRE(matrix >= 0);
  for (const bool replay : {false, true}) {
    BOOST_TEST_CONTEXT((replay ? "graph replays" : "eager steps")) {
      FastCudaBackend sticky(layout, options), clean_only(layout, options);
      FlatState a(layout);
      gen.fill_params(a);
      gen.fill_gradients(a, 1);
      FlatState b = a;
      BOOST_TEST(!sticky.step(a, options).skipped);  // eager: loads the kernels before a capture
      BOOST_TEST(!clean_only.step(b, options).skipped);
      if (replay) BOOST_REQUIRE_NO_THROW(sticky.capture_graph());
      auto run = [replay, &sticky] {
        if (replay)
          sticky.replay_graph();
        else
          sticky.enqueue_step();
      };
      FlatState grads(layout);
      gen.fill_gradients(grads, 2);
      FlatState bad = grads;
      bad.grad(matrix)[5] = std::numeric_limits<float>::quiet_NaN();
      upload_gradients(sticky, bad);  // synchronises the stream, which does not clear the status
      sticky.set_options(options);
      run();
      upload_gradients(sticky, grads);
      run();
      BOOST_CHECK_EXCEPTION(sticky.finish_step(options), std::runtime_error, [&](const std::runtime_error& e) {
        const std::string m = e.what();
        BOOST_TEST_MESSAGE("sticky status: " << m);
        return m.find("'" + name + "'") != std::string::npos && m.find("element 5") != std::string::npos &&
               m.find("nan") != std::string::npos;
      });
      upload_gradients(clean_only, grads);
      clean_only.set_options(options);
      clean_only.enqueue_step();
      BOOST_TEST(!clean_only.finish_step(options).skipped);
      const FlatState after_clean = download(clean_only, layout);
      BOOST_TEST(first_difference(after_clean, download(sticky, layout)) == "");
      BOOST_TEST(after_clean.group_steps[0] == 2);
      // That finish_step() cleared the status: the next clean step reports nothing.
      gen.fill_gradients(grads, 3);
      upload_gradients(sticky, grads);
      run();
      StepResult result{true, "not set"};
      BOOST_CHECK_NO_THROW(result = sticky.finish_step(options));
      BOOST_TEST(!result.skipped);
      upload_gradients(clean_only, grads);
      clean_only.enqueue_step();
      BOOST_TEST(!clean_only.finish_step(options).skipped);
      const FlatState next = download(clean_only, layout);
      BOOST_TEST(first_difference(next, download(sticky, layout)) == "");
      BOOST_TEST(next.group_steps[0] == 3);
    }
  }
}

BOOST_AUTO_TEST_CASE(nonfinite_bf16_gradients_are_reported_like_fp32_ones) {
  // A NaN in bf16 gradients: the parameter, the element and "nan", in begin_step's words as for fp32
  // gradients, through Backend::step and device-resident; nothing changes.
  const Options options = with("");
  Options skip = options;
  skip.set("nonfinite=skip_step");
  const Layout layout = Layout::build(preset_manifest("tiny"), options);
  const GradientGenerator gen{1234, 0};
  FastCudaConfig config;
  config.grad_type = cuda::ElemType::bf16;
  FastCudaBackend backend(layout, options, config);
  FlatState state(layout);
  gen.fill_params(state);
  gen.fill_gradients(state, 1);
  BOOST_TEST(!backend.step(state, options).skipped);
  const std::string name = "transformer.h.1.attn.c_proj.weight";
  const int matrix = layout.find(name);
  const int norm = layout.find("transformer.ln_f.weight");  // after the matrix in layout order
  BOOST_REQUIRE(matrix >= 0 && norm > matrix);
  gen.fill_gradients(state, 2);
  state.grad(matrix)[7] = std::numeric_limits<float>::quiet_NaN();
  state.grad(norm)[3] = std::numeric_limits<float>::infinity();
  const FlatState before = state;
  const std::string expected_error = prologue_message(state, options);
  const std::string expected_skip = prologue_message(state, skip);
  BOOST_TEST(expected_error.find("'" + name + "'") != std::string::npos);
  BOOST_TEST(expected_error.find("element 7") != std::string::npos);
  BOOST_TEST(expected_error.find("nan") != std::string::npos);
  auto is_expected = [&](const std::runtime_error& e) {
    BOOST_TEST_MESSAGE("bf16: " << e.what());
    return std::string(e.what()) == expected_error;
  };

  BOOST_CHECK_EXCEPTION(backend.step(state, options), std::runtime_error, is_expected);
  BOOST_TEST(first_difference(before, state) == "");
  BOOST_TEST(first_difference(before, download(backend, layout)) == "");
  const StepResult skipped = backend.step(state, skip);
  BOOST_TEST(skipped.skipped);
  BOOST_TEST(skipped.reason == expected_skip);
  BOOST_TEST(first_difference(before, download(backend, layout)) == "");

  // Device-resident: the caller writes the bf16 gradients.
  std::vector<uint16_t> grads_bf16(static_cast<size_t>(layout.param_floats));
  for (int64_t i = 0; i < layout.param_floats; ++i) grads_bf16[static_cast<size_t>(i)] = bf16_bits(state.grads[i]);
  cuda::DeviceFlatState& d = backend.device_state();
  CHECK_CUDA(cudaMemcpyAsync(d.grads_bf16.data(), grads_bf16.data(), d.grads_bf16.bytes(), cudaMemcpyHostToDevice,
                             backend.stream()));
  CHECK_CUDA(cudaMemcpyAsync(d.has_grad.data(), state.has_grad.data(), d.has_grad.bytes(), cudaMemcpyHostToDevice,
                             backend.stream()));
  CHECK_CUDA(cudaStreamSynchronize(backend.stream()));
  backend.set_options(options);
  backend.enqueue_step();
  BOOST_CHECK_EXCEPTION(backend.finish_step(options), std::runtime_error, is_expected);
  BOOST_TEST(first_difference(before, download(backend, layout)) == "");
}

// ---- bf16 gradients and the bf16 parameter copy ----------------------------------------------------------

BOOST_AUTO_TEST_CASE(bf16_gradients_equal_prerounded_fp32_gradients) {
  for (const bool odd : {false, true}) {
    BOOST_TEST_CONTEXT((odd ? "odd shapes" : "tiny")) {
      const Options options = odd ? odd_options() : with("");
      const Layout layout = Layout::build(odd ? odd_manifest() : preset_manifest("tiny"), options);
      FastCudaConfig bf16_config;
      bf16_config.grad_type = cuda::ElemType::bf16;
      bf16_config.bf16_params = true;
      FastCudaBackend bf16(layout, options, bf16_config), f32(layout, options), resident(layout, options, bf16_config);
      FlatState a(layout);
      kGenerator.fill_params(a);
      FlatState b = a;
      resident.device_state().upload(a, resident.stream());
      std::vector<uint16_t> grads_bf16(static_cast<size_t>(layout.param_floats));
      constexpr int64_t kSteps = 8;
      for (int64_t s = 1; s <= kSteps; ++s) {
        kGenerator.fill_gradients(a, s);
        for (int64_t i = 0; i < layout.param_floats; ++i) {
          b.grads[i] = round_bf16(a.grads[i]);
          grads_bf16[static_cast<size_t>(i)] = bf16_bits(a.grads[i]);
        }
        b.has_grad = a.has_grad;
        BOOST_TEST(!bf16.step(a, options).skipped);  // uploads a's fp32 gradients as bf16
        BOOST_TEST(!f32.step(b, options).skipped);
        // Device-resident: the caller writes bf16 gradients itself.
        cuda::DeviceFlatState& d = resident.device_state();
        CHECK_CUDA(cudaMemcpyAsync(d.grads_bf16.data(), grads_bf16.data(), d.grads_bf16.bytes(), cudaMemcpyHostToDevice,
                                   resident.stream()));
        CHECK_CUDA(cudaMemcpyAsync(d.has_grad.data(), a.has_grad.data(), d.has_grad.bytes(), cudaMemcpyHostToDevice,
                                   resident.stream()));
        CHECK_CUDA(cudaStreamSynchronize(resident.stream()));
        resident.set_options(options);
        resident.enqueue_step();
        BOOST_TEST(!resident.finish_step(options).skipped);
      }
      BOOST_TEST(first_difference(b, a) == "");
      BOOST_TEST(first_difference(a, download(resident, layout)) == "");
      // The bf16 copy is the fp32 master copy rounded to nearest even, in both backends.
      for (FastCudaBackend* backend : {&bf16, &resident}) {
        const std::vector<uint16_t> copy = device_params_bf16(*backend);
        int64_t differing = 0, first = -1;
        for (int64_t i = 0; i < layout.param_floats; ++i)
          if (copy[static_cast<size_t>(i)] != bf16_bits(a.params[i])) {
            if (first < 0) first = i;
            ++differing;
          }
        BOOST_TEST(differing == 0, differing << " bf16 parameters differ, the first at " << first);
      }
    }
  }
}

// ---- parameters without a gradient -----------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(parameters_without_gradients_stay_unchanged) {
  for (const bool odd : {false, true}) {
    BOOST_TEST_CONTEXT((odd ? "odd shapes" : "tiny")) {
      const Options options = odd ? odd_options() : with("");
      const Layout layout = Layout::build(odd ? odd_manifest() : preset_manifest("tiny"), options);
      // tiny: a matrix, the embedding and a bias; odd: both members of the fp32 group (so the group's step
      // doesn't advance), an AdamW vector and a matrix sharing a batch with stepped ones.
      const std::vector<std::string> names =
          odd ? std::vector<std::string>{"b", "tall2", "vec", "idle"}
              : std::vector<std::string>{"transformer.h.1.attn.c_proj.weight", "transformer.wte.weight",
                                         "transformer.h.0.ln_1.bias"};
      std::vector<int> idle;
      for (const auto& n : names) {
        idle.push_back(layout.find(n));
        BOOST_REQUIRE(idle.back() >= 0);
      }
      const GradientGenerator gen{1234, 0};
      FastCudaBackend backend(layout, options);
      FlatState state(layout);
      gen.fill_params(state);
      for (int64_t s = 1; s <= 2; ++s) {  // some state to keep
        gen.fill_gradients(state, s);
        backend.step(state, options);
      }
      const FlatState snapshot = state;
      for (int64_t s = 3; s <= 7; ++s) {
        gen.fill_gradients(state, s);
        for (int e : idle) {
          state.has_grad[e] = 0;
          // Not looked at: a NaN in a gradient that isn't there is no error.
          if (layout.entries[e].numel > 0) state.grad(e)[0] = std::numeric_limits<float>::quiet_NaN();
        }
        BOOST_TEST(!backend.step(state, options).skipped);
      }
      for (int e : idle) {
        const LayoutEntry& le = layout.entries[e];
        BOOST_TEST_CONTEXT(le.name) {
          BOOST_TEST(same_bits(state.param(e), snapshot.param(e), le.numel));
          if (le.algorithm == Algorithm::normuon) {
            BOOST_TEST(same_bits(state.momentum.data() + le.offset, snapshot.momentum.data() + le.offset, le.numel));
            BOOST_TEST(same_bits(state.row_var.data() + le.stat_offset, snapshot.row_var.data() + le.stat_offset,
                                 le.stat_len));
          } else {
            BOOST_TEST(same_bits(state.exp_avg.data() + le.adam_offset, snapshot.exp_avg.data() + le.adam_offset, le.numel));
            BOOST_TEST(same_bits(state.exp_avg_sq.data() + le.adam_offset, snapshot.exp_avg_sq.data() + le.adam_offset,
                                 le.numel));
          }
        }
      }
      // Everything else moved; group steps advance only where a gradient was.
      const int stepped = layout.find(odd ? "a" : "transformer.h.2.attn.c_proj.weight");
      BOOST_TEST(!same_bits(state.param(stepped), snapshot.param(stepped), layout.entries[stepped].numel));
      if (odd)
        BOOST_TEST((state.group_steps == std::vector<int64_t>{7, 7, 2, 7}));  // normuon, adamw, fp32, adam2
      else
        BOOST_TEST((state.group_steps == std::vector<int64_t>{7, 7}));
    }
  }
}

// Issue 12's drift case (drift_case.h) on the GPU: each parameter's own step count drives its AdamW bias
// corrections. Host-exact through Backend::step (it passes the counts) and in table mode
// (set_options(options, group_steps, entry_steps)), derived on the device when set_options gets no counts
// (eager steps, then graph replays; pow on the device may differ from the host's in the last bit of the
// double, which for these counts does not reach the fp32 values); and, for a caller that keeps group
// counters only (set_options(options, group_steps), the Python package before it adopts entry_steps),
// every parameter at its group's counter, as state format version 1 did.
BOOST_AUTO_TEST_CASE(adamw_bias_corrections_use_each_parameters_own_step_count) {
  const Options options = drift_options();
  const Layout layout = Layout::build(drift_manifest(), options);
  FlatState initial(layout);
  drift_generator().fill_params(initial);

  FastCudaBackend flat_backend(layout, options);
  FlatState flat = initial;
  for (int64_t s = 1; s <= kDriftSteps; ++s) {
    fill_drift_gradients(flat, s);
    BOOST_REQUIRE(!flat_backend.step(flat, options).skipped);
  }
  BOOST_TEST(drift_difference(flat, options, kDriftSteps) == "");

  // Device-resident: derived on the device (eager, then replays of a captured graph), and group counters only.
  FastCudaBackend derived(layout, options), groups_only(layout, options);
  derived.device_state().upload(initial, derived.stream());
  groups_only.device_state().upload(initial, groups_only.stream());
  FlatState grads(layout), counters(layout);
  for (int64_t s = 1; s <= kDriftSteps; ++s) {
    fill_drift_gradients(grads, s);
    upload_gradients(derived, grads);
    derived.set_options(options);
    if (s <= 2) {
      derived.enqueue_step();
    } else {
      if (s == 3) BOOST_REQUIRE_NO_THROW(derived.capture_graph());
      derived.replay_graph();
    }
    BOOST_TEST(!derived.finish_step(options).skipped);
    upload_gradients(groups_only, grads);
    groups_only.set_options(options, &counters.group_steps);
    groups_only.enqueue_step();
    BOOST_TEST(!groups_only.finish_step(options).skipped);
    counters.has_grad = grads.has_grad;
    BOOST_REQUIRE(!begin_step(counters, options));  // the host's copy of the counters
  }
  BOOST_TEST(drift_difference(download(derived, layout), options, kDriftSteps) == "");
  const FlatState v1 = download(groups_only, layout);
  for (const char* name : {"a", "b", "e", "s"}) {
    const int e = layout.find(name);
    BOOST_TEST(adamw_difference(v1, e, expected_adamw(layout, options, e, kDriftSteps, /*group_count=*/true)) == "",
               name);
  }

  // Table mode: the caller's device tensors, the counts from the host's copy.
  FastCudaConfig config;
  config.caller_tensors = true;
  FastCudaBackend table_backend(layout, options, config);
  table_backend.device_state().upload(initial, table_backend.stream());
  ParamTable table(layout);
  std::vector<float*> params(layout.entries.size()), device_grads(layout.entries.size());
  for (size_t e = 0; e < layout.entries.size(); ++e) {
    const size_t bytes = sizeof(float) * static_cast<size_t>(std::max<int64_t>(1, layout.entries[e].numel));
    CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&params[e]), bytes));
    CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&device_grads[e]), bytes));
    CHECK_CUDA(cudaMemcpy(params[e], initial.param(static_cast<int>(e)), sizeof(float) * layout.entries[e].numel,
                          cudaMemcpyHostToDevice));
    table.params[e].data = params[e];
  }
  FlatState host_counts(layout);
  for (int64_t s = 1; s <= kDriftSteps; ++s) {
    fill_drift_gradients(grads, s);
    for (size_t e = 0; e < layout.entries.size(); ++e) {
      CHECK_CUDA(cudaMemcpy(device_grads[e], grads.grad(static_cast<int>(e)), sizeof(float) * layout.entries[e].numel,
                            cudaMemcpyHostToDevice));
      table.grads[e] = TensorRef{grads.has_grad[e] ? device_grads[e] : nullptr, DType::f32, {}};
    }
    table_backend.set_tensors(table);
    table_backend.set_options(options, &host_counts.group_steps, &host_counts.entry_steps);
    table_backend.enqueue_step();
    BOOST_TEST(!table_backend.finish_step(options).skipped);
    host_counts.has_grad = grads.has_grad;
    BOOST_REQUIRE(!begin_step(host_counts, options));
  }
  FlatState from_table(layout);
  table_backend.device_state().download(from_table, table_backend.stream());
  for (size_t e = 0; e < layout.entries.size(); ++e) {
    CHECK_CUDA(cudaMemcpy(from_table.param(static_cast<int>(e)), params[e], sizeof(float) * layout.entries[e].numel,
                          cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaFree(params[e]));
    CHECK_CUDA(cudaFree(device_grads[e]));
  }
  BOOST_TEST(drift_difference(from_table, options, kDriftSteps) == "");
  BOOST_TEST(from_table.entry_steps == host_counts.entry_steps);
}
