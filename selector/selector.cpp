#include "selector.h"

#include <cstdlib>
#include <stdexcept>

#ifdef NORMUON_HAVE_FAST_CPU
#include "fast_cpu_backend.h"
#endif
#ifdef NORMUON_HAVE_FAST_CUDA
#include "cuda_device.h"
#include "fast_cuda_backend.h"
#include "step_plan.h"
#endif
#ifdef NORMUON_HAVE_REFERENCE
#include "reference_backend.h"
#endif

namespace normuon {

namespace {

[[maybe_unused]] [[noreturn]] void not_built(const std::string& what, const std::string& option) {
  throw std::invalid_argument("backend " + what + " was requested but this build does not have it (configured with -D" +
                              option + "=OFF); no fallback to another backend");
}

std::unique_ptr<Backend> make_reference(const Layout& layout, const Options& options, DeviceChoice device) {
  (void)layout;
  (void)options;
#ifdef NORMUON_HAVE_REFERENCE
  const ReferenceDevice where = device == DeviceChoice::cpu ? ReferenceDevice::cpu : ReferenceDevice::cuda;
  const std::string reason = ReferenceBackend::unavailable_reason(where);
  if (!reason.empty())
    throw std::invalid_argument(std::string("backend reference on ") + to_string(device) + " cannot run here: " + reason);
  return std::make_unique<ReferenceBackend>(where);
#else
  not_built(std::string("reference on ") + to_string(device), "NORMUON_BUILD_REFERENCE");
#endif
}

std::unique_ptr<Backend> make_fast(const std::string& asked, const Layout& layout, const Options& options,
                                   DeviceChoice device) {
  (void)layout;
  (void)options;
  const std::string advice = " (no fallback to the reference; change the options or ask for backend=reference)";
  if (device == DeviceChoice::cuda) {
#ifdef NORMUON_HAVE_FAST_CUDA
    const std::string reason = cuda::plan_unsupported_reason(layout, options);
    if (!reason.empty()) throw std::invalid_argument("backend " + asked + " on cuda cannot serve this request: " + reason + advice);
    const std::string no_gpu = cuda::unavailable_reason();
    if (!no_gpu.empty())
      throw std::invalid_argument("backend " + asked + " on cuda cannot run here: " + no_gpu +
                                  " (no fallback to the CPU; ask for device=cpu explicitly)");
    return std::make_unique<FastCudaBackend>(layout, options);
#else
    not_built(asked + " on cuda", "NORMUON_BUILD_CUDA");
#endif
  }
#ifdef NORMUON_HAVE_FAST_CPU
  const std::string reason = FastCpuBackend::unsupported_reason(layout, options);
  if (!reason.empty()) throw std::invalid_argument("backend " + asked + " on cpu cannot serve this request: " + reason + advice);
  return std::make_unique<FastCpuBackend>(layout, options);
#else
  not_built(asked + " on cpu", "NORMUON_BUILD_FAST_CPU");
#endif
}

}  // namespace

std::unique_ptr<Backend> make_backend(BackendChoice choice, const Layout& layout, const Options& options,
                                      DeviceChoice device) {
  if (choice == BackendChoice::reference) return make_reference(layout, options, device);
  return make_fast(choice == BackendChoice::automatic ? "auto (= fast)" : "fast", layout, options, device);
}

}  // namespace normuon
