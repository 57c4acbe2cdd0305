// The tables the fused CUDA step reads: built on the host once at setup (chunks, matrices, statistics
// tasks) or at each set_options() (per-group scalars), copied to device memory, read by the kernels.
// Plain structs shared by host and device code; every scalar is already rounded to what the
// reference's ATen ops use (docs/spec.md section 1), so device arithmetic mirrors it.
#pragma once

#include <cstdint>

namespace normuon::cuda {

// Threads per block of the step's kernels (one block per chunk, statistics task or matrix).
constexpr int kStepThreads = 256;

// A piece of one parameter for the multi-tensor passes: <= kChunkElements elements of entry `entry`.
constexpr int64_t kChunkElements = 16384;
struct Chunk {
  int32_t entry;
  int32_t size;
  int64_t begin;  // element offset inside the parameter
};

// The element type of a gradient, or of a low-precision parameter the step writes rounded.
enum class ElemType : int32_t { f32, bf16, f16 };

// Where the step finds one parameter's tensors (one per layout entry, in device memory): the backend's
// flat buffers, or the caller's own tensors (table mode, re-uploaded when an address changes).
// A tensor's rows in runs (RowRuns of normuon/row_runs.h): element i of the matrix lies at
// (i / run) * pitch + i % run; run == 0: dense. Only the caller's tensors of table mode have runs (a block
// of Megatron's fused QKV weight).
struct Runs {
  int64_t run, pitch;
};

struct EntryOperands {
  float* master;      // the fp32 values the step reads and writes
  void* low;          // a bf16 / fp16 parameter written rounded from master in the same pass, or nullptr
  const void* grad;   // the gradient (read only when has_grad)
  ElemType grad_type;
  ElemType low_type;
  Runs master_runs, low_runs, grad_runs;
};

// One per layout entry.
struct EntryInfo {
  int64_t offset;       // in the param / grad buffers (and momentum, for NorMuon)
  int64_t adam_offset;  // in exp_avg / exp_avg_sq (AdamW only)
  int32_t group;
  int32_t matrix;       // index into the matrix table (NorMuon with elements), else -1
  int32_t empty;        // 0 elements: its own step count never advances (spec section 5)
};

// One per NorMuon matrix with elements, in layout order.
struct MatrixInfo {
  int32_t entry, group;
  int32_t rows, cols;
  int32_t stats_per_row;  // second moment per row (length rows) or per column (length cols)
  int32_t ns_bf16;        // the Newton-Schulz buffers hold __nv_bfloat16 (else float)
  void* ns_input;         // where the momentum pass writes P(U)
  const void* ns_output;  // where Newton-Schulz leaves O
  int64_t offset;         // in the param buffer
  int64_t stat_offset, stat_len;  // in row_var (and the statistics scratch)
};

// A statistics work item: a few rows (per-row statistics) or columns (per-column) of one matrix.
constexpr int kStatRowsPerTask = 8;     // one warp per row, 8 warps per block
constexpr int kStatColsPerTask = 256;   // one thread per column
static_assert(kStatRowsPerTask * 32 == kStepThreads && kStatColsPerTask == kStepThreads, "one task per block");
struct StatTask {
  int32_t matrix;
  int32_t first;  // first row or column of the task
};

// One Newton-Schulz batch's share of the NorMuon tables: its matrices' chunks, statistics tasks and
// matrices are consecutive (StepPlan orders them by batch), so its passes launch over these ranges.
// Host memory only: the ranges are launch arguments.
struct BatchRange {
  int first_chunk, n_chunks;
  int first_task, n_tasks;
  int first_matrix, n_matrices;
};

// Where one step finds the chunk and task tables (StepPlan's, on the device), and their sizes.
struct StepTables {
  const Chunk* scan_chunks;     // every parameter's gradient
  int n_scan_chunks;
  const Chunk* normuon_chunks;  // NorMuon matrices
  int n_normuon_chunks;
  const Chunk* adamw_chunks;    // AdamW parameters
  int n_adamw_chunks;
  const StatTask* stat_tasks;
  int n_stat_tasks;
  int n_matrices;
  const BatchRange* batches;  // per Newton-Schulz batch, in host memory
  int n_batches;
};

// Per group. Set by the host from Options at set_options().
struct GroupScalars {
  // NorMuon
  float w1, beta1;  // momentum lerp weight 1 - beta1, and beta1 (Nesterov blend)
  int32_t nesterov;
  float w2;         // second-moment lerp weight 1 - beta2
  int32_t eps_add;  // EpsPlacement::add (else clamp)
  float denom_eps, renorm_eps;
  int32_t wd_mode;  // 0 decoupled, 1 cautious, 2 none
  int32_t decay;    // weight decay applies (weight_decay != 0 and a mode that decays)
  float decay_factor;  // 1 - lr*wd
  float lr_wd;         // lr*wd (cautious)
  float neg_lr;
  // AdamW
  int32_t adam_decay;
  float adam_decay_factor, adam_w1, adam_beta2, adam_one_minus_beta2, adam_eps;
  double adam_lr, adam_beta1_d, adam_beta2_d;  // for the bias corrections, in double as the reference
};

// Per layout entry: the AdamW bias corrections of its own step count t (docs/spec.md section 5: a
// parameter's count advances only in the steps in which it has a gradient). Derived from t after the
// step's increment: on the host with the C library's pow when the caller passed the counts to
// set_options() (bias_from_host = 1: exactly the reference's values), else on the device by the
// step-counter kernel (graph replays), where pow may differ in the last bit of the double. Host values
// hold until the entry's next step that runs: the step-counter kernel clears the flag as it uses them
// (an entry without a gradient keeps them, its count unchanged). Written for every entry (NorMuon's are
// never read: NorMuon has no bias correction).
struct EntryScalars {
  int32_t bias_from_host;
  float adam_bc2_sqrt;        // sqrt(1 - beta2^t)
  float adam_neg_step_size;   // -lr / (1 - beta1^t)
};

// Per matrix, written on the device by the finalize kernel and read by the update pass.
struct MatrixScalars {
  float ratio;  // ||O|| / (||O * s|| + renorm_eps)
  float kappa;  // the lr_scale shape factor (set by the host)
};

// The step's outcome, in device memory. first_bad = (entry << 40) | element of the first NaN/Inf
// gradient of this step (the minimum, so the same one whatever the launch order), or kNoBadGradient;
// reset by every step. The reported_* fields keep the first bad step since the host last read them
// (finish_step), so that a NaN in one of several steps enqueued or replayed in a row is not lost.
constexpr unsigned long long kNoBadGradient = ~0ull;
// first_bad of a step the gradient scaler skipped (found_inf): not a verdict, nothing is reported.
constexpr unsigned long long kScalerFoundInf = ~0ull - 1;
constexpr int kBadElementBits = 40;
struct StepStatus {
  unsigned long long first_bad;
  unsigned long long reported_bad;
  long long reported_step;  // the step number the bad step would have had
  float reported_value;     // the gradient value found
};

}  // namespace normuon::cuda
