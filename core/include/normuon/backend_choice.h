// Which backend and device a request asks for, and how the request is resolved: the one rule the
// command line, the selector and the Python package share. Production gets the fast path (`auto` means
// fast); the reference runs only when asked for by name.
#pragma once

#include <string>

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

}  // namespace normuon
