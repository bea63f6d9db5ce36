// Fused input kernel: LayerNorm_in, the five projections (P and G of a and b, the output gate
// logits), gates and mask, in one pass over x. One CTA per tile of kRows positions. Step
// q < input_chunks writes a and b channel-major; the last step writes go row-major. The next
// block's weights load while the epilogue runs. One kernel for float32, one for 16-bit types
// (mma.sync), and for 16-bit types at D = 64 and 128 the Hopper kernel below (TMA, wgmma, warp
// specialization; persistent), which the launcher takes there.
//
// float32 (GEMMs on the CUDA cores, IEEE sigmoid, 2 CTAs per SM):
//   X  [kRows, Dp]     x_ln, the A operand of every step
//   W  [kChunkN, Dp]   one packed weight block: kChunkChannels rows of Wp_in, then the same
//                      rows of Wg_in; the last block is Wg_out
//   C  [kChunkN, kLdCT] the product of a step q < input_chunks (transposed: column-major reads
//                      for the channel-major a and b); [kRows, kLdC] for the last step
#include <algorithm>
#include <utility>

#include <cute/arch/copy_sm90_tma.hpp>

#include "kernels/attention/tma.cuh"
#include "kernels/common/wgmma.cuh"
#include "kernels/trimul/device.cuh"
#include "kernels/trimul/input_forward_sm90.h"
#include "kernels/trimul/launch.h"
#include "kernels/trimul/layer_norm.cuh"
#include "kernels/trimul/sm90_gmma.cuh"

namespace tpf::cuda::trimul {
namespace {

struct InputForwardF32Smem {
  float* x;
  float* w;
  float* c;
  float* mask;
  size_t bytes;
  __host__ __device__ InputForwardF32Smem(unsigned char* base, int Dp) {
    SmemCarver s{base};
    take_step_operands(s, Dp, x, w);
    c = s.take<float>(kStagingFloats);
    mask = s.take<float>(kRows);
    bytes = s.at;
  }
};

__global__ void __launch_bounds__(kThreads, kF32Ctas) input_forward_f32_kernel(const Params p) {
  using T = float;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  InputForwardF32Smem s(smem_raw, p.Dp);
  const Tile tile(blockIdx.x, p);
  const int ld = p.Dp + kPad, D = int(p.D);
  const T* w_in = static_cast<const T*>(p.w_in);

  copy_tile_async(s.w, ld, w_in, p.Dp, kChunkN, p.Dp);
  normalize_input_rows(p, tile, s.x, ld, s.mask, nullptr, nullptr);

  for (int q = 0; q <= p.input_chunks; ++q) {
    const bool gate_step = q == p.input_chunks;
    WarpTileF32 acc;
    wait_and_multiply(acc, s.x, s.w, ld, p.Dp, kChunkN);
    if (gate_step)
      acc.store(s.c, kLdC, kChunkN);
    else
      acc.store_col_major(s.c, kLdCT, kChunkN);
    __syncthreads();
    if (!gate_step)
      copy_tile_async(s.w, ld, w_in + int64_t(q + 1) * kChunkN * p.Dp, p.Dp, kChunkN, p.Dp);

    if (!gate_step) {
      // a | b = sigmoid(G) * P * mask, channel-major: thread t takes row t % kRows of channels
      // t / kRows + (kThreads / kRows) k, so a warp reads one column of C over consecutive rows
      // and writes consecutive j.
      const int r = threadIdx.x % kRows, cl0 = threadIdx.x / kRows;
      constexpr int kStep = kThreads / kRows;
      constexpr int kIters = kChunkChannels / kStep;
      const float m = s.mask[r];
      // The biases first: each is a dependent L1 round trip when loaded next to its use.
      float bias_p[kIters], bias_g[kIters];
#pragma unroll
      for (int k = 0; k < kIters; ++k) {
        const int c = q * kChunkChannels + cl0 + kStep * k;
        bias_p[k] = c < 2 * D ? p.bias_in[c] : 0.0f;
        bias_g[k] = c < 2 * D ? p.bias_in[2 * D + c] : 0.0f;
      }
#pragma unroll
      for (int k = 0; k < kIters; ++k) {
        const int cl = cl0 + kStep * k;
        const int c = q * kChunkChannels + cl;
        if (c >= 2 * D || r >= tile.n) continue;
        const float pv = s.c[cl * kLdCT + r] + bias_p[k];
        const float gv = s.c[(kChunkChannels + cl) * kLdCT + r] + bias_g[k];
        T* dst = static_cast<T*>(c < D ? p.a : p.b);
        dst[tile.channel_major(p, c < D ? c : c - D, r)] = from_f<T>(sigmoid(gv) * pv * m);
      }
    } else {
      // Output gate logits, row-major: consecutive threads take consecutive channels.
      T* go = static_cast<T*>(p.go);
#pragma unroll 4
      for (int idx = threadIdx.x; idx < kRows * kChunkN; idx += kThreads) {
        const int r = idx / kChunkN, c = idx % kChunkN;
        if (c < D && r < tile.n)
          go[(tile.row0 + r) * D + c] = from_f<T>(s.c[r * kLdC + c] + p.bias_out[D + c]);
      }
    }
  }
}

// ---- 16-bit types: the same work at 3 CTAs per SM (mma.sync GEMMs, the epilogues from the MMA
// registers, the fast sigmoid).
//
//   X  [kRows, Dp]       x_ln (T)
//   W  [kChunkN, Dp]     one packed weight block (T); a/b blocks with their rows interleaved
//                        (InterleavePG) so that a warp's two 16-column halves are P and G of the
//                        same 16 channels, and the epilogue takes both from its own registers
//   St [kRows, kLdSt]    the step's results in T: a | b transposed ([channel][row], row stride
//                        kRows + kPad), go row-major; written out in 16-byte pieces
// No fp32 staging (34 KB less shared memory: 68 KB per CTA at D = 128) and at most 80 registers.

template <typename T>
struct InputForward16BitSmem {
  T* x;
  T* w;
  T* st;
  float* mask;
  size_t bytes;
  __host__ __device__ InputForward16BitSmem(unsigned char* base, int Dp) {
    SmemCarver s{base};
    take_step_operands(s, Dp, x, w);
    st = s.take<T>(size_t(kRows) * kLdSt);
    mask = s.take<float>(kRows);
    bytes = s.at;
  }
};

// kD: static D (64 or 128; Dims), or 0 for D from Params. Only kD = 0 is launched: D = 64 and 128
// run input_forward_sm90_kernel (their instantiations here were deleted with it).
template <typename T, int kD>
__global__ void __launch_bounds__(kThreads, k16BitCtas) input_forward_16bit_kernel(const Params p) {
  using Acc = WarpTileLdsm<T>;
  using Dm = Dims<kD>;
  constexpr int kLdAB = kRows + kPad;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const int D = Dm::D(p), Dp = Dm::Dp(p), ld = Dm::ld(p), chunks = Dm::chunks(p);
  InputForward16BitSmem<T> s(smem_raw, Dp);
  const Tile tile = tile_at<true>(blockIdx.x, p);  // grids of at most 2^31 - 1 tiles
  const T* w_in = static_cast<const T*>(p.w_in);

  copy_weight_async<kD, kChunkN>(s.w, w_in, Dp, kChunkN, InterleavePG{});
  normalize_input_rows<kD>(p, tile, s.x, ld, s.mask, nullptr, nullptr);
  // Channel (within the step) of this thread's a | b elements acc[i][0 or 1][h][e].
  const int cl_base = (threadIdx.x / 32 >> 1) * 16 + 2 * (threadIdx.x & 3);

  for (int q = 0; q <= chunks; ++q) {
    const bool gate_step = q == chunks;
    // This thread's biases before the GEMM, which hides their latency: [j][h][e % 2] = the P and
    // G biases of channel cl_base + 8 h + e % 2 (a | b steps) or go column Acc::col(j, h, e).
    float bias[2][2][2];
    if (gate_step) {
      Acc::column_values(p.bias_out + D, D, bias);
    } else {
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int c = q * kChunkChannels + cl_base + 8 * h + e;
            bias[j][h][e] = Dm::ab_channel(c, D) ? p.bias_in[j * 2 * D + c] : 0.0f;
          }
    }
    Acc acc;
    wait_and_multiply(acc, s.x, s.w, ld, Dp, kChunkN);
    __syncthreads();
    if (q + 1 < chunks)
      copy_weight_async<kD, kChunkN>(s.w, w_in + int64_t(q + 1) * kChunkN * Dp, Dp, kChunkN,
                                     InterleavePG{});
    else if (!gate_step)
      copy_weight_async<kD, kChunkN>(s.w, w_in + int64_t(q + 1) * kChunkN * Dp, Dp, kChunkN);

    if (!gate_step) {
      // a | b = sigmoid(G) * P * mask into St transposed, then channel-major to global.
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = Acc::row(i, e), cl = cl_base + 8 * h + (e & 1);
            const float pv = acc.acc[i][0][h][e] + bias[0][h][e & 1];
            const float gv = acc.acc[i][1][h][e] + bias[1][h][e & 1];
            s.st[cl * kLdAB + r] = from_f<T>(sigmoid_fast(gv) * pv * s.mask[r]);
          }
      __syncthreads();
      // Channel c of a | b at dst + c * plane (a for c < D, b past it); static D: the step's
      // channels are all in a or all in b (D is a multiple of kChunkChannels).
      const int64_t plane = p.S * p.S;
      const int64_t origin = tile.channel_major(p, D, 0, 0);
      if constexpr (Dm::kStatic) {
        const int c0 = q * kChunkChannels;
        T* dst = (c0 < D ? static_cast<T*>(p.a) + origin + c0 * plane
                         : static_cast<T*>(p.b) + origin + (c0 - D) * plane);
        const auto row = [=](int cl) -> T* { return dst + cl * plane; };
        // Whole in full tiles where S % 8 == 0 (every channel's 64 positions 16-byte aligned).
        store_staged_tile<true, kChunkChannels, kRows, true>(tile.n == kRows && p.S % 8 == 0, s.st,
                                                             kLdAB, tile.n, row, row);
      } else {
        store_staged_rows<kChunkChannels, kRows, true>(s.st, kLdAB, tile.n, [=](int cl) -> T* {
          const int c = q * kChunkChannels + cl;
          if (c >= 2 * D) return nullptr;
          return static_cast<T*>(c < D ? p.a : p.b) + tile.channel_major(p, c < D ? c : c - D, 0);
        });
      }
    } else {
      // Output gate logits, row-major.
      Acc::template for_each_element<2>([&](int i, int j, int h, int e) {
        store_pair(s.st + Acc::row(i, e) * kLdSt + Acc::col(j, h, e),
                   acc.acc[i][j][h][e] + bias[j][h][0], acc.acc[i][j][h][e + 1] + bias[j][h][1]);
      });
      __syncthreads();
      T* go = static_cast<T*>(p.go) + tile.row0 * D;
      const int n = tile.n;
      store_staged_tile<Dm::kStatic, kRows, kD ? kD : kChunkN, true, true>(
          n == kRows, s.st, kLdSt, D, [=](int r) -> T* { return go + r * D; },
          [=](int r) -> T* { return r < n ? go + r * D : nullptr; });
    }
  }
}

// ---- Hopper (sm_90a), 16-bit types at D = 64 and 128: the same outputs from TMA, wgmma and warp
// specialization. Persistent CTAs, one per SM, of one producer warpgroup and sm90::kConsumers
// consumer warpgroups (input_forward_sm90.h: the shared-memory layout and the tile order):
//   - the producer's first thread loads every weight block once (TMA, 128-byte swizzle: W stays
//     in shared memory, 160 KiB at D = 128), then the x tiles [64][D] of the CTA's tiles into a
//     ring of stages (full / empty mbarriers);
//   - a consumer takes every kConsumers-th tile of its CTA: LayerNorm of its 64 rows in place in
//     the stage (a warp per row as normalize_input_rows: the same sums, the same bits of x_ln),
//     written back swizzled, so the stage becomes wgmma's K-major A operand; then per step a
//     wgmma m64nNk16 chain (A = x_ln, B = the weight block, both from shared memory), the stage
//     released after the last step's GEMM, and the epilogue from the accumulator registers in parts
//     of 32 channels or columns: a | b = sigmoid_fast(G) * P * mask transposed into its staging,
//     go row-major, then 16-byte stores (a channel's 64 positions are 128 contiguous bytes).
// The a/b blocks are used as pack.cu writes them (P rows 0..63, G rows 64..127): accumulator
// columns 8j.. (j < 8) and 8(j + 8).. are P and G of the same channels in the same thread.
// The products accumulate in fp32 as mma.sync's do but in wgmma's order, so a, b and go may differ
// from the mma.sync kernel's in the last bit of a rounding; x_ln, the biases, sigmoid and the
// 16-bit roundings are the same expressions.

// The producer's arrival on a barrier of count 1 with `bytes` of TMA transactions still to come:
// the phase completes once they have (mbar_expect_tx alone would leave the arrival pending).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile(
      "mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
      "r"(bytes)
      : "memory");
}

// Named barrier of consumer warpgroup c (ids 1.., 128 threads; 0 is __syncthreads).
__device__ __forceinline__ void consumer_sync(int c) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + c) : "memory");
}

template <typename T, int kD>
__global__ void __launch_bounds__(sm90::kThreads, 1)
    input_forward_sm90_kernel(const __grid_constant__ Params p,
                              const __grid_constant__ CUtensorMap x_map,
                              const __grid_constant__ CUtensorMap w_map) {
  using L = sm90::Layout<kD>;
  constexpr int kPart = L::kPart, kLdAB = L::kLdAB, kLdGo = L::kLdGo;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // Aligned up to 1024 bytes by pointer arithmetic on the shared array (a round trip through an
  // integer would lose its state space: generic loads and stores instead of LDS / STS).
  unsigned char* base = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  float* bias_in = reinterpret_cast<float*>(base + L::kBiasIn);
  float* bias_go = reinterpret_cast<float*>(base + L::kBiasGo);
  uint64_t* bars = reinterpret_cast<uint64_t*>(base + L::kBars);
  uint64_t* w_bar = bars;
  uint64_t* full = bars + 1;
  uint64_t* empty = bars + 1 + L::kStages;

  for (int i = threadIdx.x; i < 4 * kD; i += sm90::kThreads) bias_in[i] = p.bias_in[i];
  for (int i = threadIdx.x; i < kD; i += sm90::kThreads) bias_go[i] = p.bias_out[kD + i];
  if (threadIdx.x == 0) {
    mbar_init(w_bar, 1);
    for (int s = 0; s < L::kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 128);  // every thread of the consumer that used the stage
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  const int64_t ntiles = sm90::tiles_of(blockIdx.x, gridDim.x, p.tiles);
  // A CTA with no tile (never with the launcher's grid of min(tiles, SMs)) leaves before the
  // weights' TMA: nothing would wait for it, and a load still in flight when the CTA exits
  // writes shared memory that the SM may already have given to the next CTA.
  if (ntiles == 0) return;
  if (wg == 0) {
    // Producer: one thread issues every load.
    if (threadIdx.x != 0) return;
    constexpr uint64_t kEvictFirst = 0x12F0000000000000ull, kEvictLast = 0x14F0000000000000ull;
    mbar_arrive_expect_tx(w_bar, L::kWBytes);
#pragma unroll
    for (int q = 0; q < L::kBlocks; ++q)
#pragma unroll
      for (int h = 0; h < L::kKHalves; ++h)
        cute::SM90_TMA_LOAD_2D::copy(&w_map, w_bar, kEvictLast,
                                     base + L::kW + q * L::kWBlockBytes + h * (kChunkN * 128),
                                     h * sm90::kAtomCols, q * kChunkN);
    for (int64_t k = 0; k < ntiles; ++k) {
      const sm90::Slot s = sm90::slot_of(blockIdx.x, gridDim.x, k, L::kStages);
      const unsigned t = unsigned(s.tile), tpr = unsigned(p.tiles_per_row);
      const unsigned bi = t / tpr;
      const int j0 = int(t - bi * tpr) * kRows;
      mbar_wait(&empty[s.stage], s.parity ^ 1);
      mbar_arrive_expect_tx(&full[s.stage], L::kXBytes);
#pragma unroll
      for (int h = 0; h < L::kKHalves; ++h)
        cute::SM90_TMA_LOAD_3D::copy(&x_map, &full[s.stage], kEvictFirst,
                                     base + L::kX + s.stage * L::kXBytes + h * (kRows * 128),
                                     h * sm90::kAtomCols, j0, int(bi));
    }
    return;
  }

  // Consumer c.
  const int c = wg - 1, tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const int g = lane >> 2, tq = lane & 3;
  T* st = reinterpret_cast<T*>(base + L::kStaging + c * L::kStagingBytes);
  float* mask = reinterpret_cast<float*>(base + L::kMask) + c * kRows;
  const bool masked = p.mask != nullptr;
  const int64_t plane = p.S * p.S;
  float ln_w[kD / 32], ln_b[kD / 32];
#pragma unroll
  for (int t = 0; t < kD / 32; ++t) {
    ln_w[t] = p.ln_in_w[lane + 32 * t];
    ln_b[t] = p.ln_in_b[lane + 32 * t];
  }

  for (int64_t k = c; k < ntiles; k += sm90::kConsumers) {
    const sm90::Slot s = sm90::slot_of(blockIdx.x, gridDim.x, k, L::kStages);
    const Tile tile = tile_at<true>(s.tile, p);
    if (tid < kRows)
      mask[tid] = (masked && tid < tile.n) ? mask_value<T>(p, tile.row0 + tid) : 1.0f;
    unsigned char* xs = base + L::kX + s.stage * L::kXBytes;
    const uint32_t xs_addr = smem_addr(xs);
    // A parity wait only tells apart a phase from the one just before it: full[stage]'s wait for
    // use u is sound once use u - 1's phase has completed. With an odd number of stages (D = 128:
    // 3) use u - 1 is the other consumer's tile k - kStages, whose TMA may still be in flight here
    // (TMA loads complete in no particular order); the parity test would then pass at once, on
    // the previous tile's bytes. Waiting first for that use's release (empty[stage], the
    // producer's own wait for tile k) orders it: the other consumer releases only after it has
    // seen its full phase. Use u - 2 of empty is this consumer's own (tile k - 2 kStages), so
    // this wait is sound too (sm90::slot_of).
    if constexpr (L::kStages % sm90::kConsumers != 0) mbar_wait(&empty[s.stage], s.parity ^ 1);
    mbar_wait(&full[s.stage], s.parity);

    // LayerNorm in place: warp w takes rows w + 4 i, lane l elements l + 32 t (row_stats's sums).
    // Rows past the tile were read as zeros (TMA's out-of-bounds fill); their results are never
    // stored.
    constexpr int kGroup = 4;
#pragma unroll 1
    for (int i0 = 0; i0 < kRows / 4; i0 += kGroup) {
      float v[kGroup][kD / 32];
#pragma unroll
      for (int u = 0; u < kGroup; ++u)
#pragma unroll
        for (int t = 0; t < kD / 32; ++t)
          v[u][t] = to_f(*reinterpret_cast<const T*>(
              xs + sm90::sw128_offset(kRows, warp + 4 * (i0 + u), lane + 32 * t)));
#pragma unroll
      for (int u = 0; u < kGroup; ++u) {
        const int r = warp + 4 * (i0 + u);
        const RowStats rs = row_stats<kD>(v[u], kD, p.eps);
#pragma unroll
        for (int t = 0; t < kD / 32; ++t)
          *reinterpret_cast<T*>(xs + sm90::sw128_offset(kRows, r, lane + 32 * t)) =
              from_f<T>((v[u][t] - rs.mean) * rs.rstd * ln_w[t] + ln_b[t]);
      }
    }
    fence_proxy_async();
    consumer_sync(c);
    mbar_wait(w_bar, 0);
    // The mask of this thread's accumulator rows 16 warp + g and + 8.
    const float mask_lo = mask[16 * warp + g], mask_hi = mask[16 * warp + g + 8];

    // a | b steps: 64 channels each, all in a (q < chunks / 2) or all in b; the epilogue in two
    // parts of kPart channels (accumulator blocks j and j + 8 of each part: P and G).
    const int64_t origin = tile.channel_major(p, kD, 0, 0);
    const bool whole = tile.n == kRows && p.S % 8 == 0;
#pragma unroll 1
    for (int q = 0; q < L::kChunks; ++q) {
      float acc[kChunkN / 8][4];
      step_gemm<T, kChunkN, kD>(acc, xs_addr, smem_addr(base + L::kW + q * L::kWBlockBytes));
      wgmma_wait<0>();
      fence_regs(acc);
      const int c0 = q * kChunkChannels;
      T* dst =
          (c0 < kD ? static_cast<T*>(p.a) + c0 * plane : static_cast<T*>(p.b) + (c0 - kD) * plane) +
          origin;
#pragma unroll
      for (int part = 0; part < kChunkChannels / kPart; ++part) {
        // This thread's biases of the part (P and G of channels c0 + 8 j + 2 tq, + 1) into
        // registers first: loaded next to their use, each would be reloaded after every staging
        // store (the compiler cannot tell the arrays apart).
        float2 bias_p[kPart / 8], bias_g[kPart / 8];
#pragma unroll
        for (int jj = 0; jj < kPart / 8; ++jj) {
          const int ch = c0 + 8 * (part * kPart / 8 + jj) + 2 * tq;
          bias_p[jj] = *reinterpret_cast<const float2*>(bias_in + ch);
          bias_g[jj] = *reinterpret_cast<const float2*>(bias_in + 2 * kD + ch);
        }
        consumer_sync(c);  // the staging's previous readers are done
        // 16 channels x 16 positions per stmatrix.trans (store_transposed: the C fragment of
        // the [position][channel] block lands in [channel][position]).
#pragma unroll
        for (int jj = 0; jj < kPart / 8; jj += 2) {
          uint32_t frag[4];
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int ep = 0; ep < 2; ++ep) {
              const int j = part * kPart / 8 + jj + h;
              const float m = ep ? mask_hi : mask_lo;
              const float2 bp = bias_p[jj + h], bg = bias_g[jj + h];
              const float v0 =
                  sigmoid_fast(acc[j + 8][2 * ep] + bg.x) * (acc[j][2 * ep] + bp.x) * m;
              const float v1 =
                  sigmoid_fast(acc[j + 8][2 * ep + 1] + bg.y) * (acc[j][2 * ep + 1] + bp.y) * m;
              frag[2 * h + ep] = Mma<T>::pack(v0, v1);
            }
          store_transposed(st, kLdAB, 8 * jj, 16 * warp, frag);
        }
        consumer_sync(c);
        // Channel part * kPart + idx / 8 of the step, rows 8 (idx % 8) ..: 16 bytes a thread.
#pragma unroll
        for (int it = 0; it < kPart * kRows / 8 / 128; ++it) {
          const int idx = tid + 128 * it, cl = idx / (kRows / 8), r0 = (idx % (kRows / 8)) * 8;
          T* d = dst + (part * kPart + cl) * plane + r0;
          const T* sv = st + cl * kLdAB + r0;
          if (whole || (r0 + 8 <= tile.n && reinterpret_cast<uintptr_t>(d) % 16 == 0)) {
            *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(sv);
          } else {
#pragma unroll
            for (int e = 0; e < 8; ++e)
              if (r0 + e < tile.n) d[e] = sv[e];
          }
        }
      }
    }

    // Output gate logits, N = D, row-major through the staging in parts of kPart columns.
    {
      float acc[kD / 8][4];
      step_gemm<T, kD, kD>(acc, xs_addr, smem_addr(base + L::kW + L::kChunks * L::kWBlockBytes));
      wgmma_wait<0>();
      fence_regs(acc);
      mbar_arrive(&empty[s.stage]);  // this thread's reads of the stage are done
      T* go = static_cast<T*>(p.go) + tile.row0 * kD;
#pragma unroll
      for (int part = 0; part < kD / kPart; ++part) {
        consumer_sync(c);
#pragma unroll
        for (int j = part * kPart / 8; j < (part + 1) * kPart / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; e += 2) {
            const int r = 16 * warp + g + 8 * (e >> 1), n = 8 * j + 2 * tq;
            const float2 bias = *reinterpret_cast<const float2*>(bias_go + n);
            store_pair(st + r * kLdGo + n - part * kPart, acc[j][e] + bias.x,
                       acc[j][e + 1] + bias.y);
          }
        consumer_sync(c);
        // Row idx / (kPart / 8), columns part * kPart + 8 (idx % (kPart / 8)) ..: 16 bytes.
#pragma unroll
        for (int it = 0; it < kRows * kPart / 8 / 128; ++it) {
          const int idx = tid + 128 * it, r = idx / (kPart / 8), c8 = (idx % (kPart / 8)) * 8;
          if (r < tile.n)
            *reinterpret_cast<uint4*>(go + r * kD + part * kPart + c8) =
                *reinterpret_cast<const uint4*>(st + r * kLdGo + c8);
        }
      }
    }
  }
}

// Whether the Hopper kernel takes this call: D = 64 or 128, 32-bit tile indices and TMA
// coordinates, 16-byte aligned x (TMA) and outputs (16-byte stores).
bool sm90_input_forward_fits(const Params& p) {
  const auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  return (p.D == 64 || p.D == 128) && p.tiles <= INT32_MAX && p.B * p.S <= INT32_MAX &&
         aligned(p.x) && aligned(p.w_in) && aligned(p.a) && aligned(p.b) && aligned(p.go);
}

int multiprocessors() {
  int device = 0, n = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device),
             "cudaDeviceGetAttribute");
  return n;
}

template <typename T, int kD>
void launch_input_forward_sm90(const Params& p, cudaStream_t stream) {
  using L = sm90::Layout<kD>;
  constexpr bool kFp16 = std::is_same_v<T, __half>;
  uint32_t dims = 0;
  // x [B * S, S, D]: box 64 positions x 64 channels; positions past S read as zero.
  const int64_t x_size[2] = {p.S, p.B * p.S}, x_stride[2] = {kD, p.S * kD};
  const uint32_t x_box[2] = {uint32_t(kRows), 1};
  const CUtensorMap x_map =
      tiled_tensor_map(p.x, kFp16, 2, x_size, x_stride, x_box, kD, uint32_t(sm90::kAtomCols),
                       CU_TENSOR_MAP_SWIZZLE_128B, "trimul x", dims);
  // w_in [kBlocks * 128, D]: box 128 rows x 64 columns.
  const int64_t w_size[1] = {int64_t(L::kBlocks) * kChunkN}, w_stride[1] = {kD};
  const uint32_t w_box[1] = {uint32_t(kChunkN)};
  const CUtensorMap w_map =
      tiled_tensor_map(p.w_in, kFp16, 1, w_size, w_stride, w_box, kD, uint32_t(sm90::kAtomCols),
                       CU_TENSOR_MAP_SWIZZLE_128B, "trimul w_in", dims);
  const auto kernel = input_forward_sm90_kernel<T, kD>;
  set_max_smem(kernel, L::kBytes);
  const int64_t grid = std::min<int64_t>(p.tiles, multiprocessors());
  kernel<<<unsigned(grid), sm90::kThreads, L::kBytes, stream>>>(p, x_map, w_map);
  check_launch("trimul input_forward (sm90)");
}

}  // namespace

// float32: input_forward_f32_kernel. 16-bit types: the Hopper kernel at D = 64 and 128, the
// mma.sync kernel with D from Params otherwise (and where the Hopper kernel's conditions fail).
template <typename T>
void launch_input_forward(const Params& p, cudaStream_t stream) {
  if constexpr (kIsF32<T>) {
    launch_kernel(input_forward_f32_kernel, dim3(unsigned(p.tiles)),
                  InputForwardF32Smem(nullptr, p.Dp).bytes, p, stream, "trimul input_forward");
  } else {
    if (sm90_input_forward_fits(p)) {
      if (p.D == 64)
        launch_input_forward_sm90<T, 64>(p, stream);
      else
        launch_input_forward_sm90<T, 128>(p, stream);
      return;
    }
    launch_kernel(input_forward_16bit_kernel<T, 0>, dim3(unsigned(p.tiles)),
                  InputForward16BitSmem<T>(nullptr, p.Dp).bytes, p, stream, "trimul input_forward");
  }
}

TPF_TRIMUL_INSTANTIATE(launch_input_forward)

}  // namespace tpf::cuda::trimul
