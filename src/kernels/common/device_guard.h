// Host-side helpers shared by the kernels' entry points: CUDA errors as tpf::RuntimeError, and a
// guard that runs a launch on the tensors' device and restores the caller's.
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "tpf/error.h"

namespace tpf::cuda {

inline void check_cuda_call(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw RuntimeError(std::string(what) + ": " + cudaGetErrorString(e));
}

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check_cuda_call(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check_cuda_call(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace tpf::cuda
