// The loops of fast/ns_elementwise.h as templates, kept apart so that a test can build them for each ISA
// level itself (tests/test_ns_elementwise.cpp) and check that every clone gives the same bits. Internal:
// include ns_elementwise.h to use them.
#pragma once

#include <algorithm>
#include <cstdint>

#include "ns_elementwise.h"

namespace normuon::fast::ns_loops {

template <typename T>
inline float load(T x) { return ns_widen(x); }
template <typename T>
inline void store(T& d, float x) { ns_round_into(d, x); }
template <typename T>
inline float P(float x) { return ns_round<T>(x); }

// Transposes in square tiles that stay in L1, so that neither side is walked a whole row apart.
constexpr int64_t kTile = 32;

template <typename T>
inline void load_into(const float* u, T* x, int64_t rows, int64_t cols, bool transpose) {
  if (!transpose) {
    for (int64_t i = 0; i < rows * cols; ++i) store(x[i], u[i]);
    return;
  }
  for (int64_t i0 = 0; i0 < rows; i0 += kTile)
    for (int64_t j0 = 0; j0 < cols; j0 += kTile) {
      const int64_t i1 = std::min(i0 + kTile, rows), j1 = std::min(j0 + kTile, cols);
      for (int64_t j = j0; j < j1; ++j)
        for (int64_t i = i0; i < i1; ++i) store(x[j * rows + i], u[i * cols + j]);
    }
}

template <typename T>
inline void store_from(const T* x, float* o, int64_t rows, int64_t cols, bool transpose) {
  if (!transpose) {
    for (int64_t i = 0; i < rows * cols; ++i) o[i] = load(x[i]);
    return;
  }
  for (int64_t i0 = 0; i0 < rows; i0 += kTile)
    for (int64_t j0 = 0; j0 < cols; j0 += kTile) {
      const int64_t i1 = std::min(i0 + kTile, rows), j1 = std::min(j0 + kTile, cols);
      for (int64_t j = j0; j < j1; ++j)
        for (int64_t i = i0; i < i1; ++i) o[j * rows + i] = load(x[i * cols + j]);
    }
}

template <typename T>
inline double sum_squares(const T* x, int64_t n) {
  constexpr int kLanes = 8;
  double s[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int k = 0; k < kLanes; ++k) {
      const double v = load(x[i + k]);
      s[k] += v * v;
    }
  for (int k = 0; i < n; ++i, ++k) {
    const double v = load(x[i]);
    s[k] += v * v;
  }
  double total = 0;
  for (double part : s) total += part;
  return total;
}

template <typename T>
inline void divide(T* x, float d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) store(x[i], load(x[i]) / d);
}
template <typename T>
inline void scale(T* __restrict d, const T* __restrict a, float c, int64_t n) {
  for (int64_t i = 0; i < n; ++i) store(d[i], c * load(a[i]));
}
template <typename T>
inline void scaled_add(T* __restrict d, const T* __restrict a, const T* __restrict g, float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) store(d[i], P<T>(s * load(a[i])) + load(g[i]));
}
template <typename T>
inline void scaled_add_in_place(T* x, const T* __restrict g, float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) store(x[i], P<T>(s * load(x[i])) + load(g[i]));
}

}  // namespace normuon::fast::ns_loops
