// tpf::cuda::info (kernels/info.h): versions compiled in and found at run time, and the devices.
#include <cublas_api.h>
#include <cuda_runtime.h>
#include <cutlass/version.h>
#include <library_types.h>

#include <string>

#include "kernels/info.h"

namespace tpf::cuda {

CudaInfo info() {
  CudaInfo r;
  r.built = true;
  r.arch = "sm_90a";
  r.cuda_compiled = CUDART_VERSION;
  r.cublas_compiled = CUBLAS_VERSION;
  r.cutlass = std::to_string(CUTLASS_MAJOR) + "." + std::to_string(CUTLASS_MINOR) + "." +
              std::to_string(CUTLASS_PATCH);
  cudaRuntimeGetVersion(&r.cuda_runtime);
  if (cudaDriverGetVersion(&r.cuda_driver) != cudaSuccess) r.cuda_driver = 0;
  int major = 0, minor = 0, patch = 0;
  if (cublasGetProperty(MAJOR_VERSION, &major) == CUBLAS_STATUS_SUCCESS &&
      cublasGetProperty(MINOR_VERSION, &minor) == CUBLAS_STATUS_SUCCESS &&
      cublasGetProperty(PATCH_LEVEL, &patch) == CUBLAS_STATUS_SUCCESS)
    r.cublas_runtime = major * 10000 + minor * 100 + patch;
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    r.error = cudaGetErrorString(e);
    cudaGetLastError();  // leave no sticky error behind for the next caller
    return r;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) continue;
    r.devices.push_back({p.name, p.major, p.minor});
  }
  return r;
}

}  // namespace tpf::cuda
