#include "step_plan.h"

#include <limits>
#include <stdexcept>

#include "normuon/ns_coefficients.h"

namespace normuon::cuda {
namespace {

void add_chunks(std::vector<Chunk>& chunks, int entry, int64_t numel) {
  for (int64_t begin = 0; begin < numel; begin += kChunkElements)
    chunks.push_back({entry, static_cast<int32_t>(std::min(kChunkElements, numel - begin)), begin});
}

}  // namespace

std::string plan_unsupported_reason(const Layout& layout, const Options& options) {
  if (options.groups.size() != layout.group_names.size())
    return "the options define " + std::to_string(options.groups.size()) + " groups, the layout " +
           std::to_string(layout.group_names.size());
  for (const auto& g : options.groups)
    if (g.algorithm == Algorithm::normuon && g.normuon.ns_coefficients == NsCoefficients::polar_express &&
        g.normuon.ns_steps > kPolarExpressSteps)
      return "group '" + g.name + "': Polar Express has 5 coefficient triples, ns_steps is " +
             std::to_string(g.normuon.ns_steps);
  // The step status packs (entry, element) into 64 bits; chunk and task indices are 32-bit.
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

StepPlan StepPlan::build(const Layout& layout, const Options& options) {
  const std::string reason = plan_unsupported_reason(layout, options);
  if (!reason.empty()) throw std::invalid_argument(reason);
  StepPlan plan;
  std::vector<int> batch_of_entry(layout.entries.size(), -1), index_of_entry(layout.entries.size(), -1);
  for (const NsBatch& batch : newton_schulz_batches(layout)) {
    const NorMuonHyper& h = options.groups[batch.group].normuon;
    const int b = static_cast<int>(plan.batches.size());
    plan.batches.push_back({batch.rows, batch.cols, static_cast<int64_t>(batch.entries.size()), h.ns_precision,
                            h.ns_coefficients, h.ns_steps, h.ns_eps});
    plan.batch_group.push_back(batch.group);
    for (size_t k = 0; k < batch.entries.size(); ++k) {
      batch_of_entry[batch.entries[k]] = b;
      index_of_entry[batch.entries[k]] = static_cast<int>(k);
    }
  }
  for (int i = 0; i < static_cast<int>(layout.entries.size()); ++i) {
    const LayoutEntry& e = layout.entries[i];
    EntryInfo info{e.offset, e.adam_offset, e.group, -1};
    add_chunks(plan.scan_chunks, i, e.numel);
    if (e.algorithm == Algorithm::normuon && e.numel > 0) {
      MatrixInfo m{};
      m.entry = i;
      m.group = e.group;
      m.rows = static_cast<int32_t>(e.rows);
      m.cols = static_cast<int32_t>(e.cols);
      m.stats_per_row = e.stats_per_row;
      m.ns_bf16 = plan.batches[batch_of_entry[i]].precision == NsPrecision::bf16;
      m.offset = e.offset;
      m.stat_offset = e.stat_offset;
      m.stat_len = e.stat_len;
      info.matrix = static_cast<int32_t>(plan.matrices.size());
      if (e.stats_per_row)
        for (int64_t r = 0; r < e.rows; r += kStatRowsPerTask) plan.stat_tasks.push_back({info.matrix, static_cast<int32_t>(r)});
      else
        for (int64_t c = 0; c < e.cols; c += kStatColsPerTask) plan.stat_tasks.push_back({info.matrix, static_cast<int32_t>(c)});
      plan.matrices.push_back(m);
      plan.matrix_batch.push_back(batch_of_entry[i]);
      plan.matrix_index.push_back(index_of_entry[i]);
      add_chunks(plan.normuon_chunks, i, e.numel);
    } else if (e.algorithm == Algorithm::adamw) {
      add_chunks(plan.adamw_chunks, i, e.numel);
    }
    plan.entries.push_back(info);
  }
  return plan;
}

int64_t StepPlan::elementwise_launches() const {
  return 1 /* step counters */ + !scan_chunks.empty() + !normuon_chunks.empty() /* momentum */ + !stat_tasks.empty() +
         !matrices.empty() /* finalize */ + !normuon_chunks.empty() /* update */ + !adamw_chunks.empty();
}

int64_t StepPlan::newton_schulz_launches() const {
  int64_t n = 0;
  for (const auto& b : batches)
    if (b.count > 0 && b.rows * b.cols > 0) n += 2 + 3 * b.steps;
  return n;
}

}  // namespace normuon::cuda
