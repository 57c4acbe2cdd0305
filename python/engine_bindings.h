// normuon._C's engine: the native optimizer Python's NorMuonAdamW is a client of (engine_bindings.cpp).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <utility>
#include <vector>

#include "normuon/engine.h"
#include "normuon/options.h"

namespace normuon {

void bind_engine(pybind11::module_& m);
void bind_spec(pybind11::module_& m);  // spec_bindings.cpp

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
    pybind11::object v = pybind11::reinterpret_borrow<pybind11::object>(value);
    if (pybind11::hasattr(v, "numel") && pybind11::hasattr(v, "item")) {  // a tensor (torch's tensor lr)
      const auto n = v.attr("numel")().cast<int64_t>();
      if (n != 1)
        throw pybind11::value_error("option '" + field + "': Tensor " + field + " must be 1-element (it has " +
                                    std::to_string(n) + ")");
      v = v.attr("item")();
    }
    try {
      out.emplace_back(field, v.cast<FieldValue>());
    } catch (const pybind11::cast_error&) {
      throw pybind11::value_error("option '" + field + "': " + pybind11::repr(v).cast<std::string>() + " (" +
                                  pybind11::str(v.get_type().attr("__name__")).cast<std::string>() +
                                  ") is not a number, a bool or a string");
    }
  }
  return out;
}

// A backend factory handed from one of the package's native modules to normuon._C.Engine: a capsule of
// this name owning an Engine::BackendFactory (the modules of one build agree on its layout).
constexpr const char* kBackendFactoryCapsule = "normuon.BackendFactory";

inline pybind11::capsule backend_capsule(Engine::BackendFactory factory) {
  return pybind11::capsule(new Engine::BackendFactory(std::move(factory)), kBackendFactoryCapsule, [](PyObject* o) {
    delete static_cast<Engine::BackendFactory*>(PyCapsule_GetPointer(o, kBackendFactoryCapsule));
  });
}

inline const Engine::BackendFactory& backend_factory(const pybind11::capsule& capsule) {
  if (std::string(capsule.name() ? capsule.name() : "") != kBackendFactoryCapsule)
    throw pybind11::type_error("not a backend of normuon's native modules");
  return *capsule.get_pointer<Engine::BackendFactory>();
}

}  // namespace normuon
