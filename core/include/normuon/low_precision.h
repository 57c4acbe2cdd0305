// fp32 <-> bf16 / fp16 for the caller's tensors of table mode: widening is exact, narrowing rounds to
// nearest even as torch's .to(dtype) does (NaN stays NaN), so a parameter written back from its fp32
// master holds the bits torch would give it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "normuon/manifest.h"

namespace normuon {

// One bf16 value (its 16 bits) to fp32 and back, as c10::BFloat16 converts: widening is exact, narrowing
// rounds to nearest even and makes every NaN the quiet 0x7fc0. Inline, so that loops over them vectorise.
inline float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

size_t dtype_bytes(DType dtype);  // 4, 2, 2

void widen(const void* src, DType src_dtype, float* dst, int64_t n);   // dst = float(src)
void narrow(const float* src, void* dst, DType dst_dtype, int64_t n);  // dst = round(src); f32: a copy
float widen_one(const void* src, DType src_dtype, int64_t i);           // float(src[i])

}  // namespace normuon
