#include "normuon/flat_state.h"

#include <sys/sysinfo.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <cstring>
#include <new>
#include <stdexcept>

namespace normuon {

namespace {

// Bytes for people: "4.00 TB (4000000000000 bytes)".
std::string bytes_text(double bytes) {
  const char* units[] = {"bytes", "kB", "MB", "GB", "TB", "PB", "EB"};
  double value = bytes;
  int unit = 0;
  while (value >= 1000 && unit < 6) {
    value /= 1000;
    ++unit;
  }
  char text[64];
  if (unit == 0)
    std::snprintf(text, sizeof text, "%.0f bytes", bytes);
  else
    std::snprintf(text, sizeof text, "%.2f %s (%.0f bytes)", value, units[unit], bytes);
  return text;
}

// RAM plus swap: no allocation larger than this can ever be backed.
double machine_memory_bytes() {
  struct sysinfo info{};
  if (::sysinfo(&info) != 0) return 0;
  return (static_cast<double>(info.totalram) + static_cast<double>(info.totalswap)) * info.mem_unit;
}

}  // namespace

AlignedBuffer::AlignedBuffer(int64_t size) : size_(size) {
  if (size < 0 || size > kMaxLayoutFloats)
    throw OutOfMemoryError("cannot allocate a buffer of " + std::to_string(size) + " floats (the limit is " +
                           std::to_string(kMaxLayoutFloats) + ")");
  // aligned_alloc needs a size that is a multiple of the alignment, and a non-zero one.
  const size_t bytes = static_cast<size_t>(align_up(size > 0 ? size : 1)) * sizeof(float);
  data_.reset(static_cast<float*>(std::aligned_alloc(kAlignFloats * sizeof(float), bytes)));
  if (!data_)
    throw OutOfMemoryError("cannot allocate " + bytes_text(static_cast<double>(bytes)) + " for a buffer of " +
                           std::to_string(size) + " floats");
  std::memset(data_.get(), 0, bytes);
}

AlignedBuffer::AlignedBuffer(const AlignedBuffer& other) : AlignedBuffer(other.size_) {
  std::memcpy(data_.get(), other.data_.get(), static_cast<size_t>(size_) * sizeof(float));
}

AlignedBuffer& AlignedBuffer::operator=(const AlignedBuffer& other) {
  if (this != &other) *this = AlignedBuffer(other);
  return *this;
}

namespace {

// What a FlatState of `l` needs, checked before anything is allocated: a model too large for the machine
// gets one clear error, not a bare std::bad_alloc (or an OOM kill while the buffers are zeroed).
const Layout& check_fits(const Layout& l) {
  const double floats = 2.0 * static_cast<double>(l.param_floats) + static_cast<double>(l.normuon_floats) +
                        static_cast<double>(l.stat_floats) + 2.0 * static_cast<double>(l.adam_floats);
  const double bytes = floats * sizeof(float), available = machine_memory_bytes();
  if (available > 0 && bytes > available) {
    const LayoutEntry* largest = nullptr;
    for (const LayoutEntry& e : l.entries)
      if (!largest || e.numel > largest->numel) largest = &e;
    throw OutOfMemoryError(
        "the optimizer state needs " + bytes_text(bytes) + " (parameters, gradients and state of " +
        std::to_string(l.entries.size()) + " parameters), more than this machine's " + bytes_text(available) +
        " of memory and swap" +
        (largest ? "; the largest parameter, '" + largest->name + "' [" + shape_to_string(largest->shape) + "], has " +
                       std::to_string(largest->numel) + " elements"
                 : std::string()));
  }
  return l;
}

// A buffer of the state, its name added to an allocation failure.
AlignedBuffer state_buffer(const char* name, int64_t floats) {
  try {
    return AlignedBuffer(floats);
  } catch (const std::bad_alloc& e) {
    throw OutOfMemoryError(std::string("optimizer state buffer '") + name + "': " + e.what());
  }
}

}  // namespace

FlatState::FlatState(const Layout& l)
    : layout(&check_fits(l)),
      params(state_buffer("params", l.param_floats)),
      grads(state_buffer("grads", l.param_floats)),
      momentum(state_buffer("momentum", l.normuon_floats)),
      row_var(state_buffer("row_var", l.stat_floats)),
      exp_avg(state_buffer("exp_avg", l.adam_floats)),
      exp_avg_sq(state_buffer("exp_avg_sq", l.adam_floats)),
      has_grad(l.entries.size(), 1),
      group_steps(l.group_names.size(), 0),
      entry_steps(l.entries.size(), 0) {}

namespace {
bool same_bits(const AlignedBuffer& a, const AlignedBuffer& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), static_cast<size_t>(a.size()) * sizeof(float)) == 0;
}
}  // namespace

bool FlatState::same_optimizer_state(const FlatState& o) const {
  return same_bits(momentum, o.momentum) && same_bits(row_var, o.row_var) && same_bits(exp_avg, o.exp_avg) &&
         same_bits(exp_avg_sq, o.exp_avg_sq) && group_steps == o.group_steps && entry_steps == o.entry_steps;
}

std::vector<int64_t> entry_steps_from_groups(const Layout& layout, const std::vector<int64_t>& group_steps) {
  if (group_steps.size() != layout.group_names.size())
    throw std::invalid_argument(std::to_string(group_steps.size()) + " group steps for " +
                                std::to_string(layout.group_names.size()) + " groups");
  std::vector<int64_t> out(layout.entries.size());
  for (size_t e = 0; e < out.size(); ++e) out[e] = group_steps[static_cast<size_t>(layout.entries[e].group)];
  return out;
}

std::string entry_steps_invalid_reason(const Layout& layout, const std::vector<int64_t>& group_steps,
                                       const std::vector<int64_t>& entry_steps) {
  if (group_steps.size() != layout.group_names.size())
    return std::to_string(group_steps.size()) + " group steps for " + std::to_string(layout.group_names.size()) +
           " groups";
  if (entry_steps.size() != layout.entries.size())
    return std::to_string(entry_steps.size()) + " entry steps for " + std::to_string(layout.entries.size()) +
           " parameters";
  for (size_t e = 0; e < entry_steps.size(); ++e) {
    const LayoutEntry& le = layout.entries[e];
    const int64_t group_step = group_steps[static_cast<size_t>(le.group)];
    if (entry_steps[e] < 0 || entry_steps[e] > group_step)
      return "parameter '" + le.name + "' has step count " + std::to_string(entry_steps[e]) + ", outside [0, " +
             std::to_string(group_step) + "] (its group '" + layout.group_names[static_cast<size_t>(le.group)] +
             "' is at step " + std::to_string(group_step) + ")";
  }
  return "";
}

std::vector<int64_t> checked_entry_steps(const Layout& layout, const std::vector<int64_t>& group_steps,
                                         const std::vector<int64_t>& entry_steps) {
  if (group_steps.size() != layout.group_names.size())
    throw std::invalid_argument(std::to_string(group_steps.size()) + " group steps for " +
                                std::to_string(layout.group_names.size()) + " groups");
  for (int64_t t : group_steps)
    if (t < 0) throw std::invalid_argument("a group step is negative: " + std::to_string(t));
  std::vector<int64_t> out = entry_steps.empty() ? entry_steps_from_groups(layout, group_steps) : entry_steps;
  const std::string reason = entry_steps_invalid_reason(layout, group_steps, out);
  if (!reason.empty()) throw std::invalid_argument("entry_steps: " + reason);
  return out;
}

std::vector<StateTensorRef> state_tensors(FlatState& s, int entry) {
  const LayoutEntry& e = s.layout->entries[entry];
  if (e.algorithm == Algorithm::normuon)
    return {{e.name + "." + kMomentumSuffix, e.shape, s.momentum.data() + e.offset, e.numel},
            {e.name + "." + kRowVarSuffix, {e.stat_len}, s.row_var.data() + e.stat_offset, e.stat_len}};
  return {{e.name + "." + kExpAvgSuffix, e.shape, s.exp_avg.data() + e.adam_offset, e.numel},
          {e.name + "." + kExpAvgSqSuffix, e.shape, s.exp_avg_sq.data() + e.adam_offset, e.numel}};
}

int find_nonfinite_gradient(const FlatState& s, int64_t* element) {
  for (int i = 0; i < static_cast<int>(s.layout->entries.size()); ++i) {
    if (!s.has_grad[i]) continue;
    const float* g = s.grad(i);
    for (int64_t k = 0; k < s.layout->entries[i].numel; ++k)
      if (!std::isfinite(g[k])) {
        if (element) *element = k;
        return i;
      }
  }
  return -1;
}

}  // namespace normuon
