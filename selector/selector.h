// Which backend serves a request. Production gets the fast path: `auto` means fast, and if the fast
// backend cannot serve the request (not built, or an option it doesn't support) that is an error naming
// the reason, never a silent fallback to the reference. The reference runs only when asked for by name.
#pragma once

#include <memory>
#include <string>

#include "normuon/backend.h"
#include "normuon/backend_choice.h"
#include "normuon/layout.h"

namespace normuon {

// Builds the chosen backend for a layout (which must outlive it) on the chosen device: fast-cpu,
// fast-cuda, reference-cpu or reference-cuda. Throws std::invalid_argument saying why when the choice
// cannot be served (not built, no GPU, an option the backend lacks): never another backend instead.
std::unique_ptr<Backend> make_backend(BackendChoice choice, const Layout& layout, const Options& options,
                                      DeviceChoice device = DeviceChoice::cpu);

}  // namespace normuon
