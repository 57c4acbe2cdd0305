// normuon._C.Engine: the native engine (core/include/normuon/engine.h) on the fast CPU backend or on a
// device backend another module builds (normuon._C_cuda's engine_backend), with the caller's torch
// tensors walked here, in C++, once per step: their addresses, gradients and version counters go into the
// engine's table without a Python-level call per parameter. No libtorch: the tensors are reached through
// their Python attributes (data_ptr, grad, _version, get_device, ...).
#include "engine_bindings.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "normuon/backend_choice.h"
#include "normuon/engine.h"
#include "normuon/low_precision.h"
#include "normuon/step_prologue.h"
#include "table_reference.h"
#ifdef NORMUON_HAVE_FAST_CPU
#include "fast_cpu_backend.h"
#endif

namespace py = pybind11;

namespace normuon {
namespace {

// A field's checked value as Python has it: an integer field as an int.
py::object to_python(const FieldSpec& spec, const FieldValue& v) {
  if (spec.kind == FieldSpec::Kind::integer) return py::int_(static_cast<int64_t>(std::get<double>(v)));
  return std::visit([](const auto& x) -> py::object { return py::cast(x); }, v);
}

const FieldSpec& field_spec(Algorithm algorithm, const std::string& name) {
  static const std::vector<FieldSpec> specs[2] = {Options::fields(Algorithm::normuon), Options::fields(Algorithm::adamw)};
  for (const FieldSpec& s : specs[algorithm == Algorithm::normuon ? 0 : 1])
    if (s.name == name) return s;
  throw std::invalid_argument("a " + std::string(to_string(algorithm)) + " group has no field '" + name + "'");
}

// A caller's tensor that is neither contiguous nor dense (a strided view): the step runs on a contiguous copy
// of it (the shadow), read from it when it was written from outside and written back after each step.
struct Staged {
  py::object shadow, caller;
  bool fp32 = false;      // read at every step: an fp32 parameter's writes through .data are seen, as in place
  uintptr_t address = 0;  // the caller's as last synced (0: never)
  int64_t version = -1;
  bool stepped = false;   // an entry over it had a gradient in this step
};

// One layout entry's tensor as the walk sees it.
struct BoundTensor {
  py::object tensor;  // the parameter, or the fused tensor a block of rows lies in (a staged one's shadow)
  int64_t offset = 0; // elements into it where the block starts (0: the whole tensor)
  RowRuns runs;       // the block's rows in it (dense: the whole tensor)
  py::object shape;   // torch.Size when bound: a parameter moved to another shape is refused
  py::object strides = py::none();  // None: contiguous; else a dense tensor's strides, stepped in memory order
  py::object grad_of; // whose .grad is this entry's gradient (a DTensor's: its local shard), or None: tensor's
  int staged = -1;    // its Staged, or -1
  uintptr_t address = 0;
  int64_t version = -1;  // -1: its master not read yet
};

// Whether two tensors' strides lay out `shape` alike (a dimension of one element has no stride that matters).
bool same_layout(const std::vector<int64_t>& shape, const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  if (a.size() != shape.size() || b.size() != shape.size()) return false;
  for (size_t d = 0; d < shape.size(); ++d)
    if (shape[d] != 1 && a[d] != b[d]) return false;
  return true;
}

std::vector<int64_t> ints(const py::object& sequence) { return sequence.cast<std::vector<int64_t>>(); }

// A dense tensor's element order (param_table.h) from its shape and strides: its dimensions from the
// outermost in memory, each with its row-major stride over `shape`. Empty when row-major already. Throws
// std::invalid_argument when the strides are not those of a dense tensor (a gap, or an element twice).
ElementOrder element_order(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
                           const std::string& name) {
  std::vector<size_t> dims(shape.size());
  for (size_t d = 0; d < dims.size(); ++d) dims[d] = d;
  std::stable_sort(dims.begin(), dims.end(), [&](size_t a, size_t b) { return strides[a] > strides[b]; });
  std::vector<int64_t> row_major(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) row_major[d - 1] = row_major[d] * shape[d];
  ElementOrder order;
  int64_t expected = 1;
  for (size_t k = dims.size(); k-- > 0;) {
    const size_t d = dims[k];
    if (shape[d] != 1 && strides[d] != expected)
      throw std::invalid_argument("parameter '" + name + "' is neither contiguous nor dense (strides " +
                                  py::str(py::tuple(py::cast(strides))).cast<std::string>() + " over shape " +
                                  py::str(py::tuple(py::cast(shape))).cast<std::string>() +
                                  "): it must be stepped through a contiguous copy (staged)");
    expected *= shape[d];
  }
  for (const size_t d : dims) {
    order.sizes.push_back(shape[d]);
    order.strides.push_back(row_major[d]);
  }
  if (std::is_sorted(dims.begin(), dims.end())) order = {};
  return order;
}

// The engine with the torch tensors it steps, all on one device: `device` as torch's get_device() says it
// (-1: the CPU).
class TorchEngine {
 public:
  TorchEngine(const Manifest& manifest, const Options& options, const Engine::BackendFactory& factory, int device)
      : engine_(manifest, options, factory), device_(device) {
    const py::module_ torch = py::module_::import("torch");
    dtypes_[0] = {torch.attr("float32"), DType::f32};
    dtypes_[1] = {torch.attr("bfloat16"), DType::bf16};
    dtypes_[2] = {torch.attr("float16"), DType::f16};
  }
#ifdef NORMUON_HAVE_FAST_CPU
  TorchEngine(const Manifest& manifest, const Options& options, int threads)
      : TorchEngine(manifest, options, fast_cpu(threads, &cpu_), -1) {}
#endif

  Engine& engine() { return engine_; }
  int threads() const {
#ifdef NORMUON_HAVE_FAST_CPU
    if (cpu_) return cpu_->threads();
#endif
    return 0;
  }
  // The fast CPU backend again with `threads` threads (torch's count changed): the state stays.
  void set_threads(int threads) {
#ifdef NORMUON_HAVE_FAST_CPU
    if (cpu_ && threads != cpu_->threads()) engine_.set_backend(fast_cpu(threads, &cpu_));
#else
    (void)threads;
#endif
  }

  // The tensors, one per layout entry, with each block of rows's (offset, run, pitch) in elements or
  // (0, 0, 0) for a whole tensor. Their masters are read at the next step. A whole tensor may be dense but
  // not contiguous (channels_last, a transposed view): it is stepped in memory order, as its layout entry
  // says, its gradient laid out alike, and messages name elements as the caller numbers them.
  // frozen: tensors outside the layout (no state) that frozen_with_grad() watches.
  // grad_of: per entry, the object whose .grad holds its gradient (a DTensor parameter, bound by its local
  // tensor: the gradient is read as .grad._local_tensor), or empty: each tensor's own.
  // staged: (shadow, caller) pairs: where `tensors` holds a shadow (a contiguous tensor of the caller's shape
  // and dtype), the step runs on it; it is read from the caller's tensor when that was written from outside,
  // and written back after every step that stepped it. The caller's .grad is the gradient.
  void bind(const py::list& tensors, const std::vector<std::tuple<int64_t, int64_t, int64_t>>& blocks,
            const py::list& frozen, const py::list& grad_of, const py::list& staged) {
    const size_t n = engine_.layout().entries.size();
    if (tensors.size() != n || (!blocks.empty() && blocks.size() != n) || (!grad_of.empty() && grad_of.size() != n))
      throw std::invalid_argument("Engine.bind: " + std::to_string(tensors.size()) + " tensors for " +
                                  std::to_string(n) + " layout entries");
    std::vector<Staged> shadows;
    std::unordered_map<PyObject*, int> shadow_index;
    for (const py::handle pair : staged) {
      const auto [shadow, caller] = pair.cast<std::pair<py::object, py::object>>();
      if (!shadow.attr("is_contiguous")().cast<bool>() || !py::object(shadow.attr("shape")).equal(caller.attr("shape")) ||
          !py::object(shadow.attr("dtype")).is(caller.attr("dtype")))
        throw std::invalid_argument("Engine.bind: a shadow must be a contiguous tensor of its caller's shape and dtype");
      shadow_index[shadow.ptr()] = static_cast<int>(shadows.size());
      shadows.push_back(Staged{shadow, caller, py::object(caller.attr("dtype")).is(dtypes_[0].first)});
    }
    ParamTable& table = engine_.table();
    std::vector<ElementOrder> orders(n);
    bool any_order = false;
    std::vector<BoundTensor> bound(n);
    for (size_t e = 0; e < n; ++e) {
      const LayoutEntry& le = engine_.layout().entries[e];
      bound[e].tensor = tensors[e];
      bound[e].grad_of = grad_of.empty() ? py::none() : py::object(grad_of[e]);
      if (!blocks.empty()) {
        const auto& [offset, run, pitch] = blocks[e];
        bound[e].offset = offset;
        bound[e].runs = RowRuns{run, pitch};
      }
      if (const auto it = shadow_index.find(bound[e].tensor.ptr()); it != shadow_index.end()) bound[e].staged = it->second;
      bound[e].shape = bound[e].tensor.attr("shape");
      if (!bound[e].tensor.attr("is_contiguous")().cast<bool>()) {
        if (bound[e].offset != 0 || !bound[e].runs.dense())
          throw std::invalid_argument("Engine.bind: '" + le.name + "' is a block of a tensor that is not contiguous");
        bound[e].strides = bound[e].tensor.attr("stride")();
        orders[e] = element_order(ints(bound[e].shape), ints(bound[e].strides), le.name);
        any_order = any_order || !orders[e].sizes.empty();
      }
      const auto numel = bound[e].tensor.attr("numel")().cast<int64_t>();
      const int64_t needs = bound[e].runs.dense() ? le.numel + bound[e].offset
                                                  : bound[e].offset + (le.numel / bound[e].runs.run - 1) * bound[e].runs.pitch +
                                                        bound[e].runs.run;
      if (bound[e].offset < 0 || numel < needs)
        throw std::invalid_argument("Engine.bind: tensor " + std::to_string(e) + " has " + std::to_string(numel) +
                                    " elements; layout entry '" + le.name + "' needs " + std::to_string(needs));
    }
    bound_ = std::move(bound);
    staged_ = std::move(shadows);
    table.orders = any_order ? std::move(orders) : std::vector<ElementOrder>{};
    table_bound_ = false;
    frozen_ = frozen;
  }

  // Positions in the frozen list of the tensors that now have a gradient (to be laid out).
  std::vector<size_t> frozen_with_grad() const {
    std::vector<size_t> out;
    for (size_t i = 0; i < frozen_.size(); ++i)
      if (!py::object(frozen_[i].attr("grad")).is_none()) out.push_back(i);
    return out;
  }

  // Reads every tensor's address, version and gradient into the engine's table, then steps with the
  // GIL released. grad_scale, found_inf: addresses of a scaler's fp32 scalars on the tensors' device, or
  // 0; stream: a device backend's stream for this step (a cudaStream_t handle; 0 is the legacy default
  // stream, torch's default), or none.
  StepResult step(uintptr_t grad_scale, uintptr_t found_inf, std::optional<uintptr_t> stream) {
    if (bound_.size() != engine_.layout().entries.size()) throw std::logic_error("Engine.step before Engine.bind");
    if (stream) engine_.set_stream(reinterpret_cast<void*>(*stream));  // before a master refresh enqueues work
    table_bound_ = false;  // until every entry is read: step_bound refuses a half-read table
    keep_.clear();         // the gradients this step reads, held while the GIL is released (and for step_bound)
    std::unordered_map<PyObject*, py::object> relaid;  // a gradient laid out otherwise than its tensor, copied once
    ParamTable& table = engine_.table();
    sync_staged();
    for (Staged& s : staged_) s.stepped = false;
    for (size_t e = 0; e < bound_.size(); ++e) {
      BoundTensor& b = bound_[e];
      const LayoutEntry& le = engine_.layout().entries[e];
      read_parameter(e);
      py::object grad = (!b.grad_of.is_none() ? b.grad_of : b.staged >= 0 ? staged_[b.staged].caller : b.tensor).attr("grad");
      if (!b.grad_of.is_none() && !grad.is_none()) grad = grad.attr("_local_tensor");
      if (grad.is_none()) {
        table.grads[e] = TensorRef{};
        continue;
      }
      const DType dtype = grad_dtype(grad, b, le);
      if (!laid_out_as(grad, b)) {  // the step reads it as its tensor lies
        auto [it, fresh] = relaid.try_emplace(grad.ptr());
        if (fresh) it->second = b.strides.is_none() ? grad.attr("contiguous")()
                                                    : grad.attr("new_empty_strided")(b.shape, b.strides).attr("copy_")(grad);
        grad = it->second;
      }
      if (b.staged >= 0) staged_[b.staged].stepped = true;
      keep_.push_back(grad);
      const uintptr_t g = grad.attr("data_ptr")().cast<uintptr_t>();
      table.grads[e] = TensorRef{reinterpret_cast<char*>(g) + b.offset * static_cast<int64_t>(dtype_bytes(dtype)), dtype, b.runs};
    }
    table_bound_ = true;
    return run_step(reinterpret_cast<const float*>(grad_scale), reinterpret_cast<const float*>(found_inf));
  }

  // Every parameter's address into the table, and the masters of those written from outside since they
  // were last read, read again (Engine::refresh_master's rule): what a step does first, for the callers
  // that read the masters between steps (state dicts, state files). stream: as step()'s.
  void refresh_masters(std::optional<uintptr_t> stream) {
    if (bound_.size() != engine_.layout().entries.size()) throw std::logic_error("Engine.refresh_masters before Engine.bind");
    if (stream) engine_.set_stream(reinterpret_cast<void*>(*stream));
    sync_staged();
    for (size_t e = 0; e < bound_.size(); ++e) read_parameter(e);
  }

  // Bytes of the shadows staged tensors are stepped through (memory the optimizer holds beyond the model's).
  int64_t staged_bytes() const {
    int64_t bytes = 0;
    for (const Staged& s : staged_)
      bytes += s.shadow.attr("numel")().cast<int64_t>() * s.shadow.attr("element_size")().cast<int64_t>();
    return bytes;
  }

  StepResult settle() {
    py::gil_scoped_release release;
    return engine_.settle();
  }

  // The step over the table as the last step() read it (the benchmark's C++ step alone).
  StepResult step_bound() {
    if (!table_bound_) throw std::logic_error("Engine.step_bound: no complete step() has bound the table");
    return run_step(nullptr, nullptr);
  }

  // The tensors as they are now are what the masters hold (Python just wrote both: a load, the masters
  // made at construction): their addresses and versions are recorded, no master is read again.
  void mark_current() {
    for (Staged& s : staged_) sync_in(s, true);
    for (size_t e = 0; e < bound_.size(); ++e) {
      BoundTensor& b = bound_[e];
      check_parameter(b, engine_.layout().entries[e]);
      b.address = b.tensor.attr("data_ptr")().cast<uintptr_t>();
      b.version = b.tensor.attr("_version").cast<int64_t>();
    }
  }

  // Every master read again from its parameter at the next step (after a write the version counter
  // does not see, or a load).
  void forget_versions() {
    for (auto& b : bound_) b.version = -1;
    for (Staged& s : staged_) s.address = 0;  // the shadows read again too
  }

 private:
  // Entry e's parameter into the table; written from outside (its version moved) or new storage (p.data =
  // t, or the first read): a bf16 / fp16 master is read again.
  void read_parameter(size_t e) {
    BoundTensor& b = bound_[e];
    const LayoutEntry& le = engine_.layout().entries[e];
    const uintptr_t address = b.tensor.attr("data_ptr")().cast<uintptr_t>();
    const bool moved = address != b.address;
    check_parameter(b, le);  // still the kind of tensor it was (p.data = other)?
    b.address = address;
    ParamTable& table = engine_.table();
    table.params[e].data = reinterpret_cast<char*>(address) + b.offset * static_cast<int64_t>(dtype_bytes(le.dtype));
    table.params[e].runs = b.runs;
    const auto version = b.tensor.attr("_version").cast<int64_t>();
    if (moved || version != b.version) engine_.refresh_master(static_cast<int>(e));
    b.version = version;
  }

  // The step over the bound table with the GIL released, then the staged tensors' shadows written back to
  // the caller's (a step that throws changed nothing: nothing to write back).
  StepResult run_step(const float* grad_scale, const float* found_inf) {
    StepResult result;
    {
      py::gil_scoped_release release;
      result = engine_.step(grad_scale, found_inf);
    }
    for (Staged& s : staged_)
      if (s.stepped) {
        s.caller.attr("detach")().attr("copy_")(s.shadow);  // detach: a leaf that requires grad, one version counter
        s.address = s.caller.attr("data_ptr")().cast<uintptr_t>();
        s.version = s.caller.attr("_version").cast<int64_t>();
      }
    return result;
  }

  // Every staged tensor still the kind it was, and its shadow read from it where it must be (sync_in), once,
  // before any shadow's version is read.
  void sync_staged() {
    for (size_t e = 0; e < bound_.size(); ++e)
      if (bound_[e].staged >= 0) check_parameter(bound_[e], engine_.layout().entries[e]);
    for (Staged& s : staged_) sync_in(s, false);
  }

  // The shadow read from its caller's tensor, if that was written from outside since the last sync (or
  // always; an fp32 one at every step, so that writes its version counter misses are not undone by the
  // write-back); the shadow's version then moves, so the masters read from it again where they must.
  static void sync_in(Staged& s, bool always) {
    const uintptr_t address = s.caller.attr("data_ptr")().cast<uintptr_t>();
    const auto version = s.caller.attr("_version").cast<int64_t>();
    if (!always && !s.fp32 && address == s.address && version == s.version) return;
    s.shadow.attr("copy_")(s.caller.attr("detach")());
    s.address = address;
    s.version = version;
  }

  // Whether a gradient lies as the step reads its entry's tensor: contiguous, or as the dense tensor does.
  static bool laid_out_as(const py::object& grad, const BoundTensor& b) {
    if (b.strides.is_none()) return grad.attr("is_contiguous")().cast<bool>();
    return same_layout(ints(b.shape), ints(grad.attr("stride")()), ints(b.strides));
  }

#ifdef NORMUON_HAVE_FAST_CPU
  // The fast CPU backend; `made` learns it (the engine owns it).
  static Engine::BackendFactory fast_cpu(int threads, FastCpuBackend** made) {
    return [threads, made](const Layout& l, const Options& o) {
      const std::string reason = FastCpuBackend::unsupported_reason(l, o);
      if (!reason.empty()) throw std::invalid_argument("the fast CPU backend cannot serve this request: " + reason);
      auto backend = std::make_unique<FastCpuBackend>(l, o, threads);
      *made = backend.get();
      return backend;
    };
  }
#endif

  std::string device_name() const { return device_ < 0 ? "cpu" : "cuda:" + std::to_string(device_); }

  // Still the kind of tensor it was when bound: shape, dtype, device, and (unless staged) how it lies in memory.
  void check_parameter(const BoundTensor& b, const LayoutEntry& le) const {
    const py::object t = b.staged >= 0 ? staged_[static_cast<size_t>(b.staged)].caller : b.tensor;
    const py::object dtype = t.attr("dtype");
    const bool same = py::object(t.attr("shape")).equal(b.shape) && dtype.is(dtype_object(le.dtype)) &&
                      t.attr("get_device")().cast<int>() == device_;
    if (!same)
      throw std::runtime_error("parameter '" + le.name + "' is now " + py::str(t.attr("dtype")).cast<std::string>() +
                               " " + py::str(t.attr("shape")).cast<std::string>() + " on " +
                               py::str(t.attr("device")).cast<std::string>() + "; it was " +
                               py::str(dtype_object(le.dtype)).cast<std::string>() + " " +
                               py::str(b.shape).cast<std::string>() + " on " + device_name() +
                               " when the optimizer was built");
    if (b.staged >= 0) return;  // any layout: the shadow is read from it
    const bool lies_alike = b.strides.is_none() ? t.attr("is_contiguous")().cast<bool>()
                                          : same_layout(ints(b.shape), ints(t.attr("stride")()), ints(b.strides));
    if (!lies_alike)
      throw std::runtime_error("parameter '" + le.name + "' now lies in memory with strides " +
                               py::str(t.attr("stride")()).cast<std::string>() + "; it was " +
                               (b.strides.is_none() ? std::string("contiguous")
                                                    : "laid out with strides " + py::str(b.strides).cast<std::string>()) +
                               " when the optimizer was built, and its state follows that order (a memory format "
                               "changed, or .data replaced): build the optimizer after model.to(memory_format=...)");
  }

  DType grad_dtype(const py::object& grad, const BoundTensor& b, const LayoutEntry& le) const {
    if (grad.attr("is_sparse").cast<bool>())
      throw std::runtime_error("parameter '" + le.name + "' has a sparse gradient, which NorMuonAdamW does not support");
    const py::object dtype = grad.attr("dtype");
    for (const auto& [object, d] : dtypes_)
      if (dtype.is(object) && py::object(grad.attr("shape")).equal(py::object(b.tensor.attr("shape"))) &&
          grad.attr("get_device")().cast<int>() == device_)
        return d;
    throw std::runtime_error("parameter '" + le.name + "': its gradient is " + py::str(dtype).cast<std::string>() + " " +
                             py::str(grad.attr("shape")).cast<std::string>() + " on " +
                             py::str(grad.attr("device")).cast<std::string>() +
                             "; expected float32, bfloat16 or float16 " + py::str(b.tensor.attr("shape")).cast<std::string>() +
                             " on " + device_name());
  }

  py::object dtype_object(DType d) const {
    for (const auto& [object, dtype] : dtypes_)
      if (dtype == d) return object;
    throw std::logic_error("unknown dtype");
  }

#ifdef NORMUON_HAVE_FAST_CPU
  FastCpuBackend* cpu_ = nullptr;  // engine_'s backend when it is the fast CPU one (set while it is built)
#endif
  Engine engine_;
  int device_;
  std::vector<BoundTensor> bound_;
  std::vector<Staged> staged_;
  std::vector<py::object> keep_;  // the gradients the table points at
  bool table_bound_ = false;
  py::list frozen_;
  std::pair<py::object, DType> dtypes_[3];
};

}  // namespace

void bind_engine(py::module_& m) {
  m.def(
      "fields",
      [](const std::string& algorithm) {
        std::vector<std::string> out;
        for (const FieldSpec& s : Options::fields(parse_algorithm(algorithm))) out.push_back(s.name);
        return out;
      },
      py::arg("algorithm"), "The hyper-parameter fields of a 'normuon' or 'adamw' group, in order (options.h)");
  m.def(
      "check_values",
      [](const std::string& group, const std::string& algorithm, const py::dict& values) {
        Options o;
        o.groups.resize(1);
        o.groups[0].name = group;
        o.groups[0].algorithm = parse_algorithm(algorithm);
        o.set_group(0, typed_values(values));
        py::dict out;
        for (const auto& [field, value] : values) {
          const std::string name = field.cast<std::string>();
          out[py::str(name)] = to_python(field_spec(o.groups[0].algorithm, name), o.get(0, name));
        }
        return out;
      },
      py::arg("group"), py::arg("algorithm"), py::arg("values"),
      "A group's {field: value} checked by the core's rules (ValueError naming GROUP.FIELD), in canonical types");

#ifdef NORMUON_HAVE_FAST_CPU
  m.attr("has_fast_cpu") = true;
#else
  m.attr("has_fast_cpu") = false;
#endif
  m.attr("FOUND_INF_REASON") = kFoundInfReason;
  // The step prologue's rules for sharded training (step_prologue.h), so that it states none of its own.
  m.def(
      "advance_steps",
      [](const Layout& layout, const std::vector<bool>& has_grad, std::vector<int64_t> group_steps,
         std::vector<int64_t> entry_steps) {
        if (has_grad.size() != layout.entries.size() || entry_steps.size() != layout.entries.size() ||
            group_steps.size() != layout.group_names.size())
          throw std::invalid_argument("advance_steps: one flag and one count per layout entry, one counter per group");
        advance_steps(layout, [&](size_t e) { return has_grad[e]; }, group_steps.data(), entry_steps.data());
        return py::make_tuple(group_steps, entry_steps);
      },
      py::arg("layout"), py::arg("has_grad"), py::arg("group_steps"), py::arg("entry_steps"),
      "(group_steps, entry_steps) after a step that ran: the counter rule of docs/spec.md section 5");
  m.def(
      "nonfinite_gradient",
      [](const std::string& param, float value, int64_t element, int64_t step, const std::string& policy) {
        Options o;
        o.set("nonfinite", policy);
        return nonfinite_gradient(param, value, element, step, o.nonfinite).reason;
      },
      py::arg("param"), py::arg("value"), py::arg("element"), py::arg("step"), py::arg("nonfinite"),
      "A NaN/Inf gradient in every backend's words: RuntimeError under nonfinite='error', else the skip reason");
  m.def("layout_fields", &Engine::layout_fields, "The fields the layout is built from: fixed once it is built");
  m.def(
      "resolve_backend_choice",
      [](const std::string& request) { return std::string(to_string(resolve_backend_choice(request))); },
      py::arg("request") = "",
      "'auto' | 'fast' | 'reference': the request (empty: none), else NORMUON_BACKEND, else auto; ValueError for "
      "anything else, naming where it came from");

  py::class_<TorchEngine>(m, "Engine",
                          "The native engine: layout, options, state, counters; the caller's torch tensors "
                          "stepped in place (core/include/normuon/engine.h)")
#ifdef NORMUON_HAVE_FAST_CPU
      .def(py::init<const Manifest&, const Options&, int>(), py::arg("manifest"), py::arg("options"),
           py::arg("threads") = 0, "On the fast CPU backend (threads 0: one per processor)")
#endif
      .def(py::init([](const Manifest& manifest, const Options& options, const py::capsule& backend, int device) {
             return std::make_unique<TorchEngine>(manifest, options, backend_factory(backend), device);
           }),
           py::arg("manifest"), py::arg("options"), py::arg("backend"), py::arg("device"),
           "On a device backend another module made (normuon._C_cuda.engine_backend), over tensors on `device` "
           "(torch's get_device(): -1 for the CPU)")
      .def_static(
          "reference",
          [](const Manifest& manifest, const Options& options) {
            return std::make_unique<TorchEngine>(manifest, options, [](const Layout& layout, const Options&) {
              return std::make_unique<ReferenceTableBackend>(layout);
            }, -1);
          },
          py::arg("manifest"), py::arg("options"),
          "On the reference (reference-cpu): the spec's per-parameter steps over CPU tensors, no libtorch")
      .def_property_readonly("on_device", [](TorchEngine& t) { return t.engine().on_device(); })
      .def_property("verdict",
                    [](TorchEngine& t) { return t.engine().verdict() == Verdict::sync ? "sync" : "deferred"; },
                    [](TorchEngine& t, const std::string& v) {
                      if (v != "sync" && v != "deferred")
                        throw std::invalid_argument("verdict='" + v + "': choose sync | deferred");
                      t.engine().set_verdict(v == "sync" ? Verdict::sync : Verdict::deferred);
                    },
                    "When a device step's NaN/Inf verdict reaches the host: 'sync' (in step) or 'deferred' (at "
                    "the next step or settle)")
      .def("refresh_masters", &TorchEngine::refresh_masters, py::arg("stream") = py::none(),
           "The masters of parameters written from outside since they were last read, read again (the "
           "engine's rule); what a step does first")
      .def("settle", &TorchEngine::settle,
           "The pending device step's verdict now (rolling its counters back if it was skipped)")
      .def_property_readonly("pending", [](TorchEngine& t) { return t.engine().pending(); })
      .def_property_readonly("layout", [](TorchEngine& t) -> const Layout& { return t.engine().layout(); },
                             py::return_value_policy::reference_internal)
      .def_property_readonly("backend", [](TorchEngine& t) { return t.engine().backend_name(); })
      .def_property_readonly("threads", &TorchEngine::threads)
      .def("set_threads", &TorchEngine::set_threads, py::arg("threads"),
           "The fast CPU backend again with this many threads (0: one per processor); the state stays")
      .def_property_readonly("fixed_fields", [](TorchEngine& t) { return t.engine().fixed_fields(); })
      .def("set_group",
           [](TorchEngine& t, size_t group, const py::dict& values) { t.engine().set_group(group, typed_values(values)); },
           py::arg("group"), py::arg("values"), "New values for one group by index; all or nothing")
      .def("set_nonfinite",
           [](TorchEngine& t, const std::string& policy) {
             Options o;
             o.set("nonfinite", policy);
             t.engine().set_nonfinite(o.nonfinite);
           },
           py::arg("policy"))
      .def("hyper", [](TorchEngine& t, size_t group) {
             const Options& o = t.engine().options();
             if (group >= o.groups.size()) throw py::index_error("group index out of range");
             py::dict out;
             for (const FieldSpec& s : Options::fields(o.groups[group].algorithm))
               out[py::str(s.name)] = to_python(s, o.get(group, s.name));
             return out;
           }, py::arg("group"), "A group's values as the engine holds them")
      .def_property_readonly("options", [](TorchEngine& t) { return t.engine().options(); })
      .def("bind", &TorchEngine::bind, py::arg("tensors"),
           py::arg("blocks") = std::vector<std::tuple<int64_t, int64_t, int64_t>>{}, py::arg("frozen") = py::list(),
           py::arg("grad_of") = py::list(), py::arg("staged") = py::list(),
           "The tensors, one per layout entry (a block of rows: its fused tensor with (offset, run, pitch); a "
           "dense tensor that is not contiguous: stepped in memory order); frozen: tensors outside the layout, "
           "watched by frozen_with_grad; grad_of: per entry, the DTensor whose .grad's local shard is its "
           "gradient (empty: each tensor's own .grad); staged: (shadow, caller) pairs, a strided caller's tensor "
           "stepped through its contiguous shadow")
      .def_property_readonly("staged_bytes", &TorchEngine::staged_bytes,
                             "Bytes of the contiguous copies that strided parameters are stepped through")
      .def("frozen_with_grad", &TorchEngine::frozen_with_grad,
           "Positions in the frozen list of the tensors that have a gradient now")
      .def("step", &TorchEngine::step, py::arg("grad_scale") = 0, py::arg("found_inf") = 0, py::arg("stream") = py::none(),
           "One step over the bound tensors (one native call: addresses, gradients, versions, then the step; "
           "enqueued on `stream` for a device backend)")
      .def("step_bound", &TorchEngine::step_bound,
           "The step over the table as the last step() bound it, reading no tensor again: the C++ step alone "
           "(bench/python_step.py; the tensors must still be where they were)")
      .def("mark_current", &TorchEngine::mark_current,
           "The tensors hold what the masters hold now (after Python wrote both): no master is read again")
      .def("forget_versions", &TorchEngine::forget_versions,
           "Every master is read again from its parameter at the next step")
      .def_property_readonly("group_steps", [](TorchEngine& t) { return t.engine().group_steps(); })
      .def_property_readonly("entry_steps", [](TorchEngine& t) { return t.engine().entry_steps(); })
      .def("set_steps", [](TorchEngine& t, const std::vector<int64_t>& group_steps,
                           const std::optional<std::vector<int64_t>>& entry_steps) {
             t.engine().set_steps(group_steps, entry_steps ? *entry_steps : std::vector<int64_t>{});
           }, py::arg("group_steps"), py::arg("entry_steps") = py::none(),
           "Both counters, checked first; entry_steps None: each parameter at its group's counter")
      .def_property_readonly("table", [](TorchEngine& t) -> ParamTable& { return t.engine().table(); },
                             py::return_value_policy::reference_internal)
      .def("buffers", [](py::object self) {
             py::dict out;
             for (const BufferView& b : self.cast<TorchEngine&>().engine().buffers())
               out[py::str(b.name)] = b.device ? py::object(py::make_tuple(reinterpret_cast<uintptr_t>(b.data), b.size, "<f4"))
                                               : py::object(view(b.data, b.size, self));
             return out;
           }, "The engine's own memory, masters and state buffers: numpy views of host memory, (address, "
              "elements, typestr) of device memory (for __cuda_array_interface__)")
      .def("memory_report", [](TorchEngine& t) {
             const MemoryReport r = t.engine().memory_report();
             return py::dict(py::arg("state_bytes") = r.state_bytes, py::arg("master_bytes") = r.master_bytes,
                             py::arg("workspace_bytes") = r.workspace_bytes);
           });
}

}  // namespace normuon
