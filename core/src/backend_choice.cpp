#include "normuon/backend_choice.h"

#include <cstdlib>
#include <stdexcept>

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

}  // namespace normuon
