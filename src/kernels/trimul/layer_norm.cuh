// LayerNorm pieces shared by the kernels: x_ln and z_ln of a tile (forward and backward kernels)
// and the backward of one row held by a warp.
#pragma once
#include "kernels/trimul/device.cuh"

namespace tpf::cuda::trimul {

// Mask element i (p.mask non-null) in its own dtype (p.mask_type), rounded to T as PyTorch's cast
// of the mask to x's dtype would round it (exact for bool, uint8 and a mask of x's dtype).
template <typename T>
__device__ __forceinline__ float mask_value(const Params& p, int64_t i) {
  float v;
  switch (p.mask_type) {
    case kMaskByte: v = float(static_cast<const uint8_t*>(p.mask)[i]); break;
    case kMaskF32: v = static_cast<const float*>(p.mask)[i]; break;
    case kMaskF16: v = __half2float(static_cast<const __half*>(p.mask)[i]); break;
    default: v = __bfloat162float(static_cast<const __nv_bfloat16*>(p.mask)[i]); break;
  }
  return to_f(from_f<T>(v));
}

// x_ln of the tile's rows into X (zeros past the tile and past D); mask values per row. Warp w
// takes rows w, w + kWarps, ...; it loads all of its rows (and their mask values) before it
// reduces the first one. kD: static D (Dims), or 0.
template <int kD = 0, typename T>
__device__ inline void normalize_input_rows(const Params& p, const Tile& tile, T* X, int ldx,
                                            float* mask, float* mean_out, float* rstd_out) {
  const T* x = static_cast<const T*>(p.x);
  const bool masked = p.mask != nullptr;
  const int D = Dims<kD>::D(p), Dp = Dims<kD>::Dp(p), lane = threadIdx.x % 32,
            warp = threadIdx.x / 32;
  constexpr int kLanes = kLanesOf<kD>;
  float v[kRowsPerWarp][kPerLane];
  float mv[kRowsPerWarp];
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int r = warp + kWarps * k;
    const T* row = x + (tile.row0 + r) * D + lane;
#pragma unroll
    for (int t = 0; t < kPerLane; ++t)
      v[k][t] = (r < tile.n && lane_in_d<kD>(lane, t, D)) ? to_f(row[32 * t]) : 0.0f;
    mv[k] = (masked && r < tile.n) ? mask_value<T>(p, tile.row0 + r) : 1.0f;
  }
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int r = warp + kWarps * k;
    const RowStats st = row_stats<kD>(v[k], D, p.eps);
#pragma unroll
    for (int t = 0; t < kLanes; ++t) {
      const int c = lane + 32 * t;
      if (kD > 0 || c < Dp) {
        const bool valid = r < tile.n && lane_in_d<kD>(lane, t, D);
        X[r * ldx + c] =
            from_f<T>(valid ? (v[k][t] - st.mean) * st.rstd * p.ln_in_w[c] + p.ln_in_b[c] : 0.0f);
      }
    }
    if (lane == 0) {
      mask[r] = mv[k];
      if (mean_out) {
        mean_out[r] = st.mean;
        rstd_out[r] = st.rstd;
      }
    }
  }
}

// z_ln of the tile's rows from Z (the tile of z in T, [kRows][ld]) into X (zeros past the tile and
// past D); mean and 1/sigma per row, and z_ln to global (row-major), where given. kD: static D
// (Dims), or 0.
template <int kD = 0, typename T>
__device__ inline void normalize_output_rows(const Params& p, const Tile& tile, const T* Z, T* X,
                                             int ld, float* mean_out, float* rstd_out, T* zln_out) {
  const int D = Dims<kD>::D(p), Dp = Dims<kD>::Dp(p), lane = threadIdx.x % 32;
  constexpr int kLanes = kLanesOf<kD>;
  for (int r = threadIdx.x / 32; r < kRows; r += kWarps) {
    float v[kPerLane];
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int c = lane + 32 * k;
      v[k] = lane_in_d<kD>(lane, k, D) ? to_f(Z[r * ld + c]) : 0.0f;
    }
    const RowStats st = row_stats<kD>(v, D, p.eps);
#pragma unroll
    for (int k = 0; k < kLanes; ++k) {
      const int c = lane + 32 * k;
      if (kD == 0 && c >= Dp) continue;
      const bool valid = lane_in_d<kD>(lane, k, D) && r < tile.n;
      const T zl =
          from_f<T>(valid ? (v[k] - st.mean) * st.rstd * p.ln_out_w[c] + p.ln_out_b[c] : 0.0f);
      X[r * ld + c] = zl;
      if (valid && zln_out) zln_out[(tile.row0 + r) * D + c] = zl;
    }
    if (lane == 0 && mean_out) {
      mean_out[r] = st.mean;
      rstd_out[r] = st.rstd;
    }
  }
}

// Rows warp + kWarps (k0 + k), k < N, of the tile of a row-major [positions, D] tensor, as floats
// held by the warp (lane l, element l + 32 e; zeros past the tile and past D): all loads first.
template <int kD = 0, int N, typename T>
__device__ __forceinline__ void load_warp_rows(const T* src, const Tile& tile, int D, int k0,
                                               float (&v)[N][kPerLane]) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const int r = warp + kWarps * (k0 + k);
    const T* row = src + (tile.row0 + r) * D + lane;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e)
      v[k][e] = (r < tile.n && lane_in_d<kD>(lane, e, D)) ? to_f(row[32 * e]) : 0.0f;
  }
}

// The backward of y = xhat * w + b for one row held by a warp (lane l, element l + 32 t):
// dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = dy * w. kD: static D (Dims; then dx[t] is
// computed for t < kD / 32 only; g through product<kD>), or 0.
template <int kD = 0>
__device__ __forceinline__ void layer_norm_backward_row(const float (&dy)[kPerLane],
                                                        const float (&xhat)[kPerLane],
                                                        const float* w, int D, float rstd,
                                                        float (&dx)[kPerLane]) {
  const int lane = threadIdx.x % 32;
  constexpr int kLanes = kLanesOf<kD>;
  float g[kPerLane], s1 = 0.0f, s2 = 0.0f;
#pragma unroll
  for (int t = 0; t < kLanes; ++t) {
    g[t] = lane_in_d<kD>(lane, t, D) ? product<kD>(dy[t], w[lane + 32 * t]) : 0.0f;
    s1 += g[t];
    s2 += g[t] * xhat[t];
  }
  s1 = divide_by_d<kD>(warp_sum(s1), D);
  s2 = divide_by_d<kD>(warp_sum(s2), D);
#pragma unroll
  for (int t = 0; t < kLanes; ++t) dx[t] = rstd * (g[t] - s1 - xhat[t] * s2);
}

}  // namespace tpf::cuda::trimul
