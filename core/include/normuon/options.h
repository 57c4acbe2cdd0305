// Hyper-parameters and variant knobs of the NorMuon + AdamW hybrid (docs/spec.md is the normative text).
// Framework-free: used by every backend, by the state file and by the command line.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace normuon {

// A value an option cannot take. what() reads "option 'KEY': VALUE PROBLEM" ("option 'KEY': PROBLEM" when
// value is empty); the parts are kept for callers that name the value their own way (the Megatron adapter
// names its own keys), so that no caller parses the text.
struct OptionError : std::invalid_argument {
  OptionError(std::string key, std::string value, std::string problem);
  std::string key;      // GROUP.FIELD, or FIELD
  std::string value;    // as written in the message ("1.5", "'foo'"), or empty
  std::string problem;  // "is outside [0, 1)", "is not a finite number", ...
};

enum class Algorithm { normuon, adamw };

// Axis whose length the NorMuon second moment has (the "neuron" axis).
enum class ReduceAxis {
  rows,        // official normuon.py: one statistic per row (mean over columns)
  longer_dim,  // modded-nanogpt / nanochat / Emerging-Optimizers: per row if rows >= cols, else per column
};
enum class NsCoefficients { quintic, polar_express };
enum class NsPrecision { fp32, bf16 };
// How Newton-Schulz iterates (docs/spec.md section 3.2): on X itself, or on the Gram matrix X X^T
// (Dao AI Lab's Gram Newton-Schulz; square matrices take the standard iteration either way).
enum class NsAlgorithm { standard, gram };
enum class LrScale {
  official,      // max(1, rows/cols)^0.5   (Keller Muon, official NorMuon)
  spectral,      // (rows/cols)^0.5         (dion "spectral_norm")
  rms_matching,  // 0.2 * max(rows, cols)^0.5 (torch.optim.Muon "match_rms_adamw", Moonlight)
};
enum class WeightDecayMode {
  decoupled,  // p *= 1 - lr*wd
  cautious,   // p -= lr*wd * p * [update*p >= 0]
  none,
};
// Where the 1e-10 of the NorMuon denominator goes.
enum class EpsPlacement {
  add,    // 1 / (sqrt(v) + eps)       official
  clamp,  // 1 / sqrt(max(v, eps))     modded-nanogpt, nanochat
};
// What a step does when a gradient holds NaN or Inf.
enum class NonFinitePolicy {
  error,      // throw before anything is changed, naming the parameter
  skip_step,  // leave every parameter, state tensor and step counter untouched, report it
};

struct NorMuonHyper {
  double lr = 0.02;
  double beta1 = 0.95;
  double beta2 = 0.95;
  double weight_decay = 0.0;
  bool nesterov = true;
  int ns_steps = 5;
  NsCoefficients ns_coefficients = NsCoefficients::quintic;
  NsPrecision ns_precision = NsPrecision::bf16;
  NsAlgorithm ns_algorithm = NsAlgorithm::standard;
  ReduceAxis reduce_axis = ReduceAxis::rows;
  LrScale lr_scale = LrScale::official;
  WeightDecayMode weight_decay_mode = WeightDecayMode::decoupled;
  EpsPlacement eps_placement = EpsPlacement::add;
  double ns_eps = 1e-7;      // Newton-Schulz input normalisation: X / (||X||_F + ns_eps)
  double denom_eps = 1e-10;  // second-moment denominator
  double renorm_eps = 1e-10; // Frobenius re-norm: nu / (nu' + renorm_eps)
};

// torch.optim.AdamW semantics; default values of the official NorMuonWithAuxAdam's Adam groups.
struct AdamWHyper {
  double lr = 3e-4;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-10;
  double weight_decay = 0.0;
};

// A hyper-parameter group: one algorithm, one set of values, one step counter (kept in the state).
struct GroupOptions {
  std::string name;
  Algorithm algorithm = Algorithm::normuon;
  NorMuonHyper normuon;
  AdamWHyper adamw;
};

// A hyper-parameter field as the options know it: its name, kind and valid values. The one table of them
// is in options.cpp; bindings and the command line read it from here rather than restating it.
struct FieldSpec {
  enum class Kind { number, integer, boolean, choice };
  std::string name;
  Kind kind = Kind::number;
  double lo = 0, hi = 0;  // number: [lo, hi], or [lo, hi) with below_hi; integer: [lo, hi]
  bool below_hi = false;
  std::vector<std::string> choices;  // choice
  bool optional_in_json = false;     // added after state files existed: a file without it keeps the default
};
// A field's value in its kind: number and integer fields take a double (an integer one a whole number),
// boolean ones a bool (or 0 / 1), choice ones the choice's name.
using FieldValue = std::variant<double, bool, std::string>;

struct Options {
  NonFinitePolicy nonfinite = NonFinitePolicy::error;
  std::vector<GroupOptions> groups;  // default: "normuon" and "adamw"

  Options();
  const GroupOptions& group(const std::string& name) const;  // throws naming the group
  GroupOptions& group(const std::string& name);
  const GroupOptions* find_group(const std::string& name) const;

  // "key=value" setters. Keys: "nonfinite", "GROUP.FIELD" (e.g. "normuon.lr", "adamw.beta2"), or
  // "FIELD" alone, which applies to every group whose algorithm has that field. Unknown keys or bad
  // values throw std::invalid_argument with the list of valid choices.
  void set(const std::string& key, const std::string& value);
  void set(const std::string& assignment);  // "key=value"
  // Typed values for one group (by index), checked as set() checks text, and together
  // (group_values_invalid_reason); all or nothing: on an error (std::invalid_argument naming GROUP.FIELD
  // or the group) nothing changed.
  void set_group(size_t group, const std::vector<std::pair<std::string, FieldValue>>& values);
  FieldValue get(size_t group, const std::string& field) const;  // throws for an unknown field

  // The fields of a group of this algorithm, in order.
  static std::vector<FieldSpec> fields(Algorithm algorithm);

  // Lossless text form (JSON object); doubles are written with 17 significant digits.
  std::string to_json() const;
  static Options from_json(const std::string& text);  // throws std::invalid_argument
};

// Why a group's values cannot run together (a Polar Express schedule longer than its 5 triples), or empty.
std::string group_values_invalid_reason(const GroupOptions& g);

// Shape factor kappa of an lr_scale rule for a rows x cols matrix (docs/spec.md section 3.1, step 9).
double lr_scale_factor(LrScale rule, int64_t rows, int64_t cols);

const char* to_string(Algorithm);
const char* to_string(ReduceAxis);
const char* to_string(NsCoefficients);
const char* to_string(NsPrecision);
const char* to_string(NsAlgorithm);
const char* to_string(LrScale);
const char* to_string(WeightDecayMode);
const char* to_string(EpsPlacement);
const char* to_string(NonFinitePolicy);
Algorithm parse_algorithm(const std::string&);
NsAlgorithm parse_ns_algorithm(const std::string&);  // "standard" | "gram"; throws listing them

// Every settable key with its current value, one "key=value" per entry (for --help and logs).
std::vector<std::string> describe(const Options&);

}  // namespace normuon
