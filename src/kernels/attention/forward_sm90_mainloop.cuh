// Mainloop of the Hopper forward (forward_sm90.cu): the producer's loads and the consumers'
// matrix products and softmax, over the key tiles in which some slice of the CTA has a key.
//
// Per stage (one 64-key tile): the bias block (32 KB fp32, bulk copy from the pre-pass's output,
// shared by the CTA's G slices) and each slice's K and V tile (TMA, swizzled), completing on
// full[stage]; the consumers release the stage on empty[stage] once their MMAs have read it.
// Key tiles in which no slice of the CTA has a key are skipped by both sides (the same test on
// the same mask words), and so are whole slice groups with no key at all.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "kernels/attention/forward_sm90_layout.h"
#include "kernels/attention/forward_sm90_params.h"
#include "kernels/attention/forward_sm90_primitives.cuh"
#include "kernels/attention/forward_sm90_scheduler.h"
#include "kernels/attention/forward_sm90_softmax.cuh"
#include "kernels/attention/tma.cuh"

namespace tpf::cuda::fwd90 {

// Keys < Sk of key tile kt as bits (bit i = key 64 kt + i).
__device__ __forceinline__ uint64_t valid_keys(int kt, int Sk) {
  const int left = Sk - kt * kKeys;
  return left >= kKeys ? ~0ull : (1ull << left) - 1;
}

// words[g * key_tiles + kt]: bit i set when key 64 kt + i of slice n0 + g attends (mask true and
// key < Sk; 0 for slices past N). All threads of the CTA, one word per warp at a time.
template <int G>
__device__ __forceinline__ void load_mask_words(const Params& p, const Tile& t, uint64_t* words) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int w = warp; w < G * p.key_tiles; w += kThreads / 32) {
    const int g = w / p.key_tiles, kt = w % p.key_tiles, n = t.n0 + g;
    const int k_lo = kt * kKeys + lane, k_hi = k_lo + 32;
    const uint8_t* mask =
        p.fwd.mask ? p.fwd.mask + t.b * p.fwd.mask_stride_b + int64_t(n) * p.fwd.mask_stride_n
                   : nullptr;
    const bool ok_lo = n < p.fwd.N && k_lo < p.fwd.Sk && (mask == nullptr || mask[k_lo] != 0);
    const bool ok_hi = n < p.fwd.N && k_hi < p.fwd.Sk && (mask == nullptr || mask[k_hi] != 0);
    const uint32_t lo = __ballot_sync(0xffffffffu, ok_lo), hi = __ballot_sync(0xffffffffu, ok_hi);
    if (lane == 0) words[w] = uint64_t(lo) | uint64_t(hi) << 32;
  }
}

template <int G>
__device__ __forceinline__ bool tile_active(const uint64_t* words, int key_tiles, int kt) {
  uint64_t any = 0;
#pragma unroll
  for (int g = 0; g < G; ++g) any |= words[g * key_tiles + kt];
  return any != 0;
}

// ---- producer: one thread -------------------------------------------------------------------

template <int DP>
__device__ __forceinline__ void produce(const Params& p, const Tile& t, uint8_t* smem,
                                        const uint64_t* words) {
  using L = Layout<DP>;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kBarriers);
  uint64_t* empty = full + kStages;
  const float* bias = p.bias + (int64_t(t.b * p.fwd.H + t.h) * p.q_blocks + t.q_block) *
                                   int64_t(p.key_tiles) * kBiasTileFloats;
  int i = 0;
  for (int kt = 0; kt < p.key_tiles; ++kt) {
    if (!tile_active<L::G>(words, p.key_tiles, kt)) continue;
    const int s = i % kStages;
    // A fresh barrier counts as having completed the phase before its first: the first kStages
    // waits return at once.
    Barrier::wait(&empty[s], ((i / kStages) & 1) ^ 1);
    Barrier::arrive_and_expect_tx(&full[s], L::kLoadBytes);
    uint8_t* stage = smem + s * L::kStageBytes;
    bulk_copy(bias + int64_t(kt) * kBiasTileFloats, &full[s], stage, L::kBiasBytes);
#pragma unroll
    for (int g = 0; g < L::G; ++g)
#pragma unroll
      for (int c = 0; c < L::kBlocks; ++c) {
        // Slices past N and keys past Sk are out of the tensor: TMA fills zeros (and counts them).
        tma_load_rows(&p.tma_k, p.k_dims, &full[s], stage + L::k_offset(g) + c * L::kBlockBytes,
                      c * L::W, kt * kKeys, t.h, t.n0 + g, t.b);
        tma_load_rows(&p.tma_v, p.v_dims, &full[s], stage + L::v_offset(g) + c * L::kBlockBytes,
                      c * L::W, kt * kKeys, t.h, t.n0 + g, t.b);
      }
    ++i;
  }
}

// ---- consumers: two warpgroups of 64 query rows ------------------------------------------------

// The A fragments of Q (rows row0 + lane/4 and + 8 of this warp) for the DP / 16 k-steps of
// S = Q K^T, zero past Sq and D; sign-flipped when scale < 0 (so that scores are |scale| times
// the products).
template <typename T, int DP>
__device__ __forceinline__ void load_q_fragments(const Params& p, int b, int n, int h, int row0,
                                                 int lane, uint32_t (&qf)[DP / 16][4]) {
  const uint16_t* q = static_cast<const uint16_t*>(p.fwd.q) + b * p.fwd.q_stride.b +
                      int64_t(n) * p.fwd.q_stride.n + h * p.fwd.q_stride.h;
  const int r0 = row0 + (lane >> 2), c0 = (lane & 3) * 2;
  auto at = [&](int row, int col) -> uint32_t {
    return (n < p.fwd.N && row < p.fwd.Sq && col < p.D) ? q[row * p.fwd.q_stride.s + col] : 0u;
  };
#pragma unroll
  for (int ks = 0; ks < DP / 16; ++ks)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = r0 + (i & 1) * 8, col = ks * 16 + c0 + (i >> 1) * 8;
      qf[ks][i] = (at(row, col) | at(row, col + 1) << 16) ^ p.q_sign;
    }
}

template <typename T, int DP>
struct ConsumerState {
  using L = Layout<DP>;
  uint32_t qf[L::G][DP / 16][4];
  float o[L::G][L::kPvBlocks][4];
  float m[L::G][2];
  float l[L::G][2];  // this thread's partial row sums of the fp32 P (exp_sum_pack), O's scale
};

template <typename T, int DP>
__device__ __forceinline__ void consume(const Params& p, const Tile& t, uint8_t* smem,
                                        const uint64_t* words, ConsumerState<T, DP>& st, int wg,
                                        int warp, int lane) {
  using L = Layout<DP>;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kBarriers);
  uint64_t* empty = full + kStages;
  const uint32_t smem_base = smem_u32(smem);
  const float c = p.score_log2, rescale_acc = kRescaleLog2 / p.score_log2;
  // Slices per S commit group: two at D = 32, so that their softmaxes' independent chains
  // interleave (forward kernel -3 % at S 384 / 640 / 768 on the H100); one otherwise (two at D = 16
  // measured +2-3 %; notes-attention's designs table).
  constexpr int kPair = (L::G % 2 == 0 && DP == 32) ? 2 : 1;
  int i = 0;
  for (int kt = 0; kt < p.key_tiles; ++kt) {
    if (!tile_active<L::G>(words, p.key_tiles, kt)) continue;
    const int s = i % kStages;
    Barrier::wait(&full[s], (i / kStages) & 1);
    const uint32_t stage = smem_base + s * L::kStageBytes;
    // This thread's bias values: float4 j of the warp's 16 x 64 block (the pre-pass wrote them
    // in this order), conflict-free 16-byte loads.
    const float4* bias =
        reinterpret_cast<const float4*>(smem + s * L::kStageBytes) + (wg * 4 + warp) * 256 + lane;
    const uint64_t valid = valid_keys(kt, p.fwd.Sk);
#pragma unroll
    for (int g0 = 0; g0 < L::G; g0 += kPair) {
      float sc[kPair][kKeys / 8][4];
#pragma unroll
      for (int j = 0; j < kKeys / 8; ++j) {
        const float4 v = bias[j * 32];
#pragma unroll
        for (int u = 0; u < kPair; ++u) {
          sc[u][j][0] = v.x;
          sc[u][j][1] = v.y;
          sc[u][j][2] = v.z;
          sc[u][j][3] = v.w;
        }
      }
#pragma unroll
      for (int u = 0; u < kPair; ++u) {
        const uint64_t word = words[(g0 + u) * p.key_tiles + kt];
        // Keys past Sk are -inf in the bias already; only masked keys below Sk need this.
        if (word != valid) apply_key_mask(sc[u], word, lane);
        fence_operands(sc[u]);
      }
      // S = bias + Q K^T, for the kPair slices in one commit group
      cute::warpgroup_arrive();
#pragma unroll
      for (int u = 0; u < kPair; ++u)
#pragma unroll
        for (int ks = 0; ks < DP / 16; ++ks) {
          const int col = ks * 16;
          const uint32_t addr =
              stage + L::k_offset(g0 + u) + (col / L::W) * L::kBlockBytes + (col % L::W) * 2;
          if constexpr (L::kPvN != kKeys) {
            wgmma_rs<T, kKeys, gmma::Major::K>(sc[u], st.qf[g0 + u][ks], smem_desc<L::W>(addr, 16));
          } else {
            // DP = 64: the PV product is m64n64k16 too, and ptxas (CUDA 13.0) given two chains of
            // that one shape put P into the registers of Q's fragments, which the next key tile
            // still reads (found in the SASS of f3bc00f, whose D = 56 and 64 were wrong). Keys
            // 0-31 and 32-63 as two m64n32k16 products (the second half of the K tile starts
            // 32 rows = 64 W bytes further, a whole number of swizzle periods).
            wgmma_rs<T, kKeys / 2, gmma::Major::K>(
                reinterpret_cast<float(&)[kKeys / 16][4]>(sc[u][0]), st.qf[g0 + u][ks],
                smem_desc<L::W>(addr, 16));
            wgmma_rs<T, kKeys / 2, gmma::Major::K>(
                reinterpret_cast<float(&)[kKeys / 16][4]>(sc[u][kKeys / 16]), st.qf[g0 + u][ks],
                smem_desc<L::W>(addr + (kKeys / 2) * 2 * L::W, 16));
          }
        }
      cute::warpgroup_commit_batch();
      cute::warpgroup_wait<0>();
#pragma unroll
      for (int u = 0; u < kPair; ++u) fence_operands(sc[u]);
      // The softmax (forward_sm90_softmax.cuh), each step for the kPair slices in turn.
      float mx[kPair][2];
#pragma unroll
      for (int u = 0; u < kPair; ++u) tile_row_max(sc[u], mx[u]);
#pragma unroll
      for (int u = 0; u < kPair; ++u)
        rescale_rows<L::kPvBlocks>(mx[u], st.m[g0 + u], st.l[g0 + u], st.o[g0 + u], c, rescale_acc);
      uint32_t pa[kPair][kKeys / 16][4];
#pragma unroll
      for (int u = 0; u < kPair; ++u) {
        exp_sum_pack<T>(sc[u], st.m[g0 + u], st.l[g0 + u], pa[u], c);
      }
      // O += P V
#pragma unroll
      for (int u = 0; u < kPair; ++u) fence_operands(st.o[g0 + u]);
      cute::warpgroup_arrive();
#pragma unroll
      for (int u = 0; u < kPair; ++u) {
        const uint32_t v_tile = stage + L::v_offset(g0 + u);
#pragma unroll
        for (int kk = 0; kk < kKeys / 16; ++kk)
          wgmma_rs<T, L::kPvN, gmma::Major::MN>(
              st.o[g0 + u], pa[u][kk],
              smem_desc<L::W>(v_tile + kk * 16 * 2 * L::W, L::kBlockBytes));
      }
      cute::warpgroup_commit_batch();
    }
    cute::warpgroup_wait<0>();  // every MMA that read this stage is done
#pragma unroll
    for (int g = 0; g < L::G; ++g) fence_operands(st.o[g]);
    Barrier::arrive(&empty[s]);
    ++i;
  }
}

}  // namespace tpf::cuda::fwd90
