// Output-side backward: the output gate, the output projection and LayerNorm_out, giving dz
// (channel-major, for the contraction's backward), dgo, and dpo and z_ln (for the cuBLAS weight
// gradients). Persistent CTAs walk tiles blockIdx.x, + gridDim.x, ...; each thread keeps running
// sums of one column over half of every tile's rows (d norm_out_weight, d norm_out_bias,
// d p_out_bias, d g_out_bias), written as two partial rows per CTA and summed in order later.
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

template <typename T>
__global__ void __launch_bounds__(kThreads, 2) output_backward_kernel(const Params p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  OutputBackwardSmem<T> s(smem_raw, p.Dp);
  const int ld = p.Dp + kPad, D = int(p.D), lane = threadIdx.x % 32;
  // Column-pass role: column `col`, rows [half * kRows / 2, (half + 1) * kRows / 2) of each tile.
  const int col = threadIdx.x % kChunkN, half = threadIdx.x / kChunkN;
  const int r_begin = half * (kRows / 2), r_end = r_begin + kRows / 2;
  float sum_ln_w = 0.0f, sum_ln_b = 0.0f, sum_bp = 0.0f, sum_bg = 0.0f;

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
      WarpTile<T> acc;
      acc.zero();
      acc.template mma<WLayout::kNK>(s.x, ld, s.w, ld, p.Dp, p.Dp);
      acc.store(s.c, kLdC, p.Dp);
    }
    __syncthreads();

    // Output gate: dpo = dy * sg, dgo = dy * po * sg (1 - sg); dpo also into X for dz_ln.
    if (col < p.Dp) {
      for (int r = r_begin; r < r_end; ++r) {
        float dpo = 0.0f;
        if (col < D && r < tile.n) {
          const int64_t at = (tile.row0 + r) * D + col;
          const float po = s.c[r * kLdC + col] + p.bias_out[col];
          const float sg = sigmoid(to_f(go[at]));
          const float d = to_f(dy[at]);
          dpo = d * sg;
          const float dgo = d * po * sg * (1.0f - sg);
          sum_bp += dpo;
          sum_bg += dgo;
          dpo_out[at] = from_f<T>(dpo);
          dgo_out[at] = from_f<T>(dgo);
        }
        s.x[r * ld + col] = from_f<T>(dpo);
      }
    }
    __syncthreads();

    // dz_ln = dpo Wp_out.
    {
      WarpTile<T> acc;
      acc.zero();
      acc.template mma<WLayout::kKN>(s.x, ld, s.w, ld, p.Dp, p.Dp);
      acc.store(s.c, kLdC, p.Dp);
    }
    __syncthreads();

    // d norm_out_weight += dz_ln * z_hat, d norm_out_bias += dz_ln.
    if (col < D) {
      for (int r = r_begin; r < r_end && r < tile.n; ++r) {
        const float dzl = s.c[r * kLdC + col];
        sum_ln_w += dzl * (to_f(s.z[r * ld + col]) - s.mean[r]) * s.rstd[r];
        sum_ln_b += dzl;
      }
    }
    __syncthreads();

    // dz from dz_ln, in place in C.
    for (int r = threadIdx.x / 32; r < tile.n; r += kWarps) {
      float dzl[kPerLane], zhat[kPerLane], dz[kPerLane];
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        const int c = lane + 32 * k;
        dzl[k] = c < D ? s.c[r * kLdC + c] : 0.0f;
        zhat[k] = c < D ? (to_f(s.z[r * ld + c]) - s.mean[r]) * s.rstd[r] : 0.0f;
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
    for (int idx = threadIdx.x; idx < D * kRows; idx += kThreads) {
      const int c = idx / kRows, r = idx % kRows;
      if (r < tile.n) dz_out[tile.channel_major(p, c, r)] = from_f<T>(s.c[r * kLdC + c]);
    }
    __syncthreads();
  }

  if (col < D) {
    float* row = p.partials_out + (int64_t(blockIdx.x) * 2 + half) * 4 * D;
    row[col] = sum_ln_w;
    row[D + col] = sum_ln_b;
    row[2 * D + col] = sum_bp;
    row[3 * D + col] = sum_bg;
  }
}

}  // namespace

template <typename T>
void launch_output_backward(const Params& p, cudaStream_t stream) {
  const size_t smem = OutputBackwardSmem<T>(nullptr, p.Dp).bytes;
  set_max_smem(output_backward_kernel<T>, smem);
  output_backward_kernel<T><<<p.grid_backward, kThreads, smem, stream>>>(p);
  check_launch("trimul output_backward");
}

TPF_TRIMUL_INSTANTIATE(launch_output_backward)

}  // namespace tpf::cuda::trimul
