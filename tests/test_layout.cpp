#define BOOST_TEST_MODULE layout
#include <boost/test/unit_test.hpp>

#include <cmath>

#include "normuon/flat_state.h"
#include "normuon/layout.h"
#include "normuon/presets.h"

using namespace normuon;

namespace {
ParamSpec param(const std::string& name, std::vector<int64_t> shape, Role role) {
  ParamSpec p;
  p.name = name;
  p.shape = std::move(shape);
  p.role = role;
  return p;
}

Manifest mixed_manifest() {
  Manifest m;
  m.params = {param("emb", {10, 4}, Role::embedding), param("a", {6, 3}, Role::matrix),
              param("bias", {5}, Role::bias),          param("b", {3, 6}, Role::matrix),
              param("c", {6, 3}, Role::matrix),        param("empty", {0, 3}, Role::matrix),
              param("scale", {}, Role::other)};
  return m;
}
}  // namespace

BOOST_AUTO_TEST_CASE(buckets_group_equal_shapes_in_first_appearance_order) {
  const Layout l = Layout::build(mixed_manifest(), Options());
  BOOST_TEST(l.buckets.size() == 3u);  // 6x3 (a, c), 3x6 (b), 0x3 (empty)
  BOOST_TEST(l.buckets[0].rows == 6);
  BOOST_TEST(l.buckets[0].cols == 3);
  BOOST_TEST((l.buckets[0].entries == std::vector<int>{1, 4}));
  BOOST_TEST((l.buckets[1].entries == std::vector<int>{3}));
  // Matrices of a bucket are contiguous with one aligned stride, so a batched GEMM can walk them.
  const auto& a = l.entries[1];
  const auto& c = l.entries[4];
  BOOST_TEST(c.offset - a.offset == l.buckets[0].stride);
  BOOST_TEST(l.buckets[0].stride == align_up(18));
  // AdamW parameters follow the matrices, in manifest order.
  BOOST_TEST((l.adamw_entries == std::vector<int>{0, 2, 6}));
  BOOST_TEST(l.entries[0].offset == l.normuon_floats);
  BOOST_TEST(l.entries[0].adam_offset == 0);
}

BOOST_AUTO_TEST_CASE(every_slot_is_aligned_and_disjoint) {
  for (const auto& preset : {"tiny", "gpt2-124m", "llama-1b"}) {
    const Layout l = Layout::build(preset_manifest(preset), Options());
    std::vector<std::pair<int64_t, int64_t>> spans;
    for (const auto& e : l.entries) {
      BOOST_TEST(e.offset % kAlignFloats == 0);
      BOOST_TEST(e.stat_offset % kAlignFloats == 0);
      spans.emplace_back(e.offset, e.offset + e.numel);
    }
    std::sort(spans.begin(), spans.end());
    for (size_t i = 1; i < spans.size(); ++i) BOOST_TEST(spans[i].first >= spans[i - 1].second);
    BOOST_TEST(spans.back().second <= l.param_floats);
  }
}

BOOST_AUTO_TEST_CASE(reduce_axis_decides_the_second_moment_length) {
  Options rows, longer;
  longer.set("normuon.reduce_axis=longer_dim");
  const Layout lr = Layout::build(mixed_manifest(), rows);
  const Layout ll = Layout::build(mixed_manifest(), longer);
  BOOST_TEST(lr.entries[3].stats_per_row);  // b is 3x6
  BOOST_TEST(lr.entries[3].stat_len == 3);
  BOOST_TEST(!ll.entries[3].stats_per_row);
  BOOST_TEST(ll.entries[3].stat_len == 6);
  BOOST_TEST(ll.entries[1].stat_len == 6);  // a is 6x3: rows are the longer side
  BOOST_TEST(lr.fingerprint != ll.fingerprint);
}

// A matrix stored [in, out] (GPT-2's Conv1D) has its statistics along its module's rows, the stored columns,
// and its shape factor from [out, in]; its fingerprint says so, as state files must not cross silently.
BOOST_AUTO_TEST_CASE(a_transposed_matrix_follows_its_module) {
  Manifest m = mixed_manifest();
  m.params[3].transposed = true;  // b: stored 3x6, the module's 6x3
  m.params[4].transposed = true;  // c: stored 6x3, the module's 3x6
  for (const char* axis : {"rows", "longer_dim"}) {
    BOOST_TEST_CONTEXT(axis) {
      Options o;
      o.set(std::string("normuon.reduce_axis=") + axis);
      const Layout l = Layout::build(m, o);
      const LayoutEntry& b = l.entries[3];
      const LayoutEntry& c = l.entries[4];
      BOOST_TEST(b.transposed);
      BOOST_TEST((b.rows == 3 && b.cols == 6));  // rows and cols stay the stored ones: the buffers hold it as is
      BOOST_TEST((module_shape(b) == std::make_pair<int64_t, int64_t>(6, 3)));
      BOOST_TEST(!b.stats_per_row);  // per neuron: the module's rows are b's columns (rows >= cols either way)
      BOOST_TEST(b.stat_len == 6);
      BOOST_TEST(c.stats_per_row == (std::string(axis) == "longer_dim"));  // module 3x6: per row, or its longer side
      BOOST_TEST(c.stat_len == (std::string(axis) == "longer_dim" ? 6 : 3));
      // kappa of the module's shape: b is 6x3 there (sqrt(max(1, 6/3))), c 3x6; stored as is, a 6x3.
      BOOST_TEST(entry_kappa(b, LrScale::official) == std::sqrt(2.0));
      BOOST_TEST(entry_kappa(c, LrScale::official) == 1.0);
      BOOST_TEST(entry_kappa(l.entries[1], LrScale::official) == std::sqrt(2.0));
      BOOST_TEST(entry_kappa(c, LrScale::spectral) == std::sqrt(0.5));
      BOOST_TEST(l.describe().find("transposed") != std::string::npos);
    }
  }
  // A square one: same lengths, another axis, so only the fingerprint tells the files apart.
  Manifest square;
  square.params = {param("w", {4, 4}, Role::matrix)};
  const Layout as_stored = Layout::build(square, Options());
  square.params[0].transposed = true;
  const Layout flipped = Layout::build(square, Options());
  BOOST_TEST(as_stored.entries[0].stats_per_row);
  BOOST_TEST(!flipped.entries[0].stats_per_row);
  BOOST_TEST(as_stored.fingerprint != flipped.fingerprint);
}

// docs/spec.md section 5: a 0-element matrix has 0-element state (a 0 x 3 matrix had a 3-float second
// moment, written to state files, before this was fixed).
BOOST_AUTO_TEST_CASE(an_empty_matrix_has_an_empty_second_moment) {
  for (const char* axis : {"rows", "longer_dim"}) {
    Options o;
    o.set(std::string("normuon.reduce_axis=") + axis);
    const Layout l = Layout::build(mixed_manifest(), o);
    const LayoutEntry& e = l.entries[static_cast<size_t>(l.find("empty"))];
    BOOST_TEST((e.algorithm == Algorithm::normuon));
    BOOST_TEST(e.numel == 0);
    BOOST_TEST(e.stat_len == 0, axis);
  }
}

// An expert bank [E, m, n] is laid out as its E experts, "name[k]": consecutive entries of one shape, so each
// of their buffers (momentum, second moment, masters) holds them a fixed stride apart, and a bank-shaped view of
// the state needs no copy (python/normuon/engine.py). The bank itself is refused, with what to do.
BOOST_AUTO_TEST_CASE(an_expert_bank_is_laid_out_as_its_experts_a_fixed_stride_apart) {
  Manifest m;
  m.params = {param("w", {5, 3}, Role::matrix)};  // same shape, before the bank: the bucket holds it first
  for (int k = 0; k < 4; ++k) m.params.push_back(param(expert_name("bank", k), {5, 3}, Role::experts));
  m.params.push_back(param("tail", {5, 3}, Role::matrix));
  for (auto& p : m.params) p.dtype = DType::bf16;
  const Layout l = Layout::build(m, Options());
  BOOST_TEST(expert_name("bank", 2) == "bank[2]");
  const LayoutEntry& first = l.entries[1];
  for (int k = 0; k < 4; ++k) {
    const LayoutEntry& e = l.entries[static_cast<size_t>(1 + k)];
    BOOST_TEST((e.algorithm == Algorithm::normuon));
    BOOST_TEST(e.offset == first.offset + k * align_up(15));
    BOOST_TEST(e.stat_offset == first.stat_offset + k * align_up(e.stat_len));
    BOOST_TEST(e.master_offset == first.master_offset + k * align_up(15));
  }
  Manifest bank;
  bank.params = {param("bank", {4, 5, 3}, Role::experts)};
  BOOST_TEST((route(bank.params[0]) == Algorithm::normuon));
  try {
    Layout::build(bank, Options());
    BOOST_FAIL("a bank laid out whole");
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    BOOST_TEST(what.find("'bank' is an expert bank") != std::string::npos, what);
    BOOST_TEST(what.find("bank[0]") != std::string::npos, what);
  }
}

BOOST_AUTO_TEST_CASE(fingerprint_is_stable_and_sensitive) {
  const Layout a = Layout::build(mixed_manifest(), Options());
  const Layout b = Layout::build(mixed_manifest(), Options());
  BOOST_TEST(a.fingerprint == b.fingerprint);
  BOOST_TEST(a.fingerprint_hex().size() == 16u);
  Manifest renamed = mixed_manifest();
  renamed.params[2].name = "bias2";
  BOOST_TEST(Layout::build(renamed, Options()).fingerprint != a.fingerprint);
  Manifest reshaped = mixed_manifest();
  reshaped.params[2].shape = {6};
  BOOST_TEST(Layout::build(reshaped, Options()).fingerprint != a.fingerprint);
  Manifest rerouted = mixed_manifest();
  rerouted.params[1].algorithm = Algorithm::adamw;
  BOOST_TEST(Layout::build(rerouted, Options()).fingerprint != a.fingerprint);
}

BOOST_AUTO_TEST_CASE(groups_must_exist_and_match_the_algorithm) {
  Manifest m = mixed_manifest();
  m.params[1].group = "missing";
  BOOST_CHECK_THROW(Layout::build(m, Options()), std::invalid_argument);
  m.params[1].group = "adamw";  // a NorMuon matrix in an AdamW group
  BOOST_CHECK_THROW(Layout::build(m, Options()), std::invalid_argument);
  Options o;
  GroupOptions slow;
  slow.name = "slow";
  slow.algorithm = Algorithm::normuon;
  slow.normuon.lr = 0.001;
  o.groups.push_back(slow);
  m.params[1].group = "slow";
  const Layout l = Layout::build(m, o);
  BOOST_TEST(l.group_names[l.entries[1].group] == "slow");
}

BOOST_AUTO_TEST_CASE(flat_state_is_zeroed_and_aligned) {
  const Layout l = Layout::build(preset_manifest("tiny"), Options());
  FlatState s(l);
  BOOST_TEST(reinterpret_cast<uintptr_t>(s.params.data()) % 64 == 0u);
  BOOST_TEST(reinterpret_cast<uintptr_t>(s.exp_avg_sq.data()) % 64 == 0u);
  BOOST_TEST(s.params.size() == l.param_floats);
  BOOST_TEST(s.momentum.size() == l.normuon_floats);
  BOOST_TEST(s.exp_avg.size() == l.adam_floats);
  for (int64_t i = 0; i < s.row_var.size(); ++i) BOOST_REQUIRE(s.row_var[i] == 0.0f);
  BOOST_TEST(s.group_steps.size() == 2u);
  FlatState copy = s;
  BOOST_TEST(copy.same_optimizer_state(s));
  copy.exp_avg[0] = 1.0f;
  BOOST_TEST(!copy.same_optimizer_state(s));
}

BOOST_AUTO_TEST_CASE(nonfinite_gradients_are_found_only_where_a_gradient_is_present) {
  const Layout l = Layout::build(mixed_manifest(), Options());
  FlatState s(l);
  BOOST_TEST(find_nonfinite_gradient(s) == -1);
  s.grad(3)[4] = std::numeric_limits<float>::infinity();
  int64_t element = -1;
  BOOST_TEST(find_nonfinite_gradient(s, &element) == 3);
  BOOST_TEST(element == 4);
  s.has_grad[3] = 0;
  BOOST_TEST(find_nonfinite_gradient(s) == -1);
}

// A parameter of 2^62 elements made the byte count wrap (SIGSEGV): sizes are bounded, with the parameter
// named, before any offset is computed.
BOOST_AUTO_TEST_CASE(oversized_parameters_are_refused_by_name) {
  const auto refused = [](const Manifest& m, const std::vector<std::string>& words) {
    try {
      Layout::build(m, Options());
      BOOST_ERROR("built a layout that is too large");
    } catch (const std::invalid_argument& e) {
      for (const auto& w : words)
        BOOST_TEST(std::string(e.what()).find(w) != std::string::npos, e.what() << " lacks " << w);
    }
  };
  Manifest m;
  m.params = {param("small", {4}, Role::bias), param("huge", {int64_t{1} << 62}, Role::bias)};
  refused(m, {"\"huge\"", "too large", "2^40"});
  m.params[1] = param("huge", {int64_t{1} << 31, int64_t{1} << 31, 4}, Role::other);  // the product wraps int64
  refused(m, {"\"huge\"", "too large"});
  m.params[1] = param("huge", {int64_t{1} << 21, int64_t{1} << 20}, Role::matrix);  // 2^41: NorMuon
  refused(m, {"\"huge\"", "too large"});
  m.params[1] = param("huge", {0, int64_t{1} << 62, int64_t{1} << 62}, Role::other);  // empty: fine
  BOOST_TEST(Layout::build(m, Options()).entries[1].numel == 0);

  // Each parameter within the limit, their sum beyond it: the one that crosses it is named.
  Manifest sum;
  sum.params = {param("first", {int64_t{1} << 20, int64_t{1} << 20}, Role::matrix),
                param("second", {int64_t{1} << 20, int64_t{1} << 20}, Role::matrix)};
  refused(sum, {"'second'", "parameter buffer", "2^40"});
  sum.params[1].role = Role::embedding;  // the AdamW part
  refused(sum, {"'second'", "2^40"});
  sum.params.pop_back();
  BOOST_TEST(Layout::build(sum, Options()).param_floats == int64_t{1} << 40);  // exactly the limit is allowed
}

// One of 10^12 elements (4 TB per buffer) was a bare std::bad_alloc: say how much and for what.
BOOST_AUTO_TEST_CASE(state_too_large_for_the_machine_says_so) {
  Manifest m;
  m.params = {param("emb", {1000000, 1000000}, Role::embedding), param("b", {4}, Role::bias)};
  const Layout l = Layout::build(m, Options());
  try {
    FlatState state(l);
    BOOST_TEST_MESSAGE("this machine holds 20 TB: nothing to check");
  } catch (const OutOfMemoryError& e) {
    const std::string message = e.what();
    BOOST_TEST_MESSAGE(message);
    BOOST_TEST(message.find("'emb'") != std::string::npos, message);
    BOOST_TEST(message.find("1000000000000 elements") != std::string::npos, message);
    BOOST_TEST(message.find("memory") != std::string::npos, message);
  }
  BOOST_CHECK_THROW(AlignedBuffer(kMaxLayoutFloats + 1), std::bad_alloc);
  BOOST_CHECK_THROW(AlignedBuffer(-1), std::bad_alloc);
}
