#include "normuon/grad_gen.h"

#include <cmath>

namespace normuon {

uint64_t mix64(uint64_t x) {  // splitmix64's finaliser: a bijection with full avalanche
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

float counter_normal(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  const uint64_t h = mix64(a ^ mix64(b ^ mix64(c ^ mix64(d))));
  // Irwin-Hall with four 16-bit uniforms: mean 4 * 32767.5, standard deviation sqrt(4 * (65536^2 - 1) / 12).
  const int64_t sum = static_cast<int64_t>((h & 0xffff) + ((h >> 16) & 0xffff) + ((h >> 32) & 0xffff) + (h >> 48));
  constexpr float kInvStd = 1.0f / 37837.2265f;
  return static_cast<float>(2 * sum - 262140) * 0.5f * kInvStd;  // 2*sum-262140 is exact in float
}

namespace {

constexpr uint64_t kParamStream = ~0ull;  // "step" used for initial parameters, never a real step
constexpr uint64_t kRowStream = ~1ull;

// Per-row gain: 1/4..4 in powers of two, and one row in 32 nearly dead (2^-20): exact in float.
float row_gain(uint64_t seed, int entry, int64_t row) {
  const uint64_t h = mix64(seed ^ mix64(kRowStream ^ mix64(static_cast<uint64_t>(entry) ^ mix64(static_cast<uint64_t>(row)))));
  if (h % 32 == 0) return std::ldexp(1.0f, -20);
  return std::ldexp(1.0f, static_cast<int>((h >> 8) % 5) - 2);
}

int64_t row_length(const LayoutEntry& e) { return e.shape.size() == 2 ? e.shape[1] : e.numel; }

}  // namespace

float GradientGenerator::gradient(int entry, int64_t step, int64_t element, int64_t cols) const {
  const int64_t row = cols > 0 ? element / cols : 0;
  return 0.01f * row_gain(seed, entry, row) *
         counter_normal(seed, static_cast<uint64_t>(step), static_cast<uint64_t>(entry), static_cast<uint64_t>(element));
}

void GradientGenerator::fill_gradients(FlatState& state, int64_t step) const {
  const auto& entries = state.layout->entries;
  for (int i = 0; i < static_cast<int>(entries.size()); ++i) {
    const bool has = missing_grad_period <= 0 || (step + i) % missing_grad_period != 0;
    state.has_grad[i] = has ? 1 : 0;
    float* g = state.grad(i);
    const int64_t n = entries[i].numel, cols = row_length(entries[i]);
#pragma omp parallel for schedule(static) if (n > (1 << 16))
    for (int64_t k = 0; k < n; ++k) g[k] = has ? gradient(i, step, k, cols) : 0.0f;
  }
}

void GradientGenerator::fill_params(FlatState& state) const {
  const auto& entries = state.layout->entries;
  for (int i = 0; i < static_cast<int>(entries.size()); ++i) {
    const LayoutEntry& e = entries[i];
    float* p = state.param(i);
    const int64_t n = e.numel;
    if (e.role == Role::norm || e.role == Role::bias) {
      const float value = e.role == Role::norm ? 1.0f : 0.0f;
      for (int64_t k = 0; k < n; ++k) p[k] = value;
      continue;
    }
#pragma omp parallel for schedule(static) if (n > (1 << 16))
    for (int64_t k = 0; k < n; ++k)
      p[k] = 0.02f * counter_normal(seed, kParamStream, static_cast<uint64_t>(i), static_cast<uint64_t>(k));
  }
}

}  // namespace normuon
