// What the fused step's kernels (step_kernels.cuh) work on: the device buffers and the tables. Every
// kernel first reads the step status and does nothing when a NaN/Inf gradient was found, so a skipped
// step changes nothing, also when replayed from a CUDA graph.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "step_tables.h"

namespace normuon::cuda {

// The element type of a gradient, or of a low-precision parameter the step writes rounded.
enum class ElemType : int32_t { f32, bf16, f16 };

// Where the step finds one parameter's tensors (one per layout entry, in device memory): the backend's
// flat buffers, or the caller's own tensors (table mode, re-uploaded when an address changes).
struct EntryOperands {
  float* master;      // the fp32 values the step reads and writes
  void* low;          // a bf16 / fp16 parameter written rounded from master in the same pass, or nullptr
  const void* grad;   // the gradient (read only when has_grad)
  ElemType grad_type;
  ElemType low_type;
};

// The device buffers and tables one step works on (pointers into DeviceFlatState and the backend).
struct StepBuffers {
  const EntryOperands* operands;  // per layout entry
  float* momentum;
  float* row_var;
  float* exp_avg;
  float* exp_avg_sq;
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

}  // namespace normuon::cuda
