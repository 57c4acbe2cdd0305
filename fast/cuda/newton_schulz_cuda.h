// Batched Newton-Schulz on the GPU: the matrices of one (shape, group) batch are orthogonalised
// together, bf16 operands with fp32 accumulation through cuBLASLt strided-batched GEMMs (true fp32 in
// fp32 precision, never TF32). Wide and tall matrices both iterate on the wide orientation without a
// materialised transpose (the GEMMs read the row-major data as the transposed column-major matrix).
// The coefficients enter through elementwise kernels that round as the spec does (ns_gemm_plan.h).
//
// Everything (buffers, cuBLASLt handle, workspace, algorithm choices) is set up in the constructor;
// run() enqueues work on the stream only: no allocation, no synchronisation, capturable in a CUDA graph.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "normuon/options.h"

namespace normuon::cuda {

// cuBLASLt's workspace, allocated once when some batch has work.
constexpr int64_t kLtWorkspaceBytes = int64_t{32} << 20;

struct NsBatchShape {
  int64_t rows = 0, cols = 0;  // of each matrix, as stored (row-major)
  int64_t count = 0;           // matrices in the batch
  NsPrecision precision = NsPrecision::bf16;
  NsCoefficients coefficients = NsCoefficients::quintic;
  int steps = 5;
  double eps = 1e-7;           // X / (||X||_F + eps)
  NsAlgorithm algorithm = NsAlgorithm::standard;  // gram: on square matrices the standard iteration all the same
  // Width of the column panels a symmetric product is computed in (ns_gemm_plan.h): 0 leaves it to
  // ns_auto_panel_width; s or more computes the full product in one GEMM (still mirrored). Each element is
  // the same dot product either way, summed in the order of the GEMM's cuBLASLt algorithm.
  int64_t panel_width = 0;
};

class BatchedNewtonSchulz {
 public:
  BatchedNewtonSchulz(const std::vector<NsBatchShape>& batches, cudaStream_t stream);
  ~BatchedNewtonSchulz();
  BatchedNewtonSchulz(const BatchedNewtonSchulz&) = delete;
  BatchedNewtonSchulz& operator=(const BatchedNewtonSchulz&) = delete;

  int size() const;
  const NsBatchShape& shape(int b) const;

  // A batch's input and output: `count` row-major rows x cols matrices, stride(b) elements apart,
  // __nv_bfloat16 in bf16 precision and float in fp32. The caller writes P(U) (values already
  // rounded to the working precision) into input(b) before run(b); run(b) leaves O, the orthogonalised
  // matrices in the same layout and type, in output(b) (the same buffer: the run is in place). Every
  // batch has the same buffer, sized for the largest (NsWorkspaceSizes): a batch's output must be read
  // before the next batch's input is written. Both pointers are fixed for the object's life.
  void* input(int b);
  const void* output(int b) const;
  int64_t stride(int b) const;

  // Enqueues the whole orthogonalisation of batch b on the stream (norms, scaling, ns_steps iterations).
  void run(int b);
  // Later runs go to `stream` (the caller keeps the order with what it enqueued before).
  void set_stream(cudaStream_t stream);

  int launches(int b) const;  // kernels plus cuBLASLt matmuls that one run(b) enqueues
  int64_t workspace_bytes() const;  // every device buffer it holds
  double flops(int b) const;  // multiply-adds x 2 that one run(b) computes (ns_batch_flops)
  std::string describe() const;  // per batch: shape, count, precision, GEMM algorithm

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace normuon::cuda
