#include "selector.h"

#include <cstdlib>
#include <stdexcept>

#ifdef NORMUON_HAVE_FAST_CPU
#include "fast_cpu_backend.h"
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

std::unique_ptr<Backend> make_backend(BackendChoice choice, const Layout& layout, const Options& options) {
  if (choice == BackendChoice::reference) {
#ifdef NORMUON_HAVE_REFERENCE
    return std::make_unique<ReferenceBackend>();
#else
    throw std::invalid_argument("backend 'reference' was requested but this build has no reference backend "
                                "(configured with -DNORMUON_BUILD_REFERENCE=OFF)");
#endif
  }
  const std::string asked = choice == BackendChoice::automatic ? "auto (= fast)" : "fast";
#ifdef NORMUON_HAVE_FAST_CPU
  const std::string reason = FastCpuBackend::unsupported_reason(layout, options);
  if (!reason.empty())
    throw std::invalid_argument("backend " + asked + " cannot serve this request: " + reason +
                                " (no fallback to the reference; change the options or ask for backend=reference)");
  return std::make_unique<FastCpuBackend>(layout, options);
#else
  (void)layout;
  (void)options;
  throw std::invalid_argument("backend " + asked + " was requested but this build has no fast backend "
                              "(configured with -DNORMUON_BUILD_FAST_CPU=OFF); no fallback to the reference");
#endif
}

}  // namespace normuon
