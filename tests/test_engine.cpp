// The engine (core/include/normuon/engine.h): typed hyper-parameters checked once, in the core, all or
// nothing; the fields the layout was built from kept; a step over the bound table that is the backend's
// table step bit for bit, with its counters; found_inf skipping the step; masters refreshed from outside
// writes unless the parameter still holds the master rounded; the memory it holds, by kind.
#define BOOST_TEST_MODULE engine
#include <boost/test/unit_test.hpp>

#include <cstring>
#include <limits>
#include <stdexcept>
#include <memory>
#include <string>
#include <vector>

#include "fast_cpu_backend.h"
#include "normuon/engine.h"
#include "normuon/grad_gen.h"
#include "normuon/low_precision.h"
#include "normuon/presets.h"

using namespace normuon;

namespace {

bool message_contains(const std::exception& e, const std::string& what) {
  return std::string(e.what()).find(what) != std::string::npos;
}

Engine::BackendFactory fast_cpu(int threads = 1) {
  return [threads](const Layout& l, const Options& o) { return std::make_unique<FastCpuBackend>(l, o, threads); };
}

// The caller's tensors for an engine's layout: fp32 or bf16 parameters, fp32 gradients, bound into the
// engine's table.
struct Tensors {
  std::vector<std::vector<char>> params;
  std::vector<std::vector<float>> grads;

  explicit Tensors(Engine& engine) {
    const Layout& l = engine.layout();
    params.resize(l.entries.size());
    grads.resize(l.entries.size());
    for (size_t e = 0; e < l.entries.size(); ++e) {
      const LayoutEntry& le = l.entries[e];
      params[e].assign(static_cast<size_t>(le.numel) * dtype_bytes(le.dtype), 0);
      grads[e].assign(static_cast<size_t>(le.numel), 0.f);
      for (int64_t i = 0; i < le.numel; ++i) {
        const float v = 0.01f * static_cast<float>((i * 7 + static_cast<int64_t>(e)) % 23) - 0.1f;
        narrow(&v, params[e].data() + i * static_cast<int64_t>(dtype_bytes(le.dtype)), le.dtype, 1);
      }
      engine.table().params[e].data = params[e].data();
      engine.table().grads[e] = TensorRef{grads[e].data(), DType::f32, {}};
      engine.refresh_master(static_cast<int>(e));
    }
  }
  void fill_grads(int step) {
    for (size_t e = 0; e < grads.size(); ++e)
      for (size_t i = 0; i < grads[e].size(); ++i)
        grads[e][i] = 0.001f * static_cast<float>(static_cast<int64_t>((i * 13 + e * 5 + static_cast<size_t>(step) * 11) % 31) - 15);
  }
};

Manifest tiny(DType dtype = DType::f32) {
  Manifest m = preset_manifest("tiny");
  for (auto& p : m.params) p.dtype = dtype;
  return m;
}

}  // namespace

BOOST_AUTO_TEST_CASE(typed_values_are_checked_in_the_core_all_or_nothing) {
  Engine engine(tiny(), Options(), fast_cpu());
  engine.set_group(0, {{"lr", 0.5}, {"nesterov", false}, {"ns_steps", 3.0}, {"lr_scale", std::string("spectral")}});
  BOOST_TEST(engine.options().groups[0].normuon.lr == 0.5);
  BOOST_TEST(!engine.options().groups[0].normuon.nesterov);
  BOOST_TEST(engine.options().groups[0].normuon.ns_steps == 3);
  BOOST_TEST(std::get<std::string>(engine.options().get(0, "lr_scale")) == "spectral");
  // A bad value anywhere in the list: nothing of it is applied.
  BOOST_CHECK_EXCEPTION(engine.set_group(0, {{"lr", 0.1}, {"beta1", 1.0}}), std::invalid_argument, [](const auto& e) {
    return message_contains(e, "option 'normuon.beta1': 1 is outside [0, 1)");
  });
  BOOST_TEST(engine.options().groups[0].normuon.lr == 0.5);
  const std::vector<std::pair<std::string, FieldValue>> bad[] = {
      {{"ns_steps", 2.5}}, {{"lr", std::string("fast")}}, {{"nesterov", 2.0}}, {{"ns_precision", std::string("fp8")}},
      {{"eps", 1e-8}} /* an AdamW field */, {{"lr", -1.0}}};
  const char* says[] = {"not an integer in [1, 100]", "is not a number", "not a boolean", "(choose fp32 | bf16)",
                        "has no field 'eps'", "outside [0, 1e+06]"};
  for (size_t i = 0; i < std::size(bad); ++i)
    BOOST_CHECK_EXCEPTION(engine.set_group(0, bad[i]), std::invalid_argument,
                          [&](const auto& e) { return message_contains(e, says[i]); });
  // Values that cannot run together: refused as a whole.
  BOOST_CHECK_EXCEPTION(engine.set_group(0, {{"ns_coefficients", std::string("polar_express")}, {"ns_steps", 6.0}}),
                        std::invalid_argument, [](const auto& e) { return message_contains(e, "Polar Express has 5"); });
  BOOST_TEST(engine.options().groups[0].normuon.ns_steps == 3);
  engine.set_group(1, {{"eps", 1e-8}, {"beta2", 0.999}});
  BOOST_TEST(engine.options().groups[1].adamw.eps == 1e-8);
  BOOST_CHECK_THROW(engine.set_group(2, {{"lr", 0.1}}), std::invalid_argument);
}

BOOST_AUTO_TEST_CASE(the_fields_the_layout_was_built_from_are_kept) {
  Engine engine(tiny(), Options(), fast_cpu());
  BOOST_TEST(engine.fixed_fields() == std::vector<std::string>{"reduce_axis"});
  engine.set_group(0, {{"reduce_axis", std::string("rows")}, {"lr", 0.3}});  // the same value: fine
  BOOST_CHECK_EXCEPTION(engine.set_group(0, {{"lr", 0.4}, {"reduce_axis", std::string("longer_dim")}}),
                        std::invalid_argument, [](const auto& e) {
                          return message_contains(e, "normuon.reduce_axis") && message_contains(e, "layout") &&
                                 message_contains(e, "'longer_dim'");
                        });
  BOOST_TEST(engine.options().groups[0].normuon.lr == 0.3);
}

BOOST_AUTO_TEST_CASE(a_step_is_the_backends_table_step_with_its_counters) {
  Options options;
  options.set("weight_decay=0.1");
  Engine engine(tiny(), options, fast_cpu());
  Tensors mine(engine);
  // The same step through the backend directly, on its own copy of the tensors.
  const Layout& layout = engine.layout();
  FastCpuBackend backend(layout, options, 1);
  TableState state(layout);
  ParamTable table(layout);
  Tensors theirs = mine;
  for (size_t e = 0; e < layout.entries.size(); ++e) {
    table.params[e].data = theirs.params[e].data();
    table.grads[e] = TensorRef{theirs.grads[e].data(), DType::f32, {}};
  }
  for (size_t e = 0; e < layout.entries.size(); ++e) {  // the engine's table points at `mine`
    engine.table().params[e].data = mine.params[e].data();
    engine.table().grads[e].data = mine.grads[e].data();
  }
  for (int step = 1; step <= 3; ++step) {
    mine.fill_grads(step);
    theirs.fill_grads(step);
    if (step == 2) engine.table().grads[0].data = table.grads[0].data = nullptr;  // no gradient for one entry
    BOOST_TEST(!engine.step().skipped);
    BOOST_TEST(!backend.step(state, table, options).skipped);
    engine.table().grads[0].data = mine.grads[0].data();
    table.grads[0].data = theirs.grads[0].data();
  }
  BOOST_TEST(mine.params == theirs.params);
  BOOST_TEST(engine.group_steps() == state.group_steps);
  BOOST_TEST(engine.entry_steps() == state.entry_steps);
  BOOST_TEST(engine.group_steps() == (std::vector<int64_t>{3, 3}));
  BOOST_TEST(engine.entry_steps()[0] == 2);
  BOOST_TEST(std::memcmp(engine.state().momentum.data(), state.momentum.data(), 4 * state.momentum.size()) == 0);

  // The scaler's found_inf: nothing changes, counters included.
  const auto before = mine.params;
  const float found = 1.f, none = 0.f;
  mine.fill_grads(9);
  const StepResult r = engine.step(nullptr, &found);
  BOOST_TEST(r.skipped);
  BOOST_TEST(r.reason == kFoundInfReason);
  BOOST_TEST(mine.params == before);
  BOOST_TEST(engine.group_steps() == (std::vector<int64_t>{3, 3}));
  BOOST_TEST(!engine.step(nullptr, &none).skipped);
  BOOST_TEST(engine.group_steps() == (std::vector<int64_t>{4, 4}));
}

BOOST_AUTO_TEST_CASE(set_steps_is_checked_before_anything_is_written) {
  Engine engine(tiny(), Options(), fast_cpu());
  size_t e = 0;
  while (engine.layout().entries[e].group != 0) ++e;  // a parameter of group 0
  engine.set_steps({5, 7});
  BOOST_TEST(engine.entry_steps()[e] == 5);  // each at its group's counter
  std::vector<int64_t> entries = engine.entry_steps();
  entries[e] = 6;  // above its group's 5
  BOOST_CHECK_THROW(engine.set_steps({5, 7}, entries), std::invalid_argument);
  BOOST_CHECK_THROW(engine.set_steps({5}), std::invalid_argument);
  BOOST_CHECK_THROW(engine.set_steps({-1, 0}), std::invalid_argument);
  BOOST_TEST(engine.group_steps() == (std::vector<int64_t>{5, 7}));
  entries[e] = 2;
  engine.set_steps({5, 7}, entries);
  BOOST_TEST(engine.entry_steps()[e] == 2);
}

BOOST_AUTO_TEST_CASE(masters_follow_outside_writes_unless_they_are_the_masters_rounded) {
  Engine engine(tiny(DType::bf16), Options(), fast_cpu());
  Tensors t(engine);
  const LayoutEntry& le = engine.layout().entries[0];
  float* master = engine.state().master(0);
  BOOST_TEST(master[1] == widen_one(t.params[0].data(), DType::bf16, 1));
  // Low bits below bf16's: the parameter holds the master rounded, so the master keeps them.
  master[1] += master[1] * 1e-4f;
  const float kept = master[1];
  narrow(&master[1], t.params[0].data() + 2, DType::bf16, 1);
  engine.refresh_master(0);
  BOOST_TEST(master[1] == kept);
  // A real outside write: the master is read from the parameter.
  const float v = 0.75f;
  narrow(&v, t.params[0].data() + 2, DType::bf16, 1);
  engine.refresh_master(0);
  BOOST_TEST(master[1] == 0.75f);
  BOOST_TEST(le.master_offset >= 0);
}

BOOST_AUTO_TEST_CASE(the_memory_report_names_every_byte_by_kind) {
  Engine f32(tiny(), Options(), fast_cpu());
  const Layout& l = f32.layout();
  const MemoryReport r = f32.memory_report();
  BOOST_TEST(r.state_bytes == 4 * (l.normuon_floats + l.stat_floats + 2 * l.adam_floats));
  BOOST_TEST(r.master_bytes == 0);
  BOOST_TEST(r.workspace_bytes > 0);
  Engine bf16(tiny(DType::bf16), Options(), fast_cpu());
  BOOST_TEST(bf16.memory_report().master_bytes == 4 * bf16.layout().param_floats);
}

namespace {

// A device backend whose "device" is host memory: its own TableState stands for the device's buffers and
// counters, a step runs the fast CPU backend's table step on them when it is enqueued (a bad gradient
// skips it there, as the device's kernels do whatever the policy), and the verdict waits until asked.
class HostDevice : public DeviceTableBackend {
 public:
  HostDevice(const Layout& layout, const Options& options) : cpu_(layout, options, 1), device_(layout) {}
  std::string name() const override { return "host-device"; }
  int64_t workspace_bytes() const override { return cpu_.workspace_bytes(); }
  void enqueue(const TableState& state, const ParamTable& table, const Options& options, const float* grad_scale,
               const float* found_inf) override {
    ++enqueued;
    BOOST_TEST(state.group_steps == device_.group_steps);  // the host's counters follow the device's
    BOOST_TEST(state.entry_steps == device_.entry_steps);
    error_.clear();
    if (found_inf && *found_inf != 0) {
      last_ = StepResult{true, kFoundInfReason};
      return;
    }
    Options skip = options;
    skip.nonfinite = NonFinitePolicy::skip_step;
    last_ = cpu_.step(device_, table, skip, grad_scale);
    if (last_.skipped && options.nonfinite == NonFinitePolicy::error) error_ = last_.reason;
  }
  StepResult verdict(const Options&) override {
    ++verdicts;
    if (!error_.empty()) throw std::runtime_error(error_);
    return last_;
  }
  void set_steps(const TableState& state) override {
    device_.group_steps = state.group_steps;
    device_.entry_steps = state.entry_steps;
  }
  void refresh_master(int e, const ParamTable& table) override { device_.refresh_master(e, table); }
  std::vector<BufferView> buffers() override {
    return state_buffers(device_, true);
  }
  void set_stream(void*) override {}
  int enqueued = 0, verdicts = 0;

 private:
  FastCpuBackend cpu_;
  TableState device_;
  StepResult last_;
  std::string error_;
};

Engine::BackendFactory host_device() {
  return [](const Layout& l, const Options& o) { return std::make_unique<HostDevice>(l, o); };
}

// Steps `engine` through gradients where step `bad` has a NaN, as a host engine does; returns the results.
std::vector<std::string> run_with_a_bad_step(Engine& engine, Tensors& t, int steps, int bad) {
  std::vector<std::string> reasons;
  for (int step = 1; step <= steps; ++step) {
    t.fill_grads(step);
    if (step == bad) t.grads[1][3] = std::numeric_limits<float>::quiet_NaN();
    const StepResult r = engine.step();
    reasons.push_back(r.skipped ? r.reason : "");
  }
  const StepResult last = engine.settle();
  reasons.push_back(last.skipped ? last.reason : "");
  return reasons;
}

}  // namespace

BOOST_AUTO_TEST_CASE(a_device_step_is_enqueued_and_its_counters_roll_back_when_it_turns_out_skipped) {
  Options options;
  options.set("nonfinite=skip_step");
  Engine host(tiny(), options, fast_cpu());
  Engine sync(tiny(), options, host_device());
  Engine deferred(tiny(), options, host_device());
  deferred.set_verdict(Verdict::deferred);
  BOOST_TEST(sync.on_device());
  BOOST_TEST(sync.state().momentum.size() == 0);  // the device backend's buffers are its own
  BOOST_TEST(sync.buffers().at(0).device);
  Tensors a(host), b(sync), c(deferred);
  const auto on_host = run_with_a_bad_step(host, a, 4, 2);
  const auto now = run_with_a_bad_step(sync, b, 4, 2);
  const auto later = run_with_a_bad_step(deferred, c, 4, 2);
  // In step() (sync) the verdict is this step's; deferred, it is the step before's, the last at settle().
  BOOST_TEST(on_host[1].find("step 2: gradient of") == 0);
  BOOST_TEST(now == on_host);
  BOOST_TEST(later[0].empty());
  BOOST_TEST(later[2] == on_host[1]);
  BOOST_TEST(later[1].empty());
  BOOST_TEST(a.params == b.params);
  BOOST_TEST(a.params == c.params);
  for (Engine* e : {&sync, &deferred}) {
    BOOST_TEST(e->group_steps() == host.group_steps());
    BOOST_TEST(e->entry_steps() == host.entry_steps());
    BOOST_TEST(!e->pending());
  }
  BOOST_TEST(host.group_steps() == (std::vector<int64_t>{3, 3}));
}

BOOST_AUTO_TEST_CASE(a_deferred_error_is_raised_at_the_next_step_before_it_is_enqueued) {
  HostDevice* device = nullptr;
  Engine engine(tiny(), Options(), [&](const Layout& l, const Options& o) {  // nonfinite=error
    auto made = std::make_unique<HostDevice>(l, o);
    device = made.get();
    return made;
  });
  engine.set_verdict(Verdict::deferred);
  Tensors t(engine);
  t.fill_grads(1);
  BOOST_TEST(!engine.step().skipped);
  t.grads[1][3] = std::numeric_limits<float>::infinity();
  BOOST_TEST(!engine.step().skipped);  // enqueued; its verdict is out
  BOOST_TEST(engine.group_steps() == (std::vector<int64_t>{2, 2}));
  t.fill_grads(3);
  BOOST_CHECK_EXCEPTION(engine.step(), std::runtime_error,
                        [](const auto& e) { return message_contains(e, "step 2: gradient of"); });
  BOOST_TEST(device->enqueued == 2);  // the third step was not enqueued
  BOOST_TEST(engine.group_steps() == (std::vector<int64_t>{1, 1}));
  BOOST_TEST(!engine.pending());
  // The scaler's found_inf (device memory): skipped, the counters as they were.
  const float found = 1.f;
  BOOST_TEST(!engine.step(nullptr, &found).skipped);
  BOOST_TEST(engine.group_steps() == (std::vector<int64_t>{2, 2}));
  BOOST_TEST(engine.settle().reason == kFoundInfReason);
  BOOST_TEST(engine.group_steps() == (std::vector<int64_t>{1, 1}));
  // set_steps settles a pending step first, then the device's counters follow the host's.
  BOOST_TEST(!engine.step().skipped);
  const int verdicts = device->verdicts;
  engine.set_steps({7, 9});
  BOOST_TEST(device->verdicts == verdicts + 1);
  BOOST_TEST(!engine.step().skipped);
  BOOST_TEST(engine.settle().reason.empty());
  BOOST_TEST(engine.group_steps() == (std::vector<int64_t>{8, 10}));
}
