// Host side of the triangle multiplicative update kernels: the launchers (one per kernel file) and
// the helpers they share. Launchers never synchronize; errors become tpf::RuntimeError.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels/common/device_guard.h"
#include "kernels/trimul/params.h"
#include "tpf/error.h"
#include "tpf/tensor.h"

namespace tpf::cuda::trimul {

// One kernel per job and element type (their tile sizes and CTAs per SM: tiles.h). 16-bit types
// (bfloat16, float16) run the kernels bounded for k16BitCtas CTAs per SM: GEMMs through mma.sync
// with ldmatrix fragments, epilogues from the MMA registers, the sigmoid through the approximate
// exponential and division (device.cuh), input_backward split in two persistent kernels
// (input_backward_split.cu) and output_backward persistent over k16BitOutputBackwardCtas CTAs.
// float32 runs its own kernels (GEMMs on the CUDA cores, IEEE sigmoid: float32 outputs keep
// float32 accuracy), at kF32Ctas CTAs per SM, persistent backward kernels over kBackwardCtas CTAs.
// The designs tried and deleted: bench/notes-trimul.md.
template <typename T>
constexpr bool kIsF32 = std::is_same_v<T, float>;

// Allows the kernel `bytes` of dynamic shared memory on the current device (before each launch: the
// attribute is per device, and setting it is a host-side call that does not synchronize).
template <typename Kernel>
void set_max_smem(Kernel kernel, size_t bytes) {
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)),
             "cudaFuncSetAttribute");
}

// Calls f(std::integral_constant<int, kD>{}) with the 16-bit kernels' instantiation for p.D: kD =
// 64 or 128 (D at compile time, device.cuh's Dims), else kD = 0 (D from Params). The static ones
// also take their tile indices in 32 bits and store the tiles' interiors with no per-piece
// predicates, assuming 16-byte aligned outputs (store_staged_tile): both are checked here, and
// where either does not hold (never, in practice) the run-time kernels run.
template <typename F>
void with_static_d(const Params& p, F&& f) {
  const auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  const bool fits = p.tiles <= INT32_MAX && aligned(p.y) && aligned(p.go) && aligned(p.a) &&
                    aligned(p.b) && aligned(p.dz) && aligned(p.dpo) && aligned(p.zln);
  if (fits && p.D == 64)
    f(std::integral_constant<int, 64>{});
  else if (fits && p.D == 128)
    f(std::integral_constant<int, 128>{});
  else
    f(std::integral_constant<int, 0>{});
}

// One launch of a kernel over Params with kThreads threads per CTA and `smem` bytes of dynamic
// shared memory (allowed first, see set_max_smem); `name` for the launch check.
template <typename Kernel>
void launch_kernel(Kernel kernel, dim3 grid, size_t smem, const Params& p, cudaStream_t stream,
                   const char* name) {
  set_max_smem(kernel, smem);
  kernel<<<grid, kThreads, smem, stream>>>(p);
  check_launch(name);
}

// What pack_weights reads (the weights, all of element type `dtype`: float32, bfloat16 or float16;
// a null bias is zero) and where it writes them in the workspace: w_in and w_out in T, the biases
// and the LayerNorm vectors in float32 (Params::bias_in, bias_out, ln_*).
struct PackArgs {
  const void *p_in, *g_in, *g_out, *p_out;  // [2D, D], [2D, D], [D, D], [D, D]
  const void* bias[4];                      // p_in, g_in (2D each), p_out, g_out (D each)
  const void* norm[4];                      // norm_in weight, bias, norm_out weight, bias ([D])
  DType dtype;
  void *w_in, *w_out;
  float *bias_in, *bias_out, *norms;  // [4D], [2D], [4D]
};
template <typename T>
void launch_pack_weights(const Params& p, const PackArgs& a, cudaStream_t s);
template <typename T>
void launch_input_forward(const Params& p, cudaStream_t s);
template <typename T>
void launch_output_forward(const Params& p, cudaStream_t s);
template <typename T>
void launch_output_backward(const Params& p, cudaStream_t s);
template <typename T>
void launch_input_backward(const Params& p, cudaStream_t s);
// The two kernels of the 16-bit types' input_backward, called by launch_input_backward.
template <typename T>
void launch_input_backward_split(const Params& p, cudaStream_t s);

// Sums the backward kernels' per-CTA partials (Params::partials_*) in row order, in double, into
// Params::sums; one launch, no atomics.
void launch_reduce_sums(const Params& p, cudaStream_t s);

// Everything the backward gives that is not a cuBLAS output, in the weights' dtype (computed as
// in float32, rounded once at the store): the sums copied out, the two LayerNorm bias gradients
// from the projection bias sums (d norm_out_bias = Wp_out^T d bp_out, d norm_in_bias = Wp_in^T
// d bp_in + Wg_in^T d bg_in + Wg_out^T d bg_out: each is the sum over positions of dz_ln or dx_ln,
// which are linear in dpo | dP | dG | dgo), and the weight gradients: the input-side ones split
// out of the one [5D, D] GEMM result dw_in, d p_out_weight from dw_out. A null destination is an
// absent bias.
struct FinishArgs {
  const double* sums;
  const float* dw_in;                                                   // [5D, D]
  const float* dw_out;                                                  // [D, D]
  const void *p_in_weight, *g_in_weight, *p_out_weight, *g_out_weight;  // the weights (dtype)
  void *d_norm_in_weight, *d_norm_in_bias, *d_norm_out_weight, *d_norm_out_bias;
  void *d_p_in_bias, *d_g_in_bias, *d_p_out_bias, *d_g_out_bias;
  void *d_p_in_weight, *d_g_in_weight, *d_g_out_weight, *d_p_out_weight;
  DType dtype;  // of the weights and their gradients: float32, bfloat16 or float16
  int D;
};
void launch_finish_backward(const FinishArgs& a, cudaStream_t s);

}  // namespace tpf::cuda::trimul

#define TPF_TRIMUL_INSTANTIATE(launcher)                              \
  template void launcher<float>(const Params&, cudaStream_t);         \
  template void launcher<__nv_bfloat16>(const Params&, cudaStream_t); \
  template void launcher<__half>(const Params&, cudaStream_t);
