// Triangle attention forward (sm_90a, mma.sync tensor cores, cp.async double buffering).
//
// A thread block of four warps computes one query tile of one slice (b, n, h) over all key tiles
// with an online softmax in the exp2 domain; each warp owns MT x 16 query rows (MT independent MMA
// row tiles give each warp more independent work between its waits). The key, value, bias and mask
// tiles of the next step load while the current one computes. Blocks are ordered with the slice
// index fastest, so blocks that run together read the same bias rows (shared by all slices) from L2. Outputs: O (input dtype), the BF16 residual of O's rounding, and the
// log-sum-exp (natural log, +inf for a row with no key).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>

#include "kernels/attention/forward.h"
#include "kernels/attention/forward_common.cuh"
#include "kernels/attention/mma.cuh"
#include "kernels/attention/tile_config.h"
#include "kernels/attention/tile_io.cuh"

namespace tpf::cuda {
namespace {

template <typename T, int D, int MT>
struct ForwardSmem {
  static constexpr int ROWS = kForwardWarps * kWarpRows * MT;  // queries per block
  static constexpr int LD = D + kPad;
  static constexpr int LDB = kTileK + kPad;
  T q[ROWS * LD];
  T k[2][kTileK * LD];
  T v[2][kTileK * LD];
  T bias[2][ROWS * LDB];
  uint8_t key_ok[2][kTileK];
};

template <typename T, int D, int MT>
__device__ __forceinline__ void attention_forward_body(const AttentionForwardParams p) {
  static_assert(D % 16 == 0, "the head dimension is a whole number of MMA k-steps");
  using S = ForwardSmem<T, D, MT>;
  constexpr int ROWS = S::ROWS, LD = S::LD, LDB = S::LDB, THREADS = kForwardWarps * 32;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  S& sm = *reinterpret_cast<S*>(smem_raw);

  const ForwardTile<T> t = forward_tile<T, ROWS>(p);
  const int warp = t.warp, lane = t.lane;
  auto load_keys = [&](int kt, int stage) {
    load_key_stage<T, D, ROWS, THREADS, false>(sm, stage, t, p, kt);
  };

  load_query_tile<T, D, ROWS, THREADS>(sm.q, t, p);
  load_keys(0, 0);
  cp_async_commit();

  // Per thread, for each row tile mt: rows warp_row(mt) + lane/4 and + 8.
  auto warp_row = [&](int mt) { return (warp * MT + mt) * kWarpRows; };
  uint32_t qf[MT][D / 16][4];
  float o[MT][D / 8][4];
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) init_rows<D>(o[mt], m[mt], l[mt]);

  const float scale = in_register(p.scale);  // see in_register (mma.cuh)
  const int key_tiles = (p.Sk + kTileK - 1) / kTileK;
  for (int kt = 0; kt < key_tiles; ++kt) {
    const int stage = kt & 1;
    if (kt + 1 < key_tiles) {
      load_keys(kt + 1, stage ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (kt == 0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) load_a(qf[mt][ks], sm.q, LD, warp_row(mt), ks * 16);
    }

    // s = q k^T for this warp's MT x 16 rows x 64 keys; each key fragment serves every row tile.
    float s[MT][kTileK / 8][4];
#pragma unroll
    for (int j = 0; j < kTileK / 8; ++j) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t bf[2];
        load_b_nk(bf, sm.k[stage], LD, j * 8, ks * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) Mma<T>::run(s[mt][j], qf[mt][ks], bf);
      }
    }

#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float correction[2];
      softmax_tile<T>(s[mt], m[mt], l[mt], correction, sm.bias[stage], LDB, warp_row(mt),
                      sm.key_ok[stage], scale, lane);
      rescale_rows<D>(o[mt], correction);
    }
    // o += p v, with p rounded to the input dtype for the MMA; each value fragment serves every
    // row tile.
#pragma unroll
    for (int kk = 0; kk < kTileK / 16; ++kk) {
      uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) pack_p<T>(pa[mt], s[mt], kk);
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        uint32_t bf[2];
        load_b_kn(bf, sm.v[stage], LD, kk * 16, i * 8);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) Mma<T>::run(o[mt][i], pa[mt], bf);
      }
    }
    __syncthreads();  // the next iteration's loads overwrite this stage
  }

  // Finish: normalize, write O, its residual and the lse.
  const OutputSlice<T> out = output_slice<T>(p, t.b, t.n, t.h);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    store_rows<T, D>(p, out, t.b, t.n, t.h, t.q0 + warp_row(mt), o[mt], m[mt], l[mt], lane);
}

template <typename T, int D, int MT>
__global__ void __launch_bounds__(kForwardWarps * 32)
    attention_forward_kernel(const AttentionForwardParams p) {
  attention_forward_body<T, D, MT>(p);
}

// The same with registers capped for 5 blocks per SM (D = 32: 96 registers and 20 warps per SM,
// where the default takes ~110 and fits 4 blocks).
template <typename T, int D, int MT>
__global__ void __launch_bounds__(kForwardWarps * 32, 5)
    attention_forward_5_kernel(const AttentionForwardParams p) {
  attention_forward_body<T, D, MT>(p);
}

template <typename T, int D, int MT, int MinBlocks = 1>
void launch_tiles(const AttentionForwardParams& p, cudaStream_t stream) {
  using S = ForwardSmem<T, D, MT>;
  const size_t smem = sizeof(S);
  auto kernel = [] {
    if constexpr (MinBlocks == 5)
      return attention_forward_5_kernel<T, D, MT>;
    else
      return attention_forward_kernel<T, D, MT>;
  }();
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (MinBlocks > 1)
    cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                         cudaSharedmemCarveoutMaxShared);
  const dim3 grid(p.N, (p.Sq + S::ROWS - 1) / S::ROWS, p.B * p.H);
  kernel<<<grid, kForwardWarps * 32, smem, stream>>>(p);
}

template <typename T, int D>
void launch(const AttentionForwardParams& p, cudaStream_t stream) {
  static const int row_tiles = [] {
    const char* env = std::getenv("TPF_ATTENTION_FWD_ROW_TILES");
    return env ? std::atoi(env) : kForwardRowTiles;
  }();
  // TPF_ATTENTION_FWD_WGMMA=1: the warpgroup-MMA forward at head dims 16 and 32 (forward_wgmma.cu;
  // slower on the H200, kept for the next step); read at each launch like TPF_ATTENTION_FWD_BLOCKS.
  if constexpr (D <= 32) {
    const char* wgmma = std::getenv("TPF_ATTENTION_FWD_WGMMA");
    const int version = wgmma != nullptr ? std::atoi(wgmma) : 0;
    if (version == 1) return attention_forward_wgmma_launch<T, D>(p, stream);
  }
  // For D <= 32 (one row tile) registers are capped for 5 blocks per SM, the default since it was
  // measured on the H200 (D=32 S=768: forward kernel 2.62 -> 2.42 ms; bench/notes-attention.md);
  // TPF_ATTENTION_FWD_BLOCKS=4 selects the uncapped kernel (read at each launch, so that one test
  // process checks both). D = 64 would spill under the cap.
  const bool five_blocks = [] {
    const char* env = std::getenv("TPF_ATTENTION_FWD_BLOCKS");
    return env == nullptr || env[0] == '\0' || std::atoi(env) == 5;
  }();
  if (row_tiles == 2) return launch_tiles<T, D, 2>(p, stream);
  if constexpr (D <= 32)
    if (five_blocks) return launch_tiles<T, D, 1, 5>(p, stream);
  launch_tiles<T, D, 1>(p, stream);
}

}  // namespace

template <typename T>
void attention_forward_launch(const AttentionForwardParams& p, int head_dim, cudaStream_t stream) {
  switch (head_dim) {
    case 16: return launch<T, 16>(p, stream);
    case 32: return launch<T, 32>(p, stream);
    case 64: return launch<T, 64>(p, stream);
  }
}

template void attention_forward_launch<__nv_bfloat16>(const AttentionForwardParams&, int,
                                                      cudaStream_t);
template void attention_forward_launch<__half>(const AttentionForwardParams&, int, cudaStream_t);

}  // namespace tpf::cuda
