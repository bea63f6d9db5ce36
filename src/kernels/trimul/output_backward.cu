// Output-side backward: the output gate, the output projection and LayerNorm_out, giving dz
// (channel-major, for the contraction's backward), dgo, and dpo and z_ln (for the cuBLAS weight
// gradients). Persistent CTAs walk tiles blockIdx.x, + gridDim.x, ...; every thread keeps running
// sums in fixed roles, written once per CTA and summed in a fixed order later (launch_reduce_sums):
//   column pass (thread = column, half of every tile's rows): d p_out_bias, d g_out_bias
//     -> two rows of partials_bias_out [2 grid, 2D] per CTA;
//   row pass (warp = rows w, w + kWarps, ...; lane = columns): d norm_out_weight
//     -> kWarps rows of partials_norm_out [kWarps grid, D] per CTA.
// d norm_out_bias needs no sum of its own: it is Wp_out^T d p_out_bias (see pack.cu).
//
//   Z  [kRows, Dp]     z of the tile (T), transposed; kept for z_hat
//   X  [kRows, Dp]     z_ln (T), then dpo (T)
//   W  [Dp, Dp]        p_out_weight (T), loaded once per CTA
//   C  [kRows, kLdC]   po (fp32), then dz_ln, then dz
#include "kernels/trimul/device.cuh"
#include "kernels/trimul/launch.h"
#include "kernels/trimul/layer_norm.cuh"

namespace tpf::cuda::trimul {
namespace {

template <typename T>
struct OutputBackwardSmem {
  T* z;
  T* x;
  T* w;
  float* c;
  float* mean;
  float* rstd;
  size_t bytes;
  __host__ __device__ OutputBackwardSmem(unsigned char* base, int Dp) {
    SmemCarver s{base};
    z = s.take<T>(size_t(kRows) * (Dp + kPad));
    x = s.take<T>(size_t(kRows) * (Dp + kPad));
    w = s.take<T>(size_t(Dp) * (Dp + kPad));
    c = s.take<float>(size_t(kRows) * kLdC);
    mean = s.take<float>(kRows);
    rstd = s.take<float>(kRows);
    bytes = s.at;
  }
};

template <typename T, bool kFast>
__global__ void __launch_bounds__(kThreads, 2) output_backward_kernel(const Params p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  OutputBackwardSmem<T> s(smem_raw, p.Dp);
  const int ld = p.Dp + kPad, D = int(p.D), lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  // Column-pass role: column `col`, rows [half * kRows / 2, (half + 1) * kRows / 2) of each tile.
  const int col = threadIdx.x % kChunkN, half = threadIdx.x / kChunkN;
  const int r_begin = half * (kRows / 2);
  constexpr int kHalfRows = kRows / 2, kBatch = 8;
  static_assert(kThreads == 2 * kChunkN && kHalfRows % kBatch == 0, "two halves of columns");
  float sum_bp = 0.0f, sum_bg = 0.0f;
  float sum_ln_w[kPerLane] = {};

  const T* go = static_cast<const T*>(p.go);
  const T* dy = static_cast<const T*>(p.dy);
  T* dpo_out = static_cast<T*>(p.dpo);
  T* dgo_out = static_cast<T*>(p.dgo);
  T* zln_out = static_cast<T*>(p.zln);
  T* dz_out = static_cast<T*>(p.dz);

  copy_tile_async(s.w, ld, static_cast<const T*>(p.w_out), p.Dp, p.Dp, p.Dp);

  for (int64_t t = blockIdx.x; t < p.tiles; t += gridDim.x) {
    const Tile tile(t, p);
    load_channel_major_tile(p, tile, static_cast<const T*>(p.z), s.z, ld);
    __syncthreads();

    // LayerNorm_out forward again: z_ln into X and to global (for d p_out_weight).
    normalize_output_rows(p, tile, s.z, s.x, ld, s.mean, s.rstd, zln_out);
    cp_async_wait_all();
    __syncthreads();

    // po = z_ln Wp_out^T.
    {
      WarpTileFor<T, kFast> acc;
      acc.zero();
      acc.template mma<WLayout::kNK>(s.x, ld, s.w, ld, p.Dp, p.Dp);
      acc.store(s.c, kLdC, p.Dp);
    }
    __syncthreads();

    // Output gate: dpo = dy * sg, dgo = dy * po * sg (1 - sg); dpo also into X for dz_ln. The go
    // and dy loads of kBatch rows are issued before the first is used.
    if (col < p.Dp) {
      const bool col_valid = col < D;
      const float bias = col_valid ? p.bias_out[col] : 0.0f;
#pragma unroll
      for (int b0 = 0; b0 < kHalfRows; b0 += kBatch) {
        float gv[kBatch], dv[kBatch];
#pragma unroll
        for (int k = 0; k < kBatch; ++k) {
          const int r = r_begin + b0 + k;
          const bool valid = col_valid && r < tile.n;
          const int64_t at = (tile.row0 + r) * D + col;
          gv[k] = valid ? to_f(go[at]) : 0.0f;
          dv[k] = valid ? to_f(dy[at]) : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < kBatch; ++k) {
          const int r = r_begin + b0 + k;
          float dpo = 0.0f;
          if (col_valid && r < tile.n) {
            const float po = s.c[r * kLdC + col] + bias;
            const float sg = sigmoid_t<T, kFast>(gv[k]);
            dpo = dv[k] * sg;
            const float dgo = dv[k] * po * sg * (1.0f - sg);
            sum_bp += dpo;
            sum_bg += dgo;
            dpo_out[(tile.row0 + r) * D + col] = from_f<T>(dpo);
            dgo_out[(tile.row0 + r) * p.ld_dpg + col] = from_f<T>(dgo);
          }
          s.x[r * ld + col] = from_f<T>(dpo);
        }
      }
    }
    __syncthreads();

    // dz_ln = dpo Wp_out.
    {
      WarpTileFor<T, kFast> acc;
      acc.zero();
      acc.template mma<WLayout::kKN>(s.x, ld, s.w, ld, p.Dp, p.Dp);
      acc.store(s.c, kLdC, p.Dp);
    }
    __syncthreads();

    // dz from dz_ln, in place in C; d norm_out_weight += dz_ln * z_hat on the way.
    for (int r = warp; r < tile.n; r += kWarps) {
      float dzl[kPerLane], zhat[kPerLane], dz[kPerLane];
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        const int c = lane + 32 * k;
        dzl[k] = c < D ? s.c[r * kLdC + c] : 0.0f;
        zhat[k] = c < D ? (to_f(s.z[r * ld + c]) - s.mean[r]) * s.rstd[r] : 0.0f;
        sum_ln_w[k] += dzl[k] * zhat[k];
      }
      layer_norm_backward_row(dzl, zhat, p.ln_out_w, D, s.rstd[r], dz);
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        const int c = lane + 32 * k;
        if (c < D) s.c[r * kLdC + c] = dz[k];
      }
    }
    __syncthreads();

    // dz channel-major: consecutive threads take consecutive j.
    {
      const int r = threadIdx.x % kRows, c0 = threadIdx.x / kRows;
      constexpr int kStep = kThreads / kRows;
#pragma unroll 8
      for (int k = 0; k < kTileElemsPerThread; ++k) {
        const int c = c0 + kStep * k;
        if (c < D && r < tile.n) dz_out[tile.channel_major(p, c, r)] = from_f<T>(s.c[r * kLdC + c]);
      }
    }
    __syncthreads();
  }

  if (col < D) {
    float* row = p.partials_bias_out + (int64_t(blockIdx.x) * 2 + half) * 2 * D;
    row[col] = sum_bp;
    row[D + col] = sum_bg;
  }
  float* norm_row = p.partials_norm_out + (int64_t(blockIdx.x) * kWarps + warp) * D;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int c = lane + 32 * k;
    if (c < D) norm_row[c] = sum_ln_w[k];
  }
}

}  // namespace

template <typename T>
void launch_output_backward(const Params& p, cudaStream_t stream) {
  const size_t smem = OutputBackwardSmem<T>(nullptr, p.Dp).bytes;
  const auto kernel = fast_variant() ? output_backward_kernel<T, kHasFast<T>>
                                     : output_backward_kernel<T, false>;
  set_max_smem(kernel, smem);
  kernel<<<p.grid_backward, kThreads, smem, stream>>>(p);
  check_launch("trimul output_backward");
}

TPF_TRIMUL_INSTANTIATE(launch_output_backward)

}  // namespace tpf::cuda::trimul
