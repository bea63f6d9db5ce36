// Triangle attention: N slices of attention over S tokens, sharing one pair bias per head.
//
//   q [B, N, H, Sq, D], k, v [B, N, H, Sk, D], bias [B, H, Sq, Sk], mask [B, N, Sk] (bool, True = attend)
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
  TensorView q, k, v, bias;
  OptionalTensor mask;
  TensorView o, lse;
  // BF16 residual of O's rounding, r = bf16(O_fp32 - O_out); only for 16-bit outputs.
  OptionalTensor residual;
  double scale = 0.0;
  // Device scratch for the CUDA path, from the caller's allocator
  // (attention_forward_workspace_bytes): the bias pre-scaled to fp32 for the kernel.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

struct AttentionBackwardArgs {
  TensorView q, k, v, bias;
  OptionalTensor mask;
  TensorView o, lse, dout;
  OptionalTensor
      residual;  // when present, delta = rowsum(dO * (O + r)) ("output-residual compensation")
  TensorView dq, dk, dv, dbias;
  double scale = 0.0;
  // Device scratch for the CUDA path, from the caller's allocator (attention_backward_workspace_bytes).
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// Sizes after validation.
struct AttentionDims {
  int64_t B, N, H, Sq, Sk, D;
};

// Validation shared by every path: throws tpf::Error naming the argument and what was expected.
AttentionDims check_attention_forward(const AttentionForwardArgs& a);
AttentionDims check_attention_backward(const AttentionBackwardArgs& a);

// Validates, then runs on the tensors' device: the CPU path for CPU tensors, the CUDA kernels for
// CUDA tensors on `stream` (a cudaStream_t; nullptr is the default stream). Never synchronizes.
void attention_forward(const AttentionForwardArgs& a, void* stream = nullptr);
void attention_backward(const AttentionBackwardArgs& a, void* stream = nullptr);

// Scratch bytes attention_forward needs in AttentionForwardArgs::workspace (0 on the CPU).
size_t attention_forward_workspace_bytes(const AttentionDims& d, Device device);

// Scratch bytes attention_backward needs in AttentionBackwardArgs::workspace (0 on the CPU).
size_t attention_backward_workspace_bytes(const AttentionDims& d, Device device);

// CPU path: FP32 math, blocked like the GPU kernels, multithreaded, deterministic.
void attention_forward_cpu(const AttentionForwardArgs& a);
void attention_backward_cpu(const AttentionBackwardArgs& a);

// Whether this build carries the CUDA kernels.
bool cuda_available();

namespace reference {
// FP64 reference on the CPU: o (float64) and lse (float64) from inputs of any float dtype.
void attention_forward_f64(const AttentionForwardArgs& a);
// FP64 reference backward: exact gradients (float64 outputs); ignores o/residual and recomputes O.
void attention_backward_f64(const AttentionBackwardArgs& a);
}  // namespace reference

}  // namespace tpf
