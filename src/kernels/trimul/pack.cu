// Small kernels around the fused ones: packing the float32 weights into the blocks the kernels
// load (T, zero padded), and the ordered sum of the backward's per-CTA column partials.
#include "kernels/trimul/device.cuh"
#include "kernels/trimul/launch.h"

namespace tpf::cuda::trimul {
namespace {

struct WeightPointers {
  const float* p_in;   // [2D, D]
  const float* g_in;   // [2D, D]
  const float* g_out;  // [D, D]
  const float* p_out;  // [D, D]
  const float* bias[4];  // p_in, g_in (2D each), p_out, g_out (D each); null = zero
};

// w_in block q < input_chunks, row t: Wp_in row q * kChunkChannels + t for t < kChunkChannels,
// else Wg_in row q * kChunkChannels + t - kChunkChannels; the last block is Wg_out. w_out is
// Wp_out. Everything past D (rows or columns) is zero.
template <typename T>
__global__ void pack_weights_kernel(const Params p, const WeightPointers w, T* w_in, T* w_out,
                                    float* bias_in, float* bias_out) {
  const int64_t D = p.D, Dp = p.Dp;
  const int64_t in_count = int64_t(p.input_chunks + 1) * kChunkN * Dp;
  const int64_t out_count = Dp * Dp;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < in_count; idx += stride) {
    const int64_t row = idx / Dp, c = idx % Dp, q = row / kChunkN, t = row % kChunkN;
    float v = 0.0f;
    if (c < D) {
      if (q < p.input_chunks) {
        const int64_t o = q * kChunkChannels + t % kChunkChannels;
        if (o < 2 * D) v = (t < kChunkChannels ? w.p_in : w.g_in)[o * D + c];
      } else if (t < D) {
        v = w.g_out[t * D + c];
      }
    }
    w_in[idx] = from_f<T>(v);
  }
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < out_count; idx += stride) {
    const int64_t o = idx / Dp, c = idx % Dp;
    w_out[idx] = from_f<T>(o < D && c < D ? w.p_out[o * D + c] : 0.0f);
  }
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < 6 * D; idx += stride) {
    if (idx < 4 * D) {
      const float* b = w.bias[idx < 2 * D ? 0 : 1];
      bias_in[idx] = b ? b[idx % (2 * D)] : 0.0f;
    } else {
      const int64_t k = idx - 4 * D;
      const float* b = w.bias[k < D ? 2 : 3];
      bias_out[k] = b ? b[k % D] : 0.0f;
    }
  }
}

__global__ void reduce_partials_kernel(const float* partials, int rows, int cols,
                                       const ColumnSinks sinks) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  // In double: hundreds of partials, each already a sum of many rows.
  double acc = 0.0;
  for (int r = 0; r < rows; ++r) acc += partials[int64_t(r) * cols + c];
  for (int k = 0; k < ColumnSinks::kMax; ++k) {
    if (c >= sinks.begin[k] && c < sinks.begin[k + 1]) {
      if (sinks.dst[k]) sinks.dst[k][c - sinks.begin[k]] = float(acc);
      return;
    }
  }
}

}  // namespace

template <typename T>
void launch_pack_weights(const Params& p, const float* const* weights, const float* const* biases,
                         void* w_in, void* w_out, float* bias_in, float* bias_out,
                         cudaStream_t stream) {
  const WeightPointers w{weights[0], weights[1], weights[2], weights[3],
                         {biases[0], biases[1], biases[2], biases[3]}};
  pack_weights_kernel<T><<<64, kThreads, 0, stream>>>(p, w, static_cast<T*>(w_in),
                                                      static_cast<T*>(w_out), bias_in, bias_out);
  check_launch("trimul pack_weights");
}

template void launch_pack_weights<float>(const Params&, const float* const*, const float* const*,
                                         void*, void*, float*, float*, cudaStream_t);
template void launch_pack_weights<__nv_bfloat16>(const Params&, const float* const*,
                                                 const float* const*, void*, void*, float*, float*,
                                                 cudaStream_t);
template void launch_pack_weights<__half>(const Params&, const float* const*, const float* const*,
                                          void*, void*, float*, float*, cudaStream_t);

void launch_reduce_partials(const float* partials, int rows, int cols, const ColumnSinks& sinks,
                            cudaStream_t stream) {
  reduce_partials_kernel<<<unsigned((cols + 127) / 128), 128, 0, stream>>>(partials, rows, cols,
                                                                           sinks);
  check_launch("trimul reduce_partials");
}

}  // namespace tpf::cuda::trimul
