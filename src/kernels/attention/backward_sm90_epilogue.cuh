// The Hopper backward's outputs: the dQ and dbias writers (warps 1-3 of the producer warpgroup),
// which add the consumers' staged tiles to the fp32 accumulators in global memory in a fixed order
// across CTAs (semaphores, wgmma.cuh), the consumers' dK/dV stores, and the kernel that turns the
// dbias accumulator into dbias.
//
// dQ of (slice n, query tile i) = scale * sum over key blocks jb = 0, 1, ..., J - 1 of the CTA's
// partial (both warpgroups' keys summed in the MMA): key block 0 stores it, the next ones add
// theirs (bulk reductions at L2); attention_dq_finish_kernel writes dq from the sum.
// dbias^T of (query tile i, key block jb) = sum over slice groups g = 0, 1, ... of the CTA's sum
// over its slices (in lanes, g mod L): group 0 stores, the others add (bulk copies);
// attention_dbias_finish_kernel adds the lanes and transposes the sum into dbias. Either order is
// the CTA numbering of the scheduler (backward_sm90.h).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/attention/backward_sm90.h"
#include "kernels/attention/backward_sm90_mainloop.cuh"
#include "kernels/common/mma.cuh"
#include "kernels/common/wgmma.cuh"

namespace tpf::cuda {

// dq[row, c .. c + 3] = scale * x in the output dtype.
template <typename T>
__device__ __forceinline__ void store_dq4(T* dst, float4 x, float scale, bool aligned) {
  const T y0 = from_float<T>(x.x * scale), y1 = from_float<T>(x.y * scale),
          y2 = from_float<T>(x.z * scale), y3 = from_float<T>(x.w * scale);
  if (aligned) {
    uint2 v;
    v.x = uint32_t(*reinterpret_cast<const uint16_t*>(&y0)) |
          uint32_t(*reinterpret_cast<const uint16_t*>(&y1)) << 16;
    v.y = uint32_t(*reinterpret_cast<const uint16_t*>(&y2)) |
          uint32_t(*reinterpret_cast<const uint16_t*>(&y3)) << 16;
    *reinterpret_cast<uint2*>(dst) = v;
  } else {
    dst[0] = y0;
    dst[1] = y1;
    dst[2] = y2;
    dst[3] = y3;
  }
}

// dQ of a slice group's query tile is summed over its key blocks jb = 0, 1, ..., J - 1 in that
// order (the semaphore counts the key blocks that have added theirs) by the dQ writer, thread 0 of
// warp 1 (the warp's other lanes leave at once), by TMA: block 0 stores its staged tiles, the next
// ones add theirs (bulk reductions at L2); each query tile's copies are waited for, then the turn
// is passed on. The accumulator's tile holds the stage's order (stage_offset), so a whole staged
// tile is one bulk copy; attention_dq_finish_kernel turns the sums into dq after the launch.
template <typename T, int D, typename BT>
__device__ __forceinline__ void sm90_backward_write_dq(const AttentionBackwardParams& p,
                                                       Sm90BackwardSmem<T, D, BT>& sm, int g, int b,
                                                       int h, int jb, int T_tiles,
                                                       int chunk_first_slice) {
  using S = Sm90BackwardSmem<T, D, BT>;
  constexpr int A = S::A, DQS = S::DQS;
  constexpr int kTileBytes = kTileQ * D * int(sizeof(float));
  const AttentionForwardParams& f = p.fwd;
  if ((threadIdx.x & 31) != 0) return;
  const int64_t sq_pad = int64_t(T_tiles) * kTileQ;
  const bool first = jb == 0;
  int staged = 0;
#pragma unroll 1
  for (int i = 0; i < T_tiles; ++i) {
    int* sem = p.dq_sem + ((int64_t(g) * f.B + b) * f.H + h) * T_tiles + i;
    wait_turn(sem, jb);
    fence_proxy_async_all();  // the block before's sums (acquired above) to the bulk copies
#pragma unroll 1
    for (int u = 0; u < A; ++u, ++staged) {
      const int buf = staged % DQS;
      mbar_wait(&sm.dq_full[buf], (staged / DQS) & 1);
      const int n = g * A + u;
      if (n < f.N && (first || sm.dq_valid[buf] != 0)) {
        float* acc = p.dq_acc +
                     ((int64_t(n - chunk_first_slice) * f.B + b) * f.H + h) * sq_pad * D +
                     int64_t(i) * kTileQ * D;
        if (first)
          bulk_store(acc, sm.dq_stage[buf][0], kTileBytes);
        else
          bulk_reduce_add(acc, sm.dq_stage[buf][0], kTileBytes);
        bulk_commit();
        bulk_wait_read();
      }
      mbar_arrive(&sm.dq_empty[buf]);
    }
    bulk_wait();
    fence_proxy_async_all();
    pass_turn(sem);
  }
}

// dq = scale * the dQ accumulator of the launch's slices first_slice .. first_slice + slices - 1, in
// q's dtype: one CTA per (slice, b, h, query tile), reading the tile's 64 x D floats in order
// (stage_offset's) and writing each float4 as four columns of its row.
template <typename T, int D>
__global__ void attention_dq_finish_kernel(const AttentionBackwardParams p, int first_slice,
                                           int T_tiles) {
  constexpr int DQC = D / 2, HALF = kTileQ * DQC;
  const AttentionForwardParams& f = p.fwd;
  int64_t t = blockIdx.x;  // ((slice - first_slice) B + b) H + h) T + i
  const int i = int(t % T_tiles);
  t /= T_tiles;
  const int h = int(t % f.H);
  t /= f.H;
  const int b = int(t % f.B);
  t /= f.B;
  const int n = first_slice + int(t);
  const float* acc = p.dq_acc + ((t * f.B + b) * f.H + h) * int64_t(T_tiles) * kTileQ * D +
                     int64_t(i) * kTileQ * D;
  T* out =
      static_cast<T*>(p.dq) + b * p.dq_stride.b + int64_t(n) * p.dq_stride.n + h * p.dq_stride.h;
  const int q0 = i * kTileQ, qrows = min(kTileQ, f.Sq - q0);
  for (int e = threadIdx.x; e < kTileQ * D / 4; e += blockDim.x) {
    const int half = 4 * e / HALF, row = 4 * e % HALF / DQC;
    const int c = half * DQC + stage_offset<DQC>(row, 4 * e % DQC) - row * DQC;
    if (row < qrows && c < p.head_dim)
      store_dq4(out + int64_t(q0 + row) * p.dq_stride.s + c,
                __ldcs(reinterpret_cast<const float4*>(acc + 4 * e)), f.scale, p.dq_aligned);
  }
}

// The dbias writer, thread 0 of warp 2 (warp 3 and the other lanes leave at once), by TMA: per query tile,
// the CTA's dbias^T tile (keys of both warpgroups x 64 queries, one bulk copy) into its lane
// l = g % L, in its slice group's turn there (g / L; the semaphore counts the groups that have
// passed): the first group of a lane stores, the others add (backward_sm90_tiles.h). A lane's
// accumulator is tiled: [key block][query tile][KB keys][64 queries] in stage_offset's order.
template <typename T, int D, typename BT>
__device__ __forceinline__ void sm90_backward_write_dbias(const AttentionBackwardParams& p,
                                                          Sm90BackwardSmem<T, D, BT>& sm, int g,
                                                          int b, int h, int jb, int J, int T_tiles,
                                                          int part) {
  using S = Sm90BackwardSmem<T, D, BT>;
  constexpr int kTileBytes = S::KB * kTileQ * int(sizeof(float));
  const AttentionForwardParams& f = p.fwd;
  if (part != 0 || (threadIdx.x & 31) != 0) return;
  const int lanes = p.dbias_lanes, lane_of_g = g % lanes, turn = g / lanes;
  const int64_t bh = (int64_t(lane_of_g) * f.B + b) * f.H + h;  // this lane's [b][h]
#pragma unroll 1
  for (int i = 0; i < T_tiles; ++i) {
    mbar_wait(&sm.dbias_full, i & 1);
    int* sem = p.dbias_sem + (bh * T_tiles + i) * J + jb;
    wait_turn(sem, turn);
    fence_proxy_async_all();  // the groups before's sums (acquired above) to the bulk copy
    float* acc = p.dbias_acc_t + ((bh * J + jb) * T_tiles + i) * int64_t(S::KB) * kTileQ;
    const bool valid = sm.dbias_valid[0] != 0 || sm.dbias_valid[1] != 0;
    if (turn == 0 || valid) {
      if (turn == 0)
        bulk_store(acc, sm.dbias_stage[0], kTileBytes);
      else
        bulk_reduce_add(acc, sm.dbias_stage[0], kTileBytes);
      bulk_commit();
      bulk_wait_read();
    }
    mbar_arrive(&sm.dbias_empty);
    bulk_wait();
    fence_proxy_async_all();
    pass_turn(sem);
  }
}

// A consumer's dK (scaled) and dV for its 64 keys of each slice, from registers: its DC columns
// from col0 of the 64 keys from key0 (sm90_backward_consume).
template <typename T, int DC, int A>
__device__ __forceinline__ void sm90_backward_store_dkdv(const AttentionBackwardParams& p,
                                                         const ConsumerAccumulators<DC, A>& acc,
                                                         int g, int b, int h, int key0, int col0,
                                                         int w) {
  const AttentionForwardParams& f = p.fwd;
  const int ctid = threadIdx.x - 128 * (1 + w), warp = ctid >> 5, lane = ctid & 31;
#pragma unroll
  for (int u = 0; u < A; ++u) {
    const int n = g * A + u;
    if (n >= f.N) continue;
    T* dk_out =
        static_cast<T*>(p.dk) + b * p.dk_stride.b + int64_t(n) * p.dk_stride.n + h * p.dk_stride.h;
    T* dv_out =
        static_cast<T*>(p.dv) + b * p.dv_stride.b + int64_t(n) * p.dv_stride.n + h * p.dv_stride.h;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = key0 + warp * kWarpRows + (lane >> 2) + r * 8;
      if (key >= f.Sk) continue;
#pragma unroll
      for (int c = 0; c < DC / 8; ++c) {
        const int col = col0 + c * 8 + (lane & 3) * 2;
        if (col >= p.head_dim) break;  // zero-padded columns (backward_sm90.h)
        T* dkp = dk_out + int64_t(key) * p.dk_stride.s + col;
        T* dvp = dv_out + int64_t(key) * p.dv_stride.s + col;
        dkp[0] = from_float<T>(acc.dk[u][c][2 * r] * f.scale);
        dkp[1] = from_float<T>(acc.dk[u][c][2 * r + 1] * f.scale);
        dvp[0] = from_float<T>(acc.dv[u][c][2 * r]);
        dvp[1] = from_float<T>(acc.dv[u][c][2 * r + 1]);
      }
    }
  }
}

// dbias[b, h, q, k] = sum over the lanes l = 0, 1, ... (in order) of dbias^T (k, q) of lane l, in
// the output dtype T (the bias's): kBwdFinishTile^2 tiles through shared memory, reads along the
// accumulator's rows (keys; their queries swizzled within 16-byte chunks), writes along dbias's.
template <typename T>
__global__ void attention_dbias_finish_kernel(const AttentionBackwardParams p, int query_tiles,
                                              int key_blocks, int key_block) {
  const AttentionForwardParams& f = p.fwd;
  constexpr int kT = kBwdFinishTile;
  __shared__ float tile[kT][kT + 1];
  const int bh = blockIdx.z, b = bh / f.H, h = bh % f.H;
  const int q0 = blockIdx.x * kT, k0 = blockIdx.y * kT;
  const int64_t tile_floats = int64_t(key_block) * kTileQ;
  const int64_t lane_floats = int64_t(f.B) * f.H * key_blocks * query_tiles * tile_floats;
  const float* acc = p.dbias_acc_t + int64_t(bh) * key_blocks * query_tiles * tile_floats;
  for (int r = threadIdx.y; r < kT; r += blockDim.y) {  // rows: keys
    const int k = k0 + r, q = q0 + threadIdx.x;
    float x = 0.f;
    if (k < f.Sk && q < f.Sq) {
      const int jb = k / key_block, kr = k % key_block;
      const float* a = acc + (int64_t(jb) * query_tiles + q / kTileQ) * tile_floats +
                       stage_offset<kTileQ>(kr, q % kTileQ);
      x = a[0];
      for (int l = 1; l < p.dbias_lanes; ++l) x += a[l * lane_floats];
    }
    tile[r][threadIdx.x] = x;
  }
  __syncthreads();
  T* out = static_cast<T*>(p.dbias) + b * p.dbias_stride_b + h * p.dbias_stride_h;
  for (int r = threadIdx.y; r < kT; r += blockDim.y) {  // rows: queries
    const int q = q0 + r, k = k0 + threadIdx.x;
    if (q < f.Sq && k < f.Sk)
      out[int64_t(q) * p.dbias_stride_q + k] = from_float<T>(tile[threadIdx.x][r]);
  }
}

}  // namespace tpf::cuda
