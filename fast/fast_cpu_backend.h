// The fused CPU backend over the shared flat layout: one multi-threaded pass per phase over all
// parameters of a kind, batched Newton-Schulz per (shape, group), the NorMuon statistics and update in
// three passes per matrix, AdamW in one pass (each element read once, written once). It steps a FlatState
// or, in table mode, the caller's own tensors (bf16 / fp16 gradients widened a chunk at a time, bf16 /
// fp16 parameters written back rounded while the chunk is in cache). Everything it needs
// is allocated in the constructor; a step allocates nothing of its own (oneDNN's execute() allocates a few
// small blocks of its own per GEMM call: tests/test_fast_cpu.cpp measures both). Gram Newton-Schulz's
// buffers are made only for options that ask for it: the first step whose options turn it on later makes
// them, once.
#pragma once

#include <memory>
#include <vector>

#include "normuon/backend.h"
#include "normuon/engine.h"
#include "normuon/layout.h"
#include "normuon/param_table.h"

namespace normuon::fast {
class BatchedNewtonSchulz;
struct NsBatchShape;
class WorkPool;
struct NsWork;
}

namespace normuon {

// Work counts of the last step, for the old-vs-new comparison.
struct FastStepCounters {
  int64_t elementwise_passes = 0;  // multi-tensor passes over flat buffers or bucket workspaces
  int64_t gemm_calls = 0;          // oneDNN matmul executions (one per matrix, or per batch: newton_schulz.h)
};

class FastCpuBackend : public Backend, public TableBackend {
 public:
  // The layout must outlive the backend; options give the groups (as for Layout::build). `threads`:
  // the threads of its passes and GEMMs (OpenMP regions of that many threads whose waits do not spin,
  // work_pool.h), 0 = default_threads() (thread_budget.h: the processors this process may use, within
  // its CPU quota). The process-wide OpenMP count is not used, so a host that lowers it (libtorch sets 1
  // here) doesn't starve it; a Newton-Schulz batch smaller than the thread count runs on oneDNN's
  // threads, this many for that call (newton_schulz.h).
  FastCpuBackend(const Layout& layout, const Options& options, int threads = 0);
  ~FastCpuBackend() override;

  std::string name() const override { return "fast-cpu"; }
  StepResult step(FlatState& state, const Options& options) override;
  // Table mode: the caller's parameters and gradients in place (param_table.h); the same passes.
  // grad_scale: a gradient scaler's scale (StepOperands::grad_scale), or nullptr.
  StepResult step(TableState& state, const ParamTable& table, const Options& options,
                  const float* grad_scale = nullptr) override;

  const FastStepCounters& counters() const { return counters_; }
  std::string describe() const;  // batches and GEMM implementations
  int threads() const { return threads_; }
  // Bytes of its own beyond the state: Newton-Schulz buffers and per-thread scratch.
  int64_t workspace_bytes() const override;

  // Empty when this backend can run `options` on `layout`; otherwise why not (the selector reports it).
  static std::string unsupported_reason(const Layout& layout, const Options& options);

 private:
  StepResult run(const Options& options);  // one step over operands_

  struct Chunk {  // a piece of one parameter for the multi-tensor passes
    int entry;
    int64_t begin, size;
  };
  const Layout& layout_;
  std::vector<NsBatch> batches_;
  std::vector<fast::NsBatchShape> ns_shapes_;  // of batches_, for BatchedNewtonSchulz
  std::vector<Chunk> normuon_chunks_, adamw_chunks_;
  std::vector<float> update_;           // Nesterov blend, then Newton-Schulz output (normuon_floats)
  std::vector<double> col_sums_;        // per thread: max cols
  std::vector<float> inv_scale_;        // per thread: max stat length
  std::vector<const float*> ns_in_;     // per batch member pointers, all batches (sized at setup)
  std::vector<float*> ns_out_;
  std::vector<fast::NsWork> ns_work_;   // the batches of this step's Newton-Schulz run
  std::vector<double> phase_ms_;        // per thread: normalisation and update times
  std::vector<float> grad_scratch_;     // per thread: one chunk of a bf16 / fp16 gradient, widened
  StepOperands operands_;               // what this step works on (either mode)
  int64_t max_cols_ = 0, max_stat_ = 0;
  int threads_ = 1;
  std::unique_ptr<fast::WorkPool> pool_;  // before ns_, which runs on it
  std::unique_ptr<fast::BatchedNewtonSchulz> ns_;
  FastStepCounters counters_;
};

}  // namespace normuon
