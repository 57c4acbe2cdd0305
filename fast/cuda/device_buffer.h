// A fixed-size device allocation, owned: cudaMalloc in the constructor, cudaFree in the destructor.
// Backends allocate all of these at setup, so that a step allocates nothing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

#include "cuda_check.h"

namespace normuon::cuda {

template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(int64_t count) : count_(count) {
    if (count > 0) NORMUON_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&data_), bytes()));
  }
  ~DeviceBuffer() {
    if (data_) cudaFree(data_);  // no throw from a destructor; a failure here leaves nothing to undo
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), count_(std::exchange(other.count_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(count_, other.count_);
    return *this;
  }

  T* data() { return data_; }
  const T* data() const { return data_; }
  int64_t size() const { return count_; }
  size_t bytes() const { return static_cast<size_t>(count_) * sizeof(T); }

 private:
  T* data_ = nullptr;
  int64_t count_ = 0;
};

}  // namespace normuon::cuda
