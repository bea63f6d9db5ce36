// Triangle attention forward for Hopper (sm_90a): the kernel's orchestration and its launch.
//
// A CTA computes 128 queries (two consumer warpgroups of 64) of G slices (n0 .. n0 + G - 1) of
// one head (b, h), over all key tiles of 64 keys; a producer warpgroup (one thread) feeds it:
//   - the bias, pre-scaled to fp32 (bias / |scale|) by a pre-pass in the consumers' fragment
//     order, enters each slice's S = Q K^T accumulator as its initial value (masked keys as
//     -inf): one 32 KB bulk copy per key tile, shared by the G slices;
//   - K and V tiles by TMA (5-d descriptors over the strided tensors, swizzled);
//   - S = Q K^T and O += P V by warpgroup MMAs with A (Q, P) in registers; the row sums of P are
//     added in fp32 registers from the unrounded P (FlashAttention-3's way);
//   - online softmax with one FFMA per score before the exponential, conditional rescaling, and
//     part of the exponentials on the FMA pipe (forward_sm90_softmax.cuh).
// The producer's registers go to the consumers (setmaxnreg). Every sum runs in a fixed order:
// results are bitwise reproducible. Files: tiles (the tile table), layout (shared memory),
// params, scheduler (CTA -> work), mainloop (producer, consumers), softmax, epilogue.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/attention/forward_sm90.h"
#include "kernels/attention/forward_sm90_epilogue.cuh"
#include "kernels/attention/forward_sm90_mainloop.cuh"
#include "kernels/attention/tma.cuh"
#include "kernels/common/device_guard.h"
#include "tpf/error.h"

namespace tpf::cuda::fwd90 {
namespace {

template <typename T, int DP>
__global__ void __launch_bounds__(kThreads, 1)
    attention_forward_sm90_kernel(const __grid_constant__ Params p) {
  using L = Layout<DP>;
  extern __shared__ uint8_t smem_raw[];
  // Rounded up to 1024 bytes by offsetting the shared array itself (not through an integer), so
  // that loads from it stay shared-memory loads (LDS).
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kBarriers);
  uint64_t* empty = full + kStages;
  uint64_t* words = reinterpret_cast<uint64_t*>(smem + L::kWords);
  const Tile t = tile_of_cta<L::G>(p);
  const int warpgroup = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      Barrier::init(&full[s], 1);                  // the producer's arrive (plus the TMA bytes)
      Barrier::init(&empty[s], kConsumers * 128);  // every consumer thread
    }
    cutlass::arch::fence_barrier_init();
  }
  load_mask_words<L::G>(p, t, words);
  __syncthreads();

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    if (threadIdx.x == 0) produce<DP>(p, t, smem, words);
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
    const int wg = warpgroup - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int row0 = t.q_block * kRows + wg * kRowsPerWarpgroup + warp * 16;
    ConsumerState<T, DP> st;
#pragma unroll
    for (int g = 0; g < L::G; ++g) {
      load_q_fragments<T, DP>(p, t.b, t.n0 + g, t.h, row0, lane, st.qf[g]);
      st.m[g][0] = st.m[g][1] = -INFINITY;
      st.l[g][0] = st.l[g][1] = 0.f;
#pragma unroll
      for (int i = 0; i < L::kPvBlocks; ++i)
        st.o[g][i][0] = st.o[g][i][1] = st.o[g][i][2] = st.o[g][i][3] = 0.f;
    }
    consume<T, DP>(p, t, smem, words, st, wg, warp, lane);
#pragma unroll
    for (int g = 0; g < L::G; ++g)
      store_slice<T, DP, L::kPvBlocks>(p, t.b, t.n0 + g, t.h, row0, st.o[g], st.m[g], st.l[g],
                                       lane);
  }
}

// The pre-pass: bias (any float dtype, strided) -> bias / |scale| in fp32, one 32 KB block per
// (b, h, query block, key tile) in the consumers' order: float4 f of a block is thread `lane` of
// warp w of warpgroup wg, column block j (f = ((wg 4 + w) 8 + j) 32 + lane), elements (row, col),
// (row, col + 1), (row + 8, col), (row + 8, col + 1). Keys past Sk are -inf (masked), rows past
// Sq 0.
template <typename TB>
__global__ void __launch_bounds__(kPrepassThreads)
    bias_prepass_kernel(const TB* bias, int64_t sb, int64_t sh, int64_t sq, int H, int Sq, int Sk,
                        int q_blocks, int key_tiles, float inv_scale, float4* out) {
  const int kt = blockIdx.x, qb = blockIdx.y, bh = blockIdx.z, b = bh / H, h = bh % H;
  const TB* src = bias + b * sb + h * sh;
  float4* dst = out + (int64_t(bh) * q_blocks + qb) * int64_t(key_tiles) * (kBiasTileFloats / 4) +
                int64_t(kt) * (kBiasTileFloats / 4);
  for (int f = threadIdx.x; f < kBiasTileFloats / 4; f += kPrepassThreads) {
    const int lane = f & 31, j = (f >> 5) & 7, w = (f >> 8) & 3, wg = f >> 10;
    const int row = qb * kRows + wg * kRowsPerWarpgroup + w * 16 + (lane >> 2);
    const int col = kt * kKeys + j * 8 + (lane & 3) * 2;
    auto at = [&](int r, int k) {
      if (k >= Sk) return -INFINITY;
      if (r >= Sq) return 0.f;
      return float(src[r * sq + k]) * inv_scale;
    };
    dst[f] = make_float4(at(row, col), at(row, col + 1), at(row + 8, col), at(row + 8, col + 1));
  }
}

// K or V [B, N, H, S, D] as a 5-d TMA map with a box of one [64 keys][W] block, swizzled as the
// consumers' descriptors read it (tma.cuh; its dims order goes to Params::k_dims / v_dims).
template <int DP>
CUtensorMap key_tensor_map(const TensorView& x, bool fp16, const char* name, uint32_t& dims) {
  using L = Layout<DP>;
  const CUtensorMapSwizzle swizzle = L::W == 64   ? CU_TENSOR_MAP_SWIZZLE_128B
                                     : L::W == 32 ? CU_TENSOR_MAP_SWIZZLE_64B
                                                  : CU_TENSOR_MAP_SWIZZLE_32B;
  return rows_tensor_map(x.data, strides4(x), int(x.shape[0]), int(x.shape[1]), int(x.shape[2]),
                         int(x.shape[3]), int(x.shape[4]), fp16, uint32_t(L::W), uint32_t(kKeys),
                         swizzle, name, dims);
}

template <typename TB>
void launch_prepass(const AttentionForwardArgs& a, const AttentionDims& d, const Params& p,
                    float* out, cudaStream_t stream) {
  const dim3 grid(p.key_tiles, p.q_blocks, int(d.B * d.H));
  bias_prepass_kernel<TB><<<grid, kPrepassThreads, 0, stream>>>(
      static_cast<const TB*>(a.bias.data), a.bias.stride[0], a.bias.stride[1], a.bias.stride[2],
      int(d.H), int(d.Sq), int(d.Sk), p.q_blocks, p.key_tiles, float(1.0 / std::fabs(a.scale)),
      reinterpret_cast<float4*>(out));
}

// The kernel's params: the tensors' fields as entry.cu filled them, and what this tile shape
// derives (the TMA maps of k and v, the tile counts, the scale's forms).
template <typename T, int DP>
void launch_dp(const AttentionForwardParams& f, const AttentionForwardArgs& a,
               const AttentionDims& d, void* workspace, cudaStream_t stream) {
  using L = Layout<DP>;
  const bool fp16 = std::is_same_v<T, __half>;
  Params p{};
  p.fwd = f;
  p.tma_k = key_tensor_map<DP>(a.k, fp16, "k", p.k_dims);
  p.tma_v = key_tensor_map<DP>(a.v, fp16, "v", p.v_dims);
  p.bias = static_cast<const float*>(workspace);
  p.D = int(d.D);
  p.q_blocks = int(ceil_div(d.Sq, kRows));
  p.key_tiles = int(ceil_div(d.Sk, kKeys));
  p.slice_groups = int(ceil_div(d.N, L::G));
  p.scale_abs = float(std::fabs(a.scale));
  p.score_log2 = float(std::fabs(a.scale) * 1.4426950408889634);
  p.q_sign = a.scale < 0 ? 0x80008000u : 0u;

  float* bias_out = static_cast<float*>(workspace);
  switch (a.bias.dtype) {
    case DType::bf16: launch_prepass<__nv_bfloat16>(a, d, p, bias_out, stream); break;
    case DType::f16: launch_prepass<__half>(a, d, p, bias_out, stream); break;
    default: launch_prepass<float>(a, d, p, bias_out, stream); break;
  }
  auto kernel = attention_forward_sm90_kernel<T, DP>;
  const size_t smem = L::smem_bytes(p.key_tiles);
  // The mask words (8 bytes per slice and key tile) sit in shared memory beside the stages; src/ops
  // checked Sk against max_keys before anything was queued.
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
             "attention forward: its shared memory");
  kernel<<<grid_of(p), kThreads, smem, stream>>>(p);
}

}  // namespace

template <typename T>
void launch(const AttentionForwardParams& f, const AttentionForwardArgs& a, const AttentionDims& d,
            void* workspace, cudaStream_t stream) {
  switch (padded_head_dim(int(d.D))) {
    case 16: return launch_dp<T, 16>(f, a, d, workspace, stream);
    case 32: return launch_dp<T, 32>(f, a, d, workspace, stream);
    case 48: return launch_dp<T, 48>(f, a, d, workspace, stream);
    case 64: return launch_dp<T, 64>(f, a, d, workspace, stream);
    case 80: return launch_dp<T, 80>(f, a, d, workspace, stream);
    case 96: return launch_dp<T, 96>(f, a, d, workspace, stream);
    case 112: return launch_dp<T, 112>(f, a, d, workspace, stream);
    case 128: return launch_dp<T, 128>(f, a, d, workspace, stream);
  }
  throw Error("the Hopper attention forward has no kernel for head dim " + std::to_string(d.D));
}

template void launch<__nv_bfloat16>(const AttentionForwardParams&, const AttentionForwardArgs&,
                                    const AttentionDims&, void*, cudaStream_t);
template void launch<__half>(const AttentionForwardParams&, const AttentionForwardArgs&,
                             const AttentionDims&, void*, cudaStream_t);

}  // namespace tpf::cuda::fwd90
