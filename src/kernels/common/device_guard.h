// Host-side helpers shared by the kernels' entry points: the one way CUDA errors become
// tpf::RuntimeError (check_cuda, check_launch), a guard that runs a launch on the tensors' device
// and restores the caller's, and the one dispatch from a float dtype to its CUDA type.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "tpf/error.h"
#include "tpf/tensor.h"

namespace tpf::cuda {

inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw RuntimeError(std::string(what) + ": " + cudaGetErrorString(e));
}
// After a launch: the launch's own error (bad configuration, too much shared memory, ...).
inline void check_launch(const char* what) { check_cuda(cudaGetLastError(), what); }

// f(T{}) with T the CUDA type of dtype d: float, __nv_bfloat16 or __half (the validation in src/ops
// admits no other where this is called; `what` names the argument otherwise).
template <typename F>
void with_float_type(DType d, F&& f, const char* what = "the CUDA kernels' inputs") {
  switch (d) {
    case DType::f32: return f(float{});
    case DType::bf16: return f(__nv_bfloat16{});
    case DType::f16: return f(__half{});
    default:
      throw Error(std::string(what) + " must be float32, bfloat16 or float16, got " +
                  dtype_name(d));
  }
}

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
