// Batched Newton-Schulz on the GPU (docs/spec.md section 3.2): two deterministic kernels normalise the
// batch, then each iteration is three cuBLASLt strided-batched GEMMs whose alpha/beta epilogues carry the
// polynomial's coefficients.
//
// GEMM layouts (transposes, layouts, operand buffers): ns_gemm_plan.h.
// Batch strides: stride(b) elements for X buffers, gram_stride for the s x s buffers, both multiples of
// 128 elements so every matrix starts 256-byte aligned (cuBLASLt's default alignment assumption).
//
// The `c*A@A + b*A` and `B@X + a*X` forms each round once in the epilogue (the reference rounds c*A, the
// product and the sum separately); the difference is within the bf16/fp32 NS tolerance.
//
// Determinism: the norm kernels reduce in a fixed order with no atomics; cuBLASLt gives the same bits for
// a fixed algorithm, workspace and GPU (cuBLAS's reproducibility guarantee; the split-K scheme allowed
// here, COMPUTE_TYPE, reduces the fp32 partials in a separate pass in a fixed order).
#include "newton_schulz_cuda.h"

#include <cublasLt.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <utility>

#include "cuda_check.h"
#include "device_buffer.h"
#include "normuon/ns_coefficients.h"
#include "ns_gemm_plan.h"

namespace normuon::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;                       // elements per vector access (16 B of bf16, 32 B of fp32)
constexpr int64_t kElementsPerBlock = 16384;  // target slice size of the norm kernels
constexpr int64_t kMaxSlices = 1024;          // partial sums per matrix; re-summed by every block of it
constexpr int64_t kStrideAlign = 128;         // elements: 256 B in bf16
constexpr size_t kWorkspaceBytes = size_t{32} << 20;

__host__ __device__ inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
__host__ __device__ inline int64_t ceil_div(int64_t x, int64_t m) { return (x + m - 1) / m; }

// ---- device helpers --------------------------------------------------------------------------------

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }

// P: round to the working precision (RNE), identity in fp32.
__device__ __forceinline__ float round_p(float x, const __nv_bfloat16*) {
  return __bfloat162float(__float2bfloat16_rn(x));
}
__device__ __forceinline__ float round_p(float x, const float*) { return x; }

__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&v)[kVec]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < kVec / 2; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void load8(const float* p, float (&v)[kVec]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void store8(__nv_bfloat16* p, const float (&v)[kVec]) {
  uint4 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < kVec / 2; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}
__device__ __forceinline__ void store8(float* p, const float (&v)[kVec]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
__device__ __forceinline__ void store1(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ void store1(float* p, float x) { *p = x; }

__device__ __forceinline__ double warp_sum(double x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Block sum in a fixed order (the same tree every launch); the result is valid in thread 0.
__device__ double block_sum(double x) {
  __shared__ double warps[kThreads / 32];
  x = warp_sum(x);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warps[warp] = x;
  __syncthreads();
  double total = 0;
  if (warp == 0) total = warp_sum(lane < kThreads / 32 ? warps[lane] : 0.0);
  return total;
}

// Kernel 1: block (matrix, slice) writes the sum of squares of its slice, in double, to partials.
// A slice is a run of whole 8-element groups; the matrix's last group may be partial.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    ns_norm_partials(const T* __restrict__ x, int64_t stride, int64_t n, int slices, int64_t groups_per_slice,
                     double* __restrict__ partials) {
  const int64_t matrix = blockIdx.x / slices;
  const int64_t slice = blockIdx.x % slices;
  const T* xm = x + matrix * stride;
  const int64_t groups = ceil_div(n, kVec);
  const int64_t g_begin = slice * groups_per_slice;
  const int64_t g_end = min(g_begin + groups_per_slice, groups);
  double acc = 0;
  for (int64_t g = g_begin + threadIdx.x; g < g_end; g += kThreads) {
    const int64_t e = g * kVec;
    if (e + kVec <= n) {
      float v[kVec];
      load8(xm + e, v);
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc = fma(static_cast<double>(v[i]), static_cast<double>(v[i]), acc);
    } else {
      for (int64_t i = e; i < n; ++i) {
        const double f = to_float(xm[i]);
        acc = fma(f, f, acc);
      }
    }
  }
  const double total = block_sum(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// Kernel 2: every block of a matrix re-sums that matrix's partials in the same fixed order (so all agree),
// forms denom = P(norm + eps) or P(P(1.02 norm) + eps), and writes X = P(X / denom) over its slice.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    ns_normalise(T* __restrict__ x, int64_t stride, int64_t n, int slices, int64_t groups_per_slice,
                 const double* __restrict__ partials, float eps, float safety, int polar) {
  __shared__ float denom_shared;
  const int64_t matrix = blockIdx.x / slices;
  const int64_t slice = blockIdx.x % slices;
  if (threadIdx.x < 32) {
    const double* pm = partials + matrix * slices;
    double sq = 0;
    for (int i = threadIdx.x; i < slices; i += 32) sq += pm[i];
    sq = warp_sum(sq);
    if (threadIdx.x == 0) {
      const T* tag = nullptr;
      const float norm = round_p(static_cast<float>(sqrt(sq)), tag);
      // Explicit _rn ops: two roundings as written, never contracted into an fma (fp32 mode has no P).
      const float denom = polar ? round_p(__fadd_rn(round_p(__fmul_rn(norm, safety), tag), eps), tag)
                                : round_p(__fadd_rn(norm, eps), tag);
      denom_shared = denom;
    }
  }
  __syncthreads();
  const float denom = denom_shared;
  T* xm = x + matrix * stride;
  const int64_t groups = ceil_div(n, kVec);
  const int64_t g_begin = slice * groups_per_slice;
  const int64_t g_end = min(g_begin + groups_per_slice, groups);
  for (int64_t g = g_begin + threadIdx.x; g < g_end; g += kThreads) {
    const int64_t e = g * kVec;
    if (e + kVec <= n) {
      float v[kVec];
      load8(xm + e, v);
#pragma unroll
      for (int i = 0; i < kVec; ++i) v[i] = __fdiv_rn(v[i], denom);  // a true division, as the reference
      store8(xm + e, v);  // stores round to bf16 (RNE) in bf16 mode: X = P(X / denom)
    } else {
      for (int64_t i = e; i < n; ++i) store1(xm + i, __fdiv_rn(to_float(xm[i]), denom));
    }
  }
}

// ---- cuBLASLt RAII ---------------------------------------------------------------------------------

struct LtHandle {
  cublasLtHandle_t h = nullptr;
  LtHandle() { NORMUON_CUBLAS_CHECK(cublasLtCreate(&h)); }
  ~LtHandle() {
    if (h) cublasLtDestroy(h);
  }
  LtHandle(const LtHandle&) = delete;
  LtHandle& operator=(const LtHandle&) = delete;
};

struct LtPreference {
  cublasLtMatmulPreference_t p = nullptr;
  LtPreference() { NORMUON_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&p)); }
  ~LtPreference() {
    if (p) cublasLtMatmulPreferenceDestroy(p);
  }
  LtPreference(const LtPreference&) = delete;
  LtPreference& operator=(const LtPreference&) = delete;
};

// One batched GEMM, planned once: descriptor, layouts (D shares C's layout) and the chosen algorithm.
struct LtGemm {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  std::string info;

  LtGemm() = default;
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;
  ~LtGemm() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

void make_layout(cudaDataType type, const NsMatrixSpec& m, int64_t batch_stride, int32_t count,
                 cublasLtMatrixLayout_t* out) {
  NORMUON_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(out, type, static_cast<uint64_t>(m.rows),
                                                  static_cast<uint64_t>(m.cols), m.ld));
  NORMUON_CUBLAS_CHECK(
      cublasLtMatrixLayoutSetAttribute(*out, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
  const int64_t offset = batch_stride;
  NORMUON_CUBLAS_CHECK(
      cublasLtMatrixLayoutSetAttribute(*out, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &offset, sizeof(offset)));
}

// D shares C's layout (and so its batch stride).
void plan_gemm(LtGemm& g, cublasLtHandle_t handle, bool bf16, const NsGemmSpec& spec, int64_t x_stride,
               int64_t gram_stride, int32_t count, const char* what) {
  const cudaDataType type = bf16 ? CUDA_R_16BF : CUDA_R_32F;
  // fp32 accumulation in both modes; CUBLAS_COMPUTE_32F never uses TF32.
  NORMUON_CUBLAS_CHECK(cublasLtMatmulDescCreate(&g.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const int32_t ta = spec.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, tb = spec.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  NORMUON_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  NORMUON_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  const int32_t pointer_mode = CUBLASLT_POINTER_MODE_HOST;  // alpha/beta are host floats read at enqueue
  NORMUON_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_POINTER_MODE, &pointer_mode, sizeof(pointer_mode)));
  make_layout(type, spec.a, ns_batch_stride(spec.a.operand, x_stride, gram_stride), count, &g.a);
  make_layout(type, spec.b, ns_batch_stride(spec.b.operand, x_stride, gram_stride), count, &g.b);
  make_layout(type, spec.c, ns_batch_stride(spec.c.operand, x_stride, gram_stride), count, &g.c);

  LtPreference pref;
  const uint64_t workspace = kWorkspaceBytes;
  NORMUON_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                            &workspace, sizeof(workspace)));
  // Split-K only when the partial sums are reduced in fp32 (COMPUTE_TYPE): INPLACE and OUTPUT_TYPE add
  // the partials in the output type, which in bf16 mode would round the accumulation more than once.
  const uint32_t reductions = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  NORMUON_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                            &reductions, sizeof(reductions)));
  cublasLtMatmulHeuristicResult_t result{};
  int returned = 0;
  NORMUON_CUBLAS_CHECK(
      cublasLtMatmulAlgoGetHeuristic(handle, g.desc, g.a, g.b, g.c, g.c, pref.p, 1, &result, &returned));
  if (returned < 1 || result.state != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("cuBLASLt found no algorithm for the Newton-Schulz ") + what + " GEMM");
  g.algo = result.algo;

  int32_t id = -1, splitk = 1;
  uint32_t tile = 0, reduction = 0;
  size_t written = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&g.algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), &written);
  cublasLtMatmulAlgoConfigGetAttribute(&g.algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &written);
  cublasLtMatmulAlgoConfigGetAttribute(&g.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk), &written);
  cublasLtMatmulAlgoConfigGetAttribute(&g.algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &reduction, sizeof(reduction),
                                       &written);
  char buf[160];
  std::snprintf(buf, sizeof buf, "%s[algo=%d tile=%u splitk=%d red=%u ws=%zu waves=%.2f]", what, id, tile, splitk,
                reduction, result.workspaceSize, static_cast<double>(result.wavesCount));
  g.info = buf;
}

struct Batch {
  NsBatchShape shape;
  bool empty = true;
  bool tall = false;
  int64_t s = 0, l = 0, n = 0;
  int64_t stride = 0, gram_stride = 0;  // elements
  int slices = 0;
  int64_t groups_per_slice = 0;
  DeviceBuffer<unsigned char> x[2];  // ping-pong; x[0] is the input
  int output = 0;                    // index of the buffer that holds O after run()
  NsGemmPlan plan{};
  LtGemm gram, square, apply;
};

const char* precision_name(NsPrecision p) { return p == NsPrecision::bf16 ? "bf16" : "fp32"; }
const char* coefficients_name(NsCoefficients c) {
  return c == NsCoefficients::quintic ? "quintic" : "polar_express";
}

}  // namespace

struct BatchedNewtonSchulz::Impl {
  cudaStream_t stream = nullptr;
  std::unique_ptr<LtHandle> handle;  // declared first: destroyed after the plans that were made with it
  DeviceBuffer<unsigned char> workspace, gram, bmat;  // shared by all batches: runs are stream-ordered
  DeviceBuffer<double> partials;
  std::vector<std::unique_ptr<Batch>> batches;

  template <typename T>
  void normalise(Batch& b) {
    T* x = reinterpret_cast<T*>(b.x[0].data());
    const unsigned blocks = static_cast<unsigned>(b.shape.count * b.slices);
    ns_norm_partials<T><<<blocks, kThreads, 0, stream>>>(x, b.stride, b.n, b.slices, b.groups_per_slice,
                                                         partials.data());
    NORMUON_CUDA_CHECK_LAUNCH();
    const bool polar = b.shape.coefficients == NsCoefficients::polar_express;
    ns_normalise<T><<<blocks, kThreads, 0, stream>>>(x, b.stride, b.n, b.slices, b.groups_per_slice, partials.data(),
                                                     static_cast<float>(b.shape.eps),
                                                     static_cast<float>(kPolarExpressSafety), polar ? 1 : 0);
    NORMUON_CUDA_CHECK_LAUNCH();
  }

  // D = alpha op(A) op(B) + beta C, the operands' buffers as the spec names them.
  void matmul(const LtGemm& g, const NsGemmSpec& spec, const NsBuffers<void*>& buf, float alpha, float beta) {
    const NsGemmPointers<void*> p = ns_gemm_pointers(spec, buf);
    NORMUON_CUBLAS_CHECK(cublasLtMatmul(handle->h, g.desc, &alpha, p.a, g.a, p.b, g.b, &beta, p.c, g.c, p.d, g.c,
                                        &g.algo, workspace.data(), workspace.bytes(), stream));
  }
};

BatchedNewtonSchulz::BatchedNewtonSchulz(const std::vector<NsBatchShape>& batches, cudaStream_t stream)
    : impl_(std::make_unique<Impl>()) {
  Impl& im = *impl_;
  im.stream = stream;
  // Validate everything before touching the device.
  for (const NsBatchShape& sh : batches) {
    if (sh.rows < 0 || sh.cols < 0 || sh.count < 0 || sh.steps < 0)
      throw std::invalid_argument("Newton-Schulz batch with a negative size or step count");
    if (sh.coefficients == NsCoefficients::polar_express && sh.steps > kPolarExpressSteps)
      throw std::invalid_argument("ns_steps=" + std::to_string(sh.steps) +
                                  " but the Polar Express schedule has 5 coefficient triples");
  }

  int64_t max_gram = 0, max_partials = 0;
  bool any = false;
  for (const NsBatchShape& sh : batches) {
    auto b = std::make_unique<Batch>();
    b->shape = sh;
    b->empty = sh.count == 0 || sh.rows == 0 || sh.cols == 0;
    if (!b->empty) {
      b->plan = ns_gemm_plan(sh.rows, sh.cols);
      b->tall = b->plan.tall;
      b->s = b->plan.s;
      b->l = b->plan.l;
      b->n = sh.rows * sh.cols;
      b->stride = round_up(b->n, kStrideAlign);
      b->gram_stride = round_up(b->s * b->s, kStrideAlign);
      const int64_t groups = ceil_div(b->n, kVec);
      const int64_t slices = std::clamp<int64_t>(ceil_div(b->n, kElementsPerBlock), 1, kMaxSlices);
      b->groups_per_slice = ceil_div(groups, slices);
      b->slices = static_cast<int>(ceil_div(groups, b->groups_per_slice));  // no empty slice
      if (sh.count > INT32_MAX || sh.count * b->slices > INT32_MAX || b->l > INT32_MAX)
        throw std::invalid_argument("Newton-Schulz batch too large: " + std::to_string(sh.count) + " x " +
                                    std::to_string(sh.rows) + "x" + std::to_string(sh.cols));
      b->output = sh.steps % 2;
      max_gram = std::max(max_gram, sh.count * b->gram_stride);
      max_partials = std::max(max_partials, sh.count * b->slices);
      any = true;
    }
    im.batches.push_back(std::move(b));
  }
  if (!any) return;  // nothing to run: no device resources

  im.handle = std::make_unique<LtHandle>();
  im.workspace = DeviceBuffer<unsigned char>(static_cast<int64_t>(kWorkspaceBytes));
  im.gram = DeviceBuffer<unsigned char>(max_gram * static_cast<int64_t>(sizeof(float)));
  im.bmat = DeviceBuffer<unsigned char>(max_gram * static_cast<int64_t>(sizeof(float)));
  im.partials = DeviceBuffer<double>(max_partials);

  for (auto& bp : im.batches) {
    Batch& b = *bp;
    if (b.empty) continue;
    const bool bf16 = b.shape.precision == NsPrecision::bf16;
    const int64_t elem = bf16 ? 2 : 4;
    b.x[0] = DeviceBuffer<unsigned char>(b.shape.count * b.stride * elem);
    b.x[1] = DeviceBuffer<unsigned char>(b.shape.count * b.stride * elem);
    const int32_t count = static_cast<int32_t>(b.shape.count);
    cublasLtHandle_t h = im.handle->h;
    plan_gemm(b.gram, h, bf16, b.plan.gram, b.stride, b.gram_stride, count, "gram");
    plan_gemm(b.apply, h, bf16, b.plan.apply, b.stride, b.gram_stride, count, "apply");
    plan_gemm(b.square, h, bf16, b.plan.square, b.stride, b.gram_stride, count, "square");
  }
}

BatchedNewtonSchulz::~BatchedNewtonSchulz() = default;

int BatchedNewtonSchulz::size() const { return static_cast<int>(impl_->batches.size()); }

const NsBatchShape& BatchedNewtonSchulz::shape(int b) const { return impl_->batches.at(static_cast<size_t>(b))->shape; }

void* BatchedNewtonSchulz::input(int b) { return impl_->batches.at(static_cast<size_t>(b))->x[0].data(); }

const void* BatchedNewtonSchulz::output(int b) const {
  const Batch& batch = *impl_->batches.at(static_cast<size_t>(b));
  return batch.x[batch.output].data();
}

int64_t BatchedNewtonSchulz::stride(int b) const { return impl_->batches.at(static_cast<size_t>(b))->stride; }

void BatchedNewtonSchulz::run(int b) {
  Impl& im = *impl_;
  Batch& batch = *im.batches.at(static_cast<size_t>(b));
  if (batch.empty) return;
  const bool bf16 = batch.shape.precision == NsPrecision::bf16;
  if (bf16)
    im.normalise<__nv_bfloat16>(batch);
  else
    im.normalise<float>(batch);

  void* A = im.gram.data();
  void* B = im.bmat.data();
  for (int k = 0; k < batch.shape.steps; ++k) {
    const NsTriple& t = ns_triple(batch.shape.coefficients, k);
    const float ca = static_cast<float>(t.a), cb = static_cast<float>(t.b), cc = static_cast<float>(t.c);
    const NsBuffers<void*> buf{batch.x[k % 2].data(), batch.x[(k + 1) % 2].data(), A, B};
    im.matmul(batch.gram, batch.plan.gram, buf, 1.0f, 0.0f);  // A = X X^T (beta = 0: C is not read)
    im.matmul(batch.square, batch.plan.square, buf, cc, cb);  // B = c A A + b A
    im.matmul(batch.apply, batch.plan.apply, buf, 1.0f, ca);  // X' = B X + a X
  }
}

int BatchedNewtonSchulz::launches(int b) const {
  const Batch& batch = *impl_->batches.at(static_cast<size_t>(b));
  return batch.empty ? 0 : 2 + 3 * batch.shape.steps;
}

double BatchedNewtonSchulz::flops(int b) const {
  const Batch& batch = *impl_->batches.at(static_cast<size_t>(b));
  if (batch.empty) return 0;
  const double s = static_cast<double>(batch.s), l = static_cast<double>(batch.l);
  return 2.0 * (s * s * l + s * s * s + s * s * l) * batch.shape.steps * static_cast<double>(batch.shape.count);
}

std::string BatchedNewtonSchulz::describe() const {
  std::string out;
  for (size_t i = 0; i < impl_->batches.size(); ++i) {
    const Batch& b = *impl_->batches[i];
    const NsBatchShape& sh = b.shape;
    char head[192];
    std::snprintf(head, sizeof head, "ns batch %zu: %lldx%lld x%lld %s %s steps=%d eps=%g", i,
                  static_cast<long long>(sh.rows), static_cast<long long>(sh.cols), static_cast<long long>(sh.count),
                  precision_name(sh.precision), coefficients_name(sh.coefficients), sh.steps, sh.eps);
    out += head;
    if (b.empty) {
      out += " (empty)";
    } else {
      out += b.tall ? " tall" : " wide";
      out += " slices=" + std::to_string(b.slices) + " " + b.gram.info + " " + b.square.info + " " + b.apply.info;
    }
    out += '\n';
  }
  return out;
}

void BatchedNewtonSchulz::set_stream(cudaStream_t stream) { impl_->stream = stream; }

}  // namespace normuon::cuda
