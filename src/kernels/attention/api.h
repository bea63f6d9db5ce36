// Entry points of libtpf_cuda for triangle attention. Arguments are validated by the caller
// (src/core/attention_dispatch.cpp); these only launch. Defined in the CUDA library, or by
// src/core/cuda_unavailable.cpp in a build without it.
#pragma once
#include <cstddef>
#include "tpf/attention.h"

namespace tpf::cuda {

bool available();
void attention_forward(const AttentionForwardArgs& a, const AttentionDims& d, void* stream);
size_t attention_backward_workspace_bytes(const AttentionDims& d);
void attention_backward(const AttentionBackwardArgs& a, const AttentionDims& d, void* stream);

}  // namespace tpf::cuda
