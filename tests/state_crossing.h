// A state file crossing from one backend to another (test_compare.cpp, test_fast_cuda.cpp): the saver
// steps from the generator's initial parameters and saves; the file is loaded into a fresh state, with
// its options, and a fresh backend continues it while the saver continues in memory; the comparator
// (free-running) judges the continuation.
#pragma once

#include <boost/test/unit_test.hpp>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>

#include "comparator.h"
#include "normuon/backend.h"
#include "normuon/grad_gen.h"
#include "normuon/layout.h"
#include "normuon/options.h"
#include "normuon/state_file.h"

namespace normuon::test {

using MakeBackend = std::function<std::unique_ptr<Backend>(const Options&)>;

// Steps first..last of `backend` on `state`, each with the generator's gradients; none may be skipped.
inline void run_alone(Backend& backend, FlatState& state, const Options& options, const GradientGenerator& gen,
                      int64_t first, int64_t last) {
  for (int64_t step = first; step <= last; ++step) {
    gen.fill_gradients(state, step);
    BOOST_TEST(!backend.step(state, options).skipped);
  }
}

// `saver` takes steps 1..k and saves to `file` (removed afterwards); the file must name the saver and
// give back the options, the step counters and the state bit for bit. `make_loader(loaded options)`
// continues it for steps k+1..k+more beside the saver. The comparator's expected side is the saver
// when saver_is_expected, else the loader. Returns its summary.
inline RunSummary continue_from_file(const Layout& layout, const Options& options, const GradientGenerator& gen,
                                     Backend& saver, const MakeBackend& make_loader, bool saver_is_expected,
                                     const std::string& file, int64_t k, int64_t more) {
  FlatState saved(layout);
  gen.fill_params(saved);
  run_alone(saver, saved, options, gen, 1, k);
  save_state(file, saved, options, saver.name());
  BOOST_TEST(read_state_header(file).backend == saver.name());

  FlatState loaded_state(layout);
  Options loaded;
  load_state(file, loaded_state, &loaded);
  std::remove(file.c_str());
  BOOST_TEST(loaded.to_json() == options.to_json());
  BOOST_TEST(loaded_state.group_steps == saved.group_steps);
  BOOST_TEST(loaded_state.group_steps[0] == k);
  const std::unique_ptr<Backend> loader = make_loader(loaded);

  Comparator comparator(layout, loaded, gen, CompareMode::free_running);
  Backend& expected = saver_is_expected ? saver : *loader;
  Backend& candidate = saver_is_expected ? *loader : saver;
  FlatState& expected_state = saver_is_expected ? saved : loaded_state;
  FlatState& candidate_state = saver_is_expected ? loaded_state : saved;
  const StepReport at_load = comparator.check(expected_state, candidate_state, k);
  BOOST_TEST(at_load.bit_identical == at_load.tensors);  // the file holds the state bit for bit
  for (int64_t step = k + 1; step <= k + more; ++step)
    comparator.step(expected, expected_state, candidate, candidate_state, step);
  return comparator.summary();
}

}  // namespace normuon::test
