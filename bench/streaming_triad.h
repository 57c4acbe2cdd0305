// Streaming triad a[i] = b[i] + s*c[i] over n floats with `threads` OpenMP threads: the memory bandwidth
// `normuon bench` holds the fused AdamW pass against. The arrays are allocated and first-touched once
// (by the threads that stream them), so that it can run after every fast step and see the same machine
// as the AdamW pass next to it (memory bandwidth on a shared host changes from minute to minute).
// Reported two ways: as STREAM counts it, 12 bytes per element (read b and c, write a), and as the
// memory traffic it causes, 16 bytes per element (the store to a[] first reads the line:
// write-allocate). The fused AdamW pass writes only lines it has read, so its 28 bytes per parameter
// are its whole traffic; it is compared with the triad's 16-byte figure (the stricter bar).
#pragma once

#include <cstdint>

namespace normuon::bench {

class StreamingTriad {
 public:
  StreamingTriad(int64_t n, int threads);  // at least 1024 floats
  ~StreamingTriad();
  StreamingTriad(const StreamingTriad&) = delete;
  StreamingTriad& operator=(const StreamingTriad&) = delete;

  int64_t size() const { return n_; }
  int runs() const { return runs_; }
  // Best time of one triad over the runs (after one untimed run), in ms.
  double best_ms();

  static double stream_gbps(int64_t n, double ms) { return 12.0 * static_cast<double>(n) / (ms * 1e-3) / 1e9; }
  static double traffic_gbps(int64_t n, double ms) { return 16.0 * static_cast<double>(n) / (ms * 1e-3) / 1e9; }

 private:
  void share(int64_t* begin, int64_t* end) const;
  void release();
  int64_t n_;
  int threads_;
  int runs_ = 0;
  float *a_ = nullptr, *b_ = nullptr, *c_ = nullptr;
};

}  // namespace normuon::bench
