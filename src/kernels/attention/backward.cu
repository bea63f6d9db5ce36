// Triangle attention backward (sm_90a, mma.sync tensor cores). Deterministic: no floating-point
// atomics; every sum runs in a fixed order.
//
//  1. delta = rowsum(dO * (O + r)) in FP32, r the BF16 residual of O's rounding when kept
//     ("output-residual compensation"), one thread per query row.
//  2. The main kernel: a thread block owns one 64-key tile in G consecutive slices (two quads of
//     four warps, each quad G/2 slices; each warp 16 keys) and visits every query tile. For each
//     (query tile, slice) it recomputes the probability tile once from the log-sum-exp and uses it
//     for all four gradients: dK and dV accumulate in registers over the query tiles; dS passes
//     through shared memory to give one dQ partial per key tile; dS summed over the block's G
//     slices (in slice order, quad 0's sum then quad 1's) gives one dbias partial per group.
//  3. Reductions add the dQ partials in key-tile order and the dbias partials in group order.
// TPF_ATTENTION_BWD_DQ=cluster (lean only): the CTAs of a slice group's key tiles form thread-block
// clusters; per query tile each CTA leaves its dQ tile in shared memory and the cluster adds them in
// rank (= key-tile) order through distributed shared memory, writing dQ once (or, when the key tiles
// need several clusters, one partial per cluster): no per-key-tile partials.
// Slices run in chunks (the workspace bounds the partials); the dbias accumulator carries the sum
// from chunk to chunk in order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>

#include "kernels/attention/backward_preprocess.cuh"
#include "kernels/attention/backward_workspace.h"
#include "kernels/attention/forward.h"
#include "kernels/attention/mma.cuh"
#include "kernels/attention/tile_config.h"
#include "kernels/attention/tile_io.cuh"

namespace tpf::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

// Thread-block clusters (sm_90): split arrive / wait over all threads of the cluster, and 16-byte
// loads from another CTA's shared memory at the same offset as `local` in this one. The release
// arrive makes this CTA's shared-memory writes visible to the others after their wait (acquire);
// it compiles to MEMBAR.ALL.GPU, which also waits for this thread's outstanding global stores, so
// it is issued where none are recent. The relaxed arrive (no fence) only says that this thread's
// earlier loads from the cluster are done: their values were consumed before it.
__device__ __forceinline__ void cluster_arrive_release() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ float4 load_cluster(uint32_t local, int rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
  float4 x;
  asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];\n"
               : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w)
               : "r"(remote)
               : "memory");
  return x;
}

template <typename T>
__device__ __forceinline__ void store4(T* out, float4 x) {
  out[0] = from_float<T>(x.x);
  out[1] = from_float<T>(x.y);
  out[2] = from_float<T>(x.z);
  out[3] = from_float<T>(x.w);
}

template <typename T, int D, bool Lean>
struct BackwardSmem {
  static constexpr int G = BackwardTiles<D, Lean>::kSlices;
  static constexpr int LDB = kTileK + 4;  // lean dbias tiles, [query][key] fp32, conflict-free
  static constexpr int LD = D + kPad;
  static constexpr int LDT = kTileK + kPad;  // bias and dS tiles, [query][key]
  T k[G][kTileK * LD];
  T v[G][kTileK * LD];
  T q[G][kTileQ * LD];
  T dout[G][kTileQ * LD];
  T bias[kTileQ * LDT];
  T ds[2][kTileQ * LDT];  // cluster dQ: each quad's dQ tile, [query][LDQ] fp32, once dS is used
  static constexpr int LDQ = D + 4;
  float lse2[G][kTileQ];
  float delta[G][kTileQ];
  // Default: quad 1's dbias sums, [warp][register][lane]. Lean: each quad's dS, [quad][query][key].
  float dbias_buf[Lean ? 2 * kTileQ * LDB : 4 * 32 * 32];
  uint8_t key_ok[G][kTileK];
};

// Cluster dQ of one query tile: the CTAs' dQ tiles (sm.ds reused, rows of Smem::LDQ floats) summed
// in rank order, which is key-tile order, from 0: at one cluster per slice the same additions in
// the same order as attention_dq_reduce_kernel, so dQ is bitwise today's. Rank r of C takes the
// r-th C-th of the block's 2 x 64 x D / 4 float4s. Writes dQ (dq_parts == 1) or the fp32 partial
// of cluster `part`.
template <typename T, int D, typename Smem, int THREADS>
__device__ __forceinline__ void cluster_dq_sum(const AttentionBackwardParams& p, Smem& sm, int rank,
                                               int part, int b, int h, int n_first, int n_begin,
                                               int n_end, int q0, int qrows) {
  const AttentionForwardParams& f = p.fwd;
  constexpr int U4 = kTileQ * (D / 4), U = 2 * U4;
  constexpr int BATCH =
      D == 32 ? 2 : 4;  // remote loads in flight per thread; more spills at D = 32
  const int C = p.dq_cluster, u_end = (rank + 1) * U / C;
  for (int u = rank * U / C + threadIdx.x; u < u_end; u += THREADS) {
    const int g = u / U4, row = (u % U4) / (D / 4), c = (u % (D / 4)) * 4, n = n_first + g;
    if (n >= n_end || row >= qrows) continue;
    const uint32_t local =
        smem_addr(reinterpret_cast<const float*>(sm.ds[g]) + row * Smem::LDQ + c);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int r0 = 0; r0 < C; r0 += BATCH) {  // BATCH loads in flight, then the adds in order
      float4 x[BATCH];
#pragma unroll
      for (int r = 0; r < BATCH; ++r)
        if (r0 + r < C) x[r] = load_cluster(local, r0 + r);
#pragma unroll
      for (int r = 0; r < BATCH; ++r)
        if (r0 + r < C) {
          acc.x += x[r].x;
          acc.y += x[r].y;
          acc.z += x[r].z;
          acc.w += x[r].w;
        }
    }
    if (p.dq_parts == 1) {
      store4(static_cast<T*>(p.dq) + b * p.dq_stride.b + int64_t(n) * p.dq_stride.n +
                 h * p.dq_stride.h + int64_t(q0 + row) * p.dq_stride.s + c,
             acc);
    } else {
      *reinterpret_cast<float4*>(
          p.dq_partial +
          ((((int64_t(part) * p.chunk + (n - n_begin)) * f.B + b) * f.H + h) * f.Sq + q0 + row) *
              D +
          c) = acc;
    }
  }
}

template <typename T, int D, bool Lean, bool Cluster = false>
__global__ void __launch_bounds__(BackwardTiles<D, Lean>::kWarps * 32,
                                  BackwardTiles<D, Lean>::kMinBlocksPerSm)
    attention_backward_kernel(const AttentionBackwardParams p, int n_begin, int n_end) {
  static_assert(!Cluster || Lean, "the cluster dQ is for the lean backward (one slice per quad)");
  using Tiles = BackwardTiles<D, Lean>;
  using Smem = BackwardSmem<T, D, Lean>;
  static_assert(!Cluster || sizeof(float) * kTileQ * Smem::LDQ <= sizeof(Smem::ds[0]) &&
                                offsetof(Smem, ds) % 16 == 0,
                "a quad's fp32 dQ tile fits in its dS tile, 16-byte aligned");
  constexpr int G = Tiles::kSlices, GQ = Tiles::kSlicesPerQuad, THREADS = Tiles::kWarps * 32;
  constexpr int LD = Smem::LD, LDT = Smem::LDT;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  const AttentionForwardParams& f = p.fwd;

  const int kt = blockIdx.x, group = blockIdx.y;
  const int b = blockIdx.z / f.H, h = blockIdx.z % f.H;
  // krows = 0 for a cluster's padding CTAs (key tiles padded to whole clusters): no keys, zero dQ.
  const int k0 = kt * kTileK, krows = max(0, min(kTileK, f.Sk - k0));
  const int n_first = n_begin + group * G;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int quad = warp >> 2, wq = warp & 3;
  const T* safe = static_cast<const T*>(f.q);

  auto slice_ptr = [&](const void* base, const Strides4& st, int n) {
    return static_cast<const T*>(base) + b * st.b + int64_t(n) * st.n + h * st.h;
  };

  // Keys and values of the G slices, once.
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const int n = n_first + g;
    const bool valid = n < n_end;
    load_tile<T, kTileK, D, THREADS>(
        sm.k[g], valid ? slice_ptr(f.k, f.k_stride, n) + k0 * f.k_stride.s : safe, f.k_stride.s,
        valid ? krows : 0, D, f.qkv_aligned, safe);
    load_tile<T, kTileK, D, THREADS>(
        sm.v[g], valid ? slice_ptr(f.v, f.v_stride, n) + k0 * f.v_stride.s : safe, f.v_stride.s,
        valid ? krows : 0, D, f.qkv_aligned, safe);
    for (int j = threadIdx.x; j < kTileK; j += THREADS)
      sm.key_ok[g][j] = valid && j < krows &&
                        (f.mask == nullptr ||
                         f.mask[b * f.mask_stride_b + int64_t(n) * f.mask_stride_n + k0 + j] != 0);
  }

  float dk[GQ][D / 8][4], dv[GQ][D / 8][4];
#pragma unroll
  for (int gi = 0; gi < GQ; ++gi)
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[gi][i][e] = dv[gi][i][e] = 0.f;

  const T* bias_base =
      static_cast<const T*>(f.bias) + b * f.bias_stride_b + h * f.bias_stride_h + k0;
  const float scale = in_register(f.scale);  // see in_register (mma.cuh)
  const int query_tiles = (f.Sq + kTileQ - 1) / kTileQ;
  for (int qt = 0; qt < query_tiles; ++qt) {
    const int q0 = qt * kTileQ, qrows = min(kTileQ, f.Sq - q0);
    __syncthreads();  // the previous query tile's readers are done
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const int n = n_first + g;
      const bool valid = n < n_end;
      load_tile<T, kTileQ, D, THREADS>(
          sm.q[g], valid ? slice_ptr(f.q, f.q_stride, n) + q0 * f.q_stride.s : safe, f.q_stride.s,
          valid ? qrows : 0, D, f.qkv_aligned, safe);
      load_tile<T, kTileQ, D, THREADS>(
          sm.dout[g], valid ? slice_ptr(p.dout, p.dout_stride, n) + q0 * p.dout_stride.s : safe,
          p.dout_stride.s, valid ? qrows : 0, D, p.dout_aligned, safe);
    }
    load_tile<T, kTileQ, kTileK, THREADS>(sm.bias, bias_base + q0 * f.bias_stride_q,
                                          f.bias_stride_q, qrows, krows, f.bias_aligned, safe);
    for (int i = threadIdx.x; i < G * kTileQ; i += THREADS) {
      const int g = i / kTileQ, r = i % kTileQ, n = n_first + g;
      float lse2 = INFINITY, delta = 0.f;
      if (n < n_end && r < qrows) {
        lse2 = f.lse[b * f.lse_stride_b + int64_t(n) * f.lse_stride_n + h * f.lse_stride_h +
                     (q0 + r) * f.lse_stride_s] *
               kLog2e;
        delta = p.delta[((int64_t(b) * f.N + n) * f.H + h) * f.Sq + q0 + r];
      }
      sm.lse2[g][r] = lse2;
      sm.delta[g][r] = delta;
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    // The other CTAs have read the previous query tile's dQ tiles before sm.ds is rewritten.
    if constexpr (Cluster)
      if (qt > 0) cluster_wait();

    const T* s_bias = sm.bias;
    const float* s_lse2 = sm.lse2[0];
    const float* s_delta = sm.delta[0];

    // This warp's 16 keys x 64 queries of dS, summed over its quad's slices.
    float dbias[kTileQ / 8][4];
#pragma unroll
    for (int j = 0; j < kTileQ / 8; ++j)
      dbias[j][0] = dbias[j][1] = dbias[j][2] = dbias[j][3] = 0.f;

#pragma unroll
    for (int gi = 0; gi < GQ; ++gi) {
      const int g = quad * GQ + gi, n = n_first + g;
      if (n >= n_end) continue;  // uniform over the quad, so its named barriers stay matched

      // s^T = k q^T and dp^T = v do^T: this warp's 16 keys x 64 queries.
      float st[kTileQ / 8][4], dpt[kTileQ / 8][4];
      uint32_t ka[D / 16][4], va[D / 16][4];
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        load_a(ka[ks], sm.k[g], LD, wq * kWarpRows, ks * 16);
        load_a(va[ks], sm.v[g], LD, wq * kWarpRows, ks * 16);
      }
#pragma unroll
      for (int j = 0; j < kTileQ / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) st[j][e] = dpt[j][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
          uint32_t bf[2];
          load_b_nk(bf, sm.q[g], LD, j * 8, ks * 16);
          Mma<T>::run(st[j], ka[ks], bf);
          load_b_nk(bf, sm.dout[g], LD, j * 8, ks * 16);
          Mma<T>::run(dpt[j], va[ks], bf);
        }
      }
      // p^T = exp2(s scale log2e + bias log2e - lse log2e); ds^T = p^T (dp^T - delta). This
      // thread's elements are keys g and g + 8 (g = lane / 4) of the warp's 16, times queries
      // 2t and 2t + 1 of each 8-query block (t = lane % 4): the bias tile, stored [query][key],
      // is read transposed by ldmatrix, and lse and delta as pairs.
      const int key_lo = wq * kWarpRows + (lane >> 2);
      const bool key_ok[2] = {sm.key_ok[g][key_lo] != 0, sm.key_ok[g][key_lo + 8] != 0};
#pragma unroll
      for (int jj = 0; jj < kTileQ / 16; ++jj) {
        uint32_t bias2[4];
        load_transposed(bias2, s_bias, LDT, jj * 16, wq * kWarpRows);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int j = 2 * jj + half;
          const int query = j * 8 + (lane & 3) * 2;
          const float2 lse2 = *reinterpret_cast<const float2*>(s_lse2 + g * kTileQ + query);
          const float2 delta = *reinterpret_cast<const float2*>(s_delta + g * kTileQ + query);
#pragma unroll
          for (int r = 0; r < 2; ++r) {  // key g, then g + 8
            const float2 bias = unpack2<T>(bias2[half * 2 + r]);
            // p = exp(s scale + bias - lse) = 2^((s scale + bias) log2e - lse log2e).
            const float p0 =
                key_ok[r] ? fast_exp2(fmaf(fmaf(st[j][2 * r], scale, bias.x), kLog2e, -lse2.x))
                          : 0.f;
            const float p1 =
                key_ok[r] ? fast_exp2(fmaf(fmaf(st[j][2 * r + 1], scale, bias.y), kLog2e, -lse2.y))
                          : 0.f;
            const float ds0 = p0 * (dpt[j][2 * r] - delta.x),
                        ds1 = p1 * (dpt[j][2 * r + 1] - delta.y);
            st[j][2 * r] = p0;
            st[j][2 * r + 1] = p1;
            dpt[j][2 * r] = ds0;
            dpt[j][2 * r + 1] = ds1;
            if constexpr (!Lean) {
              dbias[j][2 * r] += ds0;
              dbias[j][2 * r + 1] += ds1;
            }
          }
        }
      }
      if constexpr (Lean) {  // this slice's dS for the block's dbias sum (one slice per quad)
        float* tile = sm.dbias_buf + quad * kTileQ * Smem::LDB;
#pragma unroll
        for (int j = 0; j < kTileQ / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            tile[(j * 8 + (lane & 3) * 2 + (e & 1)) * Smem::LDB + key_lo + (e >> 1) * 8] =
                dpt[j][e];
      }
      // dv += p^T do, dk += ds^T q (scaled at the end). The packed ds^T fragments are also
      // exactly what stmatrix.trans needs to store ds as [query][key] for dq.
      T* sds = sm.ds[quad];
#pragma unroll
      for (int kk = 0; kk < kTileQ / 16; ++kk) {
        uint32_t pa[4], da[4];
        pa[0] = Mma<T>::pack(st[2 * kk][0], st[2 * kk][1]);
        pa[1] = Mma<T>::pack(st[2 * kk][2], st[2 * kk][3]);
        pa[2] = Mma<T>::pack(st[2 * kk + 1][0], st[2 * kk + 1][1]);
        pa[3] = Mma<T>::pack(st[2 * kk + 1][2], st[2 * kk + 1][3]);
        da[0] = Mma<T>::pack(dpt[2 * kk][0], dpt[2 * kk][1]);
        da[1] = Mma<T>::pack(dpt[2 * kk][2], dpt[2 * kk][3]);
        da[2] = Mma<T>::pack(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]);
        da[3] = Mma<T>::pack(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3]);
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
          uint32_t bf[2];
          load_b_kn(bf, sm.dout[g], LD, kk * 16, i * 8);
          Mma<T>::run(dv[gi][i], pa, bf);
          load_b_kn(bf, sm.q[g], LD, kk * 16, i * 8);
          Mma<T>::run(dk[gi][i], da, bf);
        }
        store_transposed(sds, LDT, kk * 16, wq * kWarpRows, da);
      }
      named_barrier(1 + quad, 128);
      float dq[D / 8][4];
#pragma unroll
      for (int i = 0; i < D / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kTileK / 16; ++kk) {
        uint32_t a[4];
        load_a(a, sds, LDT, wq * kWarpRows, kk * 16);
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
          uint32_t bf[2];
          load_b_kn(bf, sm.k[g], LD, kk * 16, i * 8);
          Mma<T>::run(dq[i], a, bf);
        }
      }
      if constexpr (Cluster) {  // dQ tile (scaled) into the quad's dS tile, read by the cluster
        named_barrier(1 + quad, 128);  // the quad's reads of dS are done
        float* sdq = reinterpret_cast<float*>(sds);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = wq * kWarpRows + (lane >> 2) + r * 8;
#pragma unroll
          for (int i = 0; i < D / 8; ++i)
            *reinterpret_cast<float2*>(sdq + row * Smem::LDQ + i * 8 + (lane & 3) * 2) =
                make_float2(dq[i][2 * r] * f.scale, dq[i][2 * r + 1] * f.scale);
        }
        continue;  // one slice per quad: sds is not rewritten before the next query tile
      }
      float* part =
          p.dq_partial +
          ((((int64_t(kt) * p.chunk + (n - n_begin)) * f.B + b) * f.H + h) * f.Sq + q0) * D;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = wq * kWarpRows + (lane >> 2) + r * 8;
        if (row >= qrows) continue;
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
          const int col = i * 8 + (lane & 3) * 2;
          *reinterpret_cast<float2*>(part + int64_t(row) * D + col) =
              make_float2(dq[i][2 * r] * f.scale, dq[i][2 * r + 1] * f.scale);
        }
      }
      named_barrier(1 + quad, 128);  // sds is rewritten by the next slice
    }

    if constexpr (Lean) {
      if constexpr (Cluster) cluster_arrive_release();  // this CTA's dQ tiles are written
      // dbias partial of this group: slice n_first's dS plus slice n_first + 1's, row by row.
      __syncthreads();
      float* part = p.dbias_partial + ((int64_t(group) * f.B + b) * f.H + h) * f.Sq * int64_t(f.Sk);
      const bool second = n_first + 1 < n_end;
      for (int i = threadIdx.x; i < kTileQ * kTileK; i += THREADS) {
        const int query = i / kTileK, key = i % kTileK;
        if (query < qrows && key < krows) {
          float v = sm.dbias_buf[query * Smem::LDB + key];
          if (second) v += sm.dbias_buf[(kTileQ + query) * Smem::LDB + key];
          part[int64_t(q0 + query) * f.Sk + k0 + key] = v;
        }
      }
      if constexpr (Cluster) {
        cluster_wait();  // every CTA's dQ tiles are written (acquire)
        cluster_dq_sum<T, D, Smem, THREADS>(p, sm, kt % p.dq_cluster, kt / p.dq_cluster, b, h,
                                            n_first, n_begin, n_end, q0, qrows);
        cluster_arrive_relaxed();  // done reading the others' tiles; waited for before sm.ds is rewritten
      }
      continue;
    }
    // dbias partial of this group: quad 0's sum plus quad 1's, in that order.
    if (quad == 1) {
#pragma unroll
      for (int j = 0; j < kTileQ / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) sm.dbias_buf[(wq * 32 + j * 4 + e) * 32 + lane] = dbias[j][e];
    }
    __syncthreads();
    if (quad == 0) {
      float* part = p.dbias_partial + ((int64_t(group) * f.B + b) * f.H + h) * f.Sq * int64_t(f.Sk);
#pragma unroll
      for (int j = 0; j < kTileQ / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = wq * kWarpRows + (lane >> 2) + (e >> 1) * 8;
          const int query = j * 8 + (lane & 3) * 2 + (e & 1);
          if (query < qrows && key < krows)
            part[int64_t(q0 + query) * f.Sk + k0 + key] =
                dbias[j][e] + sm.dbias_buf[(wq * 32 + j * 4 + e) * 32 + lane];
        }
    }
  }

  // dK (scaled) and dV of this quad's slices.
#pragma unroll
  for (int gi = 0; gi < GQ; ++gi) {
    const int n = n_first + quad * GQ + gi;
    if (n >= n_end) continue;
    T* dk_out =
        static_cast<T*>(p.dk) + b * p.dk_stride.b + int64_t(n) * p.dk_stride.n + h * p.dk_stride.h;
    T* dv_out =
        static_cast<T*>(p.dv) + b * p.dv_stride.b + int64_t(n) * p.dv_stride.n + h * p.dv_stride.h;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = wq * kWarpRows + (lane >> 2) + r * 8;
      if (key >= krows) continue;
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        const int col = i * 8 + (lane & 3) * 2;
        T* dkp = dk_out + int64_t(k0 + key) * p.dk_stride.s + col;
        T* dvp = dv_out + int64_t(k0 + key) * p.dv_stride.s + col;
        dkp[0] = from_float<T>(dk[gi][i][2 * r] * f.scale);
        dkp[1] = from_float<T>(dk[gi][i][2 * r + 1] * f.scale);
        dvp[0] = from_float<T>(dv[gi][i][2 * r]);
        dvp[1] = from_float<T>(dv[gi][i][2 * r + 1]);
      }
    }
  }
  // No CTA leaves while another may still read its shared memory.
  if constexpr (Cluster)
    if (query_tiles > 0) cluster_wait();
}

// dq[n] = sum over the `parts` partials (one per key tile, or per cluster), in order (slices
// [n_begin, n_end)).
template <typename T, int D>
__global__ void attention_dq_reduce_kernel(const AttentionBackwardParams p, int n_begin, int n_end,
                                           int parts) {
  const AttentionForwardParams& f = p.fwd;
  const int64_t rows = int64_t(n_end - n_begin) * f.B * f.H * f.Sq;
  const int64_t tile_stride = int64_t(p.chunk) * f.B * f.H * f.Sq * D;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < rows * (D / 4);
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = idx / (D / 4);
    const int c = int(idx % (D / 4)) * 4;
    const int s = int(row % f.Sq), h = int((row / f.Sq) % f.H),
              b = int((row / (int64_t(f.Sq) * f.H)) % f.B);
    const int nn = int(row / (int64_t(f.Sq) * f.H * f.B));
    const float* part = p.dq_partial + (((int64_t(nn) * f.B + b) * f.H + h) * f.Sq + s) * D + c;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int t = 0; t < parts; ++t) {
      const float4 x = *reinterpret_cast<const float4*>(part + t * tile_stride);
      acc.x += x.x;
      acc.y += x.y;
      acc.z += x.z;
      acc.w += x.w;
    }
    store4(static_cast<T*>(p.dq) + b * p.dq_stride.b + int64_t(n_begin + nn) * p.dq_stride.n +
               h * p.dq_stride.h + int64_t(s) * p.dq_stride.s + c,
           acc);
  }
}

// dbias += the chunk's group partials in group order; the last chunk writes the output dtype.
template <typename T>
__global__ void attention_dbias_reduce_kernel(const AttentionBackwardParams p, int groups,
                                              bool first_chunk, bool last_chunk) {
  const AttentionForwardParams& f = p.fwd;
  const int64_t plane = int64_t(f.Sq) * f.Sk, total = int64_t(f.B) * f.H * plane;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    float acc = first_chunk ? 0.f : p.dbias_acc[idx];
    for (int l = 0; l < groups; ++l) acc += p.dbias_partial[int64_t(l) * total + idx];
    if (!last_chunk) {
      p.dbias_acc[idx] = acc;
      continue;
    }
    const int k = int(idx % f.Sk), q = int((idx / f.Sk) % f.Sq), h = int((idx / plane) % f.H),
              b = int(idx / (plane * f.H));
    static_cast<T*>(
        p.dbias)[b * p.dbias_stride_b + h * p.dbias_stride_h + int64_t(q) * p.dbias_stride_q + k] =
        from_float<T>(acc);
  }
}

template <typename T, int D, bool Lean, bool Cluster = false>
void launch(const AttentionBackwardParams& p, cudaStream_t stream) {
  const AttentionForwardParams& f = p.fwd;
  using Tiles = BackwardTiles<D, Lean>;
  constexpr int G = Tiles::kSlices;
  launch_attention_delta<T, D>(p, stream);

  const size_t smem = sizeof(BackwardSmem<T, D, Lean>);
  auto kernel = attention_backward_kernel<T, D, Lean, Cluster>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (Lean)  // room for two blocks' shared memory per SM
    cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                         cudaSharedmemCarveoutMaxShared);
  if (Cluster && p.dq_cluster > 8)
    cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  const int key_tiles = (f.Sk + kTileK - 1) / kTileK;
  // Cluster dQ: key tiles padded to whole clusters, which lie along x; dQ partials (and their
  // reduce) only when a slice's key tiles need more than one cluster.
  const int grid_x = Cluster ? p.dq_cluster * p.dq_parts : key_tiles;
  const int dq_parts = Cluster ? (p.dq_parts > 1 ? p.dq_parts : 0) : key_tiles;
  for (int n_begin = 0; n_begin < f.N; n_begin += p.chunk) {
    const int n_end = min(f.N, n_begin + p.chunk);
    const int groups = (n_end - n_begin + G - 1) / G;
    const dim3 grid(grid_x, groups, f.B * f.H);
    if constexpr (Cluster) {
      cudaLaunchConfig_t config{};
      config.gridDim = grid;
      config.blockDim = dim3(Tiles::kWarps * 32);
      config.dynamicSmemBytes = smem;
      config.stream = stream;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = unsigned(p.dq_cluster);
      attr[0].val.clusterDim.y = 1;
      attr[0].val.clusterDim.z = 1;
      config.attrs = attr;
      config.numAttrs = 1;
      cudaLaunchKernelEx(&config, kernel, p, n_begin, n_end);
    } else {
      kernel<<<grid, Tiles::kWarps * 32, smem, stream>>>(p, n_begin, n_end);
    }
    const int64_t dq_work = int64_t(n_end - n_begin) * f.B * f.H * f.Sq * (D / 4);
    if (dq_parts > 0)
      attention_dq_reduce_kernel<T, D>
          <<<grid_for(dq_work, 256), 256, 0, stream>>>(p, n_begin, n_end, dq_parts);
    const int64_t dbias_work = int64_t(f.B) * f.H * f.Sq * f.Sk;
    attention_dbias_reduce_kernel<T>
        <<<grid_for(dbias_work, 256), 256, 0, stream>>>(p, groups, n_begin == 0, n_end == f.N);
  }
}

}  // namespace

template <typename T>
void attention_backward_launch(const AttentionBackwardParams& p, int head_dim,
                               cudaStream_t stream) {
  switch (head_dim) {
    case 16:
      if (p.dq_cluster > 0) return launch<T, 16, true, true>(p, stream);
      return backward_lean(16) ? launch<T, 16, true>(p, stream) : launch<T, 16, false>(p, stream);
    case 32:
      if (p.dq_cluster > 0) return launch<T, 32, true, true>(p, stream);
      return backward_lean(32) ? launch<T, 32, true>(p, stream) : launch<T, 32, false>(p, stream);
    case 64: return launch<T, 64, false>(p, stream);
  }
}

template void attention_backward_launch<__nv_bfloat16>(const AttentionBackwardParams&, int,
                                                       cudaStream_t);
template void attention_backward_launch<__half>(const AttentionBackwardParams&, int, cudaStream_t);

}  // namespace tpf::cuda
