// The one parameter struct of the Hopper forward kernel (forward_sm90.cu), passed by value as a
// __grid_constant__ so that the TMA descriptors live in parameter space.
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
  const float* bias;  // the pre-pass's output (forward_workspace_bytes): fp32, fragment order
  const void* q;      // [B, N, H, Sq, D], any strides (read once per CTA into registers)
  Strides4 q_stride;
  const uint8_t* mask;  // [B, N, Sk] or nullptr
  int64_t mask_stride_b, mask_stride_n;
  void* o;
  Strides4 o_stride;
  void* residual;  // bf16, or nullptr
  Strides4 residual_stride;
  float* lse;  // [B, N, H, Sq], or nullptr
  int64_t lse_stride_b, lse_stride_n, lse_stride_h, lse_stride_s;
  int B, N, H, Sq, Sk, D;
  int q_blocks, key_tiles, slice_groups;
  float
      score_log2;  // |scale| log2(e): exponent of a score in acc units (acc = q.k + bias / |scale|)
  float scale_abs;  // |scale|, for the lse
  uint32_t q_sign;  // 0x80008000 when scale < 0: the Q fragments are negated (exact)
};

}  // namespace tpf::cuda::fwd90
