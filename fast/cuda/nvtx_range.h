// An NVTX range for a scope, so nsys and the torch profiler show each phase of a step by name.
// NVTX 3 is header-only; without a profiler attached a range costs a branch.
#pragma once

#include <nvtx3/nvToolsExt.h>

namespace normuon::cuda {

class NvtxRange {
 public:
  explicit NvtxRange(const char* name) { nvtxRangePushA(name); }
  ~NvtxRange() { nvtxRangePop(); }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

}  // namespace normuon::cuda
