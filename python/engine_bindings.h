// normuon._C's engine: the native optimizer Python's NorMuonAdamW is a client of (engine_bindings.cpp).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <utility>
#include <vector>

#include "normuon/options.h"

namespace normuon {

void bind_engine(pybind11::module_& m);

// A 1-D numpy array over `size` elements at `data`, owned by `owner` (kept alive as the array's base).
template <typename T>
pybind11::array_t<T> view(T* data, int64_t size, pybind11::handle owner) {
  return pybind11::array_t<T>({static_cast<pybind11::ssize_t>(size)}, {static_cast<pybind11::ssize_t>(sizeof(T))},
                              data, owner);
}

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
