// First: the CUDA builtins for the host compiler, then the device code of the fused step itself.
#include "simt.h"
#include "ns_kernels.cuh"
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

// One Newton-Schulz batch's buffers, as BatchedNewtonSchulz has them: X, the s x s buffers A, C/B and T,
// and the X-shaped U, `count` matrices each at the geometry's strides.
template <typename T>
struct NsBuffersOf {
  std::vector<T> x, gram, b, t, u;

  void allocate(const cuda::NsBatchGeometry& g, int64_t count) {
    for (std::vector<T>* v : {&x, &u}) v->resize(static_cast<size_t>(count * g.x.stride));
    for (std::vector<T>* v : {&gram, &b, &t}) v->resize(static_cast<size_t>(count * g.gram.stride));
    // Device memory is not cleared: NaN everywhere (all bits set, in bf16 and fp32) makes any read of an
    // element nobody wrote, padding included, show up in the results.
    for (std::vector<T>* v : {&x, &gram, &b, &t, &u})
      std::memset(static_cast<void*>(v->data()), 0xff, v->size() * sizeof(T));
  }
};

template <typename T>
LtBuffer<T> whole(std::vector<T>& v) {
  return {v.data(), static_cast<int64_t>(v.size())};
}

struct NsBatch {
  cuda::NsBatchShape shape;
  cuda::NsBatchGeometry geometry;
  NsBuffersOf<__nv_bfloat16> bf16;
  NsBuffersOf<float> f32;
};

}  // namespace

struct EmulatedCudaBackend::Impl {
  const Layout& layout;
  Config config;
  cuda::StepPlan plan;
  std::vector<NsBatch> batches;
  std::vector<double> partials;  // the norm kernels' partial sums, shared by the batches
  std::vector<cuda::GroupScalars> groups;
  std::vector<cuda::MatrixScalars> matrix_scalars;
  std::vector<double> stat_sums;
  std::vector<float> inv_scale;
  std::vector<__nv_bfloat16> grads_bf16;
  cuda::StepStatus status{};
  int64_t gemms = 0;

  Impl(const Layout& l, const Options& options, Config c)
      : layout(l), config(c), plan(cuda::StepPlan::build(l, options)) {
    size_t max_partials = 0;
    for (const cuda::NsBatchShape& shape : plan.batches) {
      NsBatch& b = batches.emplace_back();
      b.shape = shape;
      b.geometry = cuda::ns_batch_geometry(shape);
      if (b.geometry.empty) continue;
      if (shape.precision == NsPrecision::bf16)
        b.bf16.allocate(b.geometry, shape.count);
      else
        b.f32.allocate(b.geometry, shape.count);
      max_partials = std::max(max_partials, static_cast<size_t>(shape.count * b.geometry.x.slices));
    }
    partials.resize(max_partials);
    // Each matrix reads and writes its slot of its batch's buffers (as FastCudaBackend points them).
    for (size_t m = 0; m < plan.matrices.size(); ++m) {
      cuda::MatrixInfo& info = plan.matrices[m];
      NsBatch& b = batches[static_cast<size_t>(plan.matrix_batch[m])];
      const int64_t at = b.geometry.x.stride * plan.matrix_index[m];
      info.ns_input = info.ns_bf16 ? static_cast<void*>(b.bf16.x.data() + at) : static_cast<void*>(b.f32.x.data() + at);
      info.ns_output = info.ns_input;  // in place
    }
    stat_sums.resize(static_cast<size_t>(layout.stat_floats));
    inv_scale.resize(static_cast<size_t>(layout.stat_floats));
    if (config.grad_type == cuda::GradType::bf16) grads_bf16.resize(static_cast<size_t>(layout.param_floats));
    std::memset(&status, 0xff, sizeof status);  // nothing bad reported
  }

  // BatchedNewtonSchulz::run on the host: the same run_newton_schulz, the GEMMs emulated.
  template <typename T>
  void run_batch(NsBatch& b, NsBuffersOf<T>& m) {
    const cuda::NsBatchGeometry& g = b.geometry;
    const cuda::NsBuffers<LtBuffer<T>> whole_buffers{whole(m.x), whole(m.gram), whole(m.b), whole(m.t), whole(m.u)};
    auto gemm = [&](cuda::ns_device::NsGemm which) {
      const cuda::NsGemmSpec& spec = which == cuda::ns_device::NsGemm::gram     ? g.plan.gram
                                     : which == cuda::ns_device::NsGemm::square ? g.plan.square
                                                                                 : g.plan.apply;
      lt_matmul<float>(spec, whole_buffers, b.shape.count, g.x.stride, g.gram.stride);
      ++gemms;
    };
    const cuda::NsBuffers<T*> buf{m.x.data(), m.gram.data(), m.b.data(), m.t.data(), m.u.data()};
    cuda::ns_device::run_newton_schulz<T>(simt::Launch{}, gemm, buf, b.shape, g, partials.data());
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
  if (options.groups.size() != im.layout.group_names.size())
    throw std::invalid_argument("fast-cuda-emulated: the options have another number of groups");
  im.groups.clear();
  for (size_t g = 0; g < options.groups.size(); ++g)
    im.groups.push_back(cuda::group_scalars(options.groups[g], host_bias ? &state.group_steps[g] : nullptr));
  im.matrix_scalars = cuda::matrix_scalars(im.plan.matrices, options);

  cuda::StepBuffers b{};
  b.params = state.params.data();
  if (im.config.grad_type == cuda::GradType::bf16) {
    for (size_t i = 0; i < im.grads_bf16.size(); ++i) im.grads_bf16[i] = __float2bfloat16_rn(state.grads[static_cast<int64_t>(i)]);
    b.grads = im.grads_bf16.data();
  } else {
    b.grads = state.grads.data();
  }
  b.grad_type = im.config.grad_type;
  b.momentum = state.momentum.data();
  b.row_var = state.row_var.data();
  b.exp_avg = state.exp_avg.data();
  b.exp_avg_sq = state.exp_avg_sq.data();
  b.params_bf16 = params_bf16_.empty() ? nullptr : params_bf16_.data();
  b.has_grad = state.has_grad.data();
  b.group_steps = state.group_steps.data();
  b.n_entries = static_cast<int32_t>(im.plan.entries.size());
  b.n_groups = static_cast<int32_t>(im.groups.size());
  b.entries = im.plan.entries.data();
  b.matrices = im.plan.matrices.data();
  b.groups = im.groups.data();
  b.matrix_scalars = im.matrix_scalars.data();
  b.stat_sums = im.stat_sums.data();
  b.inv_scale = im.inv_scale.data();
  b.status = &im.status;

  // FastCudaBackend::enqueue_step's sequence.
  const int64_t launches_before = simt::launches();
  im.gemms = 0;
  const simt::Launch launch;
  const cuda::StepPlan& p = im.plan;
  im.status.first_bad = cuda::kNoBadGradient;
  cuda::step_device::scan_gradients(launch, b, p.scan_chunks.data(), static_cast<int>(p.scan_chunks.size()));
  cuda::step_device::advance_steps(launch, b);
  cuda::step_device::momentum(launch, b, p.normuon_chunks.data(), static_cast<int>(p.normuon_chunks.size()));
  for (NsBatch& batch : im.batches) {
    if (batch.geometry.empty) continue;
    if (batch.shape.precision == NsPrecision::bf16)
      im.run_batch(batch, batch.bf16);
    else
      im.run_batch(batch, batch.f32);
  }
  cuda::step_device::statistics(launch, b, p.stat_tasks.data(), static_cast<int>(p.stat_tasks.size()));
  cuda::step_device::finalize(launch, b, static_cast<int>(p.matrices.size()));
  cuda::step_device::normuon_update(launch, b, p.normuon_chunks.data(), static_cast<int>(p.normuon_chunks.size()));
  cuda::step_device::adamw(launch, b, p.adamw_chunks.data(), static_cast<int>(p.adamw_chunks.size()));
  launches_last_step_ = simt::launches() - launches_before + im.gemms;
}

StepResult EmulatedCudaBackend::finish_step(const Options& options) {
  const cuda::StepStatus status = impl_->status;
  if (status.reported_bad == cuda::kNoBadGradient) return {};
  std::memset(&impl_->status, 0xff, sizeof status);  // reported: cleared for the next steps
  return cuda::step_result(status, impl_->layout, options);
}

StepResult EmulatedCudaBackend::step(FlatState& state, const Options& options) {
  enqueue_step(state, options, true);
  return finish_step(options);
}

}  // namespace normuon::test
