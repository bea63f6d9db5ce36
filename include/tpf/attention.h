// Triangle attention: N slices of attention over S tokens, sharing one pair bias per head.
//
//   q [B, N, H, Sq, D], k, v [B, N, H, Sk, D], bias [B, H, Sq, Sk] (or cuEquivariance's
//   [B, 1, H, Sq, Sk]), mask [B, N, Sk] (or [B, N, 1, 1, Sk]; bool, True = attend)
//   o [B, N, H, Sq, D], lse [B, N, H, Sq] (natural log; +inf for a row with no key): float32, or
//   float64 on the CPU, which the torch layer uses for float32 inputs so that the backward's
//   recomputed probabilities are as accurate as a stored softmax.
//
// Sq may differ from Sk so that a caller can run a range of queries with the matching bias rows
// (context parallelism does). Every tensor is strided; only the last (feature) dimension must have
// stride 1. All four gradients are deterministic: every reduction runs in a fixed order.
#pragma once
#include <cstddef>
#include "tpf/tensor.h"

namespace tpf {

struct AttentionForwardArgs {
  TensorView q, k, v;
  TensorView bias;      // [B, H, Sq, Sk] or [B, 1, H, Sq, Sk]
  OptionalTensor mask;  // [B, N, Sk] or [B, N, 1, 1, Sk]
  TensorView o, lse;
  // BF16 residual of O's rounding, r = bf16(O_fp32 - O_out); only for 16-bit outputs.
  OptionalTensor residual;
  double scale = 0.0;
  Allocator workspace;  // required for CUDA tensors (the bias pre-scaled to fp32 for the kernel)
};

struct AttentionBackwardArgs {
  TensorView q, k, v, bias;
  OptionalTensor mask;
  TensorView o, lse, dout;
  OptionalTensor
      residual;  // when present, delta = rowsum(dO * (O + r)) ("output-residual compensation")
  TensorView dq, dk, dv, dbias;  // dbias has bias's shape
  double scale = 0.0;
  Allocator workspace;  // required for CUDA tensors
};

// The backward's arguments over a forward's: the same q, k, v, bias, mask, o, lse, residual and
// scale; the caller adds dout, the gradients and the workspace.
inline AttentionBackwardArgs backward_args_of(const AttentionForwardArgs& f) {
  AttentionBackwardArgs b;
  b.q = f.q, b.k = f.k, b.v = f.v, b.bias = f.bias, b.mask = f.mask, b.o = f.o, b.lse = f.lse;
  b.residual = f.residual, b.scale = f.scale;
  return b;
}

// Sizes after validation.
struct AttentionDims {
  int64_t B, N, H, Sq, Sk, D;
};

// Validate (throwing tpf::Error that names the argument and what was expected), then run on the
// tensors' device: the CPU path (FP64 sums, blocked like the GPU kernels, multithreaded,
// deterministic) for CPU tensors, the CUDA kernels for CUDA tensors on `stream` (a cudaStream_t;
// nullptr is the default stream). Never synchronize. q, k, v, bias: float32, bfloat16 or float16
// (bfloat16 or float16 on CUDA).
void attention_forward(const AttentionForwardArgs& a, void* stream = nullptr);
void attention_backward(const AttentionBackwardArgs& a, void* stream = nullptr);

// attention_forward's validation of its inputs alone, for a caller that computes the op another
// way (the torch layer's float32 CUDA path): throws what attention_forward would for them.
void check_attention_inputs(const TensorView& q, const TensorView& k, const TensorView& v,
                            const TensorView& bias, const OptionalTensor& mask, double scale);

// Whether this build carries the CUDA kernels and a device is present.
bool cuda_available();

namespace reference {
// FP64 reference on CPU tensors: o (float64) and lse (float64) from inputs of any float dtype.
void attention_forward_f64(const AttentionForwardArgs& a);
// FP64 reference backward: exact gradients (float64 outputs); ignores o/residual and recomputes O.
void attention_backward_f64(const AttentionBackwardArgs& a);
}  // namespace reference

}  // namespace tpf
