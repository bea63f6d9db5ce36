// Triangle attention backward for Hopper (sm_90a): warp-specialized, wgmma, deterministic.
//
//  1. delta = rowsum(dO * (O + r)) (backward_preprocess.cuh).
//  2. attention_backward_sm90_kernel, one launch per chunk of slices. A CTA owns a 128-key block in
//     kSlices slices (backward_sm90_tiles.h) and walks every 64-query tile:
//       warp  0    loads (thread 0 by TMA into the layouts wgmma and ldmatrix read; mbarriers),
//       warps 1-2  add the staged dQ partials to the fp32 dQ accumulator in key-block order
//                  (one thread of warp 1, by TMA) and the staged dbias^T tiles to the fp32 dbias
//                  accumulator in slice-group order (one thread of warp 2, by TMA); warp 3 idles,
//       warpgroups 1, 2 (64 keys each) recompute P^T and dS^T once per tile and use them for dV,
//                  dK (registers), dQ (staged) and dbias (registers over the slices, then staged)
//                  (backward_sm90_mainloop.cuh).
//     The consumers never wait on another CTA: only the writers do, on semaphores that make every
//     sum run in one order (backward_sm90_epilogue.cuh), so all four gradients are bitwise
//     reproducible.
//  3. After each launch attention_dq_finish_kernel: dq from its accumulator.
//  4. attention_dbias_finish_kernel: dbias from its accumulator, in the bias's dtype.
// The bias is q's dtype (16-bit tiles through shared memory) or float32 (read as float32 by each
// consumer thread from global memory; dbias returned in float32): the kernel's template BT.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/attention/backward_preprocess.cuh"
#include "kernels/attention/backward_sm90.h"
#include "kernels/attention/backward_sm90_epilogue.cuh"
#include "kernels/attention/backward_sm90_mainloop.cuh"
#include "kernels/attention/tma.cuh"
#include "kernels/common/device_guard.h"
#include "kernels/common/wgmma.cuh"

namespace tpf::cuda {
namespace {

template <typename T, int D, typename BT>
__global__ void __launch_bounds__(kBwdThreads, 1)
    attention_backward_sm90_kernel(const __grid_constant__ Sm90BackwardMaps maps,
                                   const AttentionBackwardParams p, int group_begin, int groups,
                                   int chunk_first_slice) {
  using S = Sm90BackwardSmem<T, D, BT>;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  S& sm = *reinterpret_cast<S*>(smem_raw);
  const AttentionForwardParams& f = p.fwd;
  const Sm90BackwardGrid grid = sm90_backward_grid(f.N, f.Sq, f.Sk, S::A, S::Config::kKeyBlock);
  const Sm90BackwardBlock blk =
      sm90_backward_block(blockIdx.x, group_begin, groups, f.B, f.H, grid.key_blocks);

  if (threadIdx.x == 0) {
    mbar_init(&sm.kv_full, kBwdLoadThreads);
    for (int s = 0; s < 2; ++s) {
      mbar_init(&sm.full[s], 1);  // thread 0 of the producer
      mbar_init(&sm.empty[s], 256);
    }
    for (int s = 0; s < S::DQS; ++s) {
      mbar_init(&sm.dq_full[s], 256);
      mbar_init(&sm.dq_empty[s], 1);  // the dQ writer's thread (sm90_backward_write_dq)
    }
    mbar_init(&sm.dbias_full, 256);
    mbar_init(&sm.dbias_empty, 1);  // the dbias writer's thread (sm90_backward_write_dbias)
  }
  __syncthreads();

  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    warpgroup_registers_dec<S::Config::kProducerRegisters>();
    const int warp = threadIdx.x / 32;
    if (warp == 0)
      sm90_backward_load<T, D, BT>(p, maps, sm, blk.g, blk.b, blk.h, blk.jb, grid.query_tiles);
    else if (warp <= kBwdDqWriters)
      sm90_backward_write_dq<T, D, BT>(p, sm, blk.g, blk.b, blk.h, blk.jb, grid.query_tiles,
                                       chunk_first_slice);
    else
      sm90_backward_write_dbias<T, D, BT>(p, sm, blk.g, blk.b, blk.h, blk.jb, grid.key_blocks,
                                          grid.query_tiles, warp - 1 - kBwdDqWriters);
  } else {
    warpgroup_registers_inc<S::Config::kConsumerRegisters>();
    const int w = warpgroup - 1;
    ConsumerAccumulators<S::DC, S::A> acc;
    sm90_backward_consume<T, D, BT>(p, sm, acc, w, blk.b, blk.h, blk.jb, grid.query_tiles);
    const bool split = S::Config::kSplitD;
    sm90_backward_store_dkdv<T, S::DC, S::A>(
        p, acc, blk.g, blk.b, blk.h, blk.jb * S::KB + (split ? 0 : w) * kBwdKeysPerWarpgroup,
        split ? w * S::DC : 0, w);
  }
}

template <typename T, int D, typename BT>
void launch(const AttentionBackwardParams& p, const Sm90BackwardWorkspace& w, cudaStream_t stream) {
  using S = Sm90BackwardSmem<T, D, BT>;
  const AttentionForwardParams& f = p.fwd;
  const Sm90BackwardGrid grid = sm90_backward_grid(f.N, f.Sq, f.Sk, S::A, S::Config::kKeyBlock);
  const size_t smem = sizeof(S);
  static_assert(sizeof(S) <= 227 * 1024, "the backward's shared memory exceeds the SM's 227 KB");
  const bool fp16 = std::is_same_v<T, __half>;
  Sm90BackwardMaps maps;
  auto map = [&](const void* data, const Strides4& st, int rows, const char* name, uint32_t& dims) {
    return rows_tensor_map(data, st, f.B, f.N, f.H, rows, p.head_dim, fp16, 8, 64,
                           CU_TENSOR_MAP_SWIZZLE_NONE, name, dims);
  };
  maps.q = map(f.q, f.q_stride, f.Sq, "q", maps.q_dims);
  maps.k = map(f.k, f.k_stride, f.Sk, "k", maps.k_dims);
  maps.v = map(f.v, f.v_stride, f.Sk, "v", maps.v_dims);
  maps.dout = map(p.dout, p.dout_stride, f.Sq, "grad_out", maps.dout_dims);
  // Every map before anything is queued: one that cannot be built throws with nothing launched.
  // A 16-bit bias whose rows TMA cannot read is read from a copy in the workspace with 16-byte rows
  // (p.bias_copy, made below).
  const int64_t pitch = sm90_backward_bias_pitch(f.Sk);
  if constexpr (!S::kF32Bias) {
    const int64_t size[3] = {f.Sq, f.H, f.B};
    const int64_t stride[3] = {p.bias_copy ? pitch : f.bias_stride_q,
                               p.bias_copy ? f.Sq * pitch : f.bias_stride_h,
                               p.bias_copy ? f.H * f.Sq * pitch : f.bias_stride_b};
    const uint32_t box[3] = {uint32_t(kTileQ), 1, 1};
    maps.bias =
        tiled_tensor_map(p.bias_copy ? p.bias_copy : f.bias, fp16, 3, size, stride, box, f.Sk,
                         kBwdKeysPerWarpgroup, CU_TENSOR_MAP_SWIZZLE_128B, "bias", maps.bias_dims);
  }
  launch_attention_delta<T, D>(p, grid.query_tiles * kTileQ, stream);
  // dq_sem and dbias_sem are contiguous
  check_cuda(cudaMemsetAsync(p.dq_sem, 0, w.sem_bytes, stream), "attention backward: semaphores");
  if constexpr (!S::kF32Bias) {
    if (p.bias_copy)
      for (int b = 0; b < f.B; ++b)
        for (int h = 0; h < f.H; ++h) {
          char* dst = static_cast<char*>(p.bias_copy) + (int64_t(b) * f.H + h) * f.Sq * pitch * 2;
          const char* src =
              static_cast<const char*>(f.bias) + (b * f.bias_stride_b + h * f.bias_stride_h) * 2;
          check_cuda(
              cudaMemcpy2DAsync(dst, size_t(pitch) * 2, src, size_t(f.bias_stride_q) * 2,
                                size_t(f.Sk) * 2, size_t(f.Sq), cudaMemcpyDeviceToDevice, stream),
              "attention backward: the bias's aligned copy");
        }
  }
  auto kernel = attention_backward_sm90_kernel<T, D, BT>;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
             "attention backward: its shared memory");
  const int groups_per_chunk = w.chunk / S::A;
  for (int g0 = 0; g0 < grid.groups; g0 += groups_per_chunk) {
    const int groups = min(groups_per_chunk, grid.groups - g0);
    const int64_t blocks = int64_t(groups) * f.B * f.H * grid.key_blocks;
    kernel<<<unsigned(blocks), kBwdThreads, smem, stream>>>(maps, p, g0, groups, g0 * S::A);
    const int slices = min(groups * S::A, f.N - g0 * S::A);  // the launch's real slices
    const int64_t tiles = int64_t(slices) * f.B * f.H * grid.query_tiles;
    attention_dq_finish_kernel<T, D>
        <<<unsigned(tiles), kBwdDqFinishThreads, 0, stream>>>(p, g0 * S::A, grid.query_tiles);
  }
  const dim3 finish((f.Sq + kBwdFinishTile - 1) / kBwdFinishTile,
                    (f.Sk + kBwdFinishTile - 1) / kBwdFinishTile, f.B * f.H);
  attention_dbias_finish_kernel<BT><<<finish, dim3(kBwdFinishTile, kBwdFinishRows), 0, stream>>>(
      p, grid.query_tiles, grid.key_blocks, S::Config::kKeyBlock);
}

template <typename T, typename BT>
void launch_head_dim(const AttentionBackwardParams& p, const Sm90BackwardWorkspace& w,
                     cudaStream_t stream) {
  switch (sm90_backward_head_dim(p.head_dim)) {
    case 16: return launch<T, 16, BT>(p, w, stream);
    case 32: return launch<T, 32, BT>(p, w, stream);
    case 64: return launch<T, 64, BT>(p, w, stream);
    case 128: return launch<T, 128, BT>(p, w, stream);
  }
}

}  // namespace

template <typename T>
void attention_backward_sm90_launch(const AttentionBackwardParams& p,
                                    const Sm90BackwardWorkspace& w, bool f32_bias,
                                    cudaStream_t stream) {
  if (f32_bias)
    launch_head_dim<T, float>(p, w, stream);
  else
    launch_head_dim<T, T>(p, w, stream);
}

template void attention_backward_sm90_launch<__nv_bfloat16>(const AttentionBackwardParams&,
                                                            const Sm90BackwardWorkspace&, bool,
                                                            cudaStream_t);
template void attention_backward_sm90_launch<__half>(const AttentionBackwardParams&,
                                                     const Sm90BackwardWorkspace&, bool,
                                                     cudaStream_t);

}  // namespace tpf::cuda
