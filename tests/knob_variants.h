// The variant knobs every backend cross-check runs (test_compare.cpp, test_fast_cuda.cpp): one
// non-default value of each knob of docs/spec.md, as lists of "key=value" settings.
#pragma once

#include <string>
#include <vector>

#include "normuon/options.h"

namespace normuon::test {

using KnobVariant = std::vector<std::string>;

inline std::vector<KnobVariant> knob_variants() {
  return {
      {"normuon.nesterov=false"},
      {"normuon.reduce_axis=longer_dim"},
      {"normuon.lr_scale=spectral"},
      {"normuon.lr_scale=rms_matching"},
      {"normuon.weight_decay_mode=cautious", "normuon.weight_decay=0.1"},
      {"normuon.weight_decay_mode=none", "normuon.weight_decay=0.1"},
      {"normuon.ns_coefficients=polar_express"},
      {"normuon.ns_precision=fp32"},
      {"normuon.ns_algorithm=gram"},
      {"normuon.ns_algorithm=gram", "normuon.ns_steps=8"},  // restarts before iterations 2 and 5
      {"normuon.eps_placement=clamp"},
      {"weight_decay=0.1"},
  };
}

// The default options with a variant's settings applied; `label` gets the settings, space-separated.
inline Options options_with(const KnobVariant& sets, std::string& label) {
  Options options;
  label.clear();
  for (const auto& kv : sets) {
    options.set(kv);
    label += (label.empty() ? "" : " ") + kv;
  }
  return options;
}

}  // namespace normuon::test
