// First: the CUDA builtins for the host compiler, then the device code of the fused step itself.
#include "simt.h"
#include "ns_run.cuh"
#include "step_kernels.cuh"

#include "emulated_cuda_backend.h"

#include <cstring>
#include <stdexcept>

#include "lt_matmul_emulation.h"
#include "normuon/ns_coefficients.h"
#include "ns_batch_geometry.h"
#include "step_plan.h"

namespace normuon::test {
namespace {

// A device allocation of BatchedNewtonSchulz: bytes that a batch reads as bf16 or fp32. Device memory is
// not cleared: every bit set (NaN in bf16 and fp32) makes a read of an element nobody wrote show up in
// the results.
struct DeviceBytes {
  std::vector<float> storage;  // float-aligned; bf16 batches read it as twice as many halves

  explicit DeviceBytes(int64_t bytes = 0) : storage(static_cast<size_t>((bytes + 3) / 4)) {
    std::memset(static_cast<void*>(storage.data()), 0xff, storage.size() * sizeof(float));
  }
  template <typename T>
  LtBuffer<T> as() {
    return {reinterpret_cast<T*>(storage.data()),
            static_cast<int64_t>(storage.size() * sizeof(float) / sizeof(T))};
  }
};

struct NsBatch {
  cuda::NsBatchShape shape;
  cuda::NsBatchGeometry geometry;
};

// Shared by the batches and sized for the largest, as BatchedNewtonSchulz allocates them: X (each batch's
// P(U) in, O out), A, C/B, T (s x s) and U (X-shaped), Gram's Q, Z and T2 (s x s, only with a Gram batch),
// the norm kernels' partial sums.
struct NsWorkspace {
  DeviceBytes x, gram, bmat, tmat, umat, qmat, zmat, t2mat;
  std::vector<double> partials;

  void size_for(const std::vector<NsBatch>& batches) {
    cuda::NsWorkspaceSizes sizes;
    for (const NsBatch& b : batches) sizes.add(b.shape, b.geometry);
    x = DeviceBytes(sizes.x);
    gram = DeviceBytes(sizes.square);
    bmat = DeviceBytes(sizes.square);
    tmat = DeviceBytes(sizes.square);
    umat = DeviceBytes(sizes.x);
    qmat = DeviceBytes(sizes.gram_only);
    zmat = DeviceBytes(sizes.gram_only);
    t2mat = DeviceBytes(sizes.gram_only);
    partials.resize(static_cast<size_t>(sizes.partials));
  }
};

NsBatch make_batch(const cuda::NsBatchShape& shape) { return NsBatch{shape, cuda::ns_batch_geometry(shape)}; }

// BatchedNewtonSchulz::run on the host: the same run_newton_schulz or run_gram_newton_schulz, the GEMMs
// emulated. Returns the number of GEMMs.
template <typename T>
int64_t run_batch_as(NsBatch& b, NsWorkspace& w) {
  const cuda::NsBatchGeometry& g = b.geometry;
  const cuda::NsBuffers<LtBuffer<T>> whole{w.x.as<T>(),    w.gram.as<T>(), w.bmat.as<T>(), w.tmat.as<T>(),
                                           w.umat.as<T>(), w.qmat.as<T>(), w.zmat.as<T>(), w.t2mat.as<T>()};
  int64_t gemms = 0;
  auto gemm = [&](cuda::NsGemm which, int part, const cuda::NsGemmSpec& spec) {
    // The run hands each GEMM the layout planned for `which` and `part` (newton_schulz_cuda.cu plans each
    // once, ns_planned_gemm); only its operands may differ.
    if (part < 0 || part >= cuda::ns_gemm_parts(g, which)) throw LayoutError("a GEMM part that was not planned");
    if (!same_layout(spec, cuda::ns_planned_gemm(g, which, part)))
      throw LayoutError("a GEMM on another layout than the one planned for it");
    lt_matmul<float>(spec, whole, b.shape.count, g.x.stride, g.sym.stride);
    ++gemms;
  };
  const cuda::NsBuffers<T*> buf{whole.x.data, whole.gram.data, whole.b.data, whole.t.data,
                                whole.u.data, whole.q.data,    whole.z.data, whole.t2.data};
  if (g.gram_iteration)
    cuda::ns_device::run_gram_newton_schulz<T>(simt::Launch{}, gemm, buf, b.shape, g, w.partials.data());
  else
    cuda::ns_device::run_newton_schulz<T>(simt::Launch{}, gemm, buf, b.shape, g, w.partials.data());
  return gemms;
}

int64_t run_batch(NsBatch& b, NsWorkspace& w) {
  return b.shape.precision == NsPrecision::bf16 ? run_batch_as<__nv_bfloat16>(b, w) : run_batch_as<float>(b, w);
}

}  // namespace

struct EmulatedCudaBackend::Impl {
  const Layout& layout;
  Config config;
  cuda::StepPlan plan;
  std::vector<NsBatch> batches;
  NsWorkspace ns;
  std::vector<cuda::GroupScalars> groups;
  std::vector<cuda::EntryScalars> entry_scalars;  // kept between steps, as the device's (flags cleared there)
  std::vector<cuda::MatrixScalars> matrix_scalars;
  std::vector<double> stat_sums;
  std::vector<float> inv_scale;
  std::vector<__nv_bfloat16> grads_bf16;
  std::vector<cuda::EntryOperands> operands;
  std::vector<uint8_t> table_has_grad;
  cuda::StepStatus status{};
  int64_t gemms = 0;

  Impl(const Layout& l, const Options& options, Config c)
      : layout(l), config(c), plan(cuda::StepPlan::build(l, options, c.ns_budget)) {
    for (cuda::NsBatchShape& shape : plan.batches) {
      shape.panel_width = config.ns_panel_width;  // as FastCudaBackend passes it on
      batches.push_back(make_batch(shape));
    }
    ns.size_for(batches);
    // Each matrix reads and writes its slot of its batch's buffers (as FastCudaBackend points them).
    for (size_t m = 0; m < plan.matrices.size(); ++m) {
      cuda::MatrixInfo& info = plan.matrices[m];
      NsBatch& b = batches[static_cast<size_t>(plan.matrix_batch[m])];
      const int64_t at = b.geometry.x.stride * plan.matrix_index[m];
      info.ns_input = info.ns_bf16 ? static_cast<void*>(ns.x.as<__nv_bfloat16>().data + at)
                                   : static_cast<void*>(ns.x.as<float>().data + at);
      info.ns_output = info.ns_input;  // in place
    }
    stat_sums.resize(static_cast<size_t>(layout.stat_floats));
    inv_scale.resize(static_cast<size_t>(layout.stat_floats));
    if (config.grad_type == cuda::ElemType::bf16) grads_bf16.resize(static_cast<size_t>(layout.param_floats));
    std::memset(&status, 0xff, sizeof status);  // nothing bad reported
  }

};

EmulatedCudaBackend::EmulatedCudaBackend(const Layout& layout, const Options& options, Config config)
    : impl_(std::make_unique<Impl>(layout, options, config)) {
  if (config.bf16_params) params_bf16_.resize(static_cast<size_t>(layout.param_floats));
}

EmulatedCudaBackend::~EmulatedCudaBackend() = default;

void EmulatedCudaBackend::enqueue_step(FlatState& state, const Options& options, bool host_bias) {
  Impl& im = *impl_;
  if (state.layout != &im.layout) throw std::invalid_argument("fast-cuda-emulated: the state has another layout");
  set_scalars(options, host_bias ? &state.entry_steps : nullptr);
  table_ = nullptr;

  // The flat buffers as FastCudaBackend points the operand table at them.
  const void* grads = state.grads.data();
  if (im.config.grad_type == cuda::ElemType::bf16) {
    for (size_t i = 0; i < im.grads_bf16.size(); ++i) im.grads_bf16[i] = __float2bfloat16_rn(state.grads[static_cast<int64_t>(i)]);
    grads = im.grads_bf16.data();
  }
  const size_t grad_bytes = im.config.grad_type == cuda::ElemType::f32 ? 4 : 2;
  im.operands.resize(im.layout.entries.size());
  for (size_t e = 0; e < im.operands.size(); ++e) {
    const int64_t at = im.layout.entries[e].offset;
    im.operands[e] = cuda::EntryOperands{state.params.data() + at, params_bf16_.empty() ? nullptr : params_bf16_.data() + at,
                                         static_cast<const char*>(grads) + static_cast<size_t>(at) * grad_bytes,
                                         im.config.grad_type, cuda::ElemType::bf16, {}, {}, {}};  // dense
  }
  run(state.momentum.data(), state.row_var.data(), state.exp_avg.data(), state.exp_avg_sq.data(),
      state.has_grad.data(), state.group_steps.data(), state.entry_steps.data());
}

void EmulatedCudaBackend::enqueue_step(TableState& state, const ParamTable& table, const Options& options,
                                       const float* grad_scale, const float* found_inf,
                                       const std::vector<int64_t>* host_entry_steps) {
  Impl& im = *impl_;
  if (state.layout != &im.layout || table.layout != &im.layout)
    throw std::invalid_argument("fast-cuda-emulated: the state has another layout");
  const std::string reason = table.invalid_reason();
  if (!reason.empty()) throw std::invalid_argument(reason);
  set_scalars(options, host_entry_steps ? host_entry_steps : &state.entry_steps);
  table_ = &table;
  // As FastCudaBackend::set_tensors: the caller's tensors, masters for bf16 / fp16 parameters.
  im.operands.resize(im.layout.entries.size());
  im.table_has_grad.resize(im.layout.entries.size());
  for (size_t e = 0; e < im.operands.size(); ++e) {
    im.operands[e] = cuda::entry_operands(table, static_cast<int>(e), state.masters.data());
    im.table_has_grad[e] = table.grads[e].data != nullptr;
  }
  run(state.momentum.data(), state.row_var.data(), state.exp_avg.data(), state.exp_avg_sq.data(),
      im.table_has_grad.data(), state.group_steps.data(), state.entry_steps.data(), grad_scale, found_inf);
}

StepResult EmulatedCudaBackend::step(TableState& state, const ParamTable& table, const Options& options,
                                     const float* grad_scale, const float* found_inf) {
  enqueue_step(state, table, options, grad_scale, found_inf);
  return finish_step(options);
}

void EmulatedCudaBackend::set_scalars(const Options& options, const std::vector<int64_t>* entry_steps) {
  Impl& im = *impl_;
  if (options.groups.size() != im.layout.group_names.size())
    throw std::invalid_argument("fast-cuda-emulated: the options have another number of groups");
  im.groups.clear();
  for (size_t g = 0; g < options.groups.size(); ++g) im.groups.push_back(cuda::group_scalars(options.groups[g]));
  // As FastCudaBackend::set_options: host-exact per entry with the counts, else derived on the device.
  cuda::fill_entry_scalars(im.layout, options, nullptr, entry_steps, im.entry_scalars);
  cuda::fill_matrix_scalars(im.layout, im.plan.matrices, options, im.matrix_scalars);
}

void EmulatedCudaBackend::run(float* momentum, float* row_var, float* exp_avg, float* exp_avg_sq,
                              const uint8_t* has_grad, int64_t* group_steps, int64_t* entry_steps,
                              const float* grad_scale, const float* found_inf) {
  Impl& im = *impl_;
  cuda::StepBuffers b{};
  b.grad_scale = grad_scale;
  b.found_inf = found_inf;
  b.operands = im.operands.data();
  b.momentum = momentum;
  b.row_var = row_var;
  b.exp_avg = exp_avg;
  b.exp_avg_sq = exp_avg_sq;
  b.has_grad = has_grad;
  b.group_steps = group_steps;
  b.entry_steps = entry_steps;
  b.entry_scalars = im.entry_scalars.data();
  b.n_entries = static_cast<int32_t>(im.plan.entries.size());
  b.n_groups = static_cast<int32_t>(im.groups.size());
  b.entries = im.plan.entries.data();
  b.matrices = im.plan.matrices.data();
  b.groups = im.groups.data();
  b.matrix_scalars = im.matrix_scalars.data();
  b.stat_sums = im.stat_sums.data();
  b.inv_scale = im.inv_scale.data();
  b.status = &im.status;

  const int64_t launches_before = simt::launches();
  im.gemms = 0;
  im.status.first_bad = cuda::kNoBadGradient;  // as enqueue_step's memset
  auto newton_schulz = [&](int i) {
    NsBatch& batch = im.batches[static_cast<size_t>(i)];
    if (!batch.geometry.empty) im.gemms += run_batch(batch, im.ns);
  };
  const cuda::StepPlan& p = im.plan;
  cuda::step_device::run_step(simt::Launch{}, b, p.tables(p.scan_chunks.data(), p.normuon_chunks.data(),
                                                          p.adamw_chunks.data(), p.stat_tasks.data(),
                                                          p.batch_ranges.data()),
                              newton_schulz, [](int) { return 0; });
  launches_last_step_ = simt::launches() - launches_before + im.gemms;
}

StepResult EmulatedCudaBackend::finish_step(const Options& options) {
  const cuda::StepStatus status = impl_->status;
  if (status.reported_bad == cuda::kNoBadGradient) return {};
  std::memset(&impl_->status, 0xff, sizeof status);  // reported: cleared for the next steps
  return cuda::step_result(status, impl_->layout, options, table_);
}

StepResult EmulatedCudaBackend::step(FlatState& state, const Options& options) {
  // As DeviceFlatState::upload: the bf16 copy starts from the parameters (entries without a gradient
  // keep it; the kernels rewrite the others).
  for (size_t i = 0; i < params_bf16_.size(); ++i) {
    const __nv_bfloat16 h = __float2bfloat16_rn(state.params[static_cast<int64_t>(i)]);
    std::memcpy(&params_bf16_[i], &h, sizeof h);
  }
  enqueue_step(state, options, true);
  return finish_step(options);
}

cuda::StepStatus& EmulatedCudaBackend::status() { return impl_->status; }

int EmulatedCudaBackend::batches() const { return static_cast<int>(impl_->plan.batches.size()); }

int64_t EmulatedCudaBackend::workspace_bytes() const {
  const Impl& im = *impl_;
  int64_t bytes = 0;
  for (const DeviceBytes* d : {&im.ns.x, &im.ns.gram, &im.ns.bmat, &im.ns.tmat, &im.ns.umat, &im.ns.qmat, &im.ns.zmat, &im.ns.t2mat})
    bytes += 4 * static_cast<int64_t>(d->storage.size());
  bytes += 8 * static_cast<int64_t>(im.ns.partials.size() + im.stat_sums.size()) + 4 * static_cast<int64_t>(im.inv_scale.size());
  return bytes;
}

EmulatedCudaEngineBackend::EmulatedCudaEngineBackend(const Layout& layout, const Options& options)
    : layout_(layout), backend_(layout, options), device_(layout) {}

void EmulatedCudaEngineBackend::enqueue(const TableState& state, const ParamTable& table, const Options& options,
                                        const float* grad_scale, const float* found_inf) {
  backend_.enqueue_step(device_, table, options, grad_scale, found_inf, &state.entry_steps);
  table_ = &table;
}

StepResult EmulatedCudaEngineBackend::verdict(const Options& options) {
  cuda::StepStatus& status = backend_.status();
  const cuda::StepStatus copy = status;  // as FastCudaBackend reads its pinned copy
  if (copy.reported_bad != cuda::kNoBadGradient) std::memset(&status, 0xff, sizeof status);  // reported: cleared
  return cuda::step_verdict(copy, layout_, options, table_);
}

void EmulatedCudaEngineBackend::set_steps(const TableState& state) {
  device_.group_steps = state.group_steps;
  device_.entry_steps = state.entry_steps;
}

void EmulatedCudaEngineBackend::refresh_master(int e, const ParamTable& table) {
  unsigned long long all_rounded = 1;
  cuda::step_device::refresh_master(simt::Launch{}, cuda::entry_operands(table, e, device_.masters.data()),
                                    layout_.entries[e].numel, &all_rounded);
}

std::vector<BufferView> EmulatedCudaEngineBackend::buffers() {
  return state_buffers(device_, false);  // host memory: the emulator's device
}

int64_t device_row_runs_at(cuda::Runs runs, int64_t i) { return cuda::step_device::at(runs, i); }

EmulatedNewtonSchulz emulated_newton_schulz(const cuda::NsBatchShape& shape, const std::vector<float>& inputs) {
  const int64_t n = shape.rows * shape.cols;
  if (static_cast<int64_t>(inputs.size()) != shape.count * n)
    throw std::invalid_argument("emulated_newton_schulz: " + std::to_string(inputs.size()) + " values for " +
                                std::to_string(shape.count) + " matrices of " + std::to_string(n));
  std::vector<NsBatch> batches;
  batches.push_back(make_batch(shape));
  NsBatch& b = batches.front();
  EmulatedNewtonSchulz result;
  result.outputs.resize(inputs.size());
  if (b.geometry.empty) return result;
  NsWorkspace workspace;
  workspace.size_for(batches);
  const bool bf16 = shape.precision == NsPrecision::bf16;
  const int64_t stride = b.geometry.x.stride;
  DeviceBytes& x = workspace.x;
  for (int64_t q = 0; q < shape.count; ++q)
    for (int64_t e = 0; e < n; ++e) {
      const float v = inputs[static_cast<size_t>(q * n + e)];
      if (bf16)
        x.as<__nv_bfloat16>().data[q * stride + e] = __float2bfloat16_rn(v);
      else
        x.as<float>().data[q * stride + e] = v;
    }
  const int64_t before = simt::launches();
  result.launches = run_batch(b, workspace);
  result.launches += simt::launches() - before;
  for (int64_t q = 0; q < shape.count; ++q)
    for (int64_t e = 0; e < n; ++e)
      result.outputs[static_cast<size_t>(q * n + e)] = bf16 ? __bfloat162float(x.as<__nv_bfloat16>().data[q * stride + e])
                                                            : x.as<float>().data[q * stride + e];
  return result;
}

}  // namespace normuon::test
