// Fused output kernel: LayerNorm_out, the output projection and the output gate. One CTA per tile.
// y = sigmoid(go) * (z_ln Wp_out^T + bp_out), row-major. One kernel for float32, one for 16-bit
// types.
//
// float32 (GEMM on the CUDA cores, IEEE sigmoid, 2 CTAs per SM):
//   Z  [kRows, Dp]     z of the tile, transposed from channel-major
//   X  [kRows, Dp]     z_ln
//   W  [Dp, Dp]        p_out_weight
//   C  [kRows, kLdC]   z_ln Wp_out^T
#include "kernels/trimul/device.cuh"
#include "kernels/trimul/launch.h"
#include "kernels/trimul/layer_norm.cuh"

namespace tpf::cuda::trimul {
namespace {

struct OutputForwardF32Smem {
  float* z;
  float* x;
  float* w;
  float* c;
  size_t bytes;
  __host__ __device__ OutputForwardF32Smem(unsigned char* base, int Dp) {
    SmemCarver s{base};
    c = s.take<float>(size_t(kRows) * kLdC);
    z = s.take<float>(size_t(kRows) * (Dp + kPad));
    x = s.take<float>(size_t(kRows) * (Dp + kPad));
    w = s.take<float>(size_t(Dp) * (Dp + kPad));
    bytes = s.at;
  }
};

__global__ void __launch_bounds__(kThreads, kF32Ctas) output_forward_f32_kernel(const Params p) {
  using T = float;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  OutputForwardF32Smem s(smem_raw, p.Dp);
  const Tile tile(blockIdx.x, p);
  const int ld = p.Dp + kPad, D = int(p.D);

  copy_tile_async(s.w, ld, static_cast<const T*>(p.w_out), p.Dp, p.Dp, p.Dp);
  load_channel_major_tile(p, tile, static_cast<const T*>(p.z), s.z, ld);
  __syncthreads();

  normalize_output_rows(p, tile, s.z, s.x, ld, nullptr, nullptr, static_cast<T*>(nullptr));
  WarpTileF32 acc;
  wait_and_multiply(acc, s.x, s.w, ld, p.Dp, p.Dp);
  acc.store(s.c, kLdC, p.Dp);
  __syncthreads();

  // y = sigmoid(go) * (C + bp_out): thread t takes channel t % kChunkN of rows
  // t / kChunkN + (kThreads / kChunkN) k; all go loads first.
  const T* go = static_cast<const T*>(p.go);
  T* y = static_cast<T*>(p.y);
  const int c = threadIdx.x % kChunkN, r0 = threadIdx.x / kChunkN;
  constexpr int kStep = kThreads / kChunkN, kIters = kRows / kStep;
  float g[kIters];
#pragma unroll
  for (int k = 0; k < kIters; ++k) {
    const int r = r0 + kStep * k;
    g[k] = (c < D && r < tile.n) ? to_f(go[(tile.row0 + r) * D + c]) : 0.0f;
  }
  if (c >= D) return;
  const float bias = p.bias_out[c];
#pragma unroll
  for (int k = 0; k < kIters; ++k) {
    const int r = r0 + kStep * k;
    if (r < tile.n)
      y[(tile.row0 + r) * D + c] = from_f<T>(sigmoid(g[k]) * (s.c[r * kLdC + c] + bias));
  }
}

// ---- 16-bit types: the same work at 3 CTAs per SM (mma.sync GEMM, the epilogue from the MMA
// registers, the fast sigmoid).
//
//   ZX [kRows, Dp]     z of the tile, then z_ln in place
//   W  [Dp, Dp]        p_out_weight (T)
//   St [kRows, kLdSt]  the tile's go (asynchronous copy at the start), then y in place
// The epilogue takes the products from the MMA registers: no fp32 staging, 68 KB of shared memory
// per CTA at D = 128, at most 80 registers.

template <typename T>
struct OutputForward16BitSmem {
  T* zx;
  T* w;
  T* st;
  size_t bytes;
  __host__ __device__ OutputForward16BitSmem(unsigned char* base, int Dp) {
    SmemCarver s{base};
    zx = s.take<T>(size_t(kRows) * (Dp + kPad));
    w = s.take<T>(size_t(Dp) * (Dp + kPad));
    st = s.take<T>(size_t(kRows) * kLdSt);
    bytes = s.at;
  }
};

// kD: static D (64 or 128; Dims), or 0 for D from Params.
template <typename T, int kD>
__global__ void __launch_bounds__(kThreads, k16BitCtas)
    output_forward_16bit_kernel(const Params p) {
  using Acc = WarpTileLdsm<T>;
  using Dm = Dims<kD>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const int D = Dm::D(p), Dp = Dm::Dp(p), ld = Dm::ld(p);
  OutputForward16BitSmem<T> s(smem_raw, Dp);
  const Tile tile = tile_at<true>(blockIdx.x, p);  // grids of at most 2^31 - 1 tiles
  const T* go = static_cast<const T*>(p.go) + tile.row0 * D;

  copy_weight_async<kD, kD>(s.w, static_cast<const T*>(p.w_out), Dp, Dp);
  if (D % (16 / int(sizeof(T))) == 0) {
    copy_tile_async(s.st, kLdSt, go, D, tile.n, D);
  } else {
    for (int idx = threadIdx.x; idx < tile.n * D; idx += kThreads)
      s.st[idx / D * kLdSt + idx % D] = go[idx];
  }
  load_channel_major_tile<kD>(p, tile, static_cast<const T*>(p.z), s.zx, ld);
  __syncthreads();

  normalize_output_rows<kD>(p, tile, s.zx, s.zx, ld, nullptr, nullptr, static_cast<T*>(nullptr));
  // This thread's output biases before the GEMM, which hides their latency.
  float bias[2][2][2];
  Acc::column_values(p.bias_out, D, bias);
  Acc acc;
  wait_and_multiply(acc, s.zx, s.w, ld, Dp, Dp);

  // y = sigmoid(go) * (C + bp_out) in place of go in St (each element read and written by the
  // thread that owns it), then row-major to global.
  const int n = tile.n;
  Acc::for_each_element([&](int i, int j, int h, int e) {
    const int r = Acc::row(i, e), c = Acc::col(j, h, e);
    if (r < n && Dm::channel(c, D)) {
      T* at = s.st + r * kLdSt + c;
      *at = from_f<T>(sigmoid_fast(to_f(*at)) * (acc.acc[i][j][h][e] + bias[j][h][e & 1]));
    }
  });
  __syncthreads();
  T* y = static_cast<T*>(p.y) + tile.row0 * D;
  store_staged_tile<Dm::kStatic, kRows, kD ? kD : kChunkN, false, true>(
      n == kRows, s.st, kLdSt, D, [=](int r) -> T* { return y + r * D; },
      [=](int r) -> T* { return r < n ? y + r * D : nullptr; });
}

}  // namespace

template <typename T>
void launch_output_forward(const Params& p, cudaStream_t stream) {
  if constexpr (kIsF32<T>)
    launch_kernel(output_forward_f32_kernel, dim3(unsigned(p.tiles)),
                  OutputForwardF32Smem(nullptr, p.Dp).bytes, p, stream, "trimul output_forward");
  else
    with_static_d(p, [&](auto d) {
      launch_kernel(output_forward_16bit_kernel<T, d.value>, dim3(unsigned(p.tiles)),
                    OutputForward16BitSmem<T>(nullptr, p.Dp).bytes, p, stream,
                    "trimul output_forward");
    });
}

TPF_TRIMUL_INSTANTIATE(launch_output_forward)

}  // namespace tpf::cuda::trimul
