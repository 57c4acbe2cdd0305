// Models the CUDA tests share (test_cuda_plan.cpp, test_fast_cuda.cpp): a preset cut to its first
// layers, and a manifest of odd shapes with options that exercise every table and pass of the plan.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "normuon/manifest.h"
#include "normuon/options.h"
#include "normuon/presets.h"

namespace normuon::test {

// A preset with only its first `layers` blocks ("transformer.h.N." or "model.layers.N."): the same
// shapes, fewer parameters of each.
inline Manifest first_layers(const std::string& preset, int layers) {
  Manifest full = preset_manifest(preset), m;
  for (const auto& p : full.params) {
    size_t pos = p.name.find(".h.");
    size_t skip = 3;
    if (pos == std::string::npos) {
      pos = p.name.find(".layers.");
      skip = 8;
    }
    if (pos != std::string::npos && std::stoi(p.name.substr(pos + skip)) >= layers) continue;
    m.params.push_back(p);
  }
  return m;
}

// Role: matrix for 2-D, bias otherwise, unless given.
inline void add_param(Manifest& m, const std::string& name, std::vector<int64_t> shape,
                      const std::string& group = "", std::optional<Role> role = std::nullopt) {
  ParamSpec p;
  p.name = name;
  p.shape = std::move(shape);
  p.role = role ? *role : p.shape.size() == 2 ? Role::matrix : Role::bias;
  p.group = group;
  m.params.push_back(p);
}

// Odd shapes: 1 x n, n x 1, primes, tall and wide, several chunks and statistics tasks per matrix,
// 0-element parameters, and a bucket shared by two NorMuon groups of different precision.
inline Manifest odd_manifest() {
  Manifest m;
  add_param(m, "row", {1, 37});
  add_param(m, "col", {37, 1});
  add_param(m, "prime", {37, 53});
  add_param(m, "tall", {97, 13});
  add_param(m, "wide", {3, 600});    // per-column statistics over three tasks
  add_param(m, "big", {200, 300});   // four chunks
  add_param(m, "empty", {0, 8});
  add_param(m, "empty_t", {8, 0});
  add_param(m, "a", {16, 24});
  add_param(m, "b", {16, 24}, "fp32");
  add_param(m, "tall2", {97, 13}, "fp32");
  add_param(m, "idle", {16, 24});
  add_param(m, "emb", {50, 16}, "", Role::embedding);
  add_param(m, "vec", {70000}, "adam2");  // five chunks
  add_param(m, "bias", {24});
  add_param(m, "scalar", {}, "", Role::other);
  add_param(m, "empty_bias", {0});
  add_param(m, "cube", {2, 3, 5}, "adam2", Role::other);
  return m;
}

// The default groups with reduce_axis=longer_dim (so per-column statistics appear), a second NorMuon
// group in fp32 with per-row statistics, a second AdamW group.
inline Options odd_options() {
  Options o;
  o.set("normuon.reduce_axis=longer_dim");
  GroupOptions fp32;
  fp32.name = "fp32";
  fp32.algorithm = Algorithm::normuon;
  fp32.normuon.ns_precision = NsPrecision::fp32;
  o.groups.push_back(fp32);
  GroupOptions adam2;
  adam2.name = "adam2";
  adam2.algorithm = Algorithm::adamw;
  adam2.adamw.lr = 1e-3;
  o.groups.push_back(adam2);
  o.set("weight_decay=0.1");
  return o;
}

}  // namespace normuon::test
