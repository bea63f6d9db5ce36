// Fused input kernel: LayerNorm_in, the five projections (P and G of a and b, the output gate
// logits), gates and mask, in one pass over x. One CTA per tile of kRows positions. Step
// q < input_chunks writes a and b channel-major; the last step writes go row-major. The next
// block's weights load while the epilogue runs. One kernel for float32, one for 16-bit types.
//
// float32 (GEMMs on the CUDA cores, IEEE sigmoid, 2 CTAs per SM):
//   X  [kRows, Dp]     x_ln, the A operand of every step
//   W  [kChunkN, Dp]   one packed weight block: kChunkChannels rows of Wp_in, then the same
//                      rows of Wg_in; the last block is Wg_out
//   C  [kChunkN, kLdCT] the product of a step q < input_chunks (transposed: column-major reads
//                      for the channel-major a and b); [kRows, kLdC] for the last step
#include "kernels/trimul/device.cuh"
#include "kernels/trimul/launch.h"
#include "kernels/trimul/layer_norm.cuh"

namespace tpf::cuda::trimul {
namespace {

struct InputForwardF32Smem {
  float* x;
  float* w;
  float* c;
  float* mask;
  size_t bytes;
  __host__ __device__ InputForwardF32Smem(unsigned char* base, int Dp) {
    SmemCarver s{base};
    take_step_operands(s, Dp, x, w);
    c = s.take<float>(kStagingFloats);
    mask = s.take<float>(kRows);
    bytes = s.at;
  }
};

__global__ void __launch_bounds__(kThreads, kF32Ctas) input_forward_f32_kernel(const Params p) {
  using T = float;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  InputForwardF32Smem s(smem_raw, p.Dp);
  const Tile tile(blockIdx.x, p);
  const int ld = p.Dp + kPad, D = int(p.D);
  const T* w_in = static_cast<const T*>(p.w_in);

  copy_tile_async(s.w, ld, w_in, p.Dp, kChunkN, p.Dp);
  normalize_input_rows(p, tile, s.x, ld, s.mask, nullptr, nullptr);

  for (int q = 0; q <= p.input_chunks; ++q) {
    const bool gate_step = q == p.input_chunks;
    WarpTileF32 acc;
    wait_and_multiply(acc, s.x, s.w, ld, p.Dp, kChunkN);
    if (gate_step)
      acc.store(s.c, kLdC, kChunkN);
    else
      acc.store_col_major(s.c, kLdCT, kChunkN);
    __syncthreads();
    if (!gate_step)
      copy_tile_async(s.w, ld, w_in + int64_t(q + 1) * kChunkN * p.Dp, p.Dp, kChunkN, p.Dp);

    if (!gate_step) {
      // a | b = sigmoid(G) * P * mask, channel-major: thread t takes row t % kRows of channels
      // t / kRows + (kThreads / kRows) k, so a warp reads one column of C over consecutive rows
      // and writes consecutive j.
      const int r = threadIdx.x % kRows, cl0 = threadIdx.x / kRows;
      constexpr int kStep = kThreads / kRows;
      constexpr int kIters = kChunkChannels / kStep;
      const float m = s.mask[r];
      // The biases first: each is a dependent L1 round trip when loaded next to its use.
      float bias_p[kIters], bias_g[kIters];
#pragma unroll
      for (int k = 0; k < kIters; ++k) {
        const int c = q * kChunkChannels + cl0 + kStep * k;
        bias_p[k] = c < 2 * D ? p.bias_in[c] : 0.0f;
        bias_g[k] = c < 2 * D ? p.bias_in[2 * D + c] : 0.0f;
      }
#pragma unroll
      for (int k = 0; k < kIters; ++k) {
        const int cl = cl0 + kStep * k;
        const int c = q * kChunkChannels + cl;
        if (c >= 2 * D || r >= tile.n) continue;
        const float pv = s.c[cl * kLdCT + r] + bias_p[k];
        const float gv = s.c[(kChunkChannels + cl) * kLdCT + r] + bias_g[k];
        T* dst = static_cast<T*>(c < D ? p.a : p.b);
        dst[tile.channel_major(p, c < D ? c : c - D, r)] = from_f<T>(sigmoid(gv) * pv * m);
      }
    } else {
      // Output gate logits, row-major: consecutive threads take consecutive channels.
      T* go = static_cast<T*>(p.go);
#pragma unroll 4
      for (int idx = threadIdx.x; idx < kRows * kChunkN; idx += kThreads) {
        const int r = idx / kChunkN, c = idx % kChunkN;
        if (c < D && r < tile.n)
          go[(tile.row0 + r) * D + c] = from_f<T>(s.c[r * kLdC + c] + p.bias_out[D + c]);
      }
    }
  }
}

// ---- 16-bit types: the same work at 3 CTAs per SM (mma.sync GEMMs, the epilogues from the MMA
// registers, the fast sigmoid).
//
//   X  [kRows, Dp]       x_ln (T)
//   W  [kChunkN, Dp]     one packed weight block (T); a/b blocks with their rows interleaved
//                        (InterleavePG) so that a warp's two 16-column halves are P and G of the
//                        same 16 channels, and the epilogue takes both from its own registers
//   St [kRows, kLdSt]    the step's results in T: a | b transposed ([channel][row], row stride
//                        kRows + kPad), go row-major; written out in 16-byte pieces
// No fp32 staging (34 KB less shared memory: 68 KB per CTA at D = 128) and at most 80 registers.

template <typename T>
struct InputForward16BitSmem {
  T* x;
  T* w;
  T* st;
  float* mask;
  size_t bytes;
  __host__ __device__ InputForward16BitSmem(unsigned char* base, int Dp) {
    SmemCarver s{base};
    take_step_operands(s, Dp, x, w);
    st = s.take<T>(size_t(kRows) * kLdSt);
    mask = s.take<float>(kRows);
    bytes = s.at;
  }
};

// kD: static D (64 or 128; Dims), or 0 for D from Params.
template <typename T, int kD>
__global__ void __launch_bounds__(kThreads, k16BitCtas) input_forward_16bit_kernel(const Params p) {
  using Acc = WarpTileLdsm<T>;
  using Dm = Dims<kD>;
  constexpr int kLdAB = kRows + kPad;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const int D = Dm::D(p), Dp = Dm::Dp(p), ld = Dm::ld(p), chunks = Dm::chunks(p);
  InputForward16BitSmem<T> s(smem_raw, Dp);
  const Tile tile = tile_at<true>(blockIdx.x, p);  // grids of at most 2^31 - 1 tiles
  const T* w_in = static_cast<const T*>(p.w_in);

  copy_weight_async<kD, kChunkN>(s.w, w_in, Dp, kChunkN, InterleavePG{});
  normalize_input_rows<kD>(p, tile, s.x, ld, s.mask, nullptr, nullptr);
  // Channel (within the step) of this thread's a | b elements acc[i][0 or 1][h][e].
  const int cl_base = (threadIdx.x / 32 >> 1) * 16 + 2 * (threadIdx.x & 3);

  for (int q = 0; q <= chunks; ++q) {
    const bool gate_step = q == chunks;
    // This thread's biases before the GEMM, which hides their latency: [j][h][e % 2] = the P and
    // G biases of channel cl_base + 8 h + e % 2 (a | b steps) or go column Acc::col(j, h, e).
    float bias[2][2][2];
    if (gate_step) {
      Acc::column_values(p.bias_out + D, D, bias);
    } else {
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int c = q * kChunkChannels + cl_base + 8 * h + e;
            bias[j][h][e] = Dm::ab_channel(c, D) ? p.bias_in[j * 2 * D + c] : 0.0f;
          }
    }
    Acc acc;
    wait_and_multiply(acc, s.x, s.w, ld, Dp, kChunkN);
    __syncthreads();
    if (q + 1 < chunks)
      copy_weight_async<kD, kChunkN>(s.w, w_in + int64_t(q + 1) * kChunkN * Dp, Dp, kChunkN,
                                     InterleavePG{});
    else if (!gate_step)
      copy_weight_async<kD, kChunkN>(s.w, w_in + int64_t(q + 1) * kChunkN * Dp, Dp, kChunkN);

    if (!gate_step) {
      // a | b = sigmoid(G) * P * mask into St transposed, then channel-major to global.
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = Acc::row(i, e), cl = cl_base + 8 * h + (e & 1);
            const float pv = acc.acc[i][0][h][e] + bias[0][h][e & 1];
            const float gv = acc.acc[i][1][h][e] + bias[1][h][e & 1];
            s.st[cl * kLdAB + r] = from_f<T>(sigmoid_fast(gv) * pv * s.mask[r]);
          }
      __syncthreads();
      // Channel c of a | b at dst + c * plane (a for c < D, b past it); static D: the step's
      // channels are all in a or all in b (D is a multiple of kChunkChannels).
      const int64_t plane = p.S * p.S;
      const int64_t origin = tile.channel_major(p, D, 0, 0);
      if constexpr (Dm::kStatic) {
        const int c0 = q * kChunkChannels;
        T* dst = (c0 < D ? static_cast<T*>(p.a) + origin + c0 * plane
                         : static_cast<T*>(p.b) + origin + (c0 - D) * plane);
        const auto row = [=](int cl) -> T* { return dst + cl * plane; };
        // Whole in full tiles where S % 8 == 0 (every channel's 64 positions 16-byte aligned).
        store_staged_tile<true, kChunkChannels, kRows, true>(tile.n == kRows && p.S % 8 == 0, s.st,
                                                             kLdAB, tile.n, row, row);
      } else {
        store_staged_rows<kChunkChannels, kRows, true>(s.st, kLdAB, tile.n, [=](int cl) -> T* {
          const int c = q * kChunkChannels + cl;
          if (c >= 2 * D) return nullptr;
          return static_cast<T*>(c < D ? p.a : p.b) + tile.channel_major(p, c < D ? c : c - D, 0);
        });
      }
    } else {
      // Output gate logits, row-major.
      Acc::template for_each_element<2>([&](int i, int j, int h, int e) {
        store_pair(s.st + Acc::row(i, e) * kLdSt + Acc::col(j, h, e),
                   acc.acc[i][j][h][e] + bias[j][h][0], acc.acc[i][j][h][e + 1] + bias[j][h][1]);
      });
      __syncthreads();
      T* go = static_cast<T*>(p.go) + tile.row0 * D;
      const int n = tile.n;
      store_staged_tile<Dm::kStatic, kRows, kD ? kD : kChunkN, true, true>(
          n == kRows, s.st, kLdSt, D, [=](int r) -> T* { return go + r * D; },
          [=](int r) -> T* { return r < n ? go + r * D : nullptr; });
    }
  }
}

}  // namespace

template <typename T>
void launch_input_forward(const Params& p, cudaStream_t stream) {
  if constexpr (kIsF32<T>)
    launch_kernel(input_forward_f32_kernel, dim3(unsigned(p.tiles)),
                  InputForwardF32Smem(nullptr, p.Dp).bytes, p, stream, "trimul input_forward");
  else
    with_static_d(p, [&](auto d) {
      launch_kernel(input_forward_16bit_kernel<T, d.value>, dim3(unsigned(p.tiles)),
                    InputForward16BitSmem<T>(nullptr, p.Dp).bytes, p, stream,
                    "trimul input_forward");
    });
}

TPF_TRIMUL_INSTANTIATE(launch_input_forward)

}  // namespace tpf::cuda::trimul
