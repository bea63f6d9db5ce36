// Triangle multiplicative update (AlphaFold3 algorithms 12 and 13, fused as cuEquivariance does).
//
//   x [B, S, S, D], mask [B, S, S] (multiplies a and b), y [B, S, S, D]
//   x_ln = LayerNorm_in(x)
//   a | b = sigmoid(x_ln Wg_in^T + bg_in) * (x_ln Wp_in^T + bp_in) * mask     (2D channels: a first)
//   outgoing: z_ij = sum_k a_ik * b_jk        incoming: z_ij = sum_k a_ki * b_kj   (per channel)
//   go = x_ln Wg_out^T + bg_out
//   y = sigmoid(go) * (LayerNorm_out(z) Wp_out^T + bp_out)
//
// Weights are laid out as cuEquivariance's (nn.Linear's [out, in]): Wp_in, Wg_in [2D, D];
// Wp_out, Wg_out [D, D]; the four projection biases are optional (absent = zero).
//
// Dtypes: x float32, bfloat16 or float16 (float64 too for the reference). The CPU path and the
// reference take the mask in x's dtype and weights of any float dtype. The CUDA kernels take the
// mask as bool, uint8, float32, bfloat16 or float16 (each value rounded to x's dtype), and all
// weights in one dtype, float32, bfloat16 or float16, read as they are (math in float32); weight
// gradients have the weights' dtype.
//
// The forward keeps what the backward needs in x's dtype: a and b channel-major [B, D, S, S] (each
// channel one S x S matrix, so the contraction is one strided-batched GEMM), z channel-major
// [B, D, S, S] and the output gate logits go [B, S, S, D]. Every gradient is deterministic: every
// reduction runs in a fixed order.
#pragma once
#include <cstddef>
#include "tpf/tensor.h"

namespace tpf {

struct TrimulWeights {
  TensorView norm_in_weight, norm_in_bias;  // [D]
  TensorView p_in_weight, g_in_weight;      // [2D, D]
  OptionalTensor p_in_bias, g_in_bias;      // [2D]
  TensorView norm_out_weight, norm_out_bias;
  TensorView p_out_weight, g_out_weight;  // [D, D]
  OptionalTensor p_out_bias, g_out_bias;  // [D]
};

// Gradients of TrimulWeights, same shapes; a bias gradient is present iff its bias is.
using TrimulWeightGrads = TrimulWeights;

// What the forward keeps for the backward (x's dtype, contiguous).
struct TrimulSaved {
  TensorView a, b, z;  // [B, D, S, S]
  TensorView go;       // [B, S, S, D]
};

struct TrimulForwardArgs {
  TensorView x;
  OptionalTensor mask;
  TrimulWeights w;
  bool outgoing = true;
  double eps = 1e-5;
  TensorView y;
  TrimulSaved saved;
  Allocator workspace;  // required for CUDA tensors
};

struct TrimulBackwardArgs {
  TensorView x;
  OptionalTensor mask;
  TrimulWeights w;
  bool outgoing = true;
  double eps = 1e-5;
  TrimulSaved saved;
  TensorView dy;
  TensorView dx;
  TrimulWeightGrads dw;
  Allocator workspace;  // required for CUDA tensors
};

// The backward's arguments over a forward's: the same x, mask, weights, direction, eps and saved
// tensors; the caller adds dy, dx, the weights' gradients and the workspace.
inline TrimulBackwardArgs backward_args_of(const TrimulForwardArgs& f) {
  TrimulBackwardArgs b;
  b.x = f.x, b.mask = f.mask, b.w = f.w, b.outgoing = f.outgoing, b.eps = f.eps;
  b.saved = f.saved;
  return b;
}

struct TrimulDims {
  int64_t B, S, D;
};

// Validate (throwing tpf::Error that names the argument and what was expected), then run on the
// tensors' device: the CPU path (FP32 math, tiled like the GPU kernels, multithreaded,
// deterministic) for CPU tensors, the CUDA kernels for CUDA tensors on `stream` (a cudaStream_t;
// nullptr is the default stream). Never synchronize.
void trimul_forward(const TrimulForwardArgs& a, void* stream = nullptr);
void trimul_backward(const TrimulBackwardArgs& a, void* stream = nullptr);

namespace reference {
// FP64 reference on CPU tensors of any float dtype: y only (saved is ignored).
void trimul_forward_f64(const TrimulForwardArgs& a);
// FP64 reference backward: recomputes the forward from x; dx and every weight gradient.
void trimul_backward_f64(const TrimulBackwardArgs& a);
}  // namespace reference

}  // namespace tpf
