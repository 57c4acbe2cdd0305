// The CPU Newton-Schulz on the work pool: a matrix's result does not depend on the thread count or on
// which thread ran it (bit for bit), several batches in one run give what they give one by one, and the
// per-matrix and whole-batch (oneDNN's threads) paths agree within bf16 / fp32 rounding.
#define BOOST_TEST_MODULE newton_schulz
#include <boost/test/unit_test.hpp>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "newton_schulz.h"
#include "work_pool.h"

using namespace normuon;
using namespace normuon::fast;

namespace {

// Two batches of random matrices, one wide and one tall, as stored.
const std::vector<NsBatchShape> kShapes = {{24, 40, 5}, {48, 16, 3}};

struct Batches {
  std::vector<std::vector<float>> in, out;  // per batch, the matrices one after another
  std::vector<std::vector<const float*>> in_ptr;
  std::vector<std::vector<float*>> out_ptr;
  Batches() {
    std::mt19937 rng(7);
    std::normal_distribution<float> normal;
    for (const auto& s : kShapes) {
      in.emplace_back(static_cast<size_t>(s.rows * s.cols * s.count));
      for (float& v : in.back()) v = normal(rng);
      out.emplace_back(in.back().size(), 0.0f);
    }
    for (size_t b = 0; b < kShapes.size(); ++b) {
      in_ptr.emplace_back();
      out_ptr.emplace_back();
      for (int64_t k = 0; k < kShapes[b].count; ++k) {
        in_ptr[b].push_back(in[b].data() + k * kShapes[b].rows * kShapes[b].cols);
        out_ptr[b].push_back(out[b].data() + k * kShapes[b].rows * kShapes[b].cols);
      }
    }
  }
  std::vector<NsWork> work(const NorMuonHyper& h) {
    std::vector<NsWork> w;
    for (size_t b = 0; b < kShapes.size(); ++b) w.push_back({static_cast<int>(b), in_ptr[b].data(), out_ptr[b].data(), &h});
    return w;
  }
};

NorMuonHyper hyper(NsPrecision p) {
  NorMuonHyper h;
  h.ns_precision = p;
  return h;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

BOOST_AUTO_TEST_CASE(a_matrix_does_not_depend_on_the_thread_count) {
  for (NsPrecision p : {NsPrecision::bf16, NsPrecision::fp32}) {
    const NorMuonHyper h = hyper(p);
    Batches one;
    WorkPool pool1(1);
    BatchedNewtonSchulz ns1(kShapes, pool1, NsSplit::per_matrix);
    auto w1 = one.work(h);
    ns1.run(w1.data(), static_cast<int>(w1.size()));
    for (int threads : {2, 3, 4}) {
      Batches many;
      WorkPool pool(threads);
      BatchedNewtonSchulz ns(kShapes, pool, NsSplit::per_matrix);
      for (int repeat = 0; repeat < 3; ++repeat) {  // matrices land on other threads each time
        auto w = many.work(h);
        ns.run(w.data(), static_cast<int>(w.size()));
        for (size_t b = 0; b < kShapes.size(); ++b) BOOST_TEST(same_bits(many.out[b], one.out[b]), threads << " threads");
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(one_run_of_several_batches_is_the_batches_one_by_one) {
  const NorMuonHyper h = hyper(NsPrecision::bf16);
  WorkPool pool(2);
  BatchedNewtonSchulz ns(kShapes, pool);
  Batches together, apart;
  auto w = together.work(h);
  ns.run(w.data(), static_cast<int>(w.size()));
  for (size_t b = 0; b < kShapes.size(); ++b)
    ns.run(static_cast<int>(b), apart.in_ptr[b].data(), apart.out_ptr[b].data(), h);
  for (size_t b = 0; b < kShapes.size(); ++b) BOOST_TEST(same_bits(together.out[b], apart.out[b]));
}

BOOST_AUTO_TEST_CASE(the_automatic_split_and_the_gemm_count) {
  WorkPool pool(4);
  BatchedNewtonSchulz ns(kShapes, pool);
  BOOST_TEST(ns.per_matrix(0));   // 5 matrices for 4 threads: a matrix per item
  BOOST_TEST(!ns.per_matrix(1));  // 3: the whole batch on oneDNN's threads
  Batches x;
  const NorMuonHyper h = hyper(NsPrecision::bf16);
  auto w = x.work(h);
  ns.run(w.data(), static_cast<int>(w.size()));
  BOOST_TEST(ns.gemm_calls() == (5 + 1) * 3 * h.ns_steps);
}

BOOST_AUTO_TEST_CASE(per_matrix_and_whole_batch_agree_within_rounding) {
  for (NsPrecision p : {NsPrecision::bf16, NsPrecision::fp32}) {
    const NorMuonHyper h = hyper(p);
    WorkPool pool(2);
    BatchedNewtonSchulz per_matrix(kShapes, pool, NsSplit::per_matrix), batched(kShapes, pool, NsSplit::batched);
    Batches a, b;
    auto wa = a.work(h), wb = b.work(h);
    per_matrix.run(wa.data(), static_cast<int>(wa.size()));
    batched.run(wb.data(), static_cast<int>(wb.size()));
    // Entries of an orthogonalised matrix are O(1 / sqrt(n)); the paths differ only in the GEMMs'
    // blocking, which reorders fp32 sums (then rounded to bf16 where the working precision is bf16).
    const double tolerance = p == NsPrecision::bf16 ? 0.05 : 1e-4;
    for (size_t k = 0; k < kShapes.size(); ++k) {
      double worst = 0;
      for (size_t i = 0; i < a.out[k].size(); ++i) {
        BOOST_REQUIRE(std::isfinite(a.out[k][i]));
        worst = std::max(worst, static_cast<double>(std::fabs(a.out[k][i] - b.out[k][i])));
      }
      BOOST_TEST(worst <= tolerance, "batch " << k << " precision " << static_cast<int>(p) << ": " << worst);
    }
  }
}
