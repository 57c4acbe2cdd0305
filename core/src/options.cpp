#include "normuon/options.h"

#include "bounded_json.h"
#include "normuon/ns_coefficients.h"

#include <algorithm>
#include <cerrno>
#include <limits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace normuon {

OptionError::OptionError(std::string key_, std::string value_, std::string problem_)
    : std::invalid_argument("option '" + key_ + "': " + (value_.empty() ? "" : value_ + " ") + problem_),
      key(std::move(key_)),
      value(std::move(value_)),
      problem(std::move(problem_)) {}
namespace {

using Json = nlohmann::json;

// One table of names per enum, so parsing, printing and error messages never disagree.
template <typename E>
struct EnumNames;
#define NORMUON_ENUM_NAMES(E, ...)                                      \
  template <>                                                           \
  struct EnumNames<E> {                                                 \
    static const std::vector<std::pair<E, const char*>>& get() {        \
      static const std::vector<std::pair<E, const char*>> t{__VA_ARGS__}; \
      return t;                                                         \
    }                                                                   \
  };
NORMUON_ENUM_NAMES(Algorithm, {Algorithm::normuon, "normuon"}, {Algorithm::adamw, "adamw"})
NORMUON_ENUM_NAMES(ReduceAxis, {ReduceAxis::rows, "rows"}, {ReduceAxis::longer_dim, "longer_dim"})
NORMUON_ENUM_NAMES(NsCoefficients, {NsCoefficients::quintic, "quintic"},
                   {NsCoefficients::polar_express, "polar_express"})
NORMUON_ENUM_NAMES(NsPrecision, {NsPrecision::fp32, "fp32"}, {NsPrecision::bf16, "bf16"})
NORMUON_ENUM_NAMES(NsAlgorithm, {NsAlgorithm::standard, "standard"}, {NsAlgorithm::gram, "gram"})
NORMUON_ENUM_NAMES(LrScale, {LrScale::official, "official"}, {LrScale::spectral, "spectral"},
                   {LrScale::rms_matching, "rms_matching"})
NORMUON_ENUM_NAMES(WeightDecayMode, {WeightDecayMode::decoupled, "decoupled"},
                   {WeightDecayMode::cautious, "cautious"}, {WeightDecayMode::none, "none"})
NORMUON_ENUM_NAMES(EpsPlacement, {EpsPlacement::add, "add"}, {EpsPlacement::clamp, "clamp"})
NORMUON_ENUM_NAMES(NonFinitePolicy, {NonFinitePolicy::error, "error"},
                   {NonFinitePolicy::skip_step, "skip_step"})
#undef NORMUON_ENUM_NAMES

template <typename E>
const char* enum_name(E e) {
  for (const auto& [value, name] : EnumNames<E>::get())
    if (value == e) return name;
  return "?";
}

template <typename E>
E parse_enum(const std::string& key, const std::string& text) {
  std::string choices;
  for (const auto& [value, name] : EnumNames<E>::get()) {
    if (text == name) return value;
    choices += choices.empty() ? name : std::string(" | ") + name;
  }
  throw OptionError(key, "", "unknown value '" + text + "' (choose " + choices + ")");
}

// The shortest decimal text that reads back as the same double ("0.95", not "0.94999999999999996").
std::string format_double(double v) {
  char buf[32];
  for (int digits = 6; digits <= 17; ++digits) {
    std::snprintf(buf, sizeof buf, "%.*g", digits, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

double parse_double(const std::string& key, const std::string& text) {
  // strtod rather than stod: stod throws the same out_of_range for 1e400 and 1e-400, and both were
  // reported as "not a finite number".
  const char* begin = text.c_str();
  char* end = nullptr;
  errno = 0;
  const double value = std::strtod(begin, &end);
  const bool range_error = errno == ERANGE;
  if (end == begin || static_cast<size_t>(end - begin) != text.size() || std::isnan(value) ||
      (std::isinf(value) && !range_error))
    throw OptionError(key, "'" + text + "'", "is not a finite number");
  if (range_error && std::isinf(value))
    throw OptionError(key, "'" + text + "'", "is out of range: it overflows a double (the largest is " +
                                                 format_double(std::numeric_limits<double>::max()) + ")");
  // A result that is nonzero but subnormal is representable (strtod flags it too): only a value that
  // underflows to zero while its text does not say zero is refused.
  if (range_error && value == 0)
    throw OptionError(key, "'" + text + "'", "is out of range: it underflows to 0 (the smallest positive double is " +
                                                 format_double(std::numeric_limits<double>::denorm_min()) + "); write 0 for zero");
  return value;
}

bool parse_bool(const std::string& key, const std::string& text) {
  if (text == "true" || text == "1" || text == "on") return true;
  if (text == "false" || text == "0" || text == "off") return false;
  throw OptionError(key, "'" + text + "'", "is not a boolean (true | false)");
}

// A field of a hyper-parameter struct: its public description (FieldSpec) and where it lives. Every way
// in (text, a typed value from Python, a state file's JSON) ends in assign(), so they check alike.
template <typename H>
struct Field {
  FieldSpec spec;
  double H::*number = nullptr;  // number fields
  std::function<void(H&, const FieldValue&)> store;  // an already checked value
  std::function<FieldValue(const H&)> load;
};

void require_json_type(const std::string& key, const Json& v, bool ok, const char* what) {
  if (!ok) throw std::invalid_argument("option '" + key + "': " + v.dump() + " is not " + what);
}

std::string describe_value(const FieldValue& v) {
  if (const auto* d = std::get_if<double>(&v)) return format_double(*d);
  if (const auto* b = std::get_if<bool>(&v)) return *b ? "true" : "false";
  return "'" + std::get<std::string>(v) + "'";
}

// `value` checked against `spec` in the form the field stores, or std::invalid_argument naming `key`.
FieldValue checked(const FieldSpec& spec, const std::string& key, const FieldValue& value) {
  switch (spec.kind) {
    case FieldSpec::Kind::number:
    case FieldSpec::Kind::integer: {
      const double* d = std::get_if<double>(&value);
      if (!d) throw OptionError(key, describe_value(value), "is not a number");
      const std::string text = format_double(*d);
      if (!std::isfinite(*d)) throw OptionError(key, "'" + text + "'", "is not a finite number");
      if (spec.kind == FieldSpec::Kind::integer) {
        if (*d != std::floor(*d) || *d < spec.lo || *d > spec.hi)
          throw OptionError(key, text, "is not an integer in [" + format_double(spec.lo) + ", " +
                                           format_double(spec.hi) + "]");
      } else if (*d < spec.lo || *d > spec.hi || (spec.below_hi && *d == spec.hi)) {
        throw OptionError(key, text, "is outside [" + format_double(spec.lo) + ", " + format_double(spec.hi) +
                                         (spec.below_hi ? ")" : "]"));
      }
      return *d;
    }
    case FieldSpec::Kind::boolean: {
      if (const bool* b = std::get_if<bool>(&value)) return *b;
      const double* d = std::get_if<double>(&value);
      if (d && (*d == 0 || *d == 1)) return *d == 1;  // 0 / 1, as Python's bool() of them
      throw OptionError(key, describe_value(value), "is not a boolean (true | false)");
    }
    case FieldSpec::Kind::choice: {
      const std::string* text = std::get_if<std::string>(&value);
      std::string choices;
      for (const auto& c : spec.choices) {
        if (text && *text == c) return *text;
        choices += (choices.empty() ? "" : " | ") + c;
      }
      throw OptionError(key, "", "unknown value " + describe_value(value) + " (choose " + choices + ")");
    }
  }
  throw std::logic_error("unknown field kind");
}

// Text (the command line's --set, Options::set) in the field's kind.
FieldValue from_text(const FieldSpec& spec, const std::string& key, const std::string& text) {
  switch (spec.kind) {
    case FieldSpec::Kind::number:
    case FieldSpec::Kind::integer: return parse_double(key, text);
    case FieldSpec::Kind::boolean: return parse_bool(key, text);
    case FieldSpec::Kind::choice: return text;
  }
  throw std::logic_error("unknown field kind");
}

// A state file's JSON value in the field's kind, its JSON type checked first.
FieldValue from_json_value(const FieldSpec& spec, const std::string& key, const Json& v) {
  switch (spec.kind) {
    case FieldSpec::Kind::number:
    case FieldSpec::Kind::integer:
      require_json_type(key, v, v.is_number(), "a number");
      return v.get<double>();
    case FieldSpec::Kind::boolean:
      require_json_type(key, v, v.is_boolean(), "a boolean (true | false)");
      return v.get<bool>();
    case FieldSpec::Kind::choice:
      require_json_type(key, v, v.is_string(), "a string");
      return v.get<std::string>();
  }
  throw std::logic_error("unknown field kind");
}

void to_json_value(const FieldValue& v, const char* name, Json& j) {
  if (const auto* d = std::get_if<double>(&v))
    j[name] = *d;
  else if (const auto* b = std::get_if<bool>(&v))
    j[name] = *b;
  else
    j[name] = std::get<std::string>(v);
}

// below_hi: the range is [lo, hi), as torch has it for betas (beta = 1 never forgets, and AdamW's bias
// correction divides by 1 - beta^t = 0).
template <typename H>
Field<H> number_field(const char* name, double H::*member, double lo, double hi, bool below_hi = false) {
  FieldSpec spec{name, FieldSpec::Kind::number, lo, hi, below_hi, {}, false};
  return {spec, member, [member](H& h, const FieldValue& v) { h.*member = std::get<double>(v); },
          [member](const H& h) { return FieldValue(h.*member); }};
}

template <typename H, typename E>
Field<H> enum_field(const char* name, E H::*member, bool optional_in_json = false) {
  FieldSpec spec{name, FieldSpec::Kind::choice, 0, 0, false, {}, optional_in_json};
  for (const auto& [value, text] : EnumNames<E>::get()) spec.choices.emplace_back(text);
  return {spec, nullptr,
          [member, name](H& h, const FieldValue& v) { h.*member = parse_enum<E>(name, std::get<std::string>(v)); },
          [member](const H& h) { return FieldValue(std::string(enum_name(h.*member))); }};
}

const std::vector<Field<NorMuonHyper>>& normuon_fields() {
  using H = NorMuonHyper;
  static const std::vector<Field<H>> fields{
      number_field<H>("lr", &H::lr, 0, 1e6),
      number_field<H>("beta1", &H::beta1, 0, 1, true),
      number_field<H>("beta2", &H::beta2, 0, 1, true),
      number_field<H>("weight_decay", &H::weight_decay, 0, 1e6),
      {{"nesterov", FieldSpec::Kind::boolean, 0, 0, false, {}, false}, nullptr,
       [](H& h, const FieldValue& v) { h.nesterov = std::get<bool>(v); },
       [](const H& h) { return FieldValue(h.nesterov); }},
      {{"ns_steps", FieldSpec::Kind::integer, 1, 100, false, {}, false}, nullptr,
       [](H& h, const FieldValue& v) { h.ns_steps = static_cast<int>(std::get<double>(v)); },
       [](const H& h) { return FieldValue(static_cast<double>(h.ns_steps)); }},
      enum_field<H>("ns_coefficients", &H::ns_coefficients),
      enum_field<H>("ns_precision", &H::ns_precision),
      enum_field<H>("ns_algorithm", &H::ns_algorithm, /*optional_in_json=*/true),  // absent before issue 15
      enum_field<H>("reduce_axis", &H::reduce_axis),
      enum_field<H>("lr_scale", &H::lr_scale),
      enum_field<H>("weight_decay_mode", &H::weight_decay_mode),
      enum_field<H>("eps_placement", &H::eps_placement),
      number_field<H>("ns_eps", &H::ns_eps, 0, 1),
      number_field<H>("denom_eps", &H::denom_eps, 0, 1),
      number_field<H>("renorm_eps", &H::renorm_eps, 0, 1),
  };
  return fields;
}

const std::vector<Field<AdamWHyper>>& adamw_fields() {
  using H = AdamWHyper;
  static const std::vector<Field<H>> fields{
      number_field<H>("lr", &H::lr, 0, 1e6),
      number_field<H>("beta1", &H::beta1, 0, 1, true),
      number_field<H>("beta2", &H::beta2, 0, 1, true),
      number_field<H>("eps", &H::eps, 0, 1),
      number_field<H>("weight_decay", &H::weight_decay, 0, 1e6),
  };
  return fields;
}

template <typename H>
const Field<H>* find_field(const std::vector<Field<H>>& fields, const std::string& name) {
  for (const auto& f : fields)
    if (name == f.spec.name) return &f;
  return nullptr;
}

template <typename H>
std::string field_names(const std::vector<Field<H>>& fields) {
  std::string out;
  for (const auto& f : fields) out += (out.empty() ? "" : ", ") + f.spec.name;
  return out;
}

std::string value_text(const FieldValue& v) {
  if (const auto* d = std::get_if<double>(&v)) return format_double(*d);
  if (const auto* b = std::get_if<bool>(&v)) return *b ? "true" : "false";
  return std::get<std::string>(v);
}

// Calls fn(field, hyper struct) for group g's field `name`; false when its algorithm has no such field.
template <typename Fn>
bool with_field(GroupOptions& g, const std::string& name, Fn&& fn) {
  if (g.algorithm == Algorithm::normuon) {
    const auto* f = find_field(normuon_fields(), name);
    if (f) fn(*f, g.normuon);
    return f != nullptr;
  }
  const auto* f = find_field(adamw_fields(), name);
  if (f) fn(*f, g.adamw);
  return f != nullptr;
}

// Sets `field` of group g from text; false when the group's algorithm has no such field.
bool set_group_field(GroupOptions& g, const std::string& field, const std::string& key, const std::string& value) {
  return with_field(g, field, [&](const auto& f, auto& h) { f.store(h, checked(f.spec, key, from_text(f.spec, key, value))); });
}

template <typename H>
void fields_to_json(const std::vector<Field<H>>& fields, const H& hyper, Json& j) {
  for (const auto& f : fields) {
    const FieldValue v = f.load(hyper);
    if (f.spec.kind == FieldSpec::Kind::integer)
      j[f.spec.name] = static_cast<int64_t>(std::get<double>(v));
    else
      to_json_value(v, f.spec.name.c_str(), j);
  }
}

std::string known_keys_hint() {
  return "known keys: nonfinite, [GROUP.]FIELD with NorMuon fields {" + field_names(normuon_fields()) +
         "} and AdamW fields {" + field_names(adamw_fields()) + "}";
}

}  // namespace

Options::Options() {
  GroupOptions normuon_group;
  normuon_group.name = "normuon";
  normuon_group.algorithm = Algorithm::normuon;
  GroupOptions adamw_group;
  adamw_group.name = "adamw";
  adamw_group.algorithm = Algorithm::adamw;
  groups = {normuon_group, adamw_group};
}

const GroupOptions* Options::find_group(const std::string& name) const {
  for (const auto& g : groups)
    if (g.name == name) return &g;
  return nullptr;
}

const GroupOptions& Options::group(const std::string& name) const {
  if (const auto* g = find_group(name)) return *g;
  std::string names;
  for (const auto& g : groups) names += (names.empty() ? "" : ", ") + g.name;
  throw std::invalid_argument("unknown hyper-parameter group '" + name + "' (groups: " + names + ")");
}

GroupOptions& Options::group(const std::string& name) {
  return const_cast<GroupOptions&>(static_cast<const Options*>(this)->group(name));
}

void Options::set(const std::string& key, const std::string& value) {
  if (key == "nonfinite") {
    nonfinite = parse_enum<NonFinitePolicy>(key, value);
    return;
  }
  auto dot = key.find('.');
  if (dot != std::string::npos) {
    const std::string group_name = key.substr(0, dot);
    const std::string field = key.substr(dot + 1);
    GroupOptions& g = group(group_name);
    if (!set_group_field(g, field, key, value))
      throw std::invalid_argument("option '" + key + "': group '" + group_name + "' (" + to_string(g.algorithm) +
                                  ") has no field '" + field + "'; " + known_keys_hint());
    return;
  }
  bool any = false;
  for (auto& g : groups) any = set_group_field(g, key, key, value) || any;
  if (!any) throw std::invalid_argument("unknown option '" + key + "'; " + known_keys_hint());
}

void Options::set_group(size_t group, const std::vector<std::pair<std::string, FieldValue>>& values) {
  if (group >= groups.size())
    throw std::invalid_argument("group index " + std::to_string(group) + " out of range (" +
                                std::to_string(groups.size()) + " groups)");
  GroupOptions g = groups[group];  // changed as a copy: all or nothing
  for (const auto& field_value : values) {  // not a structured binding: C++17 lambdas cannot capture one
    const std::string& field = field_value.first;
    const FieldValue& value = field_value.second;
    const std::string key = g.name + "." + field;
    if (!with_field(g, field, [&](const auto& f, auto& h) { f.store(h, checked(f.spec, key, value)); }))
      throw std::invalid_argument("option '" + key + "': group '" + g.name + "' (" + to_string(g.algorithm) +
                                  ") has no field '" + field + "'; " + known_keys_hint());
  }
  const std::string reason = group_values_invalid_reason(g);
  if (!reason.empty()) throw std::invalid_argument(reason);
  groups[group] = std::move(g);
}

std::string group_values_invalid_reason(const GroupOptions& g) {
  if (g.algorithm == Algorithm::normuon && g.normuon.ns_coefficients == NsCoefficients::polar_express &&
      g.normuon.ns_steps > kPolarExpressSteps)
    return "group '" + g.name + "': Polar Express has " + std::to_string(kPolarExpressSteps) +
           " coefficient triples, ns_steps is " + std::to_string(g.normuon.ns_steps);
  return "";
}

FieldValue Options::get(size_t group, const std::string& field) const {
  if (group >= groups.size()) throw std::invalid_argument("group index " + std::to_string(group) + " out of range");
  GroupOptions g = groups[group];
  FieldValue out;
  if (!with_field(g, field, [&](const auto& f, auto& h) { out = f.load(h); }))
    throw std::invalid_argument("group '" + g.name + "' (" + to_string(g.algorithm) + ") has no field '" + field + "'");
  return out;
}

std::vector<FieldSpec> Options::fields(Algorithm algorithm) {
  std::vector<FieldSpec> out;
  if (algorithm == Algorithm::normuon)
    for (const auto& f : normuon_fields()) out.push_back(f.spec);
  else
    for (const auto& f : adamw_fields()) out.push_back(f.spec);
  return out;
}

void Options::set(const std::string& assignment) {
  auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0)
    throw std::invalid_argument("option '" + assignment + "' is not of the form KEY=VALUE");
  set(assignment.substr(0, eq), assignment.substr(eq + 1));
}

std::string Options::to_json() const {
  Json j;
  j["nonfinite"] = enum_name(nonfinite);
  Json gs = Json::array();
  for (const auto& g : groups) {
    Json jg;
    jg["name"] = g.name;
    jg["algorithm"] = enum_name(g.algorithm);
    Json h;
    if (g.algorithm == Algorithm::normuon)
      fields_to_json(normuon_fields(), g.normuon, h);
    else
      fields_to_json(adamw_fields(), g.adamw, h);
    jg["hyper"] = h;
    gs.push_back(jg);
  }
  j["groups"] = gs;
  return j.dump();  // nlohmann writes doubles with round-trip precision
}

// Every value goes through the checks of set(): a state file's options are input like any other (a file
// with ns_steps=10^9 or beta1=5 was used as it was).
Options Options::from_json(const std::string& text) {
  try {
    const Json j = detail::parse_bounded_json(text);
    if (!j.is_object()) throw std::invalid_argument("not a JSON object");
    Options o;
    const Json& nonfinite = j.at("nonfinite");
    require_json_type("nonfinite", nonfinite, nonfinite.is_string(), "a string");
    o.nonfinite = parse_enum<NonFinitePolicy>("nonfinite", nonfinite.get<std::string>());
    const Json& groups = j.at("groups");
    if (!groups.is_array()) throw std::invalid_argument("\"groups\" is not a JSON array");
    o.groups.clear();
    for (const auto& jg : groups) {
      if (!jg.is_object()) throw std::invalid_argument("a group is " + jg.dump() + ", not a JSON object");
      GroupOptions g;
      const Json& name = jg.at("name");
      require_json_type("name", name, name.is_string() && !name.get<std::string>().empty(), "a group name");
      g.name = name.get<std::string>();
      if (o.find_group(g.name)) throw std::invalid_argument("group '" + g.name + "' is defined twice");
      const Json& algorithm = jg.at("algorithm");
      require_json_type(g.name + ".algorithm", algorithm, algorithm.is_string(), "a string");
      g.algorithm = parse_enum<Algorithm>(g.name + ".algorithm", algorithm.get<std::string>());
      const Json& h = jg.at("hyper");
      if (!h.is_object()) throw std::invalid_argument("group '" + g.name + "': \"hyper\" is not a JSON object");
      const auto read_fields = [&](const auto& fields, auto& hyper) {
        // A key this build does not know is refused: a later version's option (ignoring it would run
        // something else than the file's run did) or a damaged file.
        for (const auto& kv : h.items())
          if (std::none_of(fields.begin(), fields.end(), [&](const auto& f) { return kv.key() == f.spec.name; })) {
            const std::string known = field_names(fields);
            throw std::invalid_argument("option '" + g.name + "." + kv.key() + "' is not a field of a " +
                                        enum_name(g.algorithm) + " group in this build (its fields: " + known + ")");
          }
        for (const auto& f : fields) {
          const std::string key = g.name + "." + f.spec.name;
          const auto it = h.find(f.spec.name);
          if (it == h.end()) {
            if (f.spec.optional_in_json) continue;
            throw std::invalid_argument("option '" + key + "' is missing");
          }
          f.store(hyper, checked(f.spec, key, from_json_value(f.spec, key, *it)));
        }
      };
      if (g.algorithm == Algorithm::normuon)
        read_fields(normuon_fields(), g.normuon);
      else
        read_fields(adamw_fields(), g.adamw);
      o.groups.push_back(g);
    }
    return o;
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(std::string("options JSON: ") + e.what());
  }
}

std::vector<std::string> describe(const Options& o) {
  std::vector<std::string> out{"nonfinite=" + std::string(enum_name(o.nonfinite))};
  for (const auto& g : o.groups) {
    if (g.algorithm == Algorithm::normuon)
      for (const auto& f : normuon_fields()) out.push_back(g.name + "." + f.spec.name + "=" + value_text(f.load(g.normuon)));
    else
      for (const auto& f : adamw_fields()) out.push_back(g.name + "." + f.spec.name + "=" + value_text(f.load(g.adamw)));
  }
  return out;
}

double lr_scale_factor(LrScale rule, int64_t rows, int64_t cols) {
  const double m = static_cast<double>(rows), n = static_cast<double>(cols);
  switch (rule) {
    case LrScale::official: return std::sqrt(std::max(1.0, m / n));
    case LrScale::spectral: return std::sqrt(m / n);
    case LrScale::rms_matching: return 0.2 * std::sqrt(std::max(m, n));
  }
  throw std::logic_error("unknown lr_scale");
}

const char* to_string(Algorithm e) { return enum_name(e); }
const char* to_string(ReduceAxis e) { return enum_name(e); }
const char* to_string(NsCoefficients e) { return enum_name(e); }
const char* to_string(NsPrecision e) { return enum_name(e); }
const char* to_string(NsAlgorithm e) { return enum_name(e); }
const char* to_string(LrScale e) { return enum_name(e); }
const char* to_string(WeightDecayMode e) { return enum_name(e); }
const char* to_string(EpsPlacement e) { return enum_name(e); }
const char* to_string(NonFinitePolicy e) { return enum_name(e); }
Algorithm parse_algorithm(const std::string& text) { return parse_enum<Algorithm>("algorithm", text); }
NsAlgorithm parse_ns_algorithm(const std::string& text) { return parse_enum<NsAlgorithm>("ns_algorithm", text); }

}  // namespace normuon
