#include "cuda_ops.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "kernel_ops_impl.h"

namespace normuon::spec {
namespace {
void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string("reference-cuda: ") + what + ": " + cudaGetErrorString(status));
}
}  // namespace

struct CudaRuntime {
  static void* alloc(size_t bytes) {
    void* p = nullptr;
    check(cudaMalloc(&p, bytes), "cudaMalloc");
    return p;
  }
  static void release(void* p) { cudaFree(p); }
  static void to_host(void* dst, const void* src, size_t bytes) {
    check(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "copy to the host");
  }
  // On the legacy default stream, waited for, so that an error names the kernel that caused it.
  template <typename... Params, typename... Args>
  static void launch(const char* what, void (*kernel)(Params...), unsigned blocks, int threads, Args... args) {
    kernel<<<blocks, threads>>>(args...);
    check(cudaGetLastError(), what);
    check(cudaStreamSynchronize(0), what);
  }
};

template class KernelOps<CudaRuntime>;

}  // namespace normuon::spec
