// The order of a whole Newton-Schulz run on one batch (docs/spec.md section 3.2), both algorithms: which
// kernel and which GEMM, on which buffers, one after the other. Host code, shared by the backend
// (newton_schulz_cuda.cu) and the tests' host emulation (tests/simt), so the order the tests run is
// this order.
//
// `launch(kernel, blocks, threads, args...)` launches one kernel: <<<>>> on the GPU, the SIMT emulator in
// the tests. `gemm(which, part, spec)` runs one GEMM over the batch: `spec` is the plan's GEMM for `which`
// on the operands it names, or (part p) its p-th lower panel (ns_panel_gemm); cuBLASLt on the GPU, its
// emulation in the tests.
#pragma once

#include "ns_kernels.cuh"
#include "ns_sym_kernels.cuh"

namespace normuon::cuda::ns_device {
namespace {  // internal linkage, as ns_kernels.cuh

// The lower triangle of a symmetric product (X X^T, or an s x s product), panel by panel on the plans of
// ns_planned_gemm, with the operands `full` names; what lies above the diagonal blocks is left as it was.
// The kernel that reads it next mirrors it.
template <typename Gemm>
void symmetric_gemm(const Gemm& gemm, NsGemm which, const NsGemmSpec& full, const NsBatchGeometry& geometry) {
  for (size_t p = 0; p < geometry.panels.size(); ++p)
    gemm(which, static_cast<int>(p), ns_panel_gemm(full, geometry.panels[p]));
}

// X = P(X / P(||X|| + eps)) (Polar Express: P(P(1.02 ||X||) + eps)) of every matrix of buf.x, into `out`
// (buf.x itself or buf.u): the two norm kernels. `partials` holds count * geometry.x.slices doubles.
template <typename T, typename Launch>
void normalise_batch(const Launch& launch, const NsBuffers<T*>& buf, T* out, const NsBatchShape& shape,
                     const NsBatchGeometry& geometry, double* partials) {
  const NsSlicing& xs = geometry.x;
  const int x_blocks = static_cast<int>(shape.count * xs.slices);
  const bool polar = shape.coefficients == NsCoefficients::polar_express;
  launch(ns_norm_partials<T>, x_blocks, kNsThreads, static_cast<const T*>(buf.x), xs, partials);
  launch(ns_normalise<T>, x_blocks, kNsThreads, static_cast<const T*>(buf.x), out, xs,
         static_cast<const double*>(partials), static_cast<float>(shape.eps), static_cast<float>(kPolarExpressSafety),
         polar ? 1 : 0);
}

// Orthogonalises the `count` matrices of a batch in place in buf.x with the standard iteration (buf: the
// typed buffers of ns_gemm_plan.h). `partials` holds count * geometry.x.slices doubles.
template <typename T, typename Launch, typename Gemm>
void run_newton_schulz(const Launch& launch, const Gemm& gemm, const NsBuffers<T*>& buf, const NsBatchShape& shape,
                       const NsBatchGeometry& geometry, double* partials) {
  const NsSlicing& xs = geometry.x;
  const int x_blocks = static_cast<int>(shape.count * xs.slices);
  const int sym_blocks = static_cast<int>(shape.count * geometry.sym.tiles);
  auto sym = [&](const SymLane<T>& l0, const SymFollow<T>& f) {
    launch(ns_sym_combine<T>, sym_blocks, kNsThreads, l0, SymLane<T>{nullptr, nullptr, nullptr, 0.0f}, f, geometry.sym);
  };
  normalise_batch<T>(launch, buf, buf.x, shape, geometry, partials);
  const NsGemmPlan& plan = geometry.plan;
  for (int k = 0; k < shape.steps; ++k) {
    // Coefficients enter as fp32 values (docs/spec.md section 3.2).
    const NsTriple& c = ns_triple(shape.coefficients, k);
    symmetric_gemm(gemm, NsGemm::gram, plan.gram, geometry);  // A = P(X X^T), lower triangle
    // A mirrored in place; C = P(c A) into the B buffer
    sym({nullptr, buf.gram, buf.gram, 0.0f}, {buf.b, kSymFollowScaled, static_cast<float>(c.c)});
    symmetric_gemm(gemm, NsGemm::square, plan.square, geometry);  // T = P(C A), lower triangle
    // B = P(P(b A) + sym(T))
    sym({buf.gram, buf.t, buf.b, static_cast<float>(c.b)}, {nullptr, kSymFollowNone, 0.0f});
    gemm(NsGemm::apply, 0, plan.apply);  // U = P(B X)
    // X = P(P(a X) + U), in place
    launch(ns_combine<T>, x_blocks, kNsThreads, buf.x, static_cast<const T*>(buf.x),
           static_cast<const T*>(buf.u), xs, static_cast<float>(c.a));
  }
}

// Orthogonalises the `count` matrices of a batch with Gram Newton-Schulz (geometry.gram_iteration), the
// result in buf.x as run_newton_schulz leaves it. buf: the typed buffers of ns_gemm_plan.h, with q, z and
// t2; buf.u holds X between restarts. Every GEMM but X = Q X is a symmetric product (ns_gram_plan.h).
template <typename T, typename Launch, typename Gemm>
void run_gram_newton_schulz(const Launch& launch, const Gemm& gemm, const NsBuffers<T*>& buf,
                            const NsBatchShape& shape, const NsBatchGeometry& geometry, double* partials) {
  const NsGramPlan& plan = geometry.gram_plan;
  const int blocks = static_cast<int>(shape.count * geometry.sym.tiles);
  auto sym = [&](const SymLane<T>& l0, const SymLane<T>& l1, const SymFollow<T>& f) {
    launch(ns_sym_combine<T>, blocks, kNsThreads, l0, l1, f, geometry.sym);
  };
  auto square = [&](const NsGemmSpec& spec) { symmetric_gemm(gemm, NsGemm::square, spec, geometry); };
  const SymLane<T> no_lane{nullptr, nullptr, nullptr, 0.0f};
  const SymFollow<T> no_follow{nullptr, kSymFollowNone, 0.0f};
  // X moves to the other X buffer with every X = Q X: start where an even number of moves ends in buf.x.
  bool in_u = ns_gram_applies(shape.steps) % 2 == 1;
  normalise_batch<T>(launch, buf, in_u ? buf.u : buf.x, shape, geometry, partials);
  auto apply = [&] {  // X = P(Q X)
    gemm(NsGemm::apply, 0, in_u ? plan.apply_u_to_x : plan.apply_x_to_u);
    in_u = !in_u;
  };
  auto gram = [&](float c) {  // R = sym(P(X X^T)), C = P(c R)
    symmetric_gemm(gemm, NsGemm::gram, in_u ? plan.gram_u : plan.gram_x, geometry);
    sym({nullptr, buf.gram, buf.gram, 0.0f}, no_lane, {buf.b, kSymFollowScaled, c});
  };
  // Coefficients enter as fp32 values (docs/spec.md section 3.2).
  gram(static_cast<float>(ns_triple(shape.coefficients, 0).c));
  for (int k = 0; k < shape.steps; ++k) {
    const NsGramIteration it = ns_gram_iteration(k, shape.steps);
    const NsTriple& c = ns_triple(shape.coefficients, k);
    const float a = static_cast<float>(c.a);
    if (it.restart) {
      apply();
      gram(static_cast<float>(c.c));
    }
    square(plan.c_r);  // T = C R
    // Z = P(P(b R) + sym(T)); fresh: Q = P(Z + a I)
    sym({buf.gram, buf.t, buf.z, static_cast<float>(c.b)}, no_lane,
        it.fresh ? SymFollow<T>{buf.q, kSymFollowPlusDiagonal, a} : no_follow);
    if (!it.fresh) square(plan.q_z);   // T = Q Z
    if (it.update_r) square(plan.r_z);  // T2 = R Z
    // Q = P(P(a Q) + sym(T)) in place; RZ = P(P(a R) + sym(T2)) into the C buffer
    if (!it.fresh || it.update_r)
      sym(it.fresh ? no_lane : SymLane<T>{buf.q, buf.t, buf.q, a},
          it.update_r ? SymLane<T>{buf.gram, buf.t2, buf.b, a} : no_lane, no_follow);
    if (it.update_r) {
      square(plan.z_rz);  // T = Z RZ
      // R = P(P(a RZ) + sym(T)); C = P(c' R) for the next iteration, over RZ
      const float next_c = static_cast<float>(ns_triple(shape.coefficients, k + 1).c);
      sym({buf.b, buf.t, buf.gram, a}, no_lane, {buf.b, kSymFollowScaled, next_c});
    }
  }
  apply();  // X = P(Q X), into buf.x
}

}  // namespace
}  // namespace normuon::cuda::ns_device
