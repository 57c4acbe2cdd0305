// Error checks for CUDA runtime and cuBLAS calls: a failed call throws std::runtime_error naming the
// call, the error and where it was made (never an abort, so a Python caller sees an exception).
#pragma once

#include <cuda_runtime_api.h>

namespace normuon::cuda {

[[noreturn]] void throw_cuda_error(cudaError_t error, const char* call, const char* file, int line);
[[noreturn]] void throw_cublas_error(int status, const char* call, const char* file, int line);

}  // namespace normuon::cuda

#define NORMUON_CUDA_CHECK(call)                                                           \
  do {                                                                                     \
    const cudaError_t normuon_error_ = (call);                                             \
    if (normuon_error_ != cudaSuccess)                                                     \
      ::normuon::cuda::throw_cuda_error(normuon_error_, #call, __FILE__, __LINE__);        \
  } while (0)

#define NORMUON_CUBLAS_CHECK(call)                                                         \
  do {                                                                                     \
    const int normuon_status_ = static_cast<int>(call);                                    \
    if (normuon_status_ != 0) ::normuon::cuda::throw_cublas_error(normuon_status_, #call, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: reports launch-configuration errors at once (it does not synchronise).
#define NORMUON_CUDA_CHECK_LAUNCH() NORMUON_CUDA_CHECK(cudaGetLastError())
