#include "normuon/row_runs.h"

#include <cstddef>

#include "normuon/low_precision.h"

namespace normuon {

void widen_rows(const void* data, DType dtype, const RowRuns& runs, int64_t begin, float* dst, int64_t n) {
  const size_t bytes = dtype_bytes(dtype);
  runs.for_each_piece(begin, n, [&](int64_t logical, int64_t physical, int64_t count) {
    widen(static_cast<const char*>(data) + static_cast<size_t>(physical) * bytes, dtype, dst + (logical - begin), count);
  });
}

void narrow_rows(const float* src, void* data, DType dtype, const RowRuns& runs, int64_t begin, int64_t n) {
  const size_t bytes = dtype_bytes(dtype);
  runs.for_each_piece(begin, n, [&](int64_t logical, int64_t physical, int64_t count) {
    narrow(src + (logical - begin), static_cast<char*>(data) + static_cast<size_t>(physical) * bytes, dtype, count);
  });
}

}  // namespace normuon
