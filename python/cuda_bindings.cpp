// normuon._C_cuda: the fast CUDA backend for Python, a module of its own so that normuon._C, and with it
// `import normuon`, never needs the CUDA runtime: only this module links libcudart and cuBLASLt, and
// normuon/native.py imports it when CUDA parameters first ask for it (where the runtime is missing, that
// import error is the reason the CUDA backend is unavailable). It registers the CUDA engine's backend and
// nothing else: normuon._C.Engine drives it (engine_bindings.cpp), taking it as a capsule, and the core's
// types (Layout, Options) come from normuon._C (pybind11 shares registered types between the modules of
// one build).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>

#include "cuda_device.h"
#include "engine_bindings.h"
#include "fast_cuda_backend.h"
#include "normuon/layout.h"
#include "normuon/options.h"
#include "step_plan.h"

namespace py = pybind11;
using namespace normuon;

PYBIND11_MODULE(_C_cuda, m) {
  m.doc() = "normuon's fast CUDA backend (docs/fast-cuda.md), for normuon._C.Engine";
  py::module_::import("normuon._C");  // registers Layout, Options

  m.def("cuda_unavailable_reason", &cuda::unavailable_reason, py::arg("device") = 0,
        "Empty when the fast CUDA backend can run on that device, else why not");
  m.def(
      "unsupported_reason",
      [](const Layout& layout, const Options& options, int device) {
        return FastCudaBackend::unsupported_reason(layout, options, device);
      },
      py::arg("layout"), py::arg("options"), py::arg("device") = 0,
      "Empty when the fast CUDA backend can run these options on this layout on that device, else why not");
  m.def(
      "cuda_launches_per_step",
      [](const Layout& layout, const Options& options) {
        const cuda::StepPlan plan = cuda::StepPlan::build(layout, options);
        return plan.elementwise_launches() + plan.newton_schulz_launches();
      },
      py::arg("layout"), py::arg("options"),
      "Kernels and matmuls one fast-cuda step launches over this layout (from its plan; no GPU needed)");
  m.def(
      "engine_backend",
      [](int device, uintptr_t stream) {
        return backend_capsule([device, stream](const Layout& layout, const Options& options) {
          FastCudaConfig config;
          config.device = device;
          config.stream = reinterpret_cast<cudaStream_t>(stream);
          config.caller_tensors = true;  // table mode: the caller's tensors in place
          return std::make_unique<FastCudaBackend>(layout, options, config);
        });
      },
      py::arg("device"), py::arg("stream") = 0,
      "The fast CUDA backend on that device, table mode, for normuon._C.Engine(manifest, options, backend, device); "
      "stream: the cudaStream_t handle of the first steps (0: its own)");
}
