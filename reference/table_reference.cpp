#include "table_reference.h"

#include "cpu_ops.h"
#include "normuon/low_precision.h"
#include "normuon/step_prologue.h"
#include "spec_steps.h"

#include <algorithm>

namespace normuon {

ReferenceTableBackend::ReferenceTableBackend(const Layout& layout) : ops_(std::make_unique<spec::CpuOps>()) {
  int64_t largest = 0;  // the gradient and gathered-parameter copies are sized once, not in a step
  for (const LayoutEntry& e : layout.entries) largest = std::max(largest, e.numel);
  grad_.resize(static_cast<size_t>(largest));
  param_.resize(static_cast<size_t>(largest));
}
ReferenceTableBackend::~ReferenceTableBackend() = default;

StepResult ReferenceTableBackend::step(TableState& state, const ParamTable& table, const Options& options,
                                       const float* grad_scale) {
  operands_.bind(state, table);
  operands_.set_grad_scale(grad_scale, "reference-cpu backend");
  if (auto skipped = begin_step(operands_, options)) return *skipped;
  const Layout& layout = *state.layout;
  for (size_t i = 0; i < layout.entries.size(); ++i) {
    const LayoutEntry& e = layout.entries[i];
    const ParamOperand& op = operands_.params[i];
    if (!op.grad || e.numel == 0) continue;  // untouched, state not advanced
    float* g = grad_.data();
    widen_rows(op.grad, op.grad_dtype, op.grad_runs, 0, g, e.numel);
    if (grad_scale)
      for (int64_t k = 0; k < e.numel; ++k) g[k] /= *grad_scale;
    // The fp32 values stepped: the master (or the fp32 tensor) in place when dense, else a dense copy.
    float* p = op.master;
    if (!op.master_runs.dense()) {
      p = param_.data();
      widen_rows(op.master, DType::f32, op.master_runs, 0, p, e.numel);
    }
    const GroupOptions& group = options.groups[e.group];
    if (e.algorithm == Algorithm::normuon) {
      spec::normuon_update(*ops_, p, g, operands_.momentum + e.offset, operands_.row_var + e.stat_offset, e.rows,
                           e.cols, group.normuon, e.stats_per_row, e.transposed);
    } else {
      ops_->adamw(p, g, operands_.exp_avg + e.adam_offset, operands_.exp_avg_sq + e.adam_offset, e.numel,
                  spec::adamw_scalars(group.adamw, operands_.entry_steps[i]));
    }
    if (p != op.master) narrow_rows(p, op.master, DType::f32, op.master_runs, 0, e.numel);
    if (op.low) narrow_rows(op.master, op.low, op.low_dtype, op.low_runs, 0, e.numel);
  }
  return {};
}

int64_t ReferenceTableBackend::workspace_bytes() const {
  return static_cast<int64_t>(sizeof(float) * (grad_.capacity() + param_.capacity())) + ops_->held_bytes();
}

}  // namespace normuon
