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
  for (const auto& [key, value] : values) {
    const auto field = key.cast<std::string>();
    if (value.is_none()) throw pybind11::value_error("option '" + field + "': None is not a value");
    out.emplace_back(field, value.cast<FieldValue>());
  }
  return out;
}

}  // namespace normuon
