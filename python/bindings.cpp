// normuon._C: the C++ core (options, manifest, routing, layout, flat state, state file) and the fast CPU
// backend, for the pure-Python torch optimizer in normuon/optim.py. No libtorch and no CUDA here (the CUDA
// backend is normuon._C_cuda, cuda_bindings.cpp, loaded only when needed): host buffers are handed out as
// numpy arrays that view the C++ memory (Python wraps them with torch.from_numpy).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>

#ifdef NORMUON_HAVE_FAST_CPU
#include "fast_cpu_backend.h"
#include "thread_budget.h"
#endif
#include "engine_bindings.h"
#include "normuon/backend.h"
#include "normuon/flat_state.h"
#include "normuon/grad_gen.h"
#include "normuon/layout.h"
#include "normuon/manifest.h"
#include "normuon/ns_algorithm.h"
#include "normuon/options.h"
#include "normuon/param_table.h"
#include "normuon/presets.h"
#include "normuon/state_file.h"

namespace py = pybind11;
using namespace normuon;

namespace {

// A numpy view of one of a state's buffers, for def_property_readonly (FlatState and TableState alike).
template <typename State>
auto buffer_view(AlignedBuffer State::*member) {
  return [member](py::object self) {
    AlignedBuffer& b = self.cast<State&>().*member;
    return view(b.data(), b.size(), self);
  };
}

// group_steps of a FlatState or TableState, checked before anything is written. Every parameter's own
// count (entry_steps) becomes its group's counter: a caller that sets group counters only keeps them
// only, as format-version-1 state did (entry_steps_from_groups); set entry_steps after this to give
// parameters counts of their own.
template <typename State>
void set_group_steps(State& s, const std::vector<int64_t>& steps) {
  s.entry_steps = checked_entry_steps(*s.layout, steps, {});
  s.group_steps = steps;
}

// entry_steps of a FlatState or TableState (one per layout entry, each in [0, its group's counter]),
// checked before anything is written.
template <typename State>
void set_entry_steps(State& s, const std::vector<int64_t>& steps) {
  if (steps.empty() && !s.layout->entries.empty())  // (empty would mean "from the groups" below)
    throw std::invalid_argument("entry_steps: 0 entry steps for " + std::to_string(s.layout->entries.size()) +
                                " parameters");
  s.entry_steps = checked_entry_steps(*s.layout, s.group_steps, steps);
}

std::optional<Algorithm> parse_override(const std::optional<std::string>& text) {
  if (!text || text->empty() || *text == "auto") return std::nullopt;
  return parse_algorithm(*text);
}

// A group's hyper-parameters as a dict of Python values, keyed by the names of options.h: read off
// Options::to_json, the one table of fields, so a field added there appears here too.
py::dict group_hyper(const Options& o, const GroupOptions& g) {
  const py::object parsed = py::module_::import("json").attr("loads")(o.to_json());
  const auto index = static_cast<py::ssize_t>(&g - o.groups.data());
  return parsed["groups"][py::int_(index)]["hyper"].cast<py::dict>();
}

// Group by name or index.
const GroupOptions& find_group(const Options& o, const py::object& key) {
  if (py::isinstance<py::int_>(key)) {
    const auto i = key.cast<py::ssize_t>();
    if (i < 0 || i >= static_cast<py::ssize_t>(o.groups.size()))
      throw py::index_error("group index " + std::to_string(i) + " out of range");
    return o.groups[static_cast<size_t>(i)];
  }
  return o.group(key.cast<std::string>());
}

// A state file's header as a dict, for Python.
py::dict header_dict(const StateFileHeader& h) {
  py::dict d;
  d["format"] = h.format;
  d["version"] = h.version;
  d["backend"] = h.backend;
  d["layout_fingerprint"] = h.layout_fingerprint;
  d["created_utc"] = h.created_utc;
  d["options"] = h.options;
  d["group_names"] = h.group_names;
  d["group_steps"] = h.group_steps;
  // Version 2: {parameter name: its own step count}; None for a version-1 file (each parameter at its
  // group's counter).
  if (h.version >= 2)
    d["entry_steps"] = h.entry_steps;
  else
    d["entry_steps"] = py::none();
  d["file_size"] = h.file_size;
  py::list tensors;
  for (const auto& t : h.tensors) {
    py::dict td;
    td["name"] = t.name;
    td["dtype"] = t.dtype;
    td["shape"] = t.shape;
    td["crc32"] = t.crc32;
    tensors.append(td);
  }
  d["tensors"] = tensors;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "normuon native core: options, routing, flat layout and state, state files, the fast CPU backend";
  // std::invalid_argument -> ValueError and std::runtime_error -> RuntimeError are pybind11's own mapping;
  // the state file's errors get their own class so callers can tell a bad file from a bad step.
  py::register_exception<StateFileError>(m, "StateFileError", PyExc_RuntimeError);
  // A refused option value: a ValueError that also carries its key, value and problem (options.h), so a
  // caller that names values its own way reads them instead of parsing the message.
  static py::exception<OptionError> option_error(m, "OptionError", PyExc_ValueError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const OptionError& e) {
      py::object error = py::reinterpret_borrow<py::object>(option_error.ptr())(e.what());
      error.attr("key") = e.key;
      error.attr("value") = e.value;
      error.attr("problem") = e.problem;
      PyErr_SetObject(option_error.ptr(), error.ptr());
    }
  });

  m.attr("STATE_FORMAT") = kStateFormat;
  m.attr("STATE_FORMAT_VERSION") = kStateFormatVersion;
  m.attr("STATE_FORMAT_OLDEST_VERSION") = kStateFormatOldestVersion;
  m.attr("ALIGN_FLOATS") = kAlignFloats;

  py::class_<Options>(m, "Options", "Hyper-parameters and variant knobs (options.h); groups in order")
      .def(py::init<>(), "The default groups: 'normuon' and 'adamw'")
      .def(py::init([](const std::vector<std::pair<std::string, std::string>>& groups) {
             Options o;
             o.groups.clear();
             for (const auto& [name, algorithm] : groups) {
               if (name.empty() || name.find_first_of(".=") != std::string::npos)
                 throw std::invalid_argument("group name '" + name + "' must be non-empty, without '.' or '='");
               if (o.find_group(name)) throw std::invalid_argument("two groups are named '" + name + "'");
               GroupOptions g;
               g.name = name;
               g.algorithm = parse_algorithm(algorithm);
               o.groups.push_back(g);
             }
             return o;
           }),
           py::arg("groups"), "Groups given as [(name, 'normuon' | 'adamw'), ...], each with default values")
      .def("set", py::overload_cast<const std::string&, const std::string&>(&Options::set), py::arg("key"),
           py::arg("value"), "KEY is GROUP.FIELD, FIELD (every group that has it) or 'nonfinite'")
      .def("set", py::overload_cast<const std::string&>(&Options::set), py::arg("assignment"))
      .def("set_group", [](Options& o, size_t group, const py::dict& values) { o.set_group(group, typed_values(values)); },
           py::arg("group"), py::arg("values"), "Typed {field: value} for one group by index; all or nothing")
      .def("to_json", &Options::to_json)
      .def_static("from_json", &Options::from_json, py::arg("text"))
      .def("describe", [](const Options& o) { return describe(o); }, "every key=value")
      .def_property_readonly("groups",
                             [](const Options& o) {
                               std::vector<std::pair<std::string, std::string>> out;
                               for (const auto& g : o.groups) out.emplace_back(g.name, to_string(g.algorithm));
                               return out;
                             })
      .def_property_readonly("nonfinite", [](const Options& o) { return std::string(to_string(o.nonfinite)); })
      .def("hyper", [](const Options& o, const py::object& group) { return group_hyper(o, find_group(o, group)); },
           py::arg("group"), "a group's values as a dict (group by name or index)")
      .def("__repr__", [](const Options& o) { return "normuon._C.Options(" + o.to_json() + ")"; });

  py::class_<ParamSpec>(m, "ParamSpec", "One manifest row: what the optimizer knows of a parameter")
      .def(py::init([](std::string name, std::vector<int64_t> shape, const std::string& dtype, const std::string& role,
                       std::string group, const std::optional<std::string>& algorithm, bool transposed) {
             ParamSpec p;
             p.name = std::move(name);
             p.shape = std::move(shape);
             p.dtype = parse_dtype(dtype);
             p.role = parse_role(role);
             p.group = std::move(group);
             p.algorithm = parse_override(algorithm);
             p.transposed = transposed;
             return p;
           }),
           py::arg("name"), py::arg("shape"), py::arg("dtype") = "f32", py::arg("role") = "other",
           py::arg("group") = "", py::arg("algorithm") = py::none(), py::arg("transposed") = false)
      .def_readonly("name", &ParamSpec::name)
      .def_readonly("shape", &ParamSpec::shape)
      .def_property_readonly("dtype", [](const ParamSpec& p) { return std::string(to_string(p.dtype)); })
      .def_property_readonly("role", [](const ParamSpec& p) { return std::string(to_string(p.role)); })
      .def_readonly("group", &ParamSpec::group)
      .def_property_readonly("algorithm",
                             [](const ParamSpec& p) { return std::string(p.algorithm ? to_string(*p.algorithm) : "auto"); })
      .def_readonly("transposed", &ParamSpec::transposed)
      .def("__repr__", [](const ParamSpec& p) {
        return "ParamSpec(" + p.name + ", [" + shape_to_string(p.shape) + "], " + to_string(p.dtype) + ", " +
               to_string(p.role) + ")";
      });

  // The built-in presets, so Python benchmarks and tests build the same models as the command line.
  m.def("preset_names", [] {
    std::vector<std::string> out;
    for (const auto& p : list_presets()) out.push_back(p.name);
    return out;
  });
  m.def("preset_manifest", &preset_manifest, py::arg("name"), "A built-in preset's manifest (presets.h)");

  // One matrix's Newton-Schulz FLOPs: the distributed optimizer's owners are balanced by it.
  m.def(
      "ns_dense_flops",
      [](const std::string& algorithm, int64_t rows, int64_t cols, int steps) {
        if (algorithm != "standard" && algorithm != "gram")
          throw std::invalid_argument("unknown ns_algorithm '" + algorithm + "' (choose standard | gram)");
        return ns_dense_flops(algorithm == "gram" ? NsAlgorithm::gram : NsAlgorithm::standard, rows, cols, steps);
      },
      py::arg("ns_algorithm"), py::arg("rows"), py::arg("cols"), py::arg("ns_steps"),
      "FLOPs (2 per multiply-add) of orthogonalising one rows x cols matrix, every product in full");

  m.def("route", [](const ParamSpec& p) { return std::string(to_string(route(p))); }, py::arg("param"),
        "The spec's routing rule: 'normuon' or 'adamw' (ValueError: NorMuon forced on a non-2-D parameter)");
  m.def("resolved_group", &resolved_group, py::arg("param"));
  m.def("transposable", &transposable, py::arg("param"),
        "Whether a parameter can be stored transposed ([in, out]): a matrix, or an expert bank with role experts");

  py::class_<Manifest>(m, "Manifest")
      .def(py::init([](std::vector<ParamSpec> params) {
             Manifest mf;
             mf.params = std::move(params);
             return mf;
           }),
           py::arg("params"))
      .def_readonly("params", &Manifest::params)
      .def("validate", &Manifest::validate)
      .def("numel", &Manifest::numel)
      .def("to_csv",
           [](const Manifest& mf) {
             std::ostringstream out;
             mf.write_csv(out);
             return out.str();
           })
      .def("write_csv",
           [](const Manifest& mf, const std::string& path) {
             std::ofstream out(path, std::ios::binary | std::ios::trunc);
             if (!out) throw std::runtime_error("cannot write manifest file '" + path + "'");
             mf.write_csv(out);
             if (!out.flush()) throw std::runtime_error("error writing manifest file '" + path + "'");
           },
           py::arg("path"))
      .def_static("read_csv", &Manifest::read_csv_file, py::arg("path"))
      .def_static("from_csv", [](const std::string& text) {
        std::istringstream in(text);
        return Manifest::read_csv(in);
      });

  py::class_<LayoutEntry>(m, "LayoutEntry")
      .def_readonly("name", &LayoutEntry::name)
      .def_readonly("shape", &LayoutEntry::shape)
      .def_property_readonly("dtype", [](const LayoutEntry& e) { return std::string(to_string(e.dtype)); })
      .def_property_readonly("role", [](const LayoutEntry& e) { return std::string(to_string(e.role)); })
      .def_property_readonly("algorithm", [](const LayoutEntry& e) { return std::string(to_string(e.algorithm)); })
      .def_readonly("group", &LayoutEntry::group)
      .def_readonly("numel", &LayoutEntry::numel)
      .def_readonly("offset", &LayoutEntry::offset)
      .def_readonly("rows", &LayoutEntry::rows)
      .def_readonly("cols", &LayoutEntry::cols)
      .def_readonly("bucket", &LayoutEntry::bucket)
      .def_readonly("stats_per_row", &LayoutEntry::stats_per_row)
      .def_readonly("transposed", &LayoutEntry::transposed)
      .def_readonly("stat_offset", &LayoutEntry::stat_offset)
      .def_readonly("stat_len", &LayoutEntry::stat_len)
      .def_readonly("adam_offset", &LayoutEntry::adam_offset)
      .def_readonly("master_offset", &LayoutEntry::master_offset);

  py::class_<Layout>(m, "Layout", "The flat placement of a manifest's parameters and state (layout.h)")
      .def_static("build", &Layout::build, py::arg("manifest"), py::arg("options"))
      .def_readonly("entries", &Layout::entries)
      .def_readonly("group_names", &Layout::group_names)
      .def_readonly("param_floats", &Layout::param_floats)
      .def_readonly("normuon_floats", &Layout::normuon_floats)
      .def_readonly("stat_floats", &Layout::stat_floats)
      .def_readonly("adam_floats", &Layout::adam_floats)
      .def_readonly("master_floats", &Layout::master_floats)
      .def_property_readonly("buckets",
                             [](const Layout& l) {
                               std::vector<std::pair<int64_t, int64_t>> out;
                               for (const auto& b : l.buckets) out.emplace_back(b.rows, b.cols);
                               return out;
                             })
      .def_property_readonly("fingerprint", &Layout::fingerprint_hex)
      .def("find", &Layout::find, py::arg("name"))
      .def("describe", &Layout::describe);

  py::class_<FlatState>(m, "FlatState",
                        "Flat fp32 buffers of a layout; the buffer properties are numpy views of the C++ memory")
      .def(py::init<const Layout&>(), py::arg("layout"), py::keep_alive<1, 2>())
      .def_property_readonly("params", buffer_view(&FlatState::params))
      .def_property_readonly("grads", buffer_view(&FlatState::grads))
      .def_property_readonly("momentum", buffer_view(&FlatState::momentum))
      .def_property_readonly("row_var", buffer_view(&FlatState::row_var))
      .def_property_readonly("exp_avg", buffer_view(&FlatState::exp_avg))
      .def_property_readonly("exp_avg_sq", buffer_view(&FlatState::exp_avg_sq))
      // has_grad never reallocates (one flag per entry); group_steps is replaced by load_state, so it is
      // copied in and out rather than viewed.
      .def_property_readonly("has_grad", [](py::object self) {
        auto& s = self.cast<FlatState&>();
        return view(s.has_grad.data(), static_cast<int64_t>(s.has_grad.size()), self);
      })
      .def_property("group_steps", [](const FlatState& s) { return s.group_steps; }, &set_group_steps<FlatState>,
                    "per group; setting it also sets every entry's count to its group's (set entry_steps after)")
      .def_property("entry_steps", [](const FlatState& s) { return s.entry_steps; }, &set_entry_steps<FlatState>,
                    "per layout entry: the steps in which that parameter had a gradient (AdamW's bias "
                    "corrections use it); each in [0, its group's step]")
      .def("same_optimizer_state", &FlatState::same_optimizer_state, py::arg("other"));

  // Table mode (param_table.h): the caller's tensors by address, the optimizer's own memory beside them.
  py::class_<ParamTable>(m, "ParamTable", "Per layout entry: the address of the caller's parameter and gradient")
      .def(py::init<const Layout&>(), py::arg("layout"), py::keep_alive<1, 2>())
      .def(
          "set",
          [](ParamTable& t, const std::vector<uintptr_t>& params, const std::vector<uintptr_t>& grads,
             const std::vector<std::string>& grad_dtypes, const std::vector<std::pair<int64_t, int64_t>>& runs) {
            const size_t n = t.params.size();
            if (params.size() != n || grads.size() != n || grad_dtypes.size() != n || (!runs.empty() && runs.size() != n))
              throw std::invalid_argument("ParamTable.set: " + std::to_string(params.size()) + " parameters, " +
                                          std::to_string(grads.size()) + " gradients, " +
                                          std::to_string(grad_dtypes.size()) + " gradient dtypes and " +
                                          std::to_string(runs.size()) + " row runs for " + std::to_string(n) +
                                          " entries");
            std::vector<DType> dtypes(n);
            for (size_t e = 0; e < n; ++e) dtypes[e] = parse_dtype(grad_dtypes[e]);  // all checked first
            for (size_t e = 0; e < n; ++e) {
              const RowRuns r = runs.empty() ? RowRuns{} : RowRuns{runs[e].first, runs[e].second};
              t.params[e].data = reinterpret_cast<void*>(params[e]);
              t.params[e].runs = r;
              t.grads[e] = TensorRef{reinterpret_cast<void*>(grads[e]), dtypes[e], r};
            }
          },
          py::arg("params"), py::arg("grads"), py::arg("grad_dtypes"),
          py::arg("runs") = std::vector<std::pair<int64_t, int64_t>>{},
          "Addresses (0: no gradient) and gradient dtypes (f32 | bf16 | f16), one per layout entry; runs: per "
          "entry (run, pitch) in elements when the parameter and its gradient are blocks of rows of larger "
          "tensors ((0, 0): dense), else empty")
      .def("invalid_reason", &ParamTable::invalid_reason);

  py::class_<TableState>(m, "TableState",
                         "The optimizer's memory of table mode: state and the fp32 masters of bf16/fp16 parameters")
      .def(py::init<const Layout&>(), py::arg("layout"), py::keep_alive<1, 2>())
      .def_property_readonly("masters", buffer_view(&TableState::masters))
      .def_property_readonly("momentum", buffer_view(&TableState::momentum))
      .def_property_readonly("row_var", buffer_view(&TableState::row_var))
      .def_property_readonly("exp_avg", buffer_view(&TableState::exp_avg))
      .def_property_readonly("exp_avg_sq", buffer_view(&TableState::exp_avg_sq))
      .def_property("group_steps", [](const TableState& s) { return s.group_steps; }, &set_group_steps<TableState>,
                    "per group; setting it also sets every entry's count to its group's (set entry_steps after)")
      .def_property("entry_steps", [](const TableState& s) { return s.entry_steps; }, &set_entry_steps<TableState>,
                    "per layout entry: the steps in which that parameter had a gradient; each in [0, its group's "
                    "step]");
  m.def("table_to_flat", &table_to_flat, py::arg("state"), py::arg("table"), py::arg("flat"),
        "Table mode -> FlatState: parameters (fp32 or masters), gradients, state, steps");
  m.def("flat_to_table", &flat_to_table, py::arg("flat"), py::arg("state"), py::arg("table"),
        "FlatState -> table mode: state, steps, masters, and the caller's parameters rounded to their dtype");

  bind_engine(m);
  bind_spec(m);

  py::class_<StepResult>(m, "StepResult")
      .def_readonly("skipped", &StepResult::skipped)
      .def_readonly("reason", &StepResult::reason);

#ifdef NORMUON_HAVE_FAST_CPU  // a build without oneDNN has none; optim.py then refuses CPU parameters on "fast"
  m.def("default_threads", &fast::default_threads,
        "The fast CPU backend's threads for threads=0: the processors this process may use (affinity mask), "
        "within its cgroup CPU quota");
  py::class_<FastCpuBackend>(m, "FastCpuBackend", "The fused multi-threaded CPU backend (docs/fast-cpu.md)")
      .def(py::init<const Layout&, const Options&, int>(), py::arg("layout"), py::arg("options"),
           py::arg("threads") = 0, py::keep_alive<1, 2>())
      .def_property_readonly("name", &FastCpuBackend::name)
      .def_property_readonly("threads", &FastCpuBackend::threads)
      .def_property_readonly("workspace_bytes", &FastCpuBackend::workspace_bytes)
      .def("describe", &FastCpuBackend::describe)
      // The step runs on its own OpenMP threads over memory Python doesn't touch meanwhile: let go of the GIL.
      .def("step", py::overload_cast<FlatState&, const Options&>(&FastCpuBackend::step), py::arg("state"),
           py::arg("options"), py::call_guard<py::gil_scoped_release>())
      .def(
          "step",
          [](FastCpuBackend& b, TableState& state, const ParamTable& table, const Options& options,
             uintptr_t grad_scale) {
            return b.step(state, table, options, reinterpret_cast<const float*>(grad_scale));
          },
          py::arg("state"), py::arg("table"), py::arg("options"), py::arg("grad_scale") = 0,
          py::call_guard<py::gil_scoped_release>(),
          "Table mode: the caller's tensors in place; grad_scale: the address of a GradScaler's fp32 scale "
          "(every gradient is divided by it as it is read), or 0")
      .def_property_readonly("counters", [](const FastCpuBackend& b) {
        return py::dict(py::arg("elementwise_passes") = b.counters().elementwise_passes,
                        py::arg("gemm_calls") = b.counters().gemm_calls);
      })
      .def_static("unsupported_reason", &FastCpuBackend::unsupported_reason, py::arg("layout"), py::arg("options"));
#endif

  // The CLI's deterministic gradients and initial parameters, so Python can reproduce a `normuon run`.
  py::class_<GradientGenerator>(m, "GradientGenerator")
      .def(py::init([](uint64_t seed, int missing_grad_period) { return GradientGenerator{seed, missing_grad_period}; }),
           py::arg("seed") = 1234, py::arg("missing_grad_period") = 0)
      .def("fill_gradients", &GradientGenerator::fill_gradients, py::arg("state"), py::arg("step"))
      .def("fill_params", &GradientGenerator::fill_params, py::arg("state"));

  m.def("save_state", &save_state, py::arg("path"), py::arg("state"), py::arg("options"), py::arg("backend"),
        py::call_guard<py::gil_scoped_release>(),
        "Atomic write of parameters, state, group and entry steps and options (format version STATE_FORMAT_VERSION)");
  m.def("load_state",
        [](const std::string& path, FlatState& state) {
          Options options;
          {
            py::gil_scoped_release release;
            load_state(path, state, &options);
          }
          return options;
        },
        py::arg("path"), py::arg("state"), "All-or-nothing load; returns the saved options");
  m.def(
      "read_state_header",
      [](const std::string& path, bool verify) { return header_dict(read_state_header(path, verify)); },
      py::arg("path"), py::arg("verify_checksums") = true);
  // One read of a state file: its header to look at, then the tensors loaded from the same bytes (a file
  // replaced in between cannot mix two versions).
  py::class_<StateFileContents>(m, "StateFileContents")
      .def_property_readonly("header", [](const StateFileContents& c) { return header_dict(c.header); });
  m.def("read_state_file", &read_state_file, py::arg("path"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "load_state_file",
      [](const StateFileContents& contents, FlatState& state) {
        Options options;
        {
          py::gil_scoped_release release;
          load_state_file(contents, state, &options);
        }
        return options;
      },
      py::arg("contents"), py::arg("state"), "All-or-nothing load from a file read once; returns the saved options");
}
