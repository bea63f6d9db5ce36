// Entry points of libtpf_cuda for triangle attention. Arguments are validated by the caller
// (src/ops/attention.cpp), against the limits stated here; these only launch. Defined in the CUDA
// library, or by src/kernels/unavailable.cpp in a build without it.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/attention/tile_config.h"
#include "tpf/attention.h"

namespace tpf::cuda {

// What the kernels take: bfloat16 or float16 inputs, these head dims, and at most
// kAttentionMaxGridY of each of B * H and query tiles (grid dimensions y and z).
constexpr const char* kAttentionHeadDims = "16, 32 and 64";
inline bool attention_head_dim_supported(int64_t D) { return D == 16 || D == 32 || D == 64; }
constexpr int64_t kAttentionMaxGridY = 65535;
constexpr int64_t kAttentionQueryTile = kTileQ;

bool available();
void attention_forward(const AttentionForwardArgs& a, const AttentionDims& d, void* stream);
// Sizes its workspace once and asks a.workspace for it.
void attention_backward(const AttentionBackwardArgs& a, const AttentionDims& d, void* stream);

}  // namespace tpf::cuda
