// The Newton-Schulz GEMM plan (fast/cuda/ns_gemm_plan.h) that the CUDA backend hands to cuBLASLt, run
// on the CPU: the emulator of cuBLASLt's strided-batched column-major matmul (lt_matmul_emulation.h),
// in double, executes the plan's GEMMs on buffers laid out as the backend lays them out, and the result must match a direct
// row-major implementation of the spec's iteration. No GPU needed.
#define BOOST_TEST_MODULE ns_gemm_plan
#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "lt_matmul_emulation.h"
#include "ns_gemm_plan.h"
#include "ns_gram_plan.h"

using namespace normuon::cuda;
using normuon::test::LayoutError;
using normuon::test::LtBuffer;
using normuon::test::lt_matmul;
using normuon::test::same_layout;

namespace {

constexpr double kA = 3.4445, kB = -4.7750, kC = 2.0315;
constexpr int kSteps = 3;
constexpr int64_t kCount = 3;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// kCount random row-major rows x cols matrices, x_stride apart, NaN in the padding.
std::vector<double> random_batch(int64_t rows, int64_t cols, int64_t x_stride, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(-0.1, 0.1);
  std::vector<double> x(static_cast<size_t>(kCount * x_stride), kNaN);
  for (int64_t q = 0; q < kCount; ++q)
    for (int64_t e = 0; e < rows * cols; ++e) x[static_cast<size_t>(q * x_stride + e)] = dist(rng);
  return x;
}

// dst = coef * src (+ add) over the n elements of each of the kCount matrices, stride apart: the
// elementwise steps of an iteration (ns_combine, ns_sym_combine), in double. Padding stays untouched.
void combine(std::vector<double>& dst, const std::vector<double>& src, const std::vector<double>* add, double coef,
             int64_t n, int64_t stride) {
  for (int64_t q = 0; q < kCount; ++q)
    for (int64_t e = q * stride; e < q * stride + n; ++e)
      dst[static_cast<size_t>(e)] = coef * src[static_cast<size_t>(e)] + (add ? (*add)[static_cast<size_t>(e)] : 0.0);
}

// kSteps iterations through the plan's full GEMMs, in the order of run_newton_schulz (ns_run.cuh); X in
// place.
std::vector<double> run_plan(const NsGemmPlan& plan, const std::vector<double>& input, int64_t x_stride,
                             int64_t gram_stride) {
  std::vector<double> x = input, u(input.size(), kNaN);
  std::vector<double> gram(static_cast<size_t>(kCount * gram_stride), kNaN), b(gram.size(), kNaN), t(gram.size(), kNaN);
  auto whole = [](std::vector<double>& v) { return LtBuffer<double>{v.data(), static_cast<int64_t>(v.size())}; };
  const NsBuffers<LtBuffer<double>> buf{whole(x), whole(gram), whole(b), whole(t), whole(u)};
  const int64_t n = plan.s * plan.l, nn = plan.s * plan.s;
  for (int k = 0; k < kSteps; ++k) {
    lt_matmul<double>(plan.gram, buf, kCount, x_stride, gram_stride);  // A = X X^T
    combine(b, gram, nullptr, kC, nn, gram_stride);                   // C = c A
    lt_matmul<double>(plan.square, buf, kCount, x_stride, gram_stride);  // T = C A
    combine(b, gram, &t, kB, nn, gram_stride);                          // B = b A + T
    lt_matmul<double>(plan.apply, buf, kCount, x_stride, gram_stride);   // U = B X
    combine(x, x, &u, kA, n, x_stride);                                 // X = a X + U
  }
  return x;
}

using RowMajor = std::vector<double>;  // r x c, element (i, j) at i * c + j

RowMajor matmul(const RowMajor& x, const RowMajor& y, int64_t r, int64_t k, int64_t c) {
  RowMajor z(static_cast<size_t>(r * c));
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < c; ++j) {
      double sum = 0;
      for (int64_t t = 0; t < k; ++t) sum += x[static_cast<size_t>(i * k + t)] * y[static_cast<size_t>(t * c + j)];
      z[static_cast<size_t>(i * c + j)] = sum;
    }
  return z;
}

RowMajor transpose(const RowMajor& x, int64_t r, int64_t c) {
  RowMajor t(x.size());
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < c; ++j) t[static_cast<size_t>(j * r + i)] = x[static_cast<size_t>(i * c + j)];
  return t;
}

// The spec, literally: X = M or M^T (wide s x l), A = X X^T, B = b A + c A A, X = a X + B X, back to
// M's orientation.
RowMajor reference_ns(const RowMajor& m, int64_t rows, int64_t cols) {
  const bool tall = rows > cols;
  const int64_t s = tall ? cols : rows, l = tall ? rows : cols;
  RowMajor x = tall ? transpose(m, rows, cols) : m;
  for (int k = 0; k < kSteps; ++k) {
    const RowMajor a = matmul(x, transpose(x, s, l), s, l, s);
    const RowMajor aa = matmul(a, a, s, s, s);
    RowMajor b(a.size());
    for (size_t i = 0; i < b.size(); ++i) b[i] = kB * a[i] + kC * aa[i];
    const RowMajor bx = matmul(b, x, s, s, l);
    for (size_t i = 0; i < x.size(); ++i) x[i] = kA * x[i] + bx[i];
  }
  return tall ? transpose(x, s, l) : x;
}

struct Comparison {
  double max_diff = 0;  // NaN-safe: a NaN anywhere makes it infinite
  double max_abs = 0;   // of the reference
  bool padding_intact = true;
};

Comparison compare(const NsGemmPlan& plan, int64_t rows, int64_t cols, unsigned seed) {
  const int64_t n = rows * cols;
  const int64_t x_stride = n + 7;  // deliberately not n, nor a multiple of anything
  const int64_t gram_stride = plan.s * plan.s + 5;
  const std::vector<double> input = random_batch(rows, cols, x_stride, seed);
  const std::vector<double> out = run_plan(plan, input, x_stride, gram_stride);
  Comparison r;
  for (int64_t q = 0; q < kCount; ++q) {
    const auto begin = input.begin() + q * x_stride;
    const RowMajor ref = reference_ns(RowMajor(begin, begin + n), rows, cols);
    for (int64_t e = 0; e < n; ++e) {
      const double got = out[static_cast<size_t>(q * x_stride + e)];
      const double want = ref[static_cast<size_t>(e)];
      const double diff = std::fabs(got - want);
      r.max_diff = std::isnan(diff) ? std::numeric_limits<double>::infinity() : std::max(r.max_diff, diff);
      r.max_abs = std::max(r.max_abs, std::fabs(want));
    }
    for (int64_t e = n; e < x_stride; ++e)
      if (!std::isnan(out[static_cast<size_t>(q * x_stride + e)])) r.padding_intact = false;
  }
  return r;
}

const std::vector<std::pair<int64_t, int64_t>> kShapes = {{1, 1},   {3, 5},   {5, 3},   {4, 4},  {1, 7},
                                                          {7, 1},   {17, 40}, {40, 17}, {64, 64}, {33, 65}};

std::string shape_name(int64_t rows, int64_t cols) { return std::to_string(rows) + "x" + std::to_string(cols); }

// Does the emulator catch the plan (refused, wrong result or padding written)?
bool detected(const NsGemmPlan& plan, int64_t rows, int64_t cols) {
  try {
    const Comparison r = compare(plan, rows, cols, 7);
    return !(r.max_diff < 1e-12) || !r.padding_intact;
  } catch (const LayoutError&) {
    return true;
  }
}

}  // namespace

BOOST_AUTO_TEST_CASE(plan_orientation_and_sizes) {
  for (const auto& [rows, cols] : kShapes) {
    BOOST_TEST_CONTEXT(shape_name(rows, cols)) {
      const NsGemmPlan p = ns_gemm_plan(rows, cols);
      BOOST_TEST(p.tall == (rows > cols));
      BOOST_TEST(p.s == std::min(rows, cols));
      BOOST_TEST(p.l == std::max(rows, cols));
      BOOST_TEST((p.gram.d.operand == NsOperand::gram && p.square.d.operand == NsOperand::t &&
                  p.apply.d.operand == NsOperand::u));
      // The square GEMM is (c A) A, as the reference's `(c * A) @ A`: C (in the B buffer) on the left.
      BOOST_TEST((p.square.a.operand == NsOperand::b && p.square.b.operand == NsOperand::gram));
    }
  }
  BOOST_CHECK_THROW(ns_gemm_plan(0, 3), std::invalid_argument);
  BOOST_CHECK_THROW(ns_gemm_plan(3, 0), std::invalid_argument);
}

BOOST_AUTO_TEST_CASE(emulated_plan_matches_row_major_reference) {
  unsigned seed = 1;
  for (const auto& [rows, cols] : kShapes) {
    BOOST_TEST_CONTEXT(shape_name(rows, cols)) {
      Comparison r;
      BOOST_REQUIRE_NO_THROW(r = compare(ns_gemm_plan(rows, cols), rows, cols, seed++));
      BOOST_TEST(r.max_diff < 1e-12);
      BOOST_TEST(r.padding_intact);
      BOOST_TEST(r.max_abs > 1e-3);  // a real comparison, values bounded
      BOOST_TEST(r.max_abs < 10.0);
      BOOST_TEST_MESSAGE(shape_name(rows, cols) << ": max |diff| " << r.max_diff << ", max |X| " << r.max_abs);
    }
  }
}

BOOST_AUTO_TEST_CASE(wrong_plans_are_detected) {
  struct Mutation {
    const char* name;
    std::vector<std::pair<int64_t, int64_t>> shapes;
    std::function<void(NsGemmPlan&)> apply;
  };
  const std::vector<Mutation> mutations = {
      {"apply trans_a flipped", {{3, 5}, {4, 4}, {1, 7}, {17, 40}, {64, 64}, {33, 65}},
       [](NsGemmPlan& p) { p.apply.trans_a = !p.apply.trans_a; }},
      {"apply A and B swapped", {{5, 3}, {7, 1}, {40, 17}, {3, 5}, {33, 65}},
       [](NsGemmPlan& p) { std::swap(p.apply.a, p.apply.b); }},
      {"gram trans_a flipped", {{3, 5}, {5, 3}, {4, 4}, {1, 7}, {7, 1}, {17, 40}, {40, 17}, {64, 64}},
       [](NsGemmPlan& p) { p.gram.trans_a = !p.gram.trans_a; }},
      {"apply writes over X", {{3, 5}, {5, 3}, {4, 4}, {64, 64}},
       [](NsGemmPlan& p) { p.apply.d.operand = NsOperand::x; }},
      {"apply reads T instead of B", {{3, 5}, {5, 3}, {4, 4}, {17, 40}},
       [](NsGemmPlan& p) { (p.apply.a.operand == NsOperand::b ? p.apply.a : p.apply.b).operand = NsOperand::t; }},
      {"apply ld one too large", {{3, 5}, {5, 3}, {17, 40}, {40, 17}},
       [](NsGemmPlan& p) {
         NsMatrixSpec& x = p.apply.a.operand == NsOperand::x ? p.apply.a : p.apply.b;
         x.ld += 1;
         p.apply.d.ld += 1;
       }},
      {"square writes over A", {{1, 1}, {4, 4}}, [](NsGemmPlan& p) { p.square.d.operand = NsOperand::gram; }},
  };
  for (const Mutation& m : mutations)
    for (const auto& [rows, cols] : m.shapes) {
      BOOST_TEST_CONTEXT(m.name << ", " << shape_name(rows, cols)) {
        NsGemmPlan plan = ns_gemm_plan(rows, cols);
        BOOST_TEST(!detected(plan, rows, cols));  // the real plan passes
        m.apply(plan);
        BOOST_TEST(detected(plan, rows, cols));
      }
    }
}

// Gram Newton-Schulz's GEMMs (ns_gram_plan.h) run on the three layouts planned for the standard iteration
// (newton_schulz_cuda.cu plans each once), on the buffers the loop names; X = Q X writes the other X
// buffer, never its own input. Their values are checked bit for bit against the spec's loop in
// test_cuda_emulated (batches_equal_the_spec_loop_bit_for_bit).
BOOST_AUTO_TEST_CASE(gram_plan_reuses_the_layouts_on_its_own_operands) {
  using O = NsOperand;
  auto operands = [](const NsGemmSpec& g) { return std::vector<O>{g.a.operand, g.b.operand, g.d.operand}; };
  for (const auto& [rows, cols] : kShapes) {
    if (rows == cols) continue;  // square matrices take the standard iteration
    BOOST_TEST_CONTEXT(shape_name(rows, cols)) {
      const NsGemmPlan p = ns_gemm_plan(rows, cols);
      const NsGramPlan g = ns_gram_plan(p);
      for (const NsGemmSpec* gram : {&g.gram_x, &g.gram_u}) BOOST_TEST(same_layout(*gram, p.gram));
      for (const NsGemmSpec* square : {&g.c_r, &g.q_z, &g.r_z, &g.z_rz}) BOOST_TEST(same_layout(*square, p.square));
      for (const NsGemmSpec* apply : {&g.apply_x_to_u, &g.apply_u_to_x}) BOOST_TEST(same_layout(*apply, p.apply));
      BOOST_TEST((operands(g.gram_x) == std::vector<O>{O::x, O::x, O::gram}));
      BOOST_TEST((operands(g.gram_u) == std::vector<O>{O::u, O::u, O::gram}));
      BOOST_TEST((operands(g.c_r) == std::vector<O>{O::b, O::gram, O::t}));  // C R, C in the B buffer
      BOOST_TEST((operands(g.q_z) == std::vector<O>{O::q, O::z, O::t}));
      BOOST_TEST((operands(g.r_z) == std::vector<O>{O::gram, O::z, O::t2}));
      BOOST_TEST((operands(g.z_rz) == std::vector<O>{O::z, O::b, O::t}));  // RZ in the B buffer
      // Q X: the s x s operand is Q, X from one buffer into the other, in the standard apply's order.
      const std::vector<O> x_to_u = p.tall ? std::vector<O>{O::q, O::x, O::u} : std::vector<O>{O::x, O::q, O::u};
      const std::vector<O> u_to_x = p.tall ? std::vector<O>{O::q, O::u, O::x} : std::vector<O>{O::u, O::q, O::x};
      BOOST_TEST((operands(g.apply_x_to_u) == x_to_u));
      BOOST_TEST((operands(g.apply_u_to_x) == u_to_x));
    }
  }
}

// The lower panels of a symmetric product (ns_panel_gemm) compute exactly its lower triangle: every
// element (i, j), i >= j, equal to the full GEMM's (the same dot product, summed in the same order), the
// part of the diagonal blocks above the diagonal as the full GEMM has it too, and nothing else written
// (NaN stays NaN), every panel's layouts inside their buffers; for X X^T (wide and tall) and the s x s
// product C A, with several widths, a width of s being the full product in one panel.
BOOST_AUTO_TEST_CASE(lower_panels_compute_the_lower_triangle_and_nothing_else) {
  for (const auto& [rows, cols] : kShapes) {
    const NsGemmPlan plan = ns_gemm_plan(rows, cols);
    const int64_t s = plan.s, x_stride = rows * cols + 7, gram_stride = s * s + 5;
    for (const bool square : {false, true}) {
      const NsGemmSpec& full = square ? plan.square : plan.gram;
      for (const int64_t width : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{5}, s}) {
        BOOST_TEST_CONTEXT(shape_name(rows, cols) << (square ? " C A" : " X X^T") << " width " << width) {
          std::vector<double> x = random_batch(rows, cols, x_stride, 3), u(x.size(), kNaN);
          std::vector<double> gram(static_cast<size_t>(kCount * gram_stride), kNaN), b(gram.size(), kNaN);
          std::mt19937_64 rng(11);
          std::uniform_real_distribution<double> dist(-1, 1);
          for (auto* v : {&gram, &b})  // C and A for the s x s product (A's values need not be symmetric here)
            for (int64_t q = 0; q < kCount; ++q)
              for (int64_t e = 0; e < s * s; ++e) (*v)[static_cast<size_t>(q * gram_stride + e)] = dist(rng);
          std::vector<double> want(gram.size(), kNaN), got(gram.size(), kNaN);
          auto whole = [](std::vector<double>& v) { return LtBuffer<double>{v.data(), static_cast<int64_t>(v.size())}; };
          // The product goes to T; the full GEMM into `want`, the panels into `got`.
          const NsBuffers<LtBuffer<double>> into_want{whole(x), whole(gram), whole(b), whole(want), whole(u)};
          const NsBuffers<LtBuffer<double>> into_got{whole(x), whole(gram), whole(b), whole(got), whole(u)};
          NsGemmSpec to_t = full;
          to_t.d.operand = NsOperand::t;
          lt_matmul<double>(to_t, into_want, kCount, x_stride, gram_stride);
          const std::vector<normuon::fast::SymmetricPanel> panels = normuon::fast::symmetric_panels(s, width);
          BOOST_TEST(panels.size() == static_cast<size_t>((s + width - 1) / width));
          for (const normuon::fast::SymmetricPanel& p : panels)
            BOOST_REQUIRE_NO_THROW(lt_matmul<double>(ns_panel_gemm(to_t, p), into_got, kCount, x_stride, gram_stride));
          int64_t lower_wrong = 0, stray = 0, lower = 0;
          for (int64_t q = 0; q < kCount; ++q)
            for (int64_t j = 0; j < s; ++j)
              for (int64_t i = 0; i < s; ++i) {
                const size_t e = static_cast<size_t>(q * gram_stride + i + j * s);  // column-major (i, j)
                const int64_t c0 = j / width * width;  // the panel holding column j covers rows c0..s
                if (i >= c0) {
                  lower += i >= j;
                  lower_wrong += !(got[e] == want[e]);
                } else {
                  stray += !std::isnan(got[e]);
                }
              }
          BOOST_TEST(lower == kCount * s * (s + 1) / 2);
          BOOST_TEST(lower_wrong == 0);
          BOOST_TEST(stray == 0);
          for (int64_t q = 0; q < kCount; ++q)  // the padding between matrices
            for (int64_t e = s * s; e < gram_stride; ++e) BOOST_TEST(std::isnan(got[static_cast<size_t>(q * gram_stride + e)]));
        }
      }
    }
  }
}

// The backend's panel width (ns_auto_panel_width): the full product (s) for small or lonely matrices, and
// where a panel would do too little arithmetic per byte it reads; else a multiple of 128 below s that makes
// 2 to 8 panels, never fewer panels for a larger batch.
BOOST_AUTO_TEST_CASE(auto_panel_width_splits_only_what_fills_the_gpu) {
  // moe-8x64's 512 x 1024 experts: 4 panels of 128 would re-read X for each, under 110 FLOP per byte.
  BOOST_TEST(ns_auto_panel_width(512, 512) == 512);
  BOOST_TEST(ns_panel_intensity(128, 128, 512) < 110);
  // gpt-1.3b's 2048: 2 panels of 1024 would do 410 FLOP per byte, under kNsPanelMinIntensity.
  BOOST_TEST(ns_auto_panel_width(2048, 24) == 2048);
  BOOST_TEST(ns_panel_intensity(1024, 1024, 2048) == 1024.0 * 2048 / (2 * 2048 + 1024), boost::test_tools::tolerance(1e-12));
  BOOST_TEST(ns_auto_panel_width(8192, 24) == 1024);  // 8 panels: the last at 482 FLOP per byte
  BOOST_TEST(ns_auto_panel_width(4096, 24) == 1024);  // 4 panels (8 of 512 would be at 241)
  BOOST_TEST(ns_auto_panel_width(8192, 1) == 2048);   // one matrix: 4 panels (8 would leave SMs idle)
  BOOST_TEST(ns_auto_panel_width(64, 1000) == 64);
  for (const int64_t s : {int64_t{1}, int64_t{100}, int64_t{128}, int64_t{300}, int64_t{768}, int64_t{2048}, int64_t{4096},
                          int64_t{8192}})
    for (const int64_t count : {int64_t{1}, int64_t{3}, int64_t{12}, int64_t{24}, int64_t{96}, int64_t{1000}}) {
      BOOST_TEST_CONTEXT("s " << s << " count " << count) {
        const int64_t w = ns_auto_panel_width(s, count);
        const int64_t panels = (s + w - 1) / w;
        BOOST_TEST((w == s || (w % 128 == 0 && w < s)));
        BOOST_TEST(panels <= 8);
        BOOST_TEST(ns_panels(s, count, 0).size() == static_cast<size_t>(panels));
        const int64_t more = (s + ns_auto_panel_width(s, count * 2) - 1) / ns_auto_panel_width(s, count * 2);
        BOOST_TEST(more >= panels);
      }
    }
  BOOST_TEST(ns_panels(10, 1, 3).size() == 4u);   // a width of its own
  BOOST_TEST(ns_panels(10, 1, 99).size() == 1u);  // past s: the full product
  BOOST_TEST(ns_panels(8192, 1, 1).size() == 64u);  // at most kNsMaxPanels
  BOOST_TEST(ns_panels(8192, 1, 1).front().width == 128);
}

// The alignment each panel GEMM is planned for: the largest power of two up to 256 bytes dividing the
// operand's byte offset (0: the buffer's own 256).
BOOST_AUTO_TEST_CASE(operand_alignment_is_what_the_offset_keeps) {
  BOOST_TEST(ns_operand_alignment(0, 2) == 256u);
  BOOST_TEST(ns_operand_alignment(128, 2) == 256u);  // a 128-multiple width keeps 256 bytes in bf16
  BOOST_TEST(ns_operand_alignment(128 * 2049, 2) == 256u);  // c0 (1 + s), c0 = 128
  BOOST_TEST(ns_operand_alignment(64, 2) == 128u);
  BOOST_TEST(ns_operand_alignment(8, 2) == 16u);
  BOOST_TEST(ns_operand_alignment(7, 2) == 2u);
  BOOST_TEST(ns_operand_alignment(7, 4) == 4u);
  BOOST_TEST(ns_operand_alignment(7 * 8, 4) == 32u);
}
