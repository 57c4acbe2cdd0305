#include "cuda_check.h"

#include <cublasLt.h>

#include <stdexcept>
#include <string>

namespace normuon::cuda {

void throw_cuda_error(cudaError_t error, const char* call, const char* file, int line) {
  throw std::runtime_error(std::string("CUDA error ") + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) +
                           ") in " + call + " at " + file + ":" + std::to_string(line));
}

void throw_cublas_error(int status, const char* call, const char* file, int line) {
  throw std::runtime_error(std::string("cuBLAS error ") +
                           cublasLtGetStatusName(static_cast<cublasStatus_t>(status)) + " (" +
                           cublasLtGetStatusString(static_cast<cublasStatus_t>(status)) + ") in " + call + " at " +
                           file + ":" + std::to_string(line));
}

}  // namespace normuon::cuda
