// The spec GEMM (reference/spec_gemm.h): every instruction set this processor has, at 1 and 2 threads,
// gives the bits of the plain chain, acc = fma(a, b, acc) in increasing k, on shapes that cut every tile
// and block, with products that underflow, signed zeros and the X X^T path that mirrors its lower half.
#define BOOST_TEST_MODULE spec_gemm
#include <boost/test/unit_test.hpp>

#include <omp.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "normuon/grad_gen.h"
#include "spec_gemm.h"
#include "spec_ops.h"

using namespace normuon;

namespace {

std::vector<float> values(int64_t n, uint64_t seed, bool bf16) {
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    float v = counter_normal(seed, 0, 0, static_cast<uint64_t>(i));
    if (i % 17 == 3) v *= 1e-25f;  // products below fp32's normal range
    if (i % 29 == 5) v = -0.0f;
    x[i] = bf16 ? spec::round_bf16(v) : v;
  }
  return x;
}

std::vector<float> plain_chains(const std::vector<float>& A, const std::vector<float>& B, bool b_rows, int64_t m,
                                int64_t k, int64_t n, bool bf16) {
  std::vector<float> C(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      float acc = 0.0f;
      for (int64_t t = 0; t < k; ++t) acc = std::fma(A[i * k + t], b_rows ? B[j * k + t] : B[t * n + j], acc);
      C[i * n + j] = spec::P(acc, bf16);
    }
  return C;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

BOOST_AUTO_TEST_CASE(every_isa_and_thread_count_gives_the_plain_chains_bits) {
  struct Shape {
    int64_t m, k, n;
  };
  // The last two are large enough to run on several threads.
  const Shape shapes[] = {{1, 1, 1},   {13, 7, 35},     {25, 257, 33}, {40, 600, 17},
                          {7, 0, 5},   {70, 500, 150},  {150, 300, 70}};
  int isas = 0;
  for (spec::GemmIsa isa : {spec::GemmIsa::scalar, spec::GemmIsa::avx2, spec::GemmIsa::avx512, spec::GemmIsa::neon}) {
    if (!spec::gemm_isa_available(isa)) continue;
    ++isas;
    for (const Shape& s : shapes)
      for (bool bf16 : {true, false})
        for (bool b_rows : {false, true})
          for (int threads : {1, 2}) {
            omp_set_num_threads(threads);
            const std::vector<float> A = values(s.m * s.k, 1, bf16), B = values(s.k * s.n, 2, bf16);
            std::vector<float> C(static_cast<size_t>(s.m * s.n), 99.0f);
            spec::gemm_on(isa, A.data(), B.data(), b_rows, C.data(), s.m, s.k, s.n, bf16);
            BOOST_TEST(same_bits(C, plain_chains(A, B, b_rows, s.m, s.k, s.n, bf16)),
                       spec::to_string(isa) << " " << s.m << "x" << s.k << "x" << s.n << " bf16 " << bf16 << " b_rows "
                                            << b_rows << " threads " << threads);
          }
  }
  BOOST_TEST_MESSAGE("instruction sets checked: " << isas << "; gemm() uses " << spec::to_string(spec::gemm_isa()));
}

BOOST_AUTO_TEST_CASE(x_times_its_transpose_mirrors_the_same_chains) {
  for (spec::GemmIsa isa : {spec::GemmIsa::scalar, spec::GemmIsa::avx2, spec::GemmIsa::avx512, spec::GemmIsa::neon}) {
    if (!spec::gemm_isa_available(isa)) continue;
    for (int64_t m : {1, 11, 50, 130}) {  // 130 x 300 x 130: on several threads
      const int64_t k = 300;
      const std::vector<float> X = values(m * k, 3, true);
      std::vector<float> C(static_cast<size_t>(m * m));
      spec::gemm_on(isa, X.data(), X.data(), true, C.data(), m, k, m, true);  // the lower-half path
      BOOST_TEST(same_bits(C, plain_chains(X, X, true, m, k, m, true)), spec::to_string(isa) << " m " << m);
    }
  }
}

BOOST_AUTO_TEST_CASE(non_finite_values_propagate_as_in_the_chain) {
  std::vector<float> A = values(4 * 9, 4, false), B = values(9 * 5, 5, false);
  A[2] = NAN;
  B[7] = INFINITY;
  std::vector<float> C(20);
  spec::gemm_on(spec::GemmIsa::scalar, A.data(), B.data(), false, C.data(), 4, 9, 5, false);
  const std::vector<float> want = plain_chains(A, B, false, 4, 9, 5, false);
  for (size_t e = 0; e < C.size(); ++e) {
    BOOST_TEST(std::isnan(C[e]) == std::isnan(want[e]));
    if (!std::isnan(want[e])) BOOST_TEST(C[e] == want[e]);
  }
}

BOOST_AUTO_TEST_CASE(an_instruction_set_the_processor_lacks_is_refused) {
  std::vector<float> A(4, 1.0f), C(4, 7.0f);
  const spec::GemmIsa missing = spec::gemm_isa_available(spec::GemmIsa::neon) ? spec::GemmIsa::avx512 : spec::GemmIsa::neon;
  BOOST_REQUIRE(!spec::gemm_isa_available(missing));
  BOOST_CHECK_THROW(spec::gemm_on(missing, A.data(), A.data(), false, C.data(), 2, 2, 2, false), std::invalid_argument);
  BOOST_TEST(C[0] == 7.0f);  // nothing written
}
