// Table mode (core/include/normuon/param_table.h): the fast CPU backend stepping the caller's own
// tensors gives the bits of its FlatState step, and so does the reference (its libtorch-free table step,
// reference/table_reference.h, against its ATen-held flat one), for fp32, bf16 and fp16 parameters and gradients, with
// missing gradients, addresses that change between steps, NaN/Inf gradients, states that cross between
// the modes through state files, and matrices that are blocks of rows of a larger tensor (row runs).
#define BOOST_TEST_MODULE param_table
#include <boost/test/unit_test.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "fast_cpu_backend.h"
#ifdef NORMUON_TEST_HAVE_REFERENCE
#include "reference_backend.h"
#include "table_reference.h"
#endif
#include "normuon/grad_gen.h"
#include "normuon/low_precision.h"
#include "normuon/param_table.h"
#include "normuon/presets.h"
#include "normuon/row_runs.h"
#include "normuon/state_file.h"

using namespace normuon;

namespace {

bool same_bits(const void* a, const void* b, size_t bytes) { return std::memcmp(a, b, bytes) == 0; }

// The tiny preset with its parameters in turn fp32, bf16 and fp16.
Manifest mixed_manifest() {
  Manifest m = preset_manifest("tiny");
  const DType cycle[] = {DType::f32, DType::bf16, DType::f16};
  for (size_t i = 0; i < m.params.size(); ++i) m.params[i].dtype = cycle[i % 3];
  return m;
}

Options options() {
  Options o;
  o.set("weight_decay=0.1");
  o.set("adamw.weight_decay=0.01");
  return o;
}

// The caller's tensors: one byte vector per parameter and gradient, in the dtypes asked for.
struct Caller {
  const Layout& layout;
  std::vector<std::vector<char>> params, grads;
  ParamTable table;
  DType grad_dtype;

  Caller(const Layout& l, DType g) : layout(l), params(l.entries.size()), grads(l.entries.size()), table(l), grad_dtype(g) {
    for (size_t e = 0; e < l.entries.size(); ++e) {
      params[e].resize(static_cast<size_t>(l.entries[e].numel) * dtype_bytes(l.entries[e].dtype));
      table.params[e].data = params[e].data();
    }
  }
  // Parameters from the flat fp32 values (rounded to their dtype), then the flat values from them, so
  // that both modes start from the same numbers.
  void take_params(FlatState& flat) {
    for (size_t e = 0; e < params.size(); ++e) {
      const LayoutEntry& le = layout.entries[e];
      narrow(flat.param(static_cast<int>(e)), params[e].data(), le.dtype, le.numel);
      widen(params[e].data(), le.dtype, flat.param(static_cast<int>(e)), le.numel);
    }
  }
  // This step's gradients from the flat ones (rounded to grad_dtype; flat made equal), each in a fresh
  // buffer when `move` (as zero_grad(set_to_none=True) and a new backward give).
  void take_grads(FlatState& flat, bool move) {
    for (size_t e = 0; e < grads.size(); ++e) {
      const LayoutEntry& le = layout.entries[e];
      if (move) grads[e] = std::vector<char>(static_cast<size_t>(le.numel) * dtype_bytes(grad_dtype) + 64);
      else grads[e].resize(static_cast<size_t>(le.numel) * dtype_bytes(grad_dtype) + 64);
      narrow(flat.grad(static_cast<int>(e)), grads[e].data(), grad_dtype, le.numel);
      widen(grads[e].data(), grad_dtype, flat.grad(static_cast<int>(e)), le.numel);
      table.grads[e] = TensorRef{flat.has_grad[e] ? grads[e].data() : nullptr, grad_dtype, {}};
    }
  }
};

// Which backend steps both modes.
enum class Which { fast, reference };

std::unique_ptr<Backend> flat_backend_of(Which which, const Layout& layout, const Options& opts) {
#ifdef NORMUON_TEST_HAVE_REFERENCE
  if (which == Which::reference) return std::make_unique<ReferenceBackend>(ReferenceDevice::cpu);
#endif
  BOOST_REQUIRE(which == Which::fast);
  return std::make_unique<FastCpuBackend>(layout, opts, 2);
}

std::unique_ptr<TableBackend> table_backend_of(Which which, const Layout& layout, const Options& opts) {
#ifdef NORMUON_TEST_HAVE_REFERENCE
  if (which == Which::reference) return std::make_unique<ReferenceTableBackend>(layout);
#endif
  return std::make_unique<FastCpuBackend>(layout, opts, 2);
}

// Both modes side by side from the same start, stepped with the same gradients.
struct Twins {
  Layout layout;
  Options opts;
  FlatState flat;
  TableState table_state;
  Caller caller;
  std::unique_ptr<Backend> flat_backend;
  std::unique_ptr<TableBackend> table_backend;
  GradientGenerator gen{1234, 5};  // some parameters miss their gradient at some steps

  explicit Twins(DType grad_dtype, Manifest m = mixed_manifest(), Which which = Which::fast)
      : layout(Layout::build(m, options())),
        opts(options()),
        flat(layout),
        table_state(layout),
        caller(layout, grad_dtype),
        flat_backend(flat_backend_of(which, layout, opts)),
        table_backend(table_backend_of(which, layout, opts)) {
    gen.fill_params(flat);
    caller.take_params(flat);
    for (size_t e = 0; e < layout.entries.size(); ++e) table_state.refresh_master(static_cast<int>(e), caller.table);
  }

  StepResult step(int64_t s, bool move = false) {
    gen.fill_gradients(flat, s);
    caller.take_grads(flat, move);
    const StepResult a = flat_backend->step(flat, opts);
    const StepResult b = table_step(caller.table);
    BOOST_TEST(a.skipped == b.skipped);
    BOOST_TEST(a.reason == b.reason);
    return b;
  }

  StepResult table_step(const ParamTable& table, const float* grad_scale = nullptr) {
    return table_backend->step(table_state, table, opts, grad_scale);
  }

  // Everything equal bit for bit: masters or fp32 parameters, the caller's rounded parameters, state.
  std::string difference() {
    for (size_t e = 0; e < layout.entries.size(); ++e) {
      const LayoutEntry& le = layout.entries[e];
      const float* expected = flat.param(static_cast<int>(e));
      const size_t bytes = static_cast<size_t>(le.numel) * sizeof(float);
      if (le.master_offset < 0) {
        if (!same_bits(expected, caller.params[e].data(), bytes)) return "fp32 parameter " + le.name;
        continue;
      }
      if (!same_bits(expected, table_state.master(static_cast<int>(e)), bytes)) return "master of " + le.name;
      std::vector<char> rounded(caller.params[e].size());
      narrow(expected, rounded.data(), le.dtype, le.numel);
      if (rounded != caller.params[e]) return "rounded parameter " + le.name;
    }
    const AlignedBuffer* f[] = {&flat.momentum, &flat.row_var, &flat.exp_avg, &flat.exp_avg_sq};
    const AlignedBuffer* t[] = {&table_state.momentum, &table_state.row_var, &table_state.exp_avg, &table_state.exp_avg_sq};
    for (int k = 0; k < 4; ++k)
      if (!same_bits(f[k]->data(), t[k]->data(), static_cast<size_t>(f[k]->size()) * sizeof(float))) return "state buffer " + std::to_string(k);
    if (flat.group_steps != table_state.group_steps) return "group steps";
    return "";
  }
};

}  // namespace

BOOST_AUTO_TEST_CASE(masters_only_for_low_precision_parameters) {
  const Layout layout = Layout::build(mixed_manifest(), options());
  int64_t expected = 0;
  for (const LayoutEntry& e : layout.entries) {
    if (e.dtype == DType::f32) {
      BOOST_TEST(e.master_offset == -1, e.name);
      continue;
    }
    BOOST_TEST(e.master_offset == expected, e.name);
    expected += align_up(e.numel);
  }
  BOOST_TEST(layout.master_floats == expected);
  BOOST_TEST(expected > 0);
  // The masters follow from the dtypes, which the fingerprint already covers: an all-fp32 model keeps
  // the fingerprint it had before masters existed (state files of earlier versions still load).
  BOOST_TEST(Layout::build(preset_manifest("tiny"), options()).master_floats == 0);
  BOOST_TEST(Layout::build(preset_manifest("tiny"), options()).fingerprint_hex() == Layout::build(preset_manifest("tiny"), options()).fingerprint_hex());
}

BOOST_AUTO_TEST_CASE(table_mode_is_the_flat_step_bit_for_bit_in_every_gradient_dtype) {
  for (DType g : {DType::f32, DType::bf16, DType::f16}) {
    Twins twins(g);
    for (int64_t s = 1; s <= 4; ++s) {
      BOOST_TEST(!twins.step(s).skipped);
      BOOST_TEST(twins.difference() == "", "gradients " << to_string(g) << ", step " << s);
    }
  }
}

BOOST_AUTO_TEST_CASE(gradients_at_new_addresses_every_step) {
  Twins twins(DType::bf16);
  for (int64_t s = 1; s <= 4; ++s) {
    twins.step(s, /*move=*/true);
    BOOST_TEST(twins.difference() == "", "step " << s);
  }
}

BOOST_AUTO_TEST_CASE(parameters_without_gradients_are_untouched) {
  Twins twins(DType::f32);
  const std::vector<std::vector<char>> before = twins.caller.params;
  const std::vector<float> masters_before(twins.table_state.masters.data(),
                                          twins.table_state.masters.data() + twins.layout.master_floats);
  twins.gen.fill_gradients(twins.flat, 1);
  twins.caller.take_grads(twins.flat, false);
  const int idle = 1;  // a bf16 parameter (mixed_manifest's cycle) that gets no gradient this step
  BOOST_REQUIRE(twins.layout.entries[idle].dtype == DType::bf16);
  twins.caller.table.grads[idle].data = nullptr;
  twins.table_step(twins.caller.table);
  BOOST_TEST(twins.caller.params[idle] == before[idle]);
  const LayoutEntry& le = twins.layout.entries[idle];
  BOOST_TEST(same_bits(twins.table_state.master(idle), masters_before.data() + le.master_offset,
                       static_cast<size_t>(le.numel) * sizeof(float)));
  BOOST_TEST(twins.caller.params[0] != before[0]);  // a parameter with a gradient moved
}

BOOST_AUTO_TEST_CASE(nonfinite_low_precision_gradients_change_nothing_and_read_as_the_flat_state) {
  Twins twins(DType::bf16);
  twins.step(1);
  twins.gen.fill_gradients(twins.flat, 2);
  twins.flat.has_grad.assign(twins.flat.has_grad.size(), 1);
  const int e = 4;
  twins.flat.grad(e)[3] = -std::numeric_limits<float>::infinity();
  twins.caller.take_grads(twins.flat, false);
  const std::vector<std::vector<char>> params_before = twins.caller.params;
  const TableState state_before = twins.table_state;
  std::string flat_message, table_message;
  try {
    twins.flat_backend->step(twins.flat, twins.opts);
  } catch (const std::runtime_error& x) {
    flat_message = x.what();
  }
  try { twins.table_step(twins.caller.table); } catch (const std::runtime_error& x) { table_message = x.what(); }
  BOOST_TEST(table_message.find(twins.layout.entries[e].name) != std::string::npos, table_message);
  BOOST_TEST(table_message == flat_message);
  BOOST_TEST(twins.caller.params == params_before);
  BOOST_TEST(same_bits(twins.table_state.momentum.data(), state_before.momentum.data(),
                       static_cast<size_t>(state_before.momentum.size()) * sizeof(float)));
  BOOST_TEST(twins.table_state.group_steps == state_before.group_steps);
}

BOOST_AUTO_TEST_CASE(state_files_cross_between_table_mode_and_flat_state) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "normuon_test_param_table";
  std::filesystem::create_directories(dir);
  // Table mode saves (through table_to_flat), a FlatState run loads and goes on; and back.
  Twins twins(DType::f32);
  for (int64_t s = 1; s <= 2; ++s) twins.step(s);
  FlatState saved(twins.layout);
  table_to_flat(twins.table_state, twins.caller.table, saved);
  save_state((dir / "table.nmst").string(), saved, twins.opts, "fast-cpu");

  FlatState loaded(twins.layout);
  load_state((dir / "table.nmst").string(), loaded, nullptr);
  BOOST_TEST(loaded.same_optimizer_state(twins.flat));
  BOOST_TEST(same_bits(loaded.params.data(), twins.flat.params.data(), static_cast<size_t>(twins.layout.param_floats) * sizeof(float)));

  // Back into a fresh table-mode optimizer over fresh caller tensors: it then steps as the flat run does.
  save_state((dir / "flat.nmst").string(), twins.flat, twins.opts, "fast-cpu");
  Twins resumed(DType::f32);
  FlatState file(resumed.layout);
  load_state((dir / "flat.nmst").string(), file, nullptr);
  flat_to_table(file, resumed.table_state, resumed.caller.table);
  load_state((dir / "flat.nmst").string(), resumed.flat, nullptr);
  BOOST_TEST(resumed.difference() == "");
  for (int64_t s = 3; s <= 4; ++s) {
    twins.step(s);
    resumed.step(s);
  }
  BOOST_TEST(resumed.difference() == "");
  BOOST_TEST(same_bits(resumed.flat.params.data(), twins.flat.params.data(), static_cast<size_t>(twins.layout.param_floats) * sizeof(float)));
  std::filesystem::remove_all(dir);
}

BOOST_AUTO_TEST_CASE(a_bad_table_is_refused_before_anything_changes) {
  Twins twins(DType::f32);
  twins.gen.fill_gradients(twins.flat, 1);
  twins.caller.take_grads(twins.flat, false);
  ParamTable wrong = twins.caller.table;
  wrong.params[1].dtype = DType::f32;  // the layout says bf16
  BOOST_CHECK_EXCEPTION(twins.table_step(wrong), std::invalid_argument,
                        [&](const std::invalid_argument& x) {
                          return std::string(x.what()).find(twins.layout.entries[1].name) != std::string::npos &&
                                 std::string(x.what()).find("bf16") != std::string::npos;
                        });
  ParamTable missing = twins.caller.table;
  missing.params[0].data = nullptr;
  BOOST_CHECK_THROW(twins.table_step(missing), std::invalid_argument);
  BOOST_TEST((twins.table_state.group_steps == std::vector<int64_t>{0, 0}));
}

namespace {

// Megatron's fused QKV weight: per query group, block_rows[0] query rows, block_rows[1] key rows,
// block_rows[2] value rows and one last row that no entry covers (it must come through untouched); the
// three blocks are layout entries of their own.
struct FusedGeometry {
  int64_t groups, cols;
  int64_t block_rows[3];
  int64_t group_rows() const { return block_rows[0] + block_rows[1] + block_rows[2] + 1; }
  int64_t block_first(int b) const { return b == 0 ? 0 : block_first(b - 1) + block_rows[b - 1]; }
  int64_t uncovered_row() const { return group_rows() - 1; }
  RowRuns runs(int b) const { return RowRuns{block_rows[b] * cols, group_rows() * cols}; }
};

// Blocks far smaller than a work chunk of the fast CPU backend (32768 floats): a chunk is a whole block.
constexpr FusedGeometry kSmall{3, 24, {4, 2, 2}};
// A query block of 48 x 4 rows of 200 columns, 38400 elements: its first chunk spans 40.96 runs of 800
// elements (it ends inside a run), the second the rest, so a chunk's gradient is gathered from its runs.
constexpr FusedGeometry kLarge{48, 200, {4, 2, 2}};

Manifest fused_manifest(const FusedGeometry& geometry, DType dtype) {
  Manifest m = mixed_manifest();
  const char* names[] = {"qkv.q", "qkv.k", "qkv.v"};
  for (int b = 0; b < 3; ++b)
    m.params.push_back(ParamSpec{names[b], {geometry.groups * geometry.block_rows[b], geometry.cols}, dtype,
                                 Role::matrix, "", std::nullopt});
  return m;
}

// Elements of a dense matrix into (scatter) or out of (gather) a tensor whose rows lie in runs.
void scatter(const char* dense, char* tensor, const RowRuns& runs, size_t bytes, int64_t n) {
  runs.for_each_piece(0, n, [&](int64_t logical, int64_t physical, int64_t count) {
    std::memcpy(tensor + physical * bytes, dense + logical * bytes, static_cast<size_t>(count) * bytes);
  });
}
void gather(const char* tensor, char* dense, const RowRuns& runs, size_t bytes, int64_t n) {
  runs.for_each_piece(0, n, [&](int64_t logical, int64_t physical, int64_t count) {
    std::memcpy(dense + logical * bytes, tensor + physical * bytes, static_cast<size_t>(count) * bytes);
  });
}

// Twins whose table steps the three blocks in place inside one fused parameter and one fused gradient;
// the flat twin steps the same matrices dense.
struct FusedTwins : Twins {
  FusedGeometry geometry;
  int first = 0;  // layout entry of the first block
  std::vector<char> fused_param, fused_grad;

  FusedTwins(DType dtype, DType grad_dtype, const FusedGeometry& g = kSmall, Which which = Which::fast)
      : Twins(grad_dtype, fused_manifest(g, dtype), which), geometry(g) {
    first = static_cast<int>(layout.entries.size()) - 3;
    const size_t pb = dtype_bytes(dtype), gb = dtype_bytes(grad_dtype);
    const int64_t fused_numel = g.groups * g.group_rows() * g.cols;
    fused_param.assign(static_cast<size_t>(fused_numel) * pb, 0x5a);  // the uncovered rows keep these bytes
    fused_grad.assign(static_cast<size_t>(fused_numel) * gb, 0x7f);   // NaN-ish filler nobody may read
    for (int b = 0; b < 3; ++b) {
      const int e = first + b;
      BOOST_REQUIRE(layout.entries[e].algorithm == Algorithm::normuon);
      char* at = fused_param.data() + static_cast<size_t>(g.block_first(b) * g.cols) * pb;
      scatter(caller.params[e].data(), at, g.runs(b), pb, layout.entries[e].numel);
      caller.table.params[e].data = at;
      caller.table.params[e].runs = g.runs(b);
    }
    for (int b = 0; b < 3; ++b) table_state.refresh_master(first + b, caller.table);
  }

  // tamper: edits this step's gradients before both modes take them.
  StepResult step(int64_t s, const std::function<void(FlatState&)>& tamper = {}) {
    gen.fill_gradients(flat, s);
    if (tamper) tamper(flat);
    caller.take_grads(flat, false);
    const size_t gb = dtype_bytes(caller.grad_dtype);
    for (int b = 0; b < 3; ++b) {
      const int e = first + b;
      if (!caller.table.grads[e].data) continue;
      char* at = fused_grad.data() + static_cast<size_t>(geometry.block_first(b) * geometry.cols) * gb;
      scatter(caller.grads[e].data(), at, geometry.runs(b), gb, layout.entries[e].numel);
      caller.table.grads[e] = TensorRef{at, caller.grad_dtype, geometry.runs(b)};
    }
    StepResult a, r;
    std::string a_error, r_error;  // nonfinite=error: both modes raise the same message
    try { a = flat_backend->step(flat, opts); } catch (const std::runtime_error& x) { a_error = x.what(); }
    try { r = table_step(caller.table); } catch (const std::runtime_error& x) { r_error = x.what(); }
    BOOST_TEST(a_error == r_error);
    if (!r_error.empty()) throw std::runtime_error(r_error);
    BOOST_TEST(a.skipped == r.skipped);
    BOOST_TEST(a.reason == r.reason);
    return r;
  }

  // The blocks read back out of the fused parameter, then Twins' comparison; and the uncovered rows.
  std::string difference() {
    const size_t pb = dtype_bytes(layout.entries[first].dtype);
    for (int b = 0; b < 3; ++b)
      gather(static_cast<const char*>(caller.table.params[first + b].data), caller.params[first + b].data(),
             geometry.runs(b), pb, layout.entries[first + b].numel);
    for (int64_t g = 0; g < geometry.groups; ++g) {
      const char* row =
          fused_param.data() + static_cast<size_t>((g * geometry.group_rows() + geometry.uncovered_row()) * geometry.cols) * pb;
      for (size_t k = 0; k < static_cast<size_t>(geometry.cols) * pb; ++k)
        if (row[k] != 0x5a) return "an uncovered row of the fused parameter changed";
    }
    return Twins::difference();
  }
};

struct DTypes {
  DType param, grad;
};
const std::vector<DTypes> kEveryDTypePair = {
    {DType::f32, DType::f32},  {DType::f32, DType::bf16},  {DType::f32, DType::f16},
    {DType::bf16, DType::f32}, {DType::bf16, DType::bf16}, {DType::bf16, DType::f16},
    {DType::f16, DType::f32},  {DType::f16, DType::bf16},  {DType::f16, DType::f16}};

// Three steps of blocks of `geometry` in each pair of parameter and gradient dtypes: bit for bit the
// dense matrices' flat step, and the state crosses to a FlatState and back through the runs.
void check_blocks_step_as_dense_matrices(const FusedGeometry& geometry, const std::vector<DTypes>& pairs,
                                         Which which = Which::fast) {
  for (const auto [dtype, grad_dtype] : pairs) {
    FusedTwins twins(dtype, grad_dtype, geometry, which);
    for (int64_t s = 1; s <= 3; ++s) {
      BOOST_TEST(!twins.step(s).skipped);
      BOOST_TEST(twins.difference() == "", to_string(dtype) << " parameters, " << to_string(grad_dtype)
                                                            << " gradients, step " << s);
    }
    // Into a FlatState (state files) and back, through the runs.
    FlatState out(twins.layout);
    table_to_flat(twins.table_state, twins.caller.table, out);
    BOOST_TEST(out.same_optimizer_state(twins.flat));
    BOOST_TEST(same_bits(out.params.data(), twins.flat.params.data(),
                         static_cast<size_t>(twins.layout.param_floats) * sizeof(float)));
    BOOST_TEST(same_bits(out.grads.data(), twins.flat.grads.data(),
                         static_cast<size_t>(twins.layout.param_floats) * sizeof(float)));
    flat_to_table(twins.flat, twins.table_state, twins.caller.table);
    BOOST_TEST(twins.difference() == "");
  }
}

}  // namespace

BOOST_AUTO_TEST_CASE(blocks_of_rows_of_a_fused_tensor_step_in_place_as_the_dense_matrices) {
  check_blocks_step_as_dense_matrices(kSmall, kEveryDTypePair);
}

BOOST_AUTO_TEST_CASE(a_block_larger_than_a_work_chunk_steps_as_the_dense_matrix) {
  // The fast CPU backend's multi-tensor passes cut a matrix into chunks of 32768 floats; a chunk of a
  // block then spans several runs and starts or ends inside one. Every parameter dtype on fp32 gradients
  // (gathered from the runs into scratch), and low-precision gradients (widened from them).
  BOOST_REQUIRE(kLarge.groups * kLarge.block_rows[0] * kLarge.cols > 32768);
  BOOST_REQUIRE(32768 % kLarge.runs(0).run != 0);
  check_blocks_step_as_dense_matrices(kLarge, {{DType::f32, DType::f32},
                                               {DType::bf16, DType::f32},
                                               {DType::f16, DType::f32},
                                               {DType::f32, DType::bf16},
                                               {DType::f16, DType::f16}});
}

// The error both modes raise (FusedTwins::step checks they agree) for a first step whose gradient of entry e
// holds `value` at `element`; every other parameter has a gradient.
std::string nonfinite_message(FusedTwins& twins, int e, int64_t element, float value) {
  try {
    twins.step(1, [&](FlatState& flat) {
      flat.has_grad.assign(flat.has_grad.size(), 1);
      flat.grad(e)[element] = value;
    });
  } catch (const std::runtime_error& x) {
    return x.what();
  }
  return "";
}

BOOST_AUTO_TEST_CASE(a_nonfinite_gradient_in_a_block_is_reported_at_its_element_of_the_block) {
  FusedTwins twins(DType::f32, DType::f32);
  // qkv.k; element 30: its row 1 (group 0's second key row), column 6
  const std::string message = nonfinite_message(twins, twins.first + 1, 30, std::numeric_limits<float>::quiet_NaN());
  BOOST_TEST(message.find("'qkv.k'") != std::string::npos, message);
  BOOST_TEST(message.find("element 30") != std::string::npos, message);
}

BOOST_AUTO_TEST_CASE(element_orders_number_elements_as_the_caller_does) {
  // A [2, 3, 4] tensor stored with its last dimension outermost (strides 1, 4, 12 over it): memory element k
  // is (k / 6, k / 2 % 3, k % 2) over the sizes {4, 3, 2} of its dimensions 2, 1, 0.
  const ElementOrder order{{4, 3, 2}, {1, 4, 12}};
  for (int64_t k = 0; k < 24; ++k) BOOST_TEST(order.caller_index(k) == k / 6 + k / 2 % 3 * 4 + k % 2 * 12);
  BOOST_TEST(ElementOrder{}.caller_index(17) == 17);
}

// Entry e of the tiny preset's AdamW parameters with two or more dimensions, read as stored column-major: the
// table's element order for that.
ElementOrder column_major(const LayoutEntry& le) {
  const int64_t rows = le.shape[0], cols = le.numel / rows;
  return ElementOrder{{cols, rows}, {1, cols}};
}

BOOST_AUTO_TEST_CASE(a_nonfinite_gradient_is_named_as_the_caller_numbers_its_elements) {
  std::vector<Which> backends{Which::fast};
#ifdef NORMUON_TEST_HAVE_REFERENCE
  backends.push_back(Which::reference);
#endif
  for (const Which which : backends) {
    Twins twins(DType::f32, mixed_manifest(), which);
    int e = 0;
    while (twins.layout.entries[e].algorithm != Algorithm::adamw || twins.layout.entries[e].shape.size() < 2) ++e;
    const LayoutEntry& le = twins.layout.entries[e];
    const int64_t rows = le.shape[0], cols = le.numel / rows, k = 2 * rows + 1;  // memory element: row 1, column 2
    twins.gen.fill_gradients(twins.flat, 1);
    twins.flat.has_grad.assign(twins.flat.has_grad.size(), 1);
    twins.flat.grad(e)[k] = std::numeric_limits<float>::quiet_NaN();
    twins.caller.take_grads(twins.flat, false);
    ParamTable table = twins.caller.table;
    table.orders.assign(table.params.size(), ElementOrder{});
    table.orders[e] = column_major(le);
    std::string message;
    try {
      twins.table_step(table);
    } catch (const std::runtime_error& x) {
      message = x.what();
    }
    const std::string element = "element " + std::to_string(1 * cols + 2) + " ";
    BOOST_TEST(message.find("'" + le.name + "'") != std::string::npos, message);
    BOOST_TEST(message.find(element) != std::string::npos, message);
    BOOST_TEST((twins.table_state.group_steps == std::vector<int64_t>{0, 0}));
    ParamTable wrong = table;
    wrong.orders[e].sizes[0] += 1;  // more elements than the entry has
    BOOST_TEST(wrong.invalid_reason().find("element order of '" + le.name + "'") != std::string::npos);
    wrong.orders.pop_back();
    BOOST_TEST(wrong.invalid_reason().find("element orders for") != std::string::npos);
  }
}

BOOST_AUTO_TEST_CASE(row_runs_are_checked) {
  FusedTwins twins(DType::f32, DType::f32);
  const int64_t cols = twins.geometry.cols;
  ParamTable table = twins.caller.table;
  BOOST_TEST(table.invalid_reason() == "");
  auto refused = [&](ParamTable t, const std::string& words) {
    const std::string reason = t.invalid_reason();
    BOOST_TEST(reason.find(words) != std::string::npos, reason);
  };
  ParamTable partial_rows = table;
  partial_rows.params[twins.first].runs.run = cols + 1;  // not whole rows
  refused(partial_rows, "whole rows");
  ParamTable short_pitch = table;
  short_pitch.grads[twins.first].runs = RowRuns{2 * cols, cols};  // runs that overlap
  refused(short_pitch, "the gradient of 'qkv.q'");
  ParamTable adamw = table;
  int adamw_entry = 0;
  while (twins.layout.entries[adamw_entry].algorithm != Algorithm::adamw) ++adamw_entry;
  adamw.params[adamw_entry].runs = RowRuns{1, 2};
  refused(adamw, "only NorMuon matrices");
}

BOOST_AUTO_TEST_CASE(rounding_is_torchs) {
  // Round to nearest even at the halfway points, and torch's quiet NaN for bf16.
  const float halfway_bf16 = 1.0f + 1.0f / 256;  // between 1 and the next bf16: rounds to even (1)
  uint16_t h;
  narrow(&halfway_bf16, &h, DType::bf16, 1);
  BOOST_TEST(h == 0x3f80);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  narrow(&nan, &h, DType::bf16, 1);
  BOOST_TEST(h == 0x7fc0);
  const float halfway_f16 = 1.0f + 1.0f / 2048;  // between 1 and the next fp16: rounds to even (1)
  narrow(&halfway_f16, &h, DType::f16, 1);
  BOOST_TEST(h == 0x3c00);
  const float above = 1.0f + 3.0f / 2048;  // between 1+1/1024 and 1+2/1024: rounds to even (1+2/1024)
  narrow(&above, &h, DType::f16, 1);
  BOOST_TEST(h == 0x3c02);
  BOOST_TEST(widen_one(&h, DType::f16, 0) == 1.0f + 2.0f / 1024);
}

#ifdef NORMUON_TEST_HAVE_REFERENCE
// The reference over the caller's tensors (what normuon._C's backend='reference' runs) is the reference's
// flat step, bit for bit: every gradient dtype, parameters without gradients, blocks of rows, NaN/Inf.
// The mixed manifest with a matrix stored [in, out] (its statistics and kappa follow its columns) and an
// empty matrix (a step of it does nothing).
Manifest reference_manifest() {
  Manifest m = mixed_manifest();
  m.params.push_back(ParamSpec{"conv1d.weight", {24, 40}, DType::bf16, Role::matrix, "", std::nullopt, true});
  m.params.push_back(ParamSpec{"empty.weight", {0, 8}, DType::f32, Role::matrix, "", std::nullopt});
  return m;
}

BOOST_AUTO_TEST_CASE(the_reference_table_step_is_the_reference_flat_step_bit_for_bit) {
  for (DType g : {DType::f32, DType::bf16, DType::f16}) {
    Twins twins(g, reference_manifest(), Which::reference);
    BOOST_REQUIRE(twins.layout.entries[twins.layout.entries.size() - 2].transposed);
    BOOST_TEST(twins.table_backend->name() == "reference-cpu");
    for (int64_t s = 1; s <= 3; ++s) {
      BOOST_TEST(!twins.step(s).skipped);
      BOOST_TEST(twins.difference() == "", "gradients " << to_string(g) << ", step " << s);
    }
  }
  check_blocks_step_as_dense_matrices(kSmall, kEveryDTypePair, Which::reference);
  FusedTwins twins(DType::bf16, DType::f32, kSmall, Which::reference);
  const std::string message = nonfinite_message(twins, twins.first + 2, 7, std::numeric_limits<float>::infinity());
  BOOST_TEST(message.find("'qkv.v'") != std::string::npos, message);
  BOOST_TEST(twins.difference() == "");  // nothing changed on either side
}

// A gradient scaler's scale divides each gradient as it is read (a division, not a multiplication by the
// reciprocal: with 3 they differ): the table's scaled gradients step as the flat twin's g * 3 / 3. A scale
// that is not finite and > 0 is refused before anything changes.
BOOST_AUTO_TEST_CASE(the_reference_table_step_divides_by_the_gradient_scale) {
  Twins twins(DType::f32, mixed_manifest(), Which::reference);
  const float scale = 3.0f;
  for (int64_t s = 1; s <= 2; ++s) {
    twins.gen.fill_gradients(twins.flat, s);
    twins.caller.take_grads(twins.flat, false);
    for (size_t e = 0; e < twins.layout.entries.size(); ++e) {
      auto* g = reinterpret_cast<float*>(twins.caller.grads[e].data());
      float* flat = twins.flat.grad(static_cast<int>(e));
      for (int64_t k = 0; k < twins.layout.entries[e].numel; ++k) {
        g[k] *= scale;
        flat[k] = g[k] / scale;
      }
    }
    BOOST_TEST(!twins.flat_backend->step(twins.flat, twins.opts).skipped);
    BOOST_TEST(!twins.table_step(twins.caller.table, &scale).skipped);
    BOOST_TEST(twins.difference() == "", "step " << s);
  }
  const std::vector<std::vector<char>> before = twins.caller.params;
  for (const float bad : {0.0f, -1.0f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()})
    BOOST_CHECK_THROW(twins.table_step(twins.caller.table, &bad), std::invalid_argument);
  BOOST_TEST(twins.caller.params == before);
  BOOST_TEST((twins.table_state.group_steps == std::vector<int64_t>{2, 2}));
}
#endif
