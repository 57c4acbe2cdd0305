// The one parameter layout shared by every backend: a manifest plus options become flat fp32 buffers
// with 64-byte aligned slots, NorMuon matrices grouped into shape buckets, and a fingerprint.
//
// Placement (docs/layout-and-state.md):
//   param / grad buffers:  [ NorMuon bucket 0 | bucket 1 | ... | AdamW parameters in manifest order ]
//   momentum buffer:       same offsets as the NorMuon part of the param buffer
//   row_var buffer:        one slot per NorMuon matrix (its second moment, length rows or cols)
//   exp_avg / exp_avg_sq:  same offsets as the AdamW part of the param buffer, minus its start
//   masters (table mode):  one slot per bf16 / fp16 parameter, in manifest order
// Buckets are numbered in order of first appearance in the manifest; inside a bucket, manifest order.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "normuon/manifest.h"
#include "normuon/options.h"

namespace normuon {

constexpr int64_t kAlignFloats = 16;  // 64 bytes: one cache line, one AVX-512 vector

inline int64_t align_up(int64_t n) { return (n + kAlignFloats - 1) / kAlignFloats * kAlignFloats; }

// The most floats one layout buffer (params, momentum, row_var, exp_avg, masters) may hold, padding
// included: 2^40 like the per-parameter limit, so every offset, and every byte count (x4), fits int64.
constexpr int64_t kMaxLayoutFloats = kMaxParamElements;

struct LayoutEntry {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype = DType::f32;
  Role role = Role::other;
  Algorithm algorithm = Algorithm::adamw;
  int group = 0;          // index into Options::groups
  int64_t numel = 0;
  int64_t offset = 0;     // in the param and grad buffers
  // NorMuon only
  int64_t rows = 0, cols = 0;
  int bucket = -1;
  bool stats_per_row = true;  // second moment per row (length rows) or per column (length cols)
  bool transposed = false;    // stored [in, out] (ParamSpec::transposed): rows and cols above are the stored ones
  int64_t stat_offset = 0, stat_len = 0;
  // AdamW only: offset in exp_avg / exp_avg_sq
  int64_t adam_offset = 0;
  // bf16 / fp16 parameters only: offset of the fp32 master in the masters buffer of table mode
  // (core/include/normuon/param_table.h); -1 for fp32 parameters, whose own tensor is the master.
  int64_t master_offset = -1;
};

struct ShapeBucket {
  int64_t rows = 0, cols = 0;
  int64_t stride = 0;        // floats between consecutive matrices of the bucket (aligned rows*cols)
  int64_t offset = 0;        // of its first matrix in the param buffer
  std::vector<int> entries;  // layout entry indices, in manifest order
};

struct Layout {
  std::vector<LayoutEntry> entries;  // manifest order
  std::vector<ShapeBucket> buckets;
  std::vector<std::string> group_names;  // Options::groups order
  std::vector<int> adamw_entries;        // manifest order
  int64_t param_floats = 0;    // size of the param and grad buffers
  int64_t normuon_floats = 0;  // prefix of the param buffer that holds NorMuon matrices (= momentum size)
  int64_t stat_floats = 0;     // size of the row_var buffer
  int64_t adam_floats = 0;     // size of exp_avg and exp_avg_sq
  int64_t master_floats = 0;   // size of the masters buffer of table mode (low-precision parameters)
  // FNV-1a over names, shapes, dtypes, algorithms, groups, transposition and all offsets but the master
  // offsets, which follow from the dtypes (so state files of earlier versions keep their fingerprint).
  uint64_t fingerprint = 0;

  // Validates the manifest, routes every parameter, checks its group exists and matches its algorithm.
  // A buffer that would exceed kMaxLayoutFloats is an std::invalid_argument naming the parameter at
  // which it does.
  static Layout build(const Manifest& manifest, const Options& options);

  int find(const std::string& name) const;  // -1 when absent
  std::string fingerprint_hex() const;
  std::string describe() const;             // human-readable routing table and buckets
};

// A NorMuon entry's matrix as its module has it, [out, in]: (rows, cols), or (cols, rows) when transposed. The
// statistics axis and the shape factor kappa follow it (docs/spec.md section 3.1, steps 4 and 9).
std::pair<int64_t, int64_t> module_shape(const LayoutEntry& e);
// kappa of a NorMuon entry under an lr_scale rule: lr_scale_factor on its module's shape.
double entry_kappa(const LayoutEntry& e, LrScale rule);

// The Newton-Schulz batches every fast backend runs: the NorMuon matrices of one shape bucket that share
// a group (and so the Newton-Schulz knobs). Buckets in layout order; within a bucket, groups in order of
// first appearance, entries in manifest order.
struct NsBatch {
  int group = 0;
  int64_t rows = 0, cols = 0;
  std::vector<int> entries;  // layout entry indices
};
std::vector<NsBatch> newton_schulz_batches(const Layout& layout);

// Why these options cannot drive the fused backends' steps over this layout (a group count other than the
// layout's, a Polar Express schedule longer than its 5 triples), or empty. The fused backends check it at
// construction; the reference checks the same per step.
std::string fused_step_unsupported_reason(const Layout& layout, const Options& options);

uint64_t fnv1a64(const void* data, size_t size, uint64_t seed = 1469598103934665603ull);

}  // namespace normuon
