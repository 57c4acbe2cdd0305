// Resume equivalence: N steps straight equal k steps, save, load into a fresh optimizer, N-k steps,
// bit for bit, for several k including 1 and N-1, each parameter's own step count included.
#define BOOST_TEST_MODULE resume
#include <boost/test/unit_test.hpp>

#include <cstdio>
#include <cstring>

#include "normuon/grad_gen.h"
#include "normuon/presets.h"
#include "normuon/state_file.h"
#include "reference_backend.h"

using namespace normuon;

namespace {

constexpr int64_t kSteps = 6;

Options resume_options() {
  Options o;
  o.set("weight_decay=0.1");
  return o;
}

void run_steps(FlatState& s, const Options& o, const GradientGenerator& gen, int64_t first, int64_t last) {
  ReferenceBackend backend;
  for (int64_t step = first; step <= last; ++step) {
    gen.fill_gradients(s, step);
    backend.step(s, o);
  }
}

bool same_params(const FlatState& a, const FlatState& b) {
  return std::memcmp(a.params.data(), b.params.data(), sizeof(float) * a.params.size()) == 0;
}

}  // namespace

BOOST_AUTO_TEST_CASE(save_load_continue_is_bitwise_identical) {
  const Options options = resume_options();
  const GradientGenerator gen{99, 5};
  const Layout layout = Layout::build(preset_manifest("tiny"), options);

  FlatState straight(layout);
  gen.fill_params(straight);
  run_steps(straight, options, gen, 1, kSteps);

  for (int64_t k : {int64_t{1}, int64_t{3}, kSteps - 1}) {
    const std::string path = "resume_test_" + std::to_string(k) + ".safetensors";
    {
      FlatState first(layout);
      gen.fill_params(first);
      run_steps(first, options, gen, 1, k);
      save_state(path, first, options, "reference-cpu");
    }
    Options loaded_options;
    FlatState resumed(layout);  // a fresh optimizer: zero state, zero parameters
    load_state(path, resumed, &loaded_options);
    BOOST_TEST(loaded_options.to_json() == options.to_json());
    BOOST_TEST(resumed.group_steps[0] == k);
    run_steps(resumed, loaded_options, gen, k + 1, kSteps);
    BOOST_TEST(same_params(resumed, straight), "parameters differ after resuming at k=" << k);
    BOOST_TEST(resumed.same_optimizer_state(straight), "optimizer state differs after resuming at k=" << k);
    std::remove(path.c_str());
  }
}

// The file carries each parameter's own step count (format version 2): in this run AdamW parameters
// miss gradients, so their counts fall behind their group's counter. Resumed with the group counters
// instead (what a version-1 file gives every parameter), the run would not continue as the straight one.
BOOST_AUTO_TEST_CASE(each_parameters_step_count_is_saved_and_resumed) {
  const Options options = resume_options();
  const GradientGenerator gen{99, 5};
  const Layout layout = Layout::build(preset_manifest("tiny"), options);
  const int64_t k = 3;
  const std::string path = "resume_test_counts.safetensors";
  FlatState straight(layout), first(layout);
  gen.fill_params(straight);
  gen.fill_params(first);
  run_steps(straight, options, gen, 1, kSteps);
  run_steps(first, options, gen, 1, k);
  BOOST_REQUIRE(first.entry_steps != entry_steps_from_groups(layout, first.group_steps));  // some fell behind
  save_state(path, first, options, "reference-cpu");
  FlatState resumed(layout), group_counts(layout);
  load_state(path, resumed);
  load_state(path, group_counts);
  std::remove(path.c_str());
  BOOST_TEST(resumed.entry_steps == first.entry_steps);
  group_counts.entry_steps = entry_steps_from_groups(layout, group_counts.group_steps);
  run_steps(resumed, options, gen, k + 1, kSteps);
  run_steps(group_counts, options, gen, k + 1, kSteps);
  BOOST_TEST(same_params(resumed, straight));
  BOOST_TEST(resumed.same_optimizer_state(straight));
  BOOST_TEST(!same_params(group_counts, straight));
}
