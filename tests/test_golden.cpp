// The committed golden trace pins the semantics: a fresh reference run must reproduce it, and every
// planted change of a variant knob must make the check fail.
#define BOOST_TEST_MODULE golden
#include <boost/test/unit_test.hpp>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "reference_backend.h"
#include "trace.h"

using namespace normuon;

namespace {

const std::string kGoldenPath = std::string(NORMUON_SOURCE_DIR) + "/golden/tiny.csv";
const std::string kGoldenGramPath = std::string(NORMUON_SOURCE_DIR) + "/golden/tiny-gram.csv";

std::vector<TraceRow> run(const GoldenSpec& spec) {
  ReferenceBackend backend;
  return make_trace(backend, spec);
}

// One reference run of the standard spec, shared by the test cases.
const std::vector<TraceRow>& standard_trace() {
  static const std::vector<TraceRow> rows = run(GoldenSpec::standard());
  return rows;
}

}  // namespace

BOOST_AUTO_TEST_CASE(committed_golden_matches_a_fresh_run) {
  const TraceComparison cmp = compare_traces(read_trace_csv(kGoldenPath), standard_trace(), TraceTolerance{});
  BOOST_TEST_MESSAGE("golden: " << cmp.rows_compared << " rows, max rel. error " << cmp.max_rel_error);
  BOOST_TEST(cmp.ok(), cmp.first_mismatch);
  BOOST_TEST(cmp.rows_compared > 1000);
}

// Gram Newton-Schulz has a golden trace of its own (golden/tiny-gram.csv): the golden configuration with
// normuon.ns_algorithm=gram. tiny's square matrices (attn.c_proj) take the standard iteration there too.
BOOST_AUTO_TEST_CASE(committed_gram_golden_matches_a_fresh_run) {
  GoldenSpec spec = GoldenSpec::standard();
  spec.options.set("normuon.ns_algorithm=gram");
  TraceTolerance exact;
  exact.exact = true;
  const std::vector<TraceRow> gram = run(spec);
  const TraceComparison cmp = compare_traces(read_trace_csv(kGoldenGramPath), gram, TraceTolerance{});
  BOOST_TEST_MESSAGE("gram golden: " << cmp.rows_compared << " rows, max rel. error " << cmp.max_rel_error);
  BOOST_TEST(cmp.ok(), cmp.first_mismatch);
  BOOST_TEST(cmp.rows_compared > 1000);
  BOOST_TEST(compare_traces(gram, run(spec), exact).ok());  // bitwise run to run
  // Where it differs from the standard golden: every non-square NorMuon matrix, nothing else.
  const std::vector<TraceRow>& standard = standard_trace();
  BOOST_REQUIRE(standard.size() == gram.size());
  bool adamw_and_square_same = true, wide_differ = true;
  for (size_t i = 0; i < gram.size(); ++i) {
    const bool square = gram[i].param.find("attn.c_proj") != std::string::npos;
    const bool same = gram[i].param_hash == standard[i].param_hash;
    if (gram[i].algorithm == "adamw" || square) adamw_and_square_same = adamw_and_square_same && same;
    else if (gram[i].step == 20) wide_differ = wide_differ && !same;
  }
  BOOST_TEST(adamw_and_square_same);
  BOOST_TEST(wide_differ);
}

BOOST_AUTO_TEST_CASE(reference_is_bitwise_deterministic) {
  TraceTolerance exact;
  exact.exact = true;
  const TraceComparison cmp = compare_traces(standard_trace(), run(GoldenSpec::standard()), exact);
  BOOST_TEST(cmp.ok(), cmp.first_mismatch);
}

BOOST_AUTO_TEST_CASE(csv_round_trip_is_exact) {
  std::stringstream csv;
  write_trace_csv(csv, standard_trace());
  const std::string path = "golden_roundtrip_test.csv";
  {
    std::ofstream out(path);
    out << csv.str();
  }
  TraceTolerance exact;
  exact.exact = true;
  BOOST_TEST(compare_traces(standard_trace(), read_trace_csv(path), exact).ok());
  std::remove(path.c_str());
}

BOOST_AUTO_TEST_CASE(every_planted_semantic_change_is_caught) {
  const std::vector<std::string> planted = {
      "normuon.nesterov=false",
      "normuon.reduce_axis=longer_dim",
      "normuon.lr_scale=spectral",
      "normuon.lr_scale=rms_matching",
      "normuon.weight_decay_mode=cautious",
      "normuon.weight_decay_mode=none",
      "normuon.ns_coefficients=polar_express",
      "normuon.ns_precision=fp32",
      "normuon.ns_algorithm=gram",
      "normuon.eps_placement=clamp",
      "normuon.beta2=0.9",
      "adamw.eps=1e-8",
  };
  for (const auto& change : planted) {
    GoldenSpec spec = GoldenSpec::standard();
    spec.options.set(change);
    const TraceComparison cmp = compare_traces(standard_trace(), run(spec), TraceTolerance{});
    BOOST_TEST_MESSAGE(change << ": " << cmp.mismatches << " mismatches, max rel. error " << cmp.max_rel_error);
    BOOST_TEST(!cmp.ok(), "planted change " << change << " was not detected");
    // Far beyond the tolerance, not a borderline catch.
    BOOST_TEST(cmp.max_rel_error > 1e-3, change << " changes the trace by only " << cmp.max_rel_error);
  }
}

BOOST_AUTO_TEST_CASE(trace_reader_rejects_malformed_files) {
  const std::string path = "golden_bad_test.csv";
  {
    std::ofstream out(path);
    out << "step,param\n1,x\n";
  }
  BOOST_CHECK_THROW(read_trace_csv(path), std::runtime_error);
  std::remove(path.c_str());
  BOOST_CHECK_THROW(read_trace_csv("does/not/exist.csv"), std::runtime_error);
}
