// Launchers of the fused step's kernels (step_kernels.cu). Each launches exactly one kernel on the
// stream and returns; none allocates or synchronises. Every kernel first reads the step status and
// does nothing when a NaN/Inf gradient was found, so a skipped step changes nothing, also when replayed
// from a CUDA graph.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "step_tables.h"

namespace normuon::cuda {

enum class GradType { f32, bf16 };

// The device buffers and tables one step works on (pointers into DeviceFlatState and the backend).
struct StepBuffers {
  float* params;
  const void* grads;  // float or __nv_bfloat16 (grad_type)
  GradType grad_type;
  float* momentum;
  float* row_var;
  float* exp_avg;
  float* exp_avg_sq;
  uint16_t* params_bf16;  // optional bf16 copy of the parameters written by the step (nullptr: none)
  const uint8_t* has_grad;
  int64_t* group_steps;
  int32_t n_entries, n_groups;
  const EntryInfo* entries;
  const MatrixInfo* matrices;
  GroupScalars* groups;
  MatrixScalars* matrix_scalars;
  double* stat_sums;  // stat_floats doubles: sums of squares along the reduce axis
  float* inv_scale;   // stat_floats floats: 1 / sqrt(v) (with eps)
  StepStatus* status;
};

// Sets status->first_bad to the first NaN/Inf among gradients that are present.
void launch_scan_gradients(const StepBuffers& b, const Chunk* chunks, int n_chunks, cudaStream_t stream);
// Advances the step counter of every group with a gradient and derives its AdamW bias corrections.
void launch_advance_steps(const StepBuffers& b, cudaStream_t stream);
// M = lerp(M, g, 1-beta1); U = nesterov ? lerp(g, M, beta1) : M; writes P(U) to the matrix's NS input.
void launch_momentum(const StepBuffers& b, const Chunk* chunks, int n_chunks, cudaStream_t stream);
// Sums of squares along the reduce axis of every NS output, in double, one task per block.
void launch_statistics(const StepBuffers& b, const StatTask* tasks, int n_tasks, cudaStream_t stream);
// Per matrix: second moment, inverse scales, the re-norm ratio.
void launch_finalize(const StepBuffers& b, int n_matrices, cudaStream_t stream);
// The NorMuon update, weight decay and step of every matrix.
void launch_normuon_update(const StepBuffers& b, const Chunk* chunks, int n_chunks, cudaStream_t stream);
// torch.optim.AdamW's step over every AdamW parameter.
void launch_adamw(const StepBuffers& b, const Chunk* chunks, int n_chunks, cudaStream_t stream);

}  // namespace normuon::cuda
