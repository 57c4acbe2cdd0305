#include "newton_schulz.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include <omp.h>
#include <oneapi/dnnl/dnnl.hpp>

#include "cpu_kernels.h"
#include "ns_elementwise.h"
#include "normuon/ns_algorithm.h"
#include "normuon/ns_coefficients.h"
#include "symmetric_panels.h"
#include "work_pool.h"

namespace normuon::fast {
namespace {

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

// The workspace of the iteration: per pool slot (one matrix), or the whole batch one matrix after another.
// X and G are m x n (G also holds m x m products), the others m x m; kPanels holds the column panels of a
// symmetric product before they are placed (symmetric_panels.h).
enum Buffer { kX, kG, kA, kCA, kZ, kQ, kRZ, kPanels, kBuffers };

// Column-panel width of the symmetric products: narrower panels skip more of the upper triangle
// ((p + 1) / 2p of the full work for p panels), wide enough for brgemm to run at full rate (measured on
// AVX512_BF16, 768 x 2304 and 768 x 768: 64 is as fast per FLOP as the full product).
constexpr int64_t kPanelWidth = 64;

// One oneDNN matmul, bound to fixed places of the workspace per pool slot (or once, for a whole batch).
struct Gemm {
  dnnl::matmul prim;
  std::vector<std::unordered_map<int, dnnl::memory>> args;
  std::string impl;
  double macs = 0;  // multiply-adds of one execution
  // Where the processor has no bf16 dot products: an fp32 matmul on the bf16 operands widened
  // (exactly) into the slot's staging area, its output rounded back to bf16. bf16 products are exact in
  // fp32, so this is the spec's bf16 GEMM with fp32 accumulation. Per binding; empty for a native GEMM.
  struct Staged {
    const Bf16 *src, *wei;
    Bf16* dst;
  };
  std::vector<Staged> staged;
  int64_t src_n = 0, wei_n = 0, dst_n = 0;
  dnnl::memory::desc src_md, wei_md, dst_md;  // fp32, over the staging area
};

// Does oneDNN run bf16 dot products natively here (AVX512_BF16 or AMX, within ONEDNN_MAX_CPU_ISA)? Below
// that, Debian's oneDNN has no bf16 matmul at all (AVX2) or emulates one on AVX-512, more slowly than the
// staged fp32 GEMM (tiny: 313 against 183 ms a step, measured on an AVX-512 Xeon without BF16).
bool native_bf16_dot_products() {
  const int isa = static_cast<int>(dnnl::get_effective_cpu_isa());
  return (isa & dnnl_cpu_isa_avx512_core_bf16) == dnnl_cpu_isa_avx512_core_bf16;  // the flags are cumulative
}

// One product of the iteration for one batch and one precision. Dense, or symmetric with one panel, or
// for a whole batch: one GEMM, the full product into its destination. Symmetric with several panels (per
// matrix, m > kPanelWidth): a GEMM per column panel of the lower triangle, then placed and mirrored into
// buffer `dst`. A full product's lower triangle is mirrored where the spec makes the product symmetric
// (Gram's); the standard iteration's full products stay as computed, the reference's values.
struct Product {
  std::vector<Gemm> gemms;
  int dst = -1;
  bool panels = false;       // gemms are the lower triangle's column panels
  bool mirror_full = false;  // the full product's upper triangle is replaced by the mirrored lower one
};

struct BatchPlan {
  int64_t m = 0, n = 0, count = 0;  // wide orientation: m <= n
  bool tall = false;                 // stored rows > cols: iterate on the transpose
  bool per_matrix = false;           // a matrix per pool item, else the whole batch on oneDNN's threads
  std::vector<SymmetricPanel> panels;
  // [precision]. Standard: X X^T, (cA) A, B X. Gram (m < n): R = X X^T, (cR) R, Q Z, R Z, Z (RZ), Q X.
  Product gram[2], square[2], apply[2];
  Product gram_r[2], gram_crr[2], qz[2], rz[2], zrz[2], qx[2];
};

// Where a run works: one matrix on a pool slot's workspace, or a whole batch on oneDNN's threads.
struct Site {
  int slot = 0;
  bool batched = false;
  int64_t count = 1;
};

// X = P(U) in the wide orientation, then X = P(X / P(||X|| + eps)), for one matrix.
template <typename T>
void load_normalised(const BatchPlan& plan, const float* u, T* xk, const NorMuonHyper& h) {
  const int64_t m = plan.m, n = plan.n;
  ns_load(u, xk, plan.tall ? n : m, plan.tall ? m : n, plan.tall);  // u is n x m as stored when tall
  const float norm = ns_round<T>(static_cast<float>(std::sqrt(ns_sum_squares(xk, m * n))));
  const float ns_eps = static_cast<float>(h.ns_eps);
  const float d = h.ns_coefficients == NsCoefficients::quintic
                      ? ns_round<T>(norm + ns_eps)
                      : ns_round<T>(ns_round<T>(norm * static_cast<float>(kPolarExpressSafety)) + ns_eps);
  ns_divide(xk, d, m * n);
}

// O back to fp32, stored orientation, for one matrix.
template <typename T>
void store_output(const BatchPlan& plan, const T* xk, float* o) {
  ns_store(xk, o, plan.m, plan.n, plan.tall);
}

template <typename T>
void copy_into(T* D, const T* S, int64_t begin, int64_t end) {  // D = S (values already in P)
  std::memcpy(D + begin, S + begin, static_cast<size_t>(end - begin) * sizeof(T));
}

}  // namespace

struct BatchedNewtonSchulz::Impl {
  Impl(WorkPool& p, int team, bool gram) : pool(p), team_threads(team), with_gram(gram) {}
  void build(const std::vector<NsBatchShape>& batches, NsSplit split);  // plans, workspace, primitives
  WorkPool& pool;
  int team_threads;  // oneDNN's (OpenMP) threads for a batch that is not shared out per matrix
  bool with_gram;    // Gram's products and buffers are built
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  bool bf16_matmul = native_bf16_dot_products();  // else bf16 GEMMs run staged in fp32 (Gemm::staged)
  std::vector<std::unique_ptr<Aligned>> staging;  // per pool slot: a staged GEMM's fp32 operands
  int64_t staging_floats = 0;
  std::vector<dnnl::stream> streams;  // per pool slot
  std::vector<BatchPlan> plans;
  // Workspace, in fp32 sizes: per matrix, a region per slot (`stride[buffer]` floats apart); batched,
  // the batch's matrices one after another from the start.
  std::unique_ptr<Aligned> buffers[kBuffers], scratch;
  int64_t stride[kBuffers] = {};
  int64_t scratch_stride = 0;  // bytes per slot
  std::vector<int> order;      // run_per_matrix: its batches, costliest first (sized at set-up)
  std::vector<int64_t> first;  // and the first item of each
  std::atomic<int64_t> executions{0};
  std::atomic<int64_t> executed_macs{0};

  template <typename T>
  T* region(int buffer, const Site& s) const {
    const int64_t floats = s.batched ? 0 : s.slot * stride[buffer];
    return reinterpret_cast<T*>(static_cast<char*>(buffers[buffer]->ptr) + floats * static_cast<int64_t>(sizeof(float)));
  }

  // A place in the workspace: a buffer and an offset in elements of the GEMM's data type.
  struct Operand {
    int buffer;
    int64_t offset = 0;
  };

  // count x (M x K) times (K x N), every operand dense; weights_transposed: the weights are stored N x K
  // (rows of X or of a symmetric matrix, read as columns). Bound for `bindings` sites (pool slots).
  void make_gemm(Gemm& gemm, int64_t count, int64_t M, int64_t K, int64_t N, bool weights_transposed, int bindings,
                 Operand src, Operand wei, Operand dst, dnnl::memory::data_type dt, size_t& scratch_bytes) {
    using dims = dnnl::memory::dims;
    const bool stage = dt == dnnl::memory::data_type::bf16 && !bf16_matmul;
    const dnnl::memory::data_type mdt = stage ? dnnl::memory::data_type::f32 : dt;
    const dnnl::memory::desc src_md(dims{count, M, K}, mdt, dims{M * K, K, 1});
    const dnnl::memory::desc wei_md(dims{count, K, N}, mdt,
                                    weights_transposed ? dims{K * N, 1, K} : dims{K * N, N, 1});
    const dnnl::memory::desc dst_md(dims{count, M, N}, mdt, dims{M * N, N, 1});
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    try {
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src_md, wei_md, dst_md), attr, engine);
      gemm.prim = dnnl::matmul(pd);
      gemm.impl = stage ? std::string("f32 on bf16 values (") + pd.impl_info_str() + ")" : pd.impl_info_str();
      scratch_bytes = std::max(scratch_bytes, pd.scratchpad_desc().get_size());
    } catch (const dnnl::error& e) {
      throw std::runtime_error(std::string("the fast CPU backend's Newton-Schulz needs an ") +
                               (mdt == dnnl::memory::data_type::f32 ? "fp32" : "bf16") +
                               " matmul, which oneDNN cannot make on this processor (" + e.what() + ")");
    }
    gemm.macs = static_cast<double>(count) * static_cast<double>(M) * static_cast<double>(K) * static_cast<double>(N);
    const int64_t element = dt == dnnl::memory::data_type::bf16 ? 2 : 4;
    auto at = [&](Operand o, int s) {
      return static_cast<void*>(region<char>(o.buffer, Site{s, !per_matrix_binding, 1}) + o.offset * element);
    };
    if (stage) {  // bound to the staging areas once they are sized (bind_staged)
      gemm.src_n = count * M * K;
      gemm.wei_n = count * K * N;
      gemm.dst_n = count * M * N;
      gemm.src_md = src_md;
      gemm.wei_md = wei_md;
      gemm.dst_md = dst_md;
      staging_floats = std::max(staging_floats, gemm.src_n + gemm.wei_n + gemm.dst_n);
      for (int s = 0; s < bindings; ++s)
        gemm.staged.push_back({static_cast<const Bf16*>(at(src, s)), static_cast<const Bf16*>(at(wei, s)),
                               static_cast<Bf16*>(at(dst, s))});
      return;
    }
    for (int s = 0; s < bindings; ++s)
      gemm.args.push_back({{DNNL_ARG_SRC, dnnl::memory(src_md, engine, at(src, s))},
                           {DNNL_ARG_WEIGHTS, dnnl::memory(wei_md, engine, at(wei, s))},
                           {DNNL_ARG_DST, dnnl::memory(dst_md, engine, at(dst, s))}});
  }
  bool per_matrix_binding = false;  // make_gemm: the plan being built is per matrix (bound per slot)

  // dst = S W, symmetric m x m, S (m x K) and the rows of W (m x K, read transposed) in the workspace.
  // mirrored: the spec makes the product exactly symmetric (Gram Newton-Schulz's sym()).
  void make_symmetric(Product& p, const BatchPlan& plan, int S, int W, int64_t K, int dst, bool mirrored,
                      int bindings, dnnl::memory::data_type dt, size_t& scratch_bytes) {
    p.dst = dst;
    p.panels = plan.per_matrix && plan.panels.size() > 1;
    p.mirror_full = mirrored && !p.panels;
    if (!p.panels) {
      // A full product reads W as it is stored (W, not W^T) unless W is X itself (X X^T) or the spec makes
      // every operand exactly symmetric (Gram's): the standard (cA) A must not rest on oneDNN's X X^T
      // coming out bit-symmetric.
      const bool read_transposed = S == W || mirrored;
      p.gemms.resize(1);
      make_gemm(p.gemms[0], plan.per_matrix ? 1 : plan.count, plan.m, K, plan.m, read_transposed, bindings, {S}, {W},
                {dst}, dt, scratch_bytes);
      return;
    }
    p.gemms.resize(plan.panels.size());
    for (size_t j = 0; j < plan.panels.size(); ++j) {
      const SymmetricPanel& panel = plan.panels[j];
      make_gemm(p.gemms[j], 1, plan.m - panel.c0, K, panel.width, true, bindings, {S, panel.c0 * K},
                {W, panel.c0 * K}, {kPanels, panel.offset}, dt, scratch_bytes);
    }
  }
  // dst = S (m x m) times X (m x n), plain.
  void make_dense(Product& p, const BatchPlan& plan, int S, int X, int dst, int bindings, dnnl::memory::data_type dt,
                  size_t& scratch_bytes) {
    p.gemms.resize(1);
    make_gemm(p.gemms[0], plan.per_matrix ? 1 : plan.count, plan.m, plan.m, plan.n, false, bindings, {S}, {X}, {dst},
              dt, scratch_bytes);
  }

  template <typename F>
  void for_each_gemm(const F& f) {
    for (auto& plan : plans)
      for (int prec = 0; prec < 2; ++prec)
        for (Product* p : {&plan.gram[prec], &plan.square[prec], &plan.apply[prec], &plan.gram_r[prec],
                           &plan.gram_crr[prec], &plan.qz[prec], &plan.rz[prec], &plan.zrz[prec], &plan.qx[prec]})
          for (Gemm& gemm : p->gemms) f(gemm);
  }

  // A staged GEMM's fp32 operands in slot s's staging area: src, weights, dst.
  void bind_staged(Gemm& gemm) {
    for (size_t s = 0; s < gemm.staged.size(); ++s) {
      float* st = static_cast<float*>(staging[s]->ptr);
      gemm.args.push_back({{DNNL_ARG_SRC, dnnl::memory(gemm.src_md, engine, st)},
                           {DNNL_ARG_WEIGHTS, dnnl::memory(gemm.wei_md, engine, st + gemm.src_n)},
                           {DNNL_ARG_DST, dnnl::memory(gemm.dst_md, engine, st + gemm.src_n + gemm.wei_n)}});
    }
  }

  void exec(Gemm& gemm, int slot) {
    dnnl::stream& stream = streams[static_cast<size_t>(slot)];
    const bool staged = !gemm.staged.empty();
    float* st = staged ? static_cast<float*>(staging[static_cast<size_t>(slot)]->ptr) : nullptr;
    if (staged) {
      const Gemm::Staged& io = gemm.staged[static_cast<size_t>(slot)];
      widen(io.src, DType::bf16, st, gemm.src_n);
      widen(io.wei, DType::bf16, st + gemm.src_n, gemm.wei_n);
    }
    gemm.prim.execute(stream, gemm.args[static_cast<size_t>(slot)]);
    stream.wait();
    if (staged)
      narrow(st + gemm.src_n + gemm.wei_n, gemm.staged[static_cast<size_t>(slot)].dst, DType::bf16, gemm.dst_n);
    executions.fetch_add(1, std::memory_order_relaxed);
    executed_macs.fetch_add(static_cast<int64_t>(gemm.macs), std::memory_order_relaxed);
  }

  // The elementwise steps: f(begin, end) over the site's matrices' elements (n_per_matrix each, one after
  // another), on oneDNN's OpenMP team for a whole batch.
  template <typename F>
  static void each(const Site& s, int64_t n_per_matrix, const F& f) {
    const int64_t total = n_per_matrix * s.count;
    if (!s.batched) return f(0, total);
    const int64_t parts = omp_get_max_threads();
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < parts; ++p) f(total * p / parts, total * (p + 1) / parts);
  }
  template <typename F>
  static void each_matrix(const Site& s, const F& f) {
#pragma omp parallel for schedule(static) if (s.batched)
    for (int64_t k = 0; k < s.count; ++k) f(k);
  }

  template <typename T>
  void product(const BatchPlan& plan, Product& p, const Site& s) {
    for (Gemm& g : p.gemms) exec(g, s.slot);
    T* c = p.dst >= 0 ? region<T>(p.dst, s) : nullptr;
    const int64_t m = plan.m;
    if (p.panels)
      place_symmetric_panels(plan.panels, region<T>(kPanels, s), c, m);
    else if (p.mirror_full)
      each_matrix(s, [&](int64_t k) { mirror_lower_triangle(c + k * m * m, m); });
  }

  // NS(U) of docs/spec.md section 3.2 after the normalisation, on the site's matrices in X; returns the
  // buffer that holds the result.
  template <typename T>
  int iterate(BatchPlan& plan, int prec, const NorMuonHyper& h, const Site& s) {
    const int64_t m = plan.m, mm = m * m, mn = m * plan.n;
    T *X = region<T>(kX, s), *G = region<T>(kG, s), *A = region<T>(kA, s), *CA = region<T>(kCA, s);
    // Coefficients enter as fp32 values (docs/spec.md section 3.2).
    if (!ns_uses_gram(h.ns_algorithm, plan.m, plan.n)) {
      for (int it = 0; it < h.ns_steps; ++it) {
        const NsTriple& t = ns_triple(h.ns_coefficients, it);
        product<T>(plan, plan.gram[prec], s);  // A = P(X X^T)
        each(s, mm, [&](int64_t b, int64_t e) { ns_scale(CA + b, A + b, static_cast<float>(t.c), e - b); });
        product<T>(plan, plan.square[prec], s);  // G = P(CA A)
        each(s, mm, [&](int64_t b, int64_t e) { ns_scaled_add(CA + b, A + b, G + b, static_cast<float>(t.b), e - b); });
        product<T>(plan, plan.apply[prec], s);  // G = P(B X)
        each(s, mn, [&](int64_t b, int64_t e) {
          ns_scaled_add_in_place(X + b, G + b, static_cast<float>(t.a), e - b);
        });
      }
      return kX;
    }
    // Gram Newton-Schulz: R (in A) = X X^T, Q collects the polynomial, X <- Q X at restarts and the end.
    T *Z = region<T>(kZ, s), *Q = region<T>(kQ, s), *RZ = region<T>(kRZ, s);
    product<T>(plan, plan.gram_r[prec], s);  // R = P(X X^T)
    for (int it = 0; it < h.ns_steps; ++it) {
      const NsGramIteration does = ns_gram_iteration(it, h.ns_steps);
      if (does.restart) {
        product<T>(plan, plan.qx[prec], s);  // G = P(Q X)
        each(s, mn, [&](int64_t b, int64_t e) { copy_into(X, G, b, e); });
        product<T>(plan, plan.gram_r[prec], s);
      }
      const NsTriple& t = ns_triple(h.ns_coefficients, it);
      const float a = static_cast<float>(t.a);
      each(s, mm, [&](int64_t b, int64_t e) { ns_scale(CA + b, A + b, static_cast<float>(t.c), e - b); });
      product<T>(plan, plan.gram_crr[prec], s);  // G = P(CR R)
      each(s, mm, [&](int64_t b, int64_t e) {  // Z = P(P(bR) + G)
        ns_scaled_add(Z + b, A + b, G + b, static_cast<float>(t.b), e - b);
      });
      if (does.fresh) {  // Q = P(Z + a I)
        each(s, mm, [&](int64_t b, int64_t e) { copy_into(Q, Z, b, e); });
        each_matrix(s, [&](int64_t k) {
          T* q = Q + k * mm;
          for (int64_t i = 0; i < m; ++i) ns_round_into(q[i * m + i], ns_widen(q[i * m + i]) + a);
        });
      } else {  // Q = P(P(a Q) + P(Q Z))
        product<T>(plan, plan.qz[prec], s);
        each(s, mm, [&](int64_t b, int64_t e) { ns_scaled_add_in_place(Q + b, G + b, a, e - b); });
      }
      if (does.update_r) {  // R = (Z + a I) R (Z + a I)
        product<T>(plan, plan.rz[prec], s);
        // RZ = P(P(a R) + P(R Z))
        each(s, mm, [&](int64_t b, int64_t e) { ns_scaled_add(RZ + b, A + b, G + b, a, e - b); });
        product<T>(plan, plan.zrz[prec], s);
        // R = P(P(a RZ) + P(Z RZ))
        each(s, mm, [&](int64_t b, int64_t e) { ns_scaled_add(A + b, RZ + b, G + b, a, e - b); });
      }
    }
    product<T>(plan, plan.qx[prec], s);  // G = P(Q X)
    return kG;
  }

  // One matrix on the workspace of pool slot `slot`, every product a one-thread matmul.
  template <typename T>
  void orthogonalise(BatchPlan& plan, int prec, const float* u, float* o, const NorMuonHyper& h, int slot) {
    const Site s{slot, false, 1};
    load_normalised(plan, u, region<T>(kX, s), h);
    const int result = iterate<T>(plan, prec, h, s);
    store_output(plan, region<T>(result, s), o);
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
  double cost(const NsWork& w) const {  // of one matrix: the FLOPs of its algorithm in full
    const BatchPlan& plan = plans[static_cast<size_t>(w.batch)];
    return ns_dense_flops(w.h->ns_algorithm, plan.m, plan.n, w.h->ns_steps);
  }

  // The whole batch at once: each product one batched matmul on oneDNN's threads, the steps between
  // them on the same OpenMP team.
  template <typename T>
  void iterate_batched(BatchPlan& plan, int prec, const float* const* inputs, float* const* outputs,
                       const NorMuonHyper& h) {
    const Site s{0, true, plan.count};
    const int64_t mn = plan.m * plan.n;
    const OmpThreads team(team_threads);
    T* X = region<T>(kX, s);
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < plan.count; ++k) load_normalised(plan, inputs[k], X + k * mn, h);
    const T* result = region<T>(iterate<T>(plan, prec, h, s), s);
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < plan.count; ++k) store_output(plan, result + k * mn, outputs[k]);
  }
};

BatchedNewtonSchulz::BatchedNewtonSchulz(const std::vector<NsBatchShape>& batches, bool with_gram)
    : own_pool_(std::make_unique<WorkPool>(1)), impl_(new Impl(*own_pool_, omp_get_max_threads(), with_gram)) {
  impl_->build(batches, NsSplit::batched);
}

BatchedNewtonSchulz::BatchedNewtonSchulz(const std::vector<NsBatchShape>& batches, WorkPool& pool, NsSplit split,
                                         bool with_gram)
    : impl_(new Impl(pool, pool.threads(), with_gram)) {
  impl_->build(batches, split);
}

bool ns_keeps_the_pool_busy(const std::vector<NsBatchShape>& batches, int threads) {
  int64_t matrices = 0;
  double total = 0, largest = 0;  // the standard iteration's cost, the same for every algorithm's share
  for (const NsBatchShape& b : batches) {
    if (b.rows == 0 || b.cols == 0 || b.count == 0) continue;
    const double cost = ns_standard_dense_flops(b.rows, b.cols, 1);
    matrices += b.count;
    total += cost * static_cast<double>(b.count);
    largest = std::max(largest, cost);
  }
  return matrices >= threads && largest * threads <= total;
}

void BatchedNewtonSchulz::Impl::build(const std::vector<NsBatchShape>& batches, NsSplit split) {
  const int slots = pool.threads();
  const bool all_per_matrix = split == NsSplit::automatic && ns_keeps_the_pool_busy(batches, slots);
  int64_t max_mn = 1, max_mm = 1, max_panels = 1, batched_mn = 1, batched_mm = 1;
  bool gram_runs = false;  // some batch would run Gram's iteration (square ones never do)
  for (const auto& b : batches) {
    BatchPlan plan;
    plan.m = std::min(b.rows, b.cols);
    plan.n = std::max(b.rows, b.cols);
    plan.count = b.count;
    plan.tall = b.rows > b.cols;
    plan.per_matrix =
        split == NsSplit::per_matrix || (split == NsSplit::automatic && (b.count >= slots || all_per_matrix));
    if (plan.per_matrix) plan.panels = symmetric_panels(plan.m, kPanelWidth);
    max_mn = std::max(max_mn, plan.m * plan.n);
    max_mm = std::max(max_mm, plan.m * plan.m);
    max_panels = std::max(max_panels, symmetric_panel_floats(plan.panels, plan.m));
    gram_runs = gram_runs || (with_gram && ns_uses_gram(NsAlgorithm::gram, plan.m, plan.n));
    if (!plan.per_matrix) {
      batched_mn = std::max(batched_mn, plan.count * plan.m * plan.n);
      batched_mm = std::max(batched_mm, plan.count * plan.m * plan.m);
    }
    plans.push_back(std::move(plan));
  }
  // Slot regions 64-byte aligned (16 floats), so that no two threads share a cache line.
  auto aligned = [](int64_t floats) { return (floats + 15) / 16 * 16; };
  for (int b = 0; b < kBuffers; ++b) {
    const bool mn_sized = b == kX || b == kG;  // G holds m x n and m x m results
    const bool gram_only = b == kZ || b == kQ || b == kRZ;
    stride[b] = gram_only && !gram_runs ? 0 : aligned(b == kPanels ? max_panels : mn_sized ? max_mn : max_mm);
    const int64_t batched = b == kPanels || (gram_only && !gram_runs) ? 1 : mn_sized ? batched_mn : batched_mm;
    buffers[b] = std::make_unique<Aligned>(std::max(slots * stride[b], batched) * sizeof(float));
  }
  size_t scratch_bytes = 0;
  for (auto& plan : plans) {
    if (plan.m == 0 || plan.count == 0) continue;
    const OmpThreads team(plan.per_matrix ? 1 : team_threads);
    const int bindings = plan.per_matrix ? slots : 1;
    per_matrix_binding = plan.per_matrix;
    const int64_t m = plan.m, n = plan.n;
    for (int prec = 0; prec < 2; ++prec) {
      const auto dt = prec == 0 ? dnnl::memory::data_type::f32 : dnnl::memory::data_type::bf16;
      // Standard: X X^T, (cA) A, B X. Gram (m < n) uses the first two mirrored, as R X X^T and (cR) R.
      const bool gram = m < n;
      make_symmetric(plan.gram[prec], plan, kX, kX, n, kA, false, bindings, dt, scratch_bytes);
      make_symmetric(plan.square[prec], plan, kCA, kA, m, kG, false, bindings, dt, scratch_bytes);
      make_dense(plan.apply[prec], plan, kCA, kX, kG, bindings, dt, scratch_bytes);
      if (!gram || !with_gram) continue;  // square: always the standard iteration
      make_symmetric(plan.gram_r[prec], plan, kX, kX, n, kA, true, bindings, dt, scratch_bytes);
      make_symmetric(plan.gram_crr[prec], plan, kCA, kA, m, kG, true, bindings, dt, scratch_bytes);
      make_symmetric(plan.qz[prec], plan, kQ, kZ, m, kG, true, bindings, dt, scratch_bytes);
      make_symmetric(plan.rz[prec], plan, kA, kZ, m, kG, true, bindings, dt, scratch_bytes);
      make_symmetric(plan.zrz[prec], plan, kZ, kRZ, m, kG, true, bindings, dt, scratch_bytes);
      make_dense(plan.qx[prec], plan, kQ, kX, kG, bindings, dt, scratch_bytes);
    }
  }
  if (staging_floats > 0) {
    for (int s = 0; s < slots; ++s)
      staging.push_back(std::make_unique<Aligned>(static_cast<size_t>(staging_floats) * sizeof(float)));
    for_each_gemm([&](Gemm& gemm) { bind_staged(gemm); });
  }
  order.assign(plans.size(), 0);
  first.assign(plans.size() + 1, 0);
  scratch_stride = static_cast<int64_t>((std::max<size_t>(scratch_bytes, 64) + 63) / 64 * 64);
  scratch = std::make_unique<Aligned>(static_cast<size_t>(slots * scratch_stride));
  const dnnl::memory::desc scratch_md({scratch_stride}, dnnl::memory::data_type::u8, dnnl::memory::format_tag::a);
  for (int s = 0; s < slots; ++s) {
    streams.emplace_back(engine);
    const dnnl::memory pad(scratch_md, engine, static_cast<char*>(scratch->ptr) + s * scratch_stride);
    for_each_gemm([&](Gemm& gemm) {
      if (static_cast<size_t>(s) < gemm.args.size()) gemm.args[static_cast<size_t>(s)][DNNL_ARG_SCRATCHPAD] = pad;
    });
  }
}

BatchedNewtonSchulz::~BatchedNewtonSchulz() = default;

int64_t BatchedNewtonSchulz::workspace_bytes() const {
  size_t total = impl_->scratch->bytes;
  for (const auto& buffer : impl_->buffers) total += buffer->bytes;
  for (const auto& area : impl_->staging) total += area->bytes;
  return static_cast<int64_t>(total);
}

int64_t BatchedNewtonSchulz::gemm_calls() const { return impl_->executions.load(); }
double BatchedNewtonSchulz::multiply_adds() const { return static_cast<double>(impl_->executed_macs.load()); }

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
    if (!im.with_gram && ns_uses_gram(h.ns_algorithm, plan.m, plan.n))
      throw std::logic_error("BatchedNewtonSchulz: ns_algorithm=gram on one built without Gram (with_gram = false)");
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
bool BatchedNewtonSchulz::with_gram() const { return impl_->with_gram; }

std::string BatchedNewtonSchulz::gemm_implementation(int b, NsPrecision p) const {
  const BatchPlan& plan = impl_->plans.at(static_cast<size_t>(b));
  return plan.m > 0 && plan.count > 0 ? plan.gram[p == NsPrecision::bf16 ? 1 : 0].gemms.at(0).impl : "none";
}

}  // namespace normuon::fast
