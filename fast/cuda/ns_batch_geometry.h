// Where the matrices of one Newton-Schulz batch live and how the elementwise kernels split them into
// blocks. Plain C++ (no CUDA call), shared by the backend (newton_schulz_cuda.cu) and the host emulation
// of the step in the tests, so both lay out the same buffers.
#pragma once

#include <cstdint>

#include "newton_schulz_cuda.h"
#include "ns_gemm_plan.h"
#include "ns_gram_plan.h"

namespace normuon::cuda {

constexpr int kNsThreads = 256;                 // threads per block of the elementwise kernels
constexpr int kNsVec = 8;                       // elements per vector access (16 B of bf16, 32 B of fp32)
constexpr int64_t kNsElementsPerSlice = 16384;  // target slice size (one block each)
constexpr int64_t kNsMaxSlices = 1024;          // per matrix; the norm's partial sums are re-summed per block
constexpr int64_t kNsStrideAlign = 128;         // elements: 256 B in bf16, cuBLASLt's default alignment
constexpr int kNsSymTile = 32;                  // Gram's symmetric kernels: one block per tile of the lower triangle

// `count` matrices of n elements, `stride` elements apart, split into `slices` blocks per matrix of
// groups_per_slice groups of kNsVec elements (the matrix's last group may be partial).
struct NsSlicing {
  int64_t n = 0;
  int64_t stride = 0;  // a multiple of kNsStrideAlign
  int slices = 0;
  int64_t groups_per_slice = 0;
};

// The s x s matrices of a batch as Gram Newton-Schulz's symmetric kernels split them: one block per
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
  NsSlicing gram;     // the s x s buffers (A, C and B, T; Gram's R, Q, Z, T2 too)
  // Gram Newton-Schulz (ns_algorithm=gram on a non-square matrix, ns_steps >= 1): its GEMMs and tiles.
  bool gram_iteration = false;
  NsGramPlan gram_plan{};
  NsSymTiling sym;
};

// Launches and GEMMs of one run of a non-empty batch (ns_kernels.cuh, run_newton_schulz): the two norm
// kernels, then three GEMMs and three elementwise kernels an iteration.
constexpr int ns_launches(int steps) { return 2 + 6 * steps; }

// Launches and GEMMs of one run of a batch of this shape, either algorithm; 0 when it is empty.
int ns_batch_launches(const NsBatchShape& shape);

// Throws std::invalid_argument for a shape the kernels' 32-bit grid indices cannot hold.
NsBatchGeometry ns_batch_geometry(const NsBatchShape& shape);

}  // namespace normuon::cuda
