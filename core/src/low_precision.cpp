#include "normuon/low_precision.h"

#include <cstring>

namespace normuon {
namespace {

// The compiler's IEEE binary16: its conversions round to nearest even. GCC's C++ front end has no
// _Float16 on aarch64, where __fp16 is the same format (IEEE, not the alternative one, by default).
#if defined(__aarch64__)
using Half = __fp16;
#else
using Half = _Float16;  // GCC >= 12, Clang
#endif

}  // namespace

size_t dtype_bytes(DType dtype) { return dtype == DType::f32 ? 4 : 2; }

void widen(const void* src, DType src_dtype, float* dst, int64_t n) {
  switch (src_dtype) {
    case DType::f32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case DType::bf16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(s[i]);
      return;
    }
    case DType::f16: {
      const auto* s = static_cast<const Half*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
      return;
    }
  }
}

void narrow(const float* src, void* dst, DType dst_dtype, int64_t n) {
  switch (dst_dtype) {
    case DType::f32:
      if (dst != src) std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case DType::bf16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(src[i]);
      return;
    }
    case DType::f16: {
      auto* d = static_cast<Half*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = static_cast<Half>(src[i]);
      return;
    }
  }
}

float widen_one(const void* src, DType src_dtype, int64_t i) {
  float f;
  widen(static_cast<const char*>(src) + static_cast<size_t>(i) * dtype_bytes(src_dtype), src_dtype, &f, 1);
  return f;
}

}  // namespace normuon
