// The Newton-Schulz GEMM plan (fast/cuda/ns_gemm_plan.h) that the CUDA backend hands to cuBLASLt, run
// on the CPU: a double-precision emulator of cuBLASLt's strided-batched column-major matmul executes
// the plan's GEMMs on buffers laid out as the backend lays them out, and the result must match a direct
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

#include "ns_gemm_plan.h"

using namespace normuon::cuda;

namespace {

constexpr double kA = 3.4445, kB = -4.7750, kC = 2.0315;
constexpr int kSteps = 3;
constexpr int64_t kCount = 3;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// A plan the emulator refuses (a cuBLASLt dimension rule or a buffer bound broken).
struct LayoutError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The backend's buffers for one batch: two ping-pong X buffers (kCount row-major rows x cols matrices,
// x_stride apart) and the s x s Gram and B buffers (gram_stride apart). Unwritten elements are NaN.
struct Memory {
  int64_t x_stride = 0, gram_stride = 0;
  std::vector<double> x[2], gram, b;

  int64_t size_of(const double* p) const {
    for (const std::vector<double>* v : {&x[0], &x[1], &gram, &b})
      if (v->data() == p) return static_cast<int64_t>(v->size());
    throw std::logic_error("pointer outside the batch's buffers");
  }
};

void require(bool ok, const std::string& what) {
  if (!ok) throw LayoutError(what);
}

// One layout as cuBLASLt is told it: sane sizes, batch entries that do not overlap, inside the buffer.
void check_layout(const char* name, const NsMatrixSpec& m, int64_t stride, int64_t buffer_size) {
  const std::string n = name;
  require(m.rows >= 1 && m.cols >= 1, n + ": empty matrix");
  require(m.ld >= m.rows, n + ": ld < rows");
  const int64_t extent = m.ld * (m.cols - 1) + m.rows;
  require(extent <= stride, n + ": batch entries overlap (extent > stride)");
  require((kCount - 1) * stride + extent <= buffer_size, n + ": past the end of its buffer");
}

// cuBLASLt's strided-batched matmul, column-major, in double: D = alpha op(A) op(B) + beta C for each
// of kCount batch entries, D with C's layout (as the backend plans it). beta = 0 does not read C.
void lt_matmul(const NsGemmSpec& g, const Memory& mem, const NsGemmPointers<double*>& p, double alpha,
               double beta) {
  const int64_t sa = ns_batch_stride(g.a.operand, mem.x_stride, mem.gram_stride);
  const int64_t sb = ns_batch_stride(g.b.operand, mem.x_stride, mem.gram_stride);
  const int64_t sc = ns_batch_stride(g.c.operand, mem.x_stride, mem.gram_stride);
  check_layout("A", g.a, sa, mem.size_of(p.a));
  check_layout("B", g.b, sb, mem.size_of(p.b));
  check_layout("C", g.c, sc, mem.size_of(p.c));
  check_layout("D", g.c, sc, mem.size_of(p.d));
  // op(A) is m x k, op(B) is k x n.
  const int64_t m = g.trans_a ? g.a.cols : g.a.rows;
  const int64_t k = g.trans_a ? g.a.rows : g.a.cols;
  const int64_t kb = g.trans_b ? g.b.cols : g.b.rows;
  const int64_t n = g.trans_b ? g.b.rows : g.b.cols;
  require(k == kb, "op(A) has " + std::to_string(k) + " columns, op(B) " + std::to_string(kb) + " rows");
  require(g.c.rows == m && g.c.cols == n, "C is " + std::to_string(g.c.rows) + "x" + std::to_string(g.c.cols) +
                                              ", op(A) op(B) " + std::to_string(m) + "x" + std::to_string(n));
  require(p.d != p.a && p.d != p.b, "D overwrites an input of the same GEMM");

  std::vector<double> out(static_cast<size_t>(m * n));
  for (int64_t q = 0; q < kCount; ++q) {
    const double* a = p.a + q * sa;
    const double* b = p.b + q * sb;
    const double* c = p.c + q * sc;
    double* d = p.d + q * sc;
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < m; ++i) {
        double sum = 0;
        for (int64_t t = 0; t < k; ++t) {
          const double av = g.trans_a ? a[t + i * g.a.ld] : a[i + t * g.a.ld];
          const double bv = g.trans_b ? b[j + t * g.b.ld] : b[t + j * g.b.ld];
          sum += av * bv;
        }
        double v = alpha * sum;
        if (beta != 0) v += beta * c[i + j * g.c.ld];
        out[static_cast<size_t>(i + j * m)] = v;
      }
    for (int64_t j = 0; j < n; ++j)  // written after the reads: C and D may be the same buffer
      for (int64_t i = 0; i < m; ++i) d[i + j * g.c.ld] = out[static_cast<size_t>(i + j * m)];
  }
}

// kCount random row-major rows x cols matrices, x_stride apart, NaN in the padding.
std::vector<double> random_batch(int64_t rows, int64_t cols, int64_t x_stride, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(-0.1, 0.1);
  std::vector<double> x(static_cast<size_t>(kCount * x_stride), kNaN);
  for (int64_t q = 0; q < kCount; ++q)
    for (int64_t e = 0; e < rows * cols; ++e) x[static_cast<size_t>(q * x_stride + e)] = dist(rng);
  return x;
}

// kSteps iterations through the plan, as BatchedNewtonSchulz::run issues them; returns the output buffer.
std::vector<double> run_plan(const NsGemmPlan& plan, const std::vector<double>& input, int64_t x_stride,
                             int64_t gram_stride) {
  Memory mem;
  mem.x_stride = x_stride;
  mem.gram_stride = gram_stride;
  mem.x[0] = input;
  mem.x[1].assign(input.size(), kNaN);
  mem.gram.assign(static_cast<size_t>(kCount * gram_stride), kNaN);
  mem.b.assign(mem.gram.size(), kNaN);
  for (int k = 0; k < kSteps; ++k) {
    const NsBuffers<double*> buf{mem.x[k % 2].data(), mem.x[(k + 1) % 2].data(), mem.gram.data(), mem.b.data()};
    lt_matmul(plan.gram, mem, ns_gemm_pointers(plan.gram, buf), 1.0, 0.0);    // A = X X^T
    lt_matmul(plan.square, mem, ns_gemm_pointers(plan.square, buf), kC, kB);  // B = c A A + b A
    lt_matmul(plan.apply, mem, ns_gemm_pointers(plan.apply, buf), 1.0, kA);   // X' = B X + a X
  }
  return mem.x[kSteps % 2];
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
      // D takes C's layout and batch stride: both must be X buffers or both s x s buffers.
      for (const NsGemmSpec* g : {&p.gram, &p.square, &p.apply})
        BOOST_TEST((g->c.operand == NsOperand::x) == (g->d == NsOperand::x));
      BOOST_TEST((p.gram.d == NsOperand::gram && p.square.d == NsOperand::b && p.apply.d == NsOperand::x));
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
      {"apply C read from B", {{3, 5}, {5, 3}, {4, 4}, {64, 64}},
       [](NsGemmPlan& p) { p.apply.c.operand = NsOperand::b; }},
      {"apply ld one too large", {{3, 5}, {5, 3}, {17, 40}, {40, 17}},
       [](NsGemmPlan& p) {
         NsMatrixSpec& x = p.apply.a.operand == NsOperand::x ? p.apply.a : p.apply.b;
         x.ld += 1;
         p.apply.c.ld += 1;
       }},
      {"square writes over A", {{1, 1}, {4, 4}}, [](NsGemmPlan& p) { p.square.d = NsOperand::gram; }},
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
