// The fused step's launchers: the kernels and passes of step_kernels.cuh on a CUDA stream.
#include "step_kernels.h"

#include "cuda_check.h"
#include "step_kernels.cuh"
#include "stream_launch.cuh"

namespace normuon::cuda {

void launch_scan_gradients(const StepBuffers& b, const Chunk* chunks, int n_chunks, cudaStream_t stream) {
  step_device::scan_gradients(StreamLaunch{stream}, b, chunks, n_chunks);
}

void launch_advance_steps(const StepBuffers& b, cudaStream_t stream) {
  step_device::advance_steps(StreamLaunch{stream}, b);
}

void launch_momentum(const StepBuffers& b, const Chunk* chunks, int n_chunks, cudaStream_t stream) {
  step_device::momentum(StreamLaunch{stream}, b, chunks, n_chunks);
}

void launch_statistics(const StepBuffers& b, const StatTask* tasks, int n_tasks, cudaStream_t stream) {
  step_device::statistics(StreamLaunch{stream}, b, tasks, n_tasks);
}

void launch_finalize(const StepBuffers& b, int n_matrices, cudaStream_t stream) {
  step_device::finalize(StreamLaunch{stream}, b, n_matrices);
}

void launch_normuon_update(const StepBuffers& b, const Chunk* chunks, int n_chunks, cudaStream_t stream) {
  step_device::normuon_update(StreamLaunch{stream}, b, chunks, n_chunks);
}

void launch_adamw(const StepBuffers& b, const Chunk* chunks, int n_chunks, cudaStream_t stream) {
  step_device::adamw(StreamLaunch{stream}, b, chunks, n_chunks);
}

}  // namespace normuon::cuda
