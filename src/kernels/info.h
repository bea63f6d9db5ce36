// libtpf_cuda's build and runtime facts (tpf/cuda_info.h); kernels/unavailable.cpp answers for
// builds without it.
#pragma once
#include "tpf/cuda_info.h"

namespace tpf::cuda {
CudaInfo info();
}
