#define BOOST_TEST_MODULE grad_gen
#include <boost/test/unit_test.hpp>

#include <cmath>
#include <cstring>

#include <omp.h>

#include "normuon/grad_gen.h"
#include "normuon/presets.h"

using namespace normuon;

namespace {
bool same_bits(const AlignedBuffer& a, const AlignedBuffer& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(float) * a.size()) == 0;
}
}  // namespace

BOOST_AUTO_TEST_CASE(same_numbers_for_any_thread_count) {
  const Layout l = Layout::build(preset_manifest("tiny"), Options());
  const GradientGenerator gen{7, 0};
  FlatState one(l), many(l);
  omp_set_num_threads(1);
  gen.fill_gradients(one, 3);
  gen.fill_params(one);
  omp_set_num_threads(4);
  gen.fill_gradients(many, 3);
  gen.fill_params(many);
  BOOST_TEST(same_bits(one.grads, many.grads));
  BOOST_TEST(same_bits(one.params, many.params));
}

BOOST_AUTO_TEST_CASE(values_depend_on_seed_step_and_element) {
  const GradientGenerator a{1, 0}, b{2, 0};
  BOOST_TEST(a.gradient(0, 1, 5, 4) != b.gradient(0, 1, 5, 4));
  BOOST_TEST(a.gradient(0, 1, 5, 4) != a.gradient(0, 2, 5, 4));
  BOOST_TEST(a.gradient(0, 1, 5, 4) != a.gradient(0, 1, 6, 4));
  BOOST_TEST(a.gradient(0, 1, 5, 4) == a.gradient(0, 1, 5, 4));
}

BOOST_AUTO_TEST_CASE(counter_normal_has_unit_variance) {
  double sum = 0, sq = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    const double x = counter_normal(1, 2, 3, static_cast<uint64_t>(i));
    sum += x;
    sq += x * x;
  }
  BOOST_TEST(std::fabs(sum / n) < 0.01);
  BOOST_TEST(std::fabs(sq / n - 1.0) < 0.01);
}

BOOST_AUTO_TEST_CASE(rows_have_different_gains_and_some_are_dead) {
  const Layout l = Layout::build(preset_manifest("tiny"), Options());
  FlatState s(l);
  GradientGenerator{1234, 0}.fill_gradients(s, 1);
  const int e = l.find("transformer.h.0.mlp.c_fc.weight");
  const auto& entry = l.entries[e];
  int dead = 0;
  double min_rms = 1e30, max_rms = 0;
  for (int64_t r = 0; r < entry.rows; ++r) {
    double sq = 0;
    for (int64_t c = 0; c < entry.cols; ++c) sq += std::pow(s.grad(e)[r * entry.cols + c], 2);
    const double rms = std::sqrt(sq / static_cast<double>(entry.cols));
    if (rms < 1e-6) ++dead;
    else {
      min_rms = std::min(min_rms, rms);
      max_rms = std::max(max_rms, rms);
    }
  }
  BOOST_TEST(dead > 0);
  BOOST_TEST(dead < entry.rows / 8);
  BOOST_TEST(max_rms / min_rms > 8.0);  // gains 1/4..4
}

BOOST_AUTO_TEST_CASE(missing_gradient_pattern) {
  const Layout l = Layout::build(preset_manifest("tiny"), Options());
  FlatState s(l);
  GradientGenerator{1, 7}.fill_gradients(s, 3);
  for (int i = 0; i < static_cast<int>(l.entries.size()); ++i) {
    BOOST_TEST(s.has_grad[i] == ((3 + i) % 7 != 0 ? 1 : 0));
    if (!s.has_grad[i])
      for (int64_t k = 0; k < l.entries[i].numel; ++k) BOOST_REQUIRE(s.grad(i)[k] == 0.0f);
  }
}

BOOST_AUTO_TEST_CASE(initial_parameters_follow_the_roles) {
  const Layout l = Layout::build(preset_manifest("tiny"), Options());
  FlatState s(l);
  GradientGenerator{}.fill_params(s);
  BOOST_TEST(s.param(l.find("transformer.ln_f.weight"))[3] == 1.0f);
  BOOST_TEST(s.param(l.find("transformer.ln_f.bias"))[3] == 0.0f);
  const int w = l.find("transformer.h.1.attn.c_proj.weight");
  double sq = 0;
  for (int64_t k = 0; k < l.entries[w].numel; ++k) sq += std::pow(s.param(w)[k], 2);
  BOOST_TEST(std::sqrt(sq / static_cast<double>(l.entries[w].numel)) == 0.02, boost::test_tools::tolerance(0.05));
}
