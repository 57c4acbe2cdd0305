// The host-side plan of the fused CUDA step (fast/cuda/step_plan.h) and what the CUDA backend and the
// selector say about a machine: runs everywhere, no GPU needed. Every element of every parameter is in
// exactly one chunk of each pass that should see it, every statistic in exactly one task, the
// Newton-Schulz batches split the shape buckets as the scratch budget asks (their shared buffers within
// a tenth of the state on the largest presets), and the launch count depends on the batches only.
#define BOOST_TEST_MODULE cuda_plan
#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cuda_device.h"
#include "fast_cuda_backend.h"
#include "normuon/layout.h"
#include "normuon/ns_algorithm.h"
#include "normuon/presets.h"
#include "selector.h"
#include "ns_batch_geometry.h"
#include "step_plan.h"
#include "cuda_test_models.h"

using namespace normuon;
using normuon::cuda::StepPlan;
using namespace normuon::test;

namespace {

// Collects problems instead of asserting per chunk (the large presets have ~10^5 chunks): one assertion
// per check, with the first few problems in its message.
class Problems {
 public:
  std::ostream& add() {
    ++count_;
    if (count_ > 5) return ignored_;
    text_ << "\n  ";
    return text_;
  }
  bool none() const { return count_ == 0; }
  std::string str() const { return std::to_string(count_) + " problem(s):" + text_.str(); }

 private:
  int64_t count_ = 0;
  std::ostringstream text_;
  std::ostream ignored_{nullptr};  // no buffer: writes are dropped
};

using Intervals = std::vector<std::pair<int64_t, int64_t>>;  // [begin, end)

// Do the intervals cover [0, n) exactly once (no gap, no overlap, nothing outside)?
void check_cover(Intervals iv, int64_t n, const std::string& what, Problems& p) {
  std::sort(iv.begin(), iv.end());
  int64_t at = 0;
  for (const auto& [begin, end] : iv) {
    if (begin != at) {
      p.add() << what << ": " << (begin < at ? "overlap" : "gap") << " at " << std::min(begin, at);
      return;
    }
    if (end <= begin) {
      p.add() << what << ": empty piece at " << begin;
      return;
    }
    at = end;
  }
  if (at != n) p.add() << what << ": covered up to " << at << " of " << n;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// Checks a plan against its layout and options: chunks, matrices, batches, statistics tasks.
void check_plan(const Layout& layout, const Options& options, const StepPlan& plan, const std::string& label) {
  const int n_entries = static_cast<int>(layout.entries.size());
  BOOST_TEST_CONTEXT(label) {
    // ---- chunks: every element of every parameter exactly once per pass that should see it
    std::vector<Intervals> scan(layout.entries.size()), normuon(layout.entries.size()), adamw(layout.entries.size());
    Problems chunk_problems;
    auto collect = [&](const std::vector<cuda::Chunk>& chunks, std::vector<Intervals>& into, const char* pass) {
      for (const cuda::Chunk& c : chunks) {
        if (c.entry < 0 || c.entry >= n_entries) {
          chunk_problems.add() << pass << ": chunk of entry " << c.entry << " (out of range)";
          continue;
        }
        if (c.size <= 0 || c.size > cuda::kChunkElements || c.begin < 0)
          chunk_problems.add() << pass << ": chunk of '" << layout.entries[c.entry].name << "' at " << c.begin
                               << " has size " << c.size;
        into[c.entry].push_back({c.begin, c.begin + c.size});
      }
    };
    collect(plan.scan_chunks, scan, "scan");
    collect(plan.normuon_chunks, normuon, "normuon");
    collect(plan.adamw_chunks, adamw, "adamw");
    BOOST_TEST(chunk_problems.none(), chunk_problems.str());

    Problems cover;
    for (int i = 0; i < n_entries; ++i) {
      const LayoutEntry& e = layout.entries[i];
      const bool is_normuon = e.algorithm == Algorithm::normuon;
      check_cover(scan[i], e.numel, "scan '" + e.name + "'", cover);
      check_cover(normuon[i], is_normuon ? e.numel : 0, "normuon '" + e.name + "'", cover);
      check_cover(adamw[i], is_normuon ? 0 : e.numel, "adamw '" + e.name + "'", cover);
    }
    BOOST_TEST(cover.none(), cover.str());

    // ---- entries and matrices: one matrix per NorMuon entry with elements (in batch order)
    BOOST_REQUIRE(plan.entries.size() == layout.entries.size());
    BOOST_REQUIRE(plan.matrix_batch.size() == plan.matrices.size());
    BOOST_REQUIRE(plan.matrix_index.size() == plan.matrices.size());
    Problems tables;
    int expected_matrix = 0;
    std::set<int> matrices_seen;
    for (int i = 0; i < n_entries; ++i) {
      const LayoutEntry& e = layout.entries[i];
      const cuda::EntryInfo& info = plan.entries[i];
      if (info.offset != e.offset || info.group != e.group ||
          (e.algorithm == Algorithm::adamw && info.adam_offset != e.adam_offset))
        tables.add() << "entry '" << e.name << "': offsets or group differ from the layout";
      const bool has_matrix = e.algorithm == Algorithm::normuon && e.numel > 0;
      if (!has_matrix) {
        if (info.matrix != -1) tables.add() << "entry '" << e.name << "' has matrix " << info.matrix;
        continue;
      }
      if (info.matrix < 0 || info.matrix >= static_cast<int>(plan.matrices.size()) ||
          !matrices_seen.insert(info.matrix).second) {
        tables.add() << "entry '" << e.name << "' has matrix " << info.matrix << " (out of range or taken)";
        ++expected_matrix;
        continue;
      }
      const cuda::MatrixInfo& m = plan.matrices[info.matrix];
      const bool bf16 = options.groups[e.group].normuon.ns_precision == NsPrecision::bf16;
      if (m.entry != i || m.group != e.group || m.rows != e.rows || m.cols != e.cols ||
          (m.stats_per_row != 0) != e.stats_per_row || m.offset != e.offset || m.stat_offset != e.stat_offset ||
          m.stat_len != e.stat_len || m.stat_len != (e.stats_per_row ? e.rows : e.cols) || (m.ns_bf16 != 0) != bf16)
        tables.add() << "matrix of '" << e.name << "' differs from its layout entry";
      if (m.ns_input != nullptr || m.ns_output != nullptr)
        tables.add() << "matrix of '" << e.name << "' has Newton-Schulz pointers in the host plan";
      if (m.offset + m.rows * int64_t{m.cols} > layout.normuon_floats || m.stat_offset + m.stat_len > layout.stat_floats)
        tables.add() << "matrix of '" << e.name << "' reaches outside its buffers";
      ++expected_matrix;
    }
    BOOST_TEST(static_cast<int>(plan.matrices.size()) == expected_matrix);
    BOOST_TEST(tables.none(), tables.str());

    // ---- Newton-Schulz batches: per (shape bucket, group) as few as keep within the scratch budget,
    // matching the bucket and the group's knobs
    BOOST_REQUIRE(plan.batch_group.size() == plan.batches.size());
    BOOST_REQUIRE(plan.batch_ranges.size() == plan.batches.size());
    std::map<std::pair<int, int>, int64_t> bucket_groups;  // (bucket, group) -> NorMuon entries, empty ones too
    std::vector<int64_t> expected_count(plan.batches.size(), 0);
    Problems batches;
    for (const LayoutEntry& e : layout.entries)
      if (e.algorithm == Algorithm::normuon) ++bucket_groups[{e.bucket, e.group}];
    const int64_t budget = cuda::ns_scratch_budget(layout);
    int64_t expected_batches = 0;
    for (const auto& [key, n] : bucket_groups) {
      const LayoutEntry& first = *std::find_if(layout.entries.begin(), layout.entries.end(), [&](const LayoutEntry& e) {
        return e.algorithm == Algorithm::normuon && e.bucket == key.first && e.group == key.second;
      });
      const NorMuonHyper& h = options.groups.at(static_cast<size_t>(key.second)).normuon;
      const cuda::NsBatchShape shape{first.rows, first.cols, 1, h.ns_precision, h.ns_coefficients, h.ns_steps, h.ns_eps,
                                     h.ns_algorithm};
      const int64_t most = std::max<int64_t>(1, budget / std::max<int64_t>(1, cuda::ns_bytes_per_matrix(shape)));
      expected_batches += (n + most - 1) / most;
    }
    BOOST_TEST(static_cast<int64_t>(plan.batches.size()) == expected_batches);
    cuda::NsWorkspaceSizes sizes;
    for (const cuda::NsBatchShape& shape : plan.batches) {
      sizes.add(shape, cuda::ns_batch_geometry(shape));
      if (shape.count > 1 && cuda::ns_bytes_per_matrix(shape) * shape.count > budget)
        batches.add() << "a batch of " << shape.count << " " << shape.rows << "x" << shape.cols << " over the budget";
    }
    for (size_t b = 0; b < plan.batches.size(); ++b) {  // each batch's passes cover its own matrices only
      const cuda::BatchRange& r = plan.batch_ranges[b];
      for (int m = r.first_matrix; m < r.first_matrix + r.n_matrices; ++m)
        if (plan.matrix_batch.at(static_cast<size_t>(m)) != static_cast<int>(b)) batches.add() << "matrix " << m << " outside its batch's range";
      for (int c = r.first_chunk; c < r.first_chunk + r.n_chunks; ++c) {
        const int matrix = plan.entries.at(static_cast<size_t>(plan.normuon_chunks.at(static_cast<size_t>(c)).entry)).matrix;
        if (matrix < r.first_matrix || matrix >= r.first_matrix + r.n_matrices) batches.add() << "chunk " << c << " outside its batch";
      }
      for (int t = r.first_task; t < r.first_task + r.n_tasks; ++t) {
        const int matrix = plan.stat_tasks.at(static_cast<size_t>(t)).matrix;
        if (matrix < r.first_matrix || matrix >= r.first_matrix + r.n_matrices) batches.add() << "task " << t << " outside its batch";
      }
    }
    std::set<std::pair<int, int>> pairs;  // (batch, index) of every matrix
    for (size_t k = 0; k < plan.matrices.size(); ++k) {
      const cuda::MatrixInfo& m = plan.matrices[k];
      const int b = plan.matrix_batch[k];
      if (b < 0 || b >= static_cast<int>(plan.batches.size())) {
        batches.add() << "matrix " << k << " is in batch " << b;
        continue;
      }
      if (!pairs.insert({b, plan.matrix_index[k]}).second)
        batches.add() << "matrix " << k << ": (batch " << b << ", index " << plan.matrix_index[k] << ") taken twice";
      const cuda::NsBatchShape& shape = plan.batches[b];
      const ShapeBucket& bucket = layout.buckets[layout.entries[m.entry].bucket];
      if (shape.rows != bucket.rows || shape.cols != bucket.cols || shape.rows != m.rows || shape.cols != m.cols)
        batches.add() << "matrix " << k << " (" << m.rows << "x" << m.cols << ") is in batch " << b << " of shape "
                      << shape.rows << "x" << shape.cols;
      if (plan.batch_group[b] != m.group) batches.add() << "matrix " << k << " is in a batch of another group";
      ++expected_count[b];
    }
    for (size_t b = 0; b < plan.batches.size(); ++b) {
      const cuda::NsBatchShape& shape = plan.batches[b];
      const NorMuonHyper& h = options.groups.at(plan.batch_group[b]).normuon;
      if (shape.precision != h.ns_precision || shape.coefficients != h.ns_coefficients || shape.steps != h.ns_steps ||
          shape.eps != h.ns_eps)
        batches.add() << "batch " << b << " has other Newton-Schulz knobs than its group";
      if (shape.rows * shape.cols == 0) {
        // A 0-element shape: counted, but no matrix runs in it.
        if (expected_count[b] != 0) batches.add() << "empty-shape batch " << b << " has matrices";
        continue;
      }
      if (shape.count != expected_count[b])
        batches.add() << "batch " << b << " counts " << shape.count << " matrices, " << expected_count[b] << " are in it";
      for (int64_t i = 0; i < shape.count; ++i)
        if (!pairs.count({static_cast<int>(b), static_cast<int>(i)}))
          batches.add() << "batch " << b << " index " << i << " has no matrix";
    }
    BOOST_TEST(batches.none(), batches.str());

    // ---- statistics tasks: every row (or column) statistic of every matrix exactly once
    std::vector<Intervals> stats(plan.matrices.size());
    Problems stat_problems;
    for (const cuda::StatTask& t : plan.stat_tasks) {
      if (t.matrix < 0 || t.matrix >= static_cast<int>(plan.matrices.size())) {
        stat_problems.add() << "task of matrix " << t.matrix << " (out of range)";
        continue;
      }
      const cuda::MatrixInfo& m = plan.matrices[t.matrix];
      const int64_t len = m.stats_per_row ? m.rows : m.cols;
      const int64_t width = m.stats_per_row ? cuda::kStatRowsPerTask : cuda::kStatColsPerTask;
      if (t.first < 0 || t.first >= len) {
        stat_problems.add() << "task at " << t.first << " outside matrix " << t.matrix << " (" << len << " statistics)";
        continue;
      }
      stats[t.matrix].push_back({t.first, std::min<int64_t>(t.first + width, len)});
    }
    for (size_t k = 0; k < plan.matrices.size(); ++k)
      check_cover(stats[k], plan.matrices[k].stat_len, "statistics of matrix " + std::to_string(k), stat_problems);
    BOOST_TEST(stat_problems.none(), stat_problems.str());

    // ---- launches: the Newton-Schulz ones are 2 + (4 + 2 p) * ns_steps per batch that has work (p: the
    // panels of its symmetric products), or Gram's count for a non-square Gram batch; every batch carries
    // its group's algorithm
    int64_t ns = 0;
    for (size_t b = 0; b < plan.batches.size(); ++b) {
      const cuda::NsBatchShape& shape = plan.batches[b];
      BOOST_TEST((shape.algorithm == options.groups[static_cast<size_t>(plan.batch_group[b])].normuon.ns_algorithm));
      const bool gram = shape.algorithm == NsAlgorithm::gram && shape.rows != shape.cols;
      if (shape.count > 0 && shape.rows * shape.cols > 0) {
        const int p = static_cast<int>(
            cuda::ns_panels(std::min(shape.rows, shape.cols), shape.count, shape.panel_width).size());
        ns += gram ? cuda::ns_gram_launches(shape.steps, p) : 2 + (4 + 2 * p) * shape.steps;
      }
    }
    BOOST_TEST(plan.newton_schulz_launches() == ns);
    // The step counters, the scan and AdamW once; momentum, statistics, finalize and update per batch that
    // has matrices.
    int64_t elementwise = 1 + !plan.scan_chunks.empty() + !plan.adamw_chunks.empty();
    for (const cuda::BatchRange& r : plan.batch_ranges) elementwise += r.n_matrices > 0 ? 4 : 0;
    BOOST_TEST(plan.elementwise_launches() == elementwise);
  }
}

int64_t launches(const StepPlan& plan) { return plan.elementwise_launches() + plan.newton_schulz_launches(); }

// The plan with every symmetric product computed in `width`-wide panels (s or more: in full).
StepPlan with_panel_width(StepPlan plan, int64_t width) {
  for (cuda::NsBatchShape& shape : plan.batches) shape.panel_width = width;
  return plan;
}
constexpr int64_t kFullProducts = int64_t{1} << 40;  // a panel width past any s

}  // namespace

BOOST_AUTO_TEST_CASE(plans_of_the_presets_cover_everything_once) {
  for (const std::string name : {"tiny", "gpt2-124m", "gpt-1.3b", "llama-1b"}) {
    for (const std::string knob : {"", "normuon.reduce_axis=longer_dim", "normuon.ns_algorithm=gram"}) {
      Options options;
      if (!knob.empty()) options.set(knob);
      const Layout layout = Layout::build(preset_manifest(name), options);
      BOOST_TEST(cuda::plan_unsupported_reason(layout, options).empty());
      const StepPlan plan = StepPlan::build(layout, options);
      check_plan(layout, options, plan, name + " " + knob);
      // One group: at least one batch per shape bucket; no empty passes in a transformer.
      BOOST_TEST(plan.batches.size() >= layout.buckets.size(), name);
      BOOST_TEST(plan.elementwise_launches() == 3 + 4 * static_cast<int64_t>(plan.batches.size()), name);
    }
  }
}

BOOST_AUTO_TEST_CASE(plan_of_gpt2_124m_has_the_expected_size) {
  const Options options;
  const Layout layout = Layout::build(preset_manifest("gpt2-124m"), options);
  const StepPlan plan = StepPlan::build(layout, options);
  // 768x2304 (c_attn), 768x768, 3072x768, 768x3072: 12 matrices each.
  BOOST_TEST(plan.batches.size() == 4u);
  for (const auto& b : plan.batches) BOOST_TEST(b.count == 12);
  BOOST_TEST(plan.matrices.size() == 48u);
  BOOST_TEST(plan.newton_schulz_launches() == 4 * (2 + 6 * 5));
  BOOST_TEST(launches(plan) == 3 + 4 * 4 + 4 * 32);

  // Gram Newton-Schulz: 35 launches for each of the three non-square batches, the square 768 x 768 one
  // standard.
  Options gram;
  gram.set("normuon.ns_algorithm=gram");
  const StepPlan gram_plan = StepPlan::build(Layout::build(preset_manifest("gpt2-124m"), gram), gram);
  BOOST_TEST(gram_plan.newton_schulz_launches() == 3 * 35 + (2 + 6 * 5));
  BOOST_TEST(launches(gram_plan) == 3 + 4 * 4 + 3 * 35 + 32);
}

// Gram Newton-Schulz's launches, counted by hand from the spec's loop (docs/spec.md section 3.2): 2 norm
// kernels, X X^T and its mirror (with C = P(c R)), the final Q X; per iteration C R and the Z kernel, Q Z
// unless Q is fresh (first iteration or restart), R Z, the RZ kernel, Z RZ and the R kernel when R is
// updated (not the last iteration, nor one before a restart; the Q and RZ updates share a kernel); a
// restart adds Q X, X X^T and the mirror. Restarts before iterations 2, 5, 8 (0-based).
BOOST_AUTO_TEST_CASE(gram_launches_follow_the_spec_loop) {
  //                      ns_steps:  1   2   3   4   5   6   7   8
  const int expected[] = {7, 15, 20, 28, 35, 40, 48, 55};
  for (int steps = 1; steps <= 8; ++steps) BOOST_TEST(cuda::ns_gram_launches(steps) == expected[steps - 1], steps);
  BOOST_TEST(cuda::ns_gram_applies(5) == 2);
  BOOST_TEST(cuda::ns_gram_applies(6) == 3);
  BOOST_TEST(cuda::ns_gram_applies(2) == 1);
  // Per batch: a square Gram batch and one with no iteration take the standard count; an empty one none.
  cuda::NsBatchShape shape{64, 192, 3, NsPrecision::bf16, NsCoefficients::quintic, 5, 1e-7, NsAlgorithm::gram};
  BOOST_TEST(cuda::ns_batch_launches(shape) == 35);
  shape.cols = 64;
  BOOST_TEST(cuda::ns_batch_launches(shape) == 2 + 6 * 5);
  shape.cols = 192;
  shape.steps = 0;
  BOOST_TEST(cuda::ns_batch_launches(shape) == 2);
  shape.count = 0;
  BOOST_TEST(cuda::ns_batch_launches(shape) == 0);
}

// In panels, each symmetric product is one GEMM per panel: the standard iteration's X X^T and C A, and
// every Gram product but Q X (2 X X^T and 14 s x s products in 5 steps); the kernels stay as they are.
BOOST_AUTO_TEST_CASE(symmetric_products_launch_one_gemm_per_panel) {
  for (const int p : {1, 2, 4, 8}) {
    BOOST_TEST(cuda::ns_launches(5, p) == 2 + 6 * 5 + 2 * 5 * (p - 1), p);
    BOOST_TEST(cuda::ns_gram_launches(5, p) == 35 + (2 + 14) * (p - 1), p);
  }
  cuda::NsBatchShape shape{64, 192, 3, NsPrecision::bf16, NsCoefficients::quintic, 5, 1e-7, NsAlgorithm::gram};
  shape.panel_width = 16;  // 4 panels of s = 64
  BOOST_TEST(cuda::ns_batch_launches(shape) == 35 + 16 * 3);
  shape.algorithm = NsAlgorithm::standard;
  BOOST_TEST(cuda::ns_batch_launches(shape) == 2 + 5 * (4 + 2 * 4));
  shape.panel_width = 64;  // one panel: the full products
  BOOST_TEST(cuda::ns_batch_launches(shape) == 2 + 6 * 5);
}

// FLOPs one run computes: its symmetric products as their panels. Full products (one panel) are the dense
// counts of normuon/ns_algorithm.h; p panels of width w cost sum over panels of (s - c0) w k.
BOOST_AUTO_TEST_CASE(batch_flops_count_the_panels) {
  for (const NsAlgorithm algorithm : {NsAlgorithm::standard, NsAlgorithm::gram}) {
    cuda::NsBatchShape shape{64, 192, 3, NsPrecision::bf16, NsCoefficients::quintic, 5, 1e-7, algorithm};
    const double s = 64, l = 192;
    shape.panel_width = 64;
    BOOST_TEST(cuda::ns_batch_flops(shape) == 3 * ns_dense_flops(algorithm, 64, 192, 5));
    shape.panel_width = 32;  // two panels: (64 * 32 + 32 * 32) / (64 * 64) = 3/4 of each symmetric product
    const double sym = 0.75;
    const double want = algorithm == NsAlgorithm::standard
                            ? 5 * (sym * s * s * l + sym * s * s * s + s * s * l)
                            : 2 * sym * s * s * l + 2 * s * s * l + 14 * sym * s * s * s;
    BOOST_TEST(cuda::ns_batch_flops(shape) == 2 * 3 * want);
  }
  cuda::NsBatchShape empty{0, 192, 3};
  BOOST_TEST(cuda::ns_batch_flops(empty) == 0);
}

BOOST_AUTO_TEST_CASE(plan_of_odd_shapes_and_groups) {
  const Options options = odd_options();
  const Layout layout = Layout::build(odd_manifest(), options);
  const StepPlan plan = StepPlan::build(layout, options);
  check_plan(layout, options, plan, "odd shapes");

  // The statistics axis follows the group's reduce_axis.
  auto matrix_of = [&](const std::string& name) -> const cuda::MatrixInfo& {
    const int e = layout.find(name);
    BOOST_REQUIRE(e >= 0);
    BOOST_REQUIRE(plan.entries[e].matrix >= 0);
    return plan.matrices[plan.entries[e].matrix];
  };
  BOOST_TEST(matrix_of("row").stats_per_row == 0);    // 1 x 37, longer_dim: per column
  BOOST_TEST(matrix_of("row").stat_len == 37);
  BOOST_TEST(matrix_of("col").stats_per_row == 1);    // 37 x 1: per row
  BOOST_TEST(matrix_of("prime").stats_per_row == 0);  // 37 x 53
  BOOST_TEST(matrix_of("wide").stats_per_row == 0);
  BOOST_TEST(matrix_of("a").stats_per_row == 0);      // 16 x 24, longer_dim
  BOOST_TEST(matrix_of("b").stats_per_row == 1);      // 16 x 24 in the fp32 group (reduce_axis=rows)
  BOOST_TEST(matrix_of("a").ns_bf16 == 1);
  BOOST_TEST(matrix_of("b").ns_bf16 == 0);
  BOOST_TEST(matrix_of("tall2").ns_bf16 == 0);

  // 0-element parameters: no matrix, no chunk, no task.
  for (const std::string name : {"empty", "empty_t", "empty_bias"}) {
    const int e = layout.find(name);
    BOOST_REQUIRE(e >= 0);
    BOOST_TEST(plan.entries[e].matrix == -1, name);
    for (const auto* chunks : {&plan.scan_chunks, &plan.normuon_chunks, &plan.adamw_chunks})
      for (const auto& c : *chunks) BOOST_TEST(c.entry != e, name);
  }
  // Buckets shared by two groups make two batches: 16x24 (default and fp32) and 97x13 (default and fp32).
  int batches_16x24 = 0, batches_97x13 = 0;
  for (const auto& b : plan.batches) {
    batches_16x24 += b.rows == 16 && b.cols == 24;
    batches_97x13 += b.rows == 97 && b.cols == 13;
  }
  BOOST_TEST(batches_16x24 == 2);
  BOOST_TEST(batches_97x13 == 2);
  // Batches of the 0-element shapes launch nothing; every other batch launches 2 + 6 * 5.
  int64_t working = 0;
  for (const auto& b : plan.batches) working += b.rows * b.cols > 0;
  BOOST_TEST(plan.batches.size() == layout.buckets.size() + 2);
  BOOST_TEST(plan.newton_schulz_launches() == working * (2 + 6 * 5));
  // Chunks of the big parameters: 60000 and 70000 elements.
  auto chunks_of = [&](const std::vector<cuda::Chunk>& chunks, const std::string& name) {
    const int e = layout.find(name);
    return std::count_if(chunks.begin(), chunks.end(), [e](const cuda::Chunk& c) { return c.entry == e; });
  };
  BOOST_TEST(chunks_of(plan.normuon_chunks, "big") == 4);
  BOOST_TEST(chunks_of(plan.adamw_chunks, "vec") == 5);
  BOOST_TEST(chunks_of(plan.scan_chunks, "vec") == 5);
  // Statistics tasks: 97 rows in 8-row tasks, 600 columns in 256-column tasks.
  auto tasks_of = [&](const std::string& name) {
    const int m = plan.entries[layout.find(name)].matrix;
    return std::count_if(plan.stat_tasks.begin(), plan.stat_tasks.end(),
                         [m](const cuda::StatTask& t) { return t.matrix == m; });
  };
  BOOST_TEST(tasks_of("tall") == 13);
  BOOST_TEST(tasks_of("wide") == 3);
  BOOST_TEST(tasks_of("col") == 5);  // 37 rows
  BOOST_TEST(tasks_of("row") == 1);  // 37 columns
}

// set_options' AdamW bias corrections per entry (cuda::fill_entry_scalars): from each parameter's own
// count when given, else from its group's counter (a caller that keeps group counters only, as
// format-version-1 state did), else left to the step-counter kernel.
BOOST_AUTO_TEST_CASE(entry_scalars_come_from_each_parameters_own_count) {
  const Options options = odd_options();
  const Layout layout = Layout::build(odd_manifest(), options);
  std::vector<int64_t> groups(layout.group_names.size()), entries(layout.entries.size());
  for (size_t g = 0; g < groups.size(); ++g) groups[g] = 10 + static_cast<int64_t>(g);
  for (size_t e = 0; e < entries.size(); ++e) entries[e] = static_cast<int64_t>(e % 4);  // 0 .. 3
  auto expected = [&](size_t e, int64_t taken) {
    const AdamWHyper& h = options.groups[static_cast<size_t>(layout.entries[e].group)].adamw;
    const double t = static_cast<double>(taken + 1);
    return std::pair<float, float>{static_cast<float>(std::sqrt(1 - std::pow(h.beta2, t))),
                                   static_cast<float>(-(h.lr / (1 - std::pow(h.beta1, t))))};
  };
  std::vector<cuda::EntryScalars> out;
  cuda::fill_entry_scalars(layout, options, &groups, &entries, out);
  BOOST_REQUIRE(out.size() == layout.entries.size());
  for (size_t e = 0; e < out.size(); ++e) {
    const auto [bc2_sqrt, neg_step] = expected(e, entries[e]);
    BOOST_TEST(out[e].bias_from_host == 1);
    BOOST_TEST(out[e].adam_bc2_sqrt == bc2_sqrt, layout.entries[e].name);
    BOOST_TEST(out[e].adam_neg_step_size == neg_step, layout.entries[e].name);
  }
  cuda::fill_entry_scalars(layout, options, &groups, nullptr, out);
  for (size_t e = 0; e < out.size(); ++e) {
    const auto [bc2_sqrt, neg_step] = expected(e, groups[static_cast<size_t>(layout.entries[e].group)]);
    BOOST_TEST(out[e].bias_from_host == 1);
    BOOST_TEST(out[e].adam_bc2_sqrt == bc2_sqrt, layout.entries[e].name);
    BOOST_TEST(out[e].adam_neg_step_size == neg_step, layout.entries[e].name);
  }
  cuda::fill_entry_scalars(layout, options, nullptr, nullptr, out);
  for (const cuda::EntryScalars& s : out) BOOST_TEST(s.bias_from_host == 0);
  const std::vector<int64_t> short_entries(entries.size() - 1, 0), short_groups(groups.size() - 1, 0);
  BOOST_CHECK_THROW(cuda::fill_entry_scalars(layout, options, nullptr, &short_entries, out), std::invalid_argument);
  BOOST_CHECK_THROW(cuda::fill_entry_scalars(layout, options, &short_groups, nullptr, out), std::invalid_argument);
}

BOOST_AUTO_TEST_CASE(plan_of_a_model_without_normuon_or_adamw) {
  // Empty passes launch nothing: only AdamW, then only NorMuon.
  Manifest adam_only;
  add_param(adam_only, "bias", {24});
  add_param(adam_only, "emb", {50, 16}, "", Role::embedding);
  const Options options;
  const Layout l1 = Layout::build(adam_only, options);
  const StepPlan p1 = StepPlan::build(l1, options);
  check_plan(l1, options, p1, "adamw only");
  BOOST_TEST(p1.newton_schulz_launches() == 0);
  BOOST_TEST(p1.elementwise_launches() == 3);  // step counters, scan, AdamW

  Manifest normuon_only;
  add_param(normuon_only, "w", {16, 24});
  const Layout l2 = Layout::build(normuon_only, options);
  const StepPlan p2 = StepPlan::build(l2, options);
  check_plan(l2, options, p2, "normuon only");
  BOOST_TEST(p2.elementwise_launches() == 6);  // no AdamW pass
  BOOST_TEST(p2.newton_schulz_launches() == 2 + 6 * 5);
}

BOOST_AUTO_TEST_CASE(launches_grow_with_batches_not_parameters) {
  // The launches of a step follow its Newton-Schulz batches: the shape buckets, and the splits the scratch
  // budget asks for on a large model (gpt-1.3b's 24 layers, llama-1b's 16). Each batch launches what
  // any batch of its shape launches, whatever its count.
  const Options options;
  for (const auto& [preset, few, all] : {std::tuple<std::string, int, int>{"gpt2-124m", 2, 12},
                                         std::tuple<std::string, int, int>{"gpt-1.3b", 1, 24},
                                         std::tuple<std::string, int, int>{"llama-1b", 2, 16}}) {
    const Layout small = Layout::build(first_layers(preset, few), options);
    const Layout large = Layout::build(first_layers(preset, all), options);
    BOOST_REQUIRE(large.entries.size() > small.entries.size());
    BOOST_TEST(small.buckets.size() == large.buckets.size(), preset);
    // With a fixed panel width (here: full products), every batch of these presets launches 4 elementwise
    // passes and 2 + 6 * 5 Newton-Schulz kernels and GEMMs.
    const StepPlan ps = with_panel_width(StepPlan::build(small, options), kFullProducts);
    const StepPlan pl = with_panel_width(StepPlan::build(large, options), kFullProducts);
    check_plan(small, options, ps, preset + " " + std::to_string(few) + " layers");
    const int64_t more = static_cast<int64_t>(pl.batches.size() - ps.batches.size());
    BOOST_TEST(launches(pl) - launches(ps) == more * (4 + 32), preset);
    BOOST_TEST((more == 0) == (preset == "gpt2-124m"), preset);  // the larger two are split further
    BOOST_TEST(pl.matrices.size() > ps.matrices.size(), preset);
    // The backend's own choice splits a larger batch into more panels, at most 8 per product: the
    // standard count with 8 panels bounds it, whatever the layers.
    const StepPlan auto_large = StepPlan::build(large, options);
    check_plan(large, options, auto_large, preset + " " + std::to_string(all) + " layers, panels left to the backend");
    // By hand: gpt2-124m's batches of 12 768-wide matrices keep full products (4 x 32).
    if (preset == "gpt2-124m") BOOST_TEST(auto_large.newton_schulz_launches() == 4 * 32);
    BOOST_TEST(auto_large.newton_schulz_launches() <= static_cast<int64_t>(pl.batches.size()) * cuda::ns_launches(5, 8),
               preset);
  }
  // With the fp32 knob and polar_express the count follows ns_steps, still not the parameters.
  Options polar;
  polar.set("normuon.ns_coefficients=polar_express");
  polar.set("normuon.ns_steps=3");
  const StepPlan p2 = StepPlan::build(Layout::build(first_layers("gpt2-124m", 2), polar), polar);
  const StepPlan p12 = StepPlan::build(Layout::build(first_layers("gpt2-124m", 12), polar), polar);
  BOOST_TEST(p2.newton_schulz_launches() == 4 * (2 + 6 * 3));
  BOOST_TEST(launches(p2) == launches(p12));
}

BOOST_AUTO_TEST_CASE(unsupported_options_are_rejected_with_a_reason) {
  const Options defaults;
  const Layout layout = Layout::build(preset_manifest("tiny"), defaults);

  Options polar6;
  polar6.groups[0].normuon.ns_coefficients = NsCoefficients::polar_express;
  polar6.groups[0].normuon.ns_steps = 6;
  const std::string reason = cuda::plan_unsupported_reason(layout, polar6);
  BOOST_TEST(!reason.empty());
  BOOST_TEST(contains(reason, "Polar Express"), reason);
  BOOST_TEST(contains(reason, "6"), reason);
  BOOST_CHECK_THROW(StepPlan::build(layout, polar6), std::invalid_argument);
  Options polar5 = polar6;
  polar5.groups[0].normuon.ns_steps = 5;
  BOOST_TEST(cuda::plan_unsupported_reason(layout, polar5).empty());
  // The quintic has no such limit.
  Options quintic7;
  quintic7.groups[0].normuon.ns_steps = 7;
  BOOST_TEST(cuda::plan_unsupported_reason(layout, quintic7).empty());

  Options three_groups;
  GroupOptions extra;
  extra.name = "extra";
  three_groups.groups.push_back(extra);
  const std::string groups = cuda::plan_unsupported_reason(layout, three_groups);
  BOOST_TEST(contains(groups, "groups"), groups);
  BOOST_TEST(contains(groups, "3"), groups);
  BOOST_CHECK_THROW(StepPlan::build(layout, three_groups), std::invalid_argument);

  // The backend gives the plan's reason before asking for a device, on any machine.
  BOOST_TEST(FastCudaBackend::unsupported_reason(layout, polar6) == reason);
  BOOST_CHECK_THROW(FastCudaBackend(layout, polar6), std::invalid_argument);

  // Gram Newton-Schulz is served: the plan has nothing against it, and the backend's only reason is the
  // one every option set gets (none on a GPU machine, the missing device here).
  Options gram;
  gram.set("normuon.ns_algorithm=gram");
  BOOST_TEST(cuda::plan_unsupported_reason(layout, gram).empty());
  BOOST_TEST(FastCudaBackend::unsupported_reason(layout, gram) == FastCudaBackend::unsupported_reason(layout, defaults));
}

BOOST_AUTO_TEST_CASE(backend_reports_the_device_it_lacks) {
  const Options options;
  const Layout layout = Layout::build(preset_manifest("tiny"), options);
  const std::string device = cuda::unavailable_reason();
  const std::string reason = FastCudaBackend::unsupported_reason(layout, options);
  // A device index that exists nowhere is refused on every machine.
  BOOST_TEST(!cuda::unavailable_reason(4096).empty());
  BOOST_TEST(!FastCudaBackend::unsupported_reason(layout, options, 4096).empty());
  if (device.empty()) {
    BOOST_TEST_MESSAGE("a GPU is present: " << cuda::describe_device());
    BOOST_TEST(reason.empty(), reason);
    BOOST_TEST(contains(cuda::unavailable_reason(4096), "4096"));
    FastCudaConfig config;
    config.device = 4096;
    BOOST_CHECK_THROW(FastCudaBackend(layout, options, config), std::invalid_argument);
  } else {
    BOOST_TEST_MESSAGE("no GPU: " << device);
    BOOST_TEST(reason == device);
    BOOST_TEST(contains(lower(reason), "device"), reason);
    BOOST_CHECK_EXCEPTION(FastCudaBackend(layout, options), std::invalid_argument, [&](const std::invalid_argument& e) {
      const std::string what = e.what();
      return contains(what, "fast-cuda") && contains(what, device);
    });
  }
}

BOOST_AUTO_TEST_CASE(selector_never_falls_back_from_cuda) {
  const Options options;
  const Layout layout = Layout::build(preset_manifest("tiny"), options);
  const std::string device = cuda::unavailable_reason();
  for (BackendChoice choice : {BackendChoice::fast, BackendChoice::automatic}) {
    BOOST_TEST_CONTEXT(to_string(choice)) {
      if (device.empty()) {
        const auto backend = make_backend(choice, layout, options, DeviceChoice::cuda);
        BOOST_REQUIRE(backend);
        BOOST_TEST(backend->name() == "fast-cuda");
      } else {
        BOOST_CHECK_EXCEPTION(make_backend(choice, layout, options, DeviceChoice::cuda), std::invalid_argument,
                              [&](const std::invalid_argument& e) {
                                const std::string what = e.what();
                                BOOST_TEST_MESSAGE(what);
                                return contains(what, "no fallback") && contains(what, device) &&
                                       contains(what, "cuda");
                              });
      }
    }
  }
  // An option the CUDA backend lacks is an error naming it, GPU or not.
  Options polar6 = options;
  polar6.groups[0].normuon.ns_coefficients = NsCoefficients::polar_express;
  polar6.groups[0].normuon.ns_steps = 6;
  BOOST_CHECK_EXCEPTION(make_backend(BackendChoice::fast, layout, polar6, DeviceChoice::cuda), std::invalid_argument,
                        [](const std::invalid_argument& e) {
                          const std::string what = e.what();
                          return contains(what, "Polar Express") && contains(what, "no fallback");
                        });
}

BOOST_AUTO_TEST_CASE(the_planned_scratch_is_a_tenth_of_the_state_at_most) {
  // Everything the CUDA step holds beyond the spec's state and the masters (StepPlan::workspace_bytes: the
  // Newton-Schulz buffers, shared by the batches in their working precision, cuBLASLt's workspace, the
  // tables and the statistics' scratch), planned on the CPU for the two largest presets: at most a tenth
  // of the state. The buffers of one batch per shape bucket, as before the budget, would be far more.
  for (const std::string name : {"gpt-1.3b", "moe-8x64"}) {
    const Options options;
    const Layout layout = Layout::build(preset_manifest(name), options);
    const StepPlan plan = StepPlan::build(layout, options);
    check_plan(layout, options, plan, name);
    const double state = 4.0 * static_cast<double>(layout.normuon_floats + layout.stat_floats + 2 * layout.adam_floats);
    const double scratch = static_cast<double>(plan.workspace_bytes());
    BOOST_TEST(scratch <= 0.10 * state, name << ": " << scratch / 1e6 << " MB for " << state / 1e6 << " MB of state");
    cuda::NsWorkspaceSizes unsplit;  // one batch per (bucket, group)
    for (const NsBatch& b : newton_schulz_batches(layout)) {
      const cuda::NsBatchShape shape{b.rows, b.cols, static_cast<int64_t>(b.entries.size()), NsPrecision::bf16};
      unsplit.add(shape, cuda::ns_batch_geometry(shape));
    }
    BOOST_TEST(static_cast<double>(unsplit.bytes()) > 0.25 * state, name);
    BOOST_TEST(plan.batches.size() > layout.buckets.size(), name);
  }
}
