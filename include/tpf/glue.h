// Fused glue around the PairFormer's big ops: LayerNorm, SwiGLU and the attention's output gate,
// each one pass over memory forward and one backward, where PyTorch's eager mode spends several
// kernels (and, for LayerNorm over 128 channels, a slow one) on each.
//
//   layer_norm:   y = (x - mean) * rstd * weight + bias over the last dim of x (C channels).
//                 x [..., C] with up to three leading dims of any strides (a transposed pair
//                 tensor is read in place), stride 1 over C; y contiguous in x's logical order,
//                 any float dtype (the dtype the next GEMM wants: no separate cast); weight and
//                 bias float32 [C]; mean and rstd float32 [rows] kept for the backward.
//                 Backward: dx with x's strides and dtype; dweight, dbias float32 [C] summed in a
//                 fixed order (deterministic) through a workspace of partial sums.
//   swiglu:       h = silu(a) * b, where ab [M, 2H] holds a in its first H columns and b in the
//                 last (one GEMM's output). Backward writes d(ab) [M, 2H], the GEMM's gradient.
//   gated_output: y[r, h*D + d] = sigmoid(g[r, h*D + d]) * o[bn, h, s, d], r = bn*S + s: the
//                 attention's heads [BN, H, S, D] back to rows [BN*S, H*D] and gated in one pass;
//                 g may be a column slice of a wider GEMM output (any row stride, stride 1 over
//                 columns). Backward: dg [R, H*D] and do [BN, H, S, D].
// Storage float32, bfloat16 or float16; the kernels' math in float32 whatever the storage dtype,
// the CPU path's the same in FP64 loops (one rounding per output). Each call validates its arguments (tpf::Error naming the
// argument and what was expected), then runs on their device, on `stream` for CUDA tensors.
#pragma once
#include <cstddef>
#include "tpf/tensor.h"

namespace tpf {

struct LayerNormForwardArgs {
  TensorView x, weight, bias;
  double eps = 1e-5;
  TensorView y, mean, rstd;
};

struct LayerNormBackwardArgs {
  TensorView dy, x, weight, mean, rstd;
  TensorView dx, dweight, dbias;
  Allocator workspace;  // required for CUDA tensors (partial sums of the weight gradients)
};

struct SwigluArgs {  // forward: ab -> h; backward: dh, ab -> dab
  TensorView ab, h, dh, dab;
};

struct GatedOutputArgs {  // forward: g, o -> y; backward: dy, g, o -> dg, do_
  TensorView g, o, y, dy, dg, do_;
};

void layer_norm_forward(const LayerNormForwardArgs& a, void* stream = nullptr);
void layer_norm_backward(const LayerNormBackwardArgs& a, void* stream = nullptr);
void swiglu_forward(const SwigluArgs& a, void* stream = nullptr);
void swiglu_backward(const SwigluArgs& a, void* stream = nullptr);
void gated_output_forward(const GatedOutputArgs& a, void* stream = nullptr);
void gated_output_backward(const GatedOutputArgs& a, void* stream = nullptr);

// The largest channel count layer_norm takes.
constexpr int64_t kLayerNormMaxChannels = 1024;

}  // namespace tpf
