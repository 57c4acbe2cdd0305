// Parameter manifest: routing rule, validation and the CSV form (parsed and quoted by libcsv).
#include "normuon/manifest.h"

#include <csv.h>

#include <algorithm>
#include <array>
#include <exception>
#include <fstream>
#include <istream>
#include <limits>
#include <map>
#include <ostream>
#include <stdexcept>

namespace normuon {

namespace {

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

std::string quoted(const std::string& s) { return "\"" + s + "\""; }

// Human form for error messages, e.g. "[768, 3072]", "[]" for a scalar.
std::string shape_for_humans(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// ---- CSV reading -------------------------------------------------------------------------------

struct Row {
  int64_t line;  // physical line on which the row starts
  std::vector<std::string> fields;
};

// Collects libcsv's rows. The callbacks run inside C code, so they must not throw: an exception is
// parked and rethrown once csv_parse has returned.
struct RowCollector {
  int64_t line = 0;  // physical line being fed
  std::vector<std::string> fields;
  std::vector<Row> rows;
  std::exception_ptr error;

  static void on_field(void* s, size_t len, void* self) {
    auto* c = static_cast<RowCollector*>(self);
    try {
      c->fields.emplace_back(len ? std::string(static_cast<const char*>(s), len) : std::string());
    } catch (...) {
      c->error = std::current_exception();
    }
  }
  static void on_row(int, void* self) {
    auto* c = static_cast<RowCollector*>(self);
    try {
      // We feed one physical line at a time, so the row ends on the current line; quoted newlines
      // inside its fields tell how many lines earlier it started.
      int64_t embedded = 0;
      for (const auto& f : c->fields) embedded += std::count(f.begin(), f.end(), '\n');
      c->rows.push_back({c->line - embedded, std::move(c->fields)});
      c->fields.clear();
    } catch (...) {
      c->error = std::current_exception();
    }
  }
};

// Owns a libcsv parser so that csv_free runs on every path.
class CsvParser {
 public:
  CsvParser() {
    if (csv_init(&p_, CSV_STRICT | CSV_STRICT_FINI) != 0) throw std::bad_alloc();
  }
  ~CsvParser() { csv_free(&p_); }
  CsvParser(const CsvParser&) = delete;
  CsvParser& operator=(const CsvParser&) = delete;
  csv_parser* get() { return &p_; }

 private:
  csv_parser p_;
};

// libcsv itself skips empty (and blank) lines: they produce no row.
std::vector<Row> read_rows(std::istream& in, const std::string& source) {
  CsvParser parser;
  RowCollector rc;
  auto fail = [&] {
    throw std::invalid_argument(source + ":" + std::to_string(rc.line) + ": malformed CSV (" +
                                csv_strerror(csv_error(parser.get())) + ")");
  };
  std::string line;
  while (std::getline(in, line)) {
    ++rc.line;
    // Editors on Windows start UTF-8 files with a byte order mark; it is no part of the first column name.
    static const std::string kUtf8Bom = "\xEF\xBB\xBF";
    if (rc.line == 1 && line.compare(0, kUtf8Bom.size(), kUtf8Bom) == 0) line.erase(0, kUtf8Bom.size());
    line += '\n';
    size_t used = csv_parse(parser.get(), line.data(), line.size(), RowCollector::on_field,
                            RowCollector::on_row, &rc);
    if (rc.error) std::rethrow_exception(rc.error);
    if (used != line.size()) fail();
  }
  if (in.bad()) throw std::invalid_argument(source + ": read error");
  if (csv_fini(parser.get(), RowCollector::on_field, RowCollector::on_row, &rc) != 0) fail();
  if (rc.error) std::rethrow_exception(rc.error);
  return std::move(rc.rows);
}

enum Column { kName, kShape, kDType, kRole, kGroup, kAlgorithm, kTransposed, kColumnCount };
constexpr std::array<const char*, kColumnCount> kColumnNames = {"name", "shape",     "dtype",     "role",
                                                               "group", "algorithm", "transposed"};

std::string column_list() {
  std::string out;
  for (const char* c : kColumnNames) out += (out.empty() ? "" : ", ") + std::string(c);
  return out;
}

// Index of each known column in the file's rows, or -1 where the column is absent.
std::array<int, kColumnCount> read_header(const Row& header, const std::string& where) {
  std::array<int, kColumnCount> index;
  index.fill(-1);
  for (size_t i = 0; i < header.fields.size(); ++i) {
    const std::string& f = header.fields[i];
    auto it = std::find(kColumnNames.begin(), kColumnNames.end(), f);
    if (it == kColumnNames.end())
      throw std::invalid_argument(where + "unknown column '" + f + "' (expected " + column_list() + ")");
    int& slot = index[static_cast<size_t>(it - kColumnNames.begin())];
    if (slot >= 0) throw std::invalid_argument(where + "column '" + f + "' appears twice");
    slot = static_cast<int>(i);
  }
  for (Column required : {kName, kShape})
    if (index[required] < 0)
      throw std::invalid_argument(where + "missing required column '" + kColumnNames[required] +
                                  "' (header must name " + column_list() + "; name and shape are required)");
  return index;
}

// ---- CSV writing -------------------------------------------------------------------------------

// Quote only where libcsv would otherwise read the field back differently: separators, quotes, line
// breaks, and the leading/trailing blanks it trims from unquoted fields.
bool needs_quotes(const std::string& s) {
  if (s.find_first_of(",\"\r\n") != std::string::npos) return true;
  auto blank = [](char c) { return c == ' ' || c == '\t'; };
  return !s.empty() && (blank(s.front()) || blank(s.back()));
}

void write_field(std::ostream& out, const std::string& s) {
  if (!needs_quotes(s)) {
    out << s;
    return;
  }
  std::string buf(csv_write(nullptr, 0, s.data(), s.size()), '\0');
  csv_write(&buf[0], buf.size(), s.data(), s.size());
  out << buf;
}

}  // namespace

// ---- names and shapes --------------------------------------------------------------------------

const char* to_string(DType d) {
  switch (d) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
  }
  throw std::invalid_argument("invalid DType value");
}

const char* to_string(Role r) {
  switch (r) {
    case Role::matrix: return "matrix";
    case Role::embedding: return "embedding";
    case Role::head: return "head";
    case Role::norm: return "norm";
    case Role::bias: return "bias";
    case Role::other: return "other";
    case Role::router: return "router";
    case Role::experts: return "experts";
  }
  throw std::invalid_argument("invalid Role value");
}

DType parse_dtype(const std::string& s) {
  for (DType d : {DType::f32, DType::bf16, DType::f16})
    if (s == to_string(d)) return d;
  throw std::invalid_argument("unknown dtype " + quoted(s) + " (expected f32, bf16 or f16)");
}

Role parse_role(const std::string& s) {
  for (Role r : {Role::matrix, Role::embedding, Role::head, Role::norm, Role::bias, Role::other, Role::router,
                 Role::experts})
    if (s == to_string(r)) return r;
  throw std::invalid_argument("unknown role " + quoted(s) +
                              " (expected matrix, embedding, head, norm, bias, other, router or experts)");
}

std::string shape_to_string(const std::vector<int64_t>& shape) {
  std::string out;
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? "x" : "") + std::to_string(shape[i]);
  return out;
}

std::vector<int64_t> parse_shape(const std::string& s) {
  std::vector<int64_t> shape;
  if (s.empty()) return shape;
  int64_t elements = 1;
  size_t begin = 0;
  while (true) {
    size_t end = std::min(s.find('x', begin), s.size());
    const std::string part = s.substr(begin, end - begin);
    auto bad = [&](const std::string& why) {
      return std::invalid_argument("bad extent " + quoted(part) + " (" + why + ")");
    };
    if (part.empty() || part.find_first_not_of("0123456789") != std::string::npos)
      throw bad("expected extents joined by 'x', e.g. 768x3072");
    int64_t extent = 0;
    for (char c : part) {
      int digit = c - '0';
      if (extent > (kInt64Max - digit) / 10) throw bad("too large");
      extent = extent * 10 + digit;
    }
    if (extent != 0 && elements > kInt64Max / extent)
      throw std::invalid_argument("shape " + quoted(s) + " has too many elements");
    elements *= extent;
    shape.push_back(extent);
    if (end == s.size()) return shape;
    begin = end + 1;
  }
}

// ---- ParamSpec and routing ---------------------------------------------------------------------

int64_t ParamSpec::numel() const {
  int64_t n = 1;
  for (int64_t e : shape) n *= e;
  return n;
}

Algorithm route(const ParamSpec& p) {
  // An expert bank [E, m, n] is E matrices (one expert, as a layout holds it, is a matrix itself).
  const bool bank = p.role == Role::experts && p.shape.size() == 3;
  const bool matrix = p.shape.size() == 2 || bank;
  if (p.algorithm) {
    if (*p.algorithm == Algorithm::normuon && !matrix)
      throw std::invalid_argument("parameter " + quoted(p.name) + " is routed to NorMuon but has shape " +
                                  shape_for_humans(p.shape) + " (NorMuon needs a 2-D matrix, or an expert bank " +
                                  "[E, m, n] with role experts)");
    return *p.algorithm;
  }
  // A MoE's router goes to AdamW: a few rows (one per expert) that decide where tokens go, as the official
  // NorMuon leaves the embedding and the head to AdamW. Biases are biases at any rank (a MoE's expert
  // biases are [E, f]).
  const bool not_a_matrix = p.role == Role::embedding || p.role == Role::head || p.role == Role::router ||
                            p.role == Role::bias;
  return matrix && !not_a_matrix ? Algorithm::normuon : Algorithm::adamw;
}

bool transposable(const ParamSpec& p) {
  return p.shape.size() == 2 || (p.role == Role::experts && p.shape.size() == 3);
}

namespace {

void check_transposed(const ParamSpec& p) {
  if (p.transposed && !transposable(p))
    throw std::invalid_argument("parameter " + quoted(p.name) + " is marked transposed but has shape " +
                                shape_for_humans(p.shape) + " (only a matrix, or an expert bank with role experts, " +
                                "is stored [in, out])");
}

}  // namespace

std::string expert_name(const std::string& bank, int64_t k) { return bank + "[" + std::to_string(k) + "]"; }

std::string resolved_group(const ParamSpec& p) {
  if (!p.group.empty()) return p.group;
  return route(p) == Algorithm::normuon ? "normuon" : "adamw";
}

// ---- Manifest ----------------------------------------------------------------------------------

void Manifest::validate() const {
  std::map<std::string, size_t> seen;
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamSpec& p = params[i];
    if (p.name.empty()) throw std::invalid_argument("parameter #" + std::to_string(i) + " has an empty name");
    auto [it, fresh] = seen.emplace(p.name, i);
    if (!fresh)
      throw std::invalid_argument("duplicate parameter name " + quoted(p.name) + " (entries #" +
                                  std::to_string(it->second) + " and #" + std::to_string(i) + ")");
    for (int64_t e : p.shape)
      if (e < 0)
        throw std::invalid_argument("parameter " + quoted(p.name) + " has a negative extent in shape " +
                                    shape_for_humans(p.shape));
    // Counted with overflow checks (numel() would wrap for 2^62 x 4): the layout's offsets and byte counts
    // are sums of these, so each one is bounded first.
    bool zero = false;
    for (int64_t e : p.shape) zero = zero || e == 0;
    int64_t elements = 1;
    for (int64_t e : p.shape)
      if (!zero && elements > kMaxParamElements / e)
        throw std::invalid_argument("parameter " + quoted(p.name) + " with shape " + shape_for_humans(p.shape) +
                                    " is too large: more than the limit of " + std::to_string(kMaxParamElements) +
                                    " (2^40) elements per parameter");
      else if (!zero)
        elements *= e;
    route(p);
    check_transposed(p);
  }
}

int64_t Manifest::numel() const {
  int64_t n = 0;
  for (const ParamSpec& p : params) n += p.numel();
  return n;
}

Manifest Manifest::read_csv(std::istream& in, const std::string& source_name) {
  std::vector<Row> rows = read_rows(in, source_name);
  auto where = [&](const Row& r) { return source_name + ":" + std::to_string(r.line) + ": "; };
  if (rows.empty())
    throw std::invalid_argument(source_name + ": empty manifest (expected a header line: " + column_list() + ")");
  const std::array<int, kColumnCount> index = read_header(rows.front(), where(rows.front()));

  Manifest m;
  std::map<std::string, int64_t> first_line;  // name -> line, for duplicate errors
  for (size_t r = 1; r < rows.size(); ++r) {
    const Row& row = rows[r];
    if (row.fields.size() != rows.front().fields.size())
      throw std::invalid_argument(where(row) + "expected " + std::to_string(rows.front().fields.size()) +
                                  " fields as in the header, got " + std::to_string(row.fields.size()));
    // Runs one column's parser; its error gains the source, line and column.
    auto in_column = [&](Column c, auto parse) {
      try {
        return parse(row.fields[static_cast<size_t>(index[c])]);
      } catch (const std::invalid_argument& e) {
        throw std::invalid_argument(where(row) + "column '" + kColumnNames[c] + "': " + e.what());
      }
    };
    auto has = [&](Column c) { return index[c] >= 0; };

    ParamSpec p;
    p.name = in_column(kName, [&](const std::string& s) {
      if (s.empty()) throw std::invalid_argument("empty parameter name");
      auto [it, fresh] = first_line.emplace(s, row.line);
      if (!fresh)
        throw std::invalid_argument("duplicate parameter name " + quoted(s) + " (first on line " +
                                    std::to_string(it->second) + ")");
      return s;
    });
    p.shape = in_column(kShape, parse_shape);
    if (has(kDType)) p.dtype = in_column(kDType, parse_dtype);
    if (has(kRole)) p.role = in_column(kRole, parse_role);
    if (has(kGroup)) p.group = row.fields[static_cast<size_t>(index[kGroup])];
    if (has(kAlgorithm)) {
      p.algorithm = in_column(kAlgorithm, [](const std::string& s) -> std::optional<Algorithm> {
        if (s.empty() || s == "auto") return std::nullopt;
        return parse_algorithm(s);
      });
      in_column(kAlgorithm, [&](const std::string&) { return route(p); });  // NorMuon needs 2-D
    }
    if (has(kTransposed))
      p.transposed = in_column(kTransposed, [&](const std::string& s) {
        if (s != "" && s != "no" && s != "yes")
          throw std::invalid_argument("expected yes, no or empty, got " + quoted(s));
        p.transposed = s == "yes";
        check_transposed(p);
        return p.transposed;
      });
    m.params.push_back(std::move(p));
  }
  return m;
}

Manifest Manifest::read_csv_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument("cannot open manifest file " + quoted(path));
  return read_csv(in, path);
}

void Manifest::write_csv(std::ostream& out) const {
  // The transposed column only when a parameter needs it: other manifests read as they always did.
  const bool any_transposed =
      std::any_of(params.begin(), params.end(), [](const ParamSpec& p) { return p.transposed; });
  const size_t columns = any_transposed ? kColumnCount : kTransposed;
  for (size_t c = 0; c < columns; ++c) out << (c ? "," : "") << kColumnNames[c];
  out << '\n';
  for (const ParamSpec& p : params) {
    const std::array<std::string, kColumnCount> fields = {
        p.name, shape_to_string(p.shape), to_string(p.dtype), to_string(p.role), p.group,
        p.algorithm ? to_string(*p.algorithm) : "auto", p.transposed ? "yes" : "no"};
    for (size_t c = 0; c < columns; ++c) {
      if (c) out << ',';
      write_field(out, fields[c]);
    }
    out << '\n';
  }
}

}  // namespace normuon
