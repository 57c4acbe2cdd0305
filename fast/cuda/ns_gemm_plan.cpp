#include "ns_gemm_plan.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace normuon::cuda {

NsGemmPlan ns_gemm_plan(int64_t rows, int64_t cols) {
  if (rows < 1 || cols < 1)
    throw std::invalid_argument("ns_gemm_plan: " + std::to_string(rows) + "x" + std::to_string(cols) +
                                " has no elements");
  NsGemmPlan p{};
  p.tall = rows > cols;
  p.s = std::min(rows, cols);
  p.l = std::max(rows, cols);
  const int64_t s = p.s, l = p.l;
  const NsMatrixSpec gram{s, s, s, NsOperand::gram};
  const NsMatrixSpec bmat{s, s, s, NsOperand::b};
  p.square = {false, false, bmat, gram, {s, s, s, NsOperand::t}};  // T = C A (C in the B buffer)
  if (!p.tall) {
    const NsMatrixSpec z{l, s, l, NsOperand::x};  // Z = X^T, column-major l x s
    p.gram = {true, false, z, z, gram};                          // A = Z^T Z
    p.apply = {false, true, z, bmat, {l, s, l, NsOperand::u}};  // U^T = Z B^T
  } else {
    const NsMatrixSpec w{s, l, s, NsOperand::x};  // W = X, column-major s x l
    p.gram = {false, true, w, w, gram};                           // A = W W^T
    p.apply = {false, false, bmat, w, {s, l, s, NsOperand::u}};  // U = B W
  }
  return p;
}

NsGemmSpec ns_panel_gemm(const NsGemmSpec& full, const fast::SymmetricPanel& panel) {
  const int64_t c0 = panel.c0, w = panel.width;
  NsGemmSpec g = full;
  const int64_t s = full.d.rows;
  // op(A)'s rows c0..: A's rows, or its columns when transposed.
  if (full.trans_a) {
    g.a.offset += c0 * full.a.ld;
    g.a.cols = s - c0;
  } else {
    g.a.offset += c0;
    g.a.rows = s - c0;
  }
  // op(B)'s columns c0 .. c0 + w: B's columns, or its rows when transposed.
  if (full.trans_b) {
    g.b.offset += c0;
    g.b.rows = w;
  } else {
    g.b.offset += c0 * full.b.ld;
    g.b.cols = w;
  }
  g.d.offset += c0 + c0 * full.d.ld;
  g.d.rows = s - c0;
  g.d.cols = w;
  return g;
}

double ns_panel_intensity(int64_t r, int64_t w, int64_t k) {
  const double rd = static_cast<double>(r), wd = static_cast<double>(w), kd = static_cast<double>(k);
  return rd * wd * kd / (rd * kd + wd * kd + rd * wd);
}

int64_t ns_auto_panel_width(int64_t s, int64_t count) {
  for (const int64_t panels : {8, 4, 2}) {
    const int64_t width = (s + panels - 1) / panels;
    const int64_t rounded = (width + 127) / 128 * 128;
    if (rounded >= s) continue;
    const int64_t last = s - (s - 1) / rounded * rounded;  // the last panel is last x last
    const int64_t tiles = (last + 127) / 128;
    if (tiles * tiles * count >= kNsMinPanelTiles && ns_panel_intensity(last, last, s) >= kNsPanelMinIntensity)
      return rounded;
  }
  return s;
}

std::vector<fast::SymmetricPanel> ns_panels(int64_t s, int64_t count, int64_t width) {
  if (s < 1) return {};
  const int64_t narrowest = (s + kNsMaxPanels - 1) / kNsMaxPanels;
  const int64_t w = width > 0 ? std::clamp(width, narrowest, s) : ns_auto_panel_width(s, count);
  return fast::symmetric_panels(s, w);
}

uint32_t ns_operand_alignment(int64_t offset, int64_t element_bytes) {
  uint32_t align = 256;
  while (align > 1 && (offset * element_bytes) % align != 0) align /= 2;
  return align;
}

}  // namespace normuon::cuda
