// Online softmax of one 64-key score tile for one consumer warp's 16 rows (the wgmma accumulator
// layout: each thread holds rows lane/4 and lane/4 + 8 of its warp, columns 8 j + 2 (lane % 4)
// and + 1 of each 8-column block j).
//
// Scores arrive in "acc units": acc = q.k + bias / |scale| (the bias entered as the accumulator's
// initial value, masked keys as -inf), so that the exponent is one FFMA per score:
// p = 2^(acc c - m c) with c = |scale| log2(e) and m the row's running maximum in acc units.
#pragma once
#include <cmath>
#include <cstdint>

#include "kernels/attention/forward_sm90_primitives.cuh"
#include "kernels/attention/forward_sm90_tiles.h"
#include "kernels/common/mma.cuh"

namespace tpf::cuda::fwd90 {

// Rows keep their maximum until a tile's maximum exceeds it by this much (log2 units):
// FlashAttention-4's conditional rescaling, here at 0 (a row rescales whenever its maximum grows).
// At 8 (probabilities up to 2^8) O's error against FP64 was 0.227 % relative L2 against the peers'
// 0.201 (D 32, S 384; 0 gives 0.201) for a forward kernel 3-5 % faster (H100, 2026-12-07,
// notes-attention's designs table). The lse uses the maximum the row actually used.
constexpr float kRescaleLog2 = 0.f;

// Keys whose bit in `word` is 0 (masked) become -inf in the tile (before the MMA adds q.k).
__device__ __forceinline__ void apply_key_mask(float (&s)[kKeys / 8][4], uint64_t word, int lane) {
  const uint64_t w = word >> (2 * (lane & 3));
#pragma unroll
  for (int j = 0; j < kKeys / 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e)
      if (((w >> (8 * j + e)) & 1) == 0) s[j][e] = s[j][e + 2] = -INFINITY;
}

// One tile of one slice, in three steps, run in turn (the consumers run each step for both slices
// of a pair before the next step at D = 32, so that the two slices' independent chains of shuffles
// and exponentials interleave in one basic block):
//   tile_row_max: the tile's row maxima (acc units), over the quad;
//   rescale_rows: when a row's maximum moved by more than kRescaleLog2, updates m and rescales
//     that row's O (all kPvBlocks blocks) and its partial row sum l by the same factor;
//   exp_sum_pack: adds this tile's fp32 P to l and writes P rounded to T as the A fragments of the
//     four 16-key steps of O += P V.
// l[r] is this thread's partial sum of P over the columns it holds of row r (r = 0: row lane/4,
// r = 1: row lane/4 + 8; columns 8 j + 2 (lane % 4) + {0, 1} of every 8-column block j), the
// exact element set whose rounded copies this thread feeds into O's rows r through pa (pa[kk][0]
// and [2] are row lane/4, [1] and [3] row lane/4 + 8, as the S accumulator is). Masked keys have
// P = 0 exactly. The four threads of a quad hold one row's partials: quad_row_sums adds them in
// the epilogue (FlashAttention-3's way). Every sum is of the fp32 P before its rounding to T, the
// same values (MUFU or polynomial) that are packed.
__device__ __forceinline__ void tile_row_max(const float (&s)[kKeys / 8][4], float (&mx)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float a = fmaxf(s[0][2 * r], s[0][2 * r + 1]), b = fmaxf(s[1][2 * r], s[1][2 * r + 1]);
#pragma unroll
    for (int j = 2; j < kKeys / 8; j += 2) {
      a = fmaxf(a, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
      b = fmaxf(b, fmaxf(s[j + 1][2 * r], s[j + 1][2 * r + 1]));
    }
    mx[r] = fmaxf(a, b);
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
  }
}

template <int kPvBlocks>
__device__ __forceinline__ void rescale_rows(const float (&mx)[2], float (&m)[2], float (&l)[2],
                                             float (&o)[kPvBlocks][4], float c, float rescale_acc) {
  const bool need0 = mx[0] > m[0] + rescale_acc, need1 = mx[1] > m[1] + rescale_acc;
  if (__any_sync(0xffffffffu, need0 || need1)) {
    // corr = 2^((m_old - m_new) c): 0 for a row's first finite tile (m_old = -inf, O still 0).
    const float corr0 = need0 ? ex2_mufu((m[0] - mx[0]) * c) : 1.f;
    const float corr1 = need1 ? ex2_mufu((m[1] - mx[1]) * c) : 1.f;
    m[0] = need0 ? mx[0] : m[0];
    m[1] = need1 ? mx[1] : m[1];
    l[0] *= corr0;
    l[1] *= corr1;
#pragma unroll
    for (int i = 0; i < kPvBlocks; ++i) {
      o[i][0] *= corr0;
      o[i][1] *= corr0;
      o[i][2] *= corr1;
      o[i][3] *= corr1;
    }
  }
}

template <typename T>
__device__ __forceinline__ void exp_sum_pack(const float (&s)[kKeys / 8][4], const float (&m)[2],
                                             float (&l)[2], uint32_t (&pa)[kKeys / 16][4],
                                             float c) {
  // A row with no finite score yet keeps m = -inf and gets p = 2^-inf = 0 (subtract 0, not -inf).
  const float neg0 = m[0] == -INFINITY ? 0.f : -m[0] * c;
  const float neg1 = m[1] == -INFINITY ? 0.f : -m[1] * c;
  float p[kKeys / 8][4];
#pragma unroll
  for (int j = 0; j < kKeys / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float x = fmaf(s[j][e], c, e < 2 ? neg0 : neg1);
      // The last kPolyExpBlocks column blocks on the FMA pipe, the rest on the MUFU.
      p[j][e] = j >= kKeys / 8 - kPolyExpBlocks ? ex2_poly(x) : ex2_mufu(x);
    }
    // This tile's partial row sums: a fixed tree over the thread's 16 P of each row (bitwise
    // reproducible), then added to l. Then one P of the row is made to depend on l by adding l * 0
    // (exact: l is finite and p >= 0, so p + 0 = p) so that the sums are done before the PV MMA
    // that reads P: left free, ptxas sinks every slice's sums past the later slices' MMAs and keeps
    // their fp32 P live (measured: 86 spill instructions at DP = 32, 227 registers at DP = 16).
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float t[kKeys / 8];
#pragma unroll
    for (int j = 0; j < kKeys / 8; ++j) t[j] = p[j][2 * r] + p[j][2 * r + 1];
#pragma unroll
    for (int w = kKeys / 16; w >= 1; w /= 2)
#pragma unroll
      for (int j = 0; j < w; ++j) t[j] += t[j + w];
    l[r] += t[0];
    p[kKeys / 8 - 1][2 * r] = fmaf(l[r], 0.f, p[kKeys / 8 - 1][2 * r]);
  }
#pragma unroll
  for (int kk = 0; kk < kKeys / 16; ++kk) {
    pa[kk][0] = Mma<T>::pack(p[2 * kk][0], p[2 * kk][1]);
    pa[kk][1] = Mma<T>::pack(p[2 * kk][2], p[2 * kk][3]);
    pa[kk][2] = Mma<T>::pack(p[2 * kk + 1][0], p[2 * kk + 1][1]);
    pa[kk][3] = Mma<T>::pack(p[2 * kk + 1][2], p[2 * kk + 1][3]);
  }
}

// The full row sums from a quad's partials (exp_sum_pack's l): every thread of the quad ends with
// the same bits (the two additions are commutative). All 32 lanes of the warp must call it.
__device__ __forceinline__ void quad_row_sums(float (&l)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
}

}  // namespace tpf::cuda::fwd90
