// Host-side helpers shared by the kernels' entry points: the one way CUDA errors become
// tpf::RuntimeError (check_cuda, check_launch), and a guard that runs a launch on the tensors'
// device and restores the caller's.
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "tpf/error.h"

namespace tpf::cuda {

inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw RuntimeError(std::string(what) + ": " + cudaGetErrorString(e));
}
// After a launch: the launch's own error (bad configuration, too much shared memory, ...).
inline void check_launch(const char* what) { check_cuda(cudaGetLastError(), what); }

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace tpf::cuda
