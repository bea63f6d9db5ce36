// Entry points of libtpf_cuda for triangle attention. Arguments are validated by the caller
// (src/ops/attention.cpp), against the limits stated here; these only launch. Defined in the CUDA
// library, or by src/kernels/unavailable.cpp in a build without it.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/attention/backward_sm90_tiles.h"
#include "kernels/attention/forward_sm90_layout.h"
#include "tpf/attention.h"

namespace tpf::cuda {

// What the kernels take, every limit that a launch would otherwise meet (src/ops checks each before
// anything is queued): bfloat16 or float16 inputs, these head dims, at most kAttentionMaxGridY of
// each of B * H and query tiles (grid dimensions y and z), at most kAttentionMaxSlices slices
// B * N * H (32-bit indices; the forward's and the delta kernel's grid dimension x), and these key
// counts. The forward
// (forward_sm90.h) takes every multiple of 8 up to 128, a bias of q's dtype or float32, and K and
// V rows that TMA can copy (attention_tma_ready); the backward every multiple of 8 up to 128, the
// same biases (a float32 bias's gradient in float32) and Q, K, V and dO rows that TMA can copy.
constexpr const char* kAttentionForwardHeadDims = "8, 16, 24, ..., 128 (multiples of 8)";
inline bool attention_forward_head_dim_supported(int64_t D) {
  return D >= 8 && D <= fwd90::kMaxHeadDim && D % 8 == 0;
}
// The most keys the CUDA forward takes at head dim D (its key tiles' mask words in shared memory).
inline int64_t attention_forward_max_keys(int64_t D) { return fwd90::max_keys(int(D)); }
constexpr const char* kAttentionHeadDims = "8, 16, 24, ..., 128 (multiples of 8)";
inline bool attention_head_dim_supported(int64_t D) { return D >= 8 && D <= 128 && D % 8 == 0; }
// TMA's requirements on a [B, N, H, S, D] tensor: a 16-byte aligned start and every stride but the
// last (1) a multiple of 16 bytes.
inline bool attention_tma_ready(const TensorView& t) {
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0) return false;
  for (int i = 0; i < t.ndim - 1; ++i)
    if ((t.stride[i] * dtype_size(t.dtype)) % 16 != 0) return false;
  return true;
}
constexpr int64_t kAttentionMaxGridY = 65535;
constexpr int64_t kAttentionQueryTile = kTileQ;
constexpr int64_t kAttentionMaxSlices = 2147483647;
// The most keys the CUDA backward takes: its dbias finish kernel's key tiles are grid dimension y.
constexpr int64_t kAttentionBackwardMaxKeys = kAttentionMaxGridY * kBwdFinishTile;

bool available();
// Asks a.workspace for the bias pre-pass's scratch.
void attention_forward(const AttentionForwardArgs& a, const AttentionDims& d, void* stream);
// Sizes its workspace once and asks a.workspace for it.
void attention_backward(const AttentionBackwardArgs& a, const AttentionDims& d, void* stream);

}  // namespace tpf::cuda
