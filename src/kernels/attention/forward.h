// Host-side launchers of the attention kernels (called from entry.cu).
#pragma once
#include <cuda_runtime.h>

#include "kernels/attention/params.h"

namespace tpf::cuda {

// T: __nv_bfloat16 or __half; head_dim: 16, 32 or 64 (checked by the caller).
template <typename T>
void attention_forward_launch(const AttentionForwardParams& p, int head_dim, cudaStream_t stream);

template <typename T>
void attention_backward_launch(const AttentionBackwardParams& p, int head_dim, cudaStream_t stream);

}  // namespace tpf::cuda
