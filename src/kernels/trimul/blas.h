// The cuBLAS parts of the triangle multiplicative update: the per-channel contraction (strided-
// batched GEMMs over a and b stored channel-major) and the weight gradients (GEMMs over all
// positions). cuBLAS runs without atomics on a fixed workspace, so results are deterministic.
#pragma once
#include <cublas_api.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/trimul/params.h"

namespace tpf::cuda::trimul {

// The calling thread's handle for the current device, bound to a stream and a workspace.
class Blas {
 public:
  Blas(cudaStream_t stream, void* workspace, size_t workspace_bytes, cudaDataType dtype);
  cublasHandle_t handle() const { return handle_; }
  cudaDataType dtype() const { return dtype_; }

 private:
  cublasHandle_t handle_;
  cudaDataType dtype_;
};

// Per channel (b, c): z = a b^T (outgoing) or a^T b (incoming), S x S, in x's dtype.
void contract(const Blas& blas, const Params& p);
// Per channel: outgoing dA = dZ B, dB = dZ^T A; incoming dA = B dZ^T, dB = A dZ.
void contract_backward(const Blas& blas, const Params& p);
// dW[M, N] (fp32) = G^T X over K positions: G [K, M] with row stride ldg, X [K, N] with row
// stride ldx, both in x's dtype.
void weight_gradient(const Blas& blas, int64_t M, int64_t N, int64_t K, const void* G, int64_t ldg,
                     const void* X, int64_t ldx, float* dW);

}  // namespace tpf::cuda::trimul
