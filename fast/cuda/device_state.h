// The shared flat layout in device memory: the same buffers, sizes and offsets as FlatState
// (core/include/normuon/flat_state.h), so a state moves between host and device with one copy per
// buffer, and state files written from either side are the same. In table mode (caller_tensors) the
// parameters and gradients are the caller's: no params or grads buffers, only the masters of bf16 /
// fp16 parameters (TableState's, core/include/normuon/param_table.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "device_buffer.h"
#include "normuon/flat_state.h"
#include "step_kernels.h"

namespace normuon::cuda {

class DeviceFlatState {
 public:
  // grad_type: the dtype the caller writes gradients in (bf16 halves the gradient traffic).
  // bf16_params: also keep a bf16 copy of the parameters, written by the step in the same pass (a
  // model running in bf16 can read it instead of converting the fp32 master copy itself).
  explicit DeviceFlatState(const Layout& layout, ElemType grad_type = ElemType::f32, bool bf16_params = false,
                           bool caller_tensors = false);

  const Layout& layout() const { return *layout_; }
  bool caller_tensors() const { return caller_tensors_; }
  ElemType grad_type() const { return grad_type_; }

  DeviceBuffer<float> params, momentum, row_var, exp_avg, exp_avg_sq;
  DeviceBuffer<float> grads_f32;      // param_floats when grad_type is f32
  DeviceBuffer<uint16_t> grads_bf16;  // param_floats when grad_type is bf16
  DeviceBuffer<uint16_t> params_bf16; // param_floats when bf16_params
  DeviceBuffer<float> masters;        // master_floats in table mode
  DeviceBuffer<uint8_t> has_grad;     // per layout entry
  DeviceBuffer<int64_t> group_steps;  // per group
  DeviceBuffer<int64_t> entry_steps;  // per layout entry: its own step count (FlatState::entry_steps)

  void* grads() { return grad_type_ == ElemType::f32 ? static_cast<void*>(grads_f32.data()) : grads_bf16.data(); }

  // Host <-> device, whole state (parameters, gradients, optimizer state, flags, steps). Gradients go
  // up as fp32 (converted on the host to bf16 when grad_type is bf16); they are not copied back.
  // In table mode only the state, the steps (group and entry) and the masters (from / to the host's parameters of bf16 /
  // fp16 entries) move. Both synchronise the stream before returning.
  void upload(const FlatState& host, cudaStream_t stream);
  void download(FlatState& host, cudaStream_t stream) const;

 private:
  const Layout* layout_;
  ElemType grad_type_;
  bool caller_tensors_;
};

}  // namespace normuon::cuda
