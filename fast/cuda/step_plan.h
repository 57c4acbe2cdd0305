// What one fused CUDA step will do, worked out on the host from the layout and the options: the
// Newton-Schulz batches, the per-entry and per-matrix tables, the multi-tensor chunks, the statistics
// tasks and the number of launches. Plain C++ (no CUDA call), so tests check it on any machine.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "newton_schulz_cuda.h"
#include "normuon/backend.h"
#include "normuon/layout.h"
#include "normuon/options.h"
#include "normuon/param_table.h"
#include "step_tables.h"

namespace normuon::cuda {

// The Newton-Schulz buffers of a step are shared by its batches and sized for the largest
// (NsWorkspaceSizes), so the plan bounds a batch's buffers by this many bytes: a shape bucket's matrices of
// one group are split into as few batches as keep within it (a single matrix larger than it is a batch of
// its own). A sixteenth of the spec's state (momentum, second moments, exp_avg, exp_avg_sq), and at least
// 256 MiB, so that a small model (gpt2-124m) keeps one batch per shape.
int64_t ns_scratch_budget(const Layout& layout);

struct StepPlan {
  // Newton-Schulz batches: matrices of one shape bucket that share a group (so the NS knobs), at most as
  // many as ns_scratch_budget allows.
  std::vector<NsBatchShape> batches;
  std::vector<int> batch_group;
  // Per batch: its matrices' chunks, statistics tasks and matrices, consecutive in the tables below.
  std::vector<BatchRange> batch_ranges;
  // Per matrix (MatrixInfo order: by batch): its batch and its index inside the batch. The matrices' NS
  // pointers are left null here; the backend fills them from the BatchedNewtonSchulz buffers.
  std::vector<int> matrix_batch, matrix_index;
  std::vector<EntryInfo> entries;
  std::vector<MatrixInfo> matrices;
  std::vector<Chunk> scan_chunks;     // every parameter's gradient
  std::vector<Chunk> normuon_chunks;  // NorMuon matrices, by batch
  std::vector<Chunk> adamw_chunks;    // AdamW parameters
  std::vector<StatTask> stat_tasks;   // by batch
  int64_t stat_floats = 0, n_groups = 0;  // the layout's

  // Throws std::invalid_argument when the layout and options don't fit the tables (sizes, groups).
  // ns_budget: the bytes a batch's Newton-Schulz buffers may take; 0: ns_scratch_budget(layout).
  static StepPlan build(const Layout& layout, const Options& options, int64_t ns_budget = 0);

  // The tables' sizes, with the tables at the given copies of scan_chunks, normuon_chunks, adamw_chunks
  // and stat_tasks (device copies on the GPU) and of batch_ranges (host memory; it must outlive the steps).
  StepTables tables(const Chunk* scan, const Chunk* normuon, const Chunk* adamw, const StatTask* stat,
                    const BatchRange* ranges) const;

  // Device bytes the backend holds for this plan beyond the state and the masters (as
  // FastCudaBackend::workspace_bytes counts them): the Newton-Schulz buffers and cuBLASLt's workspace, the
  // tables, the statistics' scratch and the status words.
  int64_t workspace_bytes() const;

  // Kernel launches of one step besides Newton-Schulz's own (empty passes launch nothing).
  int64_t elementwise_launches() const;
  // Newton-Schulz launches of one step: per non-empty batch ns_launches(ns_steps, panels) =
  // 2 + (4 + 2 panels) * ns_steps, or ns_gram_launches(ns_steps, panels) for a Gram batch
  // (ns_batch_launches; panels from the batch's panel_width).
  int64_t newton_schulz_launches() const;
};

// The per-group scalars the kernels read, from a group's options.
GroupScalars group_scalars(const GroupOptions& group);

// An entry's AdamW bias corrections. With `steps_taken` (the entry's own step count before the step):
// those of its next step, computed on the host exactly as the reference computes them (bias_from_host =
// 1); without, none (the step-counter kernel derives them on the device).
EntryScalars entry_scalars(const AdamWHyper& group, const int64_t* steps_taken = nullptr);

// Per layout entry into `out` (reusing its storage: set_options() runs every step), from the counts
// before the next step: each entry's own count from `entry_steps` when given; else, when only
// `group_steps` is given, its group's counter (entry_steps_from_groups: what a caller that keeps group
// counters only, as format-version-1 state did, means); else none (derived on the device). Throws
// std::invalid_argument when a vector has the wrong size.
void fill_entry_scalars(const Layout& layout, const Options& options, const std::vector<int64_t>* group_steps,
                        const std::vector<int64_t>* entry_steps, std::vector<EntryScalars>& out);

// Per matrix (the plan's order) into `out`: the lr_scale factor of its group's rule on its entry (entry_kappa);
// the ratio is the device's. Reuses out's storage: set_options() runs every step.
void fill_matrix_scalars(const Layout& layout, const std::vector<MatrixInfo>& matrices, const Options& options,
                         std::vector<MatrixScalars>& out);

// What a step's status says, as begin_step (core/src/step_prologue.cpp) says it, so every backend
// reports a NaN/Inf gradient the same way: {} when none was reported; a skipped step under
// nonfinite=skip_step; std::runtime_error under nonfinite=error. table: the caller's tensors in table mode,
// whose element orders number the element as the caller sees it (ParamTable::caller_element), or nullptr.
StepResult step_result(const StepStatus& status, const Layout& layout, const Options& options,
                       const ParamTable* table = nullptr);
// A table-mode step's verdict from its status, copied after it: step_result's, or, when the gradient
// scaler's found_inf skipped it, skipped with kFoundInfReason (engine.h).
StepResult step_verdict(const StepStatus& status, const Layout& layout, const Options& options,
                        const ParamTable* table = nullptr);

// The fields a CUDA plan is built from (its Newton-Schulz batches' GEMMs): fixed once it is built.
inline std::vector<std::string> planned_fields() {
  return {"ns_precision", "ns_coefficients", "ns_steps", "ns_eps", "ns_algorithm"};
}

// The kernels' element type of a manifest dtype.
inline ElemType elem_type(DType d) {
  return d == DType::f32 ? ElemType::f32 : d == DType::bf16 ? ElemType::bf16 : ElemType::f16;
}

// Entry e of the caller's table as the kernels read it (table_operand, with the masters at `masters`).
inline EntryOperands entry_operands(const ParamTable& table, int e, float* masters) {
  const ParamOperand op = table_operand(table, e, masters);
  EntryOperands out{};  // value-initialised: compared bytewise when deciding to re-upload
  out.master = op.master;
  out.low = op.low;
  out.grad = op.grad;
  out.grad_type = elem_type(op.grad_dtype);
  out.low_type = elem_type(op.low_dtype);
  out.master_runs = {op.master_runs.run, op.master_runs.pitch};
  out.low_runs = {op.low_runs.run, op.low_runs.pitch};
  out.grad_runs = {op.grad_runs.run, op.grad_runs.pitch};
  return out;
}

// Why the plan cannot be built, or empty.
std::string plan_unsupported_reason(const Layout& layout, const Options& options);

}  // namespace normuon::cuda
