// The plain structs that cross from the host entry points (entry.cu) into the kernels: raw pointers,
// int64 strides in elements, sizes and flags. Nothing from PyTorch or Python.
#pragma once
#include <cstdint>

#include "tpf/tensor.h"

namespace tpf::cuda {

// Strides of a [B, N, H, S, D] tensor (the feature stride is 1).
struct Strides4 {
  int64_t b, n, h, s;
};
inline Strides4 strides4(const TensorView& t) {
  return {t.stride[0], t.stride[1], t.stride[2], t.stride[3]};
}

// The forward's tensors as both kernels see them: the Hopper forward's Params (forward_sm90_params.h)
// and the backward's hold one, filled by entry.cu's forward_params.
struct AttentionForwardParams {
  const void* q;
  const void* k;
  const void* v;
  const void* bias;     // [B, H, Sq, Sk]
  const uint8_t* mask;  // [B, N, Sk] or nullptr
  void* o;
  float* lse;      // [B, N, H, Sq]
  void* residual;  // bf16 [B, N, H, Sq, D] or nullptr
  Strides4 q_stride, k_stride, v_stride, o_stride, residual_stride;
  int64_t bias_stride_b, bias_stride_h, bias_stride_q;
  int64_t mask_stride_b, mask_stride_n;
  int64_t lse_stride_b, lse_stride_n, lse_stride_h, lse_stride_s;
  int B, N, H, Sq, Sk;
  float scale;  // softmax scale
};

struct AttentionBackwardParams {
  AttentionForwardParams fwd;  // q, k, v, bias, mask, o, lse, residual and their strides
  const void* dout;
  void* dq;
  void* dk;
  void* dv;
  void* dbias;
  Strides4 dout_stride, dq_stride, dk_stride, dv_stride;
  int64_t dbias_stride_b, dbias_stride_h, dbias_stride_q;
  int head_dim;  // the tensors' D; the kernel's (backward_sm90.h) may be larger, zero-padded
  bool dout_aligned;
  bool delta_vectorized;  // o, dout (and residual) rows start on 16-byte boundaries
  // In the workspace (backward_sm90.h's Sm90BackwardWorkspace): delta and lse log2(e) per query
  // row, [B][N][H][Sq_pad]; a copy of a bias whose rows TMA cannot read, or nullptr.
  float* delta;
  float* lse2;
  void* bias_copy;
  // The Hopper backward (backward_sm90.h): fp32 accumulators of dQ (one chunk of slices) and of
  // dbias^T, the semaphores that order the CTAs adding to them, and whether dq's rows allow 8-byte
  // stores.
  float* dq_acc;       // [chunk slices][B][H][Sq_pad][D]
  float* dbias_acc_t;  // [dbias lanes][B][H][key block][query tile][keys][64] (backward_sm90.h)
  int* dq_sem;         // [slice groups][B][H][query tiles]
  int* dbias_sem;      // [dbias lanes][B][H][query tiles][key blocks]
  int dbias_lanes;     // backward_sm90_tiles.h
  bool dq_aligned;
};

}  // namespace tpf::cuda
