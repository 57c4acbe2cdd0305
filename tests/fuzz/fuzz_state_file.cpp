// libFuzzer: any bytes as a state file. The header and metadata parse, the checksums and the fit to a
// small layout (fuzz_manifest.csv, the layout of the seed corpus) must either succeed or throw
// StateFileError; a crash, a sanitizer report or a hang is a bug.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <fstream>
#include <string>

#include "normuon/flat_state.h"
#include "normuon/layout.h"
#include "normuon/manifest.h"
#include "normuon/options.h"
#include "normuon/state_file.h"

namespace {

const normuon::Layout& layout() {
  static const normuon::Layout built =
      normuon::Layout::build(normuon::Manifest::read_csv_file(NORMUON_FUZZ_MANIFEST), normuon::Options{});
  return built;
}

// One file per process, rewritten for every input (the parsers read paths, as users give them).
const std::string& scratch_path() {
  static const std::string path = "/tmp/normuon-fuzz-" + std::to_string(::getpid()) + ".safetensors";
  return path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  {
    std::ofstream out(scratch_path(), std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  try {
    (void)normuon::read_state_header(scratch_path(), true);
    const normuon::StateFileContents contents = normuon::read_state_file(scratch_path());
    normuon::FlatState state(layout());
    normuon::Options options;
    normuon::load_state_file(contents, state, &options);
  } catch (const std::exception&) {
    // A refused file: what the checks are for.
  }
  return 0;
}
