// The Hopper backward's shared memory, its producer (loads) and its consumers (the math of one
// query tile). Orchestrated by backward_sm90.cu; the writers of the cross-CTA sums are in
// backward_sm90_epilogue.cuh.
//
// Per (query tile, slice) a consumer warpgroup owns 64 keys (rows of its accumulators) x 64 queries:
//   S^T  = K Q^T     wgmma SS, A = the key tile (K-major), B = the query tile (K-major)
//   dP^T = V dO^T    wgmma SS, the same with the value and output-gradient tiles
//   P^T  = exp2((S^T scale + bias^T) log2e - lse log2e), 0 for a masked key
//   dS^T = P^T (dP^T - delta);  dbias^T += dS^T (registers, summed over the CTA's slices)
//   dV  += P^T dO    wgmma RS, A = P^T rounded to the input dtype (the accumulator layout of S^T is
//                    the A fragment layout), B = the output-gradient tile (MN-major)
//   dK  += dS^T Q    wgmma RS, likewise
//   dQ   = dS K      wgmma SS over the CTA's whole key block (both warpgroups' dS, after a barrier
//                    of the two), warpgroup w its half of the columns: A = dS^T stored transposed by
//                    stmatrix into shared memory (K-major), B = the key tiles (MN-major); staged in
//                    shared memory for the dQ writer, which adds the other key blocks' partials in
//                    fixed order.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "kernels/attention/backward_sm90.h"
#include "kernels/attention/backward_sm90_tiles.h"
#include "kernels/attention/params.h"
#include "kernels/attention/tma.cuh"
#include "kernels/common/mma.cuh"
#include "kernels/common/wgmma.cuh"

namespace tpf::cuda {

// What a consumer warpgroup does with its 64 keys of a slice.
enum : uint8_t { kTileSkip = 0, kTileMasked = 1, kTileWhole = 2 };

// BT: the bias's dtype, T (tiles through shared memory, as Q and dO) or float (read as float32:
// each consumer thread loads its own elements from global memory, see load_bias_f32).
template <typename T, int D, typename BT>
struct Sm90BackwardSmem {
  static constexpr bool kF32Bias = sizeof(BT) == 4;
  using Config = Sm90BackwardConfig<D, kF32Bias>;
  static constexpr int A = Config::kSlices, DQS = Config::kDqStages, KT = Config::kKeyTiles;
  static constexpr int KB = Config::kKeyBlock, DC = Config::kCols, DQC = Config::kDqCols;
  static constexpr int TILE = kTileQ * D;  // a 64-row core-matrix tile, elements
  static constexpr int BIAS_HALF = kTileQ * kBwdKeysPerWarpgroup;  // a warpgroup's bias tile
  alignas(128) T k[A][KT][TILE];  // [slice][key tile]: 64 keys (a warpgroup's), core-matrix layout
  alignas(128) T v[A][KT][TILE];
  alignas(128) T q[2][A][TILE];  // [stage][slice]
  alignas(128) T dout[2][A][TILE];
  alignas(
      128) T ds[2][2][kTileQ * kBwdKeysPerWarpgroup];  // [warpgroup][parity]: dS, [key/8][query][8]
  // [stage][warpgroup]: [query][64 keys], 128-byte rows swizzled as TMA writes them (16-bit only).
  alignas(1024) T bias[kF32Bias ? 1 : 2][kF32Bias ? 8 : KT * BIAS_HALF];
  // [stage][warpgroup]: the warpgroup's DQC columns of dQ, [query][DQC] in stage_offset's order;
  // the dQ accumulator in global memory holds each tile in the same order.
  alignas(128) float dq_stage[DQS][2][kTileQ * DQC];
  // [warpgroup]: dbias^T of its 64 keys, [key][64 queries] in stage_offset's order, as the dbias
  // accumulator holds each tile; the two warpgroups' tiles contiguous (one bulk copy).
  alignas(128) float dbias_stage[2][kBwdKeysPerWarpgroup * kTileQ];
  alignas(16) float lse2[2][A][kTileQ];  // lse log2e (+inf past Sq: no probability), bulk copies
  alignas(16) float delta[2][A][kTileQ];
  uint8_t key_ok[A][KB];
  uint8_t tile_state[A][2];  // kTileSkip / kTileMasked / kTileWhole per slice and warpgroup
  int cta_alive;             // some tile is not kTileSkip
  int dq_valid[DQS];         // the staged dQ partial holds data (else: zero)
  int dbias_valid[2];
  uint64_t kv_full, full[2], empty[2], dq_full[DQS], dq_empty[DQS], dbias_full, dbias_empty;
};

// The slice (b, n, h) of a [B, N, H, S, D] tensor.
template <typename T>
__device__ __forceinline__ const T* slice_of(const void* base, const Strides4& st, int b, int n,
                                             int h) {
  return static_cast<const T*>(base) + b * st.b + int64_t(n) * st.n + h * st.h;
}

// ---- producer: warp 0 ---------------------------------------------------------------------------
// The warp reads the key flags; then thread 0 alone copies everything by TMA (Sm90BackwardMaps):
// the K and V tiles once, per query tile the Q and dO tiles, a 16-bit bias's two 64-key halves and
// (bulk copies) the rows of lse2 and delta from the workspace. kv_full counts the warp's arrivals,
// full[] thread 0's; both count TMA's bytes. Warp 1 writes dQ, warp 2 dbias (one thread each).

constexpr int kBwdLoadBarrier = 3;  // named barrier of the load threads

// One 64-row tile of D features (D / 8 TMA boxes) into `dst`, the core-matrix layout.
template <typename T, int D>
__device__ __forceinline__ void tma_tile(const CUtensorMap* map, uint32_t dims, uint64_t* bar,
                                         T* dst, int row0, int h, int n, int b) {
#pragma unroll
  for (int c = 0; c < D / 8; ++c)
    tma_load_rows(map, dims, bar, dst + c * 64 * 8, c * 8, row0, h, n, b);
}

template <typename T, int D, typename BT>
__device__ __forceinline__ void sm90_backward_load(const AttentionBackwardParams& p,
                                                   const Sm90BackwardMaps& maps,
                                                   Sm90BackwardSmem<T, D, BT>& sm, int g, int b,
                                                   int h, int jb, int T_tiles) {
  using S = Sm90BackwardSmem<T, D, BT>;
  constexpr int A = S::A;
  constexpr uint32_t kTileBytes = S::TILE * sizeof(T);
  const AttentionForwardParams& f = p.fwd;
  const int tid = threadIdx.x;

  // Keys and values of the CTA's slices, once (thread 0); the key flags (all).
  if (tid == 0) {
    uint32_t bytes = 0;
    for (int u = 0; u < A; ++u)
      for (int w = 0; w < S::KT; ++w)
        if (g * A + u < f.N) bytes += 2 * kTileBytes;
    mbar_expect_tx(&sm.kv_full, bytes);
#pragma unroll 1
    for (int u = 0; u < A; ++u) {
      const int n = g * A + u;
      if (n >= f.N) continue;
#pragma unroll 1
      for (int w = 0; w < S::KT; ++w) {
        const int k0 = jb * S::KB + w * kBwdKeysPerWarpgroup;
        tma_tile<T, D>(&maps.k, maps.k_dims, &sm.kv_full, sm.k[u][w], k0, h, n, b);
        tma_tile<T, D>(&maps.v, maps.v_dims, &sm.kv_full, sm.v[u][w], k0, h, n, b);
      }
    }
  }
#pragma unroll 1
  for (int u = 0; u < A; ++u) {
    const int n = g * A + u;
    const bool valid = n < f.N;
    for (int j = tid; j < S::KB; j += kBwdLoadThreads) {
      const int key = jb * S::KB + j;
      sm.key_ok[u][j] = valid && key < f.Sk &&
                        (f.mask == nullptr ||
                         f.mask[b * f.mask_stride_b + int64_t(n) * f.mask_stride_n + key] != 0);
    }
  }
  named_barrier(kBwdLoadBarrier, kBwdLoadThreads);
  if (tid < 2 * A) {  // a second tile past the key block (split D): skipped
    const int u = tid / 2, w = tid % 2;
    int alive = 0;
    for (int j = 0; j < kBwdKeysPerWarpgroup && w < S::KT; ++j)
      alive += sm.key_ok[u][w * kBwdKeysPerWarpgroup + j];
    sm.tile_state[u][w] = alive == 0                      ? kTileSkip
                          : alive == kBwdKeysPerWarpgroup ? kTileWhole
                                                          : kTileMasked;
  }
  named_barrier(kBwdLoadBarrier, kBwdLoadThreads);
  if (tid == 0) {
    int any = 0;
    for (int u = 0; u < A; ++u) any |= sm.tile_state[u][0] | sm.tile_state[u][1];
    sm.cta_alive = any;
  }
  named_barrier(kBwdLoadBarrier, kBwdLoadThreads);
  const bool cta_alive = sm.cta_alive != 0;
  unsigned slice_alive = 0;  // bit u: slice u has a tile to compute
#pragma unroll
  for (int u = 0; u < A; ++u)
    slice_alive |= unsigned((sm.tile_state[u][0] | sm.tile_state[u][1]) != 0) << u;
  mbar_arrive(&sm.kv_full);

  // Per query tile: Q, dO of the slices, the bias tile, lse2 and delta, into stage i % 2.
  if (tid != 0) return;
  constexpr uint32_t kBiasBytes = S::kF32Bias ? 0 : S::KT * S::BIAS_HALF * sizeof(T);
  const uint32_t stage_bytes = uint32_t(__popc(slice_alive)) * (2 * kTileBytes + 2 * kTileQ * 4);
  const int64_t sq_pad = int64_t(T_tiles) * kTileQ;
#pragma unroll 1
  for (int i = 0; i < T_tiles; ++i) {
    const int stage = i & 1;
    mbar_wait(&sm.empty[stage], ((i >> 1) & 1) ^ 1);
    if (cta_alive) {
      const int q0 = i * kTileQ;
      mbar_expect_tx(&sm.full[stage], stage_bytes + kBiasBytes);
      if constexpr (!S::kF32Bias)
        for (int w = 0; w < S::KT; ++w)
          tma_load_bias(&maps.bias, maps.bias_dims, &sm.full[stage],
                        sm.bias[stage] + w * S::BIAS_HALF, jb * S::KB + w * kBwdKeysPerWarpgroup,
                        q0, h, b);
#pragma unroll 1
      for (int u = 0; u < A; ++u) {
        if (!(slice_alive >> u & 1u)) continue;
        const int n = g * A + u;
        tma_tile<T, D>(&maps.q, maps.q_dims, &sm.full[stage], sm.q[stage][u], q0, h, n, b);
        tma_tile<T, D>(&maps.dout, maps.dout_dims, &sm.full[stage], sm.dout[stage][u], q0, h, n, b);
        const int64_t row = ((int64_t(b) * f.N + n) * f.H + h) * sq_pad + q0;
        bulk_copy(p.lse2 + row, &sm.full[stage], sm.lse2[stage][u], kTileQ * 4);
        bulk_copy(p.delta + row, &sm.full[stage], sm.delta[stage][u], kTileQ * 4);
      }
    }
    mbar_arrive(&sm.full[stage]);
  }
}

// d = A B^T for 64-row core-matrix tiles of D features, both read K-major (keys A, queries B):
// the wgmma steps over K = 16 features, the first overwriting d.
template <typename T, int D>
__device__ __forceinline__ void keys_times_queries(float (&d)[8][4], const T* a, const T* b) {
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const uint64_t da = desc_k_major(a + ks * 2 * 64 * 8), db = desc_k_major(b + ks * 2 * 64 * 8);
    if (ks == 0)
      Wgmma<T, 64>::template ss<0, 0, 0>(d, da, db);
    else
      Wgmma<T, 64>::template ss<1, 0, 0>(d, da, db);
  }
}

// ---- consumers: warpgroups 1 and 2 ------------------------------------------------------------------

// The packed 16-bit A fragment (rows of this warp, k = 16 kk .. 16 kk + 15) of an accumulator tile
// whose columns are the MMA's K: the C fragment and wgmma's register A fragment share the per-warp
// layout.
template <typename T>
__device__ __forceinline__ void pack_a(uint32_t (&a)[4], const float (&c)[8][4], int kk) {
  a[0] = Mma<T>::pack(c[2 * kk][0], c[2 * kk][1]);
  a[1] = Mma<T>::pack(c[2 * kk][2], c[2 * kk][3]);
  a[2] = Mma<T>::pack(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = Mma<T>::pack(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

// Stores this warp's packed dS^T fragment for queries 16 kk .. 16 kk + 15 (pack_a's layout: the
// warp's 16 keys x those queries, four 8 x 8 matrices) transposed into `ds`, the warpgroup's dS in
// the core-matrix layout [key / 8][query][8] (K-major A of dQ = dS K): with .trans, row r of each
// stored matrix is query r holding its 8 keys, one 16-byte core-matrix row.
__device__ __forceinline__ void store_ds_core(void* ds, int kk, int warp, const uint32_t (&r)[4],
                                              int lane) {
  const int m = lane >> 3;  // matrix: (m & 1) = keys + 8, (m >> 1) = queries + 8 (pack_a's order)
  const int key_chunk = 2 * warp + (m & 1), query = 16 * kk + 8 * (m >> 1) + (lane & 7);
  const uint32_t addr = smem_addr(ds) + uint32_t((key_chunk * kTileQ + query) * 16);
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(addr),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// A consumer's state across the query tiles: dK and dV of its 64 keys in each slice.
template <int D, int A>
struct ConsumerAccumulators {
  float dk[A][D / 8][4];
  float dv[A][D / 8][4];
};

// load_transposed (mma.cuh) of the 16 x 16 block at queries row0.., keys 16 warp.. of a warpgroup's
// 16-bit bias tile [64 queries][64 keys] as TMA wrote it with the 128-byte swizzle: the 16-byte
// chunk c of row r sits at chunk c ^ (r % 8) of its 128-byte row (the tile starts on 1024 bytes).
template <typename T>
__device__ __forceinline__ void load_bias_transposed(uint32_t (&r)[4], const T* tile, int row0,
                                                     int warp, int lane) {
  const int row = row0 + (lane & 7) + (lane >> 4) * 8, chunk = 2 * warp + ((lane >> 3) & 1);
  const uint32_t addr = smem_addr(tile) + uint32_t(row * 128 + ((chunk ^ (row & 7)) << 4));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// A float32 bias: this thread's elements of bias^T for query tile q0 (bias_keys: the bias rows of
// (b, h) from the warpgroup's first key), in the accumulator layout of S^T: b[j][2 r + e] is
// (key g + 8 r, query q0 + 8 j + 2 t + e), g = lane / 4, t = lane % 4. Keys and queries past the
// end read the last one (their probabilities are zero: masked key, lse = +inf).
__device__ __forceinline__ void load_bias_f32(float (&bias)[8][4], const float* bias_keys,
                                              int64_t stride_q, int q0, int qlast, int key,
                                              int klast, int lane) {
  const float* k0 = bias_keys + min(key, klast);
  const float* k8 = bias_keys + min(key + 8, klast);
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int64_t row = int64_t(min(q0 + j * 8 + (lane & 3) * 2 + e, qlast)) * stride_q;
      bias[j][e] = __ldg(k0 + row);
      bias[j][2 + e] = __ldg(k8 + row);
    }
}

// Warpgroup w's 64 keys are key tile kw = w of the CTA's key block, its dK, dV and dQ all DC = D
// columns; with split D (backward_sm90_tiles.h) both warpgroups take key tile 0 and warpgroup w
// owns columns cw * DC .. cw * DC + DC - 1.
template <typename T, int D, typename BT>
__device__ __forceinline__ void sm90_backward_consume(
    const AttentionBackwardParams& p, Sm90BackwardSmem<T, D, BT>& sm,
    ConsumerAccumulators<Sm90BackwardSmem<T, D, BT>::DC, Sm90BackwardSmem<T, D, BT>::A>& acc, int w,
    int b, int h, int jb, int T_tiles) {
  using S = Sm90BackwardSmem<T, D, BT>;
  constexpr int A = S::A, DQS = S::DQS, DC = S::DC, DQC = S::DQC;
  constexpr bool kSplit = S::Config::kSplitD;
  const int kw = kSplit ? 0 : w;         // key tile
  const int col0 = kSplit ? w * DC : 0;  // first column of dK, dV, dQ (core-matrix blocks of 8)
  const int ctid = threadIdx.x - 128 * (1 + w);  // 0..127 in the warpgroup
  const int warp = ctid >> 5, lane = ctid & 31;
  const float scale = in_register(p.fwd.scale);  // see in_register (mma.cuh)

  mbar_wait(&sm.kv_full, 0);
  uint8_t state[A];
  bool keep[A][2];  // per slice, this thread's key rows g and g + 8: probability kept
  const int key_lo = kw * kBwdKeysPerWarpgroup + warp * kWarpRows + (lane >> 2);
  const int key_base = jb * S::KB;  // key_lo counts from here
#pragma unroll
  for (int u = 0; u < A; ++u) {
    state[u] = sm.tile_state[u][kw];
    keep[u][0] = state[u] == kTileWhole || sm.key_ok[u][key_lo] != 0;
    keep[u][1] = state[u] == kTileWhole || sm.key_ok[u][key_lo + 8] != 0;
  }
#pragma unroll
  for (int u = 0; u < A; ++u)
#pragma unroll
    for (int i = 0; i < DC / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc.dk[u][i][e] = acc.dv[u][i][e] = 0.f;

  int staged = 0;    // dQ partials staged so far (every slice of every query tile)
  int computed = 0;  // tiles computed so far: parity of the dS buffer
#pragma unroll 1
  for (int i = 0; i < T_tiles; ++i) {
    const int stage = i & 1;
    // bias^T of this warp's 16 keys x the 64 queries. 16-bit: ldmatrix.trans of the [query][key]
    // tile, bias2[jj][2 half + r] holds queries 16 jj + 8 half + 2t, +1 of key g + 8 r; float32:
    // biasf[j][2 r + e], loaded before the wait (no dependence on the producer).
    uint32_t bias2[S::kF32Bias ? 1 : 4][4];
    float biasf[S::kF32Bias ? 8 : 1][4];
    if constexpr (S::kF32Bias) {
      const AttentionForwardParams& f = p.fwd;
      load_bias_f32(biasf,
                    static_cast<const float*>(f.bias) + b * f.bias_stride_b + h * f.bias_stride_h,
                    f.bias_stride_q, i * kTileQ, f.Sq - 1, key_base + key_lo, f.Sk - 1, lane);
    }
    mbar_wait(&sm.full[stage], (i >> 1) & 1);
    if constexpr (!S::kF32Bias) {
#pragma unroll
      for (int jj = 0; jj < 4; ++jj)
        load_bias_transposed(bias2[jj], sm.bias[stage] + kw * S::BIAS_HALF, jj * 16, warp, lane);
    }
    float db[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) db[j][0] = db[j][1] = db[j][2] = db[j][3] = 0.f;
    bool any = false;

#pragma unroll
    for (int u = 0; u < A; ++u) {
      const int buf = staged % DQS;
      // A slice with a kept key in either key tile runs every MMA of both warpgroups, without a
      // branch between them (a branch around some of one commit group's wgmmas made ptxas
      // serialize them all); a warpgroup whose own 64 keys are all masked (or past Sk: TMA filled
      // those rows with zeros) computes P^T = dS^T = 0 and adds zeros.
      bool slice_live = false;
#pragma unroll
      for (int t = 0; t < S::KT; ++t) slice_live |= sm.tile_state[u][t] != kTileSkip;
      if (!slice_live) {  // a zero partial (the first key block stores it as the sum's start)
        mbar_wait(&sm.dq_empty[buf], ((staged / DQS) & 1) ^ 1);
        float4* sq = reinterpret_cast<float4*>(sm.dq_stage[buf][w]);
        for (int e = ctid; e < kTileQ * DQC / 4; e += 128) sq[e] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (w == 0 && ctid == 0) sm.dq_valid[buf] = 0;
        fence_proxy_async();
        mbar_arrive(&sm.dq_full[buf]);
        ++staged;
        continue;
      }
      any |= state[u] != kTileSkip;
      const T* kt = sm.k[u][kw];
      const T* vt = sm.v[u][kw];
      const T* qt = sm.q[stage][u];
      const T* dot = sm.dout[stage][u];
      T* ds = sm.ds[w][computed & 1];
      uint32_t pa[4][4], da[4][4];
      {
        float st[8][4], dpt[8][4];  // S^T, dP^T: this warp's 16 keys x 64 queries
        wgmma_fence();
        keys_times_queries<T, D>(st, kt, qt);    // S^T = K Q^T
        keys_times_queries<T, D>(dpt, vt, dot);  // dP^T = V dO^T
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(st);
        fence_regs(dpt);

        // Elements (key g + 8 r, query 8 j + 2t + e) with g = lane / 4, t = lane % 4.
        const float* lse2 = sm.lse2[stage][u];
        const float* delta = sm.delta[stage][u];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int query = j * 8 + (lane & 3) * 2;
          const float2 l2 = *reinterpret_cast<const float2*>(lse2 + query);
          const float2 dl = *reinterpret_cast<const float2*>(delta + query);
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            float2 bias;
            if constexpr (S::kF32Bias)
              bias = make_float2(biasf[j][2 * r], biasf[j][2 * r + 1]);
            else
              bias = unpack2<T>(bias2[j >> 1][(j & 1) * 2 + r]);
            float p0 = fast_exp2(fmaf(fmaf(st[j][2 * r], scale, bias.x), kLog2e, -l2.x));
            float p1 = fast_exp2(fmaf(fmaf(st[j][2 * r + 1], scale, bias.y), kLog2e, -l2.y));
            p0 = keep[u][r] ? p0 : 0.f;
            p1 = keep[u][r] ? p1 : 0.f;
            const float ds0 = p0 * (dpt[j][2 * r] - dl.x), ds1 = p1 * (dpt[j][2 * r + 1] - dl.y);
            st[j][2 * r] = p0;
            st[j][2 * r + 1] = p1;
            dpt[j][2 * r] = ds0;
            dpt[j][2 * r + 1] = ds1;
            db[j][2 * r] += ds0;
            db[j][2 * r + 1] += ds1;
          }
        }
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          pack_a<T>(pa[kk], st, kk);
          pack_a<T>(da[kk], dpt, kk);
        }
        // dS into the warpgroup's buffer of this parity: the tile two computed tiles back read it
        // (both warpgroups' dQ MMAs), and every warp of both passed that tile's MMA wait before
        // the barrier of the tile in between.
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) store_ds_core(ds, kk, warp, da[kk], lane);
        fence_proxy_async();
      }
      if constexpr (kSplit)
        named_barrier(1 + w, 128);
      else
        named_barrier(1, 256);

      // This warpgroup's DC columns of dO and Q (dK, dV) and DQC columns of K (dQ): core-matrix
      // column blocks col0 / 8 and dq_col0 / 8 on.
      const int dq_col0 = w * DQC;
      const T* dot_c = dot + (col0 / 8) * 64 * 8;
      const T* qt_c = qt + (col0 / 8) * 64 * 8;
      float dq[DQC / 8][4];
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)  // dV += P^T dO: K = 16 queries per step
        Wgmma<T, DC>::template rs<1, 1>(acc.dv[u], pa[kk], desc_mn_major(dot_c + kk * 16 * 8));
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)  // dK += dS^T Q
        Wgmma<T, DC>::template rs<1, 1>(acc.dk[u], da[kk], desc_mn_major(qt_c + kk * 16 * 8));
#pragma unroll
      for (int t = 0; t < S::KT; ++t) {  // dQ = dS K over the key tiles: K = 16 keys a step
        const T* ds_t = kSplit ? ds : sm.ds[t][computed & 1];
        const T* kt_c = sm.k[u][kSplit ? kw : t] + (dq_col0 / 8) * 64 * 8;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const uint64_t a = desc_k_major(ds_t + kk * 2 * kTileQ * 8),
                         bk = desc_mn_major(kt_c + kk * 16 * 8);
          if (t == 0 && kk == 0)  // the first step overwrites dq
            Wgmma<T, DQC>::template ss<0, 0, 1>(dq, a, bk);
          else
            Wgmma<T, DQC>::template ss<1, 0, 1>(dq, a, bk);
        }
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(acc.dv[u]);
      fence_regs(acc.dk[u]);
      fence_regs(dq);
      fence_regs(pa);
      fence_regs(da);
      ++computed;

      mbar_wait(&sm.dq_empty[buf], ((staged / DQS) & 1) ^ 1);
      float* sq = sm.dq_stage[buf][w];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = warp * kWarpRows + (lane >> 2) + r * 8;
#pragma unroll
        for (int c = 0; c < DQC / 8; ++c)
          *reinterpret_cast<float2*>(sq + stage_offset<DQC>(row, c * 8 + (lane & 3) * 2)) =
              make_float2(dq[c][2 * r], dq[c][2 * r + 1]);
      }
      if (w == 0 && ctid == 0) sm.dq_valid[buf] = 1;
      fence_proxy_async();  // the writer may copy the stage by TMA (async proxy)
      mbar_arrive(&sm.dq_full[buf]);
      ++staged;
    }
    mbar_arrive(&sm.empty[stage]);  // this stage's Q, dO, bias, lse, delta are read

    mbar_wait(&sm.dbias_empty, (i & 1) ^ 1);
    if (!kSplit || w == 0) {  // zero where no slice had a kept key (db stays 0)
      float* sdb = sm.dbias_stage[w];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int key = warp * kWarpRows + (lane >> 2) + r * 8;
#pragma unroll
        for (int j = 0; j < 8; ++j)
          *reinterpret_cast<float2*>(sdb + stage_offset<kTileQ>(key, j * 8 + (lane & 3) * 2)) =
              make_float2(db[j][2 * r], db[j][2 * r + 1]);
      }
      fence_proxy_async();  // the writer copies the stage by TMA
    }
    if (ctid == 0) sm.dbias_valid[w] = any && (!kSplit || w == 0);
    mbar_arrive(&sm.dbias_full);
  }
}

}  // namespace tpf::cuda
