#include "streaming_triad.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>

#include "bench_report.h"
#include "multiversion.h"

namespace normuon::bench {
namespace {

// Vectorised the way the fast backend's kernels are (fast/cpu_kernels.cpp): AVX-512 where the CPU has it.
NORMUON_MULTIVERSION
void triad_kernel(float* a, const float* b, const float* c, float s, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}

}  // namespace

StreamingTriad::StreamingTriad(int64_t n, int threads) : n_(std::max<int64_t>(n, 1024)), threads_(threads) {
  const size_t bytes = (static_cast<size_t>(n_) * sizeof(float) + 63) / 64 * 64;
  a_ = static_cast<float*>(std::aligned_alloc(64, bytes));
  b_ = static_cast<float*>(std::aligned_alloc(64, bytes));
  c_ = static_cast<float*>(std::aligned_alloc(64, bytes));
  if (!a_ || !b_ || !c_) {
    release();
    throw std::runtime_error("streaming triad: cannot allocate 3 x " + std::to_string(bytes) + " bytes");
  }
#pragma omp parallel num_threads(threads_)
  {
    int64_t begin = 0, end = 0;
    share(&begin, &end);
    std::fill(a_ + begin, a_ + end, 0.0f);
    std::fill(b_ + begin, b_ + end, 1.0f);
    std::fill(c_ + begin, c_ + end, 2.0f);
  }
  // Enough runs for ~1 GB of traffic on small arrays, at least 5.
  runs_ = static_cast<int>(std::clamp<double>(1e9 / (12.0 * static_cast<double>(n_)), 5, 500));
}

StreamingTriad::~StreamingTriad() { release(); }

double StreamingTriad::best_ms() {
  double best = std::numeric_limits<double>::infinity();
  for (int run = 0; run <= runs_; ++run) {
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads_)
    {
      int64_t begin = 0, end = 0;
      share(&begin, &end);
      triad_kernel(a_ + begin, b_ + begin, c_ + begin, 3.0f, end - begin);
    }
    const double ms = ms_between(t0, std::chrono::steady_clock::now());
    if (run > 0) best = std::min(best, ms);
  }
  volatile float sink = a_[0] + a_[n_ - 1];  // the stores are observed
  (void)sink;
  return best;
}

// This thread's contiguous share: the same at first touch (so its pages are local) and in the runs.
void StreamingTriad::share(int64_t* begin, int64_t* end) const {
  const int64_t team = omp_get_num_threads(), chunk = (n_ + team - 1) / team;
  *begin = std::min(n_, omp_get_thread_num() * chunk);
  *end = std::min(n_, *begin + chunk);
}

void StreamingTriad::release() {
  std::free(a_);
  std::free(b_);
  std::free(c_);
  a_ = b_ = c_ = nullptr;
}

}  // namespace normuon::bench
