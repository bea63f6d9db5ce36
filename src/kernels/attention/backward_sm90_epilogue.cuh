// The Hopper backward's outputs: the dQ and dbias writers (warps 1-3 of the producer warpgroup),
// which add the consumers' staged tiles to the fp32 accumulators in global memory in a fixed order
// across CTAs (semaphores, wgmma.cuh), the consumers' dK/dV stores, and the kernel that turns the
// dbias accumulator into dbias.
//
// dQ of (slice n, query tile i) = scale * sum over key blocks jb = 0, 1, ..., J - 1 of
// (partial of warpgroup 0 + partial of warpgroup 1): key block 0 stores its sum, the next ones add
// theirs (16-byte reductions at L2), the last reads the total, adds its own and writes dq.
// dbias^T of (query tile i, key block jb) = sum over slice groups g = 0, 1, ... of the CTA's sum
// over its slices: group 0 stores, the others add; attention_dbias_finish_kernel transposes it
// into dbias. Either order is the CTA numbering of the scheduler (backward_sm90.h).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/attention/backward_sm90.h"
#include "kernels/attention/backward_sm90_mainloop.cuh"
#include "kernels/common/mma.cuh"
#include "kernels/common/wgmma.cuh"

namespace tpf::cuda {

__device__ __forceinline__ float4 add4(float4 a, float4 b) {
  return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

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

// Warps 1..kBwdDqWriters (`part` 0, 1, ...: every kBwdDqWriters-th float4 of a tile each): per
// query tile, wait for their turn among the key blocks of the slice group (once for all the group's
// slices: the semaphore counts every writer warp's pass), then take each slice's staged partials as
// the consumers leave them.
template <typename T, int D, typename BT>
__device__ __forceinline__ void sm90_backward_write_dq(const AttentionBackwardParams& p,
                                                       Sm90BackwardSmem<T, D, BT>& sm, int g, int b,
                                                       int h, int jb, int J, int T_tiles,
                                                       int chunk_first_slice, int part) {
  using S = Sm90BackwardSmem<T, D, BT>;
  constexpr int A = S::A, DQS = S::DQS, C4 = D / 4;
  const AttentionForwardParams& f = p.fwd;
  const int lane = threadIdx.x & 31;
  const int64_t sq_pad = int64_t(T_tiles) * kTileQ;
  const bool first = jb == 0, last = jb == J - 1;
  int staged = 0;
#pragma unroll 1
  for (int i = 0; i < T_tiles; ++i) {
    int* sem = p.dq_sem + ((int64_t(g) * f.B + b) * f.H + h) * T_tiles + i;
    wait_turn(sem, kBwdDqWriters * jb);
    const int q0 = i * kTileQ, qrows = min(kTileQ, f.Sq - q0);
#pragma unroll 1
    for (int u = 0; u < A; ++u, ++staged) {
      const int buf = staged % DQS;
      mbar_wait(&sm.dq_full[buf], (staged / DQS) & 1);
      const int n = g * A + u;
      const bool v0 = sm.dq_valid[buf][0] != 0, v1 = sm.dq_valid[buf][1] != 0;
      if (n < f.N && (first || last || v0 || v1)) {
        const float* s0 = sm.dq_stage[buf][0];
        const float* s1 = sm.dq_stage[buf][1];
        float* acc = p.dq_acc +
                     ((int64_t(n - chunk_first_slice) * f.B + b) * f.H + h) * sq_pad * D +
                     int64_t(q0) * D;
        T* out = static_cast<T*>(p.dq) + b * p.dq_stride.b + int64_t(n) * p.dq_stride.n +
                 h * p.dq_stride.h;
#pragma unroll 4
        for (int e = lane + 32 * part; e < kTileQ * C4; e += 32 * kBwdDqWriters) {
          const int row = e / C4, c = (e % C4) * 4;
          float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
          if constexpr (S::Config::kSplitD) {  // the warpgroups' column halves
            const bool hi = c >= S::DC;
            if (hi ? v1 : v0)
              x = *reinterpret_cast<const float4*>((hi ? s1 : s0) + row * S::LDQ + c % S::DC);
          } else {
            if (v0) x = add4(x, *reinterpret_cast<const float4*>(s0 + row * S::LDQ + c));
            if (v1) x = add4(x, *reinterpret_cast<const float4*>(s1 + row * S::LDQ + c));
          }
          float* a = acc + row * D + c;
          if (last) {
            if (!first) x = add4(__ldcg(reinterpret_cast<const float4*>(a)), x);
            if (row < qrows && c < p.head_dim)
              store_dq4(out + int64_t(q0 + row) * p.dq_stride.s + c, x, f.scale, p.dq_aligned);
          } else if (first) {
            *reinterpret_cast<float4*>(a) = x;
          } else {
            red_add4(a, x);
          }
        }
      }
      __syncwarp();
      mbar_arrive(&sm.dq_empty[buf]);
    }
    pass_turn(sem, lane);
  }
}

// The last kBwdDbiasWriters warps (`part` 0, 1, ...: every kBwdDbiasWriters-th float4 each): per
// query tile, the CTA's dbias^T tile (keys of both warpgroups x 64 queries) into its lane
// l = g % L, in its slice group's turn there (g / L; the semaphore counts every writer warp's
// pass): the first group of a lane stores, the others add (backward_sm90_tiles.h).
template <typename T, int D, typename BT>
__device__ __forceinline__ void sm90_backward_write_dbias(const AttentionBackwardParams& p,
                                                          Sm90BackwardSmem<T, D, BT>& sm, int g,
                                                          int b, int h, int jb, int J, int T_tiles,
                                                          int part) {
  using S = Sm90BackwardSmem<T, D, BT>;
  const AttentionForwardParams& f = p.fwd;
  const int lane = threadIdx.x & 31;
  const int64_t sq_pad = int64_t(T_tiles) * kTileQ;
  constexpr int C4 = kTileQ / 4;
  const int lanes = p.dbias_lanes, lane_of_g = g % lanes, turn = g / lanes;
  const int64_t bh = (int64_t(lane_of_g) * f.B + b) * f.H + h;  // this lane's [b][h]
#pragma unroll 1
  for (int i = 0; i < T_tiles; ++i) {
    mbar_wait(&sm.dbias_full, i & 1);
    int* sem = p.dbias_sem + (bh * T_tiles + i) * J + jb;
    wait_turn(sem, kBwdDbiasWriters * turn);
#pragma unroll 1
    for (int w = 0; w < S::KT; ++w) {
      const bool valid = sm.dbias_valid[w] != 0;
      if (!valid && turn > 0) continue;
      const float* src = sm.dbias_stage[w];
      float* acc = p.dbias_acc_t +
                   (bh * (int64_t(J) * S::KB) + jb * S::KB + w * kBwdKeysPerWarpgroup) * sq_pad +
                   int64_t(i) * kTileQ;
#pragma unroll 4
      for (int e = lane + 32 * part; e < kBwdKeysPerWarpgroup * C4; e += 32 * kBwdDbiasWriters) {
        const int key = e / C4, c = (e % C4) * 4;
        const float4 x = valid ? *reinterpret_cast<const float4*>(src + key * S::LDDB + c)
                               : make_float4(0.f, 0.f, 0.f, 0.f);
        float* a = acc + key * sq_pad + c;
        if (turn == 0)
          *reinterpret_cast<float4*>(a) = x;
        else
          red_add4(a, x);
      }
    }
    __syncwarp();
    mbar_arrive(&sm.dbias_empty);
    pass_turn(sem, lane);
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

// dbias[b, h, q, k] = sum over the lanes l = 0, 1, ... (in order) of dbias_acc[l, b, h, k, q], in
// the output dtype T (the bias's): kBwdFinishTile^2 tiles through shared memory, reads and writes
// along rows.
template <typename T>
__global__ void attention_dbias_finish_kernel(const AttentionBackwardParams p, int64_t sq_pad,
                                              int64_t sk_pad) {
  const AttentionForwardParams& f = p.fwd;
  constexpr int kT = kBwdFinishTile;
  __shared__ float tile[kT][kT + 1];
  const int bh = blockIdx.z, b = bh / f.H, h = bh % f.H;
  const int q0 = blockIdx.x * kT, k0 = blockIdx.y * kT;
  const int64_t lane_floats = int64_t(f.B) * f.H * sk_pad * sq_pad;
  const float* acc = p.dbias_acc_t + int64_t(bh) * sk_pad * sq_pad;
  for (int r = threadIdx.y; r < kT; r += blockDim.y) {  // rows: keys
    const int k = k0 + r, q = q0 + threadIdx.x;
    float x = 0.f;
    if (k < f.Sk && q < f.Sq) {
      const float* a = acc + int64_t(k) * sq_pad + q;
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
