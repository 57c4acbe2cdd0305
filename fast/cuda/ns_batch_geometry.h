// Where the matrices of one Newton-Schulz batch live and how the elementwise kernels split them into
// blocks. Plain C++ (no CUDA call), shared by the backend (newton_schulz_cuda.cu) and the host emulation
// of the step in the tests, so both lay out the same buffers.
#pragma once

#include <cstdint>
#include <vector>

#include "newton_schulz_cuda.h"
#include "ns_gemm_plan.h"
#include "ns_gram_plan.h"

namespace normuon::cuda {

constexpr int kNsThreads = 256;                 // threads per block of the elementwise kernels
constexpr int kNsVec = 8;                       // elements per vector access (16 B of bf16, 32 B of fp32)
constexpr int64_t kNsElementsPerSlice = 16384;  // target slice size (one block each)
constexpr int64_t kNsMaxSlices = 1024;          // per matrix; the norm's partial sums are re-summed per block
constexpr int64_t kNsStrideAlign = 128;         // elements: 256 B in bf16, cuBLASLt's default alignment
constexpr int kNsSymTile = 32;                  // the symmetric kernel: one block per tile of the lower triangle

// `count` matrices of n elements, `stride` elements apart, split into `slices` blocks per matrix of
// groups_per_slice groups of kNsVec elements (the matrix's last group may be partial).
struct NsSlicing {
  int64_t n = 0;
  int64_t stride = 0;  // a multiple of kNsStrideAlign
  int slices = 0;
  int64_t groups_per_slice = 0;
};

// The s x s matrices of a batch as the symmetric kernel (ns_sym_kernels.cuh) splits them: one block per
// kNsSymTile x kNsSymTile tile on or below the diagonal (`tiles` per matrix), column-major, `stride` apart.
struct NsSymTiling {
  int64_t s = 0;
  int64_t stride = 0;
  int64_t tiles = 0;
};

struct NsBatchGeometry {
  bool empty = true;  // no matrix or no element: nothing to run, no buffers
  NsGemmPlan plan{};  // the GEMMs of an iteration (unless empty)
  NsSlicing x;        // the X-shaped buffers (X, U): rows x cols
  NsSymTiling sym;    // the s x s buffers (A, C and B, T; Gram's R, Q, Z, T2 too), as the symmetric kernel's tiles
  // The lower panels every symmetric product (X X^T, and every s x s product) is computed in; one panel
  // (0, s) computes the full product.
  std::vector<fast::SymmetricPanel> panels;
  // Gram Newton-Schulz (ns_algorithm=gram on a non-square matrix, ns_steps >= 1): its GEMMs.
  bool gram_iteration = false;
  NsGramPlan gram_plan{};
};

// Launches and GEMMs of one run of a non-empty batch with the standard iteration (ns_run.cuh,
// run_newton_schulz): the two norm kernels, then per iteration the panels of X X^T and of C A, B X,
// and three elementwise kernels.
constexpr int ns_launches(int steps, int panels = 1) { return 2 + steps * (4 + 2 * panels); }

// Launches and GEMMs of one run of a batch of this shape, either algorithm; 0 when it is empty.
int ns_batch_launches(const NsBatchShape& shape);

// The three GEMM layouts of a run (the order of the plan's GEMMs, an index), and the cuBLASLt plans each
// takes: one per panel for the symmetric ones (X X^T, and the s x s products on the square layout),
// the apply GEMM whole. Every GEMM of a run, either algorithm, runs on one of these plans.
enum class NsGemm { gram, square, apply };
int ns_gemm_parts(const NsBatchGeometry& g, NsGemm which);
NsGemmSpec ns_planned_gemm(const NsBatchGeometry& g, NsGemm which, int part);

// Device buffers of the batches together, each sized for the largest batch that uses it, in that batch's
// working precision (as BatchedNewtonSchulz allocates them, and the tests' emulation too): the X-shaped
// X (the batch's input, written just before it runs, and its output, read before the next batch runs)
// and U, the s x s buffers A, C/B and T, Gram's s x s Q, Z and T2 (0 without a Gram batch), and the norm
// kernels' partial sums.
struct NsWorkspaceSizes {
  int64_t x = 0, square = 0, gram_only = 0;  // bytes of one buffer of each kind
  int64_t partials = 0;                       // doubles
  void add(const NsBatchShape& shape, const NsBatchGeometry& g);
  int64_t bytes() const { return 2 * x + 3 * square + 3 * gram_only + 8 * partials; }
};

// Bytes of those buffers per matrix of a batch of this shape (its count ignored): what the plan divides
// its budget by.
int64_t ns_bytes_per_matrix(NsBatchShape shape);

// FLOPs (2 per multiply-add) that one run of the batch computes, its symmetric products as its panels;
// 0 when it is empty. The full products of the same run: ns_dense_flops (normuon/ns_algorithm.h).
double ns_batch_flops(const NsBatchShape& shape);

// Throws std::invalid_argument for a shape the kernels' 32-bit grid indices cannot hold.
NsBatchGeometry ns_batch_geometry(const NsBatchShape& shape);

}  // namespace normuon::cuda
