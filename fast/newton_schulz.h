// Batched Newton-Schulz on the CPU: every NorMuon matrix of one shape and one group goes through the
// iteration together, the standard one or Gram Newton-Schulz (ns_algorithm, docs/spec.md section 3.2).
// A batch with at least as many matrices as threads is shared out a matrix at a time on the work pool
// (work_pool.h), each GEMM a one-thread oneDNN matmul on that thread's workspace: no thread waits inside
// a GEMM for a preempted one, and a preempted thread's matrices go to the others. So is every batch when
// all of them together have a matrix per thread and no one matrix outlasts an even share of the whole
// (run() hands out the matrices of all the batches it is given in one pass). There every symmetric
// product (X X^T, (cA) A, and Gram's m x m products) of a matrix wider than one panel computes only its
// lower triangle, in column panels (symmetric_panels.h), and mirrors it. A smaller batch cannot keep every
// thread busy that way: each GEMM is one oneDNN batched matmul over the whole batch on oneDNN's own
// (OpenMP) threads, whose waits spin; there, as for a matrix of one panel, a symmetric product is
// computed in full (brgemm takes no sub-matrix of a batch), the standard iteration's as it comes, Gram's
// with its lower triangle mirrored (docs/spec.md's sym). brgemm kernels, bf16 where the CPU has AVX512_BF16, chosen by
// oneDNN at run time. Primitives, memory objects and the workspace are made once, in the constructor, for
// both precisions and the standard iteration, and Gram's when asked for (with_gram: its products and three
// more m x m buffers); a step allocates nothing of its own.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "normuon/options.h"

namespace normuon::fast {

class WorkPool;

struct NsBatchShape {
  int64_t rows = 0, cols = 0;  // as stored
  int64_t count = 0;           // matrices in the batch
};

// How a batch uses the threads. automatic: per_matrix when the batch has at least as many matrices as
// the pool has threads, or when all the batches together do and no one matrix costs more than an even
// share of their total (ns_keeps_the_pool_busy); else batched. The others force one way (tests,
// measurements).
enum class NsSplit { automatic, per_matrix, batched };

// Whether the matrices of all the batches, handed out one at a time (costliest first), keep `threads`
// threads busy: at least one matrix per thread, and none alone longer than an even share of the whole
// (else that matrix, on one thread, would outlast the work the other threads share).
bool ns_keeps_the_pool_busy(const std::vector<NsBatchShape>& batches, int threads);

// One batch's part of a run: its matrices and its group's hyper-parameters.
struct NsWork {
  int batch;
  const float* const* inputs;
  float* const* outputs;
  const NorMuonHyper* h;
};

class BatchedNewtonSchulz {
 public:
  // The pool must outlive this object; run() is called from the thread that calls the pool's run().
  // with_gram = false: the standard iteration only (a Gram run throws std::logic_error), less memory.
  BatchedNewtonSchulz(const std::vector<NsBatchShape>& batches, WorkPool& pool, NsSplit split = NsSplit::automatic,
                      bool with_gram = true);
  // Without a pool: every batch on oneDNN's threads, as many as this thread's OpenMP count now.
  explicit BatchedNewtonSchulz(const std::vector<NsBatchShape>& batches, bool with_gram = true);
  ~BatchedNewtonSchulz();
  BatchedNewtonSchulz(const BatchedNewtonSchulz&) = delete;
  BatchedNewtonSchulz& operator=(const BatchedNewtonSchulz&) = delete;

  // Orthogonalises batch `b`: inputs[k] and outputs[k] point at rows x cols fp32 matrices (as stored;
  // the output may alias the input). Follows docs/spec.md section 3.2 operation by operation, the
  // symmetric products as that section allows (lower triangle, mirrored).
  void run(int b, const float* const* inputs, float* const* outputs, const NorMuonHyper& h);
  // Several batches (each at most once): the matrices of the per-matrix ones share one pass of the pool,
  // so that no thread waits at the end of each batch; the others follow, one by one.
  void run(const NsWork* work, int n);

  int64_t gemm_calls() const;     // oneDNN matmul executions since construction
  double multiply_adds() const;   // of those executions (the FLOPs actually computed are twice this)
  int64_t workspace_bytes() const;                     // its buffers and oneDNN's scratchpads
  bool per_matrix(int b) const;                        // batch b is shared out a matrix at a time
  bool with_gram() const;                              // built for Gram Newton-Schulz too
  std::string gemm_implementation(int b, NsPrecision p) const;  // e.g. "brg:avx512_core_bf16"

 private:
  struct Impl;
  std::unique_ptr<WorkPool> own_pool_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace normuon::fast
