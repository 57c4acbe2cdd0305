#include "fast_cuda_backend.h"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "cuda_check.h"
#include "cuda_device.h"
#include "newton_schulz_cuda.h"
#include "normuon/ns_coefficients.h"
#include "nvtx_range.h"
#include "step_kernels.cuh"
#include "step_plan.h"
#include "stream_launch.cuh"

namespace normuon {
namespace {

using cuda::DeviceBuffer;

// Makes `device` current for a scope (the runtime's current device is per host thread).
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    NORMUON_CUDA_CHECK(cudaGetDevice(&saved_));
    if (saved_ != device) NORMUON_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceScope() { cudaSetDevice(saved_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int saved_ = 0;
};

template <typename T>
DeviceBuffer<T> to_device(const std::vector<T>& host) {
  DeviceBuffer<T> buffer(static_cast<int64_t>(host.size()));
  if (!host.empty()) NORMUON_CUDA_CHECK(cudaMemcpy(buffer.data(), host.data(), buffer.bytes(), cudaMemcpyHostToDevice));
  return buffer;
}

const char* kPhaseNames[] = {"normuon.momentum", "normuon.newton_schulz", "normuon.normalisation", "normuon.update",
                             "normuon.adamw"};

// One part of a phase as a step enqueues it: its NVTX range and, on a timed step, events before and after.
class PhasePart {
 public:
  PhasePart(const char* name, cudaStream_t stream, cudaEvent_t begin, cudaEvent_t end)
      : range_(name), stream_(stream), end_(end) {
    if (begin) NORMUON_CUDA_CHECK(cudaEventRecord(begin, stream));
  }
  ~PhasePart() {
    if (end_) cudaEventRecord(end_, stream_);  // no throwing from a destructor; finish_step checks the events
  }
  PhasePart(const PhasePart&) = delete;
  PhasePart& operator=(const PhasePart&) = delete;

 private:
  cuda::NvtxRange range_;
  cudaStream_t stream_;
  cudaEvent_t end_;
};

}  // namespace

std::string FastCudaBackend::unsupported_reason(const Layout& layout, const Options& options, int device) {
  const std::string reason = cuda::plan_unsupported_reason(layout, options);
  return reason.empty() ? cuda::unavailable_reason(device) : reason;
}

FastCudaBackend::FastCudaBackend(const Layout& layout, const Options& options, const FastCudaConfig& config)
    : layout_(layout), device_index_(config.device) {
  const std::string reason = unsupported_reason(layout, options, config.device);
  if (!reason.empty()) throw std::invalid_argument("fast-cuda backend: " + reason);
  if (config.ns_panel_width < 0)
    throw std::invalid_argument("fast-cuda backend: ns_panel_width must be 0 (the backend's choice) or positive");
  const DeviceScope scope(device_index_);
  if (config.stream) {
    stream_ = config.stream;
  } else {  // the legacy default stream cannot be captured into a graph
    NORMUON_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    own_stream_ = true;
  }
  caller_tensors_ = config.caller_tensors;
  device_ = std::make_unique<cuda::DeviceFlatState>(layout, config.grad_type, config.bf16_params, config.caller_tensors);

  cuda::StepPlan plan = cuda::StepPlan::build(layout, options, config.ns_budget);
  for (cuda::NsBatchShape& shape : plan.batches) shape.panel_width = config.ns_panel_width;
  ns_ = std::make_unique<cuda::BatchedNewtonSchulz>(plan.batches, stream_);
  for (size_t b = 0; b < plan.batches.size(); ++b) {
    const cuda::NsBatchShape& shape = plan.batches[b];
    batch_knobs_.push_back(
        {plan.batch_group[b], shape.precision, shape.coefficients, shape.steps, shape.eps, shape.algorithm});
  }
  // Each matrix reads and writes its slot of its batch's Newton-Schulz buffers.
  for (size_t m = 0; m < plan.matrices.size(); ++m) {
    cuda::MatrixInfo& info = plan.matrices[m];
    const int batch = plan.matrix_batch[m];
    const int64_t at = ns_->stride(batch) * plan.matrix_index[m] * static_cast<int64_t>(info.ns_bf16 ? 2 : 4);  // bytes
    info.ns_input = static_cast<char*>(ns_->input(batch)) + at;
    info.ns_output = static_cast<const char*>(ns_->output(batch)) + at;
  }
  host_matrices_ = plan.matrices;
  entries_ = to_device(plan.entries);
  matrices_ = to_device(plan.matrices);
  scan_chunks_ = to_device(plan.scan_chunks);
  normuon_chunks_ = to_device(plan.normuon_chunks);
  adamw_chunks_ = to_device(plan.adamw_chunks);
  stat_tasks_ = to_device(plan.stat_tasks);
  batch_ranges_ = plan.batch_ranges;
  tables_ = plan.tables(scan_chunks_.data(), normuon_chunks_.data(), adamw_chunks_.data(), stat_tasks_.data(),
                        batch_ranges_.data());
  groups_ = DeviceBuffer<cuda::GroupScalars>(static_cast<int64_t>(layout.group_names.size()));
  entry_scalars_ = DeviceBuffer<cuda::EntryScalars>(static_cast<int64_t>(layout.entries.size()));
  matrix_scalars_ = DeviceBuffer<cuda::MatrixScalars>(tables_.n_matrices);
  stat_sums_ = DeviceBuffer<double>(layout.stat_floats);
  inv_scale_ = DeviceBuffer<float>(layout.stat_floats);
  status_ = DeviceBuffer<cuda::StepStatus>(1);
  NORMUON_CUDA_CHECK(cudaMemset(status_.data(), 0xff, sizeof(cuda::StepStatus)));  // nothing bad reported

  // Per entry, where its tensors are: the flat buffers here; in table mode, set_tensors() says.
  const size_t n_entries = layout.entries.size();
  operands_ = DeviceBuffer<cuda::EntryOperands>(static_cast<int64_t>(n_entries));
  host_operands_.assign(n_entries, cuda::EntryOperands{});
  host_has_grad_.assign(n_entries, 0);
  NORMUON_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&staged_operands_), std::max<size_t>(n_entries, 1) * sizeof(cuda::EntryOperands)));
  NORMUON_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&staged_has_grad_), std::max<size_t>(n_entries, 1)));
  NORMUON_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&polled_status_), sizeof(cuda::StepStatus)));
  NORMUON_CUDA_CHECK(cudaEventCreateWithFlags(&staged_event_, cudaEventDisableTiming));
  NORMUON_CUDA_CHECK(cudaEventCreateWithFlags(&status_event_, cudaEventDisableTiming));
  if (!caller_tensors_) {
    const size_t grad_bytes = device_->grad_type() == cuda::ElemType::f32 ? 4 : 2;
    for (size_t e = 0; e < n_entries; ++e) {
      const int64_t at = layout.entries[e].offset;
      cuda::EntryOperands& op = host_operands_[e];
      op.master = device_->params.data() + at;
      op.low = config.bf16_params ? device_->params_bf16.data() + at : nullptr;
      op.low_type = cuda::ElemType::bf16;
      op.grad = static_cast<const char*>(device_->grads()) + static_cast<size_t>(at) * grad_bytes;
      op.grad_type = device_->grad_type();
    }
    if (n_entries > 0)
      NORMUON_CUDA_CHECK(cudaMemcpy(operands_.data(), host_operands_.data(), operands_.bytes(), cudaMemcpyHostToDevice));
  }

  cuda::StepBuffers& b = buffers_;
  b.operands = operands_.data();
  b.momentum = device_->momentum.data();
  b.row_var = device_->row_var.data();
  b.exp_avg = device_->exp_avg.data();
  b.exp_avg_sq = device_->exp_avg_sq.data();
  b.has_grad = device_->has_grad.data();
  b.group_steps = device_->group_steps.data();
  b.entry_steps = device_->entry_steps.data();
  b.entry_scalars = entry_scalars_.data();
  b.n_entries = static_cast<int32_t>(plan.entries.size());
  b.n_groups = static_cast<int32_t>(layout.group_names.size());
  b.entries = entries_.data();
  b.matrices = matrices_.data();
  b.groups = groups_.data();
  b.matrix_scalars = matrix_scalars_.data();
  b.stat_sums = stat_sums_.data();
  b.inv_scale = inv_scale_.data();
  b.status = status_.data();

  // Counted as enqueue_step() issues them (launchers skip empty passes).
  launches_per_step_ = plan.elementwise_launches();
  for (int i = 0; i < ns_->size(); ++i) launches_per_step_ += ns_->launches(i);

  // A timed step's events: two per part of a phase (the prologue and AdamW, four parts per batch).
  phase_events_.resize(2 * (2 + 4 * batch_ranges_.size()));
  for (auto& event : phase_events_) NORMUON_CUDA_CHECK(cudaEventCreate(&event));
  timed_parts_.reserve(phase_events_.size() / 2);
  // upload_staged's slots: room for the largest set of values uploaded at once (set_options's scalars,
  // or set_steps's counters), each piece 16-byte aligned.
  const auto aligned = [](size_t bytes) { return (bytes + 15) / 16 * 16; };
  ring_bytes_ = std::max(aligned(groups_.bytes()) + aligned(entry_scalars_.bytes()) + aligned(matrix_scalars_.bytes()),
                         aligned(device_->group_steps.bytes()) + aligned(device_->entry_steps.bytes()));
  for (size_t i = 0; i < ring_.size(); ++i) {
    NORMUON_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&ring_[i]), std::max<size_t>(ring_bytes_, 16)));
    NORMUON_CUDA_CHECK(cudaEventCreateWithFlags(&ring_done_[i], cudaEventDisableTiming));
  }
  all_rounded_ = DeviceBuffer<unsigned long long>(1);
  set_options(options);
  // The table copies above ran on the legacy stream, which the backend's non-blocking stream does not
  // wait for: settle everything once, here, at setup.
  NORMUON_CUDA_CHECK(cudaDeviceSynchronize());
}

FastCudaBackend::~FastCudaBackend() {
  // No throwing here (the runtime may be unloading at exit): switch devices without checks.
  int saved = 0;
  const bool switched = cudaGetDevice(&saved) == cudaSuccess && saved != device_index_ &&
                        cudaSetDevice(device_index_) == cudaSuccess;
  cudaStreamSynchronize(stream_);  // no kernel may still read what is freed below
  release_graph();
  for (auto& event : phase_events_)
    if (event) cudaEventDestroy(event);
  for (cudaEvent_t event : {staged_event_, status_event_, ring_done_[0], ring_done_[1]})
    if (event) cudaEventDestroy(event);
  for (void* pinned : {static_cast<void*>(staged_operands_), static_cast<void*>(staged_has_grad_),
                       static_cast<void*>(polled_status_), static_cast<void*>(ring_[0]), static_cast<void*>(ring_[1])})
    if (pinned) cudaFreeHost(pinned);
  ns_.reset();
  if (own_stream_) cudaStreamDestroy(stream_);
  if (switched) cudaSetDevice(saved);
}

void FastCudaBackend::set_stream(cudaStream_t stream) {
  if (stream == stream_) return;
  const DeviceScope scope(device_index_);
  // Work already queued on the old stream (uploads, a step) must come first.
  NORMUON_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (own_stream_) NORMUON_CUDA_CHECK(cudaStreamDestroy(stream_));
  own_stream_ = false;
  stream_ = stream;
  ns_->set_stream(stream);
}

void FastCudaBackend::release_graph() {
  if (graph_exec_) cudaGraphExecDestroy(graph_exec_);
  if (graph_) cudaGraphDestroy(graph_);
  graph_exec_ = nullptr;
  graph_ = nullptr;
  graph_kernel_nodes_ = 0;
}

void FastCudaBackend::set_options(const Options& options, const std::vector<int64_t>* group_steps,
                                  const std::vector<int64_t>* entry_steps) {
  if (group_steps && group_steps->size() != layout_.group_names.size())
    throw std::invalid_argument("set_options: " + std::to_string(group_steps->size()) + " group steps for " +
                                std::to_string(layout_.group_names.size()) + " groups");
  if (entry_steps && entry_steps->size() != layout_.entries.size())
    throw std::invalid_argument("set_options: " + std::to_string(entry_steps->size()) + " entry steps for " +
                                std::to_string(layout_.entries.size()) + " parameters");
  if (options.groups.size() != layout_.group_names.size())
    throw std::invalid_argument("the options define " + std::to_string(options.groups.size()) +
                                " groups but the layout was built with " + std::to_string(layout_.group_names.size()));
  for (const NsKnobs& k : batch_knobs_) {
    const NorMuonHyper& h = options.groups[k.group].normuon;
    if (h.ns_precision != k.precision || h.ns_coefficients != k.coefficients || h.ns_steps != k.steps || h.ns_eps != k.eps ||
        h.ns_algorithm != k.algorithm)
      throw std::invalid_argument("fast-cuda backend: group '" + options.groups[k.group].name +
                                  "' changed a Newton-Schulz knob (ns_precision, ns_coefficients, ns_steps, ns_eps or "
                                  "ns_algorithm) "
                                  "after the backend was built; build a new backend for it");
  }
  const DeviceScope scope(device_index_);
  host_groups_.clear();
  for (size_t g = 0; g < options.groups.size(); ++g) host_groups_.push_back(cuda::group_scalars(options.groups[g]));
  cuda::fill_entry_scalars(layout_, options, group_steps, entry_steps, host_entry_scalars_);
  cuda::fill_matrix_scalars(layout_, host_matrices_, options, host_matrix_scalars_);
  upload_staged({{groups_.data(), host_groups_.data(), groups_.bytes()},
                 {entry_scalars_.data(), host_entry_scalars_.data(), host_entry_scalars_.empty() ? 0 : entry_scalars_.bytes()},
                 {matrix_scalars_.data(), host_matrix_scalars_.data(), tables_.n_matrices > 0 ? matrix_scalars_.bytes() : 0}});
}

void FastCudaBackend::upload_staged(std::initializer_list<Upload> uploads) {
  const DeviceScope scope(device_index_);
  char* slot = ring_[static_cast<size_t>(ring_next_)];
  cudaEvent_t& done = ring_done_[static_cast<size_t>(ring_next_)];
  NORMUON_CUDA_CHECK(cudaEventSynchronize(done));  // the copy from this slot, two uploads ago, has run
  size_t at = 0;
  for (const Upload& u : uploads) {
    if (u.bytes == 0) continue;
    if (at + u.bytes > ring_bytes_) throw std::logic_error("fast-cuda backend: an upload larger than its slot");
    std::memcpy(slot + at, u.host, u.bytes);
    NORMUON_CUDA_CHECK(cudaMemcpyAsync(u.device, slot + at, u.bytes, cudaMemcpyHostToDevice, stream_));
    at += (u.bytes + 15) / 16 * 16;
  }
  NORMUON_CUDA_CHECK(cudaEventRecord(done, stream_));
  ring_next_ ^= 1;
}

void FastCudaBackend::enqueue(const TableState& state, const ParamTable& table, const Options& options,
                              const float* grad_scale, const float* found_inf) {
  set_tensors(table);                              // re-uploaded only when an address changed
  set_options(options, nullptr, &state.entry_steps);  // the host's counts: host-exact bias corrections
  set_grad_scaling(grad_scale, found_inf);
  enqueue_step();
}

void FastCudaBackend::set_steps(const TableState& state) {
  if (state.group_steps.size() != layout_.group_names.size() || state.entry_steps.size() != layout_.entries.size())
    throw std::invalid_argument("fast-cuda backend: counters of another layout");
  upload_staged({{device_->group_steps.data(), state.group_steps.data(), device_->group_steps.bytes()},
                 {device_->entry_steps.data(), state.entry_steps.data(), device_->entry_steps.bytes()}});
}

void FastCudaBackend::refresh_master(int e, const ParamTable& table) {
  if (!caller_tensors_) throw std::logic_error("fast-cuda backend: refresh_master() needs table mode");
  const DeviceScope scope(device_index_);
  // All bits set: "every element still holds its master rounded" until the first kernel finds one that does not.
  NORMUON_CUDA_CHECK(cudaMemsetAsync(all_rounded_.data(), 0xff, sizeof(unsigned long long), stream_));
  cuda::step_device::refresh_master(cuda::StreamLaunch{stream_}, cuda::entry_operands(table, e, device_->masters.data()),
                                    layout_.entries.at(static_cast<size_t>(e)).numel, all_rounded_.data());
}

std::vector<BufferView> FastCudaBackend::buffers() { return state_buffers(*device_, true); }

std::vector<std::string> FastCudaBackend::fixed_fields() const { return cuda::planned_fields(); }

void FastCudaBackend::set_tensors(const ParamTable& table) {
  if (!caller_tensors_) throw std::logic_error("fast-cuda backend: set_tensors() needs caller_tensors (table mode)");
  if (table.layout != &layout_) throw std::invalid_argument("fast-cuda backend: the parameter table has another layout");
  const std::string reason = table.invalid_reason();
  if (!reason.empty()) throw std::invalid_argument("fast-cuda backend: " + reason);
  bool changed = !tensors_set_;
  for (size_t e = 0; e < host_operands_.size(); ++e) {
    const cuda::EntryOperands op = cuda::entry_operands(table, static_cast<int>(e), device_->masters.data());
    const uint8_t has = table.grads[e].data != nullptr;
    changed = changed || std::memcmp(&op, &host_operands_[e], sizeof op) != 0 || has != host_has_grad_[e];
    host_operands_[e] = op;
    host_has_grad_[e] = has;
  }
  if (changed) upload_operands();
  tensors_set_ = true;
  table_ = &table;
}

void FastCudaBackend::upload_operands() {
  const DeviceScope scope(device_index_);
  const size_t n = host_operands_.size();
  if (n == 0) return;
  NORMUON_CUDA_CHECK(cudaEventSynchronize(staged_event_));  // the previous upload has left the staging
  std::memcpy(staged_operands_, host_operands_.data(), n * sizeof(cuda::EntryOperands));
  std::memcpy(staged_has_grad_, host_has_grad_.data(), n);
  NORMUON_CUDA_CHECK(cudaMemcpyAsync(operands_.data(), staged_operands_, operands_.bytes(), cudaMemcpyHostToDevice, stream_));
  NORMUON_CUDA_CHECK(cudaMemcpyAsync(device_->has_grad.data(), staged_has_grad_, n, cudaMemcpyHostToDevice, stream_));
  NORMUON_CUDA_CHECK(cudaEventRecord(staged_event_, stream_));
}

int64_t FastCudaBackend::workspace_bytes() const {
  return ns_->workspace_bytes() + static_cast<int64_t>(all_rounded_.bytes()) +
         static_cast<int64_t>(scan_chunks_.bytes() + normuon_chunks_.bytes() + adamw_chunks_.bytes() +
                              stat_tasks_.bytes() + entries_.bytes() + operands_.bytes() + matrices_.bytes() +
                              groups_.bytes() + entry_scalars_.bytes() + matrix_scalars_.bytes() + stat_sums_.bytes() +
                              inv_scale_.bytes() + status_.bytes());
}

StepResult FastCudaBackend::poll_step(const Options& options) {
  if (!status_pending_) return {};
  const DeviceScope scope(device_index_);
  NORMUON_CUDA_CHECK(cudaEventSynchronize(status_event_));
  status_pending_ = false;
  const cuda::StepStatus status = *polled_status_;
  if (status.reported_bad != cuda::kNoBadGradient)  // reported: cleared
    NORMUON_CUDA_CHECK(cudaMemsetAsync(status_.data(), 0xff, sizeof status, stream_));
  return cuda::step_verdict(status, layout_, options, caller_tensors_ ? table_ : nullptr);
}

void FastCudaBackend::enqueue_step() {
  if (caller_tensors_ && !tensors_set_)
    throw std::logic_error("fast-cuda backend: enqueue_step() in table mode before set_tensors()");
  const DeviceScope scope(device_index_);
  const cuda::NvtxRange step_range("normuon.step");
  const bool timed = timing_ && !capturing_;
  // This step's first_bad only: the reported_* fields keep what earlier steps found until finish_step.
  NORMUON_CUDA_CHECK(cudaMemsetAsync(&status_.data()->first_bad, 0xff, sizeof(unsigned long long), stream_));
  timed_parts_.clear();  // within its reserved capacity: nothing allocated
  auto phase = [&](int i) {  // NVTX range and, timed, events of a part of phase i
    cudaEvent_t begin = nullptr, end = nullptr;
    if (timed && 2 * (timed_parts_.size() + 1) <= phase_events_.size()) {
      begin = phase_events_[2 * timed_parts_.size()];
      end = phase_events_[2 * timed_parts_.size() + 1];
      timed_parts_.push_back({i, begin, end});
    }
    return PhasePart(kPhaseNames[i], stream_, begin, end);
  };
  auto newton_schulz = [&](int i) { ns_->run(i); };
  cuda::step_device::run_step(cuda::StreamLaunch{stream_}, buffers_, tables_, newton_schulz, phase);
  if (!capturing_) {
    timed_step_pending_ = timed;
    // This step's status for poll_step(): a small copy behind it, and an event to wait on.
    NORMUON_CUDA_CHECK(cudaMemcpyAsync(polled_status_, status_.data(), sizeof(cuda::StepStatus), cudaMemcpyDeviceToHost, stream_));
    NORMUON_CUDA_CHECK(cudaEventRecord(status_event_, stream_));
    status_pending_ = true;
  }
}

StepResult FastCudaBackend::finish_step(const Options& options) {
  const DeviceScope scope(device_index_);
  NORMUON_CUDA_CHECK(cudaStreamSynchronize(stream_));
  status_pending_ = false;  // this verdict covers it
  if (timed_step_pending_) {  // each phase: the sum of its parts (the NorMuon phases run a batch at a time)
    double ms[5] = {};
    for (const TimedPart& part : timed_parts_) {
      float t = 0;
      NORMUON_CUDA_CHECK(cudaEventElapsedTime(&t, part.begin, part.end));
      ms[part.phase] += t;
    }
    times_ = PhaseTimes{ms[0], ms[1], ms[2], ms[3], ms[4], ms[0] + ms[1] + ms[2] + ms[3] + ms[4]};
    timed_step_pending_ = false;
  }
  cuda::StepStatus status{};
  NORMUON_CUDA_CHECK(cudaMemcpy(&status, status_.data(), sizeof status, cudaMemcpyDeviceToHost));
  if (status.reported_bad == cuda::kNoBadGradient) return {};
  // Reported: clear it for the next steps (on the stream, ahead of anything enqueued later).
  NORMUON_CUDA_CHECK(cudaMemsetAsync(status_.data(), 0xff, sizeof status, stream_));
  return cuda::step_result(status, layout_, options, caller_tensors_ ? table_ : nullptr);
}

StepResult FastCudaBackend::step(FlatState& state, const Options& options) {
  if (state.layout != &layout_) throw std::invalid_argument("fast-cuda backend: the state has another layout");
  if (caller_tensors_)
    throw std::logic_error("fast-cuda backend: step(FlatState&) on a table-mode backend (caller_tensors); use "
                           "set_tensors() and enqueue_step()");
  const DeviceScope scope(device_index_);
  set_grad_scaling(nullptr, nullptr);  // the FlatState form never scales: no scaler left from table mode
  set_options(options, &state.group_steps, &state.entry_steps);  // checks the groups first, before anything moves
  device_->upload(state, stream_);
  enqueue_step();
  const StepResult result = finish_step(options);  // throws under nonfinite=error: the host state is untouched
  if (!result.skipped) device_->download(state, stream_);
  return result;
}

void FastCudaBackend::capture_graph() {
  const DeviceScope scope(device_index_);
  NORMUON_CUDA_CHECK(cudaStreamSynchronize(stream_));
  release_graph();
  NORMUON_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  capturing_ = true;
  try {
    enqueue_step();
  } catch (...) {
    capturing_ = false;
    cudaGraph_t broken = nullptr;
    cudaStreamEndCapture(stream_, &broken);
    if (broken) cudaGraphDestroy(broken);
    throw;
  }
  capturing_ = false;
  NORMUON_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph_));
  NORMUON_CUDA_CHECK(cudaGraphInstantiate(&graph_exec_, graph_, 0));
  size_t n_nodes = 0;
  NORMUON_CUDA_CHECK(cudaGraphGetNodes(graph_, nullptr, &n_nodes));
  std::vector<cudaGraphNode_t> nodes(n_nodes);
  NORMUON_CUDA_CHECK(cudaGraphGetNodes(graph_, nodes.data(), &n_nodes));
  graph_kernel_nodes_ = 0;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type;
    NORMUON_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
    graph_kernel_nodes_ += type == cudaGraphNodeTypeKernel;
  }
}

void FastCudaBackend::replay_graph() {
  if (!graph_exec_) throw std::logic_error("fast-cuda backend: replay_graph() before capture_graph()");
  const DeviceScope scope(device_index_);
  const cuda::NvtxRange range("normuon.step (graph)");
  NORMUON_CUDA_CHECK(cudaGraphLaunch(graph_exec_, stream_));
}

double FastCudaBackend::newton_schulz_flops() const {
  double flops = 0;
  for (int i = 0; i < ns_->size(); ++i) flops += ns_->flops(i);
  return flops;
}

std::string FastCudaBackend::describe() const {
  std::ostringstream out;
  out << "fast-cuda on " << cuda::describe_device(device_index_) << ": " << tables_.n_matrices << " NorMuon matrices in "
      << ns_->size() << " Newton-Schulz batches, " << tables_.n_normuon_chunks << " + " << tables_.n_adamw_chunks
      << " chunks of <= "
      << cuda::kChunkElements << " elements, " << launches_per_step_ << " launches per step\n"
      << ns_->describe();
  return out.str();
}

}  // namespace normuon
