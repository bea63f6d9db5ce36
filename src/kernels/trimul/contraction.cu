#include <cublas_v2.h>

#include <string>
#include <unordered_map>

#include "kernels/trimul/blas.h"
#include "kernels/trimul/launch.h"

namespace tpf::cuda::trimul {
namespace {

void check_cublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw RuntimeError(std::string(what) + ": " + cublasGetStatusString(status));
}

// One handle per (thread, device), never destroyed: destroying handles at thread or process exit
// can run after the CUDA context is gone.
cublasHandle_t thread_handle() {
  thread_local std::unordered_map<int, cublasHandle_t> handles;
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  cublasHandle_t h;
  check_cublas(cublasCreate(&h), "cublasCreate");
  // FP32 accumulation everywhere, with no reduced-precision split-K reductions; no TF32 for
  // float32 inputs (the default math mode).
  check_cublas(cublasSetMathMode(h, cublasMath_t(CUBLAS_DEFAULT_MATH |
                                                 CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)),
               "cublasSetMathMode");
  handles.emplace(device, h);
  return h;
}

// Row-major C[M, N] = op(A) op(B) as cuBLAS's column-major C^T = op(B)^T op(A)^T, batched.
void gemm(const Blas& blas, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
          const void* A, int64_t lda, int64_t stride_a, const void* B, int64_t ldb,
          int64_t stride_b, void* C, cudaDataType c_type, int64_t ldc, int64_t stride_c,
          int64_t batch) {
  const float one = 1.0f, zero = 0.0f;
  check_cublas(cublasGemmStridedBatchedEx(
                   blas.handle(), trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                   trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, int(N), int(M), int(K), &one, B,
                   blas.dtype(), int(ldb), stride_b, A, blas.dtype(), int(lda), stride_a, &zero, C,
                   c_type, int(ldc), stride_c, int(batch), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               "cublasGemmStridedBatchedEx");
}

}  // namespace

Blas::Blas(cudaStream_t stream, void* workspace, size_t workspace_bytes, cudaDataType dtype)
    : handle_(thread_handle()), dtype_(dtype) {
  check_cublas(cublasSetStream(handle_, stream), "cublasSetStream");
  // After cublasSetStream, which resets the workspace to cuBLAS's own pool.
  check_cublas(cublasSetWorkspace(handle_, workspace, workspace_bytes), "cublasSetWorkspace");
}

void contract(const Blas& blas, const Params& p) {
  const int64_t S = p.S, SS = S * S;
  gemm(blas, !p.outgoing, p.outgoing, S, S, S, p.a, S, SS, p.b, S, SS, p.z, blas.dtype(), S, SS,
       p.B * p.D);
}

void contract_backward(const Blas& blas, const Params& p) {
  const int64_t S = p.S, SS = S * S, batch = p.B * p.D;
  if (p.outgoing) {
    gemm(blas, false, false, S, S, S, p.dz, S, SS, p.b, S, SS, p.da, blas.dtype(), S, SS, batch);
    gemm(blas, true, false, S, S, S, p.dz, S, SS, p.a, S, SS, p.db, blas.dtype(), S, SS, batch);
  } else {
    gemm(blas, false, true, S, S, S, p.b, S, SS, p.dz, S, SS, p.da, blas.dtype(), S, SS, batch);
    gemm(blas, false, false, S, S, S, p.a, S, SS, p.dz, S, SS, p.db, blas.dtype(), S, SS, batch);
  }
}

void weight_gradient(const Blas& blas, int64_t M, int64_t N, int64_t K, const void* G, int64_t ldg,
                     const void* X, int64_t ldx, float* dW) {
  gemm(blas, true, false, M, N, K, G, ldg, 0, X, ldx, 0, dW, CUDA_R_32F, N, 0, 1);
}

}  // namespace tpf::cuda::trimul
