// fp32 <-> bf16 / fp16 for the caller's tensors of table mode: widening is exact, narrowing rounds to
// nearest even as torch's .to(dtype) does (NaN stays NaN), so a parameter written back from its fp32
// master holds the bits torch would give it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "normuon/manifest.h"

namespace normuon {

size_t dtype_bytes(DType dtype);  // 4, 2, 2

void widen(const void* src, DType src_dtype, float* dst, int64_t n);   // dst = float(src)
void narrow(const float* src, void* dst, DType dst_dtype, int64_t n);  // dst = round(src); f32: a copy
float widen_one(const void* src, DType src_dtype, int64_t i);           // float(src[i])

}  // namespace normuon
