// State files: atomic save, all-or-nothing load, header inspection. Byte layout: docs/layout-and-state.md.
#include "normuon/state_file.h"

#include "bounded_json.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

namespace normuon {
namespace {

// Tensor bytes go to and from disk with memcpy/write, so the host must already be little-endian.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "state files hold little-endian fp32: a big-endian host needs byte swapping here");

using json = nlohmann::json;

constexpr uint64_t kLengthBytes = 8;              // the little-endian u64 in front of the header
constexpr uint64_t kMaxHeaderBytes = 100000000;   // safetensors' own limit
constexpr uint64_t kDataAlign = 8;                // safetensors pads its header to this
constexpr uint64_t kMaxIoChunk = uint64_t{1} << 30;  // read()/write() cap a single call below 2 GiB
constexpr size_t kMaxListed = 8;                  // names listed in one error message

// The metadata keys the format's `version` defines; any other key is a caller's
// (StateFileHeader::extra_metadata). Version 2 added "entry_steps"; version 3 adds none.
const std::set<std::string>& format_metadata_keys(int version = kStateFormatVersion) {
  static const std::set<std::string> v1{"format",      "format_version", "backend",     "layout_fingerprint",
                                        "created_utc", "options",        "group_names", "group_steps",
                                        "checksums",   "header_crc32"};
  static const std::set<std::string> v2 = [] {
    std::set<std::string> keys = v1;
    keys.insert("entry_steps");
    return keys;
  }();
  return version >= 2 ? v2 : v1;
}

}  // namespace

int state_format_version_for(const Options& options) {
  for (const auto& g : options.groups)
    if (g.algorithm == Algorithm::normuon && g.normuon.ns_algorithm != NsAlgorithm::standard) return 3;
  return 2;
}

namespace {

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw StateFileError("state file '" + path + "': " + what);
}

std::string errno_text() { return std::strerror(errno); }

const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "not a regular file";
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? "," : "") + std::to_string(shape[i]);
  return out + "]";
}

std::string list_text(const std::vector<std::string>& items) {
  std::string out;
  for (size_t i = 0; i < items.size() && i < kMaxListed; ++i) out += (i ? ", " : "") + items[i];
  if (items.size() > kMaxListed) out += " and " + std::to_string(items.size() - kMaxListed) + " more";
  return out;
}

std::string crc_hex(uint32_t crc) {
  char text[9];
  std::snprintf(text, sizeof text, "%08x", crc);
  return text;
}

uint32_t crc_of(const void* data, uint64_t size) {
  return static_cast<uint32_t>(crc32_z(0, static_cast<const Bytef*>(data), size));
}

// Every tensor of a state file, in file order: each layout entry's parameter, then its state tensors.
std::vector<StateTensorRef> file_tensors(FlatState& s) {
  std::vector<StateTensorRef> out;
  for (int e = 0; e < static_cast<int>(s.layout->entries.size()); ++e) {
    const LayoutEntry& entry = s.layout->entries[e];
    out.push_back({entry.name, entry.shape, s.param(e), entry.numel});
    for (StateTensorRef& t : state_tensors(s, e)) out.push_back(std::move(t));
  }
  return out;
}

uint64_t byte_size(const StateTensorRef& t) { return static_cast<uint64_t>(t.numel) * sizeof(float); }

// ---------------------------------------------------------------------------------------------- saving

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &utc);
  return text;
}

// CRC-32 of a header's canonical JSON text.
uint32_t header_crc(const json& root) {
  const std::string text = root.dump();
  return crc_of(text.data(), text.size());
}

// The header JSON, padded with spaces so that the data section starts 8-byte aligned.
std::string header_text(const std::string& path, const std::vector<StateTensorRef>& tensors,
                        const FlatState& state, const Options& options, const std::string& backend,
                        const std::map<std::string, std::string>& extra) {
  json root = json::object(), checksums = json::object();
  uint64_t offset = 0;
  for (const StateTensorRef& t : tensors) {
    if (t.name == "__metadata__" || root.contains(t.name)) fail(path, "two tensors would be named '" + t.name + "'");
    const uint64_t end = offset + byte_size(t);
    root[t.name] = {{"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, end}}};
    checksums[t.name] = crc_hex(crc_of(t.data, byte_size(t)));
    offset = end;
  }
  const Layout& layout = *state.layout;
  json entry_steps = json::object();  // by parameter name (manifest names are unique)
  for (size_t e = 0; e < layout.entries.size(); ++e) entry_steps[layout.entries[e].name] = state.entry_steps[e];
  root["__metadata__"] = {{"format", kStateFormat},
                          {"format_version", std::to_string(state_format_version_for(options))},
                          {"backend", backend},
                          {"layout_fingerprint", layout.fingerprint_hex()},
                          {"created_utc", utc_now()},
                          {"options", options.to_json()},
                          {"group_names", json(layout.group_names).dump()},
                          {"group_steps", json(state.group_steps).dump()},
                          {"entry_steps", entry_steps.dump()},
                          {"checksums", checksums.dump()}};
  for (const auto& [key, value] : extra) {
    if (format_metadata_keys().count(key))
      fail(path, "save failed: extra metadata key \"" + key + "\" is one of the format's own keys");
    root["__metadata__"][key] = value;
  }
  std::string text;
  try {
    // The header protects itself too: a CRC of its canonical JSON (nlohmann sorts keys) without this key.
    root["__metadata__"]["header_crc32"] = crc_hex(header_crc(root));
    text = root.dump();
  } catch (const json::exception& e) {  // a name that is not valid UTF-8
    fail(path, std::string("cannot write the header: ") + e.what());
  }
  text.append((kDataAlign - (kLengthBytes + text.size()) % kDataAlign) % kDataAlign, ' ');
  return text;
}

void write_all(int fd, const void* data, uint64_t size, const std::string& path, const std::string& tmp) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, std::min(size, kMaxIoChunk));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail(path, "save failed: writing '" + tmp + "': " + errno_text());
    p += n;
    size -= static_cast<uint64_t>(n);
  }
}

std::string directory_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string base_name(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

constexpr const char* kTempInfix = ".tmp-";
constexpr size_t kTempHexDigits = 8;

// A sibling of `path` that no other writer picks: pid plus a random suffix, created with O_EXCL.
std::string temp_name(const std::string& path) {
  char suffix[16];
  std::snprintf(suffix, sizeof suffix, "%08x", static_cast<unsigned>(std::random_device{}()));
  return path + kTempInfix + std::to_string(::getpid()) + "-" + suffix;
}

// The file a save replaces: `path`, or the end of its chain of symbolic links, so that saving onto a link
// replaces what it points to and the link stays.
struct SaveTarget {
  std::string file;
  bool exists = false;
  mode_t mode = 0;  // permission bits of the existing file, which the new one keeps
};

SaveTarget resolve_save_target(const std::string& path) {
  constexpr int kMaxLinks = 40;  // as the kernel's own limit (ELOOP)
  SaveTarget target;
  target.file = path;
  for (int links = 0;; ++links) {
    struct stat st{};
    if (::lstat(target.file.c_str(), &st) != 0) {
      if (errno == ENOENT) return target;  // a new file (or a dangling link's target, which is created)
      fail(path, "save failed: cannot stat '" + target.file + "': " + errno_text());
    }
    if (!S_ISLNK(st.st_mode)) {
      if (!S_ISREG(st.st_mode))
        fail(path, "save failed: '" + target.file + "' is " + file_kind(st.st_mode) + ", not a regular file");
      target.exists = true;
      target.mode = st.st_mode & 0777;
      return target;
    }
    if (links == kMaxLinks) fail(path, "save failed: more than 40 levels of symbolic links");
    std::string link(static_cast<size_t>(st.st_size > 0 ? st.st_size : 0) + 256, '\0');
    const ssize_t n = ::readlink(target.file.c_str(), &link[0], link.size());
    if (n <= 0) fail(path, "save failed: cannot read the symbolic link '" + target.file + "': " + errno_text());
    if (static_cast<size_t>(n) >= link.size()) fail(path, "save failed: the symbolic link '" + target.file + "' changed");
    link.resize(static_cast<size_t>(n));
    target.file = link.front() == '/' ? link : directory_of(target.file) + "/" + link;
  }
}

// Removes temporary files of `file` (`file.tmp-<pid>-<8 hex>`, exactly what temp_name makes) whose writer
// is gone: a save killed before its rename leaves one, and no later save would. A file of a live process
// (another save of the same target under way), of this process, or of a process this one may not signal
// stays. Best effort: a failure here does not fail the save.
void remove_stale_temps(const std::string& file) {
  const std::string prefix = base_name(file) + kTempInfix;
  DIR* dir = ::opendir(directory_of(file).c_str());
  if (!dir) return;
  while (const dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string rest = name.substr(prefix.size());
    const size_t dash = rest.find('-');
    if (dash == std::string::npos || dash == 0 || dash > 9 || rest[0] == '0') continue;
    const std::string pid_text = rest.substr(0, dash), hex = rest.substr(dash + 1);
    if (pid_text.find_first_not_of("0123456789") != std::string::npos || hex.size() != kTempHexDigits ||
        hex.find_first_not_of("0123456789abcdef") != std::string::npos)
      continue;
    const pid_t pid = static_cast<pid_t>(std::stol(pid_text));
    if (pid == ::getpid() || ::kill(pid, 0) == 0 || errno != ESRCH) continue;
    struct stat st{};
    if (::fstatat(::dirfd(dir), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode))
      ::unlinkat(::dirfd(dir), name.c_str(), 0);
  }
  ::closedir(dir);
}

// write temp -> fsync -> rename over the target -> fsync directory, so a crash leaves the old or the new
// file.
void write_atomically(const std::string& path, const std::string& header,
                      const std::vector<StateTensorRef>& tensors) {
  const SaveTarget target = resolve_save_target(path);
  const std::string tmp = temp_name(target.file);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd < 0) fail(path, "save failed: cannot create '" + tmp + "': " + errno_text());
  try {
    // The new file replaces the old one, so it takes the old one's permissions (a 0600 file stays private).
    if (target.exists && ::fchmod(fd, target.mode) != 0)
      fail(path, "save failed: setting the mode of '" + tmp + "': " + errno_text());
    unsigned char length[kLengthBytes];
    for (uint64_t i = 0, n = header.size(); i < kLengthBytes; ++i, n >>= 8) length[i] = static_cast<unsigned char>(n);
    write_all(fd, length, kLengthBytes, path, tmp);
    write_all(fd, header.data(), header.size(), path, tmp);
    for (const StateTensorRef& t : tensors) write_all(fd, t.data, byte_size(t), path, tmp);
    // write() leaves nothing in user space to flush; fsync puts it on the disk before the rename.
    if (::fsync(fd) != 0) fail(path, "save failed: fsync of '" + tmp + "': " + errno_text());
    const int closed = ::close(fd);
    fd = -1;
    if (closed != 0) fail(path, "save failed: closing '" + tmp + "': " + errno_text());
    if (::rename(tmp.c_str(), target.file.c_str()) != 0)
      fail(path, "save failed: renaming '" + tmp + "' over '" + target.file + "': " + errno_text());
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  remove_stale_temps(target.file);
  if (target.file != path) remove_stale_temps(path);  // earlier versions put them beside the link
  // The rename itself is durable only once the directory entry is on disk.
  const std::string dir = directory_of(target.file);
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  const bool synced = dir_fd >= 0 && ::fsync(dir_fd) == 0;
  const std::string why = synced ? "" : errno_text();
  if (dir_fd >= 0) ::close(dir_fd);
  if (!synced)
    fail(path, "saved, but syncing directory '" + dir + "' failed (" + why + "): the new file may not survive a crash");
}

// --------------------------------------------------------------------------------------------- reading

// The file's bytes: all of them, or only the length field and the header.
struct RawFile {
  std::unique_ptr<char[]> bytes;  // not zero-filled: it is read over at once
  uint64_t file_size = 0;
  uint64_t header_size = 0;
  const char* header() const { return bytes.get() + kLengthBytes; }
  const char* data() const { return bytes.get() + kLengthBytes + header_size; }
};

struct FdCloser {
  int fd;
  ~FdCloser() { ::close(fd); }
};

void read_exact(int fd, char* out, uint64_t size, const std::string& path) {
  while (size > 0) {
    const ssize_t n = ::read(fd, out, std::min(size, kMaxIoChunk));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail(path, "read failed: " + errno_text());
    if (n == 0) fail(path, "truncated while being read");
    out += n;
    size -= static_cast<uint64_t>(n);
  }
}

RawFile read_file(const std::string& path, bool with_data) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever. It changes nothing
  // for the regular files that pass the check below.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail(path, "cannot open: " + errno_text());
  const FdCloser closer{fd};
  struct stat st{};
  if (::fstat(fd, &st) != 0) fail(path, "cannot stat: " + errno_text());
  if (!S_ISREG(st.st_mode)) fail(path, std::string("is ") + file_kind(st.st_mode) + ", not a regular file");

  RawFile raw;
  raw.file_size = static_cast<uint64_t>(st.st_size);
  if (raw.file_size < kLengthBytes)
    fail(path, "truncated: " + std::to_string(raw.file_size) + " bytes, fewer than the 8 of the header length");
  unsigned char length[kLengthBytes];
  read_exact(fd, reinterpret_cast<char*>(length), kLengthBytes, path);
  for (uint64_t i = kLengthBytes; i-- > 0;) raw.header_size = raw.header_size << 8 | length[i];
  if (raw.header_size > raw.file_size - kLengthBytes)
    fail(path, "truncated (or not a state file): header length " + std::to_string(raw.header_size) + " but only " +
                   std::to_string(raw.file_size - kLengthBytes) + " bytes follow");
  if (raw.header_size > kMaxHeaderBytes)
    fail(path, "header length " + std::to_string(raw.header_size) + " exceeds the limit of " +
                   std::to_string(kMaxHeaderBytes) + " bytes");

  const uint64_t keep = with_data ? raw.file_size : kLengthBytes + raw.header_size;
  raw.bytes.reset(new char[keep]);
  std::memcpy(raw.bytes.get(), length, kLengthBytes);
  read_exact(fd, raw.bytes.get() + kLengthBytes, keep - kLengthBytes, path);
  return raw;
}

// JSON from the file, nesting bounded (see bounded_json.h); errors become StateFileErrors.
json parse_file_json(const std::string& path, const std::string& what, const char* begin, const char* end,
                     const std::function<void(const std::string&)>& on_top_key = {}) {
  try {
    return detail::parse_bounded_json(begin, end, on_top_key);
  } catch (const detail::JsonTooDeep& e) {
    fail(path, what + " is refused: " + e.what());
  } catch (const json::parse_error& e) {
    fail(path, what + " is not valid JSON: " + e.what());
  }
}

// JSON text stored inside a metadata string.
json parse_embedded(const std::string& path, const std::string& key, const std::string& text) {
  return parse_file_json(path, "metadata \"" + key + "\"", text.data(), text.data() + text.size());
}

std::string metadata_string(const std::string& path, const json& meta, const char* key) {
  const auto it = meta.find(key);
  if (it == meta.end()) fail(path, std::string("metadata has no \"") + key + "\"");
  return it->get<std::string>();  // every value was checked to be a string
}

uint64_t unsigned_field(const std::string& path, const std::string& name, const json& v, const char* what) {
  if (!v.is_number_unsigned())
    fail(path, "tensor '" + name + "': " + what + " " + v.dump() + " is not a non-negative integer");
  return v.get<uint64_t>();
}

void parse_tensor(const std::string& path, const std::string& name, const json& entry, StateTensorInfo& t) {
  t.name = name;
  if (!entry.is_object()) fail(path, "tensor '" + name + "' is not described by an object");
  const auto dtype = entry.find("dtype"), shape = entry.find("shape"), offsets = entry.find("data_offsets");
  if (dtype == entry.end() || shape == entry.end() || offsets == entry.end())
    fail(path, "tensor '" + name + "' lacks dtype, shape or data_offsets");
  if (!dtype->is_string()) fail(path, "tensor '" + name + "': dtype is not a string");
  t.dtype = dtype->get<std::string>();
  if (t.dtype != "F32") fail(path, "tensor '" + name + "' has dtype " + t.dtype + "; state files hold F32 only");
  if (!shape->is_array()) fail(path, "tensor '" + name + "': shape is not an array");
  uint64_t numel = 1;
  for (const json& d : *shape) {
    const uint64_t extent = unsigned_field(path, name, d, "shape extent");
    if (extent > uint64_t{INT64_MAX} || (extent != 0 && numel > uint64_t{INT64_MAX} / sizeof(float) / extent))
      fail(path, "tensor '" + name + "': shape " + shape->dump() + " is too large");
    numel *= extent;
    t.shape.push_back(static_cast<int64_t>(extent));
  }
  if (!offsets->is_array() || offsets->size() != 2)
    fail(path, "tensor '" + name + "': data_offsets is not [begin, end]");
  t.begin = unsigned_field(path, name, (*offsets)[0], "data_offsets begin");
  t.end = unsigned_field(path, name, (*offsets)[1], "data_offsets end");
  if (t.end < t.begin) fail(path, "tensor '" + name + "': data_offsets " + offsets->dump() + " end before they begin");
  if (t.end - t.begin != numel * sizeof(float))
    fail(path, "tensor '" + name + "': shape " + shape_text(t.shape) + " needs " +
                   std::to_string(numel * sizeof(float)) + " bytes but data_offsets " + offsets->dump() + " span " +
                   std::to_string(t.end - t.begin));
}

// Tensors sorted by position must tile the data section exactly: no gaps, no overlaps, nothing after.
void check_tiling(const std::string& path, const std::vector<StateTensorInfo>& tensors, uint64_t data_size) {
  for (const StateTensorInfo& t : tensors)
    if (t.end > data_size)
      fail(path, "tensor '" + t.name + "' ends at byte " + std::to_string(t.end) + ", past the end of the " +
                     std::to_string(data_size) + "-byte data section: the file is truncated or its offsets are wrong");
  uint64_t covered = 0;
  for (const StateTensorInfo& t : tensors) {
    if (t.begin > covered)
      fail(path, "gap in the data section: bytes [" + std::to_string(covered) + ", " + std::to_string(t.begin) +
                     ") belong to no tensor");
    if (t.begin < covered) fail(path, "tensor '" + t.name + "' overlaps the tensor before it");
    covered = t.end;
  }
  if (covered < data_size) fail(path, std::to_string(data_size - covered) + " trailing bytes after the last tensor");
}

// Everything the header says, checked for structure and consistency with the file size.
StateFileHeader parse_header(const std::string& path, const RawFile& raw) {
  const char* text = raw.header();
  if (raw.header_size == 0 || text[0] != '{') fail(path, "header does not start with '{': not a safetensors file");
  // safetensors forbids duplicate names, which a JSON parser would silently merge.
  std::set<std::string> top_keys;
  std::string duplicate;
  const auto on_top_key = [&](const std::string& key) {
    if (!top_keys.insert(key).second && duplicate.empty()) duplicate = key;
  };
  const json root = parse_file_json(path, "header", text, text + raw.header_size, on_top_key);
  if (!duplicate.empty()) fail(path, "header names '" + duplicate + "' twice");

  const auto meta_it = root.find("__metadata__");
  if (meta_it == root.end() || !meta_it->is_object())
    fail(path, "no \"__metadata__\" in the header: not a normuon state file (missing format magic)");
  const json& meta = *meta_it;
  for (const auto& kv : meta.items())
    if (!kv.value().is_string()) fail(path, "metadata \"" + kv.key() + "\" is not a string");

  StateFileHeader h;
  h.file_size = raw.file_size;
  if (!meta.contains("format")) fail(path, "metadata has no \"format\" magic: not a normuon state file");
  h.format = meta["format"].get<std::string>();
  if (h.format != kStateFormat)
    fail(path, "format magic is \"" + h.format + "\", expected \"" + kStateFormat + "\": not a normuon state file");
  const std::string version = metadata_string(path, meta, "format_version");
  if (version.empty() || version.size() > 9 || version.find_first_not_of("0123456789") != std::string::npos)
    fail(path, "format_version \"" + version + "\" is not a version number");
  h.version = std::stoi(version);
  if (h.version < kStateFormatOldestVersion || h.version > kStateFormatVersion)
    fail(path, "unsupported format_version " + version + ": this build reads format_version " +
                   std::to_string(kStateFormatOldestVersion) + " to " + std::to_string(kStateFormatVersion));

  json unsigned_root = root;
  unsigned_root["__metadata__"].erase("header_crc32");
  const std::string stored_header_crc = metadata_string(path, meta, "header_crc32");
  const std::string actual_header_crc = crc_hex(header_crc(unsigned_root));
  if (stored_header_crc != actual_header_crc)
    fail(path, "header checksum mismatch (stored " + stored_header_crc + ", computed " + actual_header_crc +
                   "): the header was changed or damaged");

  for (const auto& kv : meta.items())
    if (!format_metadata_keys(h.version).count(kv.key())) h.extra_metadata[kv.key()] = kv.value().get<std::string>();
  h.backend = metadata_string(path, meta, "backend");
  h.layout_fingerprint = metadata_string(path, meta, "layout_fingerprint");
  h.created_utc = metadata_string(path, meta, "created_utc");
  try {
    h.options = Options::from_json(metadata_string(path, meta, "options"));
  } catch (const std::exception& e) {
    fail(path, std::string("metadata \"options\" is invalid: ") + e.what());
  }

  const json names = parse_embedded(path, "group_names", metadata_string(path, meta, "group_names"));
  const json steps = parse_embedded(path, "group_steps", metadata_string(path, meta, "group_steps"));
  if (!names.is_array()) fail(path, "metadata \"group_names\" is not a JSON array");
  if (!steps.is_array()) fail(path, "metadata \"group_steps\" is not a JSON array");
  for (const json& n : names) {
    if (!n.is_string()) fail(path, "metadata \"group_names\" holds " + n.dump() + ", not a name");
    h.group_names.push_back(n.get<std::string>());
  }
  for (const json& s : steps) {
    if (!s.is_number_unsigned() || s.get<uint64_t>() > uint64_t{INT64_MAX})
      fail(path, "metadata \"group_steps\" holds " + s.dump() + ", not a step count");
    h.group_steps.push_back(s.get<int64_t>());
  }
  if (h.group_names.size() != h.group_steps.size())
    fail(path, std::to_string(h.group_names.size()) + " group names but " + std::to_string(h.group_steps.size()) +
                   " group steps");
  if (h.version >= 2) {  // each parameter's own step count, by name
    const std::string steps_text = metadata_string(path, meta, "entry_steps");
    std::string twice;
    std::set<std::string> seen;
    const std::function<void(const std::string&)> on_key = [&](const std::string& key) {
      if (!seen.insert(key).second && twice.empty()) twice = key;
    };
    const char* begin = steps_text.data();
    const json entries = parse_file_json(path, "metadata \"entry_steps\"", begin, begin + steps_text.size(), on_key);
    if (!entries.is_object()) fail(path, "metadata \"entry_steps\" is not a JSON object");
    if (!twice.empty()) fail(path, "metadata \"entry_steps\" names '" + twice + "' twice");
    for (const auto& kv : entries.items()) {
      const json& n = kv.value();
      if (!n.is_number_unsigned() || n.get<uint64_t>() > uint64_t{INT64_MAX})
        fail(path, "metadata \"entry_steps\" holds " + n.dump() + " for '" + kv.key() + "', not a step count");
      h.entry_steps[kv.key()] = n.get<int64_t>();
    }
  }

  const json checksums = parse_embedded(path, "checksums", metadata_string(path, meta, "checksums"));
  if (!checksums.is_object()) fail(path, "metadata \"checksums\" is not a JSON object");
  for (const auto& kv : root.items()) {
    if (kv.key() == "__metadata__") continue;
    StateTensorInfo t;
    parse_tensor(path, kv.key(), kv.value(), t);
    const auto crc = checksums.find(kv.key());
    if (crc == checksums.end()) fail(path, "no checksum for tensor '" + kv.key() + "'");
    const std::string hex = crc->is_string() ? crc->get<std::string>() : "";
    if (hex.size() != 8 || hex.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos)
      fail(path, "checksum of tensor '" + kv.key() + "' is " + crc->dump() + ", not 8 hex digits");
    t.crc32 = static_cast<uint32_t>(std::stoul(hex, nullptr, 16));
    h.tensors.push_back(std::move(t));
  }
  for (const auto& kv : checksums.items())
    if (!root.contains(kv.key())) fail(path, "checksum for '" + kv.key() + "', which is not a tensor in the file");

  // File order; equal positions only happen for empty tensors, which keep their header order.
  std::stable_sort(h.tensors.begin(), h.tensors.end(), [](const StateTensorInfo& a, const StateTensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  check_tiling(path, h.tensors, raw.file_size - kLengthBytes - raw.header_size);
  return h;
}

void verify_checksums(const std::string& path, const StateFileHeader& h, const char* data) {
  for (const StateTensorInfo& t : h.tensors) {
    const uint32_t actual = crc_of(data + t.begin, t.end - t.begin);
    if (actual != t.crc32)
      fail(path, "checksum mismatch in tensor '" + t.name + "': stored crc32 " + crc_hex(t.crc32) + ", computed " +
                     crc_hex(actual) + " (the data is corrupted)");
  }
}

// What tells the file's tensors and groups apart from the layout's; empty when they agree.
std::string layout_differences(const std::vector<StateTensorRef>& expected,
                               const std::map<std::string, const StateTensorInfo*>& in_file,
                               const StateFileHeader& h, const Layout& layout) {
  std::vector<std::string> missing, unexpected, shapes;
  std::set<std::string> expected_names;
  for (const StateTensorRef& t : expected) {
    expected_names.insert(t.name);
    const auto it = in_file.find(t.name);
    if (it == in_file.end())
      missing.push_back(t.name);
    else if (it->second->shape != t.shape)
      shapes.push_back("'" + t.name + "' file " + shape_text(it->second->shape) + " vs layout " + shape_text(t.shape));
  }
  for (const StateTensorInfo& t : h.tensors)
    if (!expected_names.count(t.name)) unexpected.push_back(t.name);

  std::vector<std::string> parts;
  if (!missing.empty()) parts.push_back("missing tensors (in the layout, not in the file): " + list_text(missing));
  if (!unexpected.empty())
    parts.push_back("unexpected tensors (in the file, not in the layout): " + list_text(unexpected));
  if (!shapes.empty()) parts.push_back("shape mismatch: " + list_text(shapes));
  if (h.group_names != layout.group_names)
    parts.push_back("group names are [" + list_text(h.group_names) + "] in the file, [" +
                    list_text(layout.group_names) + "] in the layout");
  std::string out;
  for (const std::string& p : parts) out += (out.empty() ? "" : "; ") + p;
  return out;
}

// Every layout entry's own step count from a file whose names and groups match the layout: version 2's
// "entry_steps" (one per parameter, none for another name, none above its group's counter), version 1's
// group counters (what that version's bias corrections used).
std::vector<int64_t> load_entry_steps(const std::string& path, const StateFileHeader& h, const Layout& layout) {
  if (h.version < 2) return entry_steps_from_groups(layout, h.group_steps);
  std::vector<int64_t> out(layout.entries.size());
  std::vector<std::string> missing, unexpected;
  std::set<std::string> names;
  for (size_t e = 0; e < layout.entries.size(); ++e) {
    const std::string& name = layout.entries[e].name;
    names.insert(name);
    const auto it = h.entry_steps.find(name);
    if (it == h.entry_steps.end())
      missing.push_back(name);
    else
      out[e] = it->second;
  }
  for (const auto& kv : h.entry_steps)
    if (!names.count(kv.first)) unexpected.push_back(kv.first);
  if (!missing.empty()) fail(path, "metadata \"entry_steps\" has no step count for " + list_text(missing));
  if (!unexpected.empty())
    fail(path, "metadata \"entry_steps\" has step counts for " + list_text(unexpected) +
                   ", not parameters of the layout");
  const std::string reason = entry_steps_invalid_reason(layout, h.group_steps, out);
  if (!reason.empty()) fail(path, "metadata \"entry_steps\": " + reason);
  return out;
}

}  // namespace

void save_state(const std::string& path, const FlatState& state, const Options& options,
                const std::string& backend) {
  save_state_with_metadata(path, state, options, backend, {});
}

void save_state_with_metadata(const std::string& path, const FlatState& state, const Options& options,
                              const std::string& backend, const std::map<std::string, std::string>& extra) {
  if (state.group_steps.size() != state.layout->group_names.size())
    fail(path, "save failed: " + std::to_string(state.group_steps.size()) + " group steps for " +
                   std::to_string(state.layout->group_names.size()) + " groups");
  const std::string steps_reason = entry_steps_invalid_reason(*state.layout, state.group_steps, state.entry_steps);
  if (!steps_reason.empty()) fail(path, "save failed: the entry steps don't fit the group steps: " + steps_reason);
  // state_tensors() hands out writable pointers; saving only reads through them.
  const std::vector<StateTensorRef> tensors = file_tensors(const_cast<FlatState&>(state));
  write_atomically(path, header_text(path, tensors, state, options, backend, extra), tensors);
}

void check_state_save_path(const std::string& path) {
  const SaveTarget target = resolve_save_target(path);
  const std::string tmp = temp_name(target.file);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) fail(path, "cannot save here: cannot create '" + tmp + "': " + errno_text());
  ::close(fd);
  ::unlink(tmp.c_str());
}

StateFileContents read_state_file(const std::string& path) {
  RawFile raw = read_file(path, true);
  StateFileContents file;
  file.path = path;
  file.header = parse_header(path, raw);
  file.data_offset = kLengthBytes + raw.header_size;
  file.bytes = std::shared_ptr<const char[]>(std::move(raw.bytes));
  return file;
}

void load_state_file(const StateFileContents& file, FlatState& state, Options* options) {
  const std::string& path = file.path;
  const StateFileHeader& h = file.header;
  if (!file.bytes || file.data_offset > h.file_size) fail(path, "no file contents to load (use read_state_file)");
  const char* data = file.bytes.get() + file.data_offset;
  std::map<std::string, const StateTensorInfo*> in_file;
  for (const StateTensorInfo& t : h.tensors) in_file[t.name] = &t;

  const Layout& layout = *state.layout;
  const std::vector<StateTensorRef> expected = file_tensors(state);
  const std::string differences = layout_differences(expected, in_file, h, layout);
  if (h.layout_fingerprint != layout.fingerprint_hex())
    fail(path, "layout fingerprint mismatch: the file has " + h.layout_fingerprint + ", this layout " +
                   layout.fingerprint_hex() + "; " +
                   (differences.empty() ? "names, shapes and groups agree, so dtypes, algorithms, group "
                                          "assignments or placement differ"
                                        : differences));
  if (!differences.empty()) fail(path, "the file does not match the layout: " + differences);
  std::vector<int64_t> entry_steps = load_entry_steps(path, h, layout);
  verify_checksums(path, h, data);

  // Everything is verified; the copies below allocate first, then nothing can fail, so `state` is never
  // left half loaded.
  std::vector<int64_t> steps = h.group_steps;
  Options loaded_options = options ? h.options : Options();
  for (const StateTensorRef& t : expected) {
    const StateTensorInfo& info = *in_file.at(t.name);
    if (info.end > info.begin) std::memcpy(t.data, data + info.begin, info.end - info.begin);
  }
  state.group_steps = std::move(steps);
  state.entry_steps = std::move(entry_steps);
  if (options) *options = std::move(loaded_options);
}

void load_state(const std::string& path, FlatState& state, Options* options) {
  load_state_file(read_state_file(path), state, options);
}

StateFileHeader read_state_header(const std::string& path, bool verify) {
  const RawFile raw = read_file(path, verify);
  StateFileHeader h = parse_header(path, raw);
  if (verify) verify_checksums(path, h, raw.data());
  return h;
}

}  // namespace normuon
