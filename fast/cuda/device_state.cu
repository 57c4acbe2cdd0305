#include "device_state.h"

#include <cuda_bf16.h>

#include <cstring>
#include <stdexcept>
#include <vector>

namespace normuon::cuda {
namespace {

template <typename T>
void to_device(DeviceBuffer<T>& dst, const T* src, int64_t count, cudaStream_t stream) {
  if (count != dst.size()) throw std::logic_error("device state: buffer size mismatch");
  if (count > 0) NORMUON_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src, dst.bytes(), cudaMemcpyHostToDevice, stream));
}

template <typename T>
void to_host(T* dst, const DeviceBuffer<T>& src, int64_t count, cudaStream_t stream) {
  if (count != src.size()) throw std::logic_error("device state: buffer size mismatch");
  if (count > 0) NORMUON_CUDA_CHECK(cudaMemcpyAsync(dst, src.data(), src.bytes(), cudaMemcpyDeviceToHost, stream));
}

// x rounded to bf16 (to nearest even, as the kernels round), as raw bits.
std::vector<uint16_t> bf16_bits(const float* x, int64_t n) {
  std::vector<uint16_t> bits(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const __nv_bfloat16 b = __float2bfloat16_rn(x[i]);
    std::memcpy(&bits[static_cast<size_t>(i)], &b, sizeof(uint16_t));
  }
  return bits;
}

}  // namespace

DeviceFlatState::DeviceFlatState(const Layout& layout, ElemType grad_type, bool bf16_params, bool caller_tensors)
    : params(caller_tensors ? 0 : layout.param_floats),
      momentum(layout.normuon_floats),
      row_var(layout.stat_floats),
      exp_avg(layout.adam_floats),
      exp_avg_sq(layout.adam_floats),
      grads_f32(!caller_tensors && grad_type == ElemType::f32 ? layout.param_floats : 0),
      grads_bf16(!caller_tensors && grad_type == ElemType::bf16 ? layout.param_floats : 0),
      params_bf16(!caller_tensors && bf16_params ? layout.param_floats : 0),
      masters(caller_tensors ? layout.master_floats : 0),
      has_grad(static_cast<int64_t>(layout.entries.size())),
      group_steps(static_cast<int64_t>(layout.group_names.size())),
      entry_steps(static_cast<int64_t>(layout.entries.size())),
      layout_(&layout),
      grad_type_(grad_type),
      caller_tensors_(caller_tensors) {
  if (grad_type == ElemType::f16) throw std::invalid_argument("device state: fp16 gradients need table mode");
  // Padding between slots is read by nothing, but zero it so device buffers hold defined values.
  for (auto* b : {&params, &momentum, &row_var, &exp_avg, &exp_avg_sq, &grads_f32, &masters})
    if (b->size() > 0) NORMUON_CUDA_CHECK(cudaMemset(b->data(), 0, b->bytes()));
  for (auto* b : {&grads_bf16, &params_bf16})
    if (b->size() > 0) NORMUON_CUDA_CHECK(cudaMemset(b->data(), 0, b->bytes()));
  // FlatState's defaults: every parameter has a gradient, no step taken yet.
  if (has_grad.size() > 0) NORMUON_CUDA_CHECK(cudaMemset(has_grad.data(), 1, has_grad.bytes()));
  if (group_steps.size() > 0) NORMUON_CUDA_CHECK(cudaMemset(group_steps.data(), 0, group_steps.bytes()));
  if (entry_steps.size() > 0) NORMUON_CUDA_CHECK(cudaMemset(entry_steps.data(), 0, entry_steps.bytes()));
  // cudaMemset is asynchronous on the legacy stream; the backend's own stream is not ordered after it.
  NORMUON_CUDA_CHECK(cudaDeviceSynchronize());
}

void DeviceFlatState::upload(const FlatState& host, cudaStream_t stream) {
  if (host.layout != layout_) throw std::invalid_argument("device state: the host state has another layout");
  const Layout& l = *layout_;
  to_device(momentum, host.momentum.data(), l.normuon_floats, stream);
  to_device(group_steps, host.group_steps.data(), static_cast<int64_t>(host.group_steps.size()), stream);
  to_device(entry_steps, host.entry_steps.data(), static_cast<int64_t>(host.entry_steps.size()), stream);
  to_device(row_var, host.row_var.data(), l.stat_floats, stream);
  to_device(exp_avg, host.exp_avg.data(), l.adam_floats, stream);
  to_device(exp_avg_sq, host.exp_avg_sq.data(), l.adam_floats, stream);
  if (caller_tensors_) {  // the masters from the host's fp32 values of the bf16 / fp16 parameters
    for (const LayoutEntry& e : l.entries)
      if (e.master_offset >= 0 && e.numel > 0)
        NORMUON_CUDA_CHECK(cudaMemcpyAsync(masters.data() + e.master_offset, host.params.data() + e.offset,
                                           static_cast<size_t>(e.numel) * sizeof(float), cudaMemcpyHostToDevice, stream));
    NORMUON_CUDA_CHECK(cudaStreamSynchronize(stream));
    return;
  }
  to_device(params, host.params.data(), l.param_floats, stream);
  to_device(has_grad, host.has_grad.data(), static_cast<int64_t>(host.has_grad.size()), stream);
  // Host staging of the bf16 buffers; both live until the synchronisation below.
  std::vector<uint16_t> grads_staged, params_staged;
  if (grad_type_ == ElemType::f32) {
    to_device(grads_f32, host.grads.data(), l.param_floats, stream);
  } else {
    grads_staged = bf16_bits(host.grads.data(), l.param_floats);
    to_device(grads_bf16, grads_staged.data(), l.param_floats, stream);
  }
  if (params_bf16.size() > 0) {  // keep the bf16 copy consistent with the uploaded master copy
    params_staged = bf16_bits(host.params.data(), l.param_floats);
    to_device(params_bf16, params_staged.data(), l.param_floats, stream);
  }
  NORMUON_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void DeviceFlatState::download(FlatState& host, cudaStream_t stream) const {
  if (host.layout != layout_) throw std::invalid_argument("device state: the host state has another layout");
  const Layout& l = *layout_;
  if (caller_tensors_) {
    for (const LayoutEntry& e : l.entries)
      if (e.master_offset >= 0 && e.numel > 0)
        NORMUON_CUDA_CHECK(cudaMemcpyAsync(host.params.data() + e.offset, masters.data() + e.master_offset,
                                           static_cast<size_t>(e.numel) * sizeof(float), cudaMemcpyDeviceToHost, stream));
  } else {
    to_host(host.params.data(), params, l.param_floats, stream);
  }
  to_host(host.momentum.data(), momentum, l.normuon_floats, stream);
  to_host(host.row_var.data(), row_var, l.stat_floats, stream);
  to_host(host.exp_avg.data(), exp_avg, l.adam_floats, stream);
  to_host(host.exp_avg_sq.data(), exp_avg_sq, l.adam_floats, stream);
  to_host(host.group_steps.data(), group_steps, static_cast<int64_t>(host.group_steps.size()), stream);
  to_host(host.entry_steps.data(), entry_steps, static_cast<int64_t>(host.entry_steps.size()), stream);
  NORMUON_CUDA_CHECK(cudaStreamSynchronize(stream));
}

}  // namespace normuon::cuda
