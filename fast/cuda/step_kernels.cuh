// Device code of the fused step: the scan, step-counter, momentum, statistics, finalize, update and
// AdamW kernels, and run_step, the order in which one step launches them. Included by step_kernels.cu and by the tests' host
// emulation of the step (tests/simt), so the code the tests run is this code.
//
// Compiled with -fmad=false: every fma below is written out where the reference's ATen op has one (as
// in fast/cpu_kernels.cpp), and nothing else is contracted, so the momentum and AdamW passes round
// exactly like the reference. Reductions are trees in a fixed order (no floating-point atomics): two
// runs give the same bits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "step_kernels.h"

namespace normuon::cuda::step_device {
namespace {  // internal linkage: the library and the tests' emulation each get their own copy

constexpr int kBlock = kStepThreads;
constexpr int kIlp = 4;  // elements in flight per thread in the multi-tensor passes

__device__ __forceinline__ bool step_skipped(const StepStatus* status) {
  return status->first_bad != kNoBadGradient;
}

// torch's lerp (ATen Lerp.h): the weight decides which end anchors the fma.
__device__ __forceinline__ float lerp(float a, float b, float w) {
  return fabsf(w) < 0.5f ? fmaf(w, b - a, a) : fmaf(w - 1.0f, b - a, b);
}

// Where element i of a matrix lies in a tensor with these runs. Dense (every AdamW parameter, every
// buffer of the optimizer's own): i, no division. Runs: only NorMuon matrices have them
// (ParamTable::invalid_reason), which the plan keeps below 2^31 elements (plan_unsupported_reason), so i
// and the run fit 32 bits and the division is a 32-bit one (a 64-bit division is a long subroutine on the
// GPU, once per element); the pitch times the run index stays 64-bit: the tensor may be far larger.
__device__ __forceinline__ int64_t at(Runs r, int64_t i) {
  if (r.run == 0) return i;
  const uint32_t element = static_cast<uint32_t>(i), run = static_cast<uint32_t>(r.run);
  const uint32_t run_index = element / run;
  return static_cast<int64_t>(run_index) * r.pitch + (element - run_index * run);
}

__device__ __forceinline__ float load_grad(const void* grad, ElemType type, int64_t i) {
  switch (type) {
    case ElemType::bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(grad)[i]);
    case ElemType::f16: return __half2float(static_cast<const __half*>(grad)[i]);
    default: return static_cast<const float*>(grad)[i];
  }
}

// Element i of an entry's gradient, as stored.
__device__ __forceinline__ float load_grad(const EntryOperands& op, int64_t i) {
  return load_grad(op.grad, op.grad_type, at(op.grad_runs, i));
}

// A gradient as the step uses it: divided by the gradient scaler's scale when there is one.
__device__ __forceinline__ float load_grad(const StepBuffers& b, const EntryOperands& op, int64_t i) {
  const float g = load_grad(op, i);
  return b.grad_scale ? g / *b.grad_scale : g;
}

__device__ __forceinline__ float load_ns(const void* data, bool bf16, int64_t i) {
  return bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(data)[i]) : static_cast<const float*>(data)[i];
}

__device__ __forceinline__ void store_ns(void* data, bool bf16, int64_t i, float x) {
  if (bf16) static_cast<__nv_bfloat16*>(data)[i] = __float2bfloat16_rn(x);  // P(U): round to nearest even
  else static_cast<float*>(data)[i] = x;
}

// The fp32 value, and the caller's bf16 / fp16 parameter rounded to nearest even (as torch's .to()).
__device__ __forceinline__ void store_param(const EntryOperands& op, int64_t i, float p) {
  op.master[at(op.master_runs, i)] = p;
  if (!op.low) return;
  const int64_t j = at(op.low_runs, i);
  if (op.low_type == ElemType::bf16) static_cast<__nv_bfloat16*>(op.low)[j] = __float2bfloat16_rn(p);
  else static_cast<__half*>(op.low)[j] = __float2half_rn(p);
}

__device__ __forceinline__ float load_param(const EntryOperands& op, int64_t i) { return op.master[at(op.master_runs, i)]; }

// Sum over the block in a fixed tree order; every thread gets the result.
__device__ double block_sum(double x, double* shared) {
  shared[threadIdx.x] = x;
  __syncthreads();
  for (unsigned half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) shared[threadIdx.x] += shared[threadIdx.x + half];
    __syncthreads();
  }
  const double total = shared[0];
  __syncthreads();
  return total;
}

__global__ void advance_steps_kernel(StepBuffers b) {
  StepStatus& status = *b.status;
  if (b.found_inf && *b.found_inf != 0.0f) {  // the scaler skips this step: nothing moves, nothing to report
    if (threadIdx.x == 0) status.first_bad = kScalerFoundInf;
    return;
  }
  if (status.first_bad != kNoBadGradient) {
    // Keep the first bad step until the host reads it: its parameter, element, value and step number.
    if (threadIdx.x == 0 && status.reported_bad == kNoBadGradient) {
      const int entry = static_cast<int>(status.first_bad >> kBadElementBits);
      const int64_t element = static_cast<int64_t>(status.first_bad & ((1ull << kBadElementBits) - 1));
      status.reported_bad = status.first_bad;
      status.reported_step = b.group_steps[b.entries[entry].group] + 1;
      status.reported_value = load_grad(b.operands[entry], element);
    }
    return;
  }
  for (int g = threadIdx.x; g < b.n_groups; g += blockDim.x) {
    bool any = false;
    for (int e = 0; e < b.n_entries && !any; ++e) any = b.entries[e].group == g && b.has_grad[e];
    if (any) ++b.group_steps[g];
  }
  // Each parameter's own count, and the AdamW bias corrections of it (spec section 5); a 0-element one
  // does not count (begin_step's rule).
  for (int e = threadIdx.x; e < b.n_entries; e += blockDim.x) {
    if (!b.has_grad[e] || b.entries[e].empty) continue;
    const double t = static_cast<double>(++b.entry_steps[e]);
    EntryScalars& s = b.entry_scalars[e];
    if (s.bias_from_host) {  // valid for this one step of the entry: later steps (replays) derive their own
      s.bias_from_host = 0;
      continue;
    }
    const GroupScalars& g = b.groups[b.entries[e].group];
    s.adam_bc2_sqrt = static_cast<float>(sqrt(1.0 - pow(g.adam_beta2_d, t)));
    s.adam_neg_step_size = static_cast<float>(-(g.adam_lr / (1.0 - pow(g.adam_beta1_d, t))));
  }
}

// Four consecutive 2-byte values in one 8-byte access.
struct alignas(8) Bf16x4 {
  __nv_bfloat16 x[4];
};
struct alignas(8) Halfx4 {
  __half x[4];
};

__device__ __forceinline__ bool aligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Four consecutive values of an fp32 buffer, in one 16-byte access.
__device__ __forceinline__ void load4(const float* p, float* x) {
  const float4 q = *reinterpret_cast<const float4*>(p);
  x[0] = q.x;
  x[1] = q.y;
  x[2] = q.z;
  x[3] = q.w;
}

__device__ __forceinline__ void store4(float* p, const float* x) {
  *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
}

// Elements i..i+3 of a bf16, fp16 or fp32 array as fp32, in one 8- or 16-byte access (load_grad's types).
__device__ __forceinline__ void load4(const void* data, ElemType type, int64_t i, float* x) {
  if (type == ElemType::bf16) {
    const Bf16x4 q = *reinterpret_cast<const Bf16x4*>(static_cast<const __nv_bfloat16*>(data) + i);
#pragma unroll
    for (int k = 0; k < 4; ++k) x[k] = __bfloat162float(q.x[k]);
  } else if (type == ElemType::f16) {
    const Halfx4 q = *reinterpret_cast<const Halfx4*>(static_cast<const __half*>(data) + i);
#pragma unroll
    for (int k = 0; k < 4; ++k) x[k] = __half2float(q.x[k]);
  } else {
    load4(static_cast<const float*>(data) + i, x);
  }
}

// Four fp32 values into elements i..i+3 of such an array, a bf16 / fp16 one rounded to nearest even (as
// torch's .to(), and P(U)), in one access.
__device__ __forceinline__ void store4(void* data, ElemType type, int64_t i, const float* x) {
  if (type == ElemType::bf16) {
    Bf16x4 q;
#pragma unroll
    for (int k = 0; k < 4; ++k) q.x[k] = __float2bfloat16_rn(x[k]);
    *reinterpret_cast<Bf16x4*>(static_cast<__nv_bfloat16*>(data) + i) = q;
  } else if (type == ElemType::f16) {
    Halfx4 q;
#pragma unroll
    for (int k = 0; k < 4; ++k) q.x[k] = __float2half_rn(x[k]);
    *reinterpret_cast<Halfx4*>(static_cast<__half*>(data) + i) = q;
  } else {
    store4(static_cast<float*>(data) + i, x);
  }
}

// Newton-Schulz's input and output hold bf16 or fp32.
__device__ __forceinline__ ElemType ns_type(bool bf16) { return bf16 ? ElemType::bf16 : ElemType::f32; }

// The fp32 values, and the caller's bf16 / fp16 parameter rounded (store_param's rule), four at a time.
__device__ __forceinline__ void store4_param(const EntryOperands& op, int64_t i, const float* p) {
  store4(op.master + i, p);
  if (op.low) store4(op.low, op.low_type, i, p);
}

// Element i of a 4-byte (fp32) or 2-byte (bf16, fp16) array starts a 16- or 8-byte vector.
__device__ __forceinline__ bool starts_vector(const void* data, int bytes, int64_t i) {
  return aligned(static_cast<const char*>(data) + i * bytes, 4 * static_cast<uintptr_t>(bytes));
}

__device__ __forceinline__ int elem_bytes(ElemType type) { return type == ElemType::f32 ? 4 : 2; }

// Four gradients as the step uses them: divided by the gradient scaler's scale, as load_grad does.
__device__ __forceinline__ void load4_grad(const StepBuffers& b, const EntryOperands& op, int64_t i, float* g) {
  load4(op.grad, op.grad_type, i, g);
  if (b.grad_scale) {
#pragma unroll
    for (int k = 0; k < 4; ++k) g[k] = g[k] / *b.grad_scale;
  }
}

// Whether a chunk's gradient, or its parameter (master and bf16 / fp16 copy), goes four elements per access:
// dense (no row runs: a block of a fused weight is not) and aligned to the vector, as the optimizer's buffers
// and torch's tensors are unless a tensor starts inside another one (an expert of a bank, a view).
__device__ __forceinline__ bool grad_in_vectors(const EntryOperands& op, const Chunk& c) {
  return op.grad_runs.run == 0 && starts_vector(op.grad, elem_bytes(op.grad_type), c.begin);
}

__device__ __forceinline__ bool param_in_vectors(const EntryOperands& op, const Chunk& c) {
  if (op.master_runs.run != 0 || !starts_vector(op.master, 4, c.begin)) return false;
  return !op.low || (op.low_runs.run == 0 && starts_vector(op.low, 2, c.begin));
}

// One element of the momentum pass (spec section 3.1, steps 1-2): the new momentum, and U, what Newton-Schulz
// reads (P(U) once stored).
__device__ __forceinline__ float momentum_element(float M, float g, const GroupScalars& s, float* u) {
  const float mk = lerp(M, g, s.w1);
  *u = s.nesterov ? lerp(g, mk, s.beta1) : mk;
  return mk;
}

// One element of AdamW (torch.optim.AdamW's single-tensor step, spec section 4): the new parameter, exp_avg
// and exp_avg_sq in place.
__device__ __forceinline__ float adamw_element(float p, float g, float* m, float* v, const GroupScalars& s,
                                               const EntryScalars& bias) {
  const float pk = s.adam_decay ? p * s.adam_decay_factor : p;                  // param.mul_(1 - lr*wd)
  *m = lerp(*m, g, s.adam_w1);                                                  // exp_avg.lerp_(g, 1 - beta1)
  *v = fmaf(s.adam_one_minus_beta2 * g, g, *v * s.adam_beta2);                  // mul_(b2).addcmul_(g, g, 1-b2)
  const float denom = sqrtf(*v) / bias.adam_bc2_sqrt + s.adam_eps;              // (sqrt(v) / bc2_sqrt).add_(eps)
  return pk + (bias.adam_neg_step_size * *m) / denom;                           // addcdiv_(m, denom, -step_size)
}

__global__ void scan_gradients_kernel(StepBuffers b, const Chunk* chunks) {
  if (b.found_inf) return;  // the gradient scaler has looked
  const Chunk c = chunks[blockIdx.x];
  if (!b.has_grad[c.entry]) return;
  const EntryOperands op = b.operands[c.entry];
  const unsigned long long entry = static_cast<unsigned long long>(c.entry) << kBadElementBits;
  unsigned long long first = kNoBadGradient;
  // Each thread walks its elements in increasing order and stops at its first bad one.
  if (grad_in_vectors(op, c)) {  // four per access, then the tail
    const int vectors = c.size / 4;
    for (int v = threadIdx.x; v < vectors && first == kNoBadGradient; v += blockDim.x) {
      float g[4];
      load4(op.grad, op.grad_type, c.begin + 4 * v, g);
      for (int k = 3; k >= 0; --k)  // the vector's first bad element wins
        if (!isfinite(g[k])) first = entry | static_cast<unsigned long long>(c.begin + 4 * v + k);
    }
    const int i = 4 * vectors + static_cast<int>(threadIdx.x);
    if (first == kNoBadGradient && i < c.size && !isfinite(load_grad(op, c.begin + i)))
      first = entry | static_cast<unsigned long long>(c.begin + i);
  } else {
    for (int i = threadIdx.x; i < c.size; i += blockDim.x)
      if (!isfinite(load_grad(op, c.begin + i))) {
        first = entry | static_cast<unsigned long long>(c.begin + i);
        break;  // later elements of this thread have larger indices
      }
  }
  for (int offset = 16; offset > 0; offset /= 2) first = min(first, __shfl_down_sync(0xffffffffu, first, offset));
  // A minimum is the same whatever order the warps arrive in: the atomic keeps the result deterministic.
  if ((threadIdx.x & 31) == 0 && first != kNoBadGradient) atomicMin(&b.status->first_bad, first);
}

__global__ void momentum_kernel(StepBuffers b, const Chunk* chunks) {
  if (step_skipped(b.status)) return;
  const Chunk c = chunks[blockIdx.x];
  if (!b.has_grad[c.entry]) return;
  const EntryInfo e = b.entries[c.entry];
  const EntryOperands op = b.operands[c.entry];
  const MatrixInfo m = b.matrices[e.matrix];
  const GroupScalars s = b.groups[e.group];
  const int64_t base = e.offset + c.begin;
  if (grad_in_vectors(op, c) && starts_vector(b.momentum, 4, base) &&
      starts_vector(m.ns_input, elem_bytes(ns_type(m.ns_bf16)), c.begin)) {  // four elements per access, then the tail
    const int vectors = c.size / 4;
    for (int v = threadIdx.x; v < vectors; v += kBlock) {
      float g[4], M[4], u[4];
      load4_grad(b, op, c.begin + 4 * v, g);
      load4(b.momentum + base + 4 * v, M);
#pragma unroll
      for (int k = 0; k < 4; ++k) M[k] = momentum_element(M[k], g[k], s, &u[k]);
      store4(b.momentum + base + 4 * v, M);
      store4(m.ns_input, ns_type(m.ns_bf16), c.begin + 4 * v, u);
    }
    const int i = 4 * vectors + static_cast<int>(threadIdx.x);
    if (i < c.size) {
      float u;
      b.momentum[base + i] = momentum_element(b.momentum[base + i], load_grad(b, op, c.begin + i), s, &u);
      store_ns(m.ns_input, m.ns_bf16, c.begin + i, u);
    }
    return;
  }
  for (int i0 = threadIdx.x; i0 < c.size; i0 += kBlock * kIlp) {
    float g[kIlp], M[kIlp];
#pragma unroll
    for (int k = 0; k < kIlp; ++k) {
      const int i = i0 + k * kBlock;
      if (i < c.size) {
        g[k] = load_grad(b, op, c.begin + i);
        M[k] = b.momentum[base + i];
      }
    }
#pragma unroll
    for (int k = 0; k < kIlp; ++k) {
      const int i = i0 + k * kBlock;
      if (i < c.size) {
        float u;
        b.momentum[base + i] = momentum_element(M[k], g[k], s, &u);
        store_ns(m.ns_input, m.ns_bf16, c.begin + i, u);
      }
    }
  }
}

__global__ void statistics_kernel(StepBuffers b, const StatTask* tasks) {
  if (step_skipped(b.status)) return;
  const StatTask task = tasks[blockIdx.x];
  const MatrixInfo m = b.matrices[task.matrix];
  if (!b.has_grad[m.entry]) return;
  const bool bf16 = m.ns_bf16;
  if (m.stats_per_row) {  // one warp per row, lanes stride the columns
    const int row = task.first + static_cast<int>(threadIdx.x / 32);
    if (row >= m.rows) return;
    double sum = 0;
    for (int j = threadIdx.x % 32; j < m.cols; j += 32) {
      const double o = load_ns(m.ns_output, bf16, static_cast<int64_t>(row) * m.cols + j);
      sum += o * o;
    }
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffffu, sum, offset);
    if (threadIdx.x % 32 == 0) b.stat_sums[m.stat_offset + row] = sum;
  } else {  // one thread per column, walking down the rows (coalesced across the warp)
    const int col = task.first + static_cast<int>(threadIdx.x);
    if (col >= m.cols) return;
    double sum = 0;
    for (int i = 0; i < m.rows; ++i) {
      const double o = load_ns(m.ns_output, bf16, static_cast<int64_t>(i) * m.cols + col);
      sum += o * o;
    }
    b.stat_sums[m.stat_offset + col] = sum;
  }
}

__global__ void finalize_kernel(StepBuffers b, int first_matrix) {
  __shared__ double shared[kBlock];
  if (step_skipped(b.status)) return;
  const int matrix = first_matrix + static_cast<int>(blockIdx.x);
  const MatrixInfo m = b.matrices[matrix];
  if (!b.has_grad[m.entry]) return;
  const GroupScalars s = b.groups[m.group];
  const double other_len = m.stats_per_row ? m.cols : m.rows;  // the axis each statistic averages over
  double total = 0, normalised = 0;
  for (int64_t k = threadIdx.x; k < m.stat_len; k += blockDim.x) {
    const int64_t at = m.stat_offset + k;
    const double sum = b.stat_sums[at];
    const float v = lerp(b.row_var[at], static_cast<float>(sum / other_len), s.w2);
    b.row_var[at] = v;
    // clamp_min keeps a NaN (fmaxf would not): written as a compare, like std::max in the CPU kernel.
    const float inv = s.eps_add ? 1.0f / (sqrtf(v) + s.denom_eps) : 1.0f / sqrtf(v < s.denom_eps ? s.denom_eps : v);
    b.inv_scale[at] = inv;
    total += sum;
    // ||O * s||^2 = sum_k s_k^2 * (sum of squares along k): no second pass over O.
    normalised += static_cast<double>(inv) * static_cast<double>(inv) * sum;
  }
  total = block_sum(total, shared);
  normalised = block_sum(normalised, shared);
  if (threadIdx.x == 0) {
    const float nu = static_cast<float>(sqrt(total));
    b.matrix_scalars[matrix].ratio = nu / (static_cast<float>(sqrt(normalised)) + s.renorm_eps);
  }
}

// One element's update (spec section 3.1, steps 7-11): normalised, re-normed and scaled, the weight decay, the
// step. Both paths of normuon_update_kernel use it, so they round alike.
__device__ __forceinline__ float updated_param(float o, float scale, float p, const GroupScalars& s,
                                               const MatrixScalars& ms) {
  const float u = ((o * scale) * ms.ratio) * ms.kappa;
  if (s.decay) {
    if (s.wd_mode == 0) p = p * s.decay_factor;
    else if (s.wd_mode == 1) p = p - (p * (u * p >= 0.0f ? 1.0f : 0.0f)) * s.lr_wd;
  }
  return fmaf(s.neg_lr, u, p);
}

// Whether a chunk's update goes four elements per access: its parameter (param_in_vectors) and its
// Newton-Schulz output.
__device__ __forceinline__ bool vector_ready(const EntryOperands& op, const MatrixInfo& m, const Chunk& c) {
  return param_in_vectors(op, c) && starts_vector(m.ns_output, elem_bytes(ns_type(m.ns_bf16)), c.begin);
}

// The update of a chunk four elements per access (vector_ready). A thread's vectors lie kBlock apart, so
// the row and column of its first element take one division and later ones follow by addition: no
// division per element. The last size % 4 elements go one per thread.
__device__ void update_in_vectors(const Chunk& c, const EntryOperands& op, const MatrixInfo& m, const GroupScalars& s,
                                  const MatrixScalars& ms, const float* __restrict__ inv_scale) {
  const int vectors = c.size / 4;
  const uint32_t cols = static_cast<uint32_t>(m.cols);  // a matrix has < 2^31 elements (plan_unsupported_reason)
  const uint32_t stride = 4 * kBlock, stride_rows = stride / cols, stride_cols = stride - stride_rows * cols;
  const uint32_t first = static_cast<uint32_t>(c.begin) + 4 * threadIdx.x;
  uint32_t row = first / cols, col = first - row * cols;
  for (int v = threadIdx.x; v < vectors; v += kBlock) {
    const int64_t i = c.begin + 4 * static_cast<int64_t>(v);
    float o[4], p[4];
    load4(m.ns_output, ns_type(m.ns_bf16), i, o);
    load4(op.master + i, p);
    uint32_t r = row, j = col;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      p[k] = updated_param(o[k], inv_scale[m.stats_per_row ? r : j], p[k], s, ms);
      if (++j == cols) {  // the next row
        j = 0;
        ++r;
      }
    }
    store4_param(op, i, p);
    col += stride_cols;
    row += stride_rows;
    if (col >= cols) {
      col -= cols;
      ++row;
    }
  }
  const int tail = 4 * vectors + static_cast<int>(threadIdx.x);
  if (tail < c.size) {
    const uint32_t idx = static_cast<uint32_t>(c.begin + tail), r = idx / cols;
    const float scale = inv_scale[m.stats_per_row ? r : idx - r * cols];
    store_param(op, idx, updated_param(load_ns(m.ns_output, m.ns_bf16, idx), scale, load_param(op, idx), s, ms));
  }
}

__global__ void normuon_update_kernel(StepBuffers b, const Chunk* chunks) {
  if (step_skipped(b.status)) return;
  const Chunk c = chunks[blockIdx.x];
  if (!b.has_grad[c.entry]) return;
  const EntryInfo e = b.entries[c.entry];
  const EntryOperands op = b.operands[c.entry];
  const MatrixInfo m = b.matrices[e.matrix];
  const GroupScalars s = b.groups[e.group];
  const MatrixScalars ms = b.matrix_scalars[e.matrix];
  const float* __restrict__ inv_scale = b.inv_scale + m.stat_offset;
  if (vector_ready(op, m, c)) {
    update_in_vectors(c, op, m, s, ms, inv_scale);
    return;
  }
  const uint32_t cols = static_cast<uint32_t>(m.cols);
  for (int i0 = threadIdx.x; i0 < c.size; i0 += kBlock * kIlp) {
    float o[kIlp], p[kIlp], scale[kIlp];
#pragma unroll
    for (int k = 0; k < kIlp; ++k) {
      const int i = i0 + k * kBlock;
      if (i < c.size) {
        const uint32_t idx = static_cast<uint32_t>(c.begin + i);  // a matrix has < 2^32 elements
        const uint32_t row = idx / cols;
        o[k] = load_ns(m.ns_output, m.ns_bf16, idx);
        p[k] = load_param(op, idx);
        scale[k] = inv_scale[m.stats_per_row ? row : idx - row * cols];
      }
    }
#pragma unroll
    for (int k = 0; k < kIlp; ++k) {
      const int i = i0 + k * kBlock;
      if (i < c.size) store_param(op, c.begin + i, updated_param(o[k], scale[k], p[k], s, ms));
    }
  }
}

__global__ void adamw_kernel(StepBuffers b, const Chunk* chunks) {
  if (step_skipped(b.status)) return;
  const Chunk c = chunks[blockIdx.x];
  if (!b.has_grad[c.entry]) return;
  const EntryInfo e = b.entries[c.entry];
  const EntryOperands op = b.operands[c.entry];
  const GroupScalars s = b.groups[e.group];
  const EntryScalars bias = b.entry_scalars[c.entry];  // the entry's own count's bias corrections
  const int64_t adam_base = e.adam_offset + c.begin;
  if (grad_in_vectors(op, c) && param_in_vectors(op, c) && starts_vector(b.exp_avg, 4, adam_base) &&
      starts_vector(b.exp_avg_sq, 4, adam_base)) {  // four elements per access, then the tail
    const int vectors = c.size / 4;
    for (int q = threadIdx.x; q < vectors; q += kBlock) {
      const int64_t i = c.begin + 4 * q;
      float g[4], p[4], m[4], v[4];
      load4_grad(b, op, i, g);
      load4(op.master + i, p);
      load4(b.exp_avg + adam_base + 4 * q, m);
      load4(b.exp_avg_sq + adam_base + 4 * q, v);
#pragma unroll
      for (int k = 0; k < 4; ++k) p[k] = adamw_element(p[k], g[k], &m[k], &v[k], s, bias);
      store4_param(op, i, p);
      store4(b.exp_avg + adam_base + 4 * q, m);
      store4(b.exp_avg_sq + adam_base + 4 * q, v);
    }
    const int i = 4 * vectors + static_cast<int>(threadIdx.x);
    if (i < c.size) {
      float m = b.exp_avg[adam_base + i], v = b.exp_avg_sq[adam_base + i];
      store_param(op, c.begin + i, adamw_element(load_param(op, c.begin + i), load_grad(b, op, c.begin + i), &m, &v,
                                                 s, bias));
      b.exp_avg[adam_base + i] = m;
      b.exp_avg_sq[adam_base + i] = v;
    }
    return;
  }
  for (int i0 = threadIdx.x; i0 < c.size; i0 += kBlock * kIlp) {
    float g[kIlp], p[kIlp], m[kIlp], v[kIlp];
#pragma unroll
    for (int k = 0; k < kIlp; ++k) {
      const int i = i0 + k * kBlock;
      if (i < c.size) {
        g[k] = load_grad(b, op, c.begin + i);
        p[k] = load_param(op, c.begin + i);
        m[k] = b.exp_avg[adam_base + i];
        v[k] = b.exp_avg_sq[adam_base + i];
      }
    }
#pragma unroll
    for (int k = 0; k < kIlp; ++k) {
      const int i = i0 + k * kBlock;
      if (i < c.size) {
        store_param(op, c.begin + i, adamw_element(p[k], g[k], &m[k], &v[k], s, bias));
        b.exp_avg[adam_base + i] = m[k];
        b.exp_avg_sq[adam_base + i] = v[k];
      }
    }
  }
}

// ---- a master read again after an outside write ---------------------------------------------------

// Engine::refresh_master's rule on the device, for a bf16 / fp16 parameter (op.low) and its master: the
// master is read again from the parameter unless the parameter still holds the master rounded (a model
// reloaded after the optimizer: the master keeps its low bits). *all_rounded starts at 1; the first
// kernel clears it where some element differs, the second then widens every element.
__global__ void master_rounded_kernel(EntryOperands op, int64_t n, unsigned long long* all_rounded) {
  bool rounded = true;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n && rounded;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float m = op.master[at(op.master_runs, i)];
    const int64_t j = at(op.low_runs, i);
    // Bit for bit, as the host's rule: a parameter of -0 does not hold a master of +0.
    if (op.low_type == ElemType::bf16)
      rounded = __bfloat16_as_ushort(__float2bfloat16_rn(m)) ==
                __bfloat16_as_ushort(static_cast<const __nv_bfloat16*>(op.low)[j]);
    else
      rounded = __half_as_ushort(__float2half_rn(m)) == __half_as_ushort(static_cast<const __half*>(op.low)[j]);
  }
  if (!rounded) atomicMin(all_rounded, 0ull);
}

__global__ void master_refresh_kernel(EntryOperands op, int64_t n, const unsigned long long* all_rounded) {
  if (*all_rounded) return;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    op.master[at(op.master_runs, i)] = load_grad(op.low, op.low_type, at(op.low_runs, i));  // widened
}

template <typename Launch>
void refresh_master(const Launch& launch, const EntryOperands& op, int64_t n, unsigned long long* all_rounded) {
  if (n == 0 || !op.low) return;
  const int blocks = static_cast<int>((n + kBlock - 1) / kBlock < 1024 ? (n + kBlock - 1) / kBlock : 1024);
  launch(master_rounded_kernel, blocks, kBlock, op, n, all_rounded);
  launch(master_refresh_kernel, blocks, kBlock, op, n, static_cast<const unsigned long long*>(all_rounded));
}

// ---- one step ---------------------------------------------------------------------------------------

// One fused step, in docs/fast-cuda.md's five phases (the status word's first_bad must be reset before).
// `launch(kernel, blocks, threads, args...)` launches one kernel: <<<>>> on the GPU, the SIMT emulator in
// the tests. One block of kBlock threads per work item (chunk, task or matrix); an empty pass launches
// nothing. The NorMuon phases run a Newton-Schulz batch at a time, because the batches share one input
// buffer (NsWorkspaceSizes): the batch's momentum pass writes it, `newton_schulz(i)` runs batch i in
// place, its statistics, finalize and update passes read it. `phase(i)` is called as phase i (0..4)
// begins, once per batch for the NorMuon phases, and what it returns lives until that part ends (the
// backend's NVTX range and timer).
template <typename Launch, typename NewtonSchulz, typename Phase>
void run_step(const Launch& launch, const StepBuffers& b, const StepTables& t, const NewtonSchulz& newton_schulz,
              const Phase& phase) {
  auto each = [&](auto kernel, int items, auto... args) {
    if (items > 0) launch(kernel, items, kBlock, b, args...);
  };
  {
    [[maybe_unused]] const auto momentum_phase = phase(0);
    each(scan_gradients_kernel, t.n_scan_chunks, t.scan_chunks);
    launch(advance_steps_kernel, 1, kBlock, b);  // one block; its threads stride the groups and the entries
  }
  for (int i = 0; i < t.n_batches; ++i) {
    const BatchRange& r = t.batches[i];
    {
      [[maybe_unused]] const auto momentum_phase = phase(0);
      each(momentum_kernel, r.n_chunks, t.normuon_chunks + r.first_chunk);
    }
    {
      [[maybe_unused]] const auto newton_schulz_phase = phase(1);
      newton_schulz(i);
    }
    {
      [[maybe_unused]] const auto normalisation_phase = phase(2);
      each(statistics_kernel, r.n_tasks, t.stat_tasks + r.first_task);
      each(finalize_kernel, r.n_matrices, r.first_matrix);
    }
    {
      [[maybe_unused]] const auto update_phase = phase(3);
      each(normuon_update_kernel, r.n_chunks, t.normuon_chunks + r.first_chunk);
    }
  }
  {
    [[maybe_unused]] const auto adamw_phase = phase(4);
    each(adamw_kernel, t.n_adamw_chunks, t.adamw_chunks);
  }
}

}  // namespace
}  // namespace normuon::cuda::step_device
