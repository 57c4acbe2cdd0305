// Newton-Schulz's vectorised elementwise passes (fast/ns_elementwise.h) against the scalar formulas of
// docs/spec.md section 3.2, bit for bit, in both working precisions: rounding ties, signed zeros, tiny
// and huge values, NaN, lengths that leave a vector tail, and transposes that leave partial tiles. The
// library runs the clone of this CPU's ISA level; the same loops built here for the baseline and (where
// the CPU has it) x86-64-v3 must give the same bits.
#define BOOST_TEST_MODULE ns_elementwise
#include <boost/test/unit_test.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "ns_elementwise.h"
#include "ns_elementwise_loops.h"

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

// bf16 as torch rounds (c10::BFloat16), written out here independently of the library's helper:
// nearest even, every NaN the quiet 0x7fc0.
Bf16 to_bf16(float x) {
  const uint32_t u = bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
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
  // The documented order: eight interleaved partial sums (element i into sum i mod 8), added in turn.
  double lanes[8] = {}, lanes_b[8] = {};
  for (size_t i = 0; i < n; ++i) {
    lanes[i % 8] += static_cast<double>(v[i]) * v[i];
    lanes_b[i % 8] += static_cast<double>(from_bf16(vb[i])) * from_bf16(vb[i]);
  }
  double ordered = 0, ordered_b = 0;
  for (int k = 0; k < 8; ++k) ordered += lanes[k], ordered_b += lanes_b[k];
  const double got = ns_sum_squares(v.data(), static_cast<int64_t>(n));
  BOOST_TEST(got == ordered);
  BOOST_TEST(ns_sum_squares(vb.data(), static_cast<int64_t>(n)) == ordered_b);
  BOOST_TEST(std::fabs(got - want) <= 1e-12 * want);  // and within double rounding of the plain sum

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

BOOST_AUTO_TEST_CASE(a_nan_stays_a_nan_in_bf16) {
  // A NaN whose payload is all in the lower half: its upper half alone would be +Inf.
  const float low_nan = from_bits(0x7f800001u), neg_nan = from_bits(0xff800003u);
  const float u[4] = {low_nan, 1.0f, neg_nan, -2.0f};
  Bf16 x[4];
  ns_load(u, x, 1, 4, false);
  BOOST_TEST(x[0] == 0x7fc0);
  BOOST_TEST(x[2] == 0x7fc0);
  BOOST_TEST(from_bf16(x[1]) == 1.0f);
  Bf16 d[4];
  ns_scale(d, x, 2.0f, 4);
  BOOST_TEST(std::isnan(from_bf16(d[0])));
  BOOST_TEST(from_bf16(d[3]) == -4.0f);
}

// The loops of the library, built in this file for the baseline ISA and for x86-64-v3 (where supported).
namespace {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define NORMUON_TEST_V3 1
#define V3 __attribute__((target("arch=x86-64-v3")))
#else
#define V3
#endif

template <typename T>
struct Outputs {
  std::vector<T> loaded, transposed, scaled, added, in_place, divided;
  std::vector<float> stored;
  double squares = 0;
  bool operator==(const Outputs& o) const {
    return loaded == o.loaded && transposed == o.transposed && scaled == o.scaled && added == o.added &&
           in_place == o.in_place && divided == o.divided &&
           std::memcmp(stored.data(), o.stored.data(), stored.size() * sizeof(float)) == 0 && squares == o.squares;
  }
};

constexpr int64_t kRows = 45, kCols = 77;  // partial tiles and vector tails

template <typename T, typename Loops>
Outputs<T> run_all(const std::vector<float>& u, Loops loops) {
  const int64_t n = kRows * kCols;
  Outputs<T> o;
  o.loaded.resize(n);
  o.transposed.resize(n);
  o.stored.resize(n);
  loops.load(u.data(), o.loaded.data(), false);
  loops.load(u.data(), o.transposed.data(), true);
  loops.store(o.transposed.data(), o.stored.data());
  o.scaled.resize(n);
  loops.scale(o.scaled.data(), o.loaded.data(), -4.775f, n);
  o.added.resize(n);
  loops.scaled_add(o.added.data(), o.loaded.data(), o.scaled.data(), 3.4445f, n);
  o.in_place = o.loaded;
  loops.scaled_add_in_place(o.in_place.data(), o.scaled.data(), 2.0315f, n);
  o.divided = o.loaded;
  loops.divide(o.divided.data(), 7.3f, n);
  o.squares = loops.sum_squares(o.loaded.data(), n);
  return o;
}

// One set of loops per ISA: the library's dispatch, and the templates compiled here.
template <typename T>
struct Library {
  void load(const float* u, T* x, bool t) { ns_load(u, x, kRows, kCols, t); }
  void store(const T* x, float* o) { ns_store(x, o, kCols, kRows, true); }
  void scale(T* d, const T* a, float c, int64_t n) { ns_scale(d, a, c, n); }
  void scaled_add(T* d, const T* a, const T* g, float s, int64_t n) { ns_scaled_add(d, a, g, s, n); }
  void scaled_add_in_place(T* x, const T* g, float s, int64_t n) { ns_scaled_add_in_place(x, g, s, n); }
  void divide(T* x, float d, int64_t n) { ns_divide(x, d, n); }
  double sum_squares(const T* x, int64_t n) { return ns_sum_squares(x, n); }
};
template <typename T>
struct Baseline {
  void load(const float* u, T* x, bool t) { ns_loops::load_into(u, x, kRows, kCols, t); }
  void store(const T* x, float* o) { ns_loops::store_from(x, o, kCols, kRows, true); }
  void scale(T* d, const T* a, float c, int64_t n) { ns_loops::scale(d, a, c, n); }
  void scaled_add(T* d, const T* a, const T* g, float s, int64_t n) { ns_loops::scaled_add(d, a, g, s, n); }
  void scaled_add_in_place(T* x, const T* g, float s, int64_t n) { ns_loops::scaled_add_in_place(x, g, s, n); }
  void divide(T* x, float d, int64_t n) { ns_loops::divide(x, d, n); }
  double sum_squares(const T* x, int64_t n) { return ns_loops::sum_squares(x, n); }
};
template <typename T>
struct AtV3 {
  V3 void load(const float* u, T* x, bool t) { ns_loops::load_into(u, x, kRows, kCols, t); }
  V3 void store(const T* x, float* o) { ns_loops::store_from(x, o, kCols, kRows, true); }
  V3 void scale(T* d, const T* a, float c, int64_t n) { ns_loops::scale(d, a, c, n); }
  V3 void scaled_add(T* d, const T* a, const T* g, float s, int64_t n) { ns_loops::scaled_add(d, a, g, s, n); }
  V3 void scaled_add_in_place(T* x, const T* g, float s, int64_t n) { ns_loops::scaled_add_in_place(x, g, s, n); }
  V3 void divide(T* x, float d, int64_t n) { ns_loops::divide(x, d, n); }
  V3 double sum_squares(const T* x, int64_t n) { return ns_loops::sum_squares(x, n); }
};

bool cpu_has_v3() {
#ifdef NORMUON_TEST_V3
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2");
#else
  return false;
#endif
}

template <typename T>
void check_every_level() {
  std::vector<float> u = probe_values(static_cast<size_t>(kRows * kCols), 5);
  for (float& x : u)
    if (!std::isfinite(x) || std::fabs(x) > 1e30f) x = 0.25f;  // finite sums and products
  const Outputs<T> library = run_all<T>(u, Library<T>{}), baseline = run_all<T>(u, Baseline<T>{});
  BOOST_TEST((library == baseline), "the library's clone against the baseline build");
  if (cpu_has_v3()) {
    const Outputs<T> v3 = run_all<T>(u, AtV3<T>{});
    BOOST_TEST((library == v3), "the library's clone against the x86-64-v3 build");
  }
}

}  // namespace

BOOST_AUTO_TEST_CASE(every_isa_level_gives_the_same_bits) {
  check_every_level<float>();
  check_every_level<Bf16>();
}
