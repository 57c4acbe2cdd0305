// normuon_emulated (tests only, never in the package): the CUDA engine's backend with its device code on
// the SIMT emulator (EmulatedCudaEngineBackend), handed to normuon._C.Engine as _C_cuda.engine_backend
// hands the real one. NorMuonAdamW(..., _device_backend=normuon_emulated.engine_backend()) then steps CPU
// tensors through the CUDA path (enqueued steps, deferred verdicts, counter roll-back, the device's
// master refresh), so the Python tests run it on machines without a GPU.
// First: the CUDA builtins for the host compiler (the emulated backend's headers use CUDA types).
#include "simt.h"

#include <pybind11/pybind11.h>

#include <memory>

#include "emulated_cuda_backend.h"
#include "engine_bindings.h"

namespace py = pybind11;
using namespace normuon;

PYBIND11_MODULE(normuon_emulated, m) {
  m.doc() = "The fast CUDA engine backend on the SIMT emulator, for normuon's Python tests";
  py::module_::import("normuon._C");
  m.def("engine_backend", [] {
    return backend_capsule([](const Layout& layout, const Options& options) {
      return std::make_unique<test::EmulatedCudaEngineBackend>(layout, options);
    });
  });
}
