// Host entry of the Hopper forward (forward_sm90.cu), called by entry.cu.
#pragma once
#include <cuda_runtime.h>

#include "tpf/attention.h"

namespace tpf::cuda::fwd90 {

// Padded head dims compiled so far (multiples of 16 up to this).
constexpr int kCompiledHeadDim = 128;

// Head dims this kernel takes: multiples of 8 whose padded size is compiled.
bool supports(const AttentionDims& d);

// Runs the bias pre-pass into a.workspace (forward_workspace_bytes) and the kernel on `stream`.
// T: the dtype of q, k, v and o (bf16 or fp16); the bias may be T or float32.
template <typename T>
void launch(const AttentionForwardArgs& a, const AttentionDims& d, cudaStream_t stream);

}  // namespace tpf::cuda::fwd90
