// State files: exact round trip, safetensors compliance, rejection of every kind of damage without
// touching the target state, and atomic saves.
#define BOOST_TEST_MODULE state_file
#include <boost/test/unit_test.hpp>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "normuon/manifest.h"
#include "normuon/state_file.h"

using namespace normuon;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

ParamSpec spec(const std::string& name, std::vector<int64_t> shape, Role role) {
  ParamSpec p;
  p.name = name;
  p.shape = std::move(shape);
  p.role = role;
  return p;
}

// Two NorMuon buckets, a bias, an embedding, an empty parameter and a scalar.
Manifest test_manifest() {
  Manifest m;
  m.params = {spec("blocks.0.attn.w", {8, 12}, Role::matrix), spec("blocks.0.mlp.w", {12, 8}, Role::matrix),
              spec("blocks.1.attn.w", {8, 12}, Role::matrix), spec("blocks.0.attn.b", {12}, Role::bias),
              spec("embed", {10, 8}, Role::embedding),       spec("empty", {0}, Role::other),
              spec("scale", {}, Role::norm)};
  return m;
}

// A fresh directory under the system temporary directory, removed at the end of the test.
struct TempDir {
  fs::path path;
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "normuon_state_XXXXXX").string();
    BOOST_REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    path = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    fs::permissions(path, fs::perms::owner_all, fs::perm_options::add, ec);
    fs::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
  std::vector<std::string> listing() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(path)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }
};

float from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Distinct values in every slot of every tensor (padding stays zero), special values at the start.
void fill(FlatState& s, float seed) {
  int64_t k = 0;
  for (int e = 0; e < static_cast<int>(s.layout->entries.size()); ++e) {
    std::vector<std::pair<float*, int64_t>> tensors{{s.param(e), s.layout->entries[e].numel}};
    for (const StateTensorRef& t : state_tensors(s, e)) tensors.emplace_back(t.data, t.numel);
    for (const auto& [data, numel] : tensors)
      for (int64_t i = 0; i < numel; ++i) data[i] = seed + 0.25f * static_cast<float>(k++);
  }
  float* first = s.param(0);
  first[0] = -0.0f;
  first[1] = from_bits(0x7fc01234u);  // NaN with a payload
  first[2] = from_bits(0x00000001u);  // smallest denormal
  first[3] = std::numeric_limits<float>::infinity();
  for (size_t g = 0; g < s.group_steps.size(); ++g)
    s.group_steps[g] = static_cast<int64_t>(seed) + 7 * static_cast<int64_t>(g);
  // Each parameter's own count: its group's counter, or up to 2 below (not below 0).
  for (size_t e = 0; e < s.entry_steps.size(); ++e)
    s.entry_steps[e] = std::max<int64_t>(0, s.group_steps[static_cast<size_t>(s.layout->entries[e].group)] -
                                                static_cast<int64_t>(e % 3));
}

bool same_bits(const AlignedBuffer& a, const AlignedBuffer& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), static_cast<size_t>(a.size()) * sizeof(float)) == 0;
}

void require_identical(const FlatState& a, const FlatState& b) {
  BOOST_TEST(same_bits(a.params, b.params));
  BOOST_TEST(same_bits(a.grads, b.grads));
  BOOST_TEST(same_bits(a.momentum, b.momentum));
  BOOST_TEST(same_bits(a.row_var, b.row_var));
  BOOST_TEST(same_bits(a.exp_avg, b.exp_avg));
  BOOST_TEST(same_bits(a.exp_avg_sq, b.exp_avg_sq));
  BOOST_TEST(a.has_grad == b.has_grad);
  BOOST_TEST(a.group_steps == b.group_steps);
  BOOST_TEST(a.entry_steps == b.entry_steps);
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  BOOST_REQUIRE(out.good());
}

// An independent minimal safetensors reader: length, header JSON, data section.
struct Safetensors {
  uint64_t header_size = 0;
  std::string header_text;
  json header;
  std::string data;
};

Safetensors read_safetensors(const std::string& path) {
  const std::string bytes = read_bytes(path);
  BOOST_REQUIRE(bytes.size() >= 8);
  Safetensors st;
  for (size_t i = 8; i-- > 0;) st.header_size = st.header_size << 8 | static_cast<unsigned char>(bytes[i]);
  BOOST_REQUIRE(8 + st.header_size <= bytes.size());
  st.header_text = bytes.substr(8, st.header_size);
  st.header = json::parse(st.header_text);
  st.data = bytes.substr(8 + st.header_size);
  return st;
}

void write_safetensors(const std::string& path, const std::string& header_text, const std::string& data) {
  std::string header = header_text;
  header.append((8 - (8 + header.size()) % 8) % 8, ' ');
  std::string bytes(8, '\0');
  for (size_t i = 0; i < 8; ++i) bytes[i] = static_cast<char>(static_cast<uint64_t>(header.size()) >> (8 * i));
  write_bytes(path, bytes + header + data);
}

uint32_t crc32_ieee(const char* data, size_t size);

// Hand-edits the header (offsets stay as the edit leaves them), keeping the data section. The header
// checksum is recomputed like a writer would, so the edit reaches the check it is aimed at; `sign=false`
// leaves the stale checksum in place.
void edit_header(const std::string& path, const std::function<void(json&)>& edit, bool sign = true) {
  Safetensors st = read_safetensors(path);
  edit(st.header);
  if (sign && st.header.contains("__metadata__") && st.header["__metadata__"].is_object()) {
    st.header["__metadata__"].erase("header_crc32");
    const std::string text = st.header.dump();
    char hex[9];
    std::snprintf(hex, sizeof hex, "%08x", crc32_ieee(text.data(), text.size()));
    st.header["__metadata__"]["header_crc32"] = hex;
  }
  write_safetensors(path, st.header.dump(), st.data);
}

json metadata_json(const json& header, const std::string& key) {
  return json::parse(header["__metadata__"][key].get<std::string>());
}

// Plain bitwise CRC-32 (IEEE 802.3, the one zlib computes), independent of the library.
uint32_t crc32_ieee(const char* data, size_t size) {
  uint32_t crc = 0xffffffffu;
  for (size_t i = 0; i < size; ++i) {
    crc ^= static_cast<unsigned char>(data[i]);
    for (int b = 0; b < 8; ++b) crc = (crc >> 1) ^ (0xedb88320u & (0u - (crc & 1u)));
  }
  return ~crc;
}

// Names in file order: each layout entry's parameter, then its state tensors.
std::vector<std::string> expected_names(FlatState& s) {
  std::vector<std::string> names;
  for (int e = 0; e < static_cast<int>(s.layout->entries.size()); ++e) {
    names.push_back(s.layout->entries[e].name);
    for (const StateTensorRef& t : state_tensors(s, e)) names.push_back(t.name);
  }
  return names;
}

bool contains(const std::string& text, const std::string& word) { return text.find(word) != std::string::npos; }

// Loading `path` into `target` must throw a StateFileError naming the path and every word, and leave
// `target` exactly as it was.
void expect_rejected(const std::string& path, FlatState& target, const std::vector<std::string>& words) {
  const FlatState before = target;
  Options options;
  options.set("normuon.lr=0.5");
  const std::string options_before = options.to_json();
  try {
    load_state(path, target, &options);
    BOOST_ERROR("load_state accepted " << path);
  } catch (const StateFileError& e) {
    const std::string message = e.what();
    BOOST_TEST_MESSAGE("rejected: " << message);
    BOOST_TEST(contains(message, path), "message lacks the path: " << message);
    for (const std::string& w : words) BOOST_TEST(contains(message, w), "message lacks '" << w << "': " << message);
  }
  require_identical(target, before);
  BOOST_TEST(options.to_json() == options_before);
}

// A saved file and a target pre-filled with other values, for the corruption tests.
struct Saved {
  TempDir dir;
  Options options;
  Layout layout = Layout::build(test_manifest(), options);
  FlatState source{layout}, target{layout};
  std::string path = dir.file("state.safetensors");
  Saved() {
    fill(source, 1.0f);
    fill(target, 1000.0f);
    save_state(path, source, options, "test-backend");
  }
  // The byte range of tensor `name` in the whole file.
  std::pair<uint64_t, uint64_t> file_range(const std::string& name) const {
    const Safetensors st = read_safetensors(path);
    const json& offsets = st.header.at(name).at("data_offsets");
    return {8 + st.header_size + offsets[0].get<uint64_t>(), 8 + st.header_size + offsets[1].get<uint64_t>()};
  }
};

}  // namespace

BOOST_AUTO_TEST_CASE(round_trip_is_bitwise_exact) {
  Saved s;
  FlatState loaded(s.layout);
  load_state(s.path, loaded, nullptr);
  require_identical(loaded, s.source);
  BOOST_TEST(loaded.group_steps == (std::vector<int64_t>{1, 8}));
  // blocks.0.attn.w, blocks.0.mlp.w, blocks.1.attn.w (normuon at 1), blocks.0.attn.b, embed, empty, scale
  BOOST_TEST(loaded.entry_steps == (std::vector<int64_t>{1, 0, 0, 8, 7, 6, 8}));
  BOOST_TEST(s.dir.listing() == std::vector<std::string>{"state.safetensors"});  // no temporary file left
}

BOOST_AUTO_TEST_CASE(gradients_and_flags_are_not_part_of_the_file) {
  Saved s;
  for (int64_t i = 0; i < s.target.grads.size(); ++i) s.target.grads[i] = static_cast<float>(i);
  s.target.has_grad.assign(s.target.has_grad.size(), 0);
  const FlatState before = s.target;
  load_state(s.path, s.target);
  BOOST_TEST(same_bits(s.target.grads, before.grads));
  BOOST_TEST(s.target.has_grad == before.has_grad);
  BOOST_TEST(same_bits(s.target.params, s.source.params));
}

BOOST_AUTO_TEST_CASE(options_round_trip) {
  TempDir dir;
  Options options;
  options.set("normuon.lr=0.0123");
  options.set("adamw.beta2=0.999");
  options.set("nonfinite=skip_step");
  options.set("normuon.ns_algorithm=gram");
  const Layout layout = Layout::build(test_manifest(), options);
  FlatState state(layout);
  fill(state, 3.0f);
  save_state(dir.file("s"), state, options, "test-backend");
  Options loaded;
  FlatState target(layout);
  load_state(dir.file("s"), target, &loaded);
  BOOST_TEST(loaded.to_json() == options.to_json());
  BOOST_TEST((loaded.group("normuon").normuon.ns_algorithm == NsAlgorithm::gram));
  BOOST_TEST(read_state_header(dir.file("s")).options.to_json() == options.to_json());
}

BOOST_AUTO_TEST_CASE(header_describes_the_file) {
  Saved s;
  const StateFileHeader h = read_state_header(s.path);
  BOOST_TEST(h.format == kStateFormat);
  BOOST_TEST(h.version == 2);  // the lowest version that holds it: no group uses Gram Newton-Schulz
  BOOST_TEST(h.backend == "test-backend");
  BOOST_TEST(h.layout_fingerprint == s.layout.fingerprint_hex());
  BOOST_TEST(h.created_utc.size() == 20u);  // 2026-01-02T03:04:05Z
  BOOST_TEST(h.created_utc.back() == 'Z');
  BOOST_TEST(h.group_names == s.layout.group_names);
  BOOST_TEST(h.group_steps == s.source.group_steps);
  BOOST_REQUIRE(h.entry_steps.size() == s.layout.entries.size());
  for (size_t e = 0; e < s.layout.entries.size(); ++e)
    BOOST_TEST(h.entry_steps.at(s.layout.entries[e].name) == s.source.entry_steps[e], s.layout.entries[e].name);
  BOOST_TEST(h.options.to_json() == s.options.to_json());
  BOOST_TEST(h.file_size == fs::file_size(s.path));

  const std::vector<std::string> names = expected_names(s.source);
  BOOST_REQUIRE(h.tensors.size() == names.size());
  const std::string bytes = read_bytes(s.path);
  const uint64_t data_start = 8 + read_safetensors(s.path).header_size;
  for (size_t i = 0; i < names.size(); ++i) {
    const StateTensorInfo& t = h.tensors[i];
    BOOST_TEST(t.name == names[i]);
    BOOST_TEST(t.dtype == "F32");
    BOOST_TEST(t.crc32 == crc32_ieee(bytes.data() + data_start + t.begin, t.end - t.begin), t.name);
  }
  // The naming convention, spelled out.
  for (const char* name : {"blocks.0.attn.w", "blocks.0.attn.w.momentum", "blocks.0.attn.w.row_var", "embed",
                           "embed.exp_avg", "embed.exp_avg_sq", "empty.exp_avg", "scale.exp_avg_sq"})
    BOOST_TEST((std::find(names.begin(), names.end(), name) != names.end()), name);
}

BOOST_AUTO_TEST_CASE(file_is_plain_safetensors) {
  Saved s;
  const Safetensors st = read_safetensors(s.path);
  BOOST_TEST((8 + st.header_size) % 8 == 0u);  // data section 8-byte aligned
  BOOST_TEST(st.header_text.front() == '{');
  BOOST_TEST(st.header.is_object());

  const json& meta = st.header.at("__metadata__");
  for (const auto& kv : meta.items()) BOOST_TEST(kv.value().is_string(), kv.key());  // string -> string
  for (const char* key : {"format", "format_version", "backend", "layout_fingerprint", "created_utc", "options",
                          "group_names", "group_steps", "entry_steps", "checksums"})
    BOOST_TEST(meta.contains(key), key);
  BOOST_TEST(meta["format"] == "normuon-state");
  BOOST_TEST(meta["format_version"] == "2");
  BOOST_TEST(metadata_json(st.header, "group_names") == json(s.layout.group_names));
  BOOST_TEST(metadata_json(st.header, "group_steps") == json(s.source.group_steps));
  json entry_steps = json::object();  // parameter name -> its own step count
  for (size_t e = 0; e < s.layout.entries.size(); ++e) entry_steps[s.layout.entries[e].name] = s.source.entry_steps[e];
  BOOST_TEST(metadata_json(st.header, "entry_steps") == entry_steps);
  const json checksums = metadata_json(st.header, "checksums");

  // Every tensor F32, data_offsets tiling the data section in file order, bytes equal to the state.
  std::vector<StateTensorRef> refs;
  for (int e = 0; e < static_cast<int>(s.layout.entries.size()); ++e) {
    refs.push_back({s.layout.entries[e].name, s.layout.entries[e].shape, s.source.param(e), s.layout.entries[e].numel});
    for (StateTensorRef& t : state_tensors(s.source, e)) refs.push_back(t);
  }
  BOOST_TEST(st.header.size() == refs.size() + 1);
  uint64_t offset = 0;
  for (const StateTensorRef& t : refs) {
    const json& entry = st.header.at(t.name);
    BOOST_TEST(entry["dtype"] == "F32");
    BOOST_TEST(entry["shape"] == json(t.shape), t.name);
    const uint64_t begin = entry["data_offsets"][0], end = entry["data_offsets"][1];
    BOOST_TEST(begin == offset, t.name);
    BOOST_TEST(end - begin == static_cast<uint64_t>(t.numel) * 4u, t.name);
    BOOST_TEST(std::memcmp(st.data.data() + begin, t.data, end - begin) == 0, t.name);
    char crc[9];
    std::snprintf(crc, sizeof crc, "%08x", crc32_ieee(st.data.data() + begin, end - begin));
    BOOST_TEST(checksums.at(t.name) == crc, t.name);
    offset = end;
  }
  BOOST_TEST(offset == st.data.size());
}

BOOST_AUTO_TEST_CASE(python_reads_it_with_json_and_struct) {
  if (!fs::exists("/usr/bin/python3")) {
    BOOST_TEST_MESSAGE("no /usr/bin/python3: skipped");
    return;
  }
  Saved s;
  const std::string script = s.dir.file("read.py"), output = s.dir.file("out.txt");
  std::ofstream(script) << R"(import json, struct, sys, zlib
raw = open(sys.argv[1], 'rb').read()
n, = struct.unpack('<Q', raw[:8])
header = json.loads(raw[8:8 + n])
stored = header['__metadata__'].pop('header_crc32')
canonical = json.dumps(header, sort_keys=True, separators=(',', ':'), ensure_ascii=False).encode()
assert '%08x' % zlib.crc32(canonical) == stored, 'header_crc32'
meta = header.pop('__metadata__')
assert meta['format'] == 'normuon-state' and meta['format_version'] == '2'
data, end = raw[8 + n:], 0
for name, t in sorted(header.items(), key=lambda kv: kv[1]['data_offsets']):
    begin, stop = t['data_offsets']
    count = 1
    for d in t['shape']:
        count *= d
    assert t['dtype'] == 'F32' and begin == end and stop - begin == 4 * count, name
    struct.unpack('<%df' % count, data[begin:stop])
    end = stop
assert end == len(data)
begin = header['embed']['data_offsets'][0]
print(len(header), json.loads(meta['group_steps']), json.loads(meta['entry_steps'])['embed'],
      struct.unpack('<I', data[begin:begin + 4])[0])
)";
  const std::string command = "/usr/bin/python3 '" + script + "' '" + s.path + "' > '" + output + "' 2>&1";
  const int rc = std::system(command.c_str());
  const std::string printed = read_bytes(output);
  BOOST_TEST(rc == 0, printed);
  std::ostringstream expected;
  uint32_t embed_bits;
  std::memcpy(&embed_bits, s.source.param(s.layout.find("embed")), sizeof embed_bits);
  expected << expected_names(s.source).size() << " [1, 8] 7 " << embed_bits << "\n";
  BOOST_TEST(printed == expected.str());
}

BOOST_AUTO_TEST_CASE(truncated_files_are_rejected) {
  Saved s;
  const std::string bytes = read_bytes(s.path);
  const uint64_t header_end = 8 + read_safetensors(s.path).header_size;
  const std::vector<uint64_t> cuts{0,  3, 7, 8, 9, header_end / 2, header_end - 1, header_end, header_end + 1,
                                   (header_end + bytes.size()) / 2, bytes.size() - 1};
  for (const uint64_t cut : cuts) {
    BOOST_TEST_CONTEXT("cut at " << cut << " of " << bytes.size()) {
      const std::string path = s.dir.file("cut" + std::to_string(cut));
      write_bytes(path, bytes.substr(0, cut));
      expect_rejected(path, s.target, {"truncated"});
    }
  }
}

BOOST_AUTO_TEST_CASE(trailing_bytes_are_rejected) {
  Saved s;
  write_bytes(s.path, read_bytes(s.path) + "junk");
  expect_rejected(s.path, s.target, {"trailing"});
}

BOOST_AUTO_TEST_CASE(flipped_data_byte_fails_its_checksum) {
  Saved s;
  const std::string clean = read_bytes(s.path);
  for (const char* name : {"blocks.0.attn.w", "blocks.0.mlp.w.momentum", "blocks.1.attn.w.row_var", "embed.exp_avg_sq",
                           "scale"}) {
    BOOST_TEST_CONTEXT(name) {
      const auto [begin, end] = s.file_range(name);
      std::string bytes = clean;
      bytes[(begin + end) / 2] = static_cast<char>(bytes[(begin + end) / 2] ^ 0x10);
      write_bytes(s.path, bytes);
      expect_rejected(s.path, s.target, {"checksum", std::string("'") + name + "'"});
      BOOST_CHECK_THROW(read_state_header(s.path, true), StateFileError);
      BOOST_TEST(read_state_header(s.path, false).tensors.size() == expected_names(s.source).size());
    }
  }
}

BOOST_AUTO_TEST_CASE(edited_metadata_fails_the_header_checksum) {
  Saved s;
  edit_header(s.path, [](json& h) { h["__metadata__"]["group_steps"] = "[7,7]"; }, /*sign=*/false);
  expect_rejected(s.path, s.target, {"header checksum mismatch"});
  edit_header(s.path, [](json& h) { h["__metadata__"].erase("header_crc32"); }, /*sign=*/false);
  expect_rejected(s.path, s.target, {"header_crc32"});
}

BOOST_AUTO_TEST_CASE(flipped_header_byte_is_rejected) {
  Saved s;
  const std::string clean = read_bytes(s.path);
  std::string bytes = clean;
  bytes[8] = 'z';  // was '{'
  write_bytes(s.path, bytes);
  expect_rejected(s.path, s.target, {"header"});

  bytes = clean;
  bytes[clean.find("\":", 8) + 1] = ';';  // was the first ':' of the JSON
  write_bytes(s.path, bytes);
  expect_rejected(s.path, s.target, {"JSON"});
}

// CRC-32 catches every single-bit error, so no flipped bit anywhere in the data can load.
BOOST_AUTO_TEST_CASE(every_data_bit_flip_is_caught) {
  Saved s;
  const std::string clean = read_bytes(s.path);
  const size_t data_start = 8 + read_safetensors(s.path).header_size;
  for (size_t i = data_start; i < clean.size(); ++i) {
    std::string bytes = clean;
    bytes[i] = static_cast<char>(bytes[i] ^ (1 << (i % 8)));
    write_bytes(s.path, bytes);
    BOOST_CHECK_THROW(load_state(s.path, s.target), StateFileError);
  }
  FlatState fresh(s.layout);
  fill(fresh, 1000.0f);
  require_identical(s.target, fresh);
}

// Every damaged header byte is rejected with a StateFileError (never another exception): the header
// checksum covers the metadata free text (backend, options, steps) that the tensor checksums can't.
BOOST_AUTO_TEST_CASE(every_header_byte_flip_is_rejected) {
  Saved s;
  const std::string clean = read_bytes(s.path);
  const size_t header_end = 8 + read_safetensors(s.path).header_size;
  int accepted = 0;
  for (size_t i = 0; i < header_end; ++i) {
    std::string bytes = clean;
    bytes[i] = static_cast<char>(bytes[i] ^ 0x01);
    write_bytes(s.path, bytes);
    FlatState target(s.layout);
    try {
      load_state(s.path, target);
    } catch (const StateFileError&) {
      continue;
    } catch (const std::exception& e) {
      BOOST_ERROR("byte " << i << ": not a StateFileError: " << e.what());
      continue;
    }
    ++accepted;
    BOOST_TEST(same_bits(target.params, s.source.params), "byte " << i);
    BOOST_TEST(same_bits(target.momentum, s.source.momentum), "byte " << i);
    BOOST_TEST(same_bits(target.row_var, s.source.row_var), "byte " << i);
    BOOST_TEST(same_bits(target.exp_avg, s.source.exp_avg), "byte " << i);
    BOOST_TEST(same_bits(target.exp_avg_sq, s.source.exp_avg_sq), "byte " << i);
  }
  BOOST_TEST(accepted == 0, accepted << " of " << header_end << " single-byte header changes loaded");
}

BOOST_AUTO_TEST_CASE(wrong_magic_is_rejected) {
  Saved s;
  edit_header(s.path, [](json& h) { h["__metadata__"]["format"] = "something-else"; });
  expect_rejected(s.path, s.target, {"format", "something-else", "normuon-state"});
  edit_header(s.path, [](json& h) { h.erase("__metadata__"); });
  expect_rejected(s.path, s.target, {"__metadata__", "not a normuon state file"});
}

BOOST_AUTO_TEST_CASE(unsupported_version_is_rejected) {
  Saved s;
  const std::string clean = read_bytes(s.path);
  edit_header(s.path, [](json& h) { h["__metadata__"]["format_version"] = "4"; });
  expect_rejected(s.path, s.target, {"unsupported format_version 4", "reads format_version 1 to 3"});
  write_bytes(s.path, clean);
  edit_header(s.path, [](json& h) { h["__metadata__"]["format_version"] = "0"; });
  expect_rejected(s.path, s.target, {"unsupported format_version 0"});
}

// Version 3 marks a file whose options a version-2 build would misread: with Gram Newton-Schulz (a key that
// build ignores) it would resume on the standard loop without a word. Such a build refuses version 3; files
// without the knob stay version 2, and both load here.
BOOST_AUTO_TEST_CASE(gram_runs_are_saved_as_version_3_and_others_as_version_2) {
  Saved s;
  BOOST_TEST(state_format_version_for(s.options) == 2);
  BOOST_TEST(read_state_header(s.path).version == 2);
  Options gram = s.options;
  gram.set("normuon.ns_algorithm=gram");
  BOOST_TEST(state_format_version_for(gram) == 3);
  save_state(s.path, s.source, gram, "test-backend");
  const StateFileHeader h = read_state_header(s.path);
  BOOST_TEST(h.version == 3);
  BOOST_TEST(h.options.to_json() == gram.to_json());
  FlatState loaded(s.layout);
  Options read_back;
  load_state(s.path, loaded, &read_back);
  require_identical(loaded, s.source);
  BOOST_TEST((read_back.group("normuon").normuon.ns_algorithm == NsAlgorithm::gram));
}

// A version-1 file as that version's writer made it: version 2 without "entry_steps", format_version 1.
void make_version_1(const std::string& path) {
  edit_header(path, [](json& h) {
    h["__metadata__"]["format_version"] = "1";
    h["__metadata__"].erase("entry_steps");
  });
}

// Version 1 kept one counter per group, which drove every parameter's bias corrections: its files load
// with every parameter at its group's counter, so an old run resumes as it would have.
BOOST_AUTO_TEST_CASE(version_1_files_load_with_every_parameter_at_its_groups_counter) {
  Saved s;
  make_version_1(s.path);
  const StateFileHeader h = read_state_header(s.path);
  BOOST_TEST(h.version == 1);
  BOOST_TEST(h.entry_steps.empty());
  FlatState loaded(s.layout);
  load_state(s.path, loaded);
  BOOST_TEST(same_bits(loaded.params, s.source.params));
  BOOST_TEST(same_bits(loaded.exp_avg_sq, s.source.exp_avg_sq));
  BOOST_TEST(loaded.group_steps == s.source.group_steps);
  BOOST_TEST(loaded.entry_steps == entry_steps_from_groups(s.layout, s.source.group_steps));
  BOOST_TEST(loaded.entry_steps == (std::vector<int64_t>{1, 1, 1, 8, 8, 8, 8}));
  // Saved again, it is a version-2 file with those counts.
  save_state(s.path, loaded, s.options, "test-backend");
  BOOST_TEST(read_state_header(s.path).version == 2);
  FlatState again(s.layout);
  load_state(s.path, again);
  require_identical(again, loaded);

  // In version 1 "entry_steps" was no key of the format: a caller's own, kept and not read.
  save_state(s.path, s.source, s.options, "test-backend");
  make_version_1(s.path);
  edit_header(s.path, [](json& header) { header["__metadata__"]["entry_steps"] = "not the format's"; });
  BOOST_TEST(read_state_header(s.path).extra_metadata.at("entry_steps") == "not the format's");
  load_state(s.path, loaded);
  BOOST_TEST(loaded.entry_steps == entry_steps_from_groups(s.layout, s.source.group_steps));
}

// Files the version-1 code wrote (tests/data/state-v1/README.md): they load, each parameter at its group's
// counter, and read back through the new writer unchanged but for the counts.
BOOST_AUTO_TEST_CASE(files_written_by_the_version_1_code_load) {
  const std::string dir = std::string(NORMUON_SOURCE_DIR) + "/tests/data/state-v1/";
  const Layout layout = Layout::build(Manifest::read_csv_file(dir + "small.csv"), Options());
  const struct {
    int step;
    std::vector<int64_t> groups;
  } files[] = {{4, {3, 4}}, {6, {4, 6}}, {7, {5, 7}}};
  for (const auto& f : files) {
    const std::string path = dir + "small-v1-step" + std::to_string(f.step) + ".safetensors";
    BOOST_TEST_CONTEXT(path) {
      const StateFileHeader h = read_state_header(path);
      BOOST_TEST(h.version == 1);
      // Written before ns_algorithm existed: no such key, read as the standard iteration they ran.
      std::ifstream file(path, std::ios::binary);
      const std::string bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
      BOOST_TEST(bytes.find("ns_algorithm") == std::string::npos);
      BOOST_TEST((h.options.group("normuon").normuon.ns_algorithm == NsAlgorithm::standard));
      BOOST_TEST(h.extra_metadata.at("run_step") == std::to_string(f.step));
      FlatState state(layout);
      load_state(path, state);
      BOOST_TEST(state.group_steps == f.groups);
      // wte.weight, h.0.ln.weight and lm_head.weight are AdamW, h.0.attn.weight NorMuon.
      BOOST_TEST(state.entry_steps == (std::vector<int64_t>{f.groups[1], f.groups[0], f.groups[1], f.groups[1]}));
      TempDir out;
      save_state(out.file("v2"), state, Options(), "test-backend");
      FlatState again(layout);
      load_state(out.file("v2"), again);
      require_identical(again, state);
      const StateFileHeader h2 = read_state_header(out.file("v2"));
      for (size_t t = 0; t < h.tensors.size(); ++t) BOOST_TEST(h2.tensors[t].crc32 == h.tensors[t].crc32);
    }
  }
}

BOOST_AUTO_TEST_CASE(bad_entry_steps_are_rejected) {
  Saved s;
  const std::string clean = read_bytes(s.path);
  const auto edit_steps = [&](const std::function<void(json&)>& edit) {
    write_bytes(s.path, clean);
    edit_header(s.path, [&](json& h) {
      json steps = json::parse(h["__metadata__"]["entry_steps"].get<std::string>());
      edit(steps);
      h["__metadata__"]["entry_steps"] = steps.dump();
    });
  };
  write_bytes(s.path, clean);
  edit_header(s.path, [](json& h) { h["__metadata__"].erase("entry_steps"); });
  expect_rejected(s.path, s.target, {"metadata has no \"entry_steps\""});
  edit_steps([](json& j) { j = json::array({1, 2}); });
  expect_rejected(s.path, s.target, {"\"entry_steps\" is not a JSON object"});
  edit_steps([](json& j) { j["embed"] = -1; });
  expect_rejected(s.path, s.target, {"holds -1 for 'embed', not a step count"});
  edit_steps([](json& j) { j["embed"] = "7"; });
  expect_rejected(s.path, s.target, {"for 'embed', not a step count"});
  edit_steps([](json& j) { j["embed"] = 2.5; });
  expect_rejected(s.path, s.target, {"for 'embed', not a step count"});
  edit_steps([](json& j) { j.erase("embed"); });
  expect_rejected(s.path, s.target, {"no step count for embed"});
  edit_steps([](json& j) {
    j["embedding"] = j["embed"];
    j.erase("embed");
  });
  expect_rejected(s.path, s.target, {"no step count for embed"});
  edit_steps([](json& j) { j["embed.exp_avg"] = 1; });
  expect_rejected(s.path, s.target, {"step counts for embed.exp_avg, not parameters of the layout"});
  // Above its group's counter (8 for the AdamW group): no parameter has had more steps than its group.
  edit_steps([](json& j) { j["embed"] = 9; });
  expect_rejected(s.path, s.target, {"'embed' has step count 9, outside [0, 8]", "'adamw' is at step 8"});
  // A name twice, which a JSON parser would silently merge.
  write_bytes(s.path, clean);
  edit_header(s.path, [](json& h) {
    std::string text = h["__metadata__"]["entry_steps"].get<std::string>();
    text.insert(1, "\"scale\":0,");
    h["__metadata__"]["entry_steps"] = text;
  });
  expect_rejected(s.path, s.target, {"names 'scale' twice"});
}

BOOST_AUTO_TEST_CASE(save_refuses_entry_steps_that_do_not_fit_the_groups) {
  TempDir dir;
  const Options options;
  const Layout layout = Layout::build(test_manifest(), options);
  FlatState state(layout);
  fill(state, 1.0f);
  state.entry_steps[static_cast<size_t>(layout.find("embed"))] = 9;  // its group is at 8
  BOOST_CHECK_THROW(save_state(dir.file("s"), state, options, "test-backend"), StateFileError);
  state.entry_steps[static_cast<size_t>(layout.find("embed"))] = -1;
  BOOST_CHECK_THROW(save_state(dir.file("s"), state, options, "test-backend"), StateFileError);
  state.entry_steps.pop_back();
  try {
    save_state(dir.file("s"), state, options, "test-backend");
    BOOST_ERROR("saved entry steps of the wrong length");
  } catch (const StateFileError& e) {
    BOOST_TEST(contains(e.what(), "6 entry steps for 7 parameters"), e.what());
  }
  BOOST_TEST(dir.listing().empty());  // nothing written
}

BOOST_AUTO_TEST_CASE(other_layout_is_rejected_with_a_hint) {
  Saved s;
  Manifest reshaped = test_manifest();
  reshaped.params[1].shape = {12, 16};
  const Layout other = Layout::build(reshaped, s.options);
  FlatState target(other);
  fill(target, 5.0f);
  expect_rejected(s.path, target, {"fingerprint", s.layout.fingerprint_hex(), other.fingerprint_hex(),
                                   "'blocks.0.mlp.w' file [12,8] vs layout [12,16]"});

  Manifest extended = test_manifest();
  extended.params.push_back(spec("extra", {4}, Role::bias));
  const Layout bigger = Layout::build(extended, s.options);
  FlatState bigger_target(bigger);
  expect_rejected(s.path, bigger_target, {"fingerprint", "missing tensors", "extra.exp_avg"});
}

BOOST_AUTO_TEST_CASE(shape_mismatch_is_rejected) {
  Saved s;  // same byte count, so offsets and checksums still hold; only the shape is wrong
  edit_header(s.path, [](json& h) { h["blocks.0.attn.w"]["shape"] = {12, 8}; });
  expect_rejected(s.path, s.target, {"shape mismatch", "'blocks.0.attn.w' file [12,8] vs layout [8,12]"});
}

BOOST_AUTO_TEST_CASE(renamed_tensor_is_rejected) {
  Saved s;
  edit_header(s.path, [](json& h) {
    h["embedding"] = h["embed"];
    h.erase("embed");
    json checksums = json::parse(h["__metadata__"]["checksums"].get<std::string>());
    checksums["embedding"] = checksums["embed"];
    checksums.erase("embed");
    h["__metadata__"]["checksums"] = checksums.dump();
  });
  expect_rejected(s.path, s.target, {"missing tensors", "embed", "unexpected tensors", "embedding"});
}

BOOST_AUTO_TEST_CASE(wrong_dtype_is_rejected) {
  Saved s;
  edit_header(s.path, [](json& h) { h["embed.exp_avg"]["dtype"] = "F16"; });
  expect_rejected(s.path, s.target, {"'embed.exp_avg'", "dtype F16"});
}

BOOST_AUTO_TEST_CASE(bad_offsets_are_rejected) {
  Saved s;
  const std::string clean = read_bytes(s.path);
  const auto shift = [](json& t, int64_t by) {
    for (json& o : t["data_offsets"]) o = o.get<int64_t>() + by;
  };
  edit_header(s.path, [&](json& h) { shift(h["embed"], 4); });
  expect_rejected(s.path, s.target, {"gap"});

  write_bytes(s.path, clean);
  edit_header(s.path, [&](json& h) { shift(h["embed"], -4); });
  expect_rejected(s.path, s.target, {"'embed'", "overlaps"});

  write_bytes(s.path, clean);
  edit_header(s.path, [](json& h) {
    json& end = h["embed"]["data_offsets"][1];
    end = end.get<int64_t>() - 4;
  });
  expect_rejected(s.path, s.target, {"'embed'", "data_offsets"});

  write_bytes(s.path, clean);
  edit_header(s.path, [](json& h) { h["scale.exp_avg_sq"]["data_offsets"] = {1u << 30, (1u << 30) + 4}; });
  expect_rejected(s.path, s.target, {"'scale.exp_avg_sq'", "past the end"});
}

BOOST_AUTO_TEST_CASE(duplicate_tensor_name_is_rejected) {
  Saved s;
  const Safetensors st = read_safetensors(s.path);
  const std::string entry = "\"scale\":" + st.header["scale"].dump();
  std::string text = st.header.dump();
  text.insert(text.find("\"scale\":"), entry + ",");
  write_safetensors(s.path, text, st.data);
  expect_rejected(s.path, s.target, {"'scale' twice"});
}

BOOST_AUTO_TEST_CASE(inconsistent_metadata_is_rejected) {
  Saved s;
  const std::string clean = read_bytes(s.path);
  edit_header(s.path, [](json& h) { h["__metadata__"]["group_steps"] = "[1]"; });
  expect_rejected(s.path, s.target, {"2 group names but 1 group steps"});

  write_bytes(s.path, clean);
  edit_header(s.path, [](json& h) { h["__metadata__"]["backend"] = 3; });
  expect_rejected(s.path, s.target, {"\"backend\" is not a string"});

  write_bytes(s.path, clean);
  edit_header(s.path, [](json& h) { h["__metadata__"].erase("checksums"); });
  expect_rejected(s.path, s.target, {"\"checksums\""});

  write_bytes(s.path, clean);
  edit_header(s.path, [](json& h) { h["__metadata__"]["options"] = "{\"no such option\": 1}"; });
  expect_rejected(s.path, s.target, {"\"options\" is invalid"});
}

BOOST_AUTO_TEST_CASE(other_groups_are_rejected) {
  Saved s;
  Options more = s.options;
  GroupOptions extra;
  extra.name = "extra";
  extra.algorithm = Algorithm::adamw;
  more.groups.push_back(extra);
  const Layout layout = Layout::build(test_manifest(), more);
  FlatState target(layout);
  expect_rejected(s.path, target, {"group names are [normuon, adamw] in the file, [normuon, adamw, extra]"});
}

BOOST_AUTO_TEST_CASE(missing_file_is_reported) {
  TempDir dir;
  Options options;
  const Layout layout = Layout::build(test_manifest(), options);
  FlatState target(layout);
  expect_rejected(dir.file("nope"), target, {"cannot open", "No such file"});
  BOOST_CHECK_THROW(read_state_header(dir.file("nope")), StateFileError);
}

BOOST_AUTO_TEST_CASE(save_replaces_the_old_file) {
  Saved s;
  FlatState second(s.layout);
  fill(second, 2.0f);
  save_state(s.path, second, s.options, "test-backend");
  BOOST_TEST(s.dir.listing() == std::vector<std::string>{"state.safetensors"});
  FlatState loaded(s.layout);
  load_state(s.path, loaded);
  require_identical(loaded, second);
}

BOOST_AUTO_TEST_CASE(failed_save_leaves_nothing_behind) {
  Saved s;
  const std::string before = read_bytes(s.path);

  // Directory that doesn't exist: no temporary file can be created.
  const std::string nowhere = s.dir.file("no-such-dir/state.safetensors");
  try {
    save_state(nowhere, s.source, s.options, "test-backend");
    BOOST_ERROR("saved into a missing directory");
  } catch (const StateFileError& e) {
    BOOST_TEST(contains(e.what(), nowhere));
    BOOST_TEST(contains(e.what(), "No such file or directory"));
  }
  BOOST_TEST(s.dir.listing() == std::vector<std::string>{"state.safetensors"});

  // Target is a directory: the temporary file is written in full, the rename fails and it is removed.
  fs::create_directory(s.dir.file("occupied"));
  BOOST_CHECK_THROW(save_state(s.dir.file("occupied"), s.source, s.options, "test-backend"), StateFileError);
  BOOST_TEST(s.dir.listing() == (std::vector<std::string>{"occupied", "state.safetensors"}));
  BOOST_TEST(fs::is_empty(s.dir.file("occupied")));
  BOOST_TEST(read_bytes(s.path) == before);
}

BOOST_AUTO_TEST_CASE(read_only_directory_keeps_the_old_file) {
  Saved s;
  const std::string before = read_bytes(s.path);
  fs::permissions(s.dir.path, fs::perms::owner_read | fs::perms::owner_exec);
  // Root (or CAP_DAC_OVERRIDE) writes regardless of permissions: find out rather than assume.
  const std::string probe = s.dir.file("probe");
  if (std::FILE* f = std::fopen(probe.c_str(), "w")) {
    std::fclose(f);
    std::remove(probe.c_str());
    fs::permissions(s.dir.path, fs::perms::owner_all);
    BOOST_TEST_MESSAGE("permissions don't stop writes for this user (root?): skipped");
    return;
  }
  FlatState other(s.layout);
  fill(other, 9.0f);
  BOOST_CHECK_THROW(save_state(s.path, other, s.options, "test-backend"), StateFileError);
  fs::permissions(s.dir.path, fs::perms::owner_all);
  BOOST_TEST(read_bytes(s.path) == before);
  BOOST_TEST(s.dir.listing() == std::vector<std::string>{"state.safetensors"});
}

// ------------------------------------------------------------------------------- hardening (issue 13)

// A FIFO has no writer, so a blocking open() for reading never returns: it must be refused, not waited on.
BOOST_AUTO_TEST_CASE(fifo_is_refused_without_blocking) {
  TempDir dir;
  const std::string fifo = dir.file("state.fifo");
  BOOST_REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  Options options;
  const Layout layout = Layout::build(test_manifest(), options);
  FlatState target(layout);
  fill(target, 3.0f);
  // alarm(): should the open block after all, the test dies with SIGALRM instead of hanging ctest.
  ::alarm(20);
  expect_rejected(fifo, target, {"FIFO", "not a regular file"});
  BOOST_CHECK_THROW(read_state_header(fifo, false), StateFileError);
  BOOST_CHECK_THROW(read_state_file(fifo), StateFileError);
  expect_rejected(dir.path.string(), target, {"directory", "not a regular file"});
  ::alarm(0);
}

// 10^6 nested arrays overflowed the stack (nlohmann's dump and copy recurse per level).
BOOST_AUTO_TEST_CASE(deeply_nested_header_is_refused) {
  Saved s;
  const Safetensors st = read_safetensors(s.path);
  const std::string deep = std::string(1000000, '[') + std::string(1000000, ']');
  std::string text = st.header.dump();
  text.insert(text.size() - 1, ",\"zz\":" + deep);
  write_safetensors(s.path, text, st.data);
  expect_rejected(s.path, s.target, {"header", "nests deeper than 64 levels"});
  BOOST_CHECK_THROW(read_state_header(s.path, false), StateFileError);

  // Inside a metadata string too (each one is JSON text of its own).
  write_safetensors(s.path, st.header.dump(), st.data);
  edit_header(s.path, [&](json& h) { h["__metadata__"]["group_names"] = "[" + deep + "]"; });
  expect_rejected(s.path, s.target, {"group_names", "nests deeper than 64 levels"});
  write_safetensors(s.path, st.header.dump(), st.data);
  edit_header(s.path, [&](json& h) { h["__metadata__"]["options"] = "{\"x\":" + deep + "}"; });
  expect_rejected(s.path, s.target, {"options", "nests deeper than 64 levels"});

  // Moderate nesting in a key the reader ignores is still valid JSON and loads (64 levels with the root).
  write_safetensors(s.path, st.header.dump(), st.data);
  edit_header(s.path, [&](json& h) { h["__metadata__"]["note"] = std::string(62, '[') + std::string(62, ']'); });
  FlatState loaded(s.layout);
  load_state(s.path, loaded);
  require_identical(loaded, s.source);
}

// Loading was quadratic in the tensor count (json::parse with a callback rescans the root object after each
// tensor entry). No timing here: a file with many tensors must load exactly; bench/ has no timing bar.
BOOST_AUTO_TEST_CASE(many_tensors_load_exactly) {
  TempDir dir;
  Manifest m;
  for (int i = 0; i < 4000; ++i)
    m.params.push_back(spec("p" + std::to_string(i), {i % 3 == 0 ? 3 : 4, 4}, i % 5 ? Role::matrix : Role::bias));
  Options options;
  const Layout layout = Layout::build(m, options);
  FlatState source(layout), target(layout);
  fill(source, 2.0f);
  save_state(dir.file("many"), source, options, "test-backend");
  const StateFileHeader h = read_state_header(dir.file("many"));
  BOOST_TEST(h.tensors.size() == 3u * 4000u);
  for (size_t i = 1; i < h.tensors.size(); ++i) BOOST_TEST_REQUIRE(h.tensors[i].begin == h.tensors[i - 1].end);
  load_state(dir.file("many"), target);
  require_identical(target, source);

  // The duplicate check still works without the callback parser, at any position.
  const Safetensors st = read_safetensors(dir.file("many"));
  std::string text = st.header.dump();
  const std::string entry = "\"p3999\":" + st.header["p3999"].dump();
  text.insert(1, entry + ",");
  write_safetensors(dir.file("many"), text, st.data);
  expect_rejected(dir.file("many"), target, {"'p3999' twice"});
}

// Hyper-parameters from a file go through the same checks as --set (ns_steps=10^9 hung a step, 0 skipped
// Newton-Schulz, a negative lr and beta1=5 were used as they were).
BOOST_AUTO_TEST_CASE(out_of_range_hyper_parameters_are_rejected) {
  Saved s;
  const std::string clean = read_bytes(s.path);
  const auto set_hyper = [&](const std::string& group, const std::string& field, const json& value) {
    write_bytes(s.path, clean);
    edit_header(s.path, [&](json& h) {
      json o = json::parse(h["__metadata__"]["options"].get<std::string>());
      for (json& g : o["groups"])
        if (g["name"] == group) g["hyper"][field] = value;
      h["__metadata__"]["options"] = o.dump();
    });
  };
  set_hyper("normuon", "ns_steps", 1000000000);
  expect_rejected(s.path, s.target, {"\"options\"", "normuon.ns_steps", "[1, 100]"});
  set_hyper("normuon", "ns_steps", 0);
  expect_rejected(s.path, s.target, {"normuon.ns_steps", "[1, 100]"});
  set_hyper("normuon", "ns_steps", 2.5);
  expect_rejected(s.path, s.target, {"normuon.ns_steps"});
  set_hyper("normuon", "lr", -0.1);
  expect_rejected(s.path, s.target, {"normuon.lr", "outside"});
  set_hyper("adamw", "beta1", 5);
  expect_rejected(s.path, s.target, {"adamw.beta1", "outside [0, 1)"});
  set_hyper("adamw", "eps", "1e-8");  // a string where a number belongs
  expect_rejected(s.path, s.target, {"adamw.eps", "number"});
  set_hyper("normuon", "nesterov", 1);
  expect_rejected(s.path, s.target, {"normuon.nesterov", "boolean"});
  set_hyper("normuon", "reduce_axis", "diagonal");
  expect_rejected(s.path, s.target, {"normuon.reduce_axis", "rows | longer_dim"});
  BOOST_CHECK_THROW(read_state_header(s.path, false), StateFileError);
  // In range: loads.
  set_hyper("normuon", "ns_steps", 100);
  Options loaded;
  FlatState target(s.layout);
  load_state(s.path, target, &loaded);
  BOOST_TEST(loaded.group("normuon").normuon.ns_steps == 100);
}

// One read: the options and the tensors come from the same version of the file, even when it is replaced
// between reading the options and loading (`normuon run --load` read the file twice and mixed two).
BOOST_AUTO_TEST_CASE(read_once_then_load_uses_one_version) {
  Saved s;
  const StateFileContents first = read_state_file(s.path);
  BOOST_TEST(first.header.options.to_json() == s.options.to_json());

  Options other_options;
  other_options.set("normuon.lr=0.125");
  FlatState other(s.layout);
  fill(other, 77.0f);
  save_state(s.path, other, other_options, "test-backend");  // the file is replaced

  FlatState target(s.layout);
  Options loaded;
  load_state_file(first, target, &loaded);
  require_identical(target, s.source);
  BOOST_TEST(loaded.to_json() == s.options.to_json());
  load_state(s.path, target, &loaded);  // the new version, whole
  require_identical(target, other);
  BOOST_TEST(loaded.to_json() == other_options.to_json());

  // A damaged file read once is rejected when loaded, state untouched.
  std::string bytes = read_bytes(s.path);
  bytes[bytes.size() - 2] = static_cast<char>(bytes[bytes.size() - 2] ^ 4);
  write_bytes(s.path, bytes);
  const StateFileContents damaged = read_state_file(s.path);
  const FlatState before = target;
  BOOST_CHECK_THROW(load_state_file(damaged, target), StateFileError);
  require_identical(target, before);
}

BOOST_AUTO_TEST_CASE(extra_metadata_round_trips) {
  Saved s;
  BOOST_TEST(read_state_header(s.path).extra_metadata.empty());
  save_state_with_metadata(s.path, s.source, s.options, "test-backend", {{"run_step", "17"}, {"note", "x"}});
  const StateFileHeader h = read_state_header(s.path);
  BOOST_TEST(h.extra_metadata.size() == 2u);
  BOOST_TEST(h.extra_metadata.at("run_step") == "17");
  FlatState loaded(s.layout);
  load_state(s.path, loaded);
  require_identical(loaded, s.source);
  try {
    save_state_with_metadata(s.path, s.source, s.options, "test-backend", {{"group_steps", "[0,0]"}});
    BOOST_ERROR("a format key was accepted as extra metadata");
  } catch (const StateFileError& e) {
    BOOST_TEST(contains(e.what(), "\"group_steps\""));
  }
  BOOST_CHECK_THROW(save_state_with_metadata(s.path, s.source, s.options, "test-backend", {{"entry_steps", "{}"}}),
                    StateFileError);  // a key of version 2
  BOOST_TEST(read_state_header(s.path).extra_metadata.at("run_step") == "17");  // the failed save changed nothing
}

BOOST_AUTO_TEST_CASE(save_path_is_checked_before_anything_is_written) {
  TempDir dir;
  check_state_save_path(dir.file("new.safetensors"));  // fine: nothing is created
  BOOST_TEST(dir.listing().empty());
  const auto refused = [&](const std::string& path, const std::string& word) {
    try {
      check_state_save_path(path);
      BOOST_ERROR("accepted " << path);
    } catch (const StateFileError& e) {
      BOOST_TEST(contains(e.what(), path));
      BOOST_TEST(contains(e.what(), word), e.what());
    }
  };
  refused(dir.file("missing/x.safetensors"), "No such file or directory");
  fs::create_directory(dir.file("sub"));
  refused(dir.file("sub"), "is a directory");
  BOOST_REQUIRE(::mkfifo(dir.file("fifo").c_str(), 0600) == 0);
  refused(dir.file("fifo"), "FIFO");
  BOOST_TEST(dir.listing() == (std::vector<std::string>{"fifo", "sub"}));

  fs::permissions(dir.file("sub"), fs::perms::owner_read | fs::perms::owner_exec);
  const std::string probe = dir.file("sub/probe");
  if (std::FILE* f = std::fopen(probe.c_str(), "w")) {  // root writes anyway
    std::fclose(f);
    std::remove(probe.c_str());
  } else {
    refused(dir.file("sub/x.safetensors"), "Permission denied");
  }
  fs::permissions(dir.file("sub"), fs::perms::owner_all);
  BOOST_TEST(fs::is_empty(dir.file("sub")));
}

// A save killed before its rename leaves PATH.tmp-<pid>-<hex>; the next save of PATH removes it once its
// process is gone, and nothing else: other targets' temporaries, look-alikes and live writers' files stay.
BOOST_AUTO_TEST_CASE(stale_temporary_files_are_removed) {
  Saved s;
  const pid_t dead = ::fork();
  BOOST_REQUIRE(dead >= 0);
  if (dead == 0) ::_exit(0);
  int status = 0;
  BOOST_REQUIRE(::waitpid(dead, &status, 0) == dead);
  const std::string d = std::to_string(dead);
  const std::string live = std::to_string(::getppid());  // a process that runs (the test's parent)
  const std::vector<std::string> stale{"state.safetensors.tmp-" + d + "-0123abcd",
                                       "state.safetensors.tmp-" + d + "-ffffffff"};
  const std::vector<std::string> kept{"state.safetensors.tmp-" + live + "-0123abcd",  // live writer
                                      "other.safetensors.tmp-" + d + "-0123abcd",     // another target
                                      "state.safetensors.tmp-" + d + "-0123abcd.bak", "state.safetensors.tmp-" + d,
                                      "state.safetensors.tmp-" + d + "-0123ABCD", "state.safetensors.tmp-x-0123abcd",
                                      "xstate.safetensors.tmp-" + d + "-0123abcd"};
  for (const auto& name : stale) write_bytes(s.dir.file(name), "partial");
  for (const auto& name : kept) write_bytes(s.dir.file(name), "partial");
  save_state(s.path, s.source, s.options, "test-backend");
  std::vector<std::string> expected = kept;
  expected.push_back("state.safetensors");
  std::sort(expected.begin(), expected.end());
  BOOST_TEST(s.dir.listing() == expected);
}

// Saving onto a symbolic link replaces the file it points to (the link stays), and a file keeps its mode.
BOOST_AUTO_TEST_CASE(save_writes_through_links_and_keeps_the_mode) {
  Saved s;
  BOOST_REQUIRE(::chmod(s.path.c_str(), 0600) == 0);
  fs::create_directory(s.dir.file("links"));
  const std::string link = s.dir.file("links/current");
  fs::create_symlink("../state.safetensors", link);
  const std::string link2 = s.dir.file("links/alias");
  fs::create_symlink("current", link2);  // a chain of two links

  FlatState second(s.layout);
  fill(second, 5.0f);
  save_state(link2, second, s.options, "test-backend");
  BOOST_TEST(fs::is_symlink(link));
  BOOST_TEST(fs::is_symlink(link2));
  BOOST_TEST(fs::read_symlink(link).string() == "../state.safetensors");
  struct stat st{};
  BOOST_REQUIRE(::stat(s.path.c_str(), &st) == 0);
  BOOST_TEST((st.st_mode & 0777) == 0600u);
  FlatState loaded(s.layout);
  load_state(s.path, loaded);
  require_identical(loaded, second);
  BOOST_TEST(s.dir.listing() == (std::vector<std::string>{"links", "state.safetensors"}));

  // A plain file keeps its mode too.
  BOOST_REQUIRE(::chmod(s.path.c_str(), 0640) == 0);
  save_state(s.path, s.source, s.options, "test-backend");
  BOOST_REQUIRE(::stat(s.path.c_str(), &st) == 0);
  BOOST_TEST((st.st_mode & 0777) == 0640u);

  // A dangling link: the file it names is created, the link stays.
  const std::string dangling = s.dir.file("links/next");
  fs::create_symlink("../next.safetensors", dangling);
  save_state(dangling, s.source, s.options, "test-backend");
  BOOST_TEST(fs::is_symlink(dangling));
  BOOST_TEST(fs::is_regular_file(s.dir.file("next.safetensors")));
}
