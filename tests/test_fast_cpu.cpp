// The fused CPU backend on its own: exact agreement where the design promises it, determinism, the
// edge cases of the spec, no allocation of its own in a step, and a version-1 state file resumed as the
// old code ran it.
#define BOOST_TEST_MODULE fast_cpu
#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <omp.h>
#include <sched.h>

#include "fast_cpu_backend.h"
#include "newton_schulz.h"
#include "thread_budget.h"
#include "work_pool.h"
#include "normuon/grad_gen.h"
#include "normuon/manifest.h"
#include "normuon/param_table.h"
#include "normuon/presets.h"
#include "normuon/state_file.h"

// Every malloc of the process is counted (operator new goes through malloc too).
static std::atomic<long> g_mallocs{0};
extern "C" {
void* __libc_malloc(size_t);
void* __libc_calloc(size_t, size_t);
void* __libc_realloc(void*, size_t);
void* __libc_memalign(size_t, size_t);
void* malloc(size_t n) {
  g_mallocs.fetch_add(1, std::memory_order_relaxed);
  return __libc_malloc(n);
}
void* calloc(size_t n, size_t s) {
  g_mallocs.fetch_add(1, std::memory_order_relaxed);
  return __libc_calloc(n, s);
}
void* realloc(void* p, size_t n) {
  g_mallocs.fetch_add(1, std::memory_order_relaxed);
  return __libc_realloc(p, n);
}
void* aligned_alloc(size_t a, size_t n) {
  g_mallocs.fetch_add(1, std::memory_order_relaxed);
  return __libc_memalign(a, n);
}
int posix_memalign(void** out, size_t a, size_t n) {
  g_mallocs.fetch_add(1, std::memory_order_relaxed);
  *out = __libc_memalign(a, n);
  return *out ? 0 : 12;
}
}

using namespace normuon;

namespace {

bool same_bits(const float* a, const float* b, int64_t n) { return std::memcmp(a, b, sizeof(float) * n) == 0; }

struct Run {
  Layout layout;
  FlatState state;
  FastCpuBackend backend;
  GradientGenerator gen;
  Options options;
  Run(const Manifest& m, const Options& o, int threads = 0, GradientGenerator g = {1234, 7})
      : layout(Layout::build(m, o)), state(layout), backend(layout, o, threads), gen(g), options(o) {
    gen.fill_params(state);
  }
  void steps(int64_t first, int64_t last) {
    for (int64_t s = first; s <= last; ++s) {
      gen.fill_gradients(state, s);
      backend.step(state, options);
    }
  }
};

Options with(const std::string& assignment) {
  Options o;
  o.set("weight_decay=0.1");
  if (!assignment.empty()) o.set(assignment);
  return o;
}

// What one oneDNN execute() allocates inside the library, measured on a batch of our own run as a step
// runs its products: a matrix per pool item, on one thread (oneDNN's allocations follow its thread count:
// below AVX-512 a product on two threads allocates more).
long onednn_allocations_per_gemm() {
  fast::WorkPool pool(1);
  fast::BatchedNewtonSchulz ns({{8, 16, 2}}, pool, fast::NsSplit::per_matrix);
  std::vector<float> buf(2 * 8 * 16, 0.5f);
  const float* in[2] = {buf.data(), buf.data() + 128};
  float* out[2] = {buf.data(), buf.data() + 128};
  NorMuonHyper h;
  ns.run(0, in, out, h);
  const long before_probe = g_mallocs.load();
  const int64_t probe_calls_before = ns.gemm_calls();
  ns.run(0, in, out, h);
  return (g_mallocs.load() - before_probe) / (ns.gemm_calls() - probe_calls_before);
}

// The allocations of one step of `run` beyond oneDNN's own (per_gemm per GEMM call).
long allocations_of_its_own(Run& run, int64_t step, long per_gemm) {
  run.gen.fill_gradients(run.state, step);
  const long before = g_mallocs.load();
  run.backend.step(run.state, run.options);
  return g_mallocs.load() - before - run.backend.counters().gemm_calls * per_gemm;
}

}  // namespace

BOOST_AUTO_TEST_CASE(two_runs_are_bitwise_identical) {
  for (const std::string knob : {"", "normuon.ns_precision=fp32", "normuon.reduce_axis=longer_dim"}) {
    Run a(preset_manifest("tiny"), with(knob)), b(preset_manifest("tiny"), with(knob));
    a.steps(1, 4);
    b.steps(1, 4);
    BOOST_TEST(same_bits(a.state.params.data(), b.state.params.data(), a.layout.param_floats), knob);
    BOOST_TEST(a.state.same_optimizer_state(b.state), knob);
  }
}

BOOST_AUTO_TEST_CASE(a_step_does_not_depend_on_the_thread_count) {
  // Every item of a pass (a chunk, a matrix) computes the same whichever thread runs it, and tiny's
  // batches (4 matrices) are shared out a matrix per thread for up to 4 threads: bit for bit the same.
  Run one(preset_manifest("tiny"), with(""), 1);
  one.steps(1, 3);
  for (int threads : {2, 3, 4}) {
    Run many(preset_manifest("tiny"), with(""), threads);
    many.steps(1, 3);
    BOOST_TEST(same_bits(many.state.params.data(), one.state.params.data(), one.layout.param_floats), threads);
    BOOST_TEST(many.state.same_optimizer_state(one.state), threads);
  }
}

BOOST_AUTO_TEST_CASE(no_allocation_of_its_own_in_a_step) {
  Run run(preset_manifest("tiny"), with(""));
  run.steps(1, 2);  // the first steps may warm up OpenMP and oneDNN
  const long per_gemm = onednn_allocations_per_gemm();
  BOOST_TEST_MESSAGE("oneDNN allocates " << per_gemm << " blocks per execute()");

  for (int64_t s = 3; s <= 5; ++s) {
    run.gen.fill_gradients(run.state, s);
    const long before = g_mallocs.load();
    run.backend.step(run.state, run.options);
    const long allocations = g_mallocs.load() - before;
    const int64_t gemms = run.backend.counters().gemm_calls;
    // 4 batches of 4 matrices x 5 iterations x 3 products: a matmul per matrix where the batch has as many
    // matrices as there are threads, else one per batch (newton_schulz.h). Per matrix, X X^T and (cA) A
    // are a matmul per 64-column panel of their lower triangle (tiny's matrices are 256 wide: 4 each).
    const bool per_matrix = run.backend.threads() <= 4;
    const int64_t per_batch = per_matrix ? 4 : 1, per_iteration = per_matrix ? 4 + 4 + 1 : 3;
    BOOST_TEST(gemms == 4 * per_batch * 5 * per_iteration);
    BOOST_TEST(allocations == gemms * per_gemm, "step " << s << ": " << allocations << " allocations, of which "
                                                        << allocations - gemms * per_gemm << " outside oneDNN");
  }
}

BOOST_AUTO_TEST_CASE(gram_buffers_are_made_only_when_asked_for) {
  Options gram_options = with("ns_algorithm=gram");
  Run later(preset_manifest("tiny"), with("")), built(preset_manifest("tiny"), gram_options);
  const int64_t standard_bytes = later.backend.workspace_bytes(), gram_bytes = built.backend.workspace_bytes();
  // tiny's matrices are 64 x 256 (or its transpose) at most: Z, Q and RZ are 64 x 64 fp32 per thread.
  BOOST_TEST(gram_bytes - standard_bytes >= 3 * 64 * 64 * 4 * later.backend.threads());
  // Both step the standard iteration, then Gram: the backend built without it makes its buffers at the
  // step that first asks, and gives what the one built with them gives.
  later.options = built.options = with("");
  later.steps(1, 2);
  built.steps(1, 2);
  BOOST_TEST(later.backend.workspace_bytes() == standard_bytes);
  later.options = built.options = gram_options;
  later.steps(3, 4);
  built.steps(3, 4);
  BOOST_TEST(later.backend.workspace_bytes() == gram_bytes);
  BOOST_TEST(same_bits(later.state.params.data(), built.state.params.data(), later.layout.param_floats));
  BOOST_TEST(later.state.same_optimizer_state(built.state));
  // Made once: the Gram steps after it allocate nothing of their own, on either backend.
  const long per_gemm = onednn_allocations_per_gemm();
  BOOST_TEST(allocations_of_its_own(later, 5, per_gemm) == 0);
  BOOST_TEST(allocations_of_its_own(built, 5, per_gemm) == 0);

  // Built without Gram, a Newton-Schulz asked for it says so; a square batch never runs it.
  std::vector<float> buf(8 * 16, 0.5f);
  const float* in[1] = {buf.data()};
  float* out[1] = {buf.data()};
  NorMuonHyper h;
  h.ns_algorithm = NsAlgorithm::gram;
  fast::BatchedNewtonSchulz wide({{8, 16, 1}}, false), square({{8, 8, 1}}, false);
  BOOST_CHECK_THROW(wide.run(0, in, out, h), std::logic_error);
  BOOST_CHECK_NO_THROW(square.run(0, in, out, h));
}

BOOST_AUTO_TEST_CASE(nonfinite_gradients_change_nothing) {
  Run run(preset_manifest("tiny"), with(""));
  run.steps(1, 1);
  run.gen.fill_gradients(run.state, 2);
  const int e = run.layout.find("transformer.h.1.attn.c_proj.weight");
  run.state.grad(e)[5] = std::numeric_limits<float>::infinity();
  const FlatState before = run.state;
  BOOST_CHECK_EXCEPTION(run.backend.step(run.state, run.options), std::runtime_error, [](const std::runtime_error& x) {
    return std::string(x.what()).find("transformer.h.1.attn.c_proj.weight") != std::string::npos;
  });
  BOOST_TEST(run.state.same_optimizer_state(before));
  BOOST_TEST(same_bits(run.state.params.data(), before.params.data(), run.layout.param_floats));
  Options skip = run.options;
  skip.set("nonfinite=skip_step");
  BOOST_TEST(run.backend.step(run.state, skip).skipped);
  BOOST_TEST(run.state.same_optimizer_state(before));
}

BOOST_AUTO_TEST_CASE(the_first_nonfinite_gradient_in_layout_order_is_named) {
  // The parallel scan meets NaN/Inf in any order (NorMuon chunks first); the message names the first in
  // the layout's order, element included, as the reference's prologue does.
  Run run(preset_manifest("tiny"), with(""), 2);
  run.gen.fill_gradients(run.state, 1);
  int adamw_entry = -1, normuon_entry = -1;
  for (int e = 0; e < static_cast<int>(run.layout.entries.size()); ++e) {
    const bool adamw = run.layout.entries[e].algorithm == Algorithm::adamw;
    if (adamw && adamw_entry < 0) adamw_entry = e;
    if (!adamw && normuon_entry < 0) normuon_entry = e;
  }
  BOOST_REQUIRE(adamw_entry >= 0 && normuon_entry >= 0);
  const int64_t last = run.layout.entries[adamw_entry].numel - 1;  // in its last chunk
  run.state.grad(adamw_entry)[last] = std::numeric_limits<float>::quiet_NaN();
  run.state.grad(normuon_entry)[3] = -std::numeric_limits<float>::infinity();
  const int first = std::min(adamw_entry, normuon_entry);
  const std::string where = first == adamw_entry ? "nan at element " + std::to_string(last) : "-inf at element 3";
  const std::string want = "gradient of '" + run.layout.entries[first].name + "' holds " + where;
  const FlatState before = run.state;
  BOOST_CHECK_EXCEPTION(run.backend.step(run.state, run.options), std::runtime_error, [&](const std::runtime_error& x) {
    BOOST_TEST_MESSAGE(x.what());
    return std::string(x.what()).find(want) != std::string::npos;
  });
  BOOST_TEST(run.state.same_optimizer_state(before));
  // Only the AdamW one left: found too, though no NorMuon chunk has one.
  run.state.grad(normuon_entry)[3] = 0.0f;
  BOOST_CHECK_THROW(run.backend.step(run.state, run.options), std::runtime_error);
  BOOST_TEST(run.state.same_optimizer_state(before));
}

BOOST_AUTO_TEST_CASE(a_gradient_scale_belongs_to_its_step_only) {
  // A table-mode step with a GradScaler scale left the pointer bound: a later FlatState step divided by
  // it (freed memory, in Python) and left out the NaN scan, so a NaN gradient went into the state.
  Run run(preset_manifest("tiny"), with(""));
  TableState table_state(run.layout);
  ParamTable table(run.layout);
  std::vector<std::vector<float>> params(run.layout.entries.size()), grads(run.layout.entries.size());
  run.gen.fill_gradients(run.state, 1);
  for (size_t e = 0; e < run.layout.entries.size(); ++e) {
    const int i = static_cast<int>(e);
    params[e].assign(run.state.param(i), run.state.param(i) + run.layout.entries[e].numel);
    grads[e].assign(run.state.grad(i), run.state.grad(i) + run.layout.entries[e].numel);
    table.params[e].data = params[e].data();
    table.grads[e].data = grads[e].data();
  }
  const float scale = 1024.0f;
  BOOST_TEST(!run.backend.step(table_state, table, run.options, &scale).skipped);
  run.gen.fill_gradients(run.state, 2);
  run.state.grad(0)[3] = std::numeric_limits<float>::quiet_NaN();
  const FlatState before = run.state;
  BOOST_CHECK_THROW(run.backend.step(run.state, run.options), std::runtime_error);
  BOOST_TEST(run.state.same_optimizer_state(before));
}

BOOST_AUTO_TEST_CASE(odd_shapes_missing_gradients_and_groups) {
  // 1 x n, n x 1, prime sizes, more rows than columns, a 0-element matrix, two groups sharing a shape
  // with different Newton-Schulz precision, and a parameter that never has a gradient.
  Manifest m;
  auto add = [&m](const std::string& name, std::vector<int64_t> shape, const std::string& group = "") {
    ParamSpec p;
    p.name = name;
    p.shape = std::move(shape);
    p.role = p.shape.size() == 2 ? Role::matrix : Role::bias;
    p.group = group;
    m.params.push_back(p);
  };
  add("row", {1, 37});
  add("col", {37, 1});
  add("prime", {13, 29});
  add("tall", {29, 13});
  add("empty", {0, 8});
  add("a", {16, 24});
  add("b", {16, 24}, "fp32");
  add("idle", {16, 24});
  add("bias", {24});
  Options o = with("");
  GroupOptions fp32;
  fp32.name = "fp32";
  fp32.normuon.ns_precision = NsPrecision::fp32;
  o.groups.push_back(fp32);
  Run run(m, o, 0, GradientGenerator{1234, 0});  // every parameter has a gradient, except idle
  const int idle = run.layout.find("idle");
  const FlatState initial = run.state;
  for (int64_t s = 1; s <= 3; ++s) {
    run.gen.fill_gradients(run.state, s);
    run.state.has_grad[idle] = 0;
    run.backend.step(run.state, run.options);
  }
  for (int64_t k = 0; k < run.layout.param_floats; ++k) BOOST_REQUIRE(std::isfinite(run.state.params[k]));
  BOOST_TEST(same_bits(run.state.param(idle), initial.param(idle), 16 * 24));
  BOOST_TEST(!same_bits(run.state.param(run.layout.find("b")), initial.param(run.layout.find("b")), 16 * 24));
  BOOST_TEST((run.state.group_steps == std::vector<int64_t>{3, 3, 3}));
  BOOST_TEST(run.backend.describe().find("group fp32") != std::string::npos);
}

BOOST_AUTO_TEST_CASE(thread_count_is_the_backends_own) {
  // A host (libtorch does) may lower the process-wide OpenMP count; the backend uses its own for the
  // step and gives the host's back.
  omp_set_num_threads(1);
  Run two(preset_manifest("tiny"), with(""), 2);
  BOOST_TEST(two.backend.threads() == 2);
  two.steps(1, 1);
  BOOST_TEST(omp_get_max_threads() == 1);
  omp_set_num_threads(omp_get_num_procs());
}

BOOST_AUTO_TEST_CASE(the_default_thread_count_respects_affinity_and_cgroup_quotas) {
  // It was one thread per processor of the machine, ignoring taskset and a container's --cpus: on a
  // shared 2-vCPU machine OpenMP's spinning threads then made a small step 47x slower.
  BOOST_TEST(fast::quota_threads_v2("max 100000\n") == 0);
  BOOST_TEST(fast::quota_threads_v2("150000 100000\n") == 2);
  BOOST_TEST(fast::quota_threads_v2("100000 100000") == 1);
  BOOST_TEST(fast::quota_threads_v2("50000 100000") == 1);  // half a CPU still gets one thread
  BOOST_TEST(fast::quota_threads_v2("garbage") == 0);
  BOOST_TEST(fast::quota_threads_v1(-1, 100000) == 0);
  BOOST_TEST(fast::quota_threads_v1(400000, 100000) == 4);
  cpu_set_t set;
  CPU_ZERO(&set);
  BOOST_REQUIRE(sched_getaffinity(0, sizeof set, &set) == 0);
  const int allowed = CPU_COUNT(&set);
  BOOST_TEST(fast::default_threads() >= 1);
  BOOST_TEST(fast::default_threads() <= allowed);
  // Pinned to one processor (as taskset -c 0 would), the default follows.
  cpu_set_t one;
  CPU_ZERO(&one);
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
    if (CPU_ISSET(cpu, &set)) {
      CPU_SET(cpu, &one);
      break;
    }
  BOOST_REQUIRE(sched_setaffinity(0, sizeof one, &one) == 0);
  const int pinned = fast::default_threads();
  sched_setaffinity(0, sizeof set, &set);
  BOOST_TEST(pinned == 1);
}

// Files the version-1 code wrote (tests/data/state-v1/README.md): its fast CPU backend after steps 4, 6 and
// 7 of one run in which parameters miss gradients. Resumed from step 4 by this code, steps 5 and 6 are
// the old run's bit for bit: the file gives every parameter its group's counter, which is what the old
// code used, and until a parameter misses a gradient after the resume the two counts move together. Step
// 7 differs where it should: wte.weight and lm_head.weight missed step 6 (count 6, group counter 7).
BOOST_AUTO_TEST_CASE(a_version_1_state_resumes_as_the_old_code_ran_it) {
  const std::string dir = std::string(NORMUON_SOURCE_DIR) + "/tests/data/state-v1/";
  const Options options;
  const Layout layout = Layout::build(Manifest::read_csv_file(dir + "small.csv"), options);
  const GradientGenerator gen{1234, 3};
  auto load = [&](int step) {
    FlatState s(layout);
    load_state(dir + "small-v1-step" + std::to_string(step) + ".safetensors", s);
    return s;
  };
  auto same_tensors = [&](const FlatState& a, const FlatState& b, const std::string& name) {
    const int e = layout.find(name);
    const LayoutEntry& le = layout.entries[static_cast<size_t>(e)];
    bool same = same_bits(a.param(e), b.param(e), le.numel);
    if (le.algorithm == Algorithm::adamw)
      same = same && same_bits(a.exp_avg.data() + le.adam_offset, b.exp_avg.data() + le.adam_offset, le.numel) &&
             same_bits(a.exp_avg_sq.data() + le.adam_offset, b.exp_avg_sq.data() + le.adam_offset, le.numel);
    else
      same = same && same_bits(a.momentum.data() + le.offset, b.momentum.data() + le.offset, le.numel) &&
             same_bits(a.row_var.data() + le.stat_offset, b.row_var.data() + le.stat_offset, le.stat_len);
    return same;
  };
  FlatState state = load(4);
  BOOST_TEST((state.entry_steps == std::vector<int64_t>{4, 3, 4, 4}));  // wte attn ln lm_head: the group counters
  FastCpuBackend backend(layout, options, 1);  // as the files were made
  for (int64_t step = 5; step <= 7; ++step) {
    gen.fill_gradients(state, step);
    BOOST_REQUIRE(!backend.step(state, options).skipped);
    if (step == 5) continue;  // no file of step 5
    const FlatState old = load(static_cast<int>(step));
    BOOST_TEST(state.group_steps == old.group_steps, "step " << step);
    for (const std::string name : {"wte.weight", "h.0.attn.weight", "h.0.ln.weight", "lm_head.weight"}) {
      const bool differs_on_purpose = step == 7 && (name == "wte.weight" || name == "lm_head.weight");
      BOOST_TEST(same_tensors(state, old, name) == !differs_on_purpose, name << " after step " << step);
    }
    if (step == 6) BOOST_TEST((state.entry_steps == std::vector<int64_t>{5, 4, 6, 5}));
  }
  BOOST_TEST((state.entry_steps == std::vector<int64_t>{6, 5, 6, 6}));
}
