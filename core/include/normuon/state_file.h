// The one state-file format of every backend: a safetensors container (8-byte little-endian header
// length, JSON header, raw little-endian tensor bytes) holding parameters and optimizer state, with the
// project's metadata in "__metadata__" (see docs/layout-and-state.md). Any safetensors reader can open it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "normuon/flat_state.h"
#include "normuon/options.h"

namespace normuon {

constexpr const char* kStateFormat = "normuon-state";
// Version 2 adds each parameter's own step count (metadata "entry_steps"); version-1 files still load,
// each parameter's count taken to be its group's counter. Version 3 marks options that a version-2 reader
// would misread: ns_algorithm=gram (a build without the knob ignores the key and would run the standard
// loop). A file is written with the lowest version that holds it (state_format_version_for), so the files
// of runs that use no such option still open in older builds.
constexpr int kStateFormatVersion = 3;
constexpr int kStateFormatOldestVersion = 1;

// The format version a file saved with these options is written with: 3 when a group uses Gram
// Newton-Schulz, else 2.
int state_format_version_for(const Options& options);

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
  // Version 2: each parameter's own step count, by parameter name. Empty in a version-1 file, whose
  // parameters load with their group's counter (entry_steps_from_groups).
  std::map<std::string, int64_t> entry_steps;
  std::vector<StateTensorInfo> tensors;  // in file order
  uint64_t file_size = 0;
  // Metadata keys this format does not define (a later version's, or a caller's own, such as the
  // `normuon run` step counter "run_step"), with their values.
  std::map<std::string, std::string> extra_metadata;
};

// A state file read once, whole: its header parsed and its structure checked, but neither its checksums
// nor its fit to a layout yet (load_state_file does both). Reading the options from `header` and then
// loading the tensors from the same object takes both from one version of the file, even while the file
// is being replaced.
struct StateFileContents {
  std::string path;
  StateFileHeader header;
  std::shared_ptr<const char[]> bytes;  // the whole file
  uint64_t data_offset = 0;             // where the data section starts in `bytes`
};

// Writes parameters, state tensors, group and entry steps, options and backend name (format version
// kStateFormatVersion; entry steps that don't fit the group steps, entry_steps_invalid_reason, are refused
// before anything is written). Atomic: a temporary file in the same directory is written, flushed,
// fsync'ed and renamed over `path`; on any error the old file (if any) is left as it was and the
// temporary file is removed.
// If `path` is a symbolic link, the file it points to is replaced (the link stays); a file that exists
// keeps its permission bits. After the rename, temporary files of the same target left by a save that
// was killed (`PATH.tmp-<pid>-<hex>` whose process no longer exists) are removed.
void save_state(const std::string& path, const FlatState& state, const Options& options,
                const std::string& backend);
// save_state with extra metadata entries (string -> string) for the caller, kept in
// StateFileHeader::extra_metadata; a key of the format's own metadata is refused.
void save_state_with_metadata(const std::string& path, const FlatState& state, const Options& options,
                              const std::string& backend, const std::map<std::string, std::string>& extra);

// Checks, without writing anything there, that save_state(path, ...) can create its file: the directory
// exists and is writable, and the target is not a directory or another non-regular file. For a long run
// that saves at the end, so that a bad path fails before the first step rather than after the last.
void check_state_save_path(const std::string& path);

// Reads and fully verifies a file (magic, version, header JSON, sizes, offsets, checksums, layout
// fingerprint, tensor names, dtypes and shapes, entry steps) before anything in `state` changes: on any
// error it throws StateFileError and `state` is untouched. `options` (if given) receives the saved
// hyper-parameters. A version-1 file gives every parameter its group's counter as its own count.
void load_state(const std::string& path, FlatState& state, Options* options = nullptr);

// Header only, with each tensor's stored checksum verified against its bytes when verify_checksums.
StateFileHeader read_state_header(const std::string& path, bool verify_checksums = true);

// One read of the whole file (see StateFileContents), then load_state's checks and copy from those bytes.
StateFileContents read_state_file(const std::string& path);
void load_state_file(const StateFileContents& file, FlatState& state, Options* options = nullptr);

}  // namespace normuon
