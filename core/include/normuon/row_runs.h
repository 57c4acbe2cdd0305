// Where the rows of a matrix lie in a caller's tensor: dense, or in runs of whole rows a fixed pitch
// apart (a block of rows of a larger tensor), and reading / writing a matrix's elements through them.
#pragma once

#include <algorithm>
#include <cstdint>

#include "normuon/manifest.h"

namespace normuon {

// Dense, or runs of `run` elements (whole rows) that start `pitch` elements apart. One block of Megatron's
// fused QKV weight is such a matrix: its rows of every query group, stepped in place as a matrix of its own
// (run = the block's rows, pitch = the rows of a query group, both times the columns). Allowed on NorMuon
// matrices only (ParamTable::invalid_reason).
struct RowRuns {
  int64_t run = 0, pitch = 0;  // elements; run == 0: dense

  bool dense() const { return run == 0; }
  // Where element i of the matrix lies, counted from the tensor's first element.
  int64_t at(int64_t i) const { return run == 0 ? i : (i / run) * pitch + i % run; }
  // f(logical, physical, n) over the contiguous pieces of elements [begin, begin + n).
  template <class F>
  void for_each_piece(int64_t begin, int64_t n, F&& f) const {
    if (run == 0) {
      if (n > 0) f(begin, begin, n);
      return;
    }
    for (int64_t i = begin, end = begin + n; i < end;) {
      const int64_t piece = std::min(end - i, run - i % run);
      f(i, at(i), piece);
      i += piece;
    }
  }
};

// widen / narrow elements [begin, begin + n) of a matrix whose rows lie in `runs` of the tensor at `data`.
void widen_rows(const void* data, DType dtype, const RowRuns& runs, int64_t begin, float* dst, int64_t n);
void narrow_rows(const float* src, void* data, DType dtype, const RowRuns& runs, int64_t begin, int64_t n);

}  // namespace normuon
