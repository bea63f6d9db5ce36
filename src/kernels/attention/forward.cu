// Triangle attention forward (sm_90a, mma.sync tensor cores, cp.async double buffering).
//
// One thread block of four warps computes a 64-query tile of one slice (b, n, h) over all key
// tiles with an online softmax in the exp2 domain; each warp owns 16 query rows. The key, value,
// bias and mask tiles of the next step load while the current one computes. Blocks are ordered with
// the slice index fastest, so blocks that run together read the same bias rows (shared by all
// slices) from L2. Outputs: O (input dtype), the BF16 residual of O's rounding, and the
// log-sum-exp (natural log, +inf for a row with no key).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "kernels/attention/forward.h"
#include "kernels/attention/mma.cuh"
#include "kernels/attention/tile_config.h"
#include "kernels/attention/tile_io.cuh"

namespace tpf::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <typename T, int D>
struct ForwardSmem {
  static constexpr int LD = D + kPad;
  static constexpr int LDB = kTileK + kPad;
  T q[kTileQ * LD];
  T k[2][kTileK * LD];
  T v[2][kTileK * LD];
  T bias[2][kTileQ * LDB];
  uint8_t key_ok[2][kTileK];
};

template <typename T, int D>
__global__ void __launch_bounds__(kForwardWarps * 32)
    attention_forward_kernel(const AttentionForwardParams p) {
  static_assert(D % 16 == 0, "the head dimension is a whole number of MMA k-steps");
  using S = ForwardSmem<T, D>;
  constexpr int LD = S::LD, LDB = S::LDB, THREADS = kForwardWarps * 32;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  S& sm = *reinterpret_cast<S*>(smem_raw);

  const int n = blockIdx.x, q0 = blockIdx.y * kTileQ;
  const int b = blockIdx.z / p.H, h = blockIdx.z % p.H;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int qrows = min(kTileQ, p.Sq - q0);

  const T* q = static_cast<const T*>(p.q) + b * p.q_stride.b + n * p.q_stride.n + h * p.q_stride.h;
  const T* k = static_cast<const T*>(p.k) + b * p.k_stride.b + n * p.k_stride.n + h * p.k_stride.h;
  const T* v = static_cast<const T*>(p.v) + b * p.v_stride.b + n * p.v_stride.n + h * p.v_stride.h;
  const T* bias = static_cast<const T*>(p.bias) + b * p.bias_stride_b + h * p.bias_stride_h +
                  q0 * p.bias_stride_q;
  const uint8_t* mask = p.mask ? p.mask + b * p.mask_stride_b + n * p.mask_stride_n : nullptr;
  const T* safe = static_cast<const T*>(p.q);

  auto load_keys = [&](int kt, int stage) {
    const int k0 = kt * kTileK, krows = min(kTileK, p.Sk - k0);
    load_tile<T, kTileK, D, THREADS>(sm.k[stage], k + k0 * p.k_stride.s, p.k_stride.s, krows, D,
                                     p.qkv_aligned, safe);
    load_tile<T, kTileK, D, THREADS>(sm.v[stage], v + k0 * p.v_stride.s, p.v_stride.s, krows, D,
                                     p.qkv_aligned, safe);
    load_tile<T, kTileQ, kTileK, THREADS>(sm.bias[stage], bias + k0, p.bias_stride_q, qrows, krows,
                                          p.bias_aligned, safe);
    for (int j = threadIdx.x; j < kTileK; j += THREADS)
      sm.key_ok[stage][j] = j < krows && (mask == nullptr || mask[k0 + j] != 0);
  };

  load_tile<T, kTileQ, D, THREADS>(sm.q, q + q0 * p.q_stride.s, p.q_stride.s, qrows, D,
                                   p.qkv_aligned, safe);
  load_keys(0, 0);
  cp_async_commit();

  // Per thread: rows r0 = warp*16 + lane/4 and r0 + 8 of the tile.
  uint32_t qf[D / 16][4];
  float o[D / 8][4];
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;

  const float scale_log2 = p.scale * kLog2e;
  const int key_tiles = (p.Sk + kTileK - 1) / kTileK;
  for (int kt = 0; kt < key_tiles; ++kt) {
    const int stage = kt & 1;
    if (kt + 1 < key_tiles) {
      load_keys(kt + 1, stage ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (kt == 0) {
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) load_a(qf[ks], sm.q, LD, warp * kWarpRows, ks * 16);
    }

    // s = q k^T for this warp's 16 rows x 64 keys.
    float s[kTileK / 8][4];
#pragma unroll
    for (int j = 0; j < kTileK / 8; ++j) {
      s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t bf[2];
        load_b_nk(bf, sm.k[stage], LD, j * 8, ks * 16);
        Mma<T>::run(s[j], qf[ks], bf);
      }
    }

    // Scale, bias, mask (log2 domain) and the running row maxima.
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < kTileK / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = warp * kWarpRows + (lane >> 2) + (e >> 1) * 8;
        const int col = j * 8 + (lane & 3) * 2 + (e & 1);
        const float x = sm.key_ok[stage][col]
                            ? fmaf(s[j][e], scale_log2,
                                   to_float(sm.bias[stage][row * LDB + col]) * kLog2e)
                            : -INFINITY;
        s[j][e] = x;
        tile_max[e >> 1] = fmaxf(tile_max[e >> 1], x);
      }
    }
    float correction[2], m_use[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
      const float m_new = fmaxf(m[r], tile_max[r]);
      m_use[r] = m_new == -INFINITY ? 0.f : m_new;  // a row with no key yet stays at zero
      correction[r] = exp2f(m[r] - m_use[r]);
      m[r] = m_new;
      l[r] *= correction[r];
    }
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      o[i][0] *= correction[0];
      o[i][1] *= correction[0];
      o[i][2] *= correction[1];
      o[i][3] *= correction[1];
    }
    // p = exp2(s - m); o += p v, with p rounded to the input dtype for the MMA.
#pragma unroll
    for (int kk = 0; kk < kTileK / 16; ++kk) {
      uint32_t pa[4];
      float pv[8];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float x = exp2f(s[2 * kk + half][e] - m_use[e >> 1]);
          pv[half * 4 + e] = x;
          l[e >> 1] += x;
        }
      }
      pa[0] = Mma<T>::pack(pv[0], pv[1]);
      pa[1] = Mma<T>::pack(pv[2], pv[3]);
      pa[2] = Mma<T>::pack(pv[4], pv[5]);
      pa[3] = Mma<T>::pack(pv[6], pv[7]);
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        uint32_t bf[2];
        load_b_kn(bf, sm.v[stage], LD, kk * 16, i * 8);
        Mma<T>::run(o[i], pa, bf);
      }
    }
    __syncthreads();  // the next iteration's loads overwrite this stage
  }

  // Finish: row sums across the quad, normalize, write O, its residual and the log-sum-exp.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  T* out = static_cast<T*>(p.o) + b * p.o_stride.b + n * p.o_stride.n + h * p.o_stride.h;
  __nv_bfloat16* res = p.residual ? static_cast<__nv_bfloat16*>(p.residual) +
                                        b * p.residual_stride.b + n * p.residual_stride.n +
                                        h * p.residual_stride.h
                                  : nullptr;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = q0 + warp * kWarpRows + (lane >> 2) + r * 8;
    if (row >= p.Sq) continue;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      const int col = i * 8 + (lane & 3) * 2;
      const float x0 = o[i][2 * r] * inv, x1 = o[i][2 * r + 1] * inv;
      const T y0 = from_float<T>(x0), y1 = from_float<T>(x1);
      T* dst = out + row * p.o_stride.s + col;
      dst[0] = y0;
      dst[1] = y1;
      if (res) {
        __nv_bfloat16* rd = res + row * p.residual_stride.s + col;
        rd[0] = __float2bfloat16_rn(x0 - to_float(y0));
        rd[1] = __float2bfloat16_rn(x1 - to_float(y1));
      }
    }
    if ((lane & 3) == 0) {
      const float lse = l[r] > 0.f ? (m[r] + log2f(l[r])) * kLn2 : INFINITY;
      p.lse[b * p.lse_stride_b + n * p.lse_stride_n + h * p.lse_stride_h + row * p.lse_stride_s] =
          lse;
    }
  }
}

template <typename T, int D>
void launch(const AttentionForwardParams& p, cudaStream_t stream) {
  const size_t smem = sizeof(ForwardSmem<T, D>);
  auto kernel = attention_forward_kernel<T, D>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  const dim3 grid(p.N, (p.Sq + kTileQ - 1) / kTileQ, p.B * p.H);
  kernel<<<grid, kForwardWarps * 32, smem, stream>>>(p);
}

}  // namespace

template <typename T>
void attention_forward_launch(const AttentionForwardParams& p, int head_dim, cudaStream_t stream) {
  switch (head_dim) {
    case 16: return launch<T, 16>(p, stream);
    case 32: return launch<T, 32>(p, stream);
    case 64: return launch<T, 64>(p, stream);
  }
}

template void attention_forward_launch<__nv_bfloat16>(const AttentionForwardParams&, int, cudaStream_t);
template void attention_forward_launch<__half>(const AttentionForwardParams&, int, cudaStream_t);

}  // namespace tpf::cuda
