// Host side of the triangle multiplicative update kernels: the launchers (one per kernel file) and
// the helpers they share. Launchers never synchronize; errors become tpf::RuntimeError.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "kernels/trimul/params.h"
#include "tpf/error.h"

namespace tpf::cuda::trimul {

inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw RuntimeError(std::string(what) + ": " + cudaGetErrorString(e));
}

inline void check_launch(const char* kernel) { check_cuda(cudaGetLastError(), kernel); }

// Allows the kernel `bytes` of dynamic shared memory on the current device (before each launch: the
// attribute is per device, and setting it is a host-side call that does not synchronize).
template <typename Kernel>
void set_max_smem(Kernel kernel, size_t bytes) {
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)),
             "cudaFuncSetAttribute");
}

template <typename T> void launch_pack_weights(const Params& p, const float* const* weights,
                                               const float* const* biases, void* w_in, void* w_out,
                                               float* bias_in, float* bias_out, cudaStream_t s);
template <typename T> void launch_input_forward(const Params& p, cudaStream_t s);
template <typename T> void launch_output_forward(const Params& p, cudaStream_t s);
template <typename T> void launch_output_backward(const Params& p, cudaStream_t s);
template <typename T> void launch_input_backward(const Params& p, cudaStream_t s);

// Sums rows [0, rows) of partials [rows, cols] in row order; column c goes to segment k with
// begin[k] <= c < begin[k + 1], at dst[k][c - begin[k]] (skipped where dst[k] is null).
struct ColumnSinks {
  static constexpr int kMax = 4;
  float* dst[kMax];
  int begin[kMax + 1];
};
void launch_reduce_partials(const float* partials, int rows, int cols, const ColumnSinks& sinks,
                            cudaStream_t s);

}  // namespace tpf::cuda::trimul

#define TPF_TRIMUL_INSTANTIATE(launcher)                                     \
  template void launcher<float>(const Params&, cudaStream_t);                \
  template void launcher<__nv_bfloat16>(const Params&, cudaStream_t);        \
  template void launcher<__half>(const Params&, cudaStream_t);
