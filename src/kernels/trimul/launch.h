// Host side of the triangle multiplicative update kernels: the launchers (one per kernel file) and
// the helpers they share. Launchers never synchronize; errors become tpf::RuntimeError.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "kernels/trimul/params.h"
#include "tpf/error.h"
#include "tpf/tensor.h"

namespace tpf::cuda::trimul {

inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw RuntimeError(std::string(what) + ": " + cudaGetErrorString(e));
}

// Kernel variants, chosen at each launch by TPF_TRIMUL_VARIANT so that one GPU run can test and
// time them side by side (unset: variant 4, the fastest measured on the H200, bench/notes-trimul.md
// sections 11, 14 and 15):
//   0  the fused kernels' GEMMs through WMMA (fragments by 32-bit generic loads), IEEE sigmoid;
//   1  the same GEMMs through mma.sync m16n8k16 with ldmatrix fragments, and for 16-bit types the
//      sigmoid through the approximate exponential and division (device.cuh);
//   2  variant 1, and in input_backward the step's biases from shared memory and the dP | dG
//      pass with a fixed, unrolled trip count (input_backward.cu; same arithmetic as variant 1);
//   3  variant 1 at higher occupancy: input_forward and output_forward take their epilogues from
//      the MMA registers and stage 16-bit results instead of fp32 products (less shared memory),
//      under launch bounds of 3 CTAs per SM (same arithmetic as variant 1); input_backward is
//      split in two kernels of kSplitBackwardCtas persistent CTAs, three per SM
//      (input_backward_split.cu); output_backward runs variant 1's code;
//   4  (the default) variant 3, and output_backward at 3 CTAs per SM as well: epilogues from
//      the MMA registers, kOccupancyBackwardCtas persistent CTAs (output_backward.cu,
//      bench/notes-trimul.md section 13).
// The workspace is the same under all of them (the partials are sized for the larger grids).
constexpr int kVariants = 5;
inline int variant() {
  const char* env = std::getenv("TPF_TRIMUL_VARIANT");
  if (env == nullptr || env[0] == '\0') return 4;
  if (env[1] != '\0' || env[0] < '0' || env[0] >= char('0' + kVariants))
    throw Error(std::string("TPF_TRIMUL_VARIANT: expected 0, 1, 2, 3 or 4 (or unset), got '") +
                env + "'");
  return env[0] - '0';
}
inline bool fast_variant() { return variant() >= 1; }
// CTAs per SM that the occupancy variant's kernels are bounded for (__launch_bounds__).
constexpr int kOccupancyCtas = 3;
// float has no fast code (its GEMMs run on the CUDA cores, its sigmoid stays IEEE): one kernel.
template <typename T>
constexpr bool kHasFast = !std::is_same_v<T, float>;
// Variant 3's occupancy kernels (input_forward, output_forward and the split input_backward), also
// under variant 4 (16-bit types; float runs variant 0's kernels under 3 and 4).
template <typename T>
bool occupancy_kernels() {
  return kHasFast<T> && variant() >= 3;
}
template <typename T>
bool split_input_backward() {
  return occupancy_kernels<T>();
}
// Variant 4's output_backward (16-bit types), with grid_backward = kOccupancyBackwardCtas.
template <typename T>
bool occupancy_output_backward() {
  return kHasFast<T> && variant() == 4;
}

inline void check_launch(const char* kernel) { check_cuda(cudaGetLastError(), kernel); }

// Allows the kernel `bytes` of dynamic shared memory on the current device (before each launch: the
// attribute is per device, and setting it is a host-side call that does not synchronize).
template <typename Kernel>
void set_max_smem(Kernel kernel, size_t bytes) {
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)),
             "cudaFuncSetAttribute");
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
// Variant 3's two kernels (16-bit types), called by launch_input_backward.
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
