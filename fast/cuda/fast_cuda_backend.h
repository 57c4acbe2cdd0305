// The fused CUDA backend over the shared flat layout (docs/fast-cuda.md). A step is a fixed sequence of
// launches on one stream: a NaN/Inf scan and the step counters; per Newton-Schulz batch (matrices of one
// shape and group, as many as the scratch budget allows) a momentum + Nesterov pass, the batched
// Newton-Schulz on cuBLASLt, a statistics pass, a per-matrix finalize and an update pass; one AdamW pass.
// The number of launches depends on the number of batches only. Everything is allocated in the constructor; a step allocates nothing, never
// synchronises and reads its hyper-parameters and step counters from device memory, so it can be
// captured once in a CUDA graph and replayed.
//
// Four ways to use it:
//  - as a Backend: step(FlatState&) uploads the host state, steps and downloads it (synchronising);
//    the comparator, golden traces and state files work unchanged.
//  - device-resident: write gradients into device_state(), then set_options(), enqueue_step() (or
//    replay_graph()), and finish_step() when the outcome is wanted (that synchronises).
//  - table mode (caller_tensors): the caller's own device tensors by address (set_tensors), read and
//    written in place; the pointer table is uploaded from pinned memory, asynchronously, only when an
//    address changed. Then set_options(), enqueue_step(), and finish_step() (one sync) or, one step
//    later, poll_step() (no stall).
//  - as the CUDA engine's backend (DeviceTableBackend, normuon/engine.h): table mode, driven by an
//    Engine, which keeps the counters and reads each step's verdict (deferred or not) through verdict().
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "device_state.h"
#include "normuon/backend.h"
#include "normuon/engine.h"
#include "normuon/layout.h"
#include "normuon/param_table.h"
#include "step_kernels.h"
#include "step_tables.h"

namespace normuon::cuda {
class BatchedNewtonSchulz;
}

namespace normuon {

struct FastCudaConfig {
  int device = 0;
  cudaStream_t stream = nullptr;  // nullptr: the backend creates its own (non-blocking) stream
  cuda::ElemType grad_type = cuda::ElemType::f32;
  bool bf16_params = false;       // keep a bf16 copy of the parameters, written in the same passes
  bool caller_tensors = false;    // table mode: step the tensors set_tensors() names (param_table.h)
  // Width of the column panels of Newton-Schulz's symmetric products (ns_gemm_plan.h): 0, the backend's
  // choice (ns_auto_panel_width); a width >= a batch's s computes each product in one GEMM (still
  // mirrored: the lower triangle wins). Each element is the same dot product either way, but a panel's
  // GEMM may run another cuBLASLt algorithm, so widths can differ in the last bits.
  int64_t ns_panel_width = 0;
  // Bytes a Newton-Schulz batch's buffers may take (StepPlan::build): 0, the plan's choice
  // (ns_scratch_budget). Smaller splits the shape buckets into more batches (the tests).
  int64_t ns_budget = 0;
};

class FastCudaBackend : public Backend, public DeviceTableBackend {
 public:
  // The layout must outlive the backend. Options fix the groups and the Newton-Schulz knobs (precision,
  // coefficients, ns_steps, ns_eps, ns_algorithm); the other values may change at every set_options().
  FastCudaBackend(const Layout& layout, const Options& options, const FastCudaConfig& config = {});
  ~FastCudaBackend() override;
  FastCudaBackend(const FastCudaBackend&) = delete;
  FastCudaBackend& operator=(const FastCudaBackend&) = delete;

  std::string name() const override { return "fast-cuda"; }
  StepResult step(FlatState& state, const Options& options) override;
  using DeviceTableBackend::step;

  // --- the engine's backend (DeviceTableBackend; table mode): set_tensors, set_options with the host's
  // counts, set_grad_scaling, enqueue_step; poll_step for the verdict.
  void enqueue(const TableState& state, const ParamTable& table, const Options& options, const float* grad_scale,
               const float* found_inf) override;
  StepResult verdict(const Options& options) override { return poll_step(options); }
  void set_steps(const TableState& state) override;  // the device's counters, behind the queued work
  void refresh_master(int e, const ParamTable& table) override;
  std::vector<BufferView> buffers() override;
  void set_stream(void* stream) override { set_stream(static_cast<cudaStream_t>(stream)); }
  std::vector<std::string> fixed_fields() const override;

  // Empty when this backend can run `options` on `layout` on `device`; otherwise why not.
  static std::string unsupported_reason(const Layout& layout, const Options& options, int device = 0);

  // --- device-resident use
  cuda::DeviceFlatState& device_state() { return *device_; }
  cudaStream_t stream() const { return stream_; }
  // Later work goes to `stream` (e.g. the caller's current stream; it must be a capturable, non-legacy
  // stream to capture graphs). Any captured graph stays valid; replays go to the new stream.
  void set_stream(cudaStream_t stream);
  // Uploads the per-group values (learning rates, weight decay, betas, eps) for the next steps; async.
  // Throws std::invalid_argument if a fixed knob differs from construction. The counts before the next
  // step, when the caller knows them, make that step's AdamW bias corrections host-exact (computed on the
  // host as the reference does, with the C library's pow), per entry, for the entry's next step only:
  // `entry_steps` gives each parameter's own count (FlatState::entry_steps); without it, `group_steps`
  // gives each parameter its group's counter (what a caller that keeps group counters only means, as
  // format-version-1 state did). With neither (and for later steps, graph replays) the device derives
  // them from its own per-entry counts.
  void set_options(const Options& options, const std::vector<int64_t>* group_steps = nullptr,
                   const std::vector<int64_t>* entry_steps = nullptr);
  // Table mode: the caller's tensors for the next steps (device addresses, dense). Uploads the table
  // only when it differs from the last one (asynchronously, from pinned memory; it waits only for the
  // previous such upload). Throws std::invalid_argument on a bad table, before anything changes.
  void set_tensors(const ParamTable& table);
  // torch's GradScaler for the next steps (device addresses of its fp32 scale and found_inf; nullptr:
  // none): gradients are divided by the scale as they are read, and a step with found_inf != 0 changes
  // nothing and is not reported (the scaler deals with it). A captured graph keeps the addresses it saw;
  // step(FlatState&) clears them.
  void set_grad_scaling(const float* grad_scale, const float* found_inf) {
    buffers_.grad_scale = grad_scale;
    buffers_.found_inf = found_inf;
  }
  // Enqueues one step. No allocation, no synchronisation: capturable.
  void enqueue_step();
  // The verdict of the last step enqueued (outside a graph), without stalling the stream: waits only
  // for that step's own status copy (normally long done when the next step begins). As finish_step
  // for that step, and skipped with kFoundInfReason when the gradient scaler's found_inf skipped it
  // (step_verdict); {} when there is none pending.
  StepResult poll_step(const Options& options);
  // Waits for the stream and reports the steps enqueued since the last call: {} when they all ran;
  // when one had a NaN/Inf gradient (that step changed nothing, the others ran), the first such one as
  // skipped (nonfinite=skip_step) or std::runtime_error (nonfinite=error).
  // Fills phase_times() when timing was on for an eager step.
  StepResult finish_step(const Options& options);

  // CUDA graph of one step: capture once (after at least one eager step, so that lazily loaded
  // kernels are loaded), then replay as often as wanted; each replay is one step.
  void capture_graph();
  void replay_graph();
  bool has_graph() const { return graph_exec_ != nullptr; }
  int64_t graph_kernel_nodes() const { return graph_kernel_nodes_; }  // counted in the captured graph

  int64_t launches_per_step() const { return launches_per_step_; }  // kernels and matmuls enqueue_step issues
  int64_t workspace_bytes() const override;  // device memory beyond the state and masters (Newton-Schulz, tables)
  double newton_schulz_flops() const;                                // per step
  std::string describe() const;

 private:
  void release_graph();
  void upload_operands();  // host_operands_ (and, in table mode, host_has_grad_) to the device
  // Host-to-device copies of per-step values, asynchronous, from a pinned slot (a copy from pageable
  // memory may synchronise): two slots used in turn, each written again once the copy from it has run.
  struct Upload {
    void* device;
    const void* host;
    size_t bytes;
  };
  void upload_staged(std::initializer_list<Upload> uploads);

  const Layout& layout_;
  int device_index_;
  cudaStream_t stream_ = nullptr;
  bool own_stream_ = false;
  std::unique_ptr<cuda::DeviceFlatState> device_;
  std::unique_ptr<cuda::BatchedNewtonSchulz> ns_;
  struct NsKnobs {
    int group;
    NsPrecision precision;
    NsCoefficients coefficients;
    int steps;
    double eps;
    NsAlgorithm algorithm;
  };
  std::vector<NsKnobs> batch_knobs_;
  std::vector<cuda::MatrixInfo> host_matrices_;  // for the lr_scale factors
  cuda::DeviceBuffer<cuda::Chunk> scan_chunks_, normuon_chunks_, adamw_chunks_;
  cuda::DeviceBuffer<cuda::StatTask> stat_tasks_;
  std::vector<cuda::BatchRange> batch_ranges_;  // per Newton-Schulz batch (host memory)
  cuda::StepTables tables_{};  // where the step finds the four tables above
  cuda::DeviceBuffer<cuda::EntryInfo> entries_;
  cuda::DeviceBuffer<cuda::EntryOperands> operands_;
  std::vector<cuda::EntryOperands> host_operands_;  // as last uploaded
  std::vector<uint8_t> host_has_grad_;
  bool caller_tensors_ = false;
  bool tensors_set_ = false;
  const ParamTable* table_ = nullptr;  // the caller's, as last set: its messages number elements as it does
  // Pinned staging of the operand table and flags, and the event of its last upload.
  cuda::EntryOperands* staged_operands_ = nullptr;
  uint8_t* staged_has_grad_ = nullptr;
  cudaEvent_t staged_event_ = nullptr;
  std::array<char*, 2> ring_{};  // upload_staged's pinned slots
  std::array<cudaEvent_t, 2> ring_done_{};
  size_t ring_bytes_ = 0;
  int ring_next_ = 0;
  cuda::DeviceBuffer<unsigned long long> all_rounded_;  // refresh_master's flag
  // The last step's status, copied to pinned memory after it (poll_step).
  cuda::StepStatus* polled_status_ = nullptr;
  cudaEvent_t status_event_ = nullptr;
  bool status_pending_ = false;
  cuda::DeviceBuffer<cuda::MatrixInfo> matrices_;
  cuda::DeviceBuffer<cuda::GroupScalars> groups_;
  cuda::DeviceBuffer<cuda::EntryScalars> entry_scalars_;
  cuda::DeviceBuffer<cuda::MatrixScalars> matrix_scalars_;
  cuda::DeviceBuffer<double> stat_sums_;
  cuda::DeviceBuffer<float> inv_scale_;
  cuda::DeviceBuffer<cuda::StepStatus> status_;
  std::vector<cuda::GroupScalars> host_groups_;
  std::vector<cuda::EntryScalars> host_entry_scalars_;
  std::vector<cuda::MatrixScalars> host_matrix_scalars_;
  cuda::StepBuffers buffers_{};
  int64_t launches_per_step_ = 0;
  struct TimedPart {
    int phase;
    cudaEvent_t begin, end;
  };
  std::vector<cudaEvent_t> phase_events_;  // a timed step's: two per part of a phase
  std::vector<TimedPart> timed_parts_;     // the last timed step's parts
  bool timed_step_pending_ = false;
  bool capturing_ = false;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t graph_exec_ = nullptr;
  int64_t graph_kernel_nodes_ = 0;
};

}  // namespace normuon
