// cuBLASLt's strided-batched column-major matmul, emulated on the host, for the Newton-Schulz GEMM plan
// (fast/cuda/ns_gemm_plan.h): D = op(A) op(B) for every batch entry, after checking each layout the
// plan would hand to cuBLASLt (sizes, ld, batch entries that do not overlap and stay inside their
// buffer). Elements of type T are read as Acc and summed in Acc in k order; the sum is rounded once to T
// (bf16: to nearest even). That is cuBLASLt's contract for fp32 compute with bf16 or fp32 data (alpha 1,
// beta 0); its summation order is its own, so results agree with a GPU to rounding, not bit for bit.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "ns_gemm_plan.h"

namespace normuon::test {

// A plan the emulator refuses (a cuBLASLt dimension rule or a buffer bound broken).
struct LayoutError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A whole buffer: where it starts and how many elements it has.
template <typename T>
struct LtBuffer {
  T* data = nullptr;
  int64_t size = 0;
};

namespace lt_detail {

inline void require(bool ok, const std::string& what) {
  if (!ok) throw LayoutError(what);
}

// One layout as cuBLASLt is told it, at its offset into each matrix (a panel's corner): sane sizes,
// inside its own matrix (so batch entries do not overlap), inside the buffer.
inline void check_layout(const char* name, const cuda::NsMatrixSpec& m, int64_t stride, int64_t count,
                         int64_t buffer_size) {
  const std::string n = name;
  require(m.rows >= 1 && m.cols >= 1, n + ": empty matrix");
  require(m.ld >= m.rows, n + ": ld < rows");
  require(m.offset >= 0, n + ": negative offset");
  const int64_t extent = m.offset + m.ld * (m.cols - 1) + m.rows;
  require(extent <= stride, n + ": batch entries overlap (offset + extent > stride)");
  require((count - 1) * stride + extent <= buffer_size, n + ": past the end of its buffer");
}

template <typename Acc, typename T>
Acc load(T x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return static_cast<Acc>(__bfloat162float(x));
  else
    return static_cast<Acc>(x);
}

template <typename T, typename Acc>
T store(Acc x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __float2bfloat16_rn(static_cast<float>(x));
  else
    return static_cast<T>(x);
}

}  // namespace lt_detail

// Whether `g` runs on the cuBLASLt plan made for `planned` (newton_schulz_cuda.cu plans a layout once and
// runs it on other operands): the same transposes, sizes, leading dimensions, batch strides and offsets
// (the alignment cuBLASLt's algorithm was chosen for).
inline bool same_layout(const cuda::NsGemmSpec& g, const cuda::NsGemmSpec& planned) {
  auto same = [](const cuda::NsMatrixSpec& m, const cuda::NsMatrixSpec& p) {
    const bool x_shaped = cuda::ns_batch_stride(m.operand, 1, 0) == 1, planned_x_shaped = cuda::ns_batch_stride(p.operand, 1, 0) == 1;
    return m.rows == p.rows && m.cols == p.cols && m.ld == p.ld && m.offset == p.offset && x_shaped == planned_x_shaped;
  };
  return g.trans_a == planned.trans_a && g.trans_b == planned.trans_b && same(g.a, planned.a) && same(g.b, planned.b) &&
         same(g.d, planned.d);
}

// The GEMM `g` of the plan over `count` batch entries; the operands' buffers as `buf` names them.
template <typename Acc, typename T>
void lt_matmul(const cuda::NsGemmSpec& g, const cuda::NsBuffers<LtBuffer<T>>& buf, int64_t count, int64_t x_stride,
               int64_t gram_stride) {
  using lt_detail::require;
  const cuda::NsGemmPointers<LtBuffer<T>> p = cuda::ns_gemm_pointers(g, buf);
  const int64_t sa = cuda::ns_batch_stride(g.a.operand, x_stride, gram_stride);
  const int64_t sb = cuda::ns_batch_stride(g.b.operand, x_stride, gram_stride);
  const int64_t sd = cuda::ns_batch_stride(g.d.operand, x_stride, gram_stride);
  lt_detail::check_layout("A", g.a, sa, count, p.a.size);
  lt_detail::check_layout("B", g.b, sb, count, p.b.size);
  lt_detail::check_layout("D", g.d, sd, count, p.d.size);
  // op(A) is m x k, op(B) is k x n.
  const int64_t m = g.trans_a ? g.a.cols : g.a.rows;
  const int64_t k = g.trans_a ? g.a.rows : g.a.cols;
  const int64_t kb = g.trans_b ? g.b.cols : g.b.rows;
  const int64_t n = g.trans_b ? g.b.rows : g.b.cols;
  require(k == kb, "op(A) has " + std::to_string(k) + " columns, op(B) " + std::to_string(kb) + " rows");
  require(g.d.rows == m && g.d.cols == n, "D is " + std::to_string(g.d.rows) + "x" + std::to_string(g.d.cols) +
                                              ", op(A) op(B) " + std::to_string(m) + "x" + std::to_string(n));
  require(p.d.data != p.a.data && p.d.data != p.b.data, "D overwrites an input of the same GEMM");

  for (int64_t q = 0; q < count; ++q) {
    const T* a = p.a.data + q * sa + g.a.offset;
    const T* b = p.b.data + q * sb + g.b.offset;
    T* d = p.d.data + q * sd + g.d.offset;
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < m; ++i) {
        Acc sum = 0;
        for (int64_t t = 0; t < k; ++t) {
          const Acc av = lt_detail::load<Acc>(g.trans_a ? a[t + i * g.a.ld] : a[i + t * g.a.ld]);
          const Acc bv = lt_detail::load<Acc>(g.trans_b ? b[j + t * g.b.ld] : b[t + j * g.b.ld]);
          sum += av * bv;
        }
        d[i + j * g.d.ld] = lt_detail::store<T>(sum);
      }
  }
}

}  // namespace normuon::test
