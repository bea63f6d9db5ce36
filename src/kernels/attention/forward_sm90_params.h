// The one parameter struct of the Hopper forward kernel (forward_sm90.cu), passed by value as a
// __grid_constant__ so that the TMA descriptors live in parameter space: the tensors' fields
// (AttentionForwardParams, as the backward has them) and what this kernel's tiles derive from them.
#pragma once
#include <cuda.h>

#include <cstdint>

#include "kernels/attention/params.h"

namespace tpf::cuda::fwd90 {

struct Params {
  // K and V [B, N, H, Sk, D] as 5-d TMA maps: dim 0 is D (box W, swizzled), dims 1..4 are key,
  // h, n, b in increasing stride order (the box is 64 along the key's dim, 1 along the others);
  // k_dims / v_dims hold the map dim of key, h, n, b in 2-bit fields (bits 0-1, 2-3, 4-5, 6-7).
  CUtensorMap tma_k;
  CUtensorMap tma_v;
  uint32_t k_dims, v_dims;
  // The tensors as both attention kernels see them (q, mask, o, residual, lse, their strides, the
  // sizes), filled by entry.cu's forward_params, the one place that fills them for the forward and
  // the backward; this kernel reads k, v and the bias through tma_k, tma_v and `bias` instead.
  AttentionForwardParams fwd;
  const float* bias;  // the pre-pass's output (forward_workspace_bytes): fp32, fragment order
  int D;
  int q_blocks, key_tiles, slice_groups;
  float
      score_log2;  // |scale| log2(e): exponent of a score in acc units (acc = q.k + bias / |scale|)
  float scale_abs;  // |scale|, for the lse
  uint32_t q_sign;  // 0x80008000 when scale < 0: the Q fragments are negated (exact)
};

}  // namespace tpf::cuda::fwd90
