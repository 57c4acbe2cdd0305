#include "cuda_bench.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <stdexcept>

#include "normuon/grad_gen.h"
#include "normuon/ns_algorithm.h"

#ifdef NORMUON_HAVE_FAST_CUDA  // defined by the build where the CUDA backend is built
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "cuda_check.h"
#include "cuda_device.h"
#include "cuda_timing.h"
#include "device_buffer.h"
#include "fast_cuda_backend.h"
#include "machine_info.h"
#include "reference_backend.h"
#endif

namespace normuon::bench {

CudaTraffic count_cuda_traffic(const Layout& layout, const Options& options, double grad_bytes) {
  CudaTraffic t;
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

NsFlops count_ns_flops(const Layout& layout, const Options& options) {
  NsFlops f;
  for (const LayoutEntry& e : layout.entries) {
    if (e.algorithm != Algorithm::normuon || e.numel == 0) continue;
    const NorMuonHyper& h = options.groups[e.group].normuon;
    f.useful += ns_standard_dense_flops(e.rows, e.cols, h.ns_steps);
    f.dense += ns_dense_flops(h.ns_algorithm, e.rows, e.cols, h.ns_steps);
  }
  return f;
}

std::string cuda_bench_unavailable_reason(int device) {
#ifdef NORMUON_HAVE_FAST_CUDA
  return cuda::unavailable_reason(device);
#else
  (void)device;
  return "this build has no CUDA backend (configured with -DNORMUON_BUILD_CUDA=OFF)";
#endif
}

#ifndef NORMUON_HAVE_FAST_CUDA

CudaBenchResult run_cuda_bench(const Layout&, const Options&, const CudaBenchConfig& config, Transcript&) {
  throw std::runtime_error(cuda_bench_unavailable_reason(config.device));
}

#else

namespace {

std::string version_string(int v) {  // 13000 -> "13.0"
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

void check(const StepResult& r, const char* what) {
  if (r.skipped) throw std::runtime_error(std::string(what) + ": a step was skipped: " + r.reason);
}

}  // namespace

CudaBenchResult run_cuda_bench(const Layout& layout, const Options& options, const CudaBenchConfig& config,
                               Transcript& log) {
  using Clock = std::chrono::steady_clock;
  using cuda::DeviceBuffer;
  if (config.warmup < 0 || config.repeats < 1 || config.steps_per_sample < 1 ||
      (config.grad_dtype != "f32" && config.grad_dtype != "bf16"))
    throw std::invalid_argument("run_cuda_bench: needs warmup >= 0, repeats >= 1, steps_per_sample >= 1 and "
                                "grad_dtype f32 or bf16");
  const int dev = config.device;
  if (const std::string reason = FastCudaBackend::unsupported_reason(layout, options, dev); !reason.empty())
    throw std::invalid_argument("fast-cuda cannot run this model with these options: " + reason);
  NORMUON_CUDA_CHECK(cudaSetDevice(dev));
  const bool quiet = config.quiet;
  const bool bf16_grads = config.grad_dtype == "bf16";
  const double grad_bytes = bf16_grads ? 2 : 4;
  const int64_t warmup = config.warmup, repeats = config.repeats, steps_per_sample = config.steps_per_sample;

  CudaBenchResult r;
  r.model = config.model;
  r.command = config.command;
  r.grad_dtype = config.grad_dtype;
  r.device = dev;
  r.warmup = warmup;
  r.repeats = repeats;
  r.steps_per_sample = steps_per_sample;
  r.parameters = layout.entries.size();
  r.buckets = layout.buckets.size();

  // ---- header: model, device, software, run
  r.traffic = count_cuda_traffic(layout, options, grad_bytes);
  const CudaTraffic& traffic = r.traffic;
  const NsFlops ns_flops = count_ns_flops(layout, options);  // actual: the backend's own count, below
  r.ns_flops = ns_flops.useful;
  r.ns_dense_flops = ns_flops.dense;
  r.ns_algorithm = ns_algorithms_of(layout, options);
  int driver = 0, runtime = 0;
  NORMUON_CUDA_CHECK(cudaDriverGetVersion(&driver));
  NORMUON_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  const size_t lt_version = cublasLtGetVersion();
  size_t free_bytes = 0, total_bytes = 0;
  NORMUON_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  r.device_name = cuda::describe_device(dev);
  const std::string kernel_driver = nvidia_driver_version();
  r.software = format("driver %s(CUDA %s), runtime %s, cuBLASLt %zu.%zu.%zu",
                      kernel_driver.empty() ? "" : (kernel_driver + " ").c_str(), version_string(driver).c_str(),
                      version_string(runtime).c_str(), lt_version / 10000, (lt_version / 100) % 100, lt_version % 100);
  r.date = utc_now("%Y-%m-%d %H:%M UTC");
  for (const auto& g : options.groups)
    if (g.algorithm == Algorithm::normuon)
      r.ns_precisions += (r.ns_precisions.empty() ? "" : ", ") + g.name + ": " + to_string(g.normuon.ns_algorithm) +
                         " " + to_string(g.normuon.ns_precision) + " (" + to_string(g.normuon.ns_coefficients) + ", " +
                         std::to_string(g.normuon.ns_steps) + " steps)";
  r.reference_reason = config.reference ? "" : "skipped (--no-reference)";
  if (r.reference_reason.empty()) {
    const std::string why = ReferenceBackend::unavailable_reason(ReferenceDevice::cuda);
    if (!why.empty()) r.reference_reason = "unavailable: " + why;
  }
  bool run_reference = r.reference_reason.empty();

  log.say("normuon bench-cuda: %s (%zu parameters, %s floats: %s on NorMuon in %zu matrices, %zu shape buckets; %s on "
          "AdamW)\n",
          r.model.c_str(), layout.entries.size(), with_commas(traffic.normuon_elements + traffic.adamw_elements).c_str(),
          with_commas(traffic.normuon_elements).c_str(), static_cast<size_t>(traffic.matrices), layout.buckets.size(),
          with_commas(traffic.adamw_elements).c_str());
  log.say("device %d: %s (%.1f GiB free); %s\n", dev, r.device_name.c_str(), static_cast<double>(free_bytes) / (1 << 30),
          r.software.c_str());
  log.say("run: %s; warm-up %lld, repeats %lld, %lld steps per whole-step sample; gradients %s; Newton-Schulz %s\n",
          r.date.c_str(), static_cast<long long>(warmup), static_cast<long long>(repeats),
          static_cast<long long>(steps_per_sample), r.grad_dtype.c_str(),
          r.ns_precisions.empty() ? "unused" : r.ns_precisions.c_str());
  log.say("command: %s\n", r.command.c_str());
  log.say("reference-cuda: %s\n", run_reference ? "will run on the same device buffers" : r.reference_reason.c_str());

  // ---- state: the generator's parameters and step-1 gradients, uploaded once
  FastCudaConfig fast_config;
  fast_config.device = dev;
  fast_config.grad_type = bf16_grads ? cuda::ElemType::bf16 : cuda::ElemType::f32;
  fast_config.ns_panel_width = config.ns_panel_width;
  const GradientGenerator generator{config.seed, 0};
  FastCudaBackend fast(layout, options, fast_config);
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
        r.reference_reason = std::string("skipped: no room for its fp32 gradient copy (") + e.what() + ")";
        log.say("reference-cuda: %s\n", r.reference_reason.c_str());
      }
    }
  }
  r.ns_actual_flops = fast.newton_schulz_flops();
  if (!quiet) log.say("%s", fast.describe().c_str());

  // ---- 1. eager with per-phase timers
  fast.set_timing(true);
  for (int64_t i = 0; i < warmup + repeats; ++i) {
    const auto t0 = Clock::now();
    fast.enqueue_step();
    const auto t1 = Clock::now();
    check(fast.finish_step(options), "fast-cuda");
    if (i < warmup) continue;
    r.fast_phases.push_back(fast.phase_times());
    r.enqueue_us.push_back(ms_between(t0, t1) * 1e3);
    if (!quiet)
      log.say("fast-cuda eager, timers, step %lld: %.3f ms\n", static_cast<long long>(i - warmup + 1),
              fast.phase_times().total);
  }
  fast.set_timing(false);

  // ---- 2. eager without timers; 3. CUDA graph
  for (int64_t i = 0; i < warmup; ++i) fast.enqueue_step();
  check(fast.finish_step(options), "fast-cuda");
  r.eager_ms = time_chained(fast.stream(), repeats, steps_per_sample, [&] { fast.enqueue_step(); });
  check(fast.finish_step(options), "fast-cuda");
  if (!quiet)
    for (size_t i = 0; i < r.eager_ms.size(); ++i)
      log.say("fast-cuda eager, sample %zu: %.3f ms per step\n", i + 1, r.eager_ms[i]);

  fast.capture_graph();
  for (int64_t i = 0; i < std::max<int64_t>(warmup, 1); ++i) fast.replay_graph();  // the first replay uploads it
  check(fast.finish_step(options), "fast-cuda (graph)");
  for (int64_t i = 0; i < repeats; ++i) {  // host cost of one launch, queue empty
    const auto t0 = Clock::now();
    fast.replay_graph();
    r.graph_launch_us.push_back(ms_between(t0, Clock::now()) * 1e3);
    NORMUON_CUDA_CHECK(cudaStreamSynchronize(fast.stream()));
  }
  r.graph_ms = time_chained(fast.stream(), repeats, steps_per_sample, [&] { fast.replay_graph(); });
  check(fast.finish_step(options), "fast-cuda (graph)");
  if (!quiet)
    for (size_t i = 0; i < r.graph_ms.size(); ++i)
      log.say("fast-cuda graph, sample %zu: %.3f ms per step\n", i + 1, r.graph_ms[i]);
  r.launches = fast.launches_per_step();
  r.graph_nodes = fast.graph_kernel_nodes();

  // ---- 4. the device's rates, on the same (now warm) device
  r.copy = measure_copy(static_cast<size_t>(config.copy_mib) << 20, warmup, repeats);
  r.gemm = measure_gemm(config.gemm_size, warmup, repeats);

  // ---- 5. the reference on the same device buffers
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
      std::vector<int64_t> entry_steps(layout.entries.size(), 0);
      if (!entry_steps.empty())
        NORMUON_CUDA_CHECK(cudaMemcpy(entry_steps.data(), ds.entry_steps.data(), entry_steps.size() * sizeof(int64_t),
                                      cudaMemcpyDeviceToHost));
      ReferenceBackend reference(ReferenceDevice::cuda);
      reference.set_timing(false);
      for (int64_t i = 0; i < warmup + repeats; ++i) {
        NORMUON_CUDA_CHECK(cudaDeviceSynchronize());
        const auto t0 = Clock::now();
        check(reference.step_flat(layout, t, has_grad, group_steps, entry_steps, options), "reference-cuda");
        NORMUON_CUDA_CHECK(cudaDeviceSynchronize());
        const double ms = ms_between(t0, Clock::now());
        if (i < warmup) continue;
        r.reference_ms.push_back(ms);
        if (!quiet) log.say("reference-cuda, step %lld: %.3f ms\n", static_cast<long long>(i - warmup + 1), ms);
      }
      reference.set_timing(true);  // its clock synchronises the device at every phase of every parameter
      for (int64_t i = 0; i < repeats; ++i) {
        NORMUON_CUDA_CHECK(cudaDeviceSynchronize());
        check(reference.step_flat(layout, t, has_grad, group_steps, entry_steps, options), "reference-cuda");
        r.reference_phases.push_back(reference.phase_times());
        if (!quiet)
          log.say("reference-cuda, timers, step %lld: %.3f ms\n", static_cast<long long>(i + 1),
                  reference.phase_times().total);
      }
    } catch (const std::exception& e) {
      static_cast<void>(cudaDeviceSynchronize());  // leave the device usable for what follows
      static_cast<void>(cudaGetLastError());
      run_reference = false;
      r.reference_reason = std::string("failed: ") + e.what();
      r.reference_ms.clear();
      r.reference_phases.clear();
      log.say("reference-cuda: %s\n", r.reference_reason.c_str());
    }
  }
  r.reference_ran = run_reference;
  return r;
}

#endif  // NORMUON_HAVE_FAST_CUDA

}  // namespace normuon::bench
