// Which backend serves a request. Production gets the fast path: `auto` means fast, and if the fast
// backend cannot serve the request (not built, or an option it doesn't support) that is an error naming
// the reason, never a silent fallback to the reference. The reference runs only when asked for by name.
#pragma once

#include <memory>
#include <string>

#include "normuon/backend.h"
#include "normuon/layout.h"

namespace normuon {

enum class BackendChoice { automatic, fast, reference };
// Where the backend runs. Never guessed: a request for cuda where there is no GPU is an error.
enum class DeviceChoice { cpu, cuda };

constexpr const char* kBackendEnvVar = "NORMUON_BACKEND";
constexpr const char* kDeviceEnvVar = "NORMUON_DEVICE";

// "auto" | "fast" | "reference"; anything else throws std::invalid_argument listing the choices.
BackendChoice parse_backend_choice(const std::string& text, const std::string& source = "backend");
const char* to_string(BackendChoice);

// The request in force: an explicit one (code or command line; empty = none) wins over the
// NORMUON_BACKEND environment variable, which wins over the default, auto.
BackendChoice resolve_backend_choice(const std::string& explicit_request);

// "cpu" | "cuda"; the same precedence as the backend: explicit request, NORMUON_DEVICE, default cpu.
DeviceChoice parse_device_choice(const std::string& text, const std::string& source = "device");
const char* to_string(DeviceChoice);
DeviceChoice resolve_device_choice(const std::string& explicit_request);

// Builds the chosen backend for a layout (which must outlive it) on the chosen device: fast-cpu,
// fast-cuda, reference-cpu or reference-cuda. Throws std::invalid_argument saying why when the choice
// cannot be served (not built, no GPU, an option the backend lacks): never another backend instead.
std::unique_ptr<Backend> make_backend(BackendChoice choice, const Layout& layout, const Options& options,
                                      DeviceChoice device = DeviceChoice::cpu);

}  // namespace normuon
