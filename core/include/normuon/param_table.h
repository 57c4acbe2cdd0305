// Table mode: a step over the caller's own tensors (as torch's _fused_adamw_ and Apex's multi-tensor
// apply do). Per layout entry the caller hands over where its parameter and gradient live; the step reads
// gradients in place and writes parameters in place. The optimizer keeps only its state and, for bf16 /
// fp16 parameters, their fp32 masters (Layout::master_floats), written back rounded in the same pass.
// An fp32 parameter is its own master: nothing is copied.
//
// One state format: a TableState and the caller's tensors hold exactly what a FlatState holds, so
// table_to_flat / flat_to_table move a state between the modes (state files, the comparator) unchanged.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "normuon/backend.h"
#include "normuon/flat_state.h"
#include "normuon/row_runs.h"

namespace normuon {

struct TensorRef {
  void* data = nullptr;  // row-major; nullptr: absent (a gradient: no gradient this step)
  DType dtype = DType::f32;
  RowRuns runs;          // dense unless the tensor is a block of rows of a larger one (row_runs.h)
};

// How an entry's elements, in the order they lie in memory (the order a step walks them), are numbered in
// the caller's tensor (row-major over its own shape): a dense tensor stored in another order (channels_last,
// a transposed view) is stepped where it lies, and a message still names the element the caller sees.
struct ElementOrder {
  std::vector<int64_t> sizes;    // the caller's dimensions, outermost in memory first; empty: the same order
  std::vector<int64_t> strides;  // each one's stride in the caller's row-major numbering
  int64_t caller_index(int64_t element) const;
};

// The caller's tensors, per layout entry. A parameter's dtype is the layout's; a gradient may be fp32,
// bf16 or fp16 whatever its parameter's (Megatron keeps fp32 gradients of bf16 parameters).
struct ParamTable {
  explicit ParamTable(const Layout& layout);
  const Layout* layout;
  std::vector<TensorRef> params, grads;
  std::vector<ElementOrder> orders;  // per entry (a gradient lies as its parameter); none: all row-major
  // Element `element` of entry e, as a step walks it, as the caller numbers it.
  int64_t caller_element(int e, int64_t element) const {
    return orders.empty() ? element : orders[static_cast<size_t>(e)].caller_index(element);
  }
  // Why this table cannot be stepped (a missing parameter, a dtype other than the layout's), or empty.
  std::string invalid_reason() const;
};

// The optimizer's own memory in table mode: the state buffers of FlatState, and the masters.
struct TableState {
  // buffers = false: the counters only (a device backend keeps the buffers in its own memory).
  explicit TableState(const Layout& layout, bool buffers = true);
  const Layout* layout;
  AlignedBuffer masters;              // master_floats
  AlignedBuffer momentum, row_var;    // normuon_floats, stat_floats
  AlignedBuffer exp_avg, exp_avg_sq;  // adam_floats
  std::vector<int64_t> group_steps;   // per group
  std::vector<int64_t> entry_steps;   // per layout entry: its own step count (FlatState::entry_steps)

  float* master(int e) { return masters.data() + layout->entries[e].master_offset; }  // low precision only
  // Every master from its parameter (widened): at construction, and after an outside write.
  void refresh_master(int e, const ParamTable& table);
};

// One parameter as a step sees it, in either mode.
struct ParamOperand {
  float* master = nullptr;   // the fp32 values the step reads and writes
  void* low = nullptr;       // a bf16 / fp16 copy the step writes rounded from master, or nullptr
  DType low_dtype = DType::f32;
  const void* grad = nullptr;  // nullptr: no gradient this step
  DType grad_dtype = DType::f32;
  // Each pointer's rows (RowRuns): the caller's tensors may be blocks of rows; the optimizer's own
  // buffers (FlatState's, the masters) are dense.
  RowRuns master_runs, low_runs, grad_runs;
};

// Entry e of the caller's table as a step sees it: an fp32 parameter is its own master; a bf16 / fp16
// one is written rounded from its master in `masters` (host or device memory) at the layout's offset.
ParamOperand table_operand(const ParamTable& table, int e, float* masters);

// What one step reads and writes: per-entry operands and the state buffers. Binding again reuses the
// storage, so a backend that keeps one allocates nothing per step.
struct StepOperands {
  const Layout* layout = nullptr;
  const ParamTable* table = nullptr;  // table mode: how its messages number an element (caller_element)
  std::vector<ParamOperand> params;  // per layout entry
  float *momentum = nullptr, *row_var = nullptr, *exp_avg = nullptr, *exp_avg_sq = nullptr;
  int64_t* group_steps = nullptr;
  int64_t* entry_steps = nullptr;  // per layout entry (FlatState::entry_steps)
  // A gradient scaler's scale (torch's GradScaler), or nullptr: every gradient is divided by it as it is
  // read, as torch's fused AdamW does, instead of in a pass of its own. The scaler has already looked for
  // inf/NaN gradients (its found_inf), so the step's own scan is left out.
  const float* grad_scale = nullptr;

  void bind(FlatState& state);                              // the flat buffers; has_grad picks gradients
  void bind(TableState& state, const ParamTable& tensors);    // throws std::invalid_argument on a bad table
  // After bind: a host backend's gradient scale (nullptr: none); std::invalid_argument, naming `backend`,
  // unless it is finite and > 0, so that a step never divides by it into Inf/NaN.
  void set_grad_scale(const float* scale, const std::string& backend);
  bool has_grad(int e) const { return params[e].grad != nullptr; }
};

// Between the modes. table_to_flat: the flat parameters (fp32 tensors or masters), gradients (widened,
// has_grad from presence), state and steps (group and entry). flat_to_table: state, steps and masters, and
// the caller's parameters rounded to their dtype.
void table_to_flat(const TableState& state, const ParamTable& table, FlatState& flat);
void flat_to_table(const FlatState& flat, TableState& state, const ParamTable& table);

}  // namespace normuon
