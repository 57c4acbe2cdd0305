#include "normuon/param_table.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <utility>

namespace normuon {
namespace {

// In place: views of either buffer (Python's, the comparator's) stay valid.
void copy_into(const AlignedBuffer& src, AlignedBuffer& dst) {
  std::memcpy(dst.data(), src.data(), static_cast<size_t>(src.size()) * sizeof(float));
}

void copy_state(const AlignedBuffer* const from[4], AlignedBuffer* const to[4]) {
  for (int k = 0; k < 4; ++k) copy_into(*from[k], *to[k]);
}

}  // namespace

namespace {

// Why `runs` cannot describe where entry `le`'s rows lie, or empty.
std::string runs_invalid_reason(const RowRuns& runs, const LayoutEntry& le, const char* what) {
  if (runs.dense()) return "";
  const std::string where = std::string(what) + " of '" + le.name + "' ";
  if (le.algorithm != Algorithm::normuon)
    return where + "lies in row runs, which only NorMuon matrices may (it is an AdamW parameter)";
  const int64_t row = le.cols;
  if (runs.run <= 0 || runs.pitch < runs.run || row <= 0 || runs.run % row || runs.pitch % row || le.numel % runs.run)
    return where + "has row runs of " + std::to_string(runs.run) + " elements every " + std::to_string(runs.pitch) +
           ": a run must be whole rows (" + std::to_string(row) + " elements each) dividing the matrix, and the "
           "pitch whole rows no shorter than the run";
  return "";
}

}  // namespace

int64_t ElementOrder::caller_index(int64_t element) const {
  int64_t index = 0;
  for (size_t d = sizes.size(); d-- > 0;) {  // the innermost dimension first
    index += element % sizes[d] * strides[d];
    element /= sizes[d];
  }
  return sizes.empty() ? element : index;
}

ParamTable::ParamTable(const Layout& l) : layout(&l), params(l.entries.size()), grads(l.entries.size()) {
  for (size_t e = 0; e < l.entries.size(); ++e) params[e].dtype = l.entries[e].dtype;
}

std::string ParamTable::invalid_reason() const {
  if (params.size() != layout->entries.size() || grads.size() != layout->entries.size())
    return "the table has " + std::to_string(params.size()) + " parameters and " + std::to_string(grads.size()) +
           " gradients for " + std::to_string(layout->entries.size()) + " layout entries";
  if (!orders.empty() && orders.size() != params.size())
    return "the table has " + std::to_string(orders.size()) + " element orders for " + std::to_string(params.size()) +
           " layout entries";
  for (size_t e = 0; e < params.size(); ++e) {
    const LayoutEntry& le = layout->entries[e];
    if (!params[e].data && le.numel > 0) return "parameter '" + le.name + "' has no address";
    if (params[e].dtype != le.dtype)
      return "parameter '" + le.name + "' is " + to_string(params[e].dtype) + " but the layout says " +
             to_string(le.dtype);
    if (!orders.empty() && !orders[e].sizes.empty()) {
      int64_t n = 1;
      for (const int64_t size : orders[e].sizes) n *= size;
      if (n != le.numel || orders[e].strides.size() != orders[e].sizes.size() || !params[e].runs.dense())
        return "the element order of '" + le.name + "' does not describe its " + std::to_string(le.numel) +
               " elements (a dense parameter's dimensions and strides)";
    }
    for (const auto& [ref, what] : {std::pair{&params[e], "the parameter"}, std::pair{&grads[e], "the gradient"}}) {
      const std::string reason = runs_invalid_reason(ref->runs, le, what);
      if (!reason.empty()) return reason;
    }
  }
  return "";
}

TableState::TableState(const Layout& l, bool buffers)
    : layout(&l),
      masters(buffers ? l.master_floats : 0),
      momentum(buffers ? l.normuon_floats : 0),
      row_var(buffers ? l.stat_floats : 0),
      exp_avg(buffers ? l.adam_floats : 0),
      exp_avg_sq(buffers ? l.adam_floats : 0),
      group_steps(l.group_names.size(), 0),
      entry_steps(l.entries.size(), 0) {}

void TableState::refresh_master(int e, const ParamTable& table) {
  const LayoutEntry& le = layout->entries[e];
  if (le.master_offset < 0) return;  // fp32: the tensor is the master
  widen_rows(table.params[e].data, le.dtype, table.params[e].runs, 0, master(e), le.numel);
}

void StepOperands::set_grad_scale(const float* scale, const std::string& backend) {
  if (scale && !(std::isfinite(*scale) && *scale > 0))
    throw std::invalid_argument(backend + ": the gradient scale must be finite and > 0");
  grad_scale = scale;
}

ParamOperand table_operand(const ParamTable& table, int e, float* masters) {
  const LayoutEntry& le = table.layout->entries[e];
  ParamOperand op;
  if (le.master_offset < 0) {
    op.master = static_cast<float*>(table.params[e].data);
    op.master_runs = table.params[e].runs;
  } else {
    op.master = masters + le.master_offset;
    op.low = table.params[e].data;
    op.low_runs = table.params[e].runs;
  }
  op.low_dtype = le.dtype;
  op.grad = table.grads[e].data;
  op.grad_dtype = table.grads[e].dtype;
  op.grad_runs = table.grads[e].runs;
  return op;
}

void StepOperands::bind(FlatState& state) {
  layout = state.layout;
  table = nullptr;
  grad_scale = nullptr;  // a scale belongs to one step: set after binding, never left from an earlier one
  params.resize(layout->entries.size());
  for (size_t e = 0; e < params.size(); ++e) {
    const int i = static_cast<int>(e);
    params[e] = ParamOperand{state.param(i), nullptr, DType::f32, state.has_grad[e] ? state.grad(i) : nullptr,
                             DType::f32, {}, {}, {}};  // a flat state's tensors are dense
  }
  momentum = state.momentum.data();
  row_var = state.row_var.data();
  exp_avg = state.exp_avg.data();
  exp_avg_sq = state.exp_avg_sq.data();
  group_steps = state.group_steps.data();
  entry_steps = state.entry_steps.data();
}

void StepOperands::bind(TableState& state, const ParamTable& tensors) {
  if (tensors.layout != state.layout) throw std::invalid_argument("the parameter table has another layout");
  const std::string reason = tensors.invalid_reason();
  if (!reason.empty()) throw std::invalid_argument(reason);
  layout = state.layout;
  table = &tensors;
  grad_scale = nullptr;
  params.resize(layout->entries.size());
  for (size_t e = 0; e < params.size(); ++e) params[e] = table_operand(tensors, static_cast<int>(e), state.masters.data());
  momentum = state.momentum.data();
  row_var = state.row_var.data();
  exp_avg = state.exp_avg.data();
  exp_avg_sq = state.exp_avg_sq.data();
  group_steps = state.group_steps.data();
  entry_steps = state.entry_steps.data();
}

namespace {

// Both directions between the modes need one layout and a complete table.
void check_crossing(const char* what, const TableState& state, const ParamTable& table, const FlatState& flat) {
  if (flat.layout != state.layout || table.layout != state.layout)
    throw std::invalid_argument(std::string(what) + ": the states have different layouts");
  const std::string reason = table.invalid_reason();
  if (!reason.empty()) throw std::invalid_argument(std::string(what) + ": " + reason);
}

}  // namespace

void table_to_flat(const TableState& state, const ParamTable& table, FlatState& flat) {
  check_crossing("table_to_flat", state, table, flat);
  const Layout& layout = *state.layout;
  for (size_t e = 0; e < layout.entries.size(); ++e) {
    const LayoutEntry& le = layout.entries[e];
    const int i = static_cast<int>(e);
    if (le.master_offset < 0)
      widen_rows(table.params[e].data, DType::f32, table.params[e].runs, 0, flat.param(i), le.numel);
    else
      std::memcpy(flat.param(i), state.masters.data() + le.master_offset, static_cast<size_t>(le.numel) * sizeof(float));
    flat.has_grad[e] = table.grads[e].data != nullptr;
    if (table.grads[e].data)
      widen_rows(table.grads[e].data, table.grads[e].dtype, table.grads[e].runs, 0, flat.grad(i), le.numel);
    else
      std::memset(flat.grad(i), 0, static_cast<size_t>(le.numel) * sizeof(float));
  }
  const AlignedBuffer* const from[4] = {&state.momentum, &state.row_var, &state.exp_avg, &state.exp_avg_sq};
  AlignedBuffer* const to[4] = {&flat.momentum, &flat.row_var, &flat.exp_avg, &flat.exp_avg_sq};
  copy_state(from, to);
  flat.group_steps = state.group_steps;
  flat.entry_steps = state.entry_steps;
}

void flat_to_table(const FlatState& flat, TableState& state, const ParamTable& table) {
  check_crossing("flat_to_table", state, table, flat);
  const Layout& layout = *state.layout;
  for (size_t e = 0; e < layout.entries.size(); ++e) {
    const LayoutEntry& le = layout.entries[e];
    const float* master = flat.param(static_cast<int>(e));
    if (le.master_offset >= 0)
      std::memcpy(state.masters.data() + le.master_offset, master, static_cast<size_t>(le.numel) * sizeof(float));
    narrow_rows(master, table.params[e].data, le.dtype, table.params[e].runs, 0, le.numel);
  }
  const AlignedBuffer* const from[4] = {&flat.momentum, &flat.row_var, &flat.exp_avg, &flat.exp_avg_sq};
  AlignedBuffer* const to[4] = {&state.momentum, &state.row_var, &state.exp_avg, &state.exp_avg_sq};
  copy_state(from, to);
  state.group_steps = flat.group_steps;
  state.entry_steps = flat.entry_steps;
}

}  // namespace normuon
