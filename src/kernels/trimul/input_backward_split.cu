// The input-side backward of 16-bit types: the work of input_backward.cu's (float32) kernel in two
// persistent kernels that each fit 3 CTAs per SM (at most 80 registers, at most 75 KB of shared
// memory; bench/notes-trimul.md), with grid_input_backward = kSplitBackwardCtas CTAs
// and the partial-sum layouts of input_backward.cu:
//   gates kernel: x_ln, the P | G GEMM of each a/b step, dP | dG (to dpg) and the d p_in_bias |
//     d g_in_bias sums -> partials_bias_in [2 grid, 4D] (row half h: rows [32 h, 32 h + 32) of
//     every tile, as in input_backward.cu; summed per warp by shuffles instead of row by row);
//   dx kernel: dx_ln = [dP | dG | dgo] W_in over dpg (what input_backward.cu accumulates in
//     registers beside each step, here one K = 5D GEMM in stages of 64, in the same k order),
//     the LayerNorm backward, dx and the d norm_in_weight sums -> partials_norm_in
//     [kWarps grid, D] (same roles and order as input_backward.cu).
// The split costs one more pass over dP | dG | dgo (5 U of reads) and keeps dx_ln's 32
// accumulators out of the step loop.
//
// Gates kernel, shared memory:
//   X    [kRows, Dp]                  x_ln (T)
//   W    [kChunkN, Dp]                one a/b block of w_in (T), rows interleaved (InterleavePG):
//                                     a warp's P and G of the same channels, for the epilogue
//                                     from the MMA registers
//   Dab  [kChunkChannels, kRows + 8]  dA | dB of the step's channels (T, channel-major like
//                                     their global layout), copied during the previous epilogue
//   sums [kMaxInputChunks, kThreads]  the CTA's bias sums, slot (q, thread) as in input_backward.cu
// Dx kernel, shared memory: two stages of (A [kRows, 64 + 8] columns of dpg, W [64, Dp] rows of
// w_in); dx_ln (fp32 [kRows, kLdC]) over the second stage and past it, so that the next tile's
// first stage loads during the LayerNorm backward.
//
// Hopper kernels (16-bit types, D = 64 and 128; below, their layouts and tile orders in
// input_backward_sm90.h): input_backward_gates_sm90_kernel (S a multiple of 8) from TMA, wgmma and
// warp specialization in input_forward_sm90_kernel's design, input_backward_dx_sm90_kernel from
// cp.async and wgmma; the same outputs and partial-sum layouts as the kernels above.
#include <algorithm>

#include "kernels/common/tile_io.cuh"
#include "kernels/trimul/device.cuh"
#include "kernels/trimul/input_backward_sm90.h"
#include "kernels/trimul/launch.h"
#include "kernels/trimul/layer_norm.cuh"
#include "kernels/trimul/sm90.cuh"

namespace tpf::cuda::trimul {
namespace {

constexpr int kLdDab = kRows + kPad;
constexpr int kStageK = kChunkChannels;  // k per stage of the dx GEMM: half an a/b block
constexpr int kLdA = kStageK + kPad;
static_assert(kLdA == kStageK + tpf::cuda::kPad, "load_tile's row stride");

template <typename T>
struct GatesSmem {
  T* x;
  T* w;
  T* dab;
  // [2][kChunkN]: the step's kChunkN biases (P half, then G half), by step parity (one pointer
  // and an offset: an array of two pointers indexed by q % 2 would live in local memory)
  float* bias;
  float* mask;
  float* sums;
  size_t bytes;
  __host__ __device__ GatesSmem(unsigned char* base, int Dp) {
    SmemCarver s{base};
    take_step_operands(s, Dp, x, w);
    dab = s.take<T>(size_t(kChunkChannels) * kLdDab);
    bias = s.take<float>(2 * kChunkN);
    mask = s.take<float>(kRows);
    sums = s.take<float>(size_t(kMaxInputChunks) * kThreads);
    bytes = s.at;
  }
};

// Starts copying dA | dB of channels q * kChunkChannels + [0, kChunkChannels) of the tile into
// Dab (channel cl at row cl). 16-byte copies where S is a multiple of 8 (every piece of 8 rows is
// then aligned and wholly inside or outside the tile); otherwise plain loads (odd shapes). Rows
// past the tile and channels past 2D are left as they are: the epilogue does not use them.
// Static D (kD > 0): a step's channels are all in dA or all in dB, from one pointer stepped by the
// channel stride.
template <int kD, typename T>
__device__ __forceinline__ void load_dab(const Params& p, const Tile& tile, int q, T* dst) {
  using Dm = Dims<kD>;
  const T* da = static_cast<const T*>(p.da);
  const T* db = static_cast<const T*>(p.db);
  const int D = Dm::D(p);
  if (p.S % 8 == 0) {
    constexpr int kPieces = kRows / 8;
    const T* src = nullptr;
    int64_t plane = 0;
    if constexpr (Dm::kStatic) {
      const int c0 = q * kChunkChannels;
      plane = p.S * p.S;
      src = (c0 < D ? da + c0 * plane : db + (c0 - D) * plane) + tile.channel_major(p, D, 0, 0);
    }
#pragma unroll
    for (int k = 0; k < kChunkChannels * kPieces / kThreads; ++k) {
      const unsigned idx = thread_index_here() + k * kThreads;
      const int cl = int(idx / kPieces), r = int(idx % kPieces) * 8, c = q * kChunkChannels + cl;
      if constexpr (Dm::kStatic) {
        if (r < tile.n) cp_async16(dst + cl * kLdDab + r, src + (cl * plane + r));
      } else if (c < 2 * D && r < tile.n) {
        cp_async16(dst + cl * kLdDab + r,
                   (c < D ? da : db) + tile.channel_major(p, c < D ? c : c - D, r));
      }
    }
  } else {
    // Registers are short here (the epilogue's are live): four loads in flight at a time.
#pragma unroll 4
    for (int idx = threadIdx.x; idx < kChunkChannels * kRows; idx += kThreads) {
      const int cl = idx / kRows, r = idx % kRows, c = q * kChunkChannels + cl;
      if (Dm::ab_channel(c, D) && r < tile.n) {
        const int cc = c < D ? c : c - D;
        dst[cl * kLdDab + r] = (c < D ? da : db)[Dm::kStatic ? tile.channel_major(p, D, cc, r)
                                                             : tile.channel_major(p, cc, r)];
      }
    }
  }
  cp_async_commit();
}

// Step q's copies: the a/b block q of w_in (rows interleaved), its biases (zeros past 2D) and
// dA | dB of its channels.
template <int kD, typename T>
__device__ __forceinline__ void load_gates_step(const Params& p, const Tile& tile, int q,
                                                const GatesSmem<T>& s) {
  using Dm = Dims<kD>;
  const int D = Dm::D(p), Dp = Dm::Dp(p);
  const int tid = int(thread_index_here() % kThreads);  // (the % tells the compiler tid >= 0)
  if (tid < kChunkN) {
    const int c = q * kChunkChannels + tid % kChunkChannels;
    const bool valid = Dm::ab_channel(c, D);
    cp_async4(s.bias + (q % 2) * kChunkN + tid,
              valid ? p.bias_in + (tid < kChunkChannels ? 0 : 2 * D) + c : p.bias_in, valid);
  }
  copy_weight_async<kD, kChunkN>(s.w, static_cast<const T*>(p.w_in) + int64_t(q) * kChunkN * Dp, Dp,
                                 kChunkN, InterleavePG{});
  load_dab<kD>(p, tile, q, s.dab);
}

// kD: static D (64 or 128; Dims), or 0 for D from Params.
template <typename T, int kD>
__global__ void __launch_bounds__(kThreads, k16BitCtas)
    input_backward_gates_kernel(const Params p) {
  using Acc = WarpTileLdsm<T>;
  using Dm = Dims<kD>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const int D = Dm::D(p), Dp = Dm::Dp(p), ld = Dm::ld(p), chunks = Dm::chunks(p);
  GatesSmem<T> s(smem_raw, Dp);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  T* xln_out = static_cast<T*>(p.xln);
  T* dpg_out = static_cast<T*>(p.dpg);
  // The thread's elements acc[i][j][h][e]: rows Acc::row(i, e), channel (of the step)
  // cl_base + 8 h + e % 2, P for j = 0 and G for j = 1 (InterleavePG).
  const int cl_base = (threadIdx.x / 32 >> 1) * 16 + 2 * (threadIdx.x & 3);
  // Row half of the warp (rows [32 half, 32 half + 32) of the tile) and its bias-sum slots:
  // sums[q * kThreads + half * kChunkN + col], col = channel (dP) or kChunkChannels + channel (dG).
  const int half = threadIdx.x / 32 & 1;
  const bool sum_lane = threadIdx.x % 32 < 4;  // lanes of row g = 0 hold the warp's column sums
  for (int k = 0; k < kMaxInputChunks; ++k) s.sums[k * kThreads + threadIdx.x] = 0.0f;

  load_gates_step<kD>(p, persistent_tile<Dm::kStatic>(blockIdx.x, p), 0, s);
  for (int64_t t = blockIdx.x; t < p.tiles; t += gridDim.x) {
    const Tile tile = persistent_tile<Dm::kStatic>(t, p);
    normalize_input_rows<kD>(p, tile, s.x, ld, s.mask, nullptr, nullptr);
    // x_ln to global: each warp its own rows (those it normalized), outside the step loop.
    __syncwarp();
    if constexpr (Dm::kStatic) {
      for (int r = warp; r < tile.n; r += kWarps) {
        T* row = xln_out + (tile.row0 + r) * D + lane;
#pragma unroll
        for (int e = 0; e < kD / 32; ++e) row[32 * e] = s.x[r * ld + lane + 32 * e];
      }
    } else {
      for (int r = warp; r < tile.n; r += kWarps)
        for (int c = lane; c < D; c += 32) xln_out[(tile.row0 + r) * D + c] = s.x[r * ld + c];
    }
#pragma unroll 1
    for (int q = 0; q < chunks; ++q) {
      Acc acc;
      wait_and_multiply(acc, s.x, s.w, ld, Dp, kChunkN);
      // The epilogue's shared-memory inputs to registers; then W, Dab, X and the mask are free
      // for the next step's (or tile's) copies, which run during the epilogue.
      // dA | dB by ldmatrix.trans in the C fragment's layout: dab[i][2 h + e / 2] holds the pair
      // of channels cl_base + 8 h + (0, 1) at row Acc::row(i, e).
      uint32_t dab[2][4];
      float m[2][2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        load_transposed(dab[i], s.dab, kLdDab, cl_base - 2 * (threadIdx.x & 3),
                        Acc::row(i, 0) - threadIdx.x % 32 / 4);
#pragma unroll
        for (int e = 0; e < 2; ++e) m[i][e] = s.mask[Acc::row(i, 2 * e)];
      }
      __syncthreads();
      if (q + 1 < chunks)
        load_gates_step<kD>(p, tile, q + 1, s);
      else if (t + gridDim.x < p.tiles)
        load_gates_step<kD>(p, persistent_tile<Dm::kStatic>(t + gridDim.x, p), 0, s);

      // dP = dab sg m, dG = dab P m sg (1 - sg) (input_backward.cu's expressions) in place of
      // P and G; the thread's column sums over its 4 rows of each channel (the last product of
      // each through product<kD>: rounded by itself, as the select against zero rounds it).
      float sum[2][2][2] = {};  // [j][h][e % 2]
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = Acc::row(i, e), c = q * kChunkChannels + cl_base + 8 * h + (e & 1);
            const float2 dab2 = unpack2<T>(dab[i][2 * h + (e >> 1)]);
            const float dv = e & 1 ? dab2.y : dab2.x;
            const float* bias = s.bias + (q % 2) * kChunkN + cl_base + 8 * h + (e & 1);
            const float pv = acc.acc[i][0][h][e] + bias[0];
            const float gv = acc.acc[i][1][h][e] + bias[kChunkChannels];
            const float sg = sigmoid_fast(gv), mv = m[i][e >> 1];
            const bool valid = r < tile.n && Dm::ab_channel(c, D);
            const float dp = valid ? product<kD>(dv * sg, mv) : 0.0f;
            const float dg = valid ? product<kD>(dv * pv * mv * sg, 1.0f - sg) : 0.0f;
            acc.acc[i][0][h][e] = dp;
            acc.acc[i][1][h][e] = dg;
            sum[0][h][e & 1] += dp;
            sum[1][h][e & 1] += dg;
          }
      // dP | dG to global: two adjacent channels per store (one 32-bit store where D is even).
      T* dpg_step = dpg_out + tile.row0 * p.ld_dpg + q * kChunkChannels + cl_base;
      const int ld_dpg = int(p.ld_dpg);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 4; e += 2) {
            const int r = Acc::row(i, e), c = q * kChunkChannels + cl_base + 8 * h;
            if (r >= tile.n || !Dm::ab_channel(c, D)) continue;
            T* dst = dpg_step + (r * ld_dpg + 8 * h);
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              const float* v = &acc.acc[i][j][h][e];
              if (D % 2 == 0) {
                store_pair(dst + j * 2 * D, v[0], v[1]);
              } else {
                dst[j * 2 * D] = from_f<T>(v[0]);
                dst[j * 2 * D + 1] = from_f<T>(v[1]);
              }
            }
          }
          // Bias sums: over the warp's 8 row groups (lanes 4 apart), then into the CTA's slot, which
          // only this thread writes.
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float v = sum[j][h][e];
#pragma unroll
            for (int o = 4; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            const int col = j * kChunkChannels + cl_base + 8 * h + e;
            if (sum_lane) s.sums[q * kThreads + half * kChunkN + col] += v;
          }
    }
  }
  __syncthreads();

  // Thread t writes slot t of each step: column t % kChunkN of row half t / kChunkN.
  const int col = threadIdx.x % kChunkN, slot_channel = col % kChunkChannels;
  const bool slot_is_g = col >= kChunkChannels;
  float* bias_row = p.partials_bias_in + (int64_t(blockIdx.x) * 2 + threadIdx.x / kChunkN) * 4 * D;
#pragma unroll
  for (int q = 0; q < kMaxInputChunks; ++q) {
    const int c = q * kChunkChannels + slot_channel;
    if (q < chunks && Dm::ab_channel(c, D))
      bias_row[(slot_is_g ? 2 * D : 0) + c] = s.sums[q * kThreads + threadIdx.x];
  }
}

template <typename T>
struct DxSmem {
  // Stage b's tiles at a + b * stage and w + b * stage (a base and an offset: an array of two
  // pointers indexed by st % 2 would live in local memory).
  T* a;
  T* w;
  int stage;
  float* c;
  // The running d norm_in_weight sums of each thread at sums[e * kThreads + thread] (in registers,
  // they spill beside the GEMM's).
  float* sums;
  size_t bytes;
  __host__ __device__ DxSmem(unsigned char* base, int Dp) {
    SmemCarver s{base};
    sums = s.take<float>(size_t(kPerLane) * kThreads);
    const size_t stage0 = s.at;
    a = s.take<T>(size_t(kRows) * kLdA);
    w = s.take<T>(size_t(kStageK) * (Dp + kPad));
    const size_t stage1 = s.at;
    stage = int((stage1 - stage0) / sizeof(T));
    s.take<T>(size_t(kRows) * kLdA);
    s.take<T>(size_t(kStageK) * (Dp + kPad));
    c = reinterpret_cast<float*>(base + stage1);
    const size_t c_end = stage1 + size_t(kRows) * kLdC * sizeof(float);
    bytes = s.at > c_end ? s.at : c_end;
  }
};

// Stages of the dx GEMM: per a/b step q, its dP columns then its dG columns (k = the rows of w_in
// block q, as input_backward.cu's dx_ln GEMM takes them), then dgo in pieces of kStageK.
template <int kD>
__device__ __forceinline__ int dx_stages(const Params& p) {
  return 2 * Dims<kD>::chunks(p) + (Dims<kD>::Dp(p) + kStageK - 1) / kStageK;
}
template <int kD>
__device__ __forceinline__ int dx_stage_k(const Params& p, int st) {
  if constexpr (kD > 0) {
    static_assert(kD % kStageK == 0, "whole stages");
    return kStageK;
  }
  const int k0 = (st - 2 * p.input_chunks) * kStageK;
  return k0 < 0 || p.Dp - k0 >= kStageK ? kStageK : p.Dp - k0;
}

// Starts copying stage st of the tile: kRows x kStageK columns of dpg (zeros past the tile and
// past the stage's valid columns) and the matching kStageK (or fewer) rows of w_in.
template <int kD, typename T>
__device__ __forceinline__ void load_dx_stage(const Params& p, const Tile& tile, int st, T* a,
                                              T* w) {
  using Dm = Dims<kD>;
  const int D = Dm::D(p), Dp = Dm::Dp(p), chunks = Dm::chunks(p);
  int col0, valid, wrow;
  if (st < 2 * chunks) {
    const int q = st / 2, part = st % 2;
    col0 = part * 2 * D + q * kChunkChannels;
    valid = 2 * D - q * kChunkChannels;
    wrow = q * kChunkN + part * kStageK;
  } else {
    const int k0 = (st - 2 * chunks) * kStageK;
    col0 = 4 * D + k0;
    valid = D - k0;
    wrow = chunks * kChunkN + k0;
  }
  // Static D: every stage's columns exist (valid >= kStageK), dpg's row stride is 5 kD.
  if constexpr (Dm::kStatic) valid = kStageK;
  const int64_t ld_dpg = Dm::kStatic ? int64_t(5) * kD : p.ld_dpg;
  const T* dpg = static_cast<const T*>(p.dpg);
  load_tile<T, kRows, kStageK, kThreads>(a, dpg + tile.row0 * ld_dpg + col0, ld_dpg, tile.n, valid,
                                         D % 8 == 0, dpg);
  copy_weight_async<kD, kStageK>(w, static_cast<const T*>(p.w_in) + int64_t(wrow) * Dp, Dp,
                                 dx_stage_k<kD>(p, st));
}

// kD: static D (64 or 128; Dims), or 0 for D from Params.
template <typename T, int kD>
__global__ void __launch_bounds__(kThreads, k16BitCtas) input_backward_dx_kernel(const Params p) {
  using Dm = Dims<kD>;
  constexpr int kLanes = kLanesOf<kD>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const int D = Dm::D(p), Dp = Dm::Dp(p), ld = Dm::ld(p);
  DxSmem<T> s(smem_raw, Dp);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int stages = dx_stages<kD>(p);
  const T* x = static_cast<const T*>(p.x);
  T* dx_out = static_cast<T*>(p.dx);
  float* sum_ln_w = s.sums + threadIdx.x;  // [e * kThreads]
  for (int e = 0; e < kPerLane; ++e) sum_ln_w[e * kThreads] = 0.0f;

  load_dx_stage<kD>(p, persistent_tile<Dm::kStatic>(blockIdx.x, p), 0, s.a, s.w);
  for (int64_t t = blockIdx.x; t < p.tiles; t += gridDim.x) {
    const Tile tile = persistent_tile<Dm::kStatic>(t, p);
    WarpTileLdsm<T> dxln;
    dxln.zero();
#pragma unroll 1
    for (int st = 0; st < stages; ++st) {
      cp_async_wait_all();
      __syncthreads();
      const int next = (st + 1) % 2 * s.stage, cur = st % 2 * s.stage;
      if (st + 1 < stages) load_dx_stage<kD>(p, tile, st + 1, s.a + next, s.w + next);
      dxln.template mma<WLayout::kKN>(s.a + cur, kLdA, s.w + cur, ld, dx_stage_k<kD>(p, st), Dp);
    }
    __syncthreads();
    dxln.store(s.c, kLdC, Dp);
    __syncthreads();
    if (t + gridDim.x < p.tiles)
      load_dx_stage<kD>(p, persistent_tile<Dm::kStatic>(t + gridDim.x, p), 0, s.a, s.w);

    // dx from dx_ln, x re-read (kXBatch of the warp's rows before the first is used) and its row
    // statistics recomputed as normalize_input_rows computes them; d norm_in_weight += dx_ln *
    // x_hat on the way (input_backward.cu's roles and order). Rows past the tile run too (zeros;
    // warp-uniform), so that no shuffle is under a branch.
    constexpr int kXBatch = kRowsPerWarp / 2;
#pragma unroll
    for (int k0 = 0; k0 < kRowsPerWarp; k0 += kXBatch) {
      float xv[kXBatch][kPerLane];
      load_warp_rows<kD>(x, tile, D, k0, xv);
#pragma unroll
      for (int k = 0; k < kXBatch; ++k) {
        const int r = warp + kWarps * (k0 + k);
        const RowStats rs = row_stats<kD>(xv[k], D, p.eps);
        float dxl[kPerLane], xhat[kPerLane], dx[kPerLane];
        // The thread's staging address, s.c + r * kLdC + lane, recomputed (ptxas would otherwise
        // keep it spilled).
        const unsigned tid = thread_index_here();
        const float* c_row = s.c + (r - warp) * kLdC + (tid + (tid / 32) * (kLdC - 32));
#pragma unroll
        for (int e = 0; e < kLanes; ++e) {
          const bool in_d = lane_in_d<kD>(lane, e, D);
          dxl[e] = in_d ? c_row[32 * e] : 0.0f;
          xhat[e] = in_d ? (xv[k][e] - rs.mean) * rs.rstd : 0.0f;
          if (r < tile.n) sum_ln_w[e * kThreads] += dxl[e] * xhat[e];
        }
        layer_norm_backward_row<kD>(dxl, xhat, p.ln_in_w, D, rs.rstd, dx);
        T* dx_row = dx_out + (tile.row0 + r) * D + lane;
#pragma unroll
        for (int e = 0; e < kLanes; ++e)
          if (lane_in_d<kD>(lane, e, D) && r < tile.n) dx_row[32 * e] = from_f<T>(dx[e]);
      }
    }
  }

  float* norm_row = p.partials_norm_in + (int64_t(blockIdx.x) * kWarps + warp) * D;
#pragma unroll
  for (int e = 0; e < kLanes; ++e) {
    const int c = lane + 32 * e;
    if (lane_in_d<kD>(lane, e, D)) norm_row[c] = sum_ln_w[e * kThreads];
  }
}

// ---- Hopper (sm_90a), 16-bit types at D = 64 and 128: the gates kernel from TMA, wgmma and warp
// specialization. Persistent CTAs, one per SM, of one producer warpgroup and sm90::kConsumers
// consumer warpgroups; the tiles, and which bias partial sums they go to, as input_backward_sm90.h
// describes (the mma.sync kernel's partials_bias_in rows, summed in an order fixed by G alone):
//   - producer: lane 0 of warp c feeds consumer c through rings of its own (x stages, dA | dB
//     stages; full / empty mbarriers), warp 0's first loads the a/b weight blocks of w_in once
//     (TMA, 128-byte swizzle; 128 KiB at D = 128, resident);
//   - consumer, per tile: LayerNorm in place in the x stage (layer_norm_in_place: the forward's
//     and normalize_input_rows's bits of x_ln), x_ln to global by a TMA store from the stage, then
//     per a/b step q a wgmma m64n128k16 chain (A = x_ln, B = weight block q: P of the step's 64
//     channels in accumulator columns 0..63, G in 64..127), the step's dA | dB from its stage by
//     ldmatrix.trans into the accumulators' layout, and the epilogue from the registers: dP, dG
//     (the mma.sync kernel's expressions and roundings) stored to dpg, their column sums over the
//     warp's 16 rows (shuffles) added into the unit's per-warp sums; the x stage is released after
//     the last step's GEMM once the x_ln store has read it.
// The products accumulate in fp32 in wgmma's order, so dP and dG may differ from the mma.sync
// kernel's in the last bit of a rounding, and the bias sums add the same values in another
// (fixed) order.
template <typename T, int kD>
__global__ void __launch_bounds__(sm90::kThreads, 1)
    input_backward_gates_sm90_kernel(const __grid_constant__ Params p,
                                     const __grid_constant__ CUtensorMap x_map,
                                     const __grid_constant__ CUtensorMap xln_map,
                                     const __grid_constant__ CUtensorMap w_map,
                                     const __grid_constant__ CUtensorMap da_map,
                                     const __grid_constant__ CUtensorMap db_map) {
  using L = sm90::GatesLayout<kD>;
  constexpr int kSumCols = L::kSumCols;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // Aligned up to 1024 bytes by pointer arithmetic on the shared array (as the forward kernel).
  unsigned char* base = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  float* bias_in = reinterpret_cast<float*>(base + L::kBiasIn);
  float* run_all = reinterpret_cast<float*>(base + L::kRun);
  float* held_all = reinterpret_cast<float*>(base + L::kHeld);
  uint64_t* bars = reinterpret_cast<uint64_t*>(base + L::kBars);
  uint64_t* w_bar = bars;
  const int64_t G = p.grid_input_backward;  // the mma.sync kernel's grid: the virtual CTAs
  const int64_t units = sm90::units_of(blockIdx.x, gridDim.x, G);

  for (int i = threadIdx.x; i < 4 * kD; i += sm90::kThreads) bias_in[i] = p.bias_in[i];
  for (int i = threadIdx.x; i < sm90::kConsumers * 4 * kSumCols; i += sm90::kThreads)
    run_all[i] = 0.0f;
  if (threadIdx.x == 0) {
    mbar_init(w_bar, 1);
    for (int c = 0; c < sm90::kConsumers; ++c) {
      for (int s = 0; s < L::kXStages; ++s) {
        mbar_init(&bars[L::x_full(c, s)], 1);
        mbar_init(&bars[L::x_empty(c, s)], 128);  // every thread of the consumer
      }
      for (int s = 0; s < L::kDabStages; ++s) {
        mbar_init(&bars[L::dab_full(c, s)], 1);
        mbar_init(&bars[L::dab_empty(c, s)], 128);
      }
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    // Producer: lane 0 of warp c feeds consumer c, in that consumer's order.
    const int c = threadIdx.x / 32;
    if (threadIdx.x % 32 != 0 || c >= sm90::kConsumers) return;
    if (c == 0) load_weight_blocks<kD, L::kChunks>(&w_map, w_bar, base + L::kW);
    int64_t xn = 0, dn = 0;  // the consumer's x and dA | dB ring uses so far
    for (int64_t k = 0; k < units; ++k) {
      const sm90::Unit u = sm90::unit_of(blockIdx.x, gridDim.x, G, p.tiles, c, k);
      for (int64_t m = 0; m < u.count; ++m, ++xn) {
        const Tile tile = tile_at<true>(u.v + (u.first + m) * G, p);
        const int j0 = int(tile.j0), i = int(tile.i), b = int(tile.b);
        const sm90::Use x = sm90::use_of(xn, L::kXStages);
        mbar_wait(&bars[L::x_empty(c, x.stage)], x.parity ^ 1);
        mbar_arrive_expect_tx(&bars[L::x_full(c, x.stage)], L::kXBytes);
        unsigned char* xs = base + L::kX + (c * L::kXStages + x.stage) * L::kXBytes;
#pragma unroll
        for (int h = 0; h < L::kKHalves; ++h)
          cute::SM90_TMA_LOAD_3D::copy(&x_map, &bars[L::x_full(c, x.stage)], kTmaEvictFirst,
                                       xs + h * (kRows * 128), h * sm90::kAtomCols, j0,
                                       b * int(p.S) + i);
          // dA | dB [B, D, S, S]: box 64 positions (j) x 64 channels at (i, b); step q's channels
          // all in dA (q < kChunks / 2) or all in dB.
#pragma unroll 1
        for (int q = 0; q < L::kChunks; ++q, ++dn) {
          const sm90::Use d = sm90::use_of(dn, L::kDabStages);
          uint64_t* full = &bars[L::dab_full(c, d.stage)];
          mbar_wait(&bars[L::dab_empty(c, d.stage)], d.parity ^ 1);
          mbar_arrive_expect_tx(full, L::kDabBytes);
          const int c0 = q * kChunkChannels;
          cute::SM90_TMA_LOAD_4D::copy(
              c0 < kD ? &da_map : &db_map, full, kTmaEvictFirst,
              base + L::kDab + (c * L::kDabStages + d.stage) * L::kDabBytes, j0, i, c0 % kD, b);
        }
      }
    }
    return;
  }

  // Consumer c.
  const int c = wg - 1, tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const int g = lane >> 2, tq = lane & 3;
  float* run = run_all + c * 4 * kSumCols;    // [warp][kSumCols]
  float* held = held_all + c * 2 * kSumCols;  // [half][kSumCols]
  const bool masked = p.mask != nullptr;
  T* dpg = static_cast<T*>(p.dpg);
  constexpr int64_t kLdDpg = 5 * kD;  // entry.cu's ld_dpg
  // The thread's accumulator rows 16 warp + g and + 8 (the C fragment's e / 2 = 0, 1).
  const int r_lo = 16 * warp + g, r_hi = r_lo + 8;
  float ln_w[kD / 32], ln_b[kD / 32];
#pragma unroll
  for (int t = 0; t < kD / 32; ++t) {
    ln_w[t] = p.ln_in_w[lane + 32 * t];
    ln_b[t] = p.ln_in_b[lane + 32 * t];
  }

  int64_t xn = 0, dn = 0;
  int64_t held_v = -1;  // the virtual CTA whose other part's sums are in held
  for (int64_t k = 0; k < units; ++k) {
    const sm90::Unit u = sm90::unit_of(blockIdx.x, gridDim.x, G, p.tiles, c, k);
#pragma unroll 1
    for (int64_t m = 0; m < u.count; ++m, ++xn) {
      const Tile tile = tile_at<true>(u.v + (u.first + m) * G, p);
      const sm90::Use x = sm90::use_of(xn, L::kXStages);
      unsigned char* xs = base + L::kX + (c * L::kXStages + x.stage) * L::kXBytes;
      // The mask of the thread's rows, loaded before the wait (the epilogue uses it).
      const float mask_lo = (masked && r_lo < tile.n) ? mask_value<T>(p, tile.row0 + r_lo) : 1.0f;
      const float mask_hi = (masked && r_hi < tile.n) ? mask_value<T>(p, tile.row0 + r_hi) : 1.0f;
      mbar_wait(&bars[L::x_full(c, x.stage)], x.parity);
      // LayerNorm in place (rows past the tile were read as zeros; they are not stored, and their
      // dP and dG are zeros).
      layer_norm_in_place<T, kD>(xs, warp, lane, ln_w, ln_b, p.eps);
      fence_proxy_async();  // the stage's new bits visible to wgmma and to the TMA store
      consumer_sync(c);
      if (tid == 0) {
        // x_ln to global ([B * S * S, D] as x): positions past S are not written.
#pragma unroll
        for (int h = 0; h < L::kKHalves; ++h)
          cute::SM90_TMA_STORE_3D::copy(&xln_map, xs + h * (kRows * 128), h * sm90::kAtomCols,
                                        int(tile.j0), int(tile.b * p.S + tile.i));
        bulk_commit();
      }
      mbar_wait(w_bar, 0);

#pragma unroll 1
      for (int q = 0; q < L::kChunks; ++q, ++dn) {
        float acc[kChunkN / 8][4];
        step_gemm<T, kChunkN, kD>(acc, smem_addr(xs),
                                  smem_addr(base + L::kW + q * L::kWBlockBytes));
        // dA | dB of the step while the GEMM runs: dab[jj][m] holds channels 8 j + 2 tq, + 1 of
        // the step at row 16 warp + 8 (m % 2) + g, j = 2 jj + m / 2 (dab_ldsm_offset); then the
        // stage goes back to the producer.
        const sm90::Use d = sm90::use_of(dn, L::kDabStages);
        const uint32_t ds =
            smem_addr(base + L::kDab + (c * L::kDabStages + d.stage) * L::kDabBytes);
        mbar_wait(&bars[L::dab_full(c, d.stage)], d.parity);
        uint32_t dab[4][4];
#pragma unroll
        for (int jj = 0; jj < 4; ++jj)
          load_transposed_at(dab[jj], ds + sm90::dab_ldsm_offset(warp, lane, jj));
        mbar_arrive(&bars[L::dab_empty(c, d.stage)]);
        wgmma_wait<0>();
        fence_regs(acc);
        if (q == L::kChunks - 1) {
          // This thread's reads of the x stage are done; the x_ln store's too (its issuer waits).
          if (tid == 0) bulk_wait_read();
          mbar_arrive(&bars[L::x_empty(c, x.stage)]);
        }

        // dP = dab sg m, dG = dab P m sg (1 - sg) (the mma.sync kernel's expressions and
        // roundings); P of channel 8 j + 2 tq + e in acc[j][2 ep + e], G in acc[j + 8][..].
        const int c0 = q * kChunkChannels;
        T* dst_lo = dpg + (tile.row0 + r_lo) * kLdDpg + c0 + 2 * tq;
#pragma unroll
        for (int j = 0; j < kChunkChannels / 8; ++j) {
          const int ch = c0 + 8 * j + 2 * tq;
          const float2 bp = *reinterpret_cast<const float2*>(bias_in + ch);
          const float2 bg = *reinterpret_cast<const float2*>(bias_in + 2 * kD + ch);
          float sum[2][2] = {};  // [dP, dG][e]: over the thread's two rows
#pragma unroll
          for (int ep = 0; ep < 2; ++ep) {
            const float2 dab2 = unpack2<T>(dab[j / 2][2 * (j % 2) + ep]);
            const float mv = ep ? mask_hi : mask_lo;
            const bool valid = (ep ? r_hi : r_lo) < tile.n;
            float dp[2], dg[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float dv = e ? dab2.y : dab2.x;
              const float pv = acc[j][2 * ep + e] + (e ? bp.y : bp.x);
              const float gv = acc[j + 8][2 * ep + e] + (e ? bg.y : bg.x);
              const float sg = sigmoid_fast(gv);
              dp[e] = valid ? product<kD>(dv * sg, mv) : 0.0f;
              dg[e] = valid ? product<kD>(dv * pv * mv * sg, 1.0f - sg) : 0.0f;
              sum[0][e] += dp[e];
              sum[1][e] += dg[e];
            }
            if (valid) {
              T* dst = dst_lo + (ep * 8 * kLdDpg + 8 * j);
              store_pair(dst, dp[0], dp[1]);
              store_pair(dst + 2 * kD, dg[0], dg[1]);
            }
          }
          // Over the warp's 8 row groups (lanes 4 apart), then into the warp's unit sums, which
          // only this lane (g = 0) writes: columns ch + e (dP), 2D + ch + e (dG).
#pragma unroll
          for (int s = 0; s < 2; ++s)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float v = sum[s][e];
#pragma unroll
              for (int o = 4; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
              if (g == 0) run[warp * kSumCols + s * 2 * kD + ch + e] += v;
            }
        }
      }
    }

    // The unit's sums per half (warps 2 h and 2 h + 1): with its partner's into the virtual CTA's
    // partials rows (part 0 + part 1), or held for the partner still to come.
    consumer_sync(c);
    const bool closes = held_v == u.v;
    for (int idx = tid; idx < 2 * kSumCols; idx += 128) {
      const int h = idx / kSumCols, col = idx % kSumCols;
      float* w0 = run + 2 * h * kSumCols + col;
      const float sum = w0[0] + w0[kSumCols];
      w0[0] = 0.0f;
      w0[kSumCols] = 0.0f;
      if (closes)
        p.partials_bias_in[(2 * u.v + h) * kSumCols + col] =
            u.part == 0 ? sum + held[idx] : held[idx] + sum;
      else
        held[idx] = sum;
    }
    held_v = closes ? -1 : u.v;
    consumer_sync(c);  // the zeroed sums before the next unit's first additions
  }
  if (tid == 0) bulk_wait();  // the x_ln stores complete before the CTA ends

  // The virtual CTA split between the consumers: part 0 in consumer 0's held, part 1 in
  // consumer 1's, both done at the barrier of the two consumer warpgroups (id 3).
  if (sm90::split_unit(blockIdx.x, gridDim.x, G)) {
    asm volatile("bar.sync 3, %0;\n" ::"n"(128 * sm90::kConsumers) : "memory");
    if (c == 1) {
      for (int idx = tid; idx < 2 * kSumCols; idx += 128) {
        const int h = idx / kSumCols, col = idx % kSumCols;
        p.partials_bias_in[(2 * held_v + h) * kSumCols + col] = held_all[idx] + held[idx];
      }
    }
  }
}

// ---- Hopper (sm_90a), 16-bit types at D = 64 and 128: the dx kernel from wgmma. Persistent CTAs
// (min(G, SMs)) of sm90::kConsumers warpgroups, no producer (input_backward_sm90.h, DxLayout):
// each consumer takes the gates kernel's units of work (unit_of), copies its stages (64 columns of
// dpg, the 64 matching rows of w_in; cp.async into wgmma's core-matrix layout, zeros past the
// tile) kStages - 1 stages ahead across its tiles, and per stage issues m64nNk16 wgmmas (A K-major,
// B = w_in's rows MN-major, as the attention backward's dV and dK products read theirs) into the
// tile's dx_ln accumulators; then dx_ln through an fp32 staging to the mma.sync dx kernel's row
// code: x re-read, row_stats, layer_norm_backward_row, dx, and d norm_in_weight += dx_ln x_hat per
// row. Warp w of a consumer takes rows w + 4 i, so its lanes sum the rows of the mma.sync
// kernel's warps w and w + 4 (r % kWarps): partials_norm_in row kWarps v + r % kWarps, as there,
// each unit's sum in registers, a virtual CTA's row = part 0 + part 1. dx_ln accumulates in fp32
// in wgmma's order (may differ from the mma.sync kernel's in the last bit of a rounding); the row
// code, its roundings and its sums are the mma.sync kernel's.

// Copies a [kR][kC] block of a row-major tensor (row stride ld elements; rows >= valid as zeros,
// never read) into the core-matrix layout [kC / 8][kR][8]: 16 bytes per cp.async, thread tid of
// 128.
template <int kR, int kC, typename T>
__device__ __forceinline__ void copy_core_block(T* s, const T* g, int64_t ld, int valid, int tid) {
#pragma unroll
  for (int i = tid; i < kR * kC / 8; i += 128) {
    const int r = i % kR, c = (i / kR) * 8;
    cp_async_16(s + sm90::core_offset(kR, r, c), r < valid ? g + r * ld + c : g,
                r < valid ? 16 : 0);
  }
}

template <typename T, int kD>
__global__ void __launch_bounds__(sm90::DxLayout<kD>::kThreads, 1)
    input_backward_dx_sm90_kernel(const __grid_constant__ Params p) {
  using L = sm90::DxLayout<kD>;
  constexpr int kHalves = kD / 64;  // wgmma N = 64 per half of dx_ln's columns
  constexpr int kLdDpg = 5 * kD;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* base = smem_raw + ((128u - (smem_addr(smem_raw) & 127u)) & 127u);
  const int c = threadIdx.x / 128, tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const int g = lane >> 2, tq = lane & 3;
  unsigned char* mine = base + c * L::kConsumerBytes;
  float* staging = reinterpret_cast<float*>(mine + L::kStaging);
  float* held = reinterpret_cast<float*>(mine + L::kHeld);  // [virtual warp][kD]
  const int64_t G = p.grid_input_backward;
  const int64_t units = sm90::units_of(blockIdx.x, gridDim.x, G);
  const T* dpg = static_cast<const T*>(p.dpg);
  const T* w_in = static_cast<const T*>(p.w_in);
  const T* x = static_cast<const T*>(p.x);
  T* dx_out = static_cast<T*>(p.dx);

  // Copies of the stage at `ahead` into its buffer (one commit group, empty past the last stage).
  sm90::StageCursor ahead(blockIdx.x, gridDim.x, G, p.tiles, c, L::kStagesPerTile);
  int64_t issued = 0;
  const auto issue = [&]() {
    if (ahead.valid()) {
      const Tile tile = tile_at<true>(ahead.tile(), p);
      const sm90::DxStage st = sm90::dx_stage<kD>(ahead.st);
      T* a = reinterpret_cast<T*>(mine + (issued % L::kStages) * L::kStageBytes);
      copy_core_block<kRows, L::kStageK>(a, dpg + tile.row0 * kLdDpg + st.col0, kLdDpg, tile.n,
                                         tid);
      copy_core_block<L::kStageK, kD>(a + L::kABytes / 2, w_in + int64_t(st.wrow) * kD, kD,
                                      L::kStageK, tid);
      ahead.next();
    }
    cp_async_commit();
    ++issued;
  };
#pragma unroll 1
  for (int s = 0; s < L::kStages - 1; ++s) issue();

  float sums[2][kD / 32] = {};    // the unit's d norm_in_weight sums: virtual warps warp, warp + 4
  int64_t held_v = -1, done = 0;  // done: stages multiplied so far
  for (int64_t k = 0; k < units; ++k) {
    const sm90::Unit u = sm90::unit_of(blockIdx.x, gridDim.x, G, p.tiles, c, k);
#pragma unroll 1
    for (int64_t m = 0; m < u.count; ++m) {
      const Tile tile = tile_at<true>(u.v + (u.first + m) * G, p);
      float acc[kHalves][8][4];
#pragma unroll
      for (int h = 0; h < kHalves; ++h)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[h][j][e] = 0.0f;
#pragma unroll 1
      for (int st = 0; st < L::kStagesPerTile; ++st, ++done) {
        // Stage `done` has landed (kStages - 2 younger groups may be in flight) for every thread;
        // every thread is past the wgmmas of stage done - 1, whose buffer the next copies take.
        cp_async_wait<L::kStages - 2>();
        fence_proxy_async();
        consumer_sync(c);
        issue();
        const T* a = reinterpret_cast<const T*>(mine + (done % L::kStages) * L::kStageBytes);
        const T* b = a + L::kABytes / 2;
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < L::kStageK / 16; ++ks) {
          const uint64_t da = desc_k_major(a + ks * 2 * kRows * 8);
#pragma unroll
          for (int h = 0; h < kHalves; ++h)
            Wgmma<T, 64>::template ss<1, 0, 1>(
                acc[h], da, desc_mn_major(b + h * 8 * L::kStageK * 8 + ks * 16 * 8));
        }
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int h = 0; h < kHalves; ++h) fence_regs(acc[h]);
      }

      // dx_ln to the staging (the previous tile's row pass is done: every thread passed this
      // tile's stage barriers), then the rows.
#pragma unroll
      for (int h = 0; h < kHalves; ++h)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; e += 2)
            *reinterpret_cast<float2*>(staging + (16 * warp + g + 4 * e) * L::kLdC + 64 * h +
                                       8 * j + 2 * tq) =
                make_float2(acc[h][j][e], acc[h][j][e + 1]);
      consumer_sync(c);
      // Rows warp + 4 (i0 + i): x re-read (kBatch rows' loads before the first use), statistics
      // recomputed as normalize_input_rows computes them; rows past the tile run too (zeros), so
      // that no shuffle is under a branch.
      constexpr int kBatch = 4;
#pragma unroll 1
      for (int i0 = 0; i0 < kRows / 4; i0 += kBatch) {
        float xv[kBatch][kPerLane];
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
          const int r = warp + 4 * (i0 + i);
          const T* row = x + (tile.row0 + r) * kD + lane;
#pragma unroll
          for (int e = 0; e < kPerLane; ++e)
            xv[i][e] = (r < tile.n && e < kD / 32) ? to_f(row[32 * e]) : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
          const int r = warp + 4 * (i0 + i);
          const RowStats rs = row_stats<kD>(xv[i], kD, p.eps);
          float dxl[kPerLane] = {}, xhat[kPerLane] = {}, dx[kPerLane];
#pragma unroll
          for (int e = 0; e < kD / 32; ++e) {
            dxl[e] = staging[r * L::kLdC + lane + 32 * e];
            xhat[e] = (xv[i][e] - rs.mean) * rs.rstd;
            // Virtual warp r % kWarps = warp + 4 (i % 2) (i0 is even).
            if (r < tile.n) sums[i % 2][e] += dxl[e] * xhat[e];
          }
          layer_norm_backward_row<kD>(dxl, xhat, p.ln_in_w, kD, rs.rstd, dx);
          T* dx_row = dx_out + (tile.row0 + r) * kD + lane;
#pragma unroll
          for (int e = 0; e < kD / 32; ++e)
            if (r < tile.n) dx_row[32 * e] = from_f<T>(dx[e]);
        }
      }
    }

    // The unit's sums: with the partner's into partials_norm_in (part 0 + part 1), or held. Each
    // lane owns its (virtual warp, channel) slots: no barrier.
    const bool closes = held_v == u.v;
#pragma unroll
    for (int vv = 0; vv < 2; ++vv)
#pragma unroll
      for (int e = 0; e < kD / 32; ++e) {
        const int vw = warp + 4 * vv, ch = lane + 32 * e;
        float& h = held[vw * kD + ch];
        if (closes)
          p.partials_norm_in[(u.v * kWarps + vw) * kD + ch] =
              u.part == 0 ? sums[vv][e] + h : h + sums[vv][e];
        else
          h = sums[vv][e];
        sums[vv][e] = 0.0f;
      }
    held_v = closes ? -1 : u.v;
  }
  cp_async_wait<0>();

  // The virtual CTA split between the consumers (input_backward_sm90.h): part 0 in consumer 0's
  // held sums, part 1 in consumer 1's.
  if (sm90::split_unit(blockIdx.x, gridDim.x, G)) {
    asm volatile("bar.sync 3, %0;\n" ::"n"(L::kThreads) : "memory");
    if (c == 1) {
      const float* held0 = reinterpret_cast<const float*>(base + L::kHeld);
#pragma unroll
      for (int vv = 0; vv < 2; ++vv)
#pragma unroll
        for (int e = 0; e < kD / 32; ++e) {
          const int i = (warp + 4 * vv) * kD + lane + 32 * e;
          p.partials_norm_in[held_v * kWarps * kD + i] = held0[i] + held[i];
        }
    }
  }
}

// Whether the Hopper gates kernel takes this call: D = 64 or 128, S a multiple of 8 (dA | dB's
// TMA strides of S elements on 16 bytes), 32-bit tile indices and TMA coordinates, 16-byte
// aligned TMA tensors and 4-byte aligned dpg (32-bit stores).
bool sm90_gates_fits(const Params& p) {
  const auto aligned = [](const void* q, int bytes) {
    return reinterpret_cast<uintptr_t>(q) % bytes == 0;
  };
  return (p.D == 64 || p.D == 128) && p.S % 8 == 0 && p.ld_dpg == 5 * p.D && p.tiles <= INT32_MAX &&
         p.B * p.S <= INT32_MAX && aligned(p.x, 16) && aligned(p.xln, 16) && aligned(p.w_in, 16) &&
         aligned(p.da, 16) && aligned(p.db, 16) && aligned(p.dpg, 4);
}

// Whether the Hopper dx kernel takes this call: D = 64 or 128, 32-bit tile indices, dpg's row
// stride 5D and 16-byte aligned dpg and w_in (16-byte copies).
bool sm90_dx_fits(const Params& p) {
  const auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  return (p.D == 64 || p.D == 128) && p.ld_dpg == 5 * p.D && p.tiles <= INT32_MAX &&
         aligned(p.dpg) && aligned(p.w_in);
}

template <typename T, int kD>
void launch_input_backward_dx_sm90(const Params& p, cudaStream_t stream) {
  using L = sm90::DxLayout<kD>;
  const auto kernel = input_backward_dx_sm90_kernel<T, kD>;
  set_max_smem(kernel, L::kBytes);
  const int64_t grid = std::min<int64_t>(p.grid_input_backward, multiprocessors());
  kernel<<<unsigned(grid), L::kThreads, L::kBytes, stream>>>(p);
  check_launch("trimul input_backward (dx, sm90)");
}

template <typename T, int kD>
void launch_input_backward_gates_sm90(const Params& p, cudaStream_t stream) {
  using L = sm90::GatesLayout<kD>;
  constexpr bool kFp16 = std::is_same_v<T, __half>;
  const CUtensorMap x_map = position_rows_map<kD>(p.x, kFp16, p, "trimul x");
  const CUtensorMap xln_map = position_rows_map<kD>(p.xln, kFp16, p, "trimul x_ln");
  const CUtensorMap w_map = w_in_map<kD>(p.w_in, kFp16, L::kChunks);
  // dA, dB [B, D, S, S]: dim 0 the positions j (box 64), then i (box 1), the channels (box 64)
  // and b, in increasing strides (tiled_tensor_map's order: dims comes back as the identity).
  const int64_t ab_size[3] = {p.S, kD, p.B}, ab_stride[3] = {p.S, p.S * p.S, kD * p.S * p.S};
  const uint32_t ab_box[3] = {1, uint32_t(kChunkChannels), 1};
  uint32_t dims = 0;
  const CUtensorMap da_map =
      tiled_tensor_map(p.da, kFp16, 3, ab_size, ab_stride, ab_box, p.S, uint32_t(kRows),
                       CU_TENSOR_MAP_SWIZZLE_128B, "trimul dA", dims);
  const CUtensorMap db_map =
      tiled_tensor_map(p.db, kFp16, 3, ab_size, ab_stride, ab_box, p.S, uint32_t(kRows),
                       CU_TENSOR_MAP_SWIZZLE_128B, "trimul dB", dims);
  TPF_CHECK(dims == (1u << 2 | 2u << 4), "trimul dA | dB: TMA dims out of the kernel's order");
  const auto kernel = input_backward_gates_sm90_kernel<T, kD>;
  set_max_smem(kernel, L::kBytes);
  const int64_t grid = std::min<int64_t>(p.grid_input_backward, multiprocessors());
  kernel<<<unsigned(grid), sm90::kThreads, L::kBytes, stream>>>(p, x_map, xln_map, w_map, da_map,
                                                                db_map);
  check_launch("trimul input_backward (gates, sm90)");
}

}  // namespace

// The gates and dx kernels: the Hopper ones where they fit (16-bit D = 64 / 128, sm90_gates_fits,
// sm90_dx_fits), the mma.sync ones otherwise.
template <typename T>
void launch_input_backward_split(const Params& p, cudaStream_t stream) {
  with_static_d(p, [&](auto d) {
    constexpr int kD = decltype(d)::value;
    bool sm90_gates = false, sm90_dx = false;
    if constexpr (kD > 0) {
      sm90_gates = sm90_gates_fits(p);
      sm90_dx = sm90_dx_fits(p);
    }
    if constexpr (kD > 0) {
      if (sm90_gates) launch_input_backward_gates_sm90<T, kD>(p, stream);
    }
    if (!sm90_gates)
      launch_kernel(input_backward_gates_kernel<T, kD>, p.grid_input_backward,
                    GatesSmem<T>(nullptr, p.Dp).bytes, p, stream, "trimul input_backward (gates)");
    if constexpr (kD > 0) {
      if (sm90_dx) launch_input_backward_dx_sm90<T, kD>(p, stream);
    }
    if (!sm90_dx)
      launch_kernel(input_backward_dx_kernel<T, kD>, p.grid_input_backward,
                    DxSmem<T>(nullptr, p.Dp).bytes, p, stream, "trimul input_backward (dx)");
  });
}

template void launch_input_backward_split<__nv_bfloat16>(const Params&, cudaStream_t);
template void launch_input_backward_split<__half>(const Params&, cudaStream_t);

}  // namespace tpf::cuda::trimul
