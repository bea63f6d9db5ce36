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
#include "kernels/common/tile_io.cuh"
#include "kernels/trimul/device.cuh"
#include "kernels/trimul/launch.h"
#include "kernels/trimul/layer_norm.cuh"

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

}  // namespace

template <typename T>
void launch_input_backward_split(const Params& p, cudaStream_t stream) {
  with_static_d(p, [&](auto d) {
    launch_kernel(input_backward_gates_kernel<T, d.value>, p.grid_input_backward,
                  GatesSmem<T>(nullptr, p.Dp).bytes, p, stream, "trimul input_backward (gates)");
    launch_kernel(input_backward_dx_kernel<T, d.value>, p.grid_input_backward,
                  DxSmem<T>(nullptr, p.Dp).bytes, p, stream, "trimul input_backward (dx)");
  });
}

template void launch_input_backward_split<__nv_bfloat16>(const Params&, cudaStream_t);
template void launch_input_backward_split<__half>(const Params&, cudaStream_t);

}  // namespace tpf::cuda::trimul
