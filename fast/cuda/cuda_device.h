// Is there a GPU to run on? Asked without throwing, so that tests and the selector can say why not.
#pragma once

#include <string>

namespace normuon::cuda {

// Empty when CUDA device `device` can be used; otherwise why not (no driver, no device, ...).
std::string unavailable_reason(int device = 0);

// "NVIDIA H100 80GB HBM3, sm_90, 132 SMs, 79.2 GiB" (the device must be available).
std::string describe_device(int device = 0);

}  // namespace normuon::cuda
