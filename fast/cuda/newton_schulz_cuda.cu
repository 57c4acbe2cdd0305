// Batched Newton-Schulz on the GPU (docs/spec.md section 3.2): two deterministic kernels normalise the
// batch, then each iteration is three cuBLASLt strided-batched products and three elementwise kernels,
// which round as the spec does (ns_gemm_plan.h has the iteration). The two symmetric products, X X^T and
// C A, are computed as their lower triangle, one strided-batched GEMM per column panel, and mirrored by
// the symmetric kernel that reads them (ns_sym_kernels.cuh). A Gram batch (ns_algorithm=gram, not
// square) runs Gram Newton-Schulz on the same layouts with other operands (ns_gram_plan.h).
//
// GEMM layouts (transposes, layouts, operand buffers, panels): ns_gemm_plan.h. Batch strides, tiles and
// slices: ns_batch_geometry.h. The kernels: ns_kernels.cuh, ns_sym_kernels.cuh; the order of a run:
// ns_run.cuh.
//
// Determinism: the norm kernels reduce in a fixed order with no atomics; cuBLASLt gives the same bits for
// a fixed algorithm, workspace and GPU (cuBLAS's reproducibility guarantee; the split-K scheme allowed
// here, COMPUTE_TYPE, reduces the fp32 partials in a separate pass in a fixed order).
#include "newton_schulz_cuda.h"

#include <cublasLt.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <utility>

#include "cuda_check.h"
#include "device_buffer.h"
#include "normuon/ns_algorithm.h"
#include "normuon/ns_coefficients.h"
#include "ns_batch_geometry.h"
#include "ns_gemm_plan.h"
#include "ns_run.cuh"
#include "stream_launch.cuh"

namespace normuon::cuda {
namespace {

constexpr size_t kWorkspaceBytes = static_cast<size_t>(kLtWorkspaceBytes);

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

// One batched GEMM, planned once: descriptor, layouts (C = D, beta = 0) and the chosen algorithm.
struct LtGemm {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  std::string info;

  LtGemm() = default;
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;
  ~LtGemm() {
    if (d) cublasLtMatrixLayoutDestroy(d);
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

void plan_gemm(LtGemm& g, cublasLtHandle_t handle, bool bf16, const NsGemmSpec& spec, int64_t x_stride,
               int64_t gram_stride, int32_t count, const std::string& what) {
  const cudaDataType type = bf16 ? CUDA_R_16BF : CUDA_R_32F;
  // fp32 accumulation in both modes; CUBLAS_COMPUTE_32F never uses TF32.
  NORMUON_CUBLAS_CHECK(cublasLtMatmulDescCreate(&g.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const int32_t ta = spec.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, tb = spec.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  NORMUON_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  NORMUON_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  const int32_t pointer_mode = CUBLASLT_POINTER_MODE_HOST;  // alpha = 1 and beta = 0, host floats
  NORMUON_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_POINTER_MODE, &pointer_mode, sizeof(pointer_mode)));
  make_layout(type, spec.a, ns_batch_stride(spec.a.operand, x_stride, gram_stride), count, &g.a);
  make_layout(type, spec.b, ns_batch_stride(spec.b.operand, x_stride, gram_stride), count, &g.b);
  make_layout(type, spec.d, ns_batch_stride(spec.d.operand, x_stride, gram_stride), count, &g.d);

  LtPreference pref;
  const uint64_t workspace = kWorkspaceBytes;
  NORMUON_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                            &workspace, sizeof(workspace)));
  // Split-K only when the partial sums are reduced in fp32 (COMPUTE_TYPE): INPLACE and OUTPUT_TYPE add
  // the partials in the output type, which in bf16 mode would round the accumulation more than once.
  const uint32_t reductions = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  NORMUON_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                            &reductions, sizeof(reductions)));
  // A panel's operands start inside a matrix: only algorithms that need no more alignment than they have.
  const int64_t element_bytes = bf16 ? 2 : 4;
  const uint32_t align_a = ns_operand_alignment(spec.a.offset, element_bytes);
  const uint32_t align_b = ns_operand_alignment(spec.b.offset, element_bytes);
  const uint32_t align_d = ns_operand_alignment(spec.d.offset, element_bytes);
  NORMUON_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                            &align_a, sizeof(align_a)));
  NORMUON_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                            &align_b, sizeof(align_b)));
  NORMUON_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                            &align_d, sizeof(align_d)));
  NORMUON_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                            &align_d, sizeof(align_d)));
  cublasLtMatmulHeuristicResult_t result{};
  int returned = 0;
  NORMUON_CUBLAS_CHECK(
      cublasLtMatmulAlgoGetHeuristic(handle, g.desc, g.a, g.b, g.d, g.d, pref.p, 1, &result, &returned));
  if (returned < 1 || result.state != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error("cuBLASLt found no algorithm for the Newton-Schulz " + what + " GEMM");
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
  std::snprintf(buf, sizeof buf, "%s[algo=%d tile=%u splitk=%d red=%u ws=%zu waves=%.2f]", what.c_str(), id, tile, splitk,
                reduction, result.workspaceSize, static_cast<double>(result.wavesCount));
  g.info = buf;
}

struct Batch {
  NsBatchShape shape;
  NsBatchGeometry geometry;
  // Planned GEMMs, indexed by NsGemm, then by part (ns_planned_gemm).
  std::vector<std::unique_ptr<LtGemm>> lt[3];
};

constexpr const char* kGemmNames[3] = {"gram", "square", "apply"};

const char* precision_name(NsPrecision p) { return p == NsPrecision::bf16 ? "bf16" : "fp32"; }
const char* coefficients_name(NsCoefficients c) {
  return c == NsCoefficients::quintic ? "quintic" : "polar_express";
}

}  // namespace

struct BatchedNewtonSchulz::Impl {
  cudaStream_t stream = nullptr;
  std::unique_ptr<LtHandle> handle;  // declared first: destroyed after the plans that were made with it
  // Shared by all batches (runs are stream-ordered; NsWorkspaceSizes): X (each batch's input and output,
  // in place), the s x s buffers A, C/B and T, the X-shaped U; and for Gram batches (only when there is
  // one) the s x s Q, Z and T2.
  DeviceBuffer<unsigned char> workspace, xmat, gram, bmat, tmat, umat, qmat, zmat, t2mat;
  DeviceBuffer<double> partials;
  std::vector<std::unique_ptr<Batch>> batches;

  template <typename T>
  void run(Batch& b) {
    auto typed = [](DeviceBuffer<unsigned char>& d) { return reinterpret_cast<T*>(d.data()); };
    const NsBuffers<T*> buf{typed(xmat),    typed(gram), typed(bmat), typed(tmat),
                            typed(umat), typed(qmat), typed(zmat), typed(t2mat)};
    auto gemm = [&](NsGemm which, int part, const NsGemmSpec& spec) {
      matmul(*b.lt[static_cast<int>(which)][static_cast<size_t>(part)], spec, buf);
    };
    if (b.geometry.gram_iteration)
      ns_device::run_gram_newton_schulz<T>(StreamLaunch{stream}, gemm, buf, b.shape, b.geometry, partials.data());
    else
      ns_device::run_newton_schulz<T>(StreamLaunch{stream}, gemm, buf, b.shape, b.geometry, partials.data());
  }

  // D = op(A) op(B), the operands' buffers as the spec names them, from their offsets.
  template <typename T>
  void matmul(const LtGemm& g, const NsGemmSpec& spec, const NsBuffers<T*>& buf) {
    const NsGemmPointers<T*> p = ns_gemm_pointers(spec, buf);
    const T* a = p.a + spec.a.offset;
    const T* b = p.b + spec.b.offset;
    T* d = p.d + spec.d.offset;
    const float alpha = 1.0f, beta = 0.0f;
    NORMUON_CUBLAS_CHECK(cublasLtMatmul(handle->h, g.desc, &alpha, a, g.a, b, g.b, &beta, d, g.d, d, g.d, &g.algo,
                                        workspace.data(), workspace.bytes(), stream));
  }
};

BatchedNewtonSchulz::BatchedNewtonSchulz(const std::vector<NsBatchShape>& batches, cudaStream_t stream)
    : impl_(std::make_unique<Impl>()) {
  Impl& im = *impl_;
  im.stream = stream;
  // Validate everything before touching the device.
  for (const NsBatchShape& sh : batches) {
    if (sh.rows < 0 || sh.cols < 0 || sh.count < 0 || sh.steps < 0 || sh.panel_width < 0)
      throw std::invalid_argument("Newton-Schulz batch with a negative size, step count or panel width");
    if (sh.coefficients == NsCoefficients::polar_express && sh.steps > kPolarExpressSteps)
      throw std::invalid_argument("ns_steps=" + std::to_string(sh.steps) +
                                  " but the Polar Express schedule has 5 coefficient triples");
  }

  NsWorkspaceSizes sizes;
  bool any = false;
  for (const NsBatchShape& sh : batches) {
    auto b = std::make_unique<Batch>();
    b->shape = sh;
    b->geometry = ns_batch_geometry(sh);
    sizes.add(sh, b->geometry);
    any = any || !b->geometry.empty;
    im.batches.push_back(std::move(b));
  }
  if (!any) return;  // nothing to run: no device resources

  using Bytes = DeviceBuffer<unsigned char>;
  im.handle = std::make_unique<LtHandle>();
  im.workspace = Bytes(static_cast<int64_t>(kWorkspaceBytes));
  im.xmat = Bytes(sizes.x);
  im.gram = Bytes(sizes.square);
  im.bmat = Bytes(sizes.square);
  im.tmat = Bytes(sizes.square);
  im.umat = Bytes(sizes.x);
  im.partials = DeviceBuffer<double>(sizes.partials);
  if (sizes.gram_only > 0) {
    im.qmat = Bytes(sizes.gram_only);
    im.zmat = Bytes(sizes.gram_only);
    im.t2mat = Bytes(sizes.gram_only);
  }

  for (auto& bp : im.batches) {
    Batch& b = *bp;
    const NsBatchGeometry& g = b.geometry;
    if (g.empty) continue;
    const bool bf16 = b.shape.precision == NsPrecision::bf16;
    const int32_t count = static_cast<int32_t>(b.shape.count);
    cublasLtHandle_t h = im.handle->h;
    for (int i = 0; i < 3; ++i) {
      const NsGemm which = static_cast<NsGemm>(i);
      const int parts = ns_gemm_parts(g, which);
      for (int p = 0; p < parts; ++p) {
        const std::string name = parts > 1 ? kGemmNames[i] + std::to_string(p) : std::string(kGemmNames[i]);
        b.lt[i].push_back(std::make_unique<LtGemm>());
        plan_gemm(*b.lt[i].back(), h, bf16, ns_planned_gemm(g, which, p), g.x.stride, g.sym.stride, count, name);
      }
    }
  }
}

BatchedNewtonSchulz::~BatchedNewtonSchulz() = default;

int BatchedNewtonSchulz::size() const { return static_cast<int>(impl_->batches.size()); }

int64_t BatchedNewtonSchulz::workspace_bytes() const {
  const Impl& im = *impl_;
  const size_t total = im.workspace.bytes() + im.xmat.bytes() + im.gram.bytes() + im.bmat.bytes() + im.tmat.bytes() +
                       im.umat.bytes() + im.qmat.bytes() + im.zmat.bytes() + im.t2mat.bytes() + im.partials.bytes();
  return static_cast<int64_t>(total);
}

const NsBatchShape& BatchedNewtonSchulz::shape(int b) const { return impl_->batches.at(static_cast<size_t>(b))->shape; }

void* BatchedNewtonSchulz::input(int b) {
  impl_->batches.at(static_cast<size_t>(b));  // range-checked
  return impl_->xmat.data();  // shared by the batches
}

const void* BatchedNewtonSchulz::output(int b) const {
  impl_->batches.at(static_cast<size_t>(b));
  return impl_->xmat.data();  // in place
}

int64_t BatchedNewtonSchulz::stride(int b) const { return impl_->batches.at(static_cast<size_t>(b))->geometry.x.stride; }

void BatchedNewtonSchulz::run(int b) {
  Batch& batch = *impl_->batches.at(static_cast<size_t>(b));
  if (batch.geometry.empty) return;
  if (batch.shape.precision == NsPrecision::bf16)
    impl_->run<__nv_bfloat16>(batch);
  else
    impl_->run<float>(batch);
}

int BatchedNewtonSchulz::launches(int b) const {
  return ns_batch_launches(impl_->batches.at(static_cast<size_t>(b))->shape);
}

double BatchedNewtonSchulz::flops(int b) const {
  return ns_batch_flops(impl_->batches.at(static_cast<size_t>(b))->shape);
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
    if (b.geometry.empty) {
      out += " (empty)";
    } else {
      out += b.geometry.plan.tall ? " tall" : " wide";
      if (b.geometry.gram_iteration) out += " gram";
      out += " panels=" + std::to_string(b.geometry.panels.size()) + "x" +
             std::to_string(b.geometry.panels.front().width) + " tiles=" + std::to_string(b.geometry.sym.tiles) +
             " slices=" + std::to_string(b.geometry.x.slices);
      for (const auto& gemms : b.lt)
        for (const auto& lt : gemms) out += " " + lt->info;
    }
    out += '\n';
  }
  return out;
}

void BatchedNewtonSchulz::set_stream(cudaStream_t stream) { impl_->stream = stream; }

}  // namespace normuon::cuda
