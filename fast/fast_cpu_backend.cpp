#include "fast_cpu_backend.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <sstream>
#include <stdexcept>

#include "cpu_kernels.h"
#include "normuon/low_precision.h"
#include "normuon/ns_algorithm.h"
#include "normuon/row_runs.h"
#include "normuon/step_prologue.h"
#include "newton_schulz.h"
#include "thread_budget.h"
#include "work_pool.h"

namespace normuon {
namespace {

constexpr int64_t kChunk = 1 << 15;  // floats per multi-tensor work item: 128 KiB, fits L2

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// Some batch would run Gram Newton-Schulz under these options (square ones never do).
bool asks_for_gram(const std::vector<NsBatch>& batches, const Options& options) {
  for (const auto& b : batches)
    if (ns_uses_gram(options.groups.at(static_cast<size_t>(b.group)).normuon.ns_algorithm, b.rows, b.cols)) return true;
  return false;
}

}  // namespace

std::string FastCpuBackend::unsupported_reason(const Layout& layout, const Options& options) {
  return fused_step_unsupported_reason(layout, options);
}

FastCpuBackend::FastCpuBackend(const Layout& layout, const Options& options, int threads)
    : layout_(layout), threads_(threads > 0 ? threads : fast::default_threads()) {
  const std::string reason = unsupported_reason(layout, options);
  if (!reason.empty()) throw std::invalid_argument("fast-cpu backend: " + reason);
  batches_ = newton_schulz_batches(layout);
  size_t ns_matrices = 0;
  for (const auto& b : batches_) {
    ns_shapes_.push_back({b.rows, b.cols, static_cast<int64_t>(b.entries.size())});
    ns_matrices += b.entries.size();
  }
  pool_ = std::make_unique<fast::WorkPool>(threads_);
  // Gram's products and buffers only when the options ask for it (run() adds them if later ones do).
  ns_ = std::make_unique<fast::BatchedNewtonSchulz>(ns_shapes_, *pool_, fast::NsSplit::automatic,
                                                    asks_for_gram(batches_, options));
  // Chunk tables for the multi-tensor passes, built once.
  for (int i = 0; i < static_cast<int>(layout.entries.size()); ++i) {
    const LayoutEntry& e = layout.entries[i];
    auto& chunks = e.algorithm == Algorithm::normuon ? normuon_chunks_ : adamw_chunks_;
    for (int64_t begin = 0; begin < e.numel; begin += kChunk) chunks.push_back({i, begin, std::min(kChunk, e.numel - begin)});
    if (e.algorithm == Algorithm::normuon) {
      max_cols_ = std::max(max_cols_, e.cols);
      max_stat_ = std::max(max_stat_, e.stat_len);
    }
  }
  update_.assign(static_cast<size_t>(layout.normuon_floats), 0.0f);
  col_sums_.assign(static_cast<size_t>(threads_ * std::max<int64_t>(max_cols_, 1)), 0.0);
  inv_scale_.assign(static_cast<size_t>(threads_ * std::max<int64_t>(max_stat_, 1)), 0.0f);
  ns_in_.resize(ns_matrices);
  ns_out_.resize(ns_matrices);
  ns_work_.resize(batches_.size());
  phase_ms_.assign(static_cast<size_t>(2 * threads_), 0.0);
  grad_scratch_.assign(static_cast<size_t>(threads_ * kChunk), 0.0f);
  operands_.params.resize(layout.entries.size());
}

FastCpuBackend::~FastCpuBackend() = default;

int64_t FastCpuBackend::workspace_bytes() const {
  return static_cast<int64_t>(update_.size() * sizeof(float) + col_sums_.size() * sizeof(double) +
                              inv_scale_.size() * sizeof(float) + grad_scratch_.size() * sizeof(float) +
                              (ns_in_.size() + ns_out_.size()) * sizeof(void*) + ns_work_.size() * sizeof(fast::NsWork) +
                              phase_ms_.size() * sizeof(double)) +
         ns_->workspace_bytes();
}

std::string FastCpuBackend::describe() const {
  std::ostringstream out;
  out << "fast-cpu: " << batches_.size() << " Newton-Schulz batches, " << normuon_chunks_.size() << " + "
      << adamw_chunks_.size() << " chunks of <= " << kChunk << " floats, " << threads_ << " threads\n";
  for (size_t b = 0; b < batches_.size(); ++b)
    out << "  batch " << b << ": " << batches_[b].entries.size() << " x [" << batches_[b].rows << ", "
        << batches_[b].cols << "] group " << layout_.group_names[batches_[b].group]
        << (ns_->per_matrix(static_cast<int>(b)) ? ", a matrix per thread" : ", on oneDNN's threads") << ", GEMM "
        << ns_->gemm_implementation(static_cast<int>(b), NsPrecision::bf16) << " (bf16), "
        << ns_->gemm_implementation(static_cast<int>(b), NsPrecision::fp32) << " (fp32)\n";
  return out.str();
}

StepResult FastCpuBackend::step(FlatState& state, const Options& options) {
  if (state.layout != &layout_) throw std::invalid_argument("fast-cpu backend: the state has another layout");
  operands_.bind(state);
  return run(options);
}

StepResult FastCpuBackend::step(TableState& state, const ParamTable& table, const Options& options,
                                const float* grad_scale) {
  if (state.layout != &layout_) throw std::invalid_argument("fast-cpu backend: the state has another layout");
  operands_.bind(state, table);
  operands_.set_grad_scale(grad_scale, "fast-cpu backend");
  return run(options);
}

StepResult FastCpuBackend::run(const Options& options) {
  StepOperands& ops = operands_;
  fast::WorkPool& pool = *pool_;
  const auto t_start = Clock::now();
  // Options that turn Gram Newton-Schulz on after construction: this step builds its products and
  // buffers (the one step that allocates), the standard ones again with them; the old set goes first,
  // so that the two are never held at once.
  if (!ns_->with_gram() && asks_for_gram(batches_, options)) {
    ns_.reset();
    ns_ = std::make_unique<fast::BatchedNewtonSchulz>(ns_shapes_, pool, fast::NsSplit::automatic, true);
  }
  times_ = PhaseTimes{};
  counters_ = FastStepCounters{};
  const int64_t gemm_calls_before = ns_->gemm_calls();

  // A chunk of a gradient as fp32: in place when it is fp32, else widened into this thread's scratch;
  // divided by a gradient scaler's scale there too (g / scale, as torch's fused AdamW unscales).
  const float* grad_scale = ops.grad_scale;
  auto grad_chunk = [&](const ParamOperand& op, int64_t begin, int64_t n, int slot) -> const float* {
    // In place when the chunk lies in one run of the tensor (always, for a dense one).
    if (op.grad_dtype == DType::f32 && !grad_scale && op.grad_runs.at(begin + n - 1) - op.grad_runs.at(begin) == n - 1)
      return static_cast<const float*>(op.grad) + op.grad_runs.at(begin);
    float* scratch = grad_scratch_.data() + static_cast<int64_t>(slot) * kChunk;
    widen_rows(op.grad, op.grad_dtype, op.grad_runs, begin, scratch, n);
    if (grad_scale) fast::divide_round(scratch, n, *grad_scale, /*bf16=*/false);
    return scratch;
  };

  // NaN/Inf: every gradient in one parallel pass; only a step that has one is scanned again, in order,
  // by the prologue, which names the first as every backend does. (Under a gradient scaler the caller
  // checks the gradients.)
  bool finite = false;
  if (!grad_scale) {
    const int64_t nn = static_cast<int64_t>(normuon_chunks_.size());
    std::atomic<bool> found{false};
    pool.run(nn + static_cast<int64_t>(adamw_chunks_.size()), [&](int64_t c, int slot) {
      const Chunk& chunk = c < nn ? normuon_chunks_[c] : adamw_chunks_[c - nn];
      const ParamOperand& op = ops.params[chunk.entry];
      if (!op.grad || found.load(std::memory_order_relaxed)) return;
      if (!fast::all_finite(grad_chunk(op, chunk.begin, chunk.size, slot), chunk.size))
        found.store(true, std::memory_order_relaxed);
    });
    finite = !found.load();
  }
  if (auto skipped = begin_step(ops, options, finite)) return *skipped;
  ++counters_.elementwise_passes;  // the gradient scan
  // A bf16 / fp16 parameter follows its master, rounded, while the values are in cache.
  auto write_low = [](const ParamOperand& op, int64_t begin, int64_t n) {
    if (op.low) narrow_rows(op.master + begin, op.low, op.low_dtype, op.low_runs, begin, n);
  };

  // Phase 1: momentum + Nesterov over every NorMuon matrix, one pass. Every pass goes through the work
  // pool (work_pool.h: its threads wait without spinning), a chunk or a matrix per item.
  auto t0 = Clock::now();
  pool.run(static_cast<int64_t>(normuon_chunks_.size()), [&](int64_t c, int slot) {
    const Chunk& chunk = normuon_chunks_[c];
    const ParamOperand& op = ops.params[chunk.entry];
    if (!op.grad) return;
    const LayoutEntry& e = layout_.entries[chunk.entry];
    const NorMuonHyper& h = options.groups[e.group].normuon;
    const int64_t at = e.offset + chunk.begin;
    fast::momentum_nesterov(ops.momentum + at, grad_chunk(op, chunk.begin, chunk.size, slot), update_.data() + at,
                            chunk.size, static_cast<float>(1 - h.beta1), static_cast<float>(h.beta1), h.nesterov);
  });
  ++counters_.elementwise_passes;
  if (timing_) times_.momentum = ms_since(t0);

  // Phase 2: Newton-Schulz, one batch per shape and group, written back into update_ in place; all
  // batches in one run, so that the threads share out the matrices of all of them at once.
  t0 = Clock::now();
  int n_work = 0;
  size_t at = 0;
  for (size_t b = 0; b < batches_.size(); ++b) {
    const NsBatch& batch = batches_[b];
    bool any = false;
    for (size_t k = 0; k < batch.entries.size(); ++k) {
      const LayoutEntry& e = layout_.entries[batch.entries[k]];
      ns_in_[at + k] = update_.data() + e.offset;
      ns_out_[at + k] = update_.data() + e.offset;
      any = any || ops.has_grad(batch.entries[k]);
    }
    // Matrices without a gradient ride along in the batch; their output is unused.
    if (any) {
      ns_work_[static_cast<size_t>(n_work++)] = {static_cast<int>(b), ns_in_.data() + at, ns_out_.data() + at,
                                                 &options.groups[batch.group].normuon};
      counters_.elementwise_passes += 2 + 3 * options.groups[batch.group].normuon.ns_steps;
    }
    at += batch.entries.size();
  }
  ns_->run(ns_work_.data(), n_work);
  if (timing_) times_.newton_schulz = ms_since(t0);

  // Phases 3-4: statistics, second moment, normalisation, re-norm, decay and step; one matrix per thread.
  std::fill(phase_ms_.begin(), phase_ms_.end(), 0.0);
  pool.run(static_cast<int64_t>(layout_.entries.size()), [&](int64_t i, int slot) {
    const LayoutEntry& e = layout_.entries[i];
    const ParamOperand& op = ops.params[i];
    if (e.algorithm != Algorithm::normuon || !op.grad || e.numel == 0) return;
    const NorMuonHyper& h = options.groups[e.group].normuon;
    fast::NorMuonScalars s;
    s.stats_per_row = e.stats_per_row;
    s.w2 = static_cast<float>(1 - h.beta2);
    s.eps_add = h.eps_placement == EpsPlacement::add;
    s.denom_eps = static_cast<float>(h.denom_eps);
    s.renorm_eps = static_cast<float>(h.renorm_eps);
    s.kappa = static_cast<float>(entry_kappa(e, h.lr_scale));
    s.wd_mode = h.weight_decay_mode == WeightDecayMode::decoupled ? 0 : h.weight_decay_mode == WeightDecayMode::cautious ? 1 : 2;
    s.decay = h.weight_decay != 0 && s.wd_mode != 2;
    s.decay_factor = static_cast<float>(1 - h.lr * h.weight_decay);
    s.lr_wd = static_cast<float>(h.lr * h.weight_decay);
    s.neg_lr = static_cast<float>(-h.lr);
    fast::NorMuonPassTimes pass_times;
    fast::normuon_finalize(update_.data() + e.offset, op.master, op.master_runs, ops.row_var + e.stat_offset, e.rows,
                           e.cols, s, col_sums_.data() + slot * std::max<int64_t>(max_cols_, 1),
                           inv_scale_.data() + slot * std::max<int64_t>(max_stat_, 1), timing_ ? &pass_times : nullptr);
    write_low(op, 0, e.numel);
    phase_ms_[static_cast<size_t>(2 * slot)] += pass_times.normalisation_ms;
    phase_ms_[static_cast<size_t>(2 * slot + 1)] += pass_times.update_ms;
  });
  counters_.elementwise_passes += 3;
  // Summed over threads: CPU time split between the two, scaled to this phase's wall time below.
  if (timing_) {
    double normalisation_ms = 0, update_ms = 0;
    for (int t = 0; t < threads_; ++t) {
      normalisation_ms += phase_ms_[static_cast<size_t>(2 * t)];
      update_ms += phase_ms_[static_cast<size_t>(2 * t + 1)];
    }
    const double wall = ms_since(t0) - times_.newton_schulz;
    const double sum = normalisation_ms + update_ms;
    times_.normalisation = sum > 0 ? wall * normalisation_ms / sum : 0;
    times_.update = sum > 0 ? wall * update_ms / sum : 0;
  }

  // Phase 5: AdamW over every AdamW parameter, one pass.
  t0 = Clock::now();
  pool.run(static_cast<int64_t>(adamw_chunks_.size()), [&](int64_t c, int slot) {
    const Chunk& chunk = adamw_chunks_[c];
    const ParamOperand& op = ops.params[chunk.entry];
    if (!op.grad) return;
    const LayoutEntry& e = layout_.entries[chunk.entry];
    const AdamWHyper& h = options.groups[e.group].adamw;
    const double t = static_cast<double>(ops.entry_steps[chunk.entry]);  // the parameter's own count
    fast::AdamWScalars s;
    s.decay = h.weight_decay != 0;
    s.decay_factor = static_cast<float>(1 - h.lr * h.weight_decay);
    s.w1 = static_cast<float>(1 - h.beta1);
    s.beta2 = static_cast<float>(h.beta2);
    s.one_minus_beta2 = static_cast<float>(1 - h.beta2);
    s.bc2_sqrt = static_cast<float>(std::sqrt(1 - std::pow(h.beta2, t)));
    s.eps = static_cast<float>(h.eps);
    s.neg_step_size = static_cast<float>(-(h.lr / (1 - std::pow(h.beta1, t))));
    const int64_t adam_at = e.adam_offset + chunk.begin;
    fast::adamw(op.master + chunk.begin, grad_chunk(op, chunk.begin, chunk.size, slot), ops.exp_avg + adam_at,
                ops.exp_avg_sq + adam_at, chunk.size, s);
    write_low(op, chunk.begin, chunk.size);
  });
  ++counters_.elementwise_passes;
  if (timing_) {
    times_.adamw = ms_since(t0);
    times_.total = ms_since(t_start);
  }
  counters_.gemm_calls = ns_->gemm_calls() - gemm_calls_before;
  return {};
}

}  // namespace normuon
