// The per-warp parts of the attention forward that do not depend on how the scores were computed:
// the online softmax of one 64-key tile and the final normalize-and-store of O, its residual and the
// lse. Shared by the mma.sync forward (forward.cu) and the wgmma forward (forward_wgmma.cu), whose
// score and output accumulators have the same per-warp layout: a warp owns 16 query rows, and each
// thread holds rows row0 + lane/4 (r = 0) and row0 + lane/4 + 8 (r = 1), with element pairs of
// adjacent columns (the C fragment of mma.sync m16n8k16, which is also wgmma's accumulator layout
// for the warp's 16 rows of an m64nN tile).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "kernels/attention/mma.cuh"
#include "kernels/attention/params.h"
#include "kernels/attention/tile_config.h"
#include "kernels/attention/tile_io.cuh"

namespace tpf::cuda {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// The inputs of slice (b, n, h) for the query tile starting at q0 (bias points at q0's row);
// `safe` is a readable address for copies that read nothing.
template <typename T>
struct SliceInputs {
  const T* q;
  const T* k;
  const T* v;
  const T* bias;
  const uint8_t* mask;  // nullptr: every key attends
  const T* safe;
};
template <typename T>
__device__ __forceinline__ SliceInputs<T> slice_inputs(const AttentionForwardParams& p, int b,
                                                       int n, int h, int q0) {
  SliceInputs<T> in;
  in.q = static_cast<const T*>(p.q) + b * p.q_stride.b + n * p.q_stride.n + h * p.q_stride.h;
  in.k = static_cast<const T*>(p.k) + b * p.k_stride.b + n * p.k_stride.n + h * p.k_stride.h;
  in.v = static_cast<const T*>(p.v) + b * p.v_stride.b + n * p.v_stride.n + h * p.v_stride.h;
  in.bias = static_cast<const T*>(p.bias) + b * p.bias_stride_b + h * p.bias_stride_h +
            q0 * p.bias_stride_q;
  in.mask = p.mask ? p.mask + b * p.mask_stride_b + n * p.mask_stride_n : nullptr;
  in.safe = static_cast<const T*>(p.q);
  return in;
}

// A block's query tile: queries q0 .. q0 + qrows - 1 (q0 = blockIdx.y * ROWS) of slice (b, n, h)
// (n = blockIdx.x, b and h from blockIdx.z), this thread's warp and lane, and the slice's inputs.
template <typename T>
struct ForwardTile {
  int n, q0, b, h, warp, lane, qrows;
  SliceInputs<T> in;
};
template <typename T, int ROWS>
__device__ __forceinline__ ForwardTile<T> forward_tile(const AttentionForwardParams& p) {
  ForwardTile<T> t;
  t.n = blockIdx.x;
  t.q0 = blockIdx.y * ROWS;
  t.b = blockIdx.z / p.H;
  t.h = blockIdx.z % p.H;
  t.warp = threadIdx.x >> 5;
  t.lane = threadIdx.x & 31;
  t.qrows = min(ROWS, p.Sq - t.q0);
  t.in = slice_inputs<T>(p, t.b, t.n, t.h, t.q0);
  return t;
}

// Starts the copies of key tile kt (the caller commits and waits): keys and values ([kTileK][D],
// padded rows, or the wgmma core-matrix layout with CORE), the bias tile of the ROWS queries
// ([ROWS][kTileK], padded rows, qrows of them valid) and the key flags (1 = attend; 0 for a masked
// key or one past Sk).
template <typename T, int D, int ROWS, int THREADS, bool CORE>
__device__ __forceinline__ void load_key_tile(T* k_dst, T* v_dst, T* bias_dst, uint8_t* key_ok,
                                              const SliceInputs<T>& in,
                                              const AttentionForwardParams& p, int kt, int qrows) {
  const int k0 = kt * kTileK, krows = min(kTileK, p.Sk - k0);
  load_tile<T, kTileK, D, THREADS, CORE>(k_dst, in.k + k0 * p.k_stride.s, p.k_stride.s, krows, D,
                                         p.qkv_aligned, in.safe);
  load_tile<T, kTileK, D, THREADS, CORE>(v_dst, in.v + k0 * p.v_stride.s, p.v_stride.s, krows, D,
                                         p.qkv_aligned, in.safe);
  load_tile<T, ROWS, kTileK, THREADS>(bias_dst, in.bias + k0, p.bias_stride_q, qrows, krows,
                                      p.bias_aligned, in.safe);
  for (int j = threadIdx.x; j < kTileK; j += THREADS)
    key_ok[j] = j < krows && (in.mask == nullptr || in.mask[k0 + j] != 0);
}

// load_key_tile into stage `stage` of a block's shared memory (members k, v, bias, key_ok).
template <typename T, int D, int ROWS, int THREADS, bool CORE, typename Smem>
__device__ __forceinline__ void load_key_stage(Smem& sm, int stage, const ForwardTile<T>& t,
                                               const AttentionForwardParams& p, int kt) {
  load_key_tile<T, D, ROWS, THREADS, CORE>(sm.k[stage], sm.v[stage], sm.bias[stage],
                                           sm.key_ok[stage], t.in, p, kt, t.qrows);
}

// Starts the copies of the query tile (padded rows; the caller commits and waits).
template <typename T, int D, int ROWS, int THREADS>
__device__ __forceinline__ void load_query_tile(T* q_dst, const ForwardTile<T>& t,
                                                const AttentionForwardParams& p) {
  load_tile<T, ROWS, D, THREADS>(q_dst, t.in.q + t.q0 * p.q_stride.s, p.q_stride.s, t.qrows, D,
                                 p.qkv_aligned, t.in.safe);
}

// One key tile of the online softmax for a warp's 16 rows. In: s = q k^T (unscaled); the bias tile
// in shared memory ([query][key], `ldb` elements per row, the warp's rows starting at row0) and the
// key flags (1 = attend) of the tile. Out: s = exp(x - m_new) with x = s * scale + bias (-inf for a
// masked key), m and l updated, and correction = exp(m_old - m_new) for the caller's O.
template <typename T>
__device__ __forceinline__ void softmax_tile(float (&s)[kTileK / 8][4], float (&m)[2],
                                             float (&l)[2], float (&correction)[2],
                                             const T* bias_tile, int ldb, int row0,
                                             const uint8_t* key_ok, float scale, int lane) {
  // Scale, bias, mask (log2 domain) and the running row maxima. Each thread's elements come in pairs
  // of adjacent keys: ldmatrix gives the bias pairs of two 8-key blocks at once (the A-fragment
  // layout), and one 16-bit load gives a pair's key flags.
  float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int jj = 0; jj < kTileK / 16; ++jj) {
    uint32_t bias2[4];
    load_a(bias2, bias_tile, ldb, row0, jj * 16);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int j = 2 * jj + half;
      const uint16_t ok = *reinterpret_cast<const uint16_t*>(&key_ok[j * 8 + (lane & 3) * 2]);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float2 bias = unpack2<T>(bias2[half * 2 + r]);
        const float x0 = (ok & 0xff) ? fmaf(s[j][2 * r], scale, bias.x) : -INFINITY;
        const float x1 = (ok >> 8) ? fmaf(s[j][2 * r + 1], scale, bias.y) : -INFINITY;
        s[j][2 * r] = x0;
        s[j][2 * r + 1] = x1;
        tile_max[r] = fmaxf(tile_max[r], fmaxf(x0, x1));
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
    const float m_new = fmaxf(m[r], tile_max[r]);
    const float m_use = m_new == -INFINITY ? 0.f : m_new;  // a row with no key yet stays zero
    const float m_log2 = m_use * kLog2e;
    correction[r] = fast_exp2(fmaf(m[r], kLog2e, -m_log2));
    m[r] = m_new;
    l[r] *= correction[r];
    // p = exp(s - m) = 2^(s log2e - m log2e), one FFMA and the SFU per score; kept in s.
#pragma unroll
    for (int j = 0; j < kTileK / 8; ++j) {
      s[j][2 * r] = fast_exp2(fmaf(s[j][2 * r], kLog2e, -m_log2));
      s[j][2 * r + 1] = fast_exp2(fmaf(s[j][2 * r + 1], kLog2e, -m_log2));
      l[r] += s[j][2 * r] + s[j][2 * r + 1];
    }
  }
}

// A warp's rows before the first key tile: O = 0, m = -inf, l = 0.
template <int D>
__device__ __forceinline__ void init_rows(float (&o)[D / 8][4], float (&m)[2], float (&l)[2]) {
  m[0] = m[1] = -INFINITY;
  l[0] = l[1] = 0.f;
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
}

// O *= correction, per row.
template <int D>
__device__ __forceinline__ void rescale_rows(float (&o)[D / 8][4], const float (&correction)[2]) {
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    o[i][0] *= correction[0];
    o[i][1] *= correction[0];
    o[i][2] *= correction[1];
    o[i][3] *= correction[1];
  }
}

// The probabilities of keys 16 kk .. 16 kk + 15 as an A fragment (mma.sync m16n8k16 and wgmma with
// A in registers use the same per-warp layout), rounded to the input dtype.
template <typename T>
__device__ __forceinline__ void pack_p(uint32_t (&pa)[4], const float (&s)[kTileK / 8][4], int kk) {
  pa[0] = Mma<T>::pack(s[2 * kk][0], s[2 * kk][1]);
  pa[1] = Mma<T>::pack(s[2 * kk][2], s[2 * kk][3]);
  pa[2] = Mma<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  pa[3] = Mma<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// The slice (b, n, h) of O and of the residual (nullptr when not requested).
template <typename T>
struct OutputSlice {
  T* o;
  __nv_bfloat16* residual;
};
template <typename T>
__device__ __forceinline__ OutputSlice<T> output_slice(const AttentionForwardParams& p, int b,
                                                       int n, int h) {
  T* out = static_cast<T*>(p.o) + b * p.o_stride.b + n * p.o_stride.n + h * p.o_stride.h;
  __nv_bfloat16* res = p.residual
                           ? static_cast<__nv_bfloat16*>(p.residual) + b * p.residual_stride.b +
                                 n * p.residual_stride.n + h * p.residual_stride.h
                           : nullptr;
  return {out, res};
}

// Two adjacent columns of a normalized output row: O in T, and the BF16 residual of that rounding
// when `res` is given.
template <typename T>
__device__ __forceinline__ void store_o_pair(T* dst, __nv_bfloat16* res, float x0, float x1) {
  const T y0 = from_float<T>(x0), y1 = from_float<T>(x1);
  dst[0] = y0;
  dst[1] = y1;
  if (res) {
    res[0] = __float2bfloat16_rn(x0 - to_float(y0));
    res[1] = __float2bfloat16_rn(x1 - to_float(y1));
  }
}

// Finish a warp's 16 rows (the first at query `row0` of the slice): row sums across the lanes of a
// row, normalize, write O (the input dtype), its BF16 residual when requested and the lse (natural
// log; +inf for a row with no key, whose O is zero).
template <typename T, int D>
__device__ __forceinline__ void store_rows(const AttentionForwardParams& p,
                                           OutputSlice<T> dst_slice, int b, int n, int h, int row0,
                                           const float (&o)[D / 8][4], const float (&m)[2],
                                           const float (&l)[2], int lane) {
  T* out = dst_slice.o;
  __nv_bfloat16* res = dst_slice.residual;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = l[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int row = row0 + (lane >> 2) + r * 8;
    if (row >= p.Sq) continue;
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      const int col = i * 8 + (lane & 3) * 2;
      store_o_pair<T>(out + row * p.o_stride.s + col,
                      res ? res + row * p.residual_stride.s + col : nullptr, o[i][2 * r] * inv,
                      o[i][2 * r + 1] * inv);
    }
    if ((lane & 3) == 0) {
      const float lse = sum > 0.f ? m[r] + log2f(sum) * kLn2 : INFINITY;
      p.lse[b * p.lse_stride_b + n * p.lse_stride_n + h * p.lse_stride_h + row * p.lse_stride_s] =
          lse;
    }
  }
}

}  // namespace tpf::cuda
