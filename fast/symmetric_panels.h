// A symmetric m x m product C = S W (X X^T, or a product of two commuting symmetric matrices) computed
// as its lower triangle only: column panels, panel j holding rows [c0, m) of columns [c0, c0 + width),
// each a dense GEMM of its own (S's rows from c0 on, times W's columns c0.. read as rows of the
// symmetric W, or of X), then written out twice, to (i, j) and to (j, i). Every element is one dot
// product, rounded once (docs/spec.md section 3.2); the upper triangle is the mirror of the lower. With
// p panels the GEMMs do (p + 1) / 2p of the full product's work: 0.54 for twelve, 0.5 in the limit.
//
// oneDNN's brgemm kernels need dense operands: a panel written in place into C (row stride m) falls
// back to a generic kernel at 0.8x the speed, so each panel has a dense buffer of its own, and placing it
// costs what mirroring would anyway (m^2 elements, against the m^2 K multiply-adds of the product).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace normuon::fast {

struct SymmetricPanel {
  int64_t c0 = 0, width = 0;  // columns [c0, c0 + width) and rows [c0, m) of C
  int64_t offset = 0;         // of its (m - c0) x width dense block in the panel buffer of one matrix
};

// Panels of width `width` (the last one narrower) for an m x m product.
inline std::vector<SymmetricPanel> symmetric_panels(int64_t m, int64_t width) {
  std::vector<SymmetricPanel> panels;
  int64_t offset = 0;
  for (int64_t c0 = 0; c0 < m; c0 += width) {
    const int64_t w = std::min(width, m - c0);
    panels.push_back({c0, w, offset});
    offset += (m - c0) * w;
  }
  return panels;
}

// Elements of one matrix's panel buffer.
inline int64_t symmetric_panel_floats(const std::vector<SymmetricPanel>& panels, int64_t m) {
  return panels.empty() ? 0 : panels.back().offset + (m - panels.back().c0) * panels.back().width;
}

// Multiply-adds of the panels' GEMMs with inner dimension k (the full product has m * m * k).
inline double symmetric_panel_macs(const std::vector<SymmetricPanel>& panels, int64_t m, int64_t k) {
  double macs = 0;
  for (const auto& p : panels) macs += static_cast<double>(m - p.c0) * static_cast<double>(p.width) * static_cast<double>(k);
  return macs;
}

// C (m x m, row-major) from the panels of one matrix: the lower triangle as computed, the upper mirrored.
// A panel's part above the diagonal (inside its diagonal block) is not used.
template <typename T>
void place_symmetric_panels(const std::vector<SymmetricPanel>& panels, const T* buffer, T* c, int64_t m) {
  for (const auto& p : panels) {
    const T* block = buffer + p.offset;
    for (int64_t i = p.c0; i < m; ++i) {
      const T* row = block + (i - p.c0) * p.width;
      const int64_t end = std::min(p.width, i - p.c0 + 1);  // columns c0 .. min(c0 + width, i + 1)
      for (int64_t j = 0; j < end; ++j) {
        c[i * m + p.c0 + j] = row[j];
        c[(p.c0 + j) * m + i] = row[j];
      }
    }
  }
}

// C's upper triangle from its lower one, in place (a full product made symmetric the same way).
template <typename T>
void mirror_lower_triangle(T* c, int64_t m) {
  constexpr int64_t tile = 64;  // a tile of rows and its mirrored tile of columns stay in cache
  for (int64_t i0 = 0; i0 < m; i0 += tile)
    for (int64_t j0 = 0; j0 <= i0; j0 += tile)
      for (int64_t i = i0; i < std::min(i0 + tile, m); ++i)
        for (int64_t j = j0; j < std::min(j0 + tile, i); ++j) c[j * m + i] = c[i * m + j];
}

}  // namespace normuon::fast
