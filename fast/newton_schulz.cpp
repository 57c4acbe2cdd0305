#include "newton_schulz.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include <oneapi/dnnl/dnnl.hpp>

#include "cpu_kernels.h"
#include "normuon/ns_coefficients.h"

namespace normuon::fast {
namespace {

// Storage of the working precision: fp32 as float, bf16 as its upper 16 bits. Storing rounds (= P).
using Bf16 = uint16_t;
inline float load(float x) { return x; }
inline float load(Bf16 b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline void store(float& d, float x) { d = x; }
inline void store(Bf16& d, float x) {
  const float r = round_bf16(x);
  uint32_t u;
  std::memcpy(&u, &r, sizeof u);
  d = static_cast<Bf16>(u >> 16);
}
template <typename T>
inline float P(float x) {
  T t;
  store(t, x);
  return load(t);
}

struct Aligned {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit Aligned(size_t n) : bytes((n + 63) / 64 * 64 + 64) {
    ptr = std::aligned_alloc(64, bytes);
    if (!ptr) throw std::bad_alloc();
  }
  ~Aligned() { std::free(ptr); }
  Aligned(const Aligned&) = delete;
  Aligned& operator=(const Aligned&) = delete;
};

// The three batched products of one iteration, for one batch and one precision.
struct BatchPlan {
  int64_t m = 0, n = 0, count = 0;  // wide orientation: m <= n
  bool tall = false;                 // stored rows > cols: iterate on the transpose
  struct Gemm {
    dnnl::matmul prim;
    std::unordered_map<int, dnnl::memory> args;
    std::string impl;
  };
  Gemm gram[2], square[2], apply[2];  // [precision]: X X^T, (cA) A, B X
};

}  // namespace

struct BatchedNewtonSchulz::Impl {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  std::vector<BatchPlan> plans;
  std::unique_ptr<Aligned> x, g, a, ca, scratch;  // workspace, sized for the largest batch in fp32
  std::vector<float> divisor;                     // per matrix of a batch

  void make_gemm(BatchPlan::Gemm& gemm, int64_t count, int64_t M, int64_t K, int64_t N, bool weights_transposed,
                 void* src, void* wei, void* dst, dnnl::memory::data_type dt, size_t& scratch_bytes) {
    using dims = dnnl::memory::dims;
    const dnnl::memory::desc src_md(dims{count, M, K}, dt, dims{M * K, K, 1});
    // X^T without a copy: the same buffer read with swapped strides.
    const dnnl::memory::desc wei_md(dims{count, K, N}, dt,
                                    weights_transposed ? dims{K * N, 1, K} : dims{K * N, N, 1});
    const dnnl::memory::desc dst_md(dims{count, M, N}, dt, dims{M * N, N, 1});
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src_md, wei_md, dst_md), attr, engine);
    gemm.prim = dnnl::matmul(pd);
    gemm.impl = pd.impl_info_str();
    scratch_bytes = std::max(scratch_bytes, pd.scratchpad_desc().get_size());
    gemm.args = {{DNNL_ARG_SRC, dnnl::memory(src_md, engine, src)},
                 {DNNL_ARG_WEIGHTS, dnnl::memory(wei_md, engine, wei)},
                 {DNNL_ARG_DST, dnnl::memory(dst_md, engine, dst)}};
  }

  template <typename T>
  void iterate(BatchPlan& plan, int prec, const float* const* inputs, float* const* outputs, const NorMuonHyper& h,
               int64_t& gemm_calls) {
    const int64_t m = plan.m, n = plan.n, count = plan.count, mn = m * n, mm = m * m;
    T* X = static_cast<T*>(x->ptr);
    T* G = static_cast<T*>(g->ptr);
    T* A = static_cast<T*>(a->ptr);
    T* CA = static_cast<T*>(ca->ptr);
    const bool quintic = h.ns_coefficients == NsCoefficients::quintic;
    const float ns_eps = static_cast<float>(h.ns_eps);

    // X = P(U), wide orientation, then X = P(X / P(||X|| + eps)) per matrix.
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < count; ++k) {
      const float* u = inputs[k];
      T* xk = X + k * mn;
      if (plan.tall) {
        for (int64_t i = 0; i < n; ++i)  // u is n x m as stored
          for (int64_t j = 0; j < m; ++j) store(xk[j * n + i], u[i * m + j]);
      } else {
        for (int64_t i = 0; i < mn; ++i) store(xk[i], u[i]);
      }
      double sq = 0;
      for (int64_t i = 0; i < mn; ++i) sq += static_cast<double>(load(xk[i])) * load(xk[i]);
      const float norm = P<T>(static_cast<float>(std::sqrt(sq)));
      const float d = quintic ? P<T>(norm + ns_eps) : P<T>(P<T>(norm * static_cast<float>(kPolarExpressSafety)) + ns_eps);
      for (int64_t i = 0; i < mn; ++i) store(xk[i], load(xk[i]) / d);
    }
    auto exec = [&](BatchPlan::Gemm& gemm) {
      gemm.prim.execute(stream, gemm.args);
      stream.wait();
      ++gemm_calls;
    };
    for (int it = 0; it < h.ns_steps; ++it) {
      // Coefficients enter as fp32 values (docs/spec.md section 3.2).
      const NsTriple& t = ns_triple(h.ns_coefficients, it);
      const float coef_a = static_cast<float>(t.a), coef_b = static_cast<float>(t.b), coef_c = static_cast<float>(t.c);
      exec(plan.gram[prec]);  // A = P(X X^T)
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < count * mm; ++i) store(CA[i], coef_c * load(A[i]));  // CA = P(c A)
      exec(plan.square[prec]);  // G = P(CA A)
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < count * mm; ++i) store(CA[i], P<T>(coef_b * load(A[i])) + load(G[i]));  // B
      exec(plan.apply[prec]);  // G = P(B X)
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < count * mn; ++i) store(X[i], P<T>(coef_a * load(X[i])) + load(G[i]));
    }
    // O back to fp32, stored orientation.
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < count; ++k) {
      const T* xk = X + k * mn;
      float* o = outputs[k];
      if (plan.tall) {
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < m; ++j) o[i * m + j] = load(xk[j * n + i]);
      } else {
        for (int64_t i = 0; i < mn; ++i) o[i] = load(xk[i]);
      }
    }
  }
};

BatchedNewtonSchulz::BatchedNewtonSchulz(const std::vector<NsBatchShape>& batches) : impl_(new Impl) {
  int64_t max_mn = 1, max_mm = 1;
  for (const auto& b : batches) {
    const int64_t m = std::min(b.rows, b.cols), n = std::max(b.rows, b.cols);
    max_mn = std::max(max_mn, b.count * m * n);
    max_mm = std::max(max_mm, b.count * m * m);
  }
  impl_->x = std::make_unique<Aligned>(max_mn * sizeof(float));
  impl_->g = std::make_unique<Aligned>(max_mn * sizeof(float));  // holds m x m and m x n products
  impl_->a = std::make_unique<Aligned>(max_mm * sizeof(float));
  impl_->ca = std::make_unique<Aligned>(max_mm * sizeof(float));
  size_t scratch_bytes = 0;
  for (const auto& b : batches) {
    BatchPlan plan;
    plan.m = std::min(b.rows, b.cols);
    plan.n = std::max(b.rows, b.cols);
    plan.count = b.count;
    plan.tall = b.rows > b.cols;
    if (plan.m > 0 && plan.count > 0)
      for (int prec = 0; prec < 2; ++prec) {
        const auto dt = prec == 0 ? dnnl::memory::data_type::f32 : dnnl::memory::data_type::bf16;
        void *X = impl_->x->ptr, *G = impl_->g->ptr, *A = impl_->a->ptr, *CA = impl_->ca->ptr;
        impl_->make_gemm(plan.gram[prec], plan.count, plan.m, plan.n, plan.m, true, X, X, A, dt, scratch_bytes);
        impl_->make_gemm(plan.square[prec], plan.count, plan.m, plan.m, plan.m, false, CA, A, G, dt, scratch_bytes);
        impl_->make_gemm(plan.apply[prec], plan.count, plan.m, plan.m, plan.n, false, CA, X, G, dt, scratch_bytes);
      }
    impl_->plans.push_back(std::move(plan));
  }
  impl_->scratch = std::make_unique<Aligned>(std::max<size_t>(scratch_bytes, 64));
  const dnnl::memory::desc scratch_md({static_cast<int64_t>(scratch_bytes)}, dnnl::memory::data_type::u8,
                                      dnnl::memory::format_tag::a);
  const dnnl::memory scratch(scratch_md, impl_->engine, impl_->scratch->ptr);
  for (auto& plan : impl_->plans)
    for (int prec = 0; prec < 2 && plan.m > 0 && plan.count > 0; ++prec)
      for (BatchPlan::Gemm* gemm : {&plan.gram[prec], &plan.square[prec], &plan.apply[prec]})
        gemm->args[DNNL_ARG_SCRATCHPAD] = scratch;
}

BatchedNewtonSchulz::~BatchedNewtonSchulz() = default;

int64_t BatchedNewtonSchulz::workspace_bytes() const {
  size_t total = 0;
  for (const auto* buffer : {&impl_->x, &impl_->g, &impl_->a, &impl_->ca, &impl_->scratch}) total += (*buffer)->bytes;
  return static_cast<int64_t>(total);
}

void BatchedNewtonSchulz::run(int b, const float* const* inputs, float* const* outputs, const NorMuonHyper& h) {
  if (h.ns_coefficients == NsCoefficients::polar_express && h.ns_steps > kPolarExpressSteps)
    throw std::invalid_argument("ns_steps=" + std::to_string(h.ns_steps) +
                                " but the Polar Express schedule has 5 coefficient triples");
  BatchPlan& plan = impl_->plans.at(static_cast<size_t>(b));
  if (plan.m == 0 || plan.count == 0) return;
  if (h.ns_precision == NsPrecision::bf16)
    impl_->iterate<Bf16>(plan, 1, inputs, outputs, h, gemm_calls_);
  else
    impl_->iterate<float>(plan, 0, inputs, outputs, h, gemm_calls_);
}

std::string BatchedNewtonSchulz::gemm_implementation(int b, NsPrecision p) const {
  const BatchPlan& plan = impl_->plans.at(static_cast<size_t>(b));
  return plan.m > 0 && plan.count > 0 ? plan.gram[p == NsPrecision::bf16 ? 1 : 0].impl : "none";
}

}  // namespace normuon::fast
