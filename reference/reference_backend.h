// The reference backend: a literal, per-parameter transcription of docs/spec.md, one parameter at a time,
// the way per-parameter PyTorch optimizers run today. It is the oracle every other backend is checked
// against, and the "old" path of the old-vs-new comparison. ATen holds the tensors; the arithmetic is the
// reference's own (spec_steps.h), so its bits follow from the spec on every processor and on CUDA
// (docs/reference.md).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "normuon/backend.h"

namespace normuon {

enum class ReferenceDevice { cpu, cuda };
const char* to_string(ReferenceDevice);  // "cpu" | "cuda"

// The six flat buffers of a layout as 1-D fp32 contiguous tensors on one device: params and grads of
// param_floats, momentum of normuon_floats, row_var of stat_floats, exp_avg and exp_avg_sq of adam_floats.
struct FlatTensors {
  at::Tensor params, grads, momentum, row_var, exp_avg, exp_avg_sq;
};

// Wraps existing buffers (host memory for cpu, device memory for cuda; not owned, not copied) as
// FlatTensors of the layout's sizes. A null pointer is allowed only for a buffer of size 0. Throws
// std::invalid_argument when the device is unavailable (ReferenceBackend::unavailable_reason).
FlatTensors wrap_flat(const Layout& layout, float* params, float* grads, float* momentum, float* row_var,
                      float* exp_avg, float* exp_avg_sq, ReferenceDevice device);

class ReferencePrimitives;  // the device's arithmetic (reference_backend.cpp)

class ReferenceBackend : public Backend {
 public:
  // Throws std::invalid_argument with unavailable_reason(device) when the device can't be used.
  explicit ReferenceBackend(ReferenceDevice device = ReferenceDevice::cpu);

  std::string name() const override;  // "reference-cpu" | "reference-cuda"
  ReferenceDevice device() const { return device_; }

  // "" when the device is usable in this process, else why not (a CPU-only libtorch, no visible GPU).
  static std::string unavailable_reason(ReferenceDevice device);

  // On cpu, works in place on views of the state's buffers. On cuda, copies the six buffers to device
  // tensors (allocated once, reused while the layout stays the same), runs step_flat there and copies
  // parameters and optimizer state back unless the step was skipped.
  StepResult step(FlatState& state, const Options& options) override;

  // The same step on device-resident flat tensors (e.g. memory owned by another backend, via wrap_flat):
  // the same per-parameter loop on views of `t`, the same NaN/Inf check and messages as begin_step
  // (core/step_prologue.h), the same advance of the steps. The tensors must be on this backend's device
  // type. has_grad has one flag per layout entry, group_steps one counter per group, entry_steps one
  // count per layout entry (FlatState::entry_steps; both advanced here, AdamW's bias corrections use
  // entry_steps). Work is queued on the device's current stream; a caller writing the memory on another
  // stream synchronises first.
  StepResult step_flat(const Layout& layout, FlatTensors& t, const std::vector<uint8_t>& has_grad,
                       std::vector<int64_t>& group_steps, std::vector<int64_t>& entry_steps, const Options& options);

 private:
  ReferenceDevice device_;
  std::shared_ptr<ReferencePrimitives> primitives_;  // scratch buffers kept between steps
  // cuda only: the device copies used by step(FlatState&), and the layout they were sized for.
  FlatTensors staged_;
  uint64_t staged_fingerprint_ = 0;
  bool have_staged_ = false;
};

// The spec's pieces, exposed for the invariant tests. All tensors are fp32 unless said, on any one device.
// Newton-Schulz orthogonalisation of a 2-D fp32 tensor in the group's precision (fp32 result holding
// values of that precision).
at::Tensor newton_schulz(const at::Tensor& update, const NorMuonHyper& h);
// One NorMuon step of one matrix, in place on p, M (momentum) and v (second moment). `times` (optional)
// receives the time of each phase (on CUDA the clock synchronises the device). transposed: p is stored
// [in, out], so kappa follows its transpose (ParamSpec::transposed; stats_per_row is the stored axis).
void normuon_update(at::Tensor p, const at::Tensor& g, at::Tensor M, at::Tensor v, const NorMuonHyper& h,
                    bool stats_per_row, PhaseTimes* times = nullptr, bool transposed = false);
// One AdamW step (torch.optim.AdamW, single-tensor path) of one tensor at its own step count t >= 1.
void adamw_update(at::Tensor p, const at::Tensor& g, at::Tensor m, at::Tensor v, const AdamWHyper& h, int64_t t,
                  PhaseTimes* times = nullptr);

}  // namespace normuon
