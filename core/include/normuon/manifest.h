// The parameter manifest: what a model's optimizer sees (name, shape, dtype, role, group), and the
// routing rule that picks NorMuon or AdamW for each parameter. Read from and written to CSV.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

#include "normuon/options.h"

namespace normuon {

// The most elements one parameter may have, and the most floats a layout buffer may hold (layout.h):
// 2^40, about 1.1e12 (4 TiB of fp32 per buffer). Far above what one optimizer process holds, and low enough
// that every offset and byte count of a layout fits int64 with room to spare.
constexpr int64_t kMaxParamElements = int64_t{1} << 40;

// dtype of the model's parameter. The optimizer keeps fp32 master values and fp32 state for all of them.
enum class DType { f32, bf16, f16 };

// What a parameter is in the model; routing reads it.
// router: a MoE's gate. experts: a MoE's bank of expert matrices [E, m, n] (transformers 5.x, torchtitan), E
// NorMuon matrices of their own; a layout takes its experts as E entries of [m, n] (expert_name), role experts.
enum class Role { matrix, embedding, head, norm, bias, other, router, experts };

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;               // empty = scalar
  DType dtype = DType::f32;
  Role role = Role::other;
  std::string group;                        // empty = the default group of its algorithm
  std::optional<Algorithm> algorithm;       // explicit override of the routing rule
  // Stored [in, out], transposed against its module's [out, in] (GPT-2's Conv1D; for a bank, each expert):
  // the statistics axis and NorMuon's shape factor follow the module (docs/spec.md section 3.1).
  bool transposed = false;

  int64_t numel() const;
};

struct Manifest {
  std::vector<ParamSpec> params;

  // Checks names (non-empty, unique), shapes (no negative extents, at most kMaxParamElements elements),
  // overrides (NorMuon only on 2-D) and transposition (only of a matrix or a bank). Throws
  // std::invalid_argument naming the offending parameter.
  void validate() const;

  // CSV with header: name,shape,dtype,role,group,algorithm[,transposed]
  //   shape: extents joined by 'x' ("768x3072"), "" for a scalar; dtype: f32|bf16|f16;
  //   role: matrix|embedding|head|norm|bias|other|router|experts; group: free text or empty;
  //   algorithm: auto|normuon|adamw; transposed: yes|no|"" (written only when a parameter is).
  // Errors name the line and the column.
  static Manifest read_csv(std::istream& in, const std::string& source_name = "<csv>");
  static Manifest read_csv_file(const std::string& path);
  void write_csv(std::ostream& out) const;
  int64_t numel() const;
};

// The spec's routing rule: NorMuon for 2-D parameters that are neither embeddings, the output head, a router
// nor biases, and for expert banks (role experts, 3-D: E matrices); AdamW for everything else. An explicit
// override wins, but NorMuon on anything but a matrix or a bank is an error.
Algorithm route(const ParamSpec& p);
// Whether a parameter can be stored transposed: a matrix, or an expert bank (role experts, 3-D).
bool transposable(const ParamSpec& p);
// Expert k of bank `name`, as a layout names the matrix it lays out for it: "name[k]".
std::string expert_name(const std::string& bank, int64_t k);
// Group of a parameter: its own, or "normuon"/"adamw" by algorithm.
std::string resolved_group(const ParamSpec& p);

const char* to_string(DType);
const char* to_string(Role);
DType parse_dtype(const std::string&);
Role parse_role(const std::string&);
std::string shape_to_string(const std::vector<int64_t>& shape);  // "768x3072", "" for scalar
std::vector<int64_t> parse_shape(const std::string&);           // throws std::invalid_argument

}  // namespace normuon
