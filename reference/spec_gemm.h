// The spec's GEMM (docs/spec.md section 3.2, "Rounding inside NS") on the CPU: every output element is
// one fp32 fma chain over the inner dimension in increasing order,
//     acc = +0;  for k = 0 .. K-1: acc = fma(A[i,k], B[k,j], acc);  C[i,j] = P(acc)
// so its bits follow from the spec alone: the same on every processor, ISA level and thread count (each
// element is computed by one chain; blocking only stores and reloads the fp32 accumulator, which is
// exact). The CUDA reference computes the same chain per thread.
#pragma once

#include <cstdint>

namespace normuon::spec {

// The instruction sets the chains can run on. Every one gives the same bits (each fma is one rounding, on
// any of them); the fastest the processor has is used, or the one NORMUON_REFERENCE_ISA names (scalar,
// avx2, avx512, neon), which lets a test run the whole reference on each.
enum class GemmIsa { scalar, avx2, avx512, neon };
const char* to_string(GemmIsa isa);
bool gemm_isa_available(GemmIsa isa);
GemmIsa gemm_isa();  // the one gemm() uses; throws std::invalid_argument for a bad NORMUON_REFERENCE_ISA

// C (m x n) = P(A (m x k) . B (k x n)); all row-major, dense, fp32. C must not alias A or B. Runs on the
// OpenMP threads (the result does not depend on how many).
void gemm(const float* A, const float* B, float* C, int64_t m, int64_t k, int64_t n, bool bf16);
// C (m x n) = P(A (m x k) . B^T), B given as n x k (X X^T without a transposed copy): the same chains.
void gemm_abt(const float* A, const float* B, float* C, int64_t m, int64_t k, int64_t n, bool bf16);
// Either, on a given instruction set (throws std::invalid_argument where it is unavailable); b_rows: B is
// given as n x k.
void gemm_on(GemmIsa isa, const float* A, const float* B, bool b_rows, float* C, int64_t m, int64_t k, int64_t n,
             bool bf16);

}  // namespace normuon::spec
