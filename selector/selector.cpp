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

BackendChoice parse_backend_choice(const std::string& text, const std::string& source) {
  if (text == "auto") return BackendChoice::automatic;
  if (text == "fast") return BackendChoice::fast;
  if (text == "reference") return BackendChoice::reference;
  throw std::invalid_argument(source + ": unknown backend '" + text + "' (choose auto | fast | reference)");
}

const char* to_string(BackendChoice c) {
  switch (c) {
    case BackendChoice::automatic: return "auto";
    case BackendChoice::fast: return "fast";
    case BackendChoice::reference: return "reference";
  }
  return "?";
}

BackendChoice resolve_backend_choice(const std::string& explicit_request) {
  if (!explicit_request.empty()) return parse_backend_choice(explicit_request);
  if (const char* env = std::getenv(kBackendEnvVar); env && *env)
    return parse_backend_choice(env, std::string("environment variable ") + kBackendEnvVar);
  return BackendChoice::automatic;
}

DeviceChoice parse_device_choice(const std::string& text, const std::string& source) {
  if (text == "cpu") return DeviceChoice::cpu;
  if (text == "cuda") return DeviceChoice::cuda;
  throw std::invalid_argument(source + ": unknown device '" + text + "' (choose cpu | cuda)");
}

const char* to_string(DeviceChoice d) { return d == DeviceChoice::cpu ? "cpu" : "cuda"; }

DeviceChoice resolve_device_choice(const std::string& explicit_request) {
  if (!explicit_request.empty()) return parse_device_choice(explicit_request);
  if (const char* env = std::getenv(kDeviceEnvVar); env && *env)
    return parse_device_choice(env, std::string("environment variable ") + kDeviceEnvVar);
  return DeviceChoice::cpu;
}

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
