// The backward's first step, shared by the attention backward kernels: delta = rowsum(dO * (O + r))
// in FP32, r the BF16 residual of O's rounding when kept ("output-residual compensation").
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/attention/params.h"
#include "kernels/common/mma.cuh"

namespace tpf::cuda {

// Query row r of the padded layout [B][N][H][sq_pad] (p.delta, p.lse2): its (b, n, h, s).
struct DeltaRow {
  int b, n, h, s;
};
__device__ __forceinline__ DeltaRow delta_row(const AttentionForwardParams& f, int64_t r,
                                              int sq_pad) {
  DeltaRow x;
  x.s = int(r % sq_pad);
  r /= sq_pad;
  x.h = int(r % f.H);
  r /= f.H;
  x.n = int(r % f.N);
  x.b = int(r / f.N);
  return x;
}

// delta and lse log2(e) of row r (rows past Sq: 0 and +inf, no probability).
__device__ __forceinline__ void store_delta(const AttentionBackwardParams& p, int64_t r,
                                            const DeltaRow& x, float delta) {
  const AttentionForwardParams& f = p.fwd;
  const bool real = x.s < f.Sq;
  p.delta[r] = real ? delta : 0.f;
  p.lse2[r] = real ? f.lse[x.b * f.lse_stride_b + int64_t(x.n) * f.lse_stride_n +
                           x.h * f.lse_stride_h + int64_t(x.s) * f.lse_stride_s] *
                         kLog2e
                   : INFINITY;
}

template <typename T, int D>
__global__ void attention_delta_kernel(const AttentionBackwardParams p, int sq_pad) {
  const AttentionForwardParams& f = p.fwd;
  const int64_t rows = int64_t(f.B) * f.N * f.H * sq_pad;
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < rows;
       r += int64_t(gridDim.x) * blockDim.x) {
    const DeltaRow x = delta_row(f, r, sq_pad);
    if (x.s >= f.Sq) {
      store_delta(p, r, x, 0.f);
      continue;
    }
    const int s = x.s, h = x.h, n = x.n, b = x.b;
    const T* o = static_cast<const T*>(f.o) + b * f.o_stride.b + n * f.o_stride.n +
                 h * f.o_stride.h + s * f.o_stride.s;
    const T* dout = static_cast<const T*>(p.dout) + b * p.dout_stride.b + n * p.dout_stride.n +
                    h * p.dout_stride.h + s * p.dout_stride.s;
    const __nv_bfloat16* res = f.residual ? static_cast<const __nv_bfloat16*>(f.residual) +
                                                b * f.residual_stride.b + n * f.residual_stride.n +
                                                h * f.residual_stride.h + s * f.residual_stride.s
                                          : nullptr;
    float acc = 0.f;
#pragma unroll
    for (int c = 0; c < D; ++c) {
      if (c >= p.head_dim) break;  // D: the built head dim, at least the tensors'
      const float oc = to_float(o[c]) + (res ? __bfloat162float(res[c]) : 0.f);
      acc = fmaf(to_float(dout[c]), oc, acc);
    }
    store_delta(p, r, x, acc);
  }
}

// The same delta with D / 8 threads per row, each loading 16 bytes of O, dO and the residual (rows
// 16-byte aligned): one thread per row read 2-byte elements D apart from its neighbours' and ran at
// a third of the bandwidth (0.45 ms at S = 768, D = 32, for ~0.45 GB). Lanes of a row are adjacent,
// their sums meet by shuffles in a fixed order.
template <typename T, int D>
__global__ void attention_delta_vec_kernel(const AttentionBackwardParams p, int sq_pad) {
  constexpr int L = D / 8;  // threads per row, a power of two dividing 32
  const AttentionForwardParams& f = p.fwd;
  const int64_t rows = int64_t(f.B) * f.N * f.H * sq_pad, total = rows * L;
  const int part = threadIdx.x % L;
  for (int64_t base = int64_t(blockIdx.x) * blockDim.x; base < total;
       base +=
       int64_t(gridDim.x) * blockDim.x) {  // uniform over the block: shuffles see every lane
    const int64_t idx = base + threadIdx.x, r = idx / L;
    float acc = 0.f;
    const DeltaRow x = delta_row(f, r, sq_pad);
    // Lanes past the tensors' D add nothing; rows past Sq read nothing.
    if (idx < total && part * 8 < p.head_dim && x.s < f.Sq) {
      const int s = x.s, h = x.h, n = x.n, b = x.b;
      const uint4 o = *reinterpret_cast<const uint4*>(
          static_cast<const T*>(f.o) + b * f.o_stride.b + n * f.o_stride.n + h * f.o_stride.h +
          s * f.o_stride.s + part * 8);
      const uint4 d = *reinterpret_cast<const uint4*>(
          static_cast<const T*>(p.dout) + b * p.dout_stride.b + n * p.dout_stride.n +
          h * p.dout_stride.h + s * p.dout_stride.s + part * 8);
      uint4 res = make_uint4(0u, 0u, 0u, 0u);
      if (f.residual)
        res = *reinterpret_cast<const uint4*>(
            static_cast<const __nv_bfloat16*>(f.residual) + b * f.residual_stride.b +
            n * f.residual_stride.n + h * f.residual_stride.h + s * f.residual_stride.s + part * 8);
      const uint32_t ow[4] = {o.x, o.y, o.z, o.w}, dw[4] = {d.x, d.y, d.z, d.w},
                     rw[4] = {res.x, res.y, res.z, res.w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const float2 oc = unpack2<T>(ow[w]), dc = unpack2<T>(dw[w]);
        const float2 rc = unpack2<__nv_bfloat16>(rw[w]);
        acc = fmaf(dc.x, oc.x + rc.x, acc);
        acc = fmaf(dc.y, oc.y + rc.y, acc);
      }
    }
#pragma unroll
    for (int off = L / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (idx < total && part == 0) store_delta(p, r, x, acc);
  }
}

inline int grid_for(int64_t work, int threads) {
  const int64_t blocks = (work + threads - 1) / threads;
  return int(blocks < 65535 * 8 ? (blocks > 0 ? blocks : 1) : 65535 * 8);
}

// delta and lse log2(e) for every query row of p (p.delta, p.lse2: [B][N][H][sq_pad]), on `stream`. D: the built head dim (backward_sm90.h), at
// least the tensors' p.head_dim.
template <typename T, int D>
void launch_attention_delta(const AttentionBackwardParams& p, int sq_pad, cudaStream_t stream) {
  const AttentionForwardParams& f = p.fwd;
  const int64_t rows = int64_t(f.B) * f.N * f.H * sq_pad;
  if (p.delta_vectorized)
    attention_delta_vec_kernel<T, D><<<grid_for(rows * (D / 8), 256), 256, 0, stream>>>(p, sq_pad);
  else
    attention_delta_kernel<T, D><<<grid_for(rows, 256), 256, 0, stream>>>(p, sq_pad);
}

}  // namespace tpf::cuda
