// libFuzzer: any bytes as a manifest CSV. Parsing, validation and building a layout must either succeed
// or throw; a crash, a sanitizer report or a hang is a bug (each one found becomes a regression test).
#include <cstddef>
#include <cstdint>
#include <exception>
#include <sstream>
#include <string>

#include "normuon/layout.h"
#include "normuon/manifest.h"
#include "normuon/options.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::istringstream in(std::string(reinterpret_cast<const char*>(data), size));
  try {
    const normuon::Manifest manifest = normuon::Manifest::read_csv(in, "<fuzz>");
    const normuon::Layout layout = normuon::Layout::build(manifest, normuon::Options{});
    (void)layout.describe();
  } catch (const std::exception&) {
    // A refused manifest: what the parser is for.
  }
  return 0;
}
