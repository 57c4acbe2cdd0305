// The GPU's own rates, measured in the benchmark's run so that the fused backend is held against the
// device it ran on: device-to-device copy bandwidth and the bf16 GEMM rate. The measuring functions
// exist only in a build with the CUDA backend; the results are plain data.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace normuon::bench {

// Bytes read plus bytes written per second (GB/s, 1e9) of a cudaMemcpyAsync.
struct CopyRate {
  size_t bytes = 0;  // per copy (one buffer)
  std::vector<double> gbps;
  std::string note;  // why the buffer is smaller than asked, if it is
};

// D = A B, n x n x n, bf16 inputs and output, fp32 accumulation, through cuBLASLt.
struct GemmRate {
  int64_t n = 0;
  std::vector<double> tflops;
  std::string algo;  // the heuristic's choice: algo, tile, workspace
};

// `samples` samples after `warmup` (at least one) unmeasured copies; the buffer is `want_bytes` or
// what fits in the free device memory. Throws below 16 MiB.
CopyRate measure_copy(size_t want_bytes, int64_t warmup, int64_t samples);

// Never TF32; the heuristic's first algorithm with a 32 MiB workspace (as the Newton-Schulz GEMMs are
// planned); random operands (zeros run faster and would flatter the rate).
GemmRate measure_gemm(int64_t n, int64_t warmup, int64_t samples);

}  // namespace normuon::bench
