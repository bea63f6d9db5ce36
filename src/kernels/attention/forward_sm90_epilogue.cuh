// Epilogue of the Hopper forward: one consumer warp's 16 rows of one slice, from registers to
// O (input dtype), its BF16 residual (when kept) and the lse (when kept); the layouts the backward
// reads (params.h, api.h).
#pragma once
#include <cuda_bf16.h>

#include <cmath>

#include "kernels/attention/forward_sm90_params.h"
#include "kernels/attention/forward_sm90_softmax.cuh"
#include "kernels/common/mma.cuh"

namespace tpf::cuda::fwd90 {

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

// o: the accumulator of P V; l_part: this thread's partial fp32 row sums of P (exp_sum_pack, in
// the scale of o), added over the quad here. m in acc units: lse = m |scale| + ln(l), natural log
// as before. A row with l = 0 (no finite score, or a fully masked slice) gets O = 0 and
// lse = +inf.
template <typename T, int DP, int kPvBlocks>
__device__ __forceinline__ void store_slice(const Params& p, int b, int n, int h, int row0,
                                            const float (&o)[kPvBlocks][4], const float (&m)[2],
                                            const float (&l_part)[2], int lane) {
  if (n >= p.fwd.N) return;  // the same n for the whole CTA: no lane of the warp goes on alone
  float l[2] = {l_part[0], l_part[1]};
  quad_row_sums(l);
  T* out =
      static_cast<T*>(p.fwd.o) + b * p.fwd.o_stride.b + n * p.fwd.o_stride.n + h * p.fwd.o_stride.h;
  __nv_bfloat16* res =
      p.fwd.residual ? static_cast<__nv_bfloat16*>(p.fwd.residual) + b * p.fwd.residual_stride.b +
                           n * p.fwd.residual_stride.n + h * p.fwd.residual_stride.h
                     : nullptr;
  const int col_pair = (lane & 3) * 2;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + (lane >> 2) + r * 8;
    if (row >= p.fwd.Sq) continue;
    const float sum = l[r];
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
    for (int i = 0; i < DP / 8; ++i) {
      const int col = i * 8 + col_pair;
      if (col >= p.D) break;  // D is a multiple of 8: both columns of the pair, or neither
      store_o_pair<T>(out + row * p.fwd.o_stride.s + col,
                      res ? res + row * p.fwd.residual_stride.s + col : nullptr, o[i][2 * r] * inv,
                      o[i][2 * r + 1] * inv);
    }
    if (p.fwd.lse && (lane & 3) == 0)
      p.fwd.lse[b * p.fwd.lse_stride_b + n * p.fwd.lse_stride_n + h * p.fwd.lse_stride_h +
                row * p.fwd.lse_stride_s] = sum > 0.f ? m[r] * p.scale_abs + logf(sum) : INFINITY;
  }
}

}  // namespace tpf::cuda::fwd90
