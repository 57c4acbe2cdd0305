// The reference's primitives on a CUDA device: KernelOps (kernel_ops.h) over the CUDA runtime, on the
// legacy default stream; each call returns when its work is done, which keeps the oracle simple. Built
// where the CUDA toolkit is (NORMUON_REFERENCE_CUDA); instantiated in cuda_ops.cu.
#pragma once

#include "kernel_ops.h"

namespace normuon::spec {

struct CudaRuntime;
using CudaOps = KernelOps<CudaRuntime>;
extern template class KernelOps<CudaRuntime>;

}  // namespace normuon::spec
