#include "ns_elementwise.h"

#include "multiversion.h"
#include "ns_elementwise_loops.h"

namespace normuon::fast {
using namespace ns_loops;

NORMUON_MULTIVERSION void ns_load(const float* u, float* x, int64_t rows, int64_t cols, bool transpose) {
  load_into(u, x, rows, cols, transpose);
}
NORMUON_MULTIVERSION void ns_load(const float* u, Bf16* x, int64_t rows, int64_t cols, bool transpose) {
  load_into(u, x, rows, cols, transpose);
}
NORMUON_MULTIVERSION void ns_store(const float* x, float* o, int64_t rows, int64_t cols, bool transpose) {
  store_from(x, o, rows, cols, transpose);
}
NORMUON_MULTIVERSION void ns_store(const Bf16* x, float* o, int64_t rows, int64_t cols, bool transpose) {
  store_from(x, o, rows, cols, transpose);
}
NORMUON_MULTIVERSION double ns_sum_squares(const float* x, int64_t n) { return sum_squares(x, n); }
NORMUON_MULTIVERSION double ns_sum_squares(const Bf16* x, int64_t n) { return sum_squares(x, n); }
NORMUON_MULTIVERSION void ns_divide(float* x, float d, int64_t n) { divide(x, d, n); }
NORMUON_MULTIVERSION void ns_divide(Bf16* x, float d, int64_t n) { divide(x, d, n); }
NORMUON_MULTIVERSION void ns_scale(float* d, const float* a, float c, int64_t n) { scale(d, a, c, n); }
NORMUON_MULTIVERSION void ns_scale(Bf16* d, const Bf16* a, float c, int64_t n) { scale(d, a, c, n); }
NORMUON_MULTIVERSION void ns_scaled_add(float* d, const float* a, const float* g, float s, int64_t n) {
  scaled_add(d, a, g, s, n);
}
NORMUON_MULTIVERSION void ns_scaled_add(Bf16* d, const Bf16* a, const Bf16* g, float s, int64_t n) {
  scaled_add(d, a, g, s, n);
}
NORMUON_MULTIVERSION void ns_scaled_add_in_place(float* x, const float* g, float s, int64_t n) {
  scaled_add_in_place(x, g, s, n);
}
NORMUON_MULTIVERSION void ns_scaled_add_in_place(Bf16* x, const Bf16* g, float s, int64_t n) {
  scaled_add_in_place(x, g, s, n);
}

}  // namespace normuon::fast
