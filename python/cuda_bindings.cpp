// normuon._C_cuda: the fast CUDA backend for Python, a module of its own so that normuon._C, and with it
// `import normuon`, never needs the CUDA runtime: only this module links libcudart and cuBLASLt, and
// normuon/optim.py imports it when CUDA parameters first ask for it (where the runtime is missing, that
// import error is the reason the CUDA backend is unavailable). It takes the core's types (Layout, Options,
// FlatState, ParamTable, StepResult) from normuon._C: pybind11 shares registered types between the
// modules of one build, so a Layout made by _C is handed over as it is.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_device.h"
#include "fast_cuda_backend.h"
#include "normuon/flat_state.h"
#include "normuon/layout.h"
#include "normuon/options.h"
#include "normuon/param_table.h"
#include "step_plan.h"

namespace py = pybind11;
using namespace normuon;

PYBIND11_MODULE(_C_cuda, m) {
  m.doc() = "normuon's fast CUDA backend (docs/fast-cuda.md); the core's types come from normuon._C";
  py::module_::import("normuon._C");  // registers Layout, Options, FlatState, ParamTable, StepResult

  m.def("cuda_unavailable_reason", &cuda::unavailable_reason, py::arg("device") = 0,
        "Empty when the fast CUDA backend can run on that device, else why not");
  m.def(
      "cuda_launches_per_step",
      [](const Layout& layout, const Options& options) {
        const cuda::StepPlan plan = cuda::StepPlan::build(layout, options);
        return plan.elementwise_launches() + plan.newton_schulz_launches();
      },
      py::arg("layout"), py::arg("options"),
      "Kernels and matmuls one fast-cuda step launches over this layout (from its plan; no GPU needed)");
  auto stream_of = [](uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); };
  py::class_<FastCudaBackend>(m, "FastCudaBackend", "The fused CUDA backend (docs/fast-cuda.md)")
      .def(py::init([stream_of](const Layout& layout, const Options& options, int device, uintptr_t stream,
                                const std::string& grad_dtype, bool bf16_params, bool caller_tensors) {
             FastCudaConfig config;
             config.device = device;
             config.stream = stream_of(stream);
             if (grad_dtype != "f32" && grad_dtype != "bf16")
               throw std::invalid_argument("grad_dtype '" + grad_dtype + "': choose f32 | bf16");
             config.grad_type = grad_dtype == "f32" ? cuda::ElemType::f32 : cuda::ElemType::bf16;
             config.bf16_params = bf16_params;
             config.caller_tensors = caller_tensors;
             return std::make_unique<FastCudaBackend>(layout, options, config);
           }),
           py::arg("layout"), py::arg("options"), py::arg("device") = 0, py::arg("stream") = 0,
           py::arg("grad_dtype") = "f32", py::arg("bf16_params") = false, py::arg("caller_tensors") = false,
           py::keep_alive<1, 2>())
      // Every call below works on C++ objects only: the GIL is let go, so other Python threads (a data
      // loader) run while the host plans, copies and enqueues.
      .def("set_tensors", &FastCudaBackend::set_tensors, py::arg("table"), py::call_guard<py::gil_scoped_release>(),
           "Table mode: the caller's device tensors; uploaded only when an address changed")
      .def(
          "set_grad_scaling",
          [](FastCudaBackend& b, uintptr_t grad_scale, uintptr_t found_inf) {
            b.set_grad_scaling(reinterpret_cast<const float*>(grad_scale), reinterpret_cast<const float*>(found_inf));
          },
          py::arg("grad_scale"), py::arg("found_inf"), py::call_guard<py::gil_scoped_release>(),
          "GradScaler's fp32 scale and found_inf (device addresses; 0, 0: none) for the next steps")
      .def("poll_step", &FastCudaBackend::poll_step, py::arg("options"), py::call_guard<py::gil_scoped_release>(),
           "The last enqueued step's verdict, waiting only for that step (deferred NaN/Inf report)")
      .def_property_readonly("workspace_bytes", &FastCudaBackend::workspace_bytes)
      .def_property_readonly("name", &FastCudaBackend::name)
      .def_property_readonly("launches_per_step", &FastCudaBackend::launches_per_step)
      .def_property_readonly(
          "stream", [](const FastCudaBackend& b) { return reinterpret_cast<uintptr_t>(b.stream()); },
          "The cudaStream_t handle work goes to (an int, like torch.cuda.Stream.cuda_stream)")
      .def_property_readonly("graph_kernel_nodes", &FastCudaBackend::graph_kernel_nodes)
      .def("describe", &FastCudaBackend::describe)
      .def("step", &FastCudaBackend::step, py::arg("state"), py::arg("options"), py::call_guard<py::gil_scoped_release>())
      .def("set_stream", [stream_of](FastCudaBackend& b, uintptr_t handle) { b.set_stream(stream_of(handle)); },
           py::arg("stream"))
      .def("upload", [](FastCudaBackend& b, const FlatState& s) { b.device_state().upload(s, b.stream()); },
           py::arg("state"), py::call_guard<py::gil_scoped_release>(), "Host state -> device (synchronises)")
      .def("download", [](FastCudaBackend& b, FlatState& s) { b.device_state().download(s, b.stream()); },
           py::arg("state"), py::call_guard<py::gil_scoped_release>(),
           "Device state -> host (synchronises; gradients stay on the device)")
      .def(
          "set_options",
          [](FastCudaBackend& b, const Options& o, const std::optional<std::vector<int64_t>>& group_steps,
             const std::optional<std::vector<int64_t>>& entry_steps) {
            b.set_options(o, group_steps ? &*group_steps : nullptr, entry_steps ? &*entry_steps : nullptr);
          },
          py::arg("options"), py::arg("group_steps") = py::none(), py::arg("entry_steps") = py::none(),
          py::call_guard<py::gil_scoped_release>(),
          "The counts before the next step, for host-exact AdamW bias corrections: entry_steps, each "
          "parameter's own (layout order); without it, group_steps gives every parameter its group's counter")
      .def("enqueue_step", &FastCudaBackend::enqueue_step, py::call_guard<py::gil_scoped_release>())
      .def("finish_step", &FastCudaBackend::finish_step, py::arg("options"), py::call_guard<py::gil_scoped_release>())
      .def("capture_graph", &FastCudaBackend::capture_graph, py::call_guard<py::gil_scoped_release>())
      .def("replay_graph", &FastCudaBackend::replay_graph, py::call_guard<py::gil_scoped_release>())
      // name -> (device pointer, elements, __cuda_array_interface__ typestr), for zero-copy torch views.
      .def("buffers",
           [](FastCudaBackend& b) {
             cuda::DeviceFlatState& d = b.device_state();
             auto entry = [](const void* p, int64_t n, const char* type) {
               return py::make_tuple(reinterpret_cast<uintptr_t>(p), n, type);
             };
             py::dict out;
             if (d.caller_tensors()) {  // table mode: the parameters and gradients are the caller's
               out["masters"] = entry(d.masters.data(), d.masters.size(), "<f4");
             } else {
               out["params"] = entry(d.params.data(), d.params.size(), "<f4");
               out["grads"] = d.grad_type() == cuda::ElemType::f32 ? entry(d.grads_f32.data(), d.grads_f32.size(), "<f4")
                                                                   : entry(d.grads_bf16.data(), d.grads_bf16.size(), "<i2");  // bf16 bits: view(torch.bfloat16)
             }
             out["momentum"] = entry(d.momentum.data(), d.momentum.size(), "<f4");
             out["row_var"] = entry(d.row_var.data(), d.row_var.size(), "<f4");
             out["exp_avg"] = entry(d.exp_avg.data(), d.exp_avg.size(), "<f4");
             out["exp_avg_sq"] = entry(d.exp_avg_sq.data(), d.exp_avg_sq.size(), "<f4");
             out["has_grad"] = entry(d.has_grad.data(), d.has_grad.size(), "|u1");
             out["group_steps"] = entry(d.group_steps.data(), d.group_steps.size(), "<i8");
             out["entry_steps"] = entry(d.entry_steps.data(), d.entry_steps.size(), "<i8");
             return out;
           })
      .def_static(
          "unsupported_reason",
          [](const Layout& layout, const Options& options, int device) {
            return FastCudaBackend::unsupported_reason(layout, options, device);
          },
          py::arg("layout"), py::arg("options"), py::arg("device") = 0);
}
