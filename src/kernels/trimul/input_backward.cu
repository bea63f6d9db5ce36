// Input-side backward: gates, mask, the input projections and LayerNorm_in, giving dx, and x_ln and
// dP | dG (for the cuBLAS weight gradients). Persistent CTAs as in output_backward.cu; each thread
// keeps running sums of one column over half of every tile's rows (d p_in_bias and d g_in_bias per
// input step, d norm_in_weight, d norm_in_bias), written as two partial rows per CTA.
//
//   X  [kRows, Dp]        x_ln (T)
//   W  [kChunkN, Dp]      one packed weight block (T), as in input_forward.cu
//   C  [kRows, kLdC]      P | G of the step (fp32), then dP | dG; finally dx_ln
//   G  [kRows, kChunkN+8] dP | dG of the step (T), then dgo: the A operand of dx_ln's GEMM
// dx_ln = dP Wp_in + dG Wg_in + dgo Wg_out accumulates in registers over the steps.
#include "kernels/trimul/device.cuh"
#include "kernels/trimul/launch.h"
#include "kernels/trimul/layer_norm.cuh"

namespace tpf::cuda::trimul {
namespace {

constexpr int kLdG = kChunkN + kPad;

template <typename T>
struct InputBackwardSmem {
  T* x;
  T* w;
  float* c;
  T* g;
  float* mask;
  float* mean;
  float* rstd;
  size_t bytes;
  __host__ __device__ InputBackwardSmem(unsigned char* base, int Dp) {
    SmemCarver s{base};
    x = s.take<T>(size_t(kRows) * (Dp + kPad));
    w = s.take<T>(size_t(kChunkN) * (Dp + kPad));
    c = s.take<float>(size_t(kRows) * kLdC);
    g = s.take<T>(size_t(kRows) * kLdG);
    mask = s.take<float>(kRows);
    mean = s.take<float>(kRows);
    rstd = s.take<float>(kRows);
    bytes = s.at;
  }
};

template <typename T>
__global__ void __launch_bounds__(kThreads, 2) input_backward_kernel(const Params p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  InputBackwardSmem<T> s(smem_raw, p.Dp);
  const int ld = p.Dp + kPad, D = int(p.D), lane = threadIdx.x % 32;
  // Column-pass role: slot `col` of kChunkN, rows [half * kRows / 2, (half + 1) * kRows / 2).
  const int col = threadIdx.x % kChunkN, half = threadIdx.x / kChunkN;
  const int r_begin = half * (kRows / 2), r_end = r_begin + kRows / 2;
  // Slot col of step q is column q * kChunkChannels + col % kChunkChannels of dP (col below
  // kChunkChannels) or of dG.
  const bool slot_is_g = col >= kChunkChannels;
  const int slot_channel = col % kChunkChannels;
  float sum_pg[kMaxInputChunks] = {};
  float sum_ln_w = 0.0f, sum_ln_b = 0.0f;

  const T* w_in = static_cast<const T*>(p.w_in);
  const T* x = static_cast<const T*>(p.x);
  const T* da = static_cast<const T*>(p.da);
  const T* db = static_cast<const T*>(p.db);
  const T* dgo = static_cast<const T*>(p.dgo);
  T* xln_out = static_cast<T*>(p.xln);
  T* dpg_out = static_cast<T*>(p.dpg);
  T* dx_out = static_cast<T*>(p.dx);

  for (int64_t t = blockIdx.x; t < p.tiles; t += gridDim.x) {
    const Tile tile(t, p);
    copy_tile_async(s.w, ld, w_in, p.Dp, kChunkN, p.Dp);
    normalize_input_rows(p, tile, s.x, ld, s.mask, s.mean, s.rstd);
    __syncthreads();
    for (int idx = threadIdx.x; idx < kRows * D; idx += kThreads) {
      const int r = idx / D, c = idx % D;
      if (r < tile.n) xln_out[(tile.row0 + r) * D + c] = s.x[r * ld + c];
    }

    WarpTile<T> dxln;
    dxln.zero();
#pragma unroll
    for (int q = 0; q < kMaxInputChunks; ++q) {
      if (q >= p.input_chunks) break;
      cp_async_wait_all();
      __syncthreads();
      {
        WarpTile<T> acc;
        acc.zero();
        acc.template mma<WLayout::kNK>(s.x, ld, s.w, ld, p.Dp, kChunkN);
        acc.store(s.c, kLdC, kChunkN);
      }
      __syncthreads();

      // dP = dab sg m, dG = dab P m sg (1 - sg) from channel-major dA | dB (consecutive j per
      // thread), in place in C (fp32) and into G (T).
      for (int idx = threadIdx.x; idx < kChunkChannels * kRows; idx += kThreads) {
        const int cl = idx / kRows, r = idx % kRows;
        const int c = q * kChunkChannels + cl;
        float dp = 0.0f, dg = 0.0f;
        if (c < 2 * D && r < tile.n) {
          const float pv = s.c[r * kLdC + cl] + p.bias_in[c];
          const float sg = sigmoid(s.c[r * kLdC + kChunkChannels + cl] + p.bias_in[2 * D + c]);
          const float dab = to_f((c < D ? da : db)[tile.channel_major(p, c < D ? c : c - D, r)]);
          dp = dab * sg * s.mask[r];
          dg = dab * pv * s.mask[r] * sg * (1.0f - sg);
        }
        s.c[r * kLdC + cl] = dp;
        s.c[r * kLdC + kChunkChannels + cl] = dg;
        s.g[r * kLdG + cl] = from_f<T>(dp);
        s.g[r * kLdG + kChunkChannels + cl] = from_f<T>(dg);
      }
      __syncthreads();

      // Bias sums and dP | dG to global (consecutive threads take consecutive channels).
      {
        const int c = q * kChunkChannels + slot_channel;
        if (c < 2 * D) {
          const int64_t gcol = (slot_is_g ? 2 * D : 0) + c;
          for (int r = r_begin; r < r_end && r < tile.n; ++r) {
            sum_pg[q] += s.c[r * kLdC + col];
            dpg_out[(tile.row0 + r) * 4 * D + gcol] = s.g[r * kLdG + col];
          }
        }
      }

      // dx_ln += dP Wp_in[chunk] + dG Wg_in[chunk].
      dxln.template mma<WLayout::kKN>(s.g, kLdG, s.w, ld, kChunkN, p.Dp);
      __syncthreads();
      copy_tile_async(s.w, ld, w_in + int64_t(q + 1) * kChunkN * p.Dp, p.Dp, kChunkN, p.Dp);
    }

    // dx_ln += dgo Wg_out (the last packed block).
    for (int idx = threadIdx.x; idx < kRows * p.Dp; idx += kThreads) {
      const int r = idx / p.Dp, c = idx % p.Dp;
      s.g[r * kLdG + c] = (r < tile.n && c < D) ? dgo[(tile.row0 + r) * D + c] : from_f<T>(0.0f);
    }
    cp_async_wait_all();
    __syncthreads();
    dxln.template mma<WLayout::kKN>(s.g, kLdG, s.w, ld, p.Dp, p.Dp);
    dxln.store(s.c, kLdC, p.Dp);
    __syncthreads();

    // d norm_in_weight += dx_ln * x_hat, d norm_in_bias += dx_ln (x re-read: row-major, coalesced).
    if (col < D) {
      for (int r = r_begin; r < r_end && r < tile.n; ++r) {
        const float dxl = s.c[r * kLdC + col];
        const float xhat = (to_f(x[(tile.row0 + r) * D + col]) - s.mean[r]) * s.rstd[r];
        sum_ln_w += dxl * xhat;
        sum_ln_b += dxl;
      }
    }

    // dx from dx_ln.
    for (int r = threadIdx.x / 32; r < tile.n; r += kWarps) {
      float dxl[kPerLane], xhat[kPerLane], dx[kPerLane];
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        const int c = lane + 32 * k;
        dxl[k] = c < D ? s.c[r * kLdC + c] : 0.0f;
        xhat[k] = c < D ? (to_f(x[(tile.row0 + r) * D + c]) - s.mean[r]) * s.rstd[r] : 0.0f;
      }
      layer_norm_backward_row(dxl, xhat, p.ln_in_w, D, s.rstd[r], dx);
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        const int c = lane + 32 * k;
        if (c < D) dx_out[(tile.row0 + r) * D + c] = from_f<T>(dx[k]);
      }
    }
    __syncthreads();
  }

  float* row = p.partials_in + (int64_t(blockIdx.x) * 2 + half) * 6 * D;
  if (col < D) {
    row[col] = sum_ln_w;
    row[D + col] = sum_ln_b;
  }
#pragma unroll
  for (int q = 0; q < kMaxInputChunks; ++q) {
    const int c = q * kChunkChannels + slot_channel;
    if (q < p.input_chunks && c < 2 * D) row[(slot_is_g ? 4 * D : 2 * D) + c] = sum_pg[q];
  }
}

}  // namespace

template <typename T>
void launch_input_backward(const Params& p, cudaStream_t stream) {
  const size_t smem = InputBackwardSmem<T>(nullptr, p.Dp).bytes;
  set_max_smem(input_backward_kernel<T>, smem);
  input_backward_kernel<T><<<p.grid_backward, kThreads, smem, stream>>>(p);
  check_launch("trimul input_backward");
}

TPF_TRIMUL_INSTANTIATE(launch_input_backward)

}  // namespace tpf::cuda::trimul
