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

// Query row s of slice bnh = (b N + n) H + h of the padded layout [B][N][H][sq_pad] (p.delta,
// p.lse2): its (b, n, h, s) and its index there. The kernels below run a grid of (slices, row
// blocks) and find the row from the block's slice by 32-bit divisions. (This replaced three 64-bit
// divisions per thread of a flat index; the time did not change, 0.164 -> 0.163 ms at D = 32,
// S = 768 on an H100: the kernel is bound by memory bandwidth.)
struct DeltaRow {
  int b, n, h, s;
  int64_t r;
};
__device__ __forceinline__ DeltaRow delta_row(const AttentionForwardParams& f, int bnh, int s,
                                              int sq_pad) {
  DeltaRow x;
  x.s = s;
  x.h = bnh % f.H;
  x.n = bnh / f.H % f.N;
  x.b = bnh / f.H / f.N;
  x.r = int64_t(bnh) * sq_pad + s;
  return x;
}

// delta and lse log2(e) of row x (rows past Sq: 0 and +inf, no probability).
__device__ __forceinline__ void store_delta(const AttentionBackwardParams& p, const DeltaRow& x,
                                            float delta) {
  const AttentionForwardParams& f = p.fwd;
  const bool real = x.s < f.Sq;
  p.delta[x.r] = real ? delta : 0.f;
  p.lse2[x.r] = real ? f.lse[x.b * f.lse_stride_b + int64_t(x.n) * f.lse_stride_n +
                             x.h * f.lse_stride_h + int64_t(x.s) * f.lse_stride_s] *
                           kLog2e
                     : INFINITY;
}

// One thread per row: grid (slices B N H, row blocks of sq_pad).
template <typename T, int D>
__global__ void attention_delta_kernel(const AttentionBackwardParams p, int sq_pad) {
  const AttentionForwardParams& f = p.fwd;
  const int row = blockIdx.y * blockDim.x + threadIdx.x;
  if (row >= sq_pad) return;
  const DeltaRow x = delta_row(f, blockIdx.x, row, sq_pad);
  if (x.s >= f.Sq) {
    store_delta(p, x, 0.f);
    return;
  }
  const int s = x.s, h = x.h, n = x.n, b = x.b;
  const T* o = static_cast<const T*>(f.o) + b * f.o_stride.b + n * f.o_stride.n + h * f.o_stride.h +
               s * f.o_stride.s;
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
  store_delta(p, x, acc);
}

// The same delta with D / 8 threads per row, each loading 16 bytes of O, dO and the residual (rows
// 16-byte aligned): one thread per row read 2-byte elements D apart from its neighbours' and ran at
// a third of the bandwidth (0.45 ms at S = 768, D = 32, for ~0.45 GB). Lanes of a row are adjacent,
// their sums meet by shuffles in a fixed order.
template <typename T, int D>
__global__ void attention_delta_vec_kernel(const AttentionBackwardParams p, int sq_pad) {
  constexpr int L = D / 8;  // threads per row, a power of two dividing 32
  const AttentionForwardParams& f = p.fwd;
  const int part = threadIdx.x % L, row = (blockIdx.y * blockDim.x + threadIdx.x) / L;
  // Every lane of a warp runs the shuffles below: rows past sq_pad read and store nothing.
  float acc = 0.f;
  const DeltaRow x = delta_row(f, blockIdx.x, row, sq_pad);
  // Lanes past the tensors' D add nothing; rows past Sq read nothing.
  if (row < sq_pad && part * 8 < p.head_dim && x.s < f.Sq) {
    const int s = x.s, h = x.h, n = x.n, b = x.b;
    const uint4 o = *reinterpret_cast<const uint4*>(static_cast<const T*>(f.o) + b * f.o_stride.b +
                                                    n * f.o_stride.n + h * f.o_stride.h +
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
  if (row < sq_pad && part == 0) store_delta(p, x, acc);
}

// delta and lse log2(e) for every query row of p (p.delta, p.lse2: [B][N][H][sq_pad]), on `stream`. D: the built head dim (backward_sm90.h), at
// least the tensors' p.head_dim.
template <typename T, int D>
void launch_attention_delta(const AttentionBackwardParams& p, int sq_pad, cudaStream_t stream) {
  const AttentionForwardParams& f = p.fwd;
  const unsigned slices = unsigned(f.B) * f.N * f.H;  // within the grid's 2^31 - 1 (src/ops)
  constexpr int kThreads = 256;
  if (p.delta_vectorized) {
    const dim3 grid(slices, (sq_pad * (D / 8) + kThreads - 1) / kThreads);
    attention_delta_vec_kernel<T, D><<<grid, kThreads, 0, stream>>>(p, sq_pad);
  } else {
    const dim3 grid(slices, (sq_pad + kThreads - 1) / kThreads);
    attention_delta_kernel<T, D><<<grid, kThreads, 0, stream>>>(p, sq_pad);
  }
}

}  // namespace tpf::cuda
