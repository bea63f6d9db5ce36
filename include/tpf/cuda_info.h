// What this build knows of CUDA, for `tpf doctor`: whether the kernels (libtpf_cuda) are built in,
// the versions they were built with and run on, and the GPUs the CUDA runtime sees. Never throws:
// on a machine without a GPU or driver the counts are 0 and `error` says why.
#pragma once
#include <string>
#include <vector>

namespace tpf {

struct CudaDevice {
  std::string name;
  int major = 0, minor = 0;  // compute capability
};

struct CudaInfo {
  bool built = false;       // this build carries the CUDA kernels
  std::string arch;         // the targets they were compiled for, e.g. "sm_90a"
  int cuda_compiled = 0;    // CUDART_VERSION at compile time (e.g. 13000 for 13.0)
  int cuda_runtime = 0;     // cudaRuntimeGetVersion (libtpf_cuda links the runtime statically)
  int cuda_driver = 0;      // cudaDriverGetVersion; 0 where no driver is installed
  int cublas_compiled = 0;  // CUBLAS_VERSION at compile time (major * 10000 + minor * 100 + patch)
  int cublas_runtime = 0;   // cublasGetProperty of the libcublas loaded, same encoding
  std::string cutlass;      // CUTLASS version of the headers the kernels were built with
  std::vector<CudaDevice> devices;
  std::string error;  // why no device is listed (cudaGetDeviceCount's error), if any
};

CudaInfo cuda_info();

}  // namespace tpf
