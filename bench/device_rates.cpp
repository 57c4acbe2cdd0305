#include "device_rates.h"

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "bench_report.h"
#include "cuda_check.h"
#include "cuda_timing.h"
#include "device_buffer.h"

namespace normuon::bench {
namespace {

using cuda::DeviceBuffer;

uint16_t to_bf16_bits(float x) {  // round to nearest even
  uint32_t u = 0;
  std::memcpy(&u, &x, sizeof u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace

CopyRate measure_copy(size_t want_bytes, int64_t warmup, int64_t samples) {
  CopyRate r;
  size_t free_bytes = 0, total_bytes = 0;
  NORMUON_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const size_t margin = size_t{256} << 20;
  const size_t fits = free_bytes > margin ? (free_bytes - margin) / 2 : 0;
  r.bytes = std::min(want_bytes, fits) / (size_t{1} << 20) * (size_t{1} << 20);
  if (r.bytes < want_bytes)
    r.note = format("%zu MiB asked, %zu MiB free on the device", want_bytes >> 20, free_bytes >> 20);
  if (r.bytes < (size_t{16} << 20)) throw std::runtime_error("copy bandwidth: not enough device memory (" + r.note + ")");
  const int64_t floats = static_cast<int64_t>(r.bytes / sizeof(float));
  DeviceBuffer<float> src(floats), dst(floats);
  NORMUON_CUDA_CHECK(cudaMemset(src.data(), 0x3c, r.bytes));
  NORMUON_CUDA_CHECK(cudaMemset(dst.data(), 0, r.bytes));
  NORMUON_CUDA_CHECK(cudaDeviceSynchronize());  // the memsets ran on the legacy stream; don't time them
  CudaStream stream;
  auto copy = [&] {
    NORMUON_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), r.bytes, cudaMemcpyDeviceToDevice, stream.get()));
  };
  for (int64_t i = 0; i < std::max<int64_t>(warmup, 1); ++i) copy();
  // Enough copies per sample for ~20 GB of traffic (about 5-7 ms on an H100/H200), at least 3.
  const int64_t per_sample = std::clamp<int64_t>(static_cast<int64_t>(2e10 / (2.0 * static_cast<double>(r.bytes))), 3, 1000);
  for (double ms : time_chained(stream.get(), samples, per_sample, copy))
    r.gbps.push_back(2.0 * static_cast<double>(r.bytes) / (ms * 1e-3) / 1e9);
  return r;
}

GemmRate measure_gemm(int64_t n, int64_t warmup, int64_t samples) {
  GemmRate r;
  r.n = n;
  const int64_t elems = n * n;
  std::vector<uint16_t> host(static_cast<size_t>(elems));
  uint64_t state = 0x9e3779b97f4a7c15ull;
  for (auto& h : host) {  // uniform in [-1, 1) from a 64-bit LCG's high bits
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    h = to_bf16_bits(static_cast<float>(static_cast<double>(state >> 40) / 8388608.0 - 1.0));
  }
  DeviceBuffer<uint16_t> a(elems), b(elems), d(elems);
  NORMUON_CUDA_CHECK(cudaMemcpy(a.data(), host.data(), a.bytes(), cudaMemcpyHostToDevice));
  std::reverse(host.begin(), host.end());
  NORMUON_CUDA_CHECK(cudaMemcpy(b.data(), host.data(), b.bytes(), cudaMemcpyHostToDevice));
  const size_t workspace_bytes = size_t{32} << 20;
  DeviceBuffer<unsigned char> workspace(static_cast<int64_t>(workspace_bytes));

  struct Lt {
    cublasLtHandle_t handle = nullptr;
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t layout = nullptr;
    cublasLtMatmulPreference_t pref = nullptr;
    ~Lt() {
      if (pref) cublasLtMatmulPreferenceDestroy(pref);
      if (layout) cublasLtMatrixLayoutDestroy(layout);
      if (desc) cublasLtMatmulDescDestroy(desc);
      if (handle) cublasLtDestroy(handle);
    }
  } lt;
  NORMUON_CUBLAS_CHECK(cublasLtCreate(&lt.handle));
  NORMUON_CUBLAS_CHECK(cublasLtMatmulDescCreate(&lt.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const int32_t op_n = CUBLAS_OP_N;
  NORMUON_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(lt.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_n, sizeof op_n));
  NORMUON_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(lt.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof op_n));
  const uint64_t dim = static_cast<uint64_t>(n);
  NORMUON_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lt.layout, CUDA_R_16BF, dim, dim, n));  // A, B, C, D alike
  NORMUON_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&lt.pref));
  const uint64_t ws = workspace_bytes;
  NORMUON_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(lt.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
  cublasLtMatmulHeuristicResult_t heuristic{};
  int returned = 0;
  NORMUON_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt.handle, lt.desc, lt.layout, lt.layout, lt.layout, lt.layout,
                                                      lt.pref, 1, &heuristic, &returned));
  if (returned < 1 || heuristic.state != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error("cuBLASLt found no algorithm for a " + std::to_string(n) + "^3 bf16 GEMM");
  int32_t algo_id = -1;
  uint32_t tile = 0;
  size_t written = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&heuristic.algo, CUBLASLT_ALGO_CONFIG_ID, &algo_id, sizeof algo_id, &written);
  cublasLtMatmulAlgoConfigGetAttribute(&heuristic.algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &written);
  r.algo = format("algo %d, tile %u, workspace %zu", algo_id, tile, heuristic.workspaceSize);

  CudaStream stream;
  const float alpha = 1.0f, beta = 0.0f;
  auto gemm = [&] {
    NORMUON_CUBLAS_CHECK(cublasLtMatmul(lt.handle, lt.desc, &alpha, a.data(), lt.layout, b.data(), lt.layout, &beta,
                                        d.data(), lt.layout, d.data(), lt.layout, &heuristic.algo, workspace.data(),
                                        workspace_bytes, stream.get()));
  };
  const double flops = 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n);
  for (int64_t i = 0; i < std::max<int64_t>(warmup, 1); ++i) gemm();
  // Enough GEMMs per sample for ~20 TFLOP (about 25 ms on an H100), at least 3.
  const int64_t per_sample = std::clamp<int64_t>(static_cast<int64_t>(2e13 / flops), 3, 1000);
  for (double ms : time_chained(stream.get(), samples, per_sample, gemm)) r.tflops.push_back(flops / (ms * 1e-3) / 1e12);
  return r;
}

}  // namespace normuon::bench
