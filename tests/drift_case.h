// The drift case of issue 12, shared by the backend tests (test_reference_invariants.cpp, test_compare.cpp,
// test_cuda_emulated.cpp, test_fast_cuda.cpp): parameters of one AdamW group that miss gradients in some
// steps, one of them in the very first step. Each one's AdamW bias corrections must use its own step count
// (docs/spec.md section 5), as torch.optim.AdamW counts (state['step'] per parameter, advanced only with a
// gradient); with the group's counter instead they drift from torch (6.1e-3 after 6 steps in the issue).
// The expectation is torch's single-tensor AdamW (spec section 4) transcribed per element with the C
// library's IEEE arithmetic, independent of every backend.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "normuon/flat_state.h"
#include "normuon/grad_gen.h"
#include "normuon/layout.h"
#include "normuon/manifest.h"
#include "normuon/options.h"
#include "normuon/param_table.h"

namespace normuon::test {

constexpr int64_t kDriftSteps = 6;

// The caller's fp32 tensors of table mode: the parameters copied from a flat state; each step, the
// gradients of a flat state by address (absent where it has none).
struct DriftTable {
  ParamTable table;
  std::vector<std::vector<float>> params;

  DriftTable(const Layout& layout, const FlatState& from) : table(layout), params(layout.entries.size()) {
    for (size_t e = 0; e < layout.entries.size(); ++e) {
      params[e].assign(from.param(static_cast<int>(e)), from.param(static_cast<int>(e)) + layout.entries[e].numel);
      table.params[e].data = params[e].data();
    }
  }
  void take_grads(FlatState& values) {
    for (size_t e = 0; e < params.size(); ++e)
      table.grads[e] = TensorRef{values.has_grad[e] ? values.grad(static_cast<int>(e)) : nullptr, DType::f32, {}};
  }
};

// A NorMuon matrix and four AdamW parameters in the default groups.
inline Manifest drift_manifest() {
  Manifest m;
  auto add = [&](const char* name, std::vector<int64_t> shape, Role role) {
    ParamSpec p;
    p.name = name;
    p.shape = std::move(shape);
    p.role = role;
    m.params.push_back(p);
  };
  add("w", {8, 12}, Role::matrix);      // NorMuon: misses step 3 (its count, unused, still counts)
  add("a", {16}, Role::bias);           // every step
  add("b", {16}, Role::bias);           // misses steps 2, 3 and 5
  add("e", {10, 8}, Role::embedding);   // misses steps 1 and 4: its first step is the group's second
  add("s", {}, Role::norm);             // misses step 6
  return m;
}

// AdamW with bias corrections that matter (betas 0.9 / 0.95, 6 steps) and decay on.
inline Options drift_options() {
  Options o;
  o.set("adamw.lr=0.01");
  o.set("adamw.weight_decay=0.05");
  o.set("weight_decay=0.05");
  return o;
}

// Whether parameter `name` has a gradient in step `step` (1-based).
inline bool drift_has_grad(const std::string& name, int64_t step) {
  if (name == "w") return step != 3;
  if (name == "b") return step != 2 && step != 3 && step != 5;
  if (name == "e") return step != 1 && step != 4;
  if (name == "s") return step != 6;
  return true;
}

// Each parameter's own step count after `steps` steps, and each group's counter.
inline std::vector<int64_t> drift_entry_steps(const Layout& layout, int64_t steps) {
  std::vector<int64_t> out(layout.entries.size(), 0);
  for (size_t e = 0; e < out.size(); ++e)
    for (int64_t s = 1; s <= steps; ++s) out[e] += drift_has_grad(layout.entries[e].name, s);
  return out;
}

inline const GradientGenerator& drift_generator() {
  static const GradientGenerator generator{4321, 0};
  return generator;
}

// The generator's gradients of `step`, and the drift case's has_grad flags (a missing gradient is NaN:
// nobody may read it).
inline void fill_drift_gradients(FlatState& state, int64_t step) {
  drift_generator().fill_gradients(state, step);
  for (size_t e = 0; e < state.layout->entries.size(); ++e) {
    const LayoutEntry& le = state.layout->entries[e];
    state.has_grad[e] = drift_has_grad(le.name, step);
    if (!state.has_grad[e]) std::fill(state.grad(static_cast<int>(e)), state.grad(static_cast<int>(e)) + le.numel, NAN);
  }
}

// One torch.optim.AdamW step (single-tensor path, spec section 4) of n elements at step count t >= 1.
inline void torch_adamw_step(float* p, const float* g, float* m, float* v, int64_t n, const AdamWHyper& h, int64_t t) {
  const float decay = static_cast<float>(1 - h.lr * h.weight_decay), w = static_cast<float>(1 - h.beta1);
  const float b2 = static_cast<float>(h.beta2), one_minus_b2 = static_cast<float>(1 - h.beta2);
  const float bc2_sqrt = static_cast<float>(std::sqrt(1 - std::pow(h.beta2, static_cast<double>(t))));
  const float neg_step = static_cast<float>(-(h.lr / (1 - std::pow(h.beta1, static_cast<double>(t)))));
  const float eps = static_cast<float>(h.eps);
  for (int64_t i = 0; i < n; ++i) {
    const float pi = h.weight_decay != 0 ? p[i] * decay : p[i];
    const float mk = std::fabs(w) < 0.5f ? std::fma(w, g[i] - m[i], m[i]) : std::fma(w - 1.0f, g[i] - m[i], g[i]);
    const float vk = std::fma(one_minus_b2 * g[i], g[i], v[i] * b2);
    p[i] = pi + (neg_step * mk) / (std::sqrt(vk) / bc2_sqrt + eps);
    m[i] = mk;
    v[i] = vk;
  }
}

// One AdamW parameter after the drift case's steps, by the transcription above.
struct AdamWExpectation {
  std::vector<float> param, exp_avg, exp_avg_sq;
  int64_t count = 0;  // its own step count
};

// The expectation for AdamW entry `entry` after `steps` steps from the generator's parameters. With
// `group_count` the bias corrections use the group's counter instead (what state format version 1 did):
// the drift the issue reports, for the tests to show that they tell the two apart.
inline AdamWExpectation expected_adamw(const Layout& layout, const Options& options, int entry, int64_t steps,
                                       bool group_count = false) {
  const LayoutEntry& le = layout.entries[static_cast<size_t>(entry)];
  FlatState scratch(layout);
  drift_generator().fill_params(scratch);
  AdamWExpectation x;
  x.param.assign(scratch.param(entry), scratch.param(entry) + le.numel);
  x.exp_avg.assign(static_cast<size_t>(le.numel), 0.0f);
  x.exp_avg_sq.assign(static_cast<size_t>(le.numel), 0.0f);
  int64_t group_counter = 0;
  for (int64_t s = 1; s <= steps; ++s) {
    bool group_has = false;
    for (const LayoutEntry& other : layout.entries) group_has |= other.group == le.group && drift_has_grad(other.name, s);
    group_counter += group_has;
    if (!drift_has_grad(le.name, s)) continue;
    ++x.count;
    fill_drift_gradients(scratch, s);
    torch_adamw_step(x.param.data(), scratch.grad(entry), x.exp_avg.data(), x.exp_avg_sq.data(), le.numel,
                     options.groups[static_cast<size_t>(le.group)].adamw, group_count ? group_counter : x.count);
  }
  return x;
}

// "" when AdamW entry `entry` of `state` holds the expectation bit for bit, else the first difference.
inline std::string adamw_difference(const FlatState& state, int entry, const AdamWExpectation& x) {
  const LayoutEntry& le = state.layout->entries[static_cast<size_t>(entry)];
  const struct {
    const char* what;
    const float* actual;
    const std::vector<float>& expected;
  } tensors[] = {{"param", state.param(entry), x.param},
                 {"exp_avg", state.exp_avg.data() + le.adam_offset, x.exp_avg},
                 {"exp_avg_sq", state.exp_avg_sq.data() + le.adam_offset, x.exp_avg_sq}};
  for (const auto& t : tensors)
    for (int64_t i = 0; i < le.numel; ++i)
      if (std::memcmp(&t.actual[i], &t.expected[static_cast<size_t>(i)], sizeof(float)) != 0)
        return le.name + " " + t.what + "[" + std::to_string(i) + "]: expected " +
               std::to_string(t.expected[static_cast<size_t>(i)]) + ", got " + std::to_string(t.actual[i]);
  if (state.entry_steps[static_cast<size_t>(entry)] != x.count)
    return le.name + " step count " + std::to_string(state.entry_steps[static_cast<size_t>(entry)]) + ", expected " +
           std::to_string(x.count);
  return "";
}

// Every AdamW entry of `state` (after `steps` drift steps) against its expectation: "" or the first
// difference.
inline std::string drift_difference(const FlatState& state, const Options& options, int64_t steps) {
  const Layout& layout = *state.layout;
  for (int e = 0; e < static_cast<int>(layout.entries.size()); ++e) {
    if (layout.entries[static_cast<size_t>(e)].algorithm != Algorithm::adamw) continue;
    const std::string d = adamw_difference(state, e, expected_adamw(layout, options, e, steps));
    if (!d.empty()) return d;
  }
  if (state.entry_steps != drift_entry_steps(layout, steps)) return "entry step counts differ";
  return "";
}

}  // namespace normuon::test
