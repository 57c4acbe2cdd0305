// The fused CUDA step on the host, for the tests of machines without a GPU: the device code of fast/cuda
// (step_kernels.cuh, ns_kernels.cuh, ns_sym_kernels.cuh, ns_run.cuh) runs on the SIMT emulator (tests/simt), the Newton-Schulz
// GEMMs run through the cuBLASLt emulation (lt_matmul_emulation.h) on the layouts of the plan, the
// tables come from StepPlan and the Newton-Schulz buffers from ns_batch_geometry, and the launches
// come from the backend's own run_step and run_newton_schulz. The device buffers are the FlatState's own (kernels write into
// it in place, which also shows that a skipped step writes nothing).
//
// What this cannot check: cuBLASLt itself (its summation order), the CUDA runtime calls of the backend
// (copies, streams, events, graph capture) and real concurrency.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "normuon/backend.h"
#include "normuon/engine.h"
#include "normuon/flat_state.h"
#include "normuon/layout.h"
#include "normuon/options.h"
#include "normuon/param_table.h"
#include "newton_schulz_cuda.h"
#include "step_kernels.h"
#include "step_plan.h"

namespace normuon::test {

class EmulatedCudaBackend : public Backend {
 public:
  struct Config {
    cuda::ElemType grad_type = cuda::ElemType::f32;  // bf16: gradients are rounded to bf16 before the step
    bool bf16_params = false;                         // keep a bf16 copy of the parameters (params_bf16())
    int64_t ns_panel_width = 0;                       // as FastCudaConfig's
    int64_t ns_budget = 0;                            // as FastCudaConfig's
  };

  EmulatedCudaBackend(const Layout& layout, const Options& options, Config config);
  EmulatedCudaBackend(const Layout& layout, const Options& options) : EmulatedCudaBackend(layout, options, Config{}) {}
  ~EmulatedCudaBackend() override;

  std::string name() const override { return "fast-cuda-emulated"; }
  // As FastCudaBackend::step: AdamW bias corrections from the host, then enqueue and finish.
  StepResult step(FlatState& state, const Options& options) override;

  // The two halves, as the CUDA backend has them. enqueue_step runs the launches on `state`; with
  // host_bias = true the AdamW bias corrections come from the host (from state.entry_steps, as
  // FastCudaBackend::set_options with the counts), with false the step-counter kernel derives them itself
  // from its per-entry counts, as in a replayed CUDA graph. finish_step reads (and clears) the sticky step status.
  void enqueue_step(FlatState& state, const Options& options, bool host_bias);
  StepResult finish_step(const Options& options);
  // Table mode, as FastCudaBackend::set_tensors + enqueue_step: the caller's (host) tensors in place.
  // grad_scale / found_inf: a gradient scaler's (FastCudaBackend::set_grad_scaling), or nullptr.
  // host_entry_steps: the counts the host keeps, for the bias corrections (as FastCudaBackend's
  // set_options takes them); nullptr: state's.
  void enqueue_step(TableState& state, const ParamTable& table, const Options& options,
                    const float* grad_scale = nullptr, const float* found_inf = nullptr,
                    const std::vector<int64_t>* host_entry_steps = nullptr);
  StepResult step(TableState& state, const ParamTable& table, const Options& options,
                  const float* grad_scale = nullptr, const float* found_inf = nullptr);

  int batches() const;  // Newton-Schulz batches of its plan
  // Kernel launches and GEMMs of the last enqueue_step, as counted while it ran.
  int64_t launches_last_step() const { return launches_last_step_; }
  const std::vector<uint16_t>& params_bf16() const { return params_bf16_; }
  // The step status as the last step left it (read back by the engine backend's verdict), and cleared.
  cuda::StepStatus& status();
  // Device bytes beyond the state and masters: Newton-Schulz buffers and the step's own arrays.
  int64_t workspace_bytes() const;

 private:
  void set_scalars(const Options& options, const std::vector<int64_t>* entry_steps);  // nullptr: device-derived
  // The launches of one step over im.operands.
  void run(float* momentum, float* row_var, float* exp_avg, float* exp_avg_sq, const uint8_t* has_grad,
           int64_t* group_steps, int64_t* entry_steps, const float* grad_scale = nullptr,
           const float* found_inf = nullptr);
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::vector<uint16_t> params_bf16_;
  int64_t launches_last_step_ = 0;
  const ParamTable* table_ = nullptr;  // table mode: the caller's, whose element orders the messages follow
};

// The CUDA engine's backend without a GPU (Engine, core/include/normuon/engine.h): FastCudaBackend's table
// mode as a DeviceTableBackend (the state, masters and counters in the "device" memory, the host's here;
// the step's launches on the emulator; the verdict from the status word the step leaves; the master refresh
// kernels), so an Engine, and Python's NorMuonAdamW through it (tests/emulated_engine_module.cpp), takes
// the CUDA path on any machine.
class EmulatedCudaEngineBackend : public DeviceTableBackend {
 public:
  EmulatedCudaEngineBackend(const Layout& layout, const Options& options);
  std::string name() const override { return "fast-cuda-emulated"; }
  int64_t workspace_bytes() const override { return backend_.workspace_bytes(); }
  std::vector<std::string> fixed_fields() const override { return cuda::planned_fields(); }
  void enqueue(const TableState& state, const ParamTable& table, const Options& options, const float* grad_scale,
               const float* found_inf) override;
  StepResult verdict(const Options& options) override;
  void set_steps(const TableState& state) override;
  void refresh_master(int e, const ParamTable& table) override;
  std::vector<BufferView> buffers() override;
  void set_stream(void*) override {}  // one "stream": the emulator runs a launch at a time
  int64_t launches_last_step() const { return backend_.launches_last_step(); }

 private:
  const Layout& layout_;
  EmulatedCudaBackend backend_;
  TableState device_;  // the device's state and counters
  const ParamTable* table_ = nullptr;  // the last step's
};

// step_kernels.cuh's at(): where the kernels find element i of a matrix whose rows lie in `runs`.
int64_t device_row_runs_at(cuda::Runs runs, int64_t i);

// One Newton-Schulz batch alone, as BatchedNewtonSchulz::run runs it (either algorithm, the kernels on the
// emulator, the GEMMs emulated): `inputs` holds shape.count row-major rows x cols matrices back to back,
// rounded to the batch's precision on the way in; `outputs` the same way.
struct EmulatedNewtonSchulz {
  std::vector<float> outputs;
  int64_t launches = 0;  // kernels and GEMMs
};
EmulatedNewtonSchulz emulated_newton_schulz(const cuda::NsBatchShape& shape, const std::vector<float>& inputs);

}  // namespace normuon::test
