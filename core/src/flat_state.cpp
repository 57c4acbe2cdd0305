#include "normuon/flat_state.h"

#include <cmath>
#include <cstring>
#include <new>

namespace normuon {

AlignedBuffer::AlignedBuffer(int64_t size) : size_(size) {
  // aligned_alloc needs a size that is a multiple of the alignment, and a non-zero one.
  const size_t bytes = static_cast<size_t>(align_up(size > 0 ? size : 1)) * sizeof(float);
  data_.reset(static_cast<float*>(std::aligned_alloc(kAlignFloats * sizeof(float), bytes)));
  if (!data_) throw std::bad_alloc();
  std::memset(data_.get(), 0, bytes);
}

AlignedBuffer::AlignedBuffer(const AlignedBuffer& other) : AlignedBuffer(other.size_) {
  std::memcpy(data_.get(), other.data_.get(), static_cast<size_t>(size_) * sizeof(float));
}

AlignedBuffer& AlignedBuffer::operator=(const AlignedBuffer& other) {
  if (this != &other) *this = AlignedBuffer(other);
  return *this;
}

FlatState::FlatState(const Layout& l)
    : layout(&l),
      params(l.param_floats),
      grads(l.param_floats),
      momentum(l.normuon_floats),
      row_var(l.stat_floats),
      exp_avg(l.adam_floats),
      exp_avg_sq(l.adam_floats),
      has_grad(l.entries.size(), 1),
      group_steps(l.group_names.size(), 0) {}

namespace {
bool same_bits(const AlignedBuffer& a, const AlignedBuffer& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), static_cast<size_t>(a.size()) * sizeof(float)) == 0;
}
}  // namespace

bool FlatState::same_optimizer_state(const FlatState& o) const {
  return same_bits(momentum, o.momentum) && same_bits(row_var, o.row_var) && same_bits(exp_avg, o.exp_avg) &&
         same_bits(exp_avg_sq, o.exp_avg_sq) && group_steps == o.group_steps;
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
