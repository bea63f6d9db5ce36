// Host entry of the Hopper forward (forward_sm90.cu), called by entry.cu.
#pragma once
#include <cuda_runtime.h>

#include "kernels/attention/params.h"
#include "tpf/attention.h"

namespace tpf::cuda::fwd90 {

// Head dims: every multiple of 8 up to 128 (api.h's attention_forward_head_dim_supported), padded
// to a multiple of 16 (padded_head_dim).
// Runs the bias pre-pass into `workspace` (forward_workspace_bytes of forward_sm90_tiles.h)
// and the kernel on `stream`. T: the dtype of q, k, v and o (bf16 or fp16); the bias may be T or
// float32. `f`: the tensors' fields (entry.cu's forward_params); `a`: the views of k and v (their
// TMA maps), the bias's dtype and the scale.
template <typename T>
void launch(const AttentionForwardParams& f, const AttentionForwardArgs& a, const AttentionDims& d,
            void* workspace, cudaStream_t stream);

}  // namespace tpf::cuda::fwd90
