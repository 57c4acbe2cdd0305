// ATen operator calls, counted by a libtorch RecordFunction global callback (FUNCTION scope: every
// dispatched c10/ATen op, on every thread) while an AtenOpCounter lives. "Top-level" calls are those
// not made from inside another op on the same thread, i.e. the calls the caller's own code makes; the
// total includes the ops those call in turn. The callback costs time: never keep one around a timed step.
#pragma once

#include <cstdint>

namespace normuon::bench {

class AtenOpCounter {
 public:
  AtenOpCounter();  // resets the counts; one counter at a time
  ~AtenOpCounter();
  AtenOpCounter(const AtenOpCounter&) = delete;
  AtenOpCounter& operator=(const AtenOpCounter&) = delete;

  int64_t top_level() const;
  int64_t dispatched() const;

 private:
  uint64_t handle_;  // at::CallbackHandle
};

}  // namespace normuon::bench
