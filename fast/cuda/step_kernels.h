// What the fused step's kernels (step_kernels.cuh) work on: the device buffers and the tables. Every
// kernel first reads the step status and does nothing when a NaN/Inf gradient was found, so a skipped
// step changes nothing, also when replayed from a CUDA graph.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "step_tables.h"

namespace normuon::cuda {

// The device buffers and tables one step works on (pointers into DeviceFlatState and the backend).
struct StepBuffers {
  const EntryOperands* operands;  // per layout entry
  float* momentum;
  float* row_var;
  float* exp_avg;
  float* exp_avg_sq;
  const uint8_t* has_grad;
  int64_t* group_steps;
  int64_t* entry_steps;           // per layout entry: its own step count
  EntryScalars* entry_scalars;    // per layout entry: AdamW bias corrections of its count
  int32_t n_entries, n_groups;
  const EntryInfo* entries;
  const MatrixInfo* matrices;
  GroupScalars* groups;
  MatrixScalars* matrix_scalars;
  double* stat_sums;  // stat_floats doubles: sums of squares along the reduce axis
  float* inv_scale;   // stat_floats floats: 1 / sqrt(v) (with eps)
  StepStatus* status;
  // torch's GradScaler, or nullptr: gradients are divided by *grad_scale as they are read (torch's fused
  // AdamW does the same), and a step with *found_inf != 0 changes nothing (the scaler backs off and
  // retries). The scaler has looked for inf/NaN itself, so the scan is left out. Device memory.
  const float* grad_scale;
  const float* found_inf;
};

}  // namespace normuon::cuda
