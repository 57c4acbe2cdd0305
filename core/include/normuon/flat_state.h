// Everything a backend reads and writes in a step, in the shared flat layout: parameters (fp32 master
// copy), gradients, optimizer state, per-parameter "has a gradient this step" flags, per-group steps and
// per-parameter step counts.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "normuon/layout.h"

namespace normuon {

// An allocation that failed, or that could not succeed on this machine, with what it was for: still a
// std::bad_alloc (Python sees a MemoryError), but its what() says how much memory and what for.
class OutOfMemoryError : public std::bad_alloc {
 public:
  explicit OutOfMemoryError(std::string message) : message_(std::move(message)) {}
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  std::string message_;
};

// A fixed-size, 64-byte aligned, zero-initialised float buffer. Never reallocates. Throws
// OutOfMemoryError when the memory cannot be had.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(int64_t size);
  AlignedBuffer(const AlignedBuffer& other);
  AlignedBuffer& operator=(const AlignedBuffer& other);
  AlignedBuffer(AlignedBuffer&&) noexcept = default;
  AlignedBuffer& operator=(AlignedBuffer&&) noexcept = default;

  float* data() { return data_.get(); }
  const float* data() const { return data_.get(); }
  int64_t size() const { return size_; }
  float& operator[](int64_t i) { return data_.get()[i]; }
  float operator[](int64_t i) const { return data_.get()[i]; }

 private:
  struct Free { void operator()(float* p) const { std::free(p); } };
  std::unique_ptr<float[], Free> data_;
  int64_t size_ = 0;
};

// Names of the state tensors, as they appear in state files: "<param>.<suffix>".
constexpr const char* kMomentumSuffix = "momentum";
constexpr const char* kRowVarSuffix = "row_var";
constexpr const char* kExpAvgSuffix = "exp_avg";
constexpr const char* kExpAvgSqSuffix = "exp_avg_sq";

struct FlatState {
  // Throws OutOfMemoryError, naming the layout's size and its largest parameter, when the buffers need more
  // than this machine's memory and swap (checked before allocating) or an allocation fails.
  explicit FlatState(const Layout& layout);

  const Layout* layout;
  AlignedBuffer params, grads;     // param_floats each
  AlignedBuffer momentum;          // normuon_floats
  AlignedBuffer row_var;           // stat_floats
  AlignedBuffer exp_avg, exp_avg_sq;  // adam_floats
  std::vector<uint8_t> has_grad;   // per layout entry; 1 by default
  std::vector<int64_t> group_steps;  // per group: optimizer steps taken
  // Per layout entry: the steps (not skipped) in which that parameter had a gradient, its own count
  // (docs/spec.md section 5). AdamW's bias corrections use it; never above its group's counter.
  std::vector<int64_t> entry_steps;

  float* param(int e) { return params.data() + layout->entries[e].offset; }
  const float* param(int e) const { return params.data() + layout->entries[e].offset; }
  float* grad(int e) { return grads.data() + layout->entries[e].offset; }
  const float* grad(int e) const { return grads.data() + layout->entries[e].offset; }

  // Optimizer state only (everything except params, grads and has_grad) is equal bit for bit, step
  // counters (group and entry) included.
  bool same_optimizer_state(const FlatState& other) const;
};

// Every entry's count taken to be its group's counter: what a state that kept group counters only (a
// version-1 state file, a caller that knows only group steps) meant, since its bias corrections used the
// group's counter for every parameter. One count per layout entry.
std::vector<int64_t> entry_steps_from_groups(const Layout& layout, const std::vector<int64_t>& group_steps);

// Why `entry_steps` cannot go with `group_steps` on `layout` (a count per entry, none negative, none above
// its group's counter), or empty.
std::string entry_steps_invalid_reason(const Layout& layout, const std::vector<int64_t>& group_steps,
                                       const std::vector<int64_t>& entry_steps);

// The entry steps to set beside `group_steps` (a count per group, none negative): `entry_steps` once
// checked (entry_steps_invalid_reason), or, when it is empty, each entry at its group's counter. Throws
// std::invalid_argument, so a caller checks both before it writes either.
std::vector<int64_t> checked_entry_steps(const Layout& layout, const std::vector<int64_t>& group_steps,
                                         const std::vector<int64_t>& entry_steps);

// Name of a state tensor, shape and pointer, for every state tensor of a layout entry.
struct StateTensorRef {
  std::string name;  // "<param>.<suffix>"
  std::vector<int64_t> shape;
  float* data;
  int64_t numel;
};
std::vector<StateTensorRef> state_tensors(FlatState& s, int entry);

// First entry whose gradient (if it has one) holds NaN or Inf, or -1. Reports the element too.
int find_nonfinite_gradient(const FlatState& s, int64_t* element = nullptr);

}  // namespace normuon
