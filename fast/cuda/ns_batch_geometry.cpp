#include "ns_batch_geometry.h"

#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>

#include "normuon/ns_algorithm.h"

namespace normuon::cuda {
namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
int64_t ceil_div(int64_t x, int64_t m) { return (x + m - 1) / m; }

NsSlicing slicing(int64_t n, int64_t count) {
  NsSlicing s;
  s.n = n;
  s.stride = round_up(n, kNsStrideAlign);
  const int64_t groups = ceil_div(n, kNsVec);
  const int64_t slices = std::clamp<int64_t>(ceil_div(n, kNsElementsPerSlice), 1, kNsMaxSlices);
  s.groups_per_slice = ceil_div(groups, slices);
  const int64_t used = ceil_div(groups, s.groups_per_slice);  // no empty slice
  if (count * used > INT32_MAX) throw std::invalid_argument("too many blocks");
  s.slices = static_cast<int>(used);
  return s;
}

}  // namespace

NsBatchGeometry ns_batch_geometry(const NsBatchShape& shape) {
  NsBatchGeometry g;
  g.empty = shape.count == 0 || shape.rows == 0 || shape.cols == 0;
  if (g.empty) return g;
  g.plan = ns_gemm_plan(shape.rows, shape.cols);
  try {
    if (shape.count > INT32_MAX || g.plan.l > INT32_MAX) throw std::invalid_argument("too large");
    g.x = slicing(shape.rows * shape.cols, shape.count);
    const int64_t per_side = ceil_div(g.plan.s, kNsSymTile);
    g.sym = {g.plan.s, round_up(g.plan.s * g.plan.s, kNsStrideAlign), per_side * (per_side + 1) / 2};
    if (shape.count * g.sym.tiles > INT32_MAX) throw std::invalid_argument("too many blocks");
    g.panels = ns_panels(g.plan.s, shape.count, shape.panel_width);
    g.gram_iteration = shape.steps > 0 && ns_uses_gram(shape.algorithm, shape.rows, shape.cols);
    if (g.gram_iteration) g.gram_plan = ns_gram_plan(g.plan);
  } catch (const std::invalid_argument&) {
    throw std::invalid_argument("Newton-Schulz batch too large: " + std::to_string(shape.count) + " x " +
                                std::to_string(shape.rows) + "x" + std::to_string(shape.cols));
  }
  return g;
}

int ns_batch_launches(const NsBatchShape& shape) {
  const NsBatchGeometry g = ns_batch_geometry(shape);
  if (g.empty) return 0;
  const int panels = static_cast<int>(g.panels.size());
  return g.gram_iteration ? ns_gram_launches(shape.steps, panels) : ns_launches(shape.steps, panels);
}

int ns_gemm_parts(const NsBatchGeometry& g, NsGemm which) {
  return which == NsGemm::apply ? 1 : static_cast<int>(g.panels.size());
}

NsGemmSpec ns_planned_gemm(const NsBatchGeometry& g, NsGemm which, int part) {
  if (which == NsGemm::apply) return g.plan.apply;
  return ns_panel_gemm(which == NsGemm::gram ? g.plan.gram : g.plan.square, g.panels.at(static_cast<size_t>(part)));
}

void NsWorkspaceSizes::add(const NsBatchShape& shape, const NsBatchGeometry& g) {
  if (g.empty) return;
  const int64_t element = shape.precision == NsPrecision::bf16 ? 2 : 4;
  square = std::max(square, shape.count * g.sym.stride * element);
  x = std::max(x, shape.count * g.x.stride * element);
  partials = std::max(partials, shape.count * g.x.slices);
  if (g.gram_iteration) gram_only = std::max(gram_only, shape.count * g.sym.stride * element);
}

int64_t ns_bytes_per_matrix(NsBatchShape shape) {
  shape.count = 1;
  NsWorkspaceSizes one;
  one.add(shape, ns_batch_geometry(shape));
  return one.bytes();
}

double ns_batch_flops(const NsBatchShape& shape) {
  const NsBatchGeometry g = ns_batch_geometry(shape);
  if (g.empty) return 0;
  const int64_t s = g.plan.s, l = g.plan.l;
  const double long_product = fast::symmetric_panel_macs(g.panels, s, l);  // X X^T
  const double square_product = fast::symmetric_panel_macs(g.panels, s, s);
  const double apply = static_cast<double>(s) * static_cast<double>(s) * static_cast<double>(l);  // B X, Q X
  double macs = 0;
  if (g.gram_iteration) {
    const NsGramProducts p = ns_gram_products(shape.steps);
    macs = p.gram * long_product + p.apply * apply + p.square * square_product;
  } else {
    macs = shape.steps * (long_product + square_product + apply);
  }
  return 2 * macs * static_cast<double>(shape.count);
}

}  // namespace normuon::cuda
