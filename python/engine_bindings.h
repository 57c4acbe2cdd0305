// normuon._C's engine: the native optimizer Python's NorMuonAdamW is a client of (engine_bindings.cpp).
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <utility>
#include <vector>

#include "normuon/options.h"

namespace normuon {

void bind_engine(pybind11::module_& m);

// {field: value} from Python in the core's typed form (unchecked: the core checks).
inline std::vector<std::pair<std::string, FieldValue>> typed_values(const pybind11::dict& values) {
  std::vector<std::pair<std::string, FieldValue>> out;
  for (const auto& [key, value] : values) out.emplace_back(key.cast<std::string>(), value.cast<FieldValue>());
  return out;
}

}  // namespace normuon
