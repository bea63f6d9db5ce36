// Output-side backward: the output gate, the output projection and LayerNorm_out, giving dz
// (channel-major, for the contraction's backward), dgo, and dpo and z_ln (for the cuBLAS weight
// gradients). Persistent CTAs walk tiles blockIdx.x, + gridDim.x, ...; every thread keeps running
// sums in fixed roles, written once per CTA and summed in a fixed order later (launch_reduce_sums):
//   column pass (thread = column, half of every tile's rows): d p_out_bias, d g_out_bias
//     -> two rows of partials_bias_out [2 grid, 2D] per CTA;
//   row pass (warp = rows w, w + kWarps, ...; lane = columns): d norm_out_weight
//     -> kWarps rows of partials_norm_out [kWarps grid, D] per CTA.
// d norm_out_bias needs no sum of its own: it is Wp_out^T d p_out_bias (see pack.cu). One kernel
// for float32, one for 16-bit types.
//
// float32 (GEMMs on the CUDA cores, IEEE sigmoid, 2 CTAs per SM, grid kBackwardCtas):
//   Z  [kRows, Dp]     z of the tile, transposed; kept for z_hat
//   X  [kRows, Dp]     z_ln, then dpo
//   W  [Dp, Dp]        p_out_weight, loaded once per CTA
//   C  [kRows, kLdC]   po, then dz_ln, then dz
#include "kernels/trimul/device.cuh"
#include "kernels/trimul/launch.h"
#include "kernels/trimul/layer_norm.cuh"

namespace tpf::cuda::trimul {
namespace {

struct OutputBackwardF32Smem {
  float* z;
  float* x;
  float* w;
  float* c;
  float* mean;
  float* rstd;
  size_t bytes;
  __host__ __device__ OutputBackwardF32Smem(unsigned char* base, int Dp) {
    SmemCarver s{base};
    z = s.take<float>(size_t(kRows) * (Dp + kPad));
    x = s.take<float>(size_t(kRows) * (Dp + kPad));
    w = s.take<float>(size_t(Dp) * (Dp + kPad));
    c = s.take<float>(size_t(kRows) * kLdC);
    mean = s.take<float>(kRows);
    rstd = s.take<float>(kRows);
    bytes = s.at;
  }
};

__global__ void __launch_bounds__(kThreads, kF32Ctas) output_backward_f32_kernel(const Params p) {
  using T = float;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  OutputBackwardF32Smem s(smem_raw, p.Dp);
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
      WarpTileF32 acc;
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
            const float sg = sigmoid(gv[k]);
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
      WarpTileF32 acc;
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

// ---- 16-bit types: the same work at 3 CTAs per SM (bench/notes-trimul.md).
//
//   Z    [kRows, Dp]          z of the tile (T), kept for z_hat
//   X    [kRows, Dp]          z_ln (T), then dpo (T); then dz (T) channel-major [Dp, kRows + 8]
//   W    [Dp, Dp]             p_out_weight (T), loaded once per CTA; norm_out_weight and
//                             p_out_bias (fp32) in its row padding (param())
//   red  [kRows, 2, 4]        the LayerNorm backward's row sums, one partial per column warp
//   mean, rstd [kRows]
//   sums [3, kThreads]        the threads' running sums
// No fp32 staging: both epilogues work on the MMA registers (WarpTileLdsm's C fragments), dpo
// and dz reach shared memory by stmatrix, z_hat by ldmatrix, and z_ln, dpo and dz leave in
// 16-byte stores. The row sums of the LayerNorm backward cross the four column warps through
// `red`. 74.5 KB of shared memory at D = 128, at most 80 registers; grid p.grid_backward =
// k16BitOutputBackwardCtas (three per SM). Running sums in fixed roles, summed per tile over the
// warp's 8 row groups by a reduce-scatter (lane g keeps column k = g of its 8), so each thread
// keeps one running sum per quantity (in its slots of `sums`):
//   d p_out_bias, d g_out_bias -> row (2 CTA + warp's row half) of partials_bias_out;
//   d norm_out_weight          -> row (kWarps CTA + warp) of partials_norm_out (zeros in the
//                                 columns of the other column warps).
// Same products, same k order, same gate expressions as the 2-CTA kernel it replaced (z_ln, dpo,
// dgo bit for bit); the sums and the LayerNorm backward's row sums add in another (fixed) order.

constexpr int kColWarps = kChunkN / 32;  // warps across the columns of the 2 x 4 warp grid
constexpr int kLdZT = kRows + kPad;      // dz staged channel-major

template <typename T>
struct OutputBackward16BitSmem {
  T* z;
  T* x;
  T* w;
  float* red;
  float* mean;
  float* rstd;
  float* sums;
  size_t bytes;
  // SmemCarver's layout (128-byte aligned regions in this order) in 32-bit offsets: with size_t
  // ones, ptxas keeps a 64-bit offset across the tile loop and spills it.
  __host__ __device__ OutputBackward16BitSmem(unsigned char* base, int Dp) {
    unsigned at = 0;
    auto take = [&](unsigned elems, unsigned elem_bytes) {
      unsigned char* q = base + at;
      at += (elems * elem_bytes + 127) / 128 * 128;
      return q;
    };
    // The regions of fixed size first: their offsets are constants.
    sums = reinterpret_cast<float*>(take(3 * kThreads, sizeof(float)));
    red = reinterpret_cast<float*>(take(kRows * 2 * kColWarps, sizeof(float)));
    mean = reinterpret_cast<float*>(take(kRows, sizeof(float)));
    rstd = reinterpret_cast<float*>(take(kRows, sizeof(float)));
    const unsigned rows = unsigned(kRows) * (Dp + kPad), cm = unsigned(Dp) * kLdZT;
    z = reinterpret_cast<T*>(take(rows, sizeof(T)));
    x = reinterpret_cast<T*>(take(rows > cm ? rows : cm, sizeof(T)));
    w = reinterpret_cast<T*>(take(unsigned(Dp) * (Dp + kPad), sizeof(T)));
    bytes = at;
    this->Dp = Dp;
  }
  int Dp;
  // norm_out_weight (k = c) and p_out_bias (k = Dp + c), zeros past D, live in W's row padding
  // (kPad = 8 elements = 4 floats after the Dp columns of each of its Dp rows; no GEMM and no
  // copy touches them): value k at row k / 4, float k % 4. `param` for one, `param_pair` for
  // k, k + 1 with k even (one 8-byte load).
  __device__ float* param(int k) const {
    return reinterpret_cast<float*>(w + (k / 4) * (Dp + kPad) + Dp) + k % 4;
  }
  __device__ float2 param_pair(int base, int c) const {
    return c < Dp ? *reinterpret_cast<const float2*>(param(base + c)) : make_float2(0.0f, 0.0f);
  }
};

// ldmatrix / stmatrix (non-transposed) of the 16 x 16 block at (row0, col0) of a row-major shared
// matrix in the C fragment's layout: r[2 h + e / 2] holds the pair (e, e + 1) of acc[.][.][h]
// (row row0 + g + 8 (e / 2), columns col0 + 8 h + 2 t, + 1).
template <typename T>
__device__ __forceinline__ const T* fragment_lane_ptr(const T* s, int ld, int row0, int col0) {
  const int lane = threadIdx.x & 31;
  return s + (row0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + col0 + (lane >> 4) * 8;
}
template <typename T>
__device__ __forceinline__ void load_fragment(uint32_t (&r)[4], const T* s, int ld, int row0,
                                              int col0) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(fragment_lane_ptr(s, ld, row0, col0))));
}
template <typename T>
__device__ __forceinline__ void store_fragment(T* s, int ld, int row0, int col0,
                                               const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(
                   smem_addr(fragment_lane_ptr(s, ld, row0, col0))),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// Two adjacent 16-bit elements src[at], src[at + 1] as one 32-bit word (zero bits where not
// valid): one 4-byte load where `paired` (D even: then v0 implies v1 and the pair is aligned).
template <typename T>
__device__ __forceinline__ uint32_t load_pair_bits(const T* src, int64_t at, bool v0, bool v1,
                                                   bool paired) {
  if (paired) return v0 ? *reinterpret_cast<const uint32_t*>(src + at) : 0u;
  const uint16_t* u = reinterpret_cast<const uint16_t*>(src);
  return uint32_t(v0 ? u[at] : 0) | uint32_t(v1 ? u[at + 1] : 0) << 16;
}

// Column sums over the warp's 8 row groups (lanes 4 apart, g = lane / 4), scattered so that each
// lane keeps one: reduce_scatter_4 takes the values v[2 h + e] of the thread's 4 columns of one
// 16-column block j and returns, in lane g, the sum over the 4 lanes that share g / 4 of
// v[g % 4] (exchanges xor 8, then xor 4); reduce_scatter_2 then adds the two blocks' results
// over xor 16, lane g keeping block g / 4. Lane (g, t) ends with column
// Acc::col(g / 4, g / 2 % 2, g % 2) summed over the warp's 32 rows, in a fixed order.
__device__ __forceinline__ float reduce_scatter_4(const float (&v)[4]) {
  const int g = (threadIdx.x & 31) >> 2;
  const bool b1 = g & 2, b0 = g & 1;
  float a[2];
#pragma unroll
  for (int k = 0; k < 2; ++k)
    a[k] = (b1 ? v[k + 2] : v[k]) + __shfl_xor_sync(0xffffffffu, b1 ? v[k] : v[k + 2], 8);
  return (b0 ? a[1] : a[0]) + __shfl_xor_sync(0xffffffffu, b0 ? a[0] : a[1], 4);
}
__device__ __forceinline__ float reduce_scatter_2(const float (&v)[2]) {
  const bool b2 = (threadIdx.x & 31) >> 2 & 4;
  return (b2 ? v[1] : v[0]) + __shfl_xor_sync(0xffffffffu, b2 ? v[0] : v[1], 16);
}

// The dynamic shared memory's base, read anew at each call (volatile: not hoisted), so that the
// carved pointers are recomputed where they are used (a few integer instructions) instead of
// being kept in registers across the tile loop and spilled under the 80-register bound.
// (The base plus a zero that the compiler cannot see through: the pointer stays one into
// smem_raw, so accesses through it remain LDS / STS rather than generic loads and stores.)
__device__ __forceinline__ unsigned char* smem_base_here(unsigned char* base) {
  unsigned zero;
  asm volatile("mov.u32 %0, 0;" : "=r"(zero));
  return base + zero;
}

// kPaired: D is even (go, dy and dgo in 32-bit pairs; scalar otherwise, for the C++ API's odd D).
// kD: static D (64 or 128; Dims; always paired), or 0 for D from Params.
template <typename T, bool kPaired, int kD>
__global__ void __launch_bounds__(kThreads, k16BitCtas)
    output_backward_16bit_kernel(const Params p) {
  using Acc = WarpTileLdsm<T>;
  using Smem = OutputBackward16BitSmem<T>;
  using Dm = Dims<kD>;
  static_assert(kD == 0 || kPaired, "static D is even");
  // The widest row (row-major stores) or the most channels (dz's channel-major store).
  constexpr int kMaxCols = kD ? kD : kChunkN;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const int ld = Dm::ld(p), D = Dm::D(p), Dp = Dm::Dp(p);
  constexpr bool paired = kPaired;
  // The thread's coordinates (C fragment: g = lane / 4, t = lane % 4; the warp's rows m0.. and
  // columns n0.. of the 2 x 4 warp grid, nq = n0 / 32) from thread_index_here() at each use:
  // kept in registers, they (and the addresses derived from them) are hoisted out of the tile
  // loop and spilled. Likewise the carved shared-memory pointers (smem()).
  const auto tid = [] { return thread_index_here() % kThreads; };
  const auto warp = [=] { return int(tid() / 32); };
  const auto lane = [=] { return int(tid() % 32); };
  const auto g = [=] { return int(tid() % 32 / 4); };
  const auto t = [=] { return int(tid() % 4); };
  const auto m0 = [=] { return int(tid() / 32 % 2 * 32); };
  const auto n0 = [=] { return int(tid() / 64 * 32); };
  const auto nq = [=] { return int(tid() / 64); };
  const auto smem = [=] { return Smem(smem_base_here(smem_raw), Dp); };
  // The thread's running sums (d p_out_bias, d g_out_bias, d norm_out_weight) in its own slots of
  // `sums` (slot q * kThreads + thread): in registers they are spilled under the 80-register bound.
  enum { kSumBp, kSumBg, kSumNw };

  const T* go = static_cast<const T*>(p.go);
  const T* dy = static_cast<const T*>(p.dy);
  T* dpo_out = static_cast<T*>(p.dpo);
  T* dgo_out = static_cast<T*>(p.dgo);
  T* zln_out = static_cast<T*>(p.zln);
  T* dz_out = static_cast<T*>(p.dz);

  {
    const Smem s = smem();
    copy_weight_async<kD, kD>(s.w, static_cast<const T*>(p.w_out), Dp, Dp);
  }
  {
    const Smem s = smem();
    for (int q = 0; q < 3; ++q) s.sums[q * kThreads + threadIdx.x] = 0.0f;
    if (threadIdx.x < Dp) {
      const int c = threadIdx.x;
      *s.param(c) = c < D ? p.ln_out_w[c] : 0.0f;
      *s.param(Dp + c) = c < D ? p.bias_out[c] : 0.0f;
    }
  }

  for (int64_t tt = blockIdx.x; tt < p.tiles; tt += gridDim.x) {
    const Tile tile = tile_at<Dm::kStatic>(tt, p);
    // The tile's go and dy (contiguous rows) toward L2 now; the gate epilogue reads them.
    {
      const int line = threadIdx.x % (kThreads / 2);
      const T* src = (threadIdx.x < kThreads / 2 ? go : dy) + tile.row0 * D;
      if (int64_t(line) * 128 < int64_t(tile.n) * D * int64_t(sizeof(T)))
        asm volatile(
            "prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char*>(src) + line * 128));
    }
    {
      const Smem s = smem();
      load_channel_major_tile<kD>(p, tile, static_cast<const T*>(p.z), s.z, ld);
      __syncthreads();
      // LayerNorm_out forward again: z_ln into X; then to global (for d p_out_weight) from X.
      normalize_output_rows<kD>(p, tile, s.z, s.x, ld, s.mean, s.rstd, static_cast<T*>(nullptr));
    }
    cp_async_wait_all();
    __syncthreads();
    {
      const Smem s = smem();
      T* zln_tile = zln_out + tile.row0 * D;
      const int n = tile.n;
      // (Not store_staged_tile: its whole variant spills at D = 128, registers being short here.)
      store_staged_rows<kRows, kMaxCols, true, false, Dm::kStatic>(
          s.x, ld, D, [=](int r) -> T* { return r < n ? zln_tile + r * D : nullptr; });
    }

    // po = z_ln Wp_out^T, in registers.
    Acc acc;
    acc.zero();
    {
      const Smem s = smem();
      acc.template mma<WLayout::kNK>(s.x, ld, s.w, ld, Dp, Dp);
    }

    // Output gate from the registers: dpo = dy sg, dgo = dy po sg (1 - sg) (the float32 kernel's
    // expressions); dpo by stmatrix into X, dgo to global in pairs; the bias sums per column.
    // One 16-column block j at a time (its go and dy loads first).
    {
      float rbp[2], rbg[2];
      const T* go_t = go + tile.row0 * D;
      const T* dy_t = dy + tile.row0 * D;
      T* dgo_t = dgo_out + tile.row0 * (Dm::kStatic ? int64_t(5) * kD : p.ld_dpg);
      const int ld_dpg = Dm::kStatic ? 5 * kD : int(p.ld_dpg);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float vbp[4] = {}, vbg[4] = {};
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          uint32_t gw[2][2], dw[2][2];  // [h][e / 2]
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int ep = 0; ep < 2; ++ep) {
              const int r = m0() + 16 * i + g() + 8 * ep, c = n0() + 16 * j + 8 * h + 2 * t();
              const bool row_ok = r < tile.n;
              const int at = r * D + c;
              const bool v0 = row_ok && Dm::channel(c, D), v1 = row_ok && Dm::channel(c + 1, D);
              gw[h][ep] = load_pair_bits(go_t, at, v0, v1, paired);
              dw[h][ep] = load_pair_bits(dy_t, at, v0, v1, paired);
            }
          // The first batch's loads are in flight across the barrier after which X takes dpo
          // (every warp done reading z_ln).
          if (j == 0 && i == 0) __syncthreads();
          const Smem s = smem();
          uint32_t frag[4];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int c = n0() + 16 * j + 8 * h + 2 * t();
            const float2 bias = s.param_pair(Dp, c);
#pragma unroll
            for (int ep = 0; ep < 2; ++ep) {
              const int r = m0() + 16 * i + g() + 8 * ep;
              const float2 gv = unpack2<T>(gw[h][ep]), dv = unpack2<T>(dw[h][ep]);
              float dpo[2], dgo[2];
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const bool valid = r < tile.n && Dm::channel(c + e, D);
                const float po = acc.acc[i][j][h][2 * ep + e] + (e ? bias.y : bias.x);
                const float sg = sigmoid_fast(e ? gv.y : gv.x), d = e ? dv.y : dv.x;
                dpo[e] = valid ? product<kD>(d, sg) : 0.0f;
                dgo[e] = valid ? product<kD>(d * po * sg, 1.0f - sg) : 0.0f;
                vbp[2 * h + e] += dpo[e];
                vbg[2 * h + e] += dgo[e];
              }
              frag[2 * h + ep] = Mma<T>::pack(dpo[0], dpo[1]);
              if (r < tile.n && Dm::channel(c, D)) {
                T* dst = dgo_t + (r * ld_dpg + c);
                if (paired) {
                  store_pair(dst, dgo[0], dgo[1]);
                } else {
                  dst[0] = from_f<T>(dgo[0]);
                  if (c + 1 < D) dst[1] = from_f<T>(dgo[1]);
                }
              }
            }
          }
          if (n0() + 16 * j < Dp) store_fragment(s.x, ld, m0() + 16 * i, n0() + 16 * j, frag);
        }
        rbp[j] = reduce_scatter_4(vbp);
        rbg[j] = reduce_scatter_4(vbg);
      }
      const float bp = reduce_scatter_2(rbp), bg = reduce_scatter_2(rbg);
      float* sums = smem().sums + tid();
      sums[kSumBp * kThreads] += bp;
      sums[kSumBg * kThreads] += bg;
    }
    __syncthreads();
    {
      const Smem s = smem();
      T* dpo_tile = dpo_out + tile.row0 * D;
      const int n = tile.n;
      store_staged_tile<Dm::kStatic, kRows, kMaxCols, true, true>(
          n == kRows, s.x, ld, D, [=](int r) -> T* { return dpo_tile + r * D; },
          [=](int r) -> T* { return r < n ? dpo_tile + r * D : nullptr; });
    }

    // dz_ln = dpo Wp_out, in registers.
    acc.zero();
    {
      const Smem s = smem();
      acc.template mma<WLayout::kKN>(s.x, ld, s.w, ld, Dp, Dp);
    }

    // LayerNorm backward, first half: g = dz_ln w (in place of dz_ln), the row sums of g and
    // g z_hat over the warp's 32 columns (-> red), d norm_out_weight += dz_ln z_hat.
    {
      float rnw[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const Smem s = smem();
        float vnw[4] = {};
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          float s1[2] = {}, s2[2] = {};  // [e / 2]
          uint32_t zf[4] = {};
          if (n0() + 16 * j < Dp) load_fragment(zf, s.z, ld, m0() + 16 * i, n0() + 16 * j);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int c = n0() + 16 * j + 8 * h + 2 * t();
            const float2 w = s.param_pair(0, c);
#pragma unroll
            for (int ep = 0; ep < 2; ++ep) {
              const int r = m0() + 16 * i + g() + 8 * ep;
              const float mean = s.mean[r], rstd = s.rstd[r];
              const float2 z = unpack2<T>(zf[2 * h + ep]);
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const bool col_ok = Dm::channel(c + e, D);
                float& a = acc.acc[i][j][h][2 * ep + e];
                const float dzl = col_ok ? a : 0.0f;
                const float zhat = col_ok ? ((e ? z.y : z.x) - mean) * rstd : 0.0f;
                if (r < tile.n) vnw[2 * h + e] += dzl * zhat;
                a = col_ok ? product<kD>(dzl, e ? w.y : w.x) : 0.0f;
                s1[ep] += a;
                s2[ep] += a * zhat;
              }
            }
          }
          // The block's row sums over its 16 columns (the 4 lanes of a row group) into the
          // warp's slot of red, block j = 1 added to block j = 0 by the same lane.
#pragma unroll
          for (int ep = 0; ep < 2; ++ep) {
            float a = s1[ep], b = s2[ep];
            a += __shfl_xor_sync(0xffffffffu, a, 1);
            b += __shfl_xor_sync(0xffffffffu, b, 1);
            a += __shfl_xor_sync(0xffffffffu, a, 2);
            b += __shfl_xor_sync(0xffffffffu, b, 2);
            if (t() == 0) {
              float* slot = s.red + (m0() + 16 * i + g() + 8 * ep) * 2 * kColWarps + nq();
              slot[0] = j == 0 ? a : slot[0] + a;
              slot[kColWarps] = j == 0 ? b : slot[kColWarps] + b;
            }
          }
        }
        rnw[j] = reduce_scatter_4(vnw);
      }
      {
        const float nw = reduce_scatter_2(rnw);
        smem().sums[kSumNw * kThreads + tid()] += nw;
      }
    }
    __syncthreads();  // red complete; every warp is done with X (dpo): X takes dz

    // Second half: dz = rstd (g - mean(g) - z_hat mean(g z_hat)), staged channel-major in X by
    // stmatrix.trans.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const Smem s = smem();
      float mean[2], rstd[2], m1[2], m2[2];
#pragma unroll
      for (int ep = 0; ep < 2; ++ep) {
        const int r = m0() + 16 * i + g() + 8 * ep;
        mean[ep] = s.mean[r];
        rstd[ep] = s.rstd[r];
        const float4 a = *reinterpret_cast<const float4*>(s.red + (r * 2 + 0) * kColWarps);
        const float4 b = *reinterpret_cast<const float4*>(s.red + (r * 2 + 1) * kColWarps);
        m1[ep] = divide_by_d<kD>(((a.x + a.y) + a.z) + a.w, D);
        m2[ep] = divide_by_d<kD>(((b.x + b.y) + b.z) + b.w, D);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        if (n0() + 16 * j >= Dp) continue;  // warp-uniform
        uint32_t zf[4], frag[4];
        load_fragment(zf, s.z, ld, m0() + 16 * i, n0() + 16 * j);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int c = n0() + 16 * j + 8 * h + 2 * t();
#pragma unroll
          for (int ep = 0; ep < 2; ++ep) {
            const float2 z = unpack2<T>(zf[2 * h + ep]);
            float dz[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float zhat =
                  Dm::channel(c + e, D) ? ((e ? z.y : z.x) - mean[ep]) * rstd[ep] : 0.0f;
              dz[e] = rstd[ep] * (acc.acc[i][j][h][2 * ep + e] - m1[ep] - zhat * m2[ep]);
            }
            frag[2 * h + ep] = Mma<T>::pack(dz[0], dz[1]);
          }
        }
        store_transposed(s.x, kLdZT, n0() + 16 * j, m0() + 16 * i, frag);
      }
    }
    __syncthreads();

    // dz channel-major: 64 consecutive positions of a channel per staged row.
    {
      const Smem s = smem();
      T* dz_tile = dz_out + tile.channel_major(p, D, 0, 0);
      const int64_t plane = p.S * p.S;
      store_staged_tile<Dm::kStatic, kMaxCols, kRows, true>(
          tile.n == kRows && p.S % 8 == 0, s.x, kLdZT, tile.n,
          [=](int c) -> T* { return dz_tile + c * plane; },
          [=](int c) -> T* { return c < D ? dz_tile + c * plane : nullptr; });
    }
  }

  // The running sums: lane (g, t) holds column Acc::col(g / 4, g / 2 % 2, g % 2) of its warp.
  const int col = n0() + 16 * (g() >> 2) + 8 * ((g() >> 1) & 1) + 2 * t() + (g() & 1);
  const float* sums = smem().sums + threadIdx.x;
  const float sum_bp = sums[kSumBp * kThreads], sum_bg = sums[kSumBg * kThreads],
              sum_nw = sums[kSumNw * kThreads];
  if (col < D) {
    float* row = p.partials_bias_out + (int64_t(blockIdx.x) * 2 + (warp() & 1)) * 2 * D;
    row[col] = sum_bp;
    row[D + col] = sum_bg;
  }
  float* norm_row = p.partials_norm_out + (int64_t(blockIdx.x) * kWarps + warp()) * D;
#pragma unroll
  for (int q = 0; q < kColWarps; ++q) {
    const int c = q == nq() ? col : 32 * q + lane();
    if (c < D) norm_row[c] = q == nq() ? sum_nw : 0.0f;
  }
}

}  // namespace

template <typename T>
void launch_output_backward(const Params& p, cudaStream_t stream) {
  if constexpr (kIsF32<T>) {
    launch_kernel(output_backward_f32_kernel, dim3(unsigned(p.grid_backward)),
                  OutputBackwardF32Smem(nullptr, p.Dp).bytes, p, stream, "trimul output_backward");
  } else {
    with_static_d(p, [&](auto d) {
      constexpr int kD = d.value;
      auto kernel = output_backward_16bit_kernel<T, true, kD>;
      if constexpr (kD == 0)
        if (p.D % 2 != 0) kernel = output_backward_16bit_kernel<T, false, 0>;
      launch_kernel(kernel, dim3(unsigned(p.grid_backward)),
                    OutputBackward16BitSmem<T>(nullptr, p.Dp).bytes, p, stream,
                    "trimul output_backward");
    });
  }
}

TPF_TRIMUL_INSTANTIATE(launch_output_backward)

}  // namespace tpf::cuda::trimul
