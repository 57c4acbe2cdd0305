// Checks the backend tests share (test_fast_cuda.cpp, test_cuda_emulated.cpp, test_compare.cpp): the first bit that differs
// between two states, the message every backend must give for a NaN/Inf gradient, bf16 rounding written
// out independently of cuda_bf16.h, and the comparator summary lines the tests log.
#pragma once

#include <boost/test/unit_test.hpp>

#include <cstdint>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>

#include "comparator.h"
#include "normuon/flat_state.h"
#include "normuon/options.h"
#include "normuon/step_prologue.h"

namespace normuon::test {

// The first difference in what a step writes (parameters, optimizer state, group and entry steps), or "".
inline std::string first_difference(const FlatState& expected, const FlatState& actual) {
  const struct {
    const char* name;
    const AlignedBuffer& e;
    const AlignedBuffer& a;
  } buffers[] = {{"params", expected.params, actual.params},
                 {"momentum", expected.momentum, actual.momentum},
                 {"row_var", expected.row_var, actual.row_var},
                 {"exp_avg", expected.exp_avg, actual.exp_avg},
                 {"exp_avg_sq", expected.exp_avg_sq, actual.exp_avg_sq}};
  for (const auto& b : buffers) {
    if (b.e.size() != b.a.size()) return std::string(b.name) + ": sizes differ";
    for (int64_t i = 0; i < b.e.size(); ++i)
      if (std::memcmp(&b.e.data()[i], &b.a.data()[i], sizeof(float)) != 0) {
        std::ostringstream out;
        out.precision(9);
        out << b.name << "[" << i << "]: expected " << b.e[i] << ", actual " << b.a[i];
        return out.str();
      }
  }
  if (expected.group_steps != actual.group_steps) return "group steps differ";
  if (expected.entry_steps != actual.entry_steps) return "entry steps differ";
  return "";
}

// What begin_step (core) says about a state's gradients: the message every backend must give.
inline std::string prologue_message(const FlatState& state, const Options& options) {
  FlatState copy = state;
  try {
    const auto result = begin_step(copy, options);
    return result ? result->reason : "";
  } catch (const std::runtime_error& e) {
    return e.what();
  }
}

// Round to nearest even, as __float2bfloat16_rn (finite values and infinities; NaN stays NaN).
inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float round_bf16(float x) {
  const uint32_t u = static_cast<uint32_t>(bf16_bits(x)) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline const KindSummary& kind(const RunSummary& s, TensorKind k) { return s.kinds[static_cast<int>(k)]; }

// The verdict, the Newton-Schulz kinds' worst errors and the exact kinds' bit-identical counts.
inline void log_summary(const std::string& label, const RunSummary& s) {
  BOOST_TEST_MESSAGE(label << ": " << verdict_line(s));
  BOOST_TEST_MESSAGE(label << ": normuon_param normwise " << kind(s, TensorKind::normuon_param).worst_normwise
                           << ", update error " << kind(s, TensorKind::normuon_param).worst_update_rel
                           << "; row_var normwise " << kind(s, TensorKind::row_var).worst_normwise
                           << "; exact kinds bit-identical: momentum " << kind(s, TensorKind::momentum).bit_identical
                           << "/" << kind(s, TensorKind::momentum).tensors << ", adamw_param "
                           << kind(s, TensorKind::adamw_param).bit_identical << "/"
                           << kind(s, TensorKind::adamw_param).tensors);
}

}  // namespace normuon::test
