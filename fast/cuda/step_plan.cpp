#include "step_plan.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "normuon/engine.h"
#include "normuon/step_prologue.h"
#include "ns_batch_geometry.h"

namespace normuon::cuda {
namespace {

void add_chunks(std::vector<Chunk>& chunks, int entry, int64_t numel) {
  for (int64_t begin = 0; begin < numel; begin += kChunkElements)
    chunks.push_back({entry, static_cast<int32_t>(std::min(kChunkElements, numel - begin)), begin});
}

}  // namespace

std::string plan_unsupported_reason(const Layout& layout, const Options& options) {
  if (std::string reason = fused_step_unsupported_reason(layout, options); !reason.empty()) return reason;
  // The step status packs (entry, element) into 64 bits; chunk and task indices are 32-bit, and so is an
  // element index of a NorMuon matrix (the update kernel's row, the division of step_kernels.cuh's at()).
  if (layout.entries.size() >= (size_t{1} << (64 - kBadElementBits - 1)))
    return "too many parameters (" + std::to_string(layout.entries.size()) + ") for the step status word";
  for (const auto& e : layout.entries) {
    if (e.numel >= (int64_t{1} << kBadElementBits)) return "parameter '" + e.name + "' has 2^40 elements or more";
    if (e.algorithm == Algorithm::normuon && e.numel > std::numeric_limits<int32_t>::max())
      return "NorMuon matrix '" + e.name + "' has 2^31 elements or more";
  }
  if (layout.param_floats / kChunkElements >= std::numeric_limits<int32_t>::max())
    return "too many elements for the chunk tables";
  return "";
}

int64_t ns_scratch_budget(const Layout& layout) {
  const int64_t state_bytes = 4 * (layout.normuon_floats + layout.stat_floats + 2 * layout.adam_floats);
  return std::max<int64_t>(state_bytes / 16, int64_t{256} << 20);
}

StepPlan StepPlan::build(const Layout& layout, const Options& options, int64_t ns_budget) {
  const std::string reason = plan_unsupported_reason(layout, options);
  if (!reason.empty()) throw std::invalid_argument(reason);
  StepPlan plan;
  plan.stat_floats = layout.stat_floats;
  plan.n_groups = static_cast<int64_t>(layout.group_names.size());
  for (int i = 0; i < static_cast<int>(layout.entries.size()); ++i) {
    const LayoutEntry& e = layout.entries[i];
    plan.entries.push_back(EntryInfo{e.offset, e.adam_offset, e.group, -1, e.numel == 0});
    add_chunks(plan.scan_chunks, i, e.numel);
    if (e.algorithm == Algorithm::adamw) add_chunks(plan.adamw_chunks, i, e.numel);
  }
  if (ns_budget < 0) throw std::invalid_argument("a negative Newton-Schulz budget");
  const int64_t budget = ns_budget > 0 ? ns_budget : ns_scratch_budget(layout);
  for (const NsBatch& batch : newton_schulz_batches(layout)) {
    const NorMuonHyper& h = options.groups[batch.group].normuon;
    NsBatchShape shape{batch.rows, batch.cols, 0, h.ns_precision, h.ns_coefficients, h.ns_steps, h.ns_eps, h.ns_algorithm};
    const int64_t n = static_cast<int64_t>(batch.entries.size());
    const int64_t most = std::max<int64_t>(1, budget / std::max<int64_t>(1, ns_bytes_per_matrix(shape)));
    const int64_t parts = (n + most - 1) / most, per = (n + parts - 1) / parts;  // as even as they come
    for (int64_t first = 0; first < n; first += per) {
      shape.count = std::min(per, n - first);
      const int b = static_cast<int>(plan.batches.size());
      plan.batches.push_back(shape);
      plan.batch_group.push_back(batch.group);
      BatchRange r{static_cast<int>(plan.normuon_chunks.size()), 0, static_cast<int>(plan.stat_tasks.size()), 0,
                   static_cast<int>(plan.matrices.size()), 0};
      for (int64_t k = first; k < first + shape.count; ++k) {
        const int i = batch.entries[static_cast<size_t>(k)];
        const LayoutEntry& e = layout.entries[i];
        if (e.numel == 0) continue;  // nothing to orthogonalise: no matrix
        MatrixInfo m{};
        m.entry = i;
        m.group = e.group;
        m.rows = static_cast<int32_t>(e.rows);
        m.cols = static_cast<int32_t>(e.cols);
        m.stats_per_row = e.stats_per_row;
        m.ns_bf16 = shape.precision == NsPrecision::bf16;
        m.offset = e.offset;
        m.stat_offset = e.stat_offset;
        m.stat_len = e.stat_len;
        const int32_t matrix = static_cast<int32_t>(plan.matrices.size());
        plan.entries[static_cast<size_t>(i)].matrix = matrix;
        if (e.stats_per_row)
          for (int64_t row = 0; row < e.rows; row += kStatRowsPerTask) plan.stat_tasks.push_back({matrix, static_cast<int32_t>(row)});
        else
          for (int64_t col = 0; col < e.cols; col += kStatColsPerTask) plan.stat_tasks.push_back({matrix, static_cast<int32_t>(col)});
        plan.matrices.push_back(m);
        plan.matrix_batch.push_back(b);
        plan.matrix_index.push_back(static_cast<int>(k - first));
        add_chunks(plan.normuon_chunks, i, e.numel);
      }
      r.n_chunks = static_cast<int>(plan.normuon_chunks.size()) - r.first_chunk;
      r.n_tasks = static_cast<int>(plan.stat_tasks.size()) - r.first_task;
      r.n_matrices = static_cast<int>(plan.matrices.size()) - r.first_matrix;
      plan.batch_ranges.push_back(r);
    }
  }
  return plan;
}

GroupScalars group_scalars(const GroupOptions& g) {
  GroupScalars s{};
  const NorMuonHyper& h = g.normuon;
  s.w1 = static_cast<float>(1 - h.beta1);
  s.beta1 = static_cast<float>(h.beta1);
  s.nesterov = h.nesterov;
  s.w2 = static_cast<float>(1 - h.beta2);
  s.eps_add = h.eps_placement == EpsPlacement::add;
  s.denom_eps = static_cast<float>(h.denom_eps);
  s.renorm_eps = static_cast<float>(h.renorm_eps);
  s.wd_mode = h.weight_decay_mode == WeightDecayMode::decoupled ? 0
              : h.weight_decay_mode == WeightDecayMode::cautious ? 1
                                                                  : 2;
  s.decay = h.weight_decay != 0 && s.wd_mode != 2;
  s.decay_factor = static_cast<float>(1 - h.lr * h.weight_decay);
  s.lr_wd = static_cast<float>(h.lr * h.weight_decay);
  s.neg_lr = static_cast<float>(-h.lr);
  const AdamWHyper& a = g.adamw;
  s.adam_decay = a.weight_decay != 0;
  s.adam_decay_factor = static_cast<float>(1 - a.lr * a.weight_decay);
  s.adam_w1 = static_cast<float>(1 - a.beta1);
  s.adam_beta2 = static_cast<float>(a.beta2);
  s.adam_one_minus_beta2 = static_cast<float>(1 - a.beta2);
  s.adam_eps = static_cast<float>(a.eps);
  s.adam_lr = a.lr;
  s.adam_beta1_d = a.beta1;
  s.adam_beta2_d = a.beta2;
  return s;
}

EntryScalars entry_scalars(const AdamWHyper& a, const int64_t* steps_taken) {
  EntryScalars s{};
  if (steps_taken) {  // the reference's arithmetic (fast/fast_cpu_backend.cpp does the same)
    const double t = static_cast<double>(*steps_taken + 1);
    s.bias_from_host = 1;
    s.adam_bc2_sqrt = static_cast<float>(std::sqrt(1 - std::pow(a.beta2, t)));
    s.adam_neg_step_size = static_cast<float>(-(a.lr / (1 - std::pow(a.beta1, t))));
  }
  return s;
}

void fill_entry_scalars(const Layout& layout, const Options& options, const std::vector<int64_t>* group_steps,
                        const std::vector<int64_t>* entry_steps, std::vector<EntryScalars>& out) {
  if (options.groups.size() != layout.group_names.size())
    throw std::invalid_argument("the options define " + std::to_string(options.groups.size()) +
                                " groups but the layout was built with " + std::to_string(layout.group_names.size()));
  if (group_steps && group_steps->size() != layout.group_names.size())
    throw std::invalid_argument(std::to_string(group_steps->size()) + " group steps for " +
                                std::to_string(layout.group_names.size()) + " groups");
  if (entry_steps && entry_steps->size() != layout.entries.size())
    throw std::invalid_argument(std::to_string(entry_steps->size()) + " entry steps for " +
                                std::to_string(layout.entries.size()) + " parameters");
  out.resize(layout.entries.size());
  for (size_t e = 0; e < out.size(); ++e) {
    const int group = layout.entries[e].group;
    const int64_t* taken = entry_steps ? &(*entry_steps)[e]
                           : group_steps ? &(*group_steps)[static_cast<size_t>(group)]
                                         : nullptr;
    out[e] = entry_scalars(options.groups[static_cast<size_t>(group)].adamw, taken);
  }
}

void fill_matrix_scalars(const Layout& layout, const std::vector<MatrixInfo>& matrices, const Options& options,
                         std::vector<MatrixScalars>& out) {
  out.resize(matrices.size());
  for (size_t m = 0; m < matrices.size(); ++m) {
    const MatrixInfo& info = matrices[m];
    const double kappa = entry_kappa(layout.entries.at(static_cast<size_t>(info.entry)),
                                     options.groups.at(info.group).normuon.lr_scale);
    out[m] = {0.0f, static_cast<float>(kappa)};
  }
}

StepResult step_result(const StepStatus& status, const Layout& layout, const Options& options,
                       const ParamTable* table) {
  if (status.reported_bad == kNoBadGradient) return {};
  const int entry = static_cast<int>(status.reported_bad >> kBadElementBits);
  int64_t element = static_cast<int64_t>(status.reported_bad & ((1ull << kBadElementBits) - 1));
  if (table) element = table->caller_element(entry, element);
  return nonfinite_gradient(layout.entries.at(entry).name, status.reported_value, element, status.reported_step,
                            options.nonfinite);
}

StepResult step_verdict(const StepStatus& status, const Layout& layout, const Options& options,
                        const ParamTable* table) {
  if (status.reported_bad == kNoBadGradient && status.first_bad == kScalerFoundInf) return {true, kFoundInfReason};
  return step_result(status, layout, options, table);
}

StepTables StepPlan::tables(const Chunk* scan, const Chunk* normuon, const Chunk* adamw, const StatTask* stat,
                            const BatchRange* ranges) const {
  return {scan,  static_cast<int>(scan_chunks.size()), normuon, static_cast<int>(normuon_chunks.size()),
          adamw, static_cast<int>(adamw_chunks.size()), stat,   static_cast<int>(stat_tasks.size()),
          static_cast<int>(matrices.size()), ranges, static_cast<int>(batch_ranges.size())};
}

int64_t StepPlan::workspace_bytes() const {
  NsWorkspaceSizes ns;
  bool any = false;
  for (const NsBatchShape& shape : batches) {
    const NsBatchGeometry g = ns_batch_geometry(shape);
    ns.add(shape, g);
    any = any || !g.empty;
  }
  auto bytes = [](const auto& v) { return static_cast<int64_t>(v.size() * sizeof(v[0])); };
  const int64_t n_entries = static_cast<int64_t>(entries.size());
  return (any ? kLtWorkspaceBytes + ns.bytes() : 0) + bytes(scan_chunks) + bytes(normuon_chunks) + bytes(adamw_chunks) +
         bytes(stat_tasks) + bytes(entries) + bytes(matrices) +
         n_entries * static_cast<int64_t>(sizeof(EntryOperands) + sizeof(EntryScalars)) +
         n_groups * static_cast<int64_t>(sizeof(GroupScalars)) +
         static_cast<int64_t>(matrices.size() * sizeof(MatrixScalars)) + stat_floats * (8 + 4) /* sums, 1/sqrt(v) */ +
         static_cast<int64_t>(sizeof(StepStatus)) + 8 /* refresh_master's flag */;
}

int64_t StepPlan::elementwise_launches() const {
  int64_t n = 1 /* step counters */ + !scan_chunks.empty() + !adamw_chunks.empty();
  for (const BatchRange& r : batch_ranges)  // momentum and update, statistics, finalize
    n += 2 * (r.n_chunks > 0) + (r.n_tasks > 0) + (r.n_matrices > 0);
  return n;
}

int64_t StepPlan::newton_schulz_launches() const {
  int64_t n = 0;
  for (const auto& b : batches) n += ns_batch_launches(b);
  return n;
}

}  // namespace normuon::cuda
