// The reference on CUDA (docs/reference.md): reference-cuda against reference-cpu bit for bit
// (the same chains and sums), bitwise run-to-run, state files crossing from the GPU to the CPU, odd shapes, and the flat
// device-resident entry point (step_flat on wrap_flat views) against step(FlatState&).
//
// The CPU-side checks (availability reporting, step_flat and its NaN/Inf prologue on host views) always
// run. Without a usable CUDA device the CUDA cases are skipped by precondition and, when everything that
// ran passed, the program prints "SKIPPED: <reason>" and exits with 77 (CTest's SKIP_RETURN_CODE).
#define BOOST_TEST_MODULE reference_cuda
#define BOOST_TEST_NO_MAIN
#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <limits>
#include <string>
#include <vector>

#include "comparator.h"
#include "normuon/grad_gen.h"
#include "normuon/presets.h"
#include "normuon/state_file.h"
#include "reference_backend.h"

using namespace normuon;
namespace utf = boost::unit_test;

namespace {

const GradientGenerator kGenerator{1234, 7};

const std::string& cuda_reason() {
  static const std::string reason = ReferenceBackend::unavailable_reason(ReferenceDevice::cuda);
  return reason;
}

// Precondition of the CUDA cases: skipped (not failed) without a usable device.
boost::test_tools::assertion_result cuda_available(utf::test_unit_id) {
  boost::test_tools::assertion_result r(cuda_reason().empty());
  r.message() << "reference-cuda unavailable: " << cuda_reason();
  return r;
}

bool same_floats(const AlignedBuffer& a, const AlignedBuffer& b) {
  return a.size() == b.size() &&
         (a.size() == 0 || std::memcmp(a.data(), b.data(), sizeof(float) * static_cast<size_t>(a.size())) == 0);
}

// Parameters, optimizer state and group steps equal bit for bit.
bool same_state(const FlatState& a, const FlatState& b) {
  return same_floats(a.params, b.params) && a.same_optimizer_state(b);
}

FlatTensors host_views(FlatState& s) {
  return wrap_flat(*s.layout, s.params.data(), s.grads.data(), s.momentum.data(), s.row_var.data(),
                   s.exp_avg.data(), s.exp_avg_sq.data(), ReferenceDevice::cpu);
}

// reference-cpu and reference-cuda from the same state, `steps` steps of the same gradients: the same bits
// after every step (docs/reference.md: the CUDA kernels compute the CPU's chains and sums). Returns the
// first step at which they differ, 0 if none.
int64_t first_difference(const Layout& layout, const Options& options, int64_t steps) {
  ReferenceBackend cpu, cuda(ReferenceDevice::cuda);
  FlatState cpu_state(layout), cuda_state(layout);
  kGenerator.fill_params(cpu_state);
  kGenerator.fill_params(cuda_state);
  for (int64_t step = 1; step <= steps; ++step) {
    kGenerator.fill_gradients(cpu_state, step);
    kGenerator.fill_gradients(cuda_state, step);
    cpu.step(cpu_state, options);
    cuda.step(cuda_state, options);
    if (!same_state(cpu_state, cuda_state)) return step;
  }
  return 0;
}

void run_steps(Backend& backend, FlatState& s, const Options& o, int64_t first, int64_t last) {
  for (int64_t step = first; step <= last; ++step) {
    kGenerator.fill_gradients(s, step);
    backend.step(s, o);
  }
}

// 1 x n, n x 1, prime sizes, more rows than columns, the 16^3 bf16 product boundary, plus AdamW tensors
// of odd lengths, a scalar and empty parameters.
Manifest odd_manifest() {
  Manifest m;
  const std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {
      {"row", {1, 37}},       {"col", {37, 1}},     {"prime", {31, 17}},  {"prime_wide", {17, 31}},
      {"tall", {97, 13}},     {"big", {257, 131}},  {"square16", {16, 16}}, {"two", {2, 3}},
      {"empty_matrix", {0, 5}}, {"bias", {37}},     {"scalar", {}},       {"empty", {0}}};
  for (const auto& [name, shape] : shapes) {
    ParamSpec p;
    p.name = name;
    p.shape = shape;
    p.role = shape.size() == 2 ? Role::matrix : Role::bias;
    m.params.push_back(p);
  }
  ParamSpec emb;
  emb.name = "embedding";
  emb.shape = {53, 7};
  emb.role = Role::embedding;
  m.params.push_back(emb);
  return m;
}

}  // namespace

// ---- always: availability, and step_flat on host views --------------------------------------------------

BOOST_AUTO_TEST_CASE(cuda_availability_is_reported_and_enforced) {
  const std::string& reason = cuda_reason();
  BOOST_TEST_MESSAGE("unavailable_reason(cuda) = \"" << reason << "\"");
  BOOST_TEST(ReferenceBackend::unavailable_reason(ReferenceDevice::cpu).empty());
  const bool libtorch_has_cuda = at::globalContext().hasCUDART();
  const bool gpu_present = std::filesystem::exists("/dev/nvidia0");
  if (!libtorch_has_cuda) {
    BOOST_TEST(reason.find("without CUDA") != std::string::npos, reason);
  } else if (gpu_present) {
    BOOST_TEST(reason.empty(), "a GPU is present and libtorch has CUDA, but: " << reason);
  }
  if (!gpu_present) BOOST_TEST(!reason.empty());  // no GPU can be visible here

  if (reason.empty()) {
    ReferenceBackend cuda(ReferenceDevice::cuda);
    BOOST_TEST(cuda.name() == "reference-cuda");
    BOOST_TEST((cuda.device() == ReferenceDevice::cuda));
  } else {
    BOOST_CHECK_EXCEPTION(ReferenceBackend{ReferenceDevice::cuda}, std::invalid_argument,
                          [&reason](const std::invalid_argument& e) {
                            return std::string(e.what()).find(reason) != std::string::npos;
                          });
    const Layout layout = Layout::build(preset_manifest("tiny"), Options());
    FlatState s(layout);
    BOOST_CHECK_THROW(wrap_flat(layout, s.params.data(), s.grads.data(), s.momentum.data(), s.row_var.data(),
                                s.exp_avg.data(), s.exp_avg_sq.data(), ReferenceDevice::cuda),
                      std::invalid_argument);
  }
}

BOOST_AUTO_TEST_CASE(cpu_backend_is_the_default) {
  BOOST_TEST(ReferenceBackend().name() == "reference-cpu");
  BOOST_TEST((ReferenceBackend().device() == ReferenceDevice::cpu));
  BOOST_TEST(ReferenceBackend(ReferenceDevice::cpu).name() == "reference-cpu");
  BOOST_TEST(std::string(to_string(ReferenceDevice::cuda)) == "cuda");
}

BOOST_AUTO_TEST_CASE(step_flat_on_host_views_equals_step) {
  for (const char* precision : {"bf16", "fp32"}) {
    Options options;
    options.set(std::string("normuon.ns_precision=") + precision);
    options.set("weight_decay=0.1");
    const Layout layout = Layout::build(preset_manifest("tiny"), options);
    ReferenceBackend a, b;
    FlatState sa(layout), sb(layout);
    kGenerator.fill_params(sa);
    kGenerator.fill_params(sb);
    FlatTensors views = host_views(sb);
    for (int64_t step = 1; step <= 8; ++step) {  // period 7: some steps have parameters without gradients
      kGenerator.fill_gradients(sa, step);
      kGenerator.fill_gradients(sb, step);
      BOOST_TEST(!a.step(sa, options).skipped);
      BOOST_TEST(!b.step_flat(layout, views, sb.has_grad, sb.group_steps, sb.entry_steps, options).skipped);
      BOOST_TEST(same_state(sa, sb), precision << " step " << step);
    }
  }
}

BOOST_AUTO_TEST_CASE(step_flat_on_odd_shapes_equals_step) {
  const Options options;
  const Layout layout = Layout::build(odd_manifest(), options);
  ReferenceBackend a, b;
  FlatState sa(layout), sb(layout);
  kGenerator.fill_params(sa);
  kGenerator.fill_params(sb);
  FlatTensors views = host_views(sb);
  for (int64_t step = 1; step <= 4; ++step) {
    kGenerator.fill_gradients(sa, step);
    kGenerator.fill_gradients(sb, step);
    a.step(sa, options);
    b.step_flat(layout, views, sb.has_grad, sb.group_steps, sb.entry_steps, options);
    BOOST_TEST(same_state(sa, sb), "step " << step);
  }
}

BOOST_AUTO_TEST_CASE(step_flat_reports_nonfinite_gradients_like_begin_step) {
  const Layout layout = Layout::build(preset_manifest("tiny"), Options());
  FlatState s(layout);
  kGenerator.fill_params(s);
  kGenerator.fill_gradients(s, 1);
  std::fill(s.has_grad.begin(), s.has_grad.end(), uint8_t{1});
  const int bad = layout.find("transformer.h.2.mlp.c_fc.weight");
  s.grad(bad)[17] = std::numeric_limits<float>::quiet_NaN();
  s.grad(bad)[40] = std::numeric_limits<float>::infinity();  // not the first: not reported
  const FlatState before = s;
  FlatTensors views = host_views(s);
  ReferenceBackend backend;

  auto message_of = [&](auto&& run) {
    try {
      run();
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("no exception");
  };
  const std::string from_step = message_of([&] { backend.step(s, Options()); });
  const std::string from_flat =
      message_of([&] { backend.step_flat(layout, views, s.has_grad, s.group_steps, s.entry_steps, Options()); });
  BOOST_TEST(from_step.find("element 17") != std::string::npos, from_step);
  BOOST_TEST(from_flat == from_step);
  BOOST_TEST(same_state(s, before));

  Options skip;
  skip.set("nonfinite=skip_step");
  const StepResult r1 = backend.step(s, skip);
  const StepResult r2 = backend.step_flat(layout, views, s.has_grad, s.group_steps, s.entry_steps, skip);
  BOOST_TEST(r1.skipped);
  BOOST_TEST(r2.skipped);
  BOOST_TEST(r2.reason == r1.reason);
  BOOST_TEST(same_state(s, before));

  // A parameter without a gradient may hold anything; so may the padding between slots.
  s.has_grad[bad] = 0;
  const LayoutEntry& first = layout.entries[0];
  const bool padded = align_up(first.numel) > first.numel;
  if (padded) s.grads[first.offset + first.numel] = std::numeric_limits<float>::quiet_NaN();
  BOOST_TEST(!backend.step_flat(layout, views, s.has_grad, s.group_steps, s.entry_steps, Options()).skipped);
  BOOST_TEST(!same_floats(s.params, before.params));
}

BOOST_AUTO_TEST_CASE(step_flat_rejects_tensors_that_do_not_fit) {
  const Layout layout = Layout::build(preset_manifest("tiny"), Options());
  FlatState s(layout);
  ReferenceBackend backend;
  std::vector<int64_t> steps = s.group_steps, entry_steps = s.entry_steps;
  {
    FlatTensors t = host_views(s);
    t.row_var = t.row_var.narrow(0, 0, t.row_var.numel() - 1);
    BOOST_CHECK_THROW(backend.step_flat(layout, t, s.has_grad, steps, entry_steps, Options()), std::invalid_argument);
  }
  {
    FlatTensors t = host_views(s);
    t.exp_avg = t.exp_avg.to(at::kDouble);
    BOOST_CHECK_THROW(backend.step_flat(layout, t, s.has_grad, steps, entry_steps, Options()), std::invalid_argument);
  }
  {
    FlatTensors t = host_views(s);
    std::vector<uint8_t> flags(s.has_grad.size() + 1, 1);
    BOOST_CHECK_THROW(backend.step_flat(layout, t, flags, steps, entry_steps, Options()), std::invalid_argument);
  }
  {
    FlatTensors t = host_views(s);
    std::vector<int64_t> short_entries(entry_steps.size() - 1, 0);
    BOOST_CHECK_THROW(backend.step_flat(layout, t, s.has_grad, steps, short_entries, Options()), std::invalid_argument);
  }
  BOOST_TEST((steps == s.group_steps));  // nothing advanced
  BOOST_TEST((entry_steps == s.entry_steps));
}

// ---- CUDA -----------------------------------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(cuda_matches_cpu_on_tiny, *utf::precondition(cuda_available)) {
  const std::vector<std::vector<std::string>> variants = {
      {},
      {"normuon.ns_precision=fp32"},
      {"weight_decay=0.1", "normuon.weight_decay_mode=cautious"},
      {"normuon.ns_coefficients=polar_express", "normuon.eps_placement=clamp"},
      {"normuon.reduce_axis=longer_dim", "normuon.lr_scale=spectral", "normuon.nesterov=false"},
  };
  for (const auto& variant : variants) {
    Options options;
    std::string label = "defaults";
    for (const auto& kv : variant) options.set(kv);
    if (!variant.empty()) label = variant.front() + (variant.size() > 1 ? " ..." : "");
    const Layout layout = Layout::build(preset_manifest("tiny"), options);
    BOOST_TEST(first_difference(layout, options, 10) == 0, label);
  }
}

BOOST_AUTO_TEST_CASE(cuda_runs_are_bitwise_identical, *utf::precondition(cuda_available)) {
  Options options;
  options.set("weight_decay=0.1");
  const Layout layout = Layout::build(preset_manifest("tiny"), options);
  FlatState first(layout), second(layout);
  kGenerator.fill_params(first);
  kGenerator.fill_params(second);
  ReferenceBackend a(ReferenceDevice::cuda);
  run_steps(a, first, options, 1, 10);
  ReferenceBackend b(ReferenceDevice::cuda);  // a fresh backend: fresh device buffers
  run_steps(b, second, options, 1, 10);
  BOOST_TEST(same_state(first, second));
}

BOOST_AUTO_TEST_CASE(cuda_state_file_continues_on_cpu, *utf::precondition(cuda_available)) {
  Options options;
  options.set("weight_decay=0.1");
  const Layout layout = Layout::build(preset_manifest("tiny"), options);
  const std::string path = "reference_cuda_test.safetensors";
  ReferenceBackend cuda(ReferenceDevice::cuda), cpu;

  FlatState on_gpu(layout);
  kGenerator.fill_params(on_gpu);
  run_steps(cuda, on_gpu, options, 1, 5);
  save_state(path, on_gpu, options, cuda.name());
  BOOST_TEST(read_state_header(path).backend == "reference-cuda");

  FlatState resumed(layout);
  Options loaded;
  load_state(path, resumed, &loaded);
  std::remove(path.c_str());
  BOOST_TEST(loaded.to_json() == options.to_json());
  BOOST_TEST(same_state(resumed, on_gpu));

  // The CPU continues from the GPU's state; the GPU continues too; they stay equal bit for bit.
  run_steps(cpu, resumed, loaded, 6, 10);
  run_steps(cuda, on_gpu, options, 6, 10);
  BOOST_TEST((resumed.group_steps == on_gpu.group_steps));
  BOOST_TEST(resumed.group_steps[0] > 5);
  BOOST_TEST(same_state(resumed, on_gpu));
}

BOOST_AUTO_TEST_CASE(cuda_matches_cpu_on_odd_shapes, *utf::precondition(cuda_available)) {
  for (const char* precision : {"bf16", "fp32"}) {
    Options options;
    options.set(std::string("normuon.ns_precision=") + precision);
    const Layout layout = Layout::build(odd_manifest(), options);
    BOOST_TEST(first_difference(layout, options, 6) == 0, precision);
  }
}

BOOST_AUTO_TEST_CASE(step_flat_on_device_views_equals_step, *utf::precondition(cuda_available)) {
  Options options;
  options.set("weight_decay=0.1");
  const Layout layout = Layout::build(preset_manifest("tiny"), options);
  FlatState via_step(layout), via_flat(layout);
  kGenerator.fill_params(via_step);
  kGenerator.fill_params(via_flat);

  // Device memory owned outside the backend (as the fast CUDA backend's would be), wrapped by pointer.
  const at::TensorOptions fp32 = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA);
  FlatTensors host = host_views(via_flat);
  std::vector<at::Tensor> owned;
  for (const at::Tensor* h : {&host.params, &host.grads, &host.momentum, &host.row_var, &host.exp_avg,
                              &host.exp_avg_sq})
    owned.push_back(at::empty({h->numel()}, fp32));
  FlatTensors device = wrap_flat(layout, owned[0].data_ptr<float>(), owned[1].data_ptr<float>(),
                                 owned[2].data_ptr<float>(), owned[3].data_ptr<float>(), owned[4].data_ptr<float>(),
                                 owned[5].data_ptr<float>(), ReferenceDevice::cuda);
  BOOST_TEST(device.params.is_cuda());
  device.params.copy_(host.params);
  device.momentum.copy_(host.momentum);
  device.row_var.copy_(host.row_var);
  device.exp_avg.copy_(host.exp_avg);
  device.exp_avg_sq.copy_(host.exp_avg_sq);

  ReferenceBackend a(ReferenceDevice::cuda), b(ReferenceDevice::cuda);
  for (int64_t step = 1; step <= 8; ++step) {
    kGenerator.fill_gradients(via_step, step);
    kGenerator.fill_gradients(via_flat, step);
    a.step(via_step, options);
    device.grads.copy_(host.grads);
    b.step_flat(layout, device, via_flat.has_grad, via_flat.group_steps, via_flat.entry_steps, options);
  }
  host.params.copy_(device.params);
  host.momentum.copy_(device.momentum);
  host.row_var.copy_(device.row_var);
  host.exp_avg.copy_(device.exp_avg);
  host.exp_avg_sq.copy_(device.exp_avg_sq);
  BOOST_TEST(same_state(via_step, via_flat));

  // A CPU backend refuses device tensors (and the CUDA one host tensors).
  ReferenceBackend cpu;
  BOOST_CHECK_THROW(
      cpu.step_flat(layout, device, via_flat.has_grad, via_flat.group_steps, via_flat.entry_steps, options),
      std::invalid_argument);
  BOOST_CHECK_THROW(b.step_flat(layout, host, via_flat.has_grad, via_flat.group_steps, via_flat.entry_steps, options),
                    std::invalid_argument);
}

BOOST_AUTO_TEST_CASE(cuda_reports_nonfinite_gradients_like_cpu, *utf::precondition(cuda_available)) {
  const Layout layout = Layout::build(preset_manifest("tiny"), Options());
  FlatState s(layout);
  kGenerator.fill_params(s);
  kGenerator.fill_gradients(s, 1);
  std::fill(s.has_grad.begin(), s.has_grad.end(), uint8_t{1});
  const int bad = layout.find("transformer.h.1.attn.c_attn.weight");
  s.grad(bad)[123] = -std::numeric_limits<float>::infinity();
  const FlatState before = s;
  ReferenceBackend cpu, cuda(ReferenceDevice::cuda);
  std::string cpu_message, cuda_message;
  try {
    cpu.step(s, Options());
  } catch (const std::runtime_error& e) {
    cpu_message = e.what();
  }
  try {
    cuda.step(s, Options());
  } catch (const std::runtime_error& e) {
    cuda_message = e.what();
  }
  BOOST_TEST(cpu_message.find("element 123") != std::string::npos, cpu_message);
  BOOST_TEST(cuda_message == cpu_message);
  BOOST_TEST(same_state(s, before));
  Options skip;
  skip.set("nonfinite=skip_step");
  const StepResult r = cuda.step(s, skip);
  BOOST_TEST(r.skipped);
  BOOST_TEST(r.reason == cpu.step(s, skip).reason);
  BOOST_TEST(same_state(s, before));
}

BOOST_AUTO_TEST_CASE(cuda_phase_times_are_recorded, *utf::precondition(cuda_available)) {
  const Layout layout = Layout::build(preset_manifest("tiny"), Options());
  FlatState s(layout);
  kGenerator.fill_params(s);
  ReferenceBackend cuda(ReferenceDevice::cuda);
  cuda.set_timing(true);
  run_steps(cuda, s, Options(), 1, 2);
  const PhaseTimes& t = cuda.phase_times();
  BOOST_TEST(t.newton_schulz > 0);
  BOOST_TEST(t.adamw > 0);
  BOOST_TEST(t.total >= t.momentum + t.newton_schulz + t.normalisation + t.update + t.adamw);
}

int main(int argc, char* argv[]) {
  const int rc = utf::unit_test_main(&init_unit_test, argc, argv);
  if (rc == 0 && !cuda_reason().empty()) {
    std::cout << "SKIPPED: " << cuda_reason() << " (reference-cuda cases not run; the CPU-side checks passed)"
              << std::endl;
    return 77;
  }
  return rc;
}
