// normuon._C's per-tensor spec steps: reference/'s arithmetic (spec_steps.h on the CPU's primitives) on one
// CPU fp32 tensor at a time, with no libtorch (the tensors are reached through data_ptr). The oracle the
// Python tests hold the optimizers to, one matrix at a time; the optimizers themselves step through the
// engine (backend='reference': ReferenceTableBackend).
#include "engine_bindings.h"

#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "cpu_ops.h"
#include "spec_steps.h"

namespace py = pybind11;

namespace normuon {
namespace {

// A contiguous CPU fp32 torch tensor of `numel` elements: its data. ValueError otherwise.
float* cpu_floats(const py::handle& t, int64_t numel, const char* what) {
  const py::module_ torch = py::module_::import("torch");
  if (t.attr("device").attr("type").cast<std::string>() != "cpu" || !t.attr("dtype").is(torch.attr("float32")) ||
      !t.attr("is_contiguous")().cast<bool>())
    throw py::value_error(std::string(what) + " must be a contiguous fp32 CPU tensor");
  if (t.attr("numel")().cast<int64_t>() != numel)
    throw py::value_error(std::string(what) + " has " + std::to_string(t.attr("numel")().cast<int64_t>()) +
                          " elements; " + std::to_string(numel) + " expected");
  return reinterpret_cast<float*>(t.attr("data_ptr")().cast<uintptr_t>());
}

// A group's values, checked by the core (its defaults where absent).
GroupOptions spec_group(Algorithm algorithm, const py::dict& values) {
  Options options;  // the groups "normuon" and "adamw"
  const size_t g = algorithm == Algorithm::normuon ? 0 : 1;
  options.set_group(g, typed_values(values));
  return options.groups[g];
}

// (rows, cols) of a 2-D tensor.
std::pair<int64_t, int64_t> matrix_shape(const py::handle& t, const char* what) {
  const auto shape = t.attr("shape").cast<std::vector<int64_t>>();
  if (shape.size() != 2) throw py::value_error(std::string(what) + " must be 2-D");
  return {shape[0], shape[1]};
}

// The tensors beside p must have its shape (a transposed one would be read row-major, silently).
void same_shape(const py::handle& p, std::initializer_list<std::pair<const py::handle*, const char*>> others) {
  const auto shape = p.attr("shape").cast<std::vector<int64_t>>();
  for (const auto& [t, what] : others)
    if (t->attr("shape").cast<std::vector<int64_t>>() != shape)
      throw py::value_error(std::string(what) + " must have p's shape");
}

}  // namespace

void bind_spec(py::module_& m) {
  m.def(
      "spec_newton_schulz",
      [](const py::handle& update, const py::handle& out, const py::dict& values) {
        const auto [rows, cols] = matrix_shape(update, "update");
        same_shape(update, {{&out, "out"}});
        const NorMuonHyper h = spec_group(Algorithm::normuon, values).normuon;
        spec::CpuOps ops;
        spec::newton_schulz(ops, cpu_floats(update, rows * cols, "update"), cpu_floats(out, rows * cols, "out"),
                            rows, cols, h);
      },
      py::arg("update"), py::arg("out"), py::arg("values"),
      "out = NS(update) of spec section 3.2 in the group's precision (fp32 tensors of one shape)");
  m.def(
      "spec_normuon_update",
      [](const py::handle& p, const py::handle& g, const py::handle& M, const py::handle& v, const py::dict& values,
         bool per_row, bool transposed) {
        const auto [rows, cols] = matrix_shape(p, "p");
        same_shape(p, {{&g, "g"}, {&M, "M"}});
        const NorMuonHyper h = spec_group(Algorithm::normuon, values).normuon;
        spec::CpuOps ops;
        const int64_t n = rows * cols;
        spec::normuon_update(ops, cpu_floats(p, n, "p"), cpu_floats(g, n, "g"), cpu_floats(M, n, "M"),
                             cpu_floats(v, per_row ? rows : cols, "v"), rows, cols, h, per_row, transposed);
      },
      py::arg("p"), py::arg("g"), py::arg("M"), py::arg("v"), py::arg("values"), py::arg("per_row"),
      py::arg("transposed") = false,
      "One NorMuon step (spec section 3.1) of one matrix, in place on p, M and v (the second moment along the "
      "stored rows when per_row); transposed: p is stored [in, out], kappa follows [out, in]");
  m.def(
      "spec_adamw_update",
      [](const py::handle& p, const py::handle& g, const py::handle& m_, const py::handle& v, const py::dict& values,
         int64_t t) {
        if (t < 1) throw py::value_error("t must be >= 1");
        same_shape(p, {{&g, "g"}, {&m_, "m"}, {&v, "v"}});
        const AdamWHyper h = spec_group(Algorithm::adamw, values).adamw;
        const int64_t n = p.attr("numel")().cast<int64_t>();
        spec::CpuOps ops;
        ops.adamw(cpu_floats(p, n, "p"), cpu_floats(g, n, "g"), cpu_floats(m_, n, "m"), cpu_floats(v, n, "v"), n,
                  spec::adamw_scalars(h, t));
      },
      py::arg("p"), py::arg("g"), py::arg("m"), py::arg("v"), py::arg("values"), py::arg("t"),
      "One AdamW step (spec section 4, torch.optim.AdamW's single-tensor path) at the tensor's step t >= 1");
}

}  // namespace normuon
