// CUDA events and streams, owned, and the chained-event timing the GPU benchmark uses throughout.
// Needs the CUDA runtime: included only by the files built with the CUDA backend.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "cuda_check.h"

namespace normuon::bench {

class CudaEvent {
 public:
  CudaEvent() { NORMUON_CUDA_CHECK(cudaEventCreate(&e_)); }
  ~CudaEvent() {
    if (e_) cudaEventDestroy(e_);
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  CudaEvent(CudaEvent&& o) noexcept : e_(o.e_) { o.e_ = nullptr; }
  CudaEvent& operator=(CudaEvent&&) = delete;
  cudaEvent_t get() const { return e_; }
  void record(cudaStream_t s) { NORMUON_CUDA_CHECK(cudaEventRecord(e_, s)); }

 private:
  cudaEvent_t e_ = nullptr;
};

inline double elapsed_ms(const CudaEvent& a, const CudaEvent& b) {
  float ms = 0;
  NORMUON_CUDA_CHECK(cudaEventElapsedTime(&ms, a.get(), b.get()));
  return static_cast<double>(ms);
}

// Non-blocking: it never waits for the legacy default stream.
class CudaStream {
 public:
  CudaStream() { NORMUON_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  ~CudaStream() {
    if (s_) cudaStreamDestroy(s_);
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

// `samples` timings of `per_sample` calls of enqueue() on `stream`, chained events (the stream never
// drains between samples); returns ms per call for each sample.
template <typename F>
std::vector<double> time_chained(cudaStream_t stream, int64_t samples, int64_t per_sample, F&& enqueue) {
  std::vector<CudaEvent> events;
  events.reserve(static_cast<size_t>(samples + 1));
  for (int64_t i = 0; i <= samples; ++i) events.emplace_back();
  events[0].record(stream);
  for (int64_t s = 0; s < samples; ++s) {
    for (int64_t k = 0; k < per_sample; ++k) enqueue();
    events[static_cast<size_t>(s + 1)].record(stream);
  }
  NORMUON_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> out;
  for (int64_t s = 0; s < samples; ++s)
    out.push_back(elapsed_ms(events[static_cast<size_t>(s)], events[static_cast<size_t>(s + 1)]) /
                  static_cast<double>(per_sample));
  return out;
}

}  // namespace normuon::bench
