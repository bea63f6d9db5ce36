// Input-side backward: gates, mask, the input projections and LayerNorm_in, giving dx, and x_ln and
// dP | dG (for the cuBLAS weight gradients). This file: float32's kernel (GEMMs on the CUDA cores,
// IEEE sigmoid, 2 CTAs per SM, grid kBackwardCtas) and the launcher; 16-bit types run the two
// kernels of input_backward_split.cu. Persistent CTAs as in output_backward.cu, with the same two
// kinds of running sums:
//   column pass (thread = slot of a kChunkN step, half of every tile's rows): d p_in_bias and
//     d g_in_bias -> two rows of partials_bias_in [2 grid, 4D] per CTA;
//   row pass (warp = rows, lane = columns): d norm_in_weight -> kWarps rows of
//     partials_norm_in [kWarps grid, D] per CTA.
// d norm_in_bias needs no sum of its own: it is Wp_in^T d p_in_bias + Wg_in^T d g_in_bias +
// Wg_out^T d g_out_bias (see pack.cu).
//
//   X  [kRows, Dp]        x_ln
//   W  [kChunkN, Dp]      one packed weight block, as in input_forward.cu
//   C  [kRows, kLdC]      P | G of the step, then dP | dG; finally dx_ln
//   G  [kRows, kChunkN+8] dP | dG of the step, then dgo: the A operand of dx_ln's GEMM
// dx_ln = dP Wp_in + dG Wg_in + dgo Wg_out accumulates in registers over the steps.
#include "kernels/trimul/device.cuh"
#include "kernels/trimul/launch.h"
#include "kernels/trimul/layer_norm.cuh"

namespace tpf::cuda::trimul {
namespace {

constexpr int kLdG = kChunkN + kPad;

struct InputBackwardF32Smem {
  float* x;
  float* w;
  float* c;
  float* g;
  float* mask;
  float* mean;
  float* rstd;
  // The running sums of each thread (kMaxInputChunks bias slots, then kPerLane norm columns) at
  // sums[k * kThreads + thread]: in registers they push the kernel past 128 registers (spills).
  float* sums;
  size_t bytes;
  __host__ __device__ InputBackwardF32Smem(unsigned char* base, int Dp) {
    SmemCarver s{base};
    take_step_operands(s, Dp, x, w);
    c = s.take<float>(size_t(kRows) * kLdC);
    g = s.take<float>(size_t(kRows) * kLdG);
    mask = s.take<float>(kRows);
    mean = s.take<float>(kRows);
    rstd = s.take<float>(kRows);
    sums = s.take<float>(size_t(kMaxInputChunks + kPerLane) * kThreads);
    bytes = s.at;
  }
};

__global__ void __launch_bounds__(kThreads, kF32Ctas) input_backward_f32_kernel(const Params p) {
  using T = float;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  InputBackwardF32Smem s(smem_raw, p.Dp);
  const int ld = p.Dp + kPad, D = int(p.D), lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  // Column-pass role: slot `col` of kChunkN, rows [half * kRows / 2, (half + 1) * kRows / 2).
  const int col = threadIdx.x % kChunkN, half = threadIdx.x / kChunkN;
  const int r_begin = half * (kRows / 2), r_end = r_begin + kRows / 2;
  // Slot col of step q is column q * kChunkChannels + col % kChunkChannels of dP (col below
  // kChunkChannels) or of dG.
  const bool slot_is_g = col >= kChunkChannels;
  const int slot_channel = col % kChunkChannels;
  float* sum_pg = s.sums + threadIdx.x;                                 // [q * kThreads]
  float* sum_ln_w = s.sums + kMaxInputChunks * kThreads + threadIdx.x;  // [e * kThreads]
  for (int k = 0; k < kMaxInputChunks + kPerLane; ++k) s.sums[k * kThreads + threadIdx.x] = 0.0f;

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
    for (int r = warp; r < tile.n; r += kWarps)
      for (int c = lane; c < D; c += 32) xln_out[(tile.row0 + r) * D + c] = s.x[r * ld + c];

    WarpTileF32 dxln;
    dxln.zero();
    for (int q = 0; q < p.input_chunks; ++q) {
      cp_async_wait_all();
      __syncthreads();
      {
        WarpTileF32 acc;
        acc.zero();
        acc.template mma<WLayout::kNK>(s.x, ld, s.w, ld, p.Dp, kChunkN);
        acc.store(s.c, kLdC, kChunkN);
      }
      __syncthreads();

      // dP = dab sg m, dG = dab P m sg (1 - sg) from channel-major dA | dB, in place in C (fp32)
      // and into G (T). Thread t takes row t % kRows of channels t / kRows + (kThreads / kRows) k
      // (consecutive j per warp); all dA | dB loads first.
      {
        const int r = threadIdx.x % kRows, cl0 = threadIdx.x / kRows;
        constexpr int kStep = kThreads / kRows, kIters = kChunkChannels / kStep;
        // Half of the loads per batch: all at once spill, with dx_ln's accumulators live.
        constexpr int kBatch = kIters / 2;
        const float m = s.mask[r];
#pragma unroll
        for (int k0 = 0; k0 < kIters; k0 += kBatch) {
          float dab[kBatch];
#pragma unroll
          for (int k = 0; k < kBatch; ++k) {
            const int c = q * kChunkChannels + cl0 + kStep * (k0 + k);
            dab[k] = (c < 2 * D && r < tile.n)
                         ? to_f((c < D ? da : db)[tile.channel_major(p, c < D ? c : c - D, r)])
                         : 0.0f;
          }
#pragma unroll
          for (int k = 0; k < kBatch; ++k) {
            const int cl = cl0 + kStep * (k0 + k);
            const int c = q * kChunkChannels + cl;
            float dp = 0.0f, dg = 0.0f;
            if (c < 2 * D && r < tile.n) {
              const float pv = s.c[r * kLdC + cl] + p.bias_in[c];
              const float gv = s.c[r * kLdC + kChunkChannels + cl] + p.bias_in[2 * D + c];
              const float sg = sigmoid(gv);
              dp = dab[k] * sg * m;
              dg = dab[k] * pv * m * sg * (1.0f - sg);
            }
            s.c[r * kLdC + cl] = dp;
            s.c[r * kLdC + kChunkChannels + cl] = dg;
            s.g[r * kLdG + cl] = from_f<T>(dp);
            s.g[r * kLdG + kChunkChannels + cl] = from_f<T>(dg);
          }
        }
      }
      __syncthreads();

      // Bias sums and dP | dG to global (consecutive threads take consecutive channels).
      {
        const int c = q * kChunkChannels + slot_channel;
        if (c < 2 * D) {
          const int64_t gcol = (slot_is_g ? 2 * D : 0) + c;
          float sum = 0.0f;
          for (int r = r_begin; r < r_end && r < tile.n; ++r) {
            sum += s.c[r * kLdC + col];
            dpg_out[(tile.row0 + r) * p.ld_dpg + gcol] = s.g[r * kLdG + col];
          }
          sum_pg[q * kThreads] += sum;
        }
      }

      // dx_ln += dP Wp_in[chunk] + dG Wg_in[chunk].
      dxln.template mma<WLayout::kKN>(s.g, kLdG, s.w, ld, kChunkN, p.Dp);
      __syncthreads();
      copy_tile_async(s.w, ld, w_in + int64_t(q + 1) * kChunkN * p.Dp, p.Dp, kChunkN, p.Dp);
    }

    // dx_ln += dgo Wg_out (the last packed block). Warp w loads rows w, w + kWarps, ... (lane =
    // columns), kDgoBatch rows' loads before the first store (fewer would leave DRAM latency
    // exposed; more spill, with dx_ln's accumulators live).
    constexpr int kDgoBatch = kRowsPerWarp / 2;
#pragma unroll
    for (int k0 = 0; k0 < kRowsPerWarp; k0 += kDgoBatch) {
      T v[kDgoBatch][kPerLane];
#pragma unroll
      for (int k = 0; k < kDgoBatch; ++k) {
        const int r = warp + kWarps * (k0 + k);
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) {
          const int c = lane + 32 * e;
          v[k][e] = (r < tile.n && c < D) ? dgo[(tile.row0 + r) * p.ld_dpg + c] : from_f<T>(0.0f);
        }
      }
#pragma unroll
      for (int k = 0; k < kDgoBatch; ++k) {
        const int r = warp + kWarps * (k0 + k);
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) {
          const int c = lane + 32 * e;
          if (c < p.Dp) s.g[r * kLdG + c] = v[k][e];
        }
      }
    }
    cp_async_wait_all();
    __syncthreads();
    dxln.template mma<WLayout::kKN>(s.g, kLdG, s.w, ld, p.Dp, p.Dp);
    dxln.store(s.c, kLdC, p.Dp);
    __syncthreads();

    // dx from dx_ln (x re-read, kXBatch of the warp's rows before the first is used);
    // d norm_in_weight += dx_ln * x_hat on the way.
    constexpr int kXBatch = kRowsPerWarp / 2;
#pragma unroll
    for (int k0 = 0; k0 < kRowsPerWarp; k0 += kXBatch) {
      float xv[kXBatch][kPerLane];
      load_warp_rows(x, tile, D, k0, xv);
#pragma unroll
      for (int k = 0; k < kXBatch; ++k) {
        const int r = warp + kWarps * (k0 + k);
        if (r >= tile.n) break;
        float dxl[kPerLane], xhat[kPerLane], dx[kPerLane];
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) {
          const int c = lane + 32 * e;
          dxl[e] = c < D ? s.c[r * kLdC + c] : 0.0f;
          xhat[e] = c < D ? (xv[k][e] - s.mean[r]) * s.rstd[r] : 0.0f;
          sum_ln_w[e * kThreads] += dxl[e] * xhat[e];
        }
        layer_norm_backward_row(dxl, xhat, p.ln_in_w, D, s.rstd[r], dx);
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) {
          const int c = lane + 32 * e;
          if (c < D) dx_out[(tile.row0 + r) * D + c] = from_f<T>(dx[e]);
        }
      }
    }
    __syncthreads();
  }

  float* bias_row = p.partials_bias_in + (int64_t(blockIdx.x) * 2 + half) * 4 * D;
#pragma unroll
  for (int q = 0; q < kMaxInputChunks; ++q) {
    const int c = q * kChunkChannels + slot_channel;
    if (q < p.input_chunks && c < 2 * D)
      bias_row[(slot_is_g ? 2 * D : 0) + c] = sum_pg[q * kThreads];
  }
  float* norm_row = p.partials_norm_in + (int64_t(blockIdx.x) * kWarps + warp) * D;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    const int c = lane + 32 * e;
    if (c < D) norm_row[c] = sum_ln_w[e * kThreads];
  }
}

}  // namespace

template <typename T>
void launch_input_backward(const Params& p, cudaStream_t stream) {
  if constexpr (kIsF32<T>)
    launch_kernel(input_backward_f32_kernel, dim3(unsigned(p.grid_input_backward)),
                  InputBackwardF32Smem(nullptr, p.Dp).bytes, p, stream, "trimul input_backward");
  else
    launch_input_backward_split<T>(p, stream);
}

TPF_TRIMUL_INSTANTIATE(launch_input_backward)

}  // namespace tpf::cuda::trimul
