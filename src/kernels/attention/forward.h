// Host-side launchers of the attention kernels (called from entry.cu).
#pragma once
#include <cuda_runtime.h>

#include "kernels/attention/params.h"

namespace tpf::cuda {

// T: __nv_bfloat16 or __half; head_dim: 16, 32 or 64 (checked by the caller).
template <typename T>
void attention_forward_launch(const AttentionForwardParams& p, int head_dim, cudaStream_t stream);

// The wgmma forward (forward_wgmma.cu), D = 16 or 32; attention_forward_launch picks it when
// TPF_ATTENTION_FWD_WGMMA=1.
template <typename T, int D>
void attention_forward_wgmma_launch(const AttentionForwardParams& p, cudaStream_t stream);

template <typename T>
void attention_backward_launch(const AttentionBackwardParams& p, int head_dim, cudaStream_t stream);

}  // namespace tpf::cuda
