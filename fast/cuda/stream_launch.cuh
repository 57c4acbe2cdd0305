// One kernel launch on a CUDA stream, as the `launch` callable of the device passes
// (step_kernels.cuh, ns_run.cuh) take it; the tests' emulator supplies another.
#pragma once

#include <cuda_runtime_api.h>

#include "cuda_check.h"

namespace normuon::cuda {

struct StreamLaunch {
  cudaStream_t stream;
  template <typename... Params, typename... Args>
  void operator()(void (*kernel)(Params...), int blocks, int threads, Args... args) const {
    kernel<<<blocks, threads, 0, stream>>>(args...);
    NORMUON_CUDA_CHECK_LAUNCH();
  }
};

}  // namespace normuon::cuda
