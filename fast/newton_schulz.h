// Batched Newton-Schulz on the CPU: every NorMuon matrix of one shape and one group goes through the
// iteration together, each GEMM one oneDNN batched matmul (brgemm kernels, bf16 where the CPU has
// AVX512_BF16, chosen by oneDNN at run time). Primitives, memory objects and the workspace are made
// once, in the constructor; a step allocates nothing of its own.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "normuon/options.h"

namespace normuon::fast {

struct NsBatchShape {
  int64_t rows = 0, cols = 0;  // as stored
  int64_t count = 0;           // matrices in the batch
};

class BatchedNewtonSchulz {
 public:
  explicit BatchedNewtonSchulz(const std::vector<NsBatchShape>& batches);
  ~BatchedNewtonSchulz();
  BatchedNewtonSchulz(const BatchedNewtonSchulz&) = delete;
  BatchedNewtonSchulz& operator=(const BatchedNewtonSchulz&) = delete;

  // Orthogonalises batch `b`: inputs[k] and outputs[k] point at rows x cols fp32 matrices (as stored;
  // the output may alias the input). Follows docs/spec.md section 3.2 operation by operation.
  void run(int b, const float* const* inputs, float* const* outputs, const NorMuonHyper& h);

  int64_t gemm_calls() const { return gemm_calls_; }  // since construction
  int64_t workspace_bytes() const;                     // its buffers and oneDNN's scratchpad
  std::string gemm_implementation(int b, NsPrecision p) const;  // e.g. "brg:avx512_core_bf16"

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int64_t gemm_calls_ = 0;
};

}  // namespace normuon::fast
