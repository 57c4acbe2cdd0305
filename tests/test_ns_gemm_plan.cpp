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
// elementwise steps of an iteration (ns_kernels.cuh, ns_combine), in double. Padding stays untouched.
void combine(std::vector<double>& dst, const std::vector<double>& src, const std::vector<double>* add, double coef,
             int64_t n, int64_t stride) {
  for (int64_t q = 0; q < kCount; ++q)
    for (int64_t e = q * stride; e < q * stride + n; ++e)
      dst[static_cast<size_t>(e)] = coef * src[static_cast<size_t>(e)] + (add ? (*add)[static_cast<size_t>(e)] : 0.0);
}

// kSteps iterations through the plan, in the order of run_newton_schulz (ns_kernels.cuh); X in place.
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
// test_cuda_emulated (gram_batches_equal_the_spec_loop_bit_for_bit).
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
