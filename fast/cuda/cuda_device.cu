#include "cuda_device.h"

#include <cuda_runtime_api.h>

#include <sstream>

namespace normuon::cuda {

std::string unavailable_reason(int device) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    cudaGetLastError();  // clear it: asking is not a failure of the caller
    return std::string("no usable CUDA driver or device (") + cudaGetErrorString(error) + ")";
  }
  if (count == 0) return "no CUDA device is visible";
  if (device < 0 || device >= count)
    return "CUDA device " + std::to_string(device) + " requested, " + std::to_string(count) + " visible";
  // The kernels are built for sm_90 and later (CMAKE_CUDA_ARCHITECTURES, PTX of compute_90): say so
  // here rather than fail at the first launch with "no kernel image".
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    cudaGetLastError();
    return "cannot read the properties of CUDA device " + std::to_string(device);
  }
  if (prop.major < 9)
    return std::string(prop.name) + " is sm_" + std::to_string(prop.major) + std::to_string(prop.minor) +
           "; the CUDA backend is built for sm_90 and later";
  return "";
}

std::string describe_device(int device) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) return "unknown CUDA device";
  std::ostringstream out;
  out.precision(1);
  out << prop.name << ", sm_" << prop.major << prop.minor << ", " << prop.multiProcessorCount << " SMs, " << std::fixed
      << static_cast<double>(prop.totalGlobalMem) / (1 << 30) << " GiB";
  return out.str();
}

}  // namespace normuon::cuda
