#include "normuon/layout.h"

#include "normuon/ns_coefficients.h"

#include <cstdio>
#include <map>
#include <sstream>
#include <stdexcept>

namespace normuon {

uint64_t fnv1a64(const void* data, size_t size, uint64_t seed) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  uint64_t h = seed;
  for (size_t i = 0; i < size; ++i) {
    h ^= bytes[i];
    h *= 1099511628211ull;
  }
  return h;
}

namespace {

// The fingerprint hashes a canonical text of everything that decides where a value lives, and what it means
// (a transposed matrix's statistics follow its columns: marked only there, so other layouts keep their print).
uint64_t compute_fingerprint(const Layout& layout) {
  std::ostringstream text;
  text << "normuon-layout-v1\n";
  for (const auto& e : layout.entries) {
    text << e.name << '|' << shape_to_string(e.shape) << '|' << to_string(e.dtype) << '|' << to_string(e.algorithm)
         << '|' << layout.group_names[e.group] << '|' << e.offset << '|' << e.bucket << '|' << e.stats_per_row << '|'
         << e.stat_offset << '|' << e.stat_len << '|' << e.adam_offset << (e.transposed ? "|transposed" : "") << '\n';
  }
  const std::string s = text.str();
  return fnv1a64(s.data(), s.size());
}

// Adds a slot of `floats` to a buffer's running size, refusing to pass kMaxLayoutFloats. The running size
// is at most the limit and a slot at most the limit plus padding, so the sum itself cannot overflow.
void grow(int64_t& size, int64_t floats, const LayoutEntry& e, const char* buffer) {
  size += floats;
  if (size > kMaxLayoutFloats)
    throw std::invalid_argument("the layout is too large: with parameter '" + e.name + "' [" + shape_to_string(e.shape) +
                                "] its " + buffer + " buffer needs " + std::to_string(size) +
                                " floats, more than the limit of " + std::to_string(kMaxLayoutFloats) + " (2^40)");
}

}  // namespace

Layout Layout::build(const Manifest& manifest, const Options& options) {
  manifest.validate();
  Layout layout;
  for (const auto& g : options.groups) layout.group_names.push_back(g.name);

  // Route every parameter and resolve its group.
  for (const auto& p : manifest.params) {
    LayoutEntry e;
    e.name = p.name;
    e.shape = p.shape;
    e.dtype = p.dtype;
    e.role = p.role;
    e.algorithm = route(p);
    e.numel = p.numel();
    const std::string group_name = resolved_group(p);
    const GroupOptions* g = options.find_group(group_name);
    if (!g) throw std::invalid_argument("parameter '" + p.name + "' names group '" + group_name +
                                        "', which the options do not define");
    if (g->algorithm != e.algorithm)
      throw std::invalid_argument("parameter '" + p.name + "' is routed to " + to_string(e.algorithm) +
                                  " but its group '" + group_name + "' is a " + to_string(g->algorithm) + " group");
    e.group = static_cast<int>(g - options.groups.data());
    if (e.algorithm == Algorithm::normuon) {
      if (p.shape.size() != 2)  // a bank: its caller lays out each expert (bindings, engine.py)
        throw std::invalid_argument("parameter '" + p.name + "' is an expert bank of shape [" + shape_to_string(p.shape) +
                                    "]: a layout takes its " + std::to_string(p.shape[0]) + " experts, one 2-D entry " +
                                    "each (" + expert_name(p.name, 0) + ", ...), not the bank");
      e.rows = p.shape[0];
      e.cols = p.shape[1];
      e.transposed = p.transposed;
      // The spec's axis (section 3.1, step 4) on the module's [out, in]; its rows are a transposed one's columns.
      const auto [m, n] = module_shape(e);
      const bool module_rows = g->normuon.reduce_axis == ReduceAxis::rows || m >= n;
      e.stats_per_row = module_rows != e.transposed;
      // docs/spec.md section 5: a 0-element matrix has 0-element state, its second moment included.
      e.stat_len = e.numel == 0 ? 0 : e.stats_per_row ? e.rows : e.cols;
    }
    layout.entries.push_back(e);
  }

  // NorMuon matrices: one bucket per shape, buckets in order of first appearance, contiguous in memory.
  std::map<std::pair<int64_t, int64_t>, int> bucket_of_shape;
  for (int i = 0; i < static_cast<int>(layout.entries.size()); ++i) {
    LayoutEntry& e = layout.entries[i];
    if (e.algorithm != Algorithm::normuon) continue;
    auto [it, inserted] = bucket_of_shape.emplace(std::make_pair(e.rows, e.cols), static_cast<int>(layout.buckets.size()));
    if (inserted) {
      ShapeBucket b;
      b.rows = e.rows;
      b.cols = e.cols;
      b.stride = align_up(e.rows * e.cols);
      layout.buckets.push_back(b);
    }
    e.bucket = it->second;
    layout.buckets[e.bucket].entries.push_back(i);
  }
  int64_t offset = 0;
  for (auto& b : layout.buckets) {
    b.offset = offset;
    for (int i : b.entries) {
      layout.entries[i].offset = offset;
      grow(offset, b.stride, layout.entries[i], "parameter");
    }
  }
  layout.normuon_floats = offset;

  // Second-moment slots, in bucket order like the matrices.
  int64_t stat_offset = 0;
  for (const auto& b : layout.buckets)
    for (int i : b.entries) {
      layout.entries[i].stat_offset = stat_offset;
      grow(stat_offset, align_up(layout.entries[i].stat_len), layout.entries[i], "second-moment");
    }
  layout.stat_floats = stat_offset;

  // AdamW parameters after the matrices, in manifest order.
  for (int i = 0; i < static_cast<int>(layout.entries.size()); ++i) {
    LayoutEntry& e = layout.entries[i];
    if (e.algorithm != Algorithm::adamw) continue;
    e.offset = offset;
    e.adam_offset = offset - layout.normuon_floats;
    grow(offset, align_up(e.numel), e, "parameter");
    layout.adamw_entries.push_back(i);
  }
  layout.param_floats = offset;
  layout.adam_floats = offset - layout.normuon_floats;

  // Table mode's fp32 masters of the low-precision parameters, in manifest order.
  for (LayoutEntry& e : layout.entries) {
    if (e.dtype == DType::f32) continue;
    e.master_offset = layout.master_floats;
    grow(layout.master_floats, align_up(e.numel), e, "master");
  }
  layout.fingerprint = compute_fingerprint(layout);
  return layout;
}

std::vector<NsBatch> newton_schulz_batches(const Layout& layout) {
  std::vector<NsBatch> batches;
  for (const auto& bucket : layout.buckets) {
    std::map<int, size_t> batch_of_group;
    for (int e : bucket.entries) {
      const int group = layout.entries[e].group;
      auto [it, inserted] = batch_of_group.emplace(group, batches.size());
      if (inserted) batches.push_back({group, bucket.rows, bucket.cols, {}});
      batches[it->second].entries.push_back(e);
    }
  }
  return batches;
}

std::pair<int64_t, int64_t> module_shape(const LayoutEntry& e) {
  return e.transposed ? std::make_pair(e.cols, e.rows) : std::make_pair(e.rows, e.cols);
}

double entry_kappa(const LayoutEntry& e, LrScale rule) {
  const auto [m, n] = module_shape(e);
  return lr_scale_factor(rule, m, n);
}

int Layout::find(const std::string& name) const {
  for (int i = 0; i < static_cast<int>(entries.size()); ++i)
    if (entries[i].name == name) return i;
  return -1;
}

std::string Layout::fingerprint_hex() const {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(fingerprint));
  return buf;
}

std::string Layout::describe() const {
  std::ostringstream out;
  int64_t normuon_params = 0, adamw_params = 0;
  for (const auto& e : entries) (e.algorithm == Algorithm::normuon ? normuon_params : adamw_params) += e.numel;
  out << entries.size() << " parameters: " << normuon_params << " values on NorMuon in " << buckets.size()
      << " shape buckets, " << adamw_params << " on AdamW; layout " << fingerprint_hex() << "\n";
  for (size_t b = 0; b < buckets.size(); ++b)
    out << "  bucket " << b << ": " << buckets[b].entries.size() << " x [" << buckets[b].rows << ", "
        << buckets[b].cols << "]\n";
  for (const auto& e : entries)
    out << "  " << to_string(e.algorithm) << (e.algorithm == Algorithm::normuon ? "  " : "    ") << e.name << " ["
        << shape_to_string(e.shape) << "] group=" << group_names[e.group]
        << (e.algorithm == Algorithm::normuon ? (e.stats_per_row ? " stats=rows" : " stats=cols") : "")
        << (e.transposed ? " transposed" : "") << "\n";
  return out.str();
}

std::string fused_step_unsupported_reason(const Layout& layout, const Options& options) {
  if (options.groups.size() != layout.group_names.size())
    return "the options define " + std::to_string(options.groups.size()) + " groups, the layout " +
           std::to_string(layout.group_names.size());
  for (const auto& g : options.groups) {
    const std::string reason = group_values_invalid_reason(g);
    if (!reason.empty()) return reason;
  }
  return "";
}

}  // namespace normuon
