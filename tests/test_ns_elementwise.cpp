// Newton-Schulz's vectorised elementwise passes (fast/ns_elementwise.h) against the scalar formulas of
// docs/spec.md section 3.2, bit for bit, in both working precisions: rounding ties, signed zeros, tiny
// and huge values, NaN, lengths that leave a vector tail, and transposes that leave partial tiles.
#define BOOST_TEST_MODULE ns_elementwise
#include <boost/test/unit_test.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "ns_elementwise.h"

using namespace normuon::fast;

namespace {

uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
float from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// bf16 by round-to-nearest-even on the bits, written out here independently of the library's helper.
Bf16 to_bf16(float x) {
  const uint32_t u = bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<Bf16>(u >> 16);  // NaN: the upper half
  const uint32_t lower = u & 0xffffu, upper = u >> 16;
  const bool up = lower > 0x8000u || (lower == 0x8000u && (upper & 1u));
  return static_cast<Bf16>(upper + (up ? 1u : 0u));
}
float from_bf16(Bf16 b) { return from_bits(static_cast<uint32_t>(b) << 16); }
float bf16_rounded(float x) { return from_bf16(to_bf16(x)); }

// Values that probe the rounding: random normals, exact ties both ways, zeros, subnormals, extremes.
std::vector<float> probe_values(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::uniform_int_distribution<uint32_t> any_bits;
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    switch (i % 8) {
      case 0: v[i] = from_bits((any_bits(rng) & 0xffff0000u) | 0x8000u); break;   // a tie
      case 1: v[i] = from_bits(any_bits(rng)); break;                              // any bits
      case 2: v[i] = i % 16 == 2 ? -0.0f : std::numeric_limits<float>::denorm_min() * static_cast<float>(i); break;
      default: v[i] = normal(rng);
    }
    if (std::isinf(v[i])) v[i] = 1.0f;
  }
  if (n > 5) v[5] = std::numeric_limits<float>::quiet_NaN();
  return v;
}

bool same_bits(float a, float b) { return bits(a) == bits(b); }

std::vector<Bf16> as_bf16(const std::vector<float>& v) {
  std::vector<Bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = to_bf16(v[i]);
  return out;
}

}  // namespace

BOOST_AUTO_TEST_CASE(scale_and_scaled_add_round_as_the_scalar_formulas) {
  for (size_t n : {1u, 7u, 64u, 1000u + 13u}) {
    const std::vector<float> a = probe_values(n, 1), g = probe_values(n, 2);
    const std::vector<Bf16> ab = as_bf16(a), gb = as_bf16(g);
    for (float s : {3.4445f, -4.775f, 2.0315f, 1.0f}) {
      std::vector<float> d(n), x = a;
      std::vector<Bf16> db(n), xb = ab;
      ns_scale(d.data(), a.data(), s, static_cast<int64_t>(n));
      ns_scale(db.data(), ab.data(), s, static_cast<int64_t>(n));
      for (size_t i = 0; i < n; ++i) {
        BOOST_TEST(same_bits(d[i], s * a[i]), "fp32 scale, n " << n << " i " << i);
        BOOST_TEST(db[i] == to_bf16(s * from_bf16(ab[i])), "bf16 scale, n " << n << " i " << i);
      }
      ns_scaled_add(d.data(), a.data(), g.data(), s, static_cast<int64_t>(n));
      ns_scaled_add(db.data(), ab.data(), gb.data(), s, static_cast<int64_t>(n));
      ns_scaled_add_in_place(x.data(), g.data(), s, static_cast<int64_t>(n));
      ns_scaled_add_in_place(xb.data(), gb.data(), s, static_cast<int64_t>(n));
      for (size_t i = 0; i < n; ++i) {
        const float want = s * a[i] + g[i];
        const Bf16 want_b = to_bf16(bf16_rounded(s * from_bf16(ab[i])) + from_bf16(gb[i]));
        BOOST_TEST(same_bits(d[i], want), "fp32 scaled_add, n " << n << " i " << i);
        BOOST_TEST(same_bits(x[i], want), "fp32 in place, n " << n << " i " << i);
        BOOST_TEST(db[i] == want_b, "bf16 scaled_add, n " << n << " i " << i);
        BOOST_TEST(xb[i] == want_b, "bf16 in place, n " << n << " i " << i);
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(divide_and_sum_squares) {
  const size_t n = 1000 + 5;
  std::vector<float> v = probe_values(n, 3);
  for (float& x : v)
    if (!std::isfinite(x) || std::fabs(x) > 1e30f) x = 0.5f;  // a norm of finite values that does not overflow
  const std::vector<Bf16> vb = as_bf16(v);
  double want = 0, want_b = 0;
  for (size_t i = 0; i < n; ++i) {
    want += static_cast<double>(v[i]) * v[i];
    want_b += static_cast<double>(from_bf16(vb[i])) * from_bf16(vb[i]);
  }
  // A fixed order of its own: within double rounding of the plain sum, and the same on every call.
  const double got = ns_sum_squares(v.data(), static_cast<int64_t>(n));
  BOOST_TEST(std::fabs(got - want) <= 1e-12 * want);
  BOOST_TEST(std::fabs(ns_sum_squares(vb.data(), static_cast<int64_t>(n)) - want_b) <= 1e-12 * want_b);
  BOOST_TEST(got == ns_sum_squares(v.data(), static_cast<int64_t>(n)));

  std::vector<float> x = v;
  std::vector<Bf16> xb = vb;
  const float d = 7.3f;
  ns_divide(x.data(), d, static_cast<int64_t>(n));
  ns_divide(xb.data(), d, static_cast<int64_t>(n));
  for (size_t i = 0; i < n; ++i) {
    BOOST_TEST(same_bits(x[i], v[i] / d), i);
    BOOST_TEST(xb[i] == to_bf16(from_bf16(vb[i]) / d), i);
  }
}

BOOST_AUTO_TEST_CASE(load_and_store_transpose_in_tiles) {
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{45, 77}, {77, 45}, {32, 64}, {1, 33}, {33, 1}}) {
    const std::vector<float> u = probe_values(static_cast<size_t>(rows * cols), 4);
    for (bool transpose : {false, true}) {
      std::vector<float> x(u.size()), o(u.size());
      std::vector<Bf16> xb(u.size());
      std::vector<float> ob(u.size());
      ns_load(u.data(), x.data(), rows, cols, transpose);
      ns_load(u.data(), xb.data(), rows, cols, transpose);
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) {
          const int64_t at = transpose ? j * rows + i : i * cols + j;
          BOOST_TEST(same_bits(x[at], u[i * cols + j]));
          BOOST_TEST(xb[at] == to_bf16(u[i * cols + j]));
        }
      // Back to the stored orientation: X is rows x cols, or cols x rows when transposed.
      const int64_t xr = transpose ? cols : rows, xc = transpose ? rows : cols;
      ns_store(x.data(), o.data(), xr, xc, transpose);
      ns_store(xb.data(), ob.data(), xr, xc, transpose);
      for (size_t k = 0; k < u.size(); ++k) {
        BOOST_TEST(same_bits(o[k], u[k]), rows << "x" << cols << " k " << k);
        BOOST_TEST(same_bits(ob[k], bf16_rounded(u[k])), rows << "x" << cols << " k " << k);
      }
    }
  }
}
