#include "newton_schulz.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include <omp.h>
#include <oneapi/dnnl/dnnl.hpp>

#include "cpu_kernels.h"
#include "normuon/ns_coefficients.h"
#include "work_pool.h"

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

// Sets this thread's OpenMP team size for one scope. oneDNN plans a primitive for the team of the thread
// that creates it and runs it with (at most) that many threads.
class OmpThreads {
 public:
  explicit OmpThreads(int n) : saved_(omp_get_max_threads()) { omp_set_num_threads(n); }
  ~OmpThreads() { omp_set_num_threads(saved_); }
  OmpThreads(const OmpThreads&) = delete;
  OmpThreads& operator=(const OmpThreads&) = delete;

 private:
  int saved_;
};

// One product of the iteration, for one batch and one precision.
struct Gemm {
  dnnl::matmul prim;
  std::vector<std::unordered_map<int, dnnl::memory>> args;  // per pool slot (per matrix), or one (batched)
  std::string impl;
};

struct BatchPlan {
  int64_t m = 0, n = 0, count = 0;  // wide orientation: m <= n
  bool tall = false;                 // stored rows > cols: iterate on the transpose
  bool per_matrix = false;           // a matrix per pool item, else the whole batch on oneDNN's threads
  Gemm gram[2], square[2], apply[2];  // [precision]: X X^T, (cA) A, B X
};

// X = P(U) in the wide orientation, then X = P(X / P(||X|| + eps)), for one matrix.
template <typename T>
void load_normalised(const BatchPlan& plan, const float* u, T* xk, const NorMuonHyper& h) {
  const int64_t m = plan.m, n = plan.n, mn = m * n;
  if (plan.tall) {
    for (int64_t i = 0; i < n; ++i)  // u is n x m as stored
      for (int64_t j = 0; j < m; ++j) store(xk[j * n + i], u[i * m + j]);
  } else {
    for (int64_t i = 0; i < mn; ++i) store(xk[i], u[i]);
  }
  double sq = 0;
  for (int64_t i = 0; i < mn; ++i) sq += static_cast<double>(load(xk[i])) * load(xk[i]);
  const float norm = P<T>(static_cast<float>(std::sqrt(sq)));
  const float ns_eps = static_cast<float>(h.ns_eps);
  const float d = h.ns_coefficients == NsCoefficients::quintic
                      ? P<T>(norm + ns_eps)
                      : P<T>(P<T>(norm * static_cast<float>(kPolarExpressSafety)) + ns_eps);
  for (int64_t i = 0; i < mn; ++i) store(xk[i], load(xk[i]) / d);
}

// O back to fp32, stored orientation, for one matrix.
template <typename T>
void store_output(const BatchPlan& plan, const T* xk, float* o) {
  const int64_t m = plan.m, n = plan.n, mn = m * n;
  if (plan.tall) {
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < m; ++j) o[i * m + j] = load(xk[j * n + i]);
  } else {
    for (int64_t i = 0; i < mn; ++i) o[i] = load(xk[i]);
  }
}

// The elementwise steps between the products; elements [begin, end) of the operands.
template <typename T>
void scale_into(T* CA, const T* A, float c, int64_t begin, int64_t end) {  // CA = P(c A)
  for (int64_t i = begin; i < end; ++i) store(CA[i], c * load(A[i]));
}
template <typename T>
void b_into(T* CA, const T* A, const T* G, float b, int64_t begin, int64_t end) {  // B = P(P(b A) + G)
  for (int64_t i = begin; i < end; ++i) store(CA[i], P<T>(b * load(A[i])) + load(G[i]));
}
template <typename T>
void x_update(T* X, const T* G, float a, int64_t begin, int64_t end) {  // X = P(P(a X) + G)
  for (int64_t i = begin; i < end; ++i) store(X[i], P<T>(a * load(X[i])) + load(G[i]));
}

}  // namespace

struct BatchedNewtonSchulz::Impl {
  Impl(WorkPool& p, int team) : pool(p), team_threads(team) {}
  void build(const std::vector<NsBatchShape>& batches, NsSplit split);  // plans, workspace, primitives
  WorkPool& pool;
  int team_threads;  // oneDNN's (OpenMP) threads for a batch that is not shared out per matrix
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  std::vector<dnnl::stream> streams;  // per pool slot
  std::vector<BatchPlan> plans;
  // Workspace, in fp32 sizes: per matrix, a region per slot (`*_stride` floats apart); batched, the
  // batch's matrices one after another from the start.
  std::unique_ptr<Aligned> x, g, a, ca, scratch;
  int64_t mn_stride = 0, mm_stride = 0, scratch_stride = 0;  // scratch: bytes per slot
  std::vector<int> order;      // run_per_matrix: its batches, costliest first (sized at set-up)
  std::vector<int64_t> first;  // and the first item of each

  template <typename T>
  T* region(const Aligned& buffer, int64_t stride, int slot) const {
    return reinterpret_cast<T*>(static_cast<char*>(buffer.ptr) + slot * stride * static_cast<int64_t>(sizeof(float)));
  }

  void make_gemm(Gemm& gemm, int64_t count, int64_t M, int64_t K, int64_t N, bool weights_transposed, int slots,
                 Aligned& src, int64_t src_stride, Aligned& wei, int64_t wei_stride, Aligned& dst, int64_t dst_stride,
                 dnnl::memory::data_type dt, size_t& scratch_bytes) {
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
    for (int s = 0; s < slots; ++s)
      gemm.args.push_back({{DNNL_ARG_SRC, dnnl::memory(src_md, engine, region<void>(src, src_stride, s))},
                           {DNNL_ARG_WEIGHTS, dnnl::memory(wei_md, engine, region<void>(wei, wei_stride, s))},
                           {DNNL_ARG_DST, dnnl::memory(dst_md, engine, region<void>(dst, dst_stride, s))}});
  }

  void exec(Gemm& gemm, int slot) {
    dnnl::stream& stream = streams[static_cast<size_t>(slot)];
    gemm.prim.execute(stream, gemm.args[static_cast<size_t>(slot)]);
    stream.wait();
  }

  // One matrix on the workspace of pool slot `slot`, every product a one-thread matmul.
  template <typename T>
  void orthogonalise(BatchPlan& plan, int prec, const float* u, float* o, const NorMuonHyper& h, int slot) {
    const int64_t mn = plan.m * plan.n, mm = plan.m * plan.m;
    T* X = region<T>(*x, mn_stride, slot);
    T* G = region<T>(*g, mn_stride, slot);
    T* A = region<T>(*a, mm_stride, slot);
    T* CA = region<T>(*ca, mm_stride, slot);
    load_normalised(plan, u, X, h);
    for (int it = 0; it < h.ns_steps; ++it) {
      // Coefficients enter as fp32 values (docs/spec.md section 3.2).
      const NsTriple& t = ns_triple(h.ns_coefficients, it);
      exec(plan.gram[prec], slot);  // A = P(X X^T)
      scale_into(CA, A, static_cast<float>(t.c), 0, mm);
      exec(plan.square[prec], slot);  // G = P(CA A)
      b_into(CA, A, G, static_cast<float>(t.b), 0, mm);
      exec(plan.apply[prec], slot);  // G = P(B X)
      x_update(X, G, static_cast<float>(t.a), 0, mn);
    }
    store_output(plan, X, o);
  }

  // The matrices of every per-matrix batch of `work` in one pass of the pool, a matrix per item, the
  // costliest batches first (the pass ends on small items, so no thread waits long for another).
  void run_per_matrix(const NsWork* work, int n) {
    int batches = 0;
    for (int i = 0; i < n; ++i) {
      const BatchPlan& plan = plans[static_cast<size_t>(work[i].batch)];
      if (!plan.per_matrix || plan.m == 0 || plan.count == 0) continue;
      int j = batches++;
      for (; j > 0 && cost(work[order[j - 1]]) < cost(work[i]); --j) order[j] = order[j - 1];
      order[j] = i;
    }
    if (batches == 0) return;
    first[0] = 0;
    for (int j = 0; j < batches; ++j) first[j + 1] = first[j] + plans[static_cast<size_t>(work[order[j]].batch)].count;
    pool.run(first[batches], [&](int64_t item, int slot) {
      const int j = static_cast<int>(std::upper_bound(first.begin(), first.begin() + batches + 1, item) - first.begin()) - 1;
      const NsWork& w = work[order[j]];
      BatchPlan& plan = plans[static_cast<size_t>(w.batch)];
      const int64_t k = item - first[j];
      if (w.h->ns_precision == NsPrecision::bf16)
        orthogonalise<Bf16>(plan, 1, w.inputs[k], w.outputs[k], *w.h, slot);
      else
        orthogonalise<float>(plan, 0, w.inputs[k], w.outputs[k], *w.h, slot);
    });
  }
  int64_t cost(const NsWork& w) const {  // of one matrix, in multiply-adds: 2 m^2 n + m^3 per iteration
    const BatchPlan& plan = plans[static_cast<size_t>(w.batch)];
    return (2 * plan.m * plan.m * plan.n + plan.m * plan.m * plan.m) * w.h->ns_steps;
  }

  // The whole batch at once: each product one batched matmul on oneDNN's threads, the steps between
  // them on the same OpenMP team.
  template <typename T>
  void iterate_batched(BatchPlan& plan, int prec, const float* const* inputs, float* const* outputs,
                       const NorMuonHyper& h) {
    const int64_t mn = plan.m * plan.n, mm = plan.m * plan.m, count = plan.count;
    T* X = region<T>(*x, 0, 0);
    T* G = region<T>(*g, 0, 0);
    T* A = region<T>(*a, 0, 0);
    T* CA = region<T>(*ca, 0, 0);
    const OmpThreads team(team_threads);
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < count; ++k) load_normalised(plan, inputs[k], X + k * mn, h);
    for (int it = 0; it < h.ns_steps; ++it) {
      const NsTriple& t = ns_triple(h.ns_coefficients, it);
      const int64_t parts = omp_get_max_threads();
      exec(plan.gram[prec], 0);
#pragma omp parallel for schedule(static)
      for (int64_t p = 0; p < parts; ++p) scale_into(CA, A, static_cast<float>(t.c), count * mm * p / parts, count * mm * (p + 1) / parts);
      exec(plan.square[prec], 0);
#pragma omp parallel for schedule(static)
      for (int64_t p = 0; p < parts; ++p) b_into(CA, A, G, static_cast<float>(t.b), count * mm * p / parts, count * mm * (p + 1) / parts);
      exec(plan.apply[prec], 0);
#pragma omp parallel for schedule(static)
      for (int64_t p = 0; p < parts; ++p) x_update(X, G, static_cast<float>(t.a), count * mn * p / parts, count * mn * (p + 1) / parts);
    }
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < count; ++k) store_output(plan, X + k * mn, outputs[k]);
  }
};

BatchedNewtonSchulz::BatchedNewtonSchulz(const std::vector<NsBatchShape>& batches)
    : own_pool_(std::make_unique<WorkPool>(1)), impl_(new Impl(*own_pool_, omp_get_max_threads())) {
  impl_->build(batches, NsSplit::batched);
}

BatchedNewtonSchulz::BatchedNewtonSchulz(const std::vector<NsBatchShape>& batches, WorkPool& pool, NsSplit split)
    : impl_(new Impl(pool, pool.threads())) {
  impl_->build(batches, split);
}

void BatchedNewtonSchulz::Impl::build(const std::vector<NsBatchShape>& batches, NsSplit split) {
  Impl& im = *this;
  const int slots = pool.threads();
  int64_t max_mn = 1, max_mm = 1, batched_mn = 1, batched_mm = 1;
  for (const auto& b : batches) {
    BatchPlan plan;
    plan.m = std::min(b.rows, b.cols);
    plan.n = std::max(b.rows, b.cols);
    plan.count = b.count;
    plan.tall = b.rows > b.cols;
    plan.per_matrix = split == NsSplit::per_matrix || (split == NsSplit::automatic && b.count >= slots);
    max_mn = std::max(max_mn, plan.m * plan.n);
    max_mm = std::max(max_mm, plan.m * plan.m);
    if (!plan.per_matrix) {
      batched_mn = std::max(batched_mn, plan.count * plan.m * plan.n);
      batched_mm = std::max(batched_mm, plan.count * plan.m * plan.m);
    }
    im.plans.push_back(std::move(plan));
  }
  // Slot regions 64-byte aligned (16 floats), so that no two threads share a cache line.
  im.mn_stride = (max_mn + 15) / 16 * 16;
  im.mm_stride = (max_mm + 15) / 16 * 16;
  im.x = std::make_unique<Aligned>(std::max(slots * im.mn_stride, batched_mn) * sizeof(float));
  im.g = std::make_unique<Aligned>(std::max(slots * im.mn_stride, batched_mn) * sizeof(float));  // m x m and m x n
  im.a = std::make_unique<Aligned>(std::max(slots * im.mm_stride, batched_mm) * sizeof(float));
  im.ca = std::make_unique<Aligned>(std::max(slots * im.mm_stride, batched_mm) * sizeof(float));
  size_t scratch_bytes = 0;
  for (auto& plan : im.plans) {
    if (plan.m == 0 || plan.count == 0) continue;
    const OmpThreads team(plan.per_matrix ? 1 : team_threads);
    const int64_t count = plan.per_matrix ? 1 : plan.count;
    const int n_args = plan.per_matrix ? slots : 1;
    const int64_t mn = plan.per_matrix ? im.mn_stride : 0, mm = plan.per_matrix ? im.mm_stride : 0;
    for (int prec = 0; prec < 2; ++prec) {
      const auto dt = prec == 0 ? dnnl::memory::data_type::f32 : dnnl::memory::data_type::bf16;
      im.make_gemm(plan.gram[prec], count, plan.m, plan.n, plan.m, true, n_args, *im.x, mn, *im.x, mn, *im.a, mm, dt,
                   scratch_bytes);
      im.make_gemm(plan.square[prec], count, plan.m, plan.m, plan.m, false, n_args, *im.ca, mm, *im.a, mm, *im.g, mn,
                   dt, scratch_bytes);
      im.make_gemm(plan.apply[prec], count, plan.m, plan.m, plan.n, false, n_args, *im.ca, mm, *im.x, mn, *im.g, mn,
                   dt, scratch_bytes);
    }
  }
  im.order.assign(im.plans.size(), 0);
  im.first.assign(im.plans.size() + 1, 0);
  im.scratch_stride = static_cast<int64_t>((std::max<size_t>(scratch_bytes, 64) + 63) / 64 * 64);
  im.scratch = std::make_unique<Aligned>(static_cast<size_t>(slots * im.scratch_stride));
  const dnnl::memory::desc scratch_md({im.scratch_stride}, dnnl::memory::data_type::u8, dnnl::memory::format_tag::a);
  for (int s = 0; s < slots; ++s) {
    im.streams.emplace_back(im.engine);
    const dnnl::memory pad(scratch_md, im.engine, static_cast<char*>(im.scratch->ptr) + s * im.scratch_stride);
    for (auto& plan : im.plans)
      for (int prec = 0; prec < 2 && plan.m > 0 && plan.count > 0; ++prec)
        for (Gemm* gemm : {&plan.gram[prec], &plan.square[prec], &plan.apply[prec]})
          if (static_cast<size_t>(s) < gemm->args.size()) gemm->args[static_cast<size_t>(s)][DNNL_ARG_SCRATCHPAD] = pad;
  }
}

BatchedNewtonSchulz::~BatchedNewtonSchulz() = default;

int64_t BatchedNewtonSchulz::workspace_bytes() const {
  size_t total = 0;
  for (const auto* buffer : {&impl_->x, &impl_->g, &impl_->a, &impl_->ca, &impl_->scratch}) total += (*buffer)->bytes;
  return static_cast<int64_t>(total);
}

void BatchedNewtonSchulz::run(int b, const float* const* inputs, float* const* outputs, const NorMuonHyper& h) {
  const NsWork work{b, inputs, outputs, &h};
  run(&work, 1);
}

void BatchedNewtonSchulz::run(const NsWork* work, int n) {
  Impl& im = *impl_;
  if (n < 0 || static_cast<size_t>(n) > im.plans.size())
    throw std::invalid_argument("BatchedNewtonSchulz::run: more work items than batches");
  for (int i = 0; i < n; ++i) {
    const NorMuonHyper& h = *work[i].h;
    if (h.ns_coefficients == NsCoefficients::polar_express && h.ns_steps > kPolarExpressSteps)
      throw std::invalid_argument("ns_steps=" + std::to_string(h.ns_steps) +
                                  " but the Polar Express schedule has 5 coefficient triples");
    const BatchPlan& plan = im.plans.at(static_cast<size_t>(work[i].batch));
    if (plan.m > 0) gemm_calls_ += 3 * static_cast<int64_t>(h.ns_steps) * (plan.per_matrix ? plan.count : 1);
  }
  im.run_per_matrix(work, n);
  for (int i = 0; i < n; ++i) {
    BatchPlan& plan = im.plans[static_cast<size_t>(work[i].batch)];
    if (plan.per_matrix || plan.m == 0 || plan.count == 0) continue;
    if (work[i].h->ns_precision == NsPrecision::bf16)
      im.iterate_batched<Bf16>(plan, 1, work[i].inputs, work[i].outputs, *work[i].h);
    else
      im.iterate_batched<float>(plan, 0, work[i].inputs, work[i].outputs, *work[i].h);
  }
}

bool BatchedNewtonSchulz::per_matrix(int b) const { return impl_->plans.at(static_cast<size_t>(b)).per_matrix; }

std::string BatchedNewtonSchulz::gemm_implementation(int b, NsPrecision p) const {
  const BatchPlan& plan = impl_->plans.at(static_cast<size_t>(b));
  return plan.m > 0 && plan.count > 0 ? plan.gram[p == NsPrecision::bf16 ? 1 : 0].impl : "none";
}

}  // namespace normuon::fast
