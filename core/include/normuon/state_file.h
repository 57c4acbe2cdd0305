// The one state-file format of every backend: a safetensors container (8-byte little-endian header
// length, JSON header, raw little-endian tensor bytes) holding parameters and optimizer state, with the
// project's metadata in "__metadata__" (see docs/layout-and-state.md). Any safetensors reader can open it.
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "normuon/flat_state.h"
#include "normuon/options.h"

namespace normuon {

constexpr const char* kStateFormat = "normuon-state";
constexpr int kStateFormatVersion = 1;

// Any reason a state file can't be loaded: the message says what is wrong and where.
class StateFileError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct StateTensorInfo {
  std::string name;
  std::string dtype;               // "F32"
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;     // byte offsets in the data section
  uint32_t crc32 = 0;              // stored checksum
};

struct StateFileHeader {
  std::string format;              // kStateFormat
  int version = 0;
  std::string backend;             // which backend wrote it ("reference-cpu", ...)
  std::string layout_fingerprint;  // hex
  std::string created_utc;
  Options options;                 // hyper-parameters at save time
  std::vector<std::string> group_names;
  std::vector<int64_t> group_steps;
  std::vector<StateTensorInfo> tensors;  // in file order
  uint64_t file_size = 0;
};

// Writes parameters, state tensors, group steps, options and backend name. Atomic: a temporary file in
// the same directory is written, flushed, fsync'ed and renamed over `path`; on any error the old file
// (if any) is left as it was and the temporary file is removed.
void save_state(const std::string& path, const FlatState& state, const Options& options,
                const std::string& backend);

// Reads and fully verifies a file (magic, version, header JSON, sizes, offsets, checksums, layout
// fingerprint, tensor names, dtypes and shapes) before anything in `state` changes: on any error it throws
// StateFileError and `state` is untouched. `options` (if given) receives the saved hyper-parameters.
void load_state(const std::string& path, FlatState& state, Options* options = nullptr);

// Header only, with each tensor's stored checksum verified against its bytes when verify_checksums.
StateFileHeader read_state_header(const std::string& path, bool verify_checksums = true);

}  // namespace normuon
