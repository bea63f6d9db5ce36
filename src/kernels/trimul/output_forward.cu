// Fused output kernel: LayerNorm_out, the output projection and the output gate. One CTA per tile.
//
//   Z  [kRows, Dp]     z of the tile (T), transposed from channel-major
//   X  [kRows, Dp]     z_ln (T)
//   W  [Dp, Dp]        p_out_weight (T)
//   C  [kRows, kLdC]   z_ln Wp_out^T (fp32)
// y = sigmoid(go) * (C + bp_out), row-major.
#include "kernels/trimul/device.cuh"
#include "kernels/trimul/layer_norm.cuh"
#include "kernels/trimul/launch.h"

namespace tpf::cuda::trimul {
namespace {

template <typename T>
struct OutputForwardSmem {
  T* z;
  T* x;
  T* w;
  float* c;
  size_t bytes;
  __host__ __device__ OutputForwardSmem(unsigned char* base, int Dp) {
    SmemCarver s{base};
    c = s.take<float>(size_t(kRows) * kLdC);
    z = s.take<T>(size_t(kRows) * (Dp + kPad));
    x = s.take<T>(size_t(kRows) * (Dp + kPad));
    w = s.take<T>(size_t(Dp) * (Dp + kPad));
    bytes = s.at;
  }
};

template <typename T, bool kFast>
__global__ void __launch_bounds__(kThreads, 2) output_forward_kernel(const Params p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  OutputForwardSmem<T> s(smem_raw, p.Dp);
  const Tile tile(blockIdx.x, p);
  const int ld = p.Dp + kPad, D = int(p.D);

  copy_tile_async(s.w, ld, static_cast<const T*>(p.w_out), p.Dp, p.Dp, p.Dp);
  load_channel_major_tile(p, tile, static_cast<const T*>(p.z), s.z, ld);
  __syncthreads();

  normalize_output_rows(p, tile, s.z, s.x, ld, nullptr, nullptr, static_cast<T*>(nullptr));
  cp_async_wait_all();
  __syncthreads();

  WarpTileFor<T, kFast> acc;
  acc.zero();
  acc.template mma<WLayout::kNK>(s.x, ld, s.w, ld, p.Dp, p.Dp);
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
      y[(tile.row0 + r) * D + c] =
          from_f<T>(sigmoid_t<T, kFast>(g[k]) * (s.c[r * kLdC + c] + bias));
  }
}

}  // namespace

template <typename T>
void launch_output_forward(const Params& p, cudaStream_t stream) {
  const size_t smem = OutputForwardSmem<T>(nullptr, p.Dp).bytes;
  const auto kernel = fast_variant() ? output_forward_kernel<T, kHasFast<T>>
                                     : output_forward_kernel<T, false>;
  set_max_smem(kernel, smem);
  kernel<<<dim3(unsigned(p.tiles)), kThreads, smem, stream>>>(p);
  check_launch("trimul output_forward");
}

TPF_TRIMUL_INSTANTIATE(launch_output_forward)

}  // namespace tpf::cuda::trimul
