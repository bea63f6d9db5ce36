// Small kernels around the fused ones: packing the float32 weights into the blocks the kernels
// load (T, zero padded), the ordered sum of the backward's per-CTA partials, and the float32
// gradients assembled from those sums.
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

// One segment of partials: rows x cols, summed over rows into sums[offset + c].
struct SumSegment {
  const float* partials;
  int rows, cols, offset;
};
struct SumSegments {
  static constexpr int kCount = 4;
  SumSegment s[kCount];
};

// blockIdx.y picks the segment. In double: hundreds of partials, each already a sum of many rows.
__global__ void reduce_sums_kernel(const SumSegments segs, double* sums) {
  const SumSegment seg = segs.s[blockIdx.y];
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= seg.cols) return;
  double acc = 0.0;
  for (int r = 0; r < seg.rows; ++r) acc += seg.partials[int64_t(r) * seg.cols + c];
  sums[seg.offset + c] = acc;
}

// Thread g of the grid: element g of dw_in (split into the three weight gradients); the first D
// threads also give channel g's LayerNorm gradients and the first 2D the projection bias ones.
__global__ void finish_backward_kernel(const FinishArgs a) {
  using C = SumColumns;
  const int D = a.D;
  const int64_t g = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const double* sums = a.sums;
  if (g < int64_t(5) * D * D) {
    const int64_t in_block = int64_t(2) * D * D;
    const float v = a.dw_in[g];
    if (g < in_block) a.d_p_in_weight[g] = v;
    else if (g < 2 * in_block) a.d_g_in_weight[g - in_block] = v;
    else a.d_g_out_weight[g - 2 * in_block] = v;
  }
  if (g < 2 * D) {
    if (a.d_p_in_bias) a.d_p_in_bias[g] = float(sums[C::kPInBias * D + g]);
    if (a.d_g_in_bias) a.d_g_in_bias[g] = float(sums[C::kGInBias * D + g]);
  }
  if (g < D) {
    const int c = int(g);
    if (a.d_p_out_bias) a.d_p_out_bias[c] = float(sums[C::kPOutBias * D + c]);
    if (a.d_g_out_bias) a.d_g_out_bias[c] = float(sums[C::kGOutBias * D + c]);
    a.d_norm_out_weight[c] = float(sums[C::kNormOutWeight * D + c]);
    a.d_norm_in_weight[c] = float(sums[C::kNormInWeight * D + c]);
    double out_bias = 0.0, in_bias = 0.0;
    for (int o = 0; o < D; ++o) {
      out_bias += double(a.p_out_weight[o * D + c]) * sums[C::kPOutBias * D + o];
      in_bias += double(a.g_out_weight[o * D + c]) * sums[C::kGOutBias * D + o];
    }
    for (int k = 0; k < 2 * D; ++k)
      in_bias += double(a.p_in_weight[k * D + c]) * sums[C::kPInBias * D + k] +
                 double(a.g_in_weight[k * D + c]) * sums[C::kGInBias * D + k];
    a.d_norm_out_bias[c] = float(out_bias);
    a.d_norm_in_bias[c] = float(in_bias);
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

void launch_reduce_sums(const Params& p, cudaStream_t stream) {
  using C = SumColumns;
  const int D = int(p.D), grid = p.grid_backward, grid_in = p.grid_input_backward;
  const SumSegments segs{{{p.partials_norm_out, kWarps * grid, D, C::kNormOutWeight * D},
                          {p.partials_bias_out, 2 * grid, 2 * D, C::kPOutBias * D},
                          {p.partials_norm_in, kWarps * grid_in, D, C::kNormInWeight * D},
                          {p.partials_bias_in, 2 * grid_in, 4 * D, C::kPInBias * D}}};
  static_assert(C::kGOutBias == C::kPOutBias + 1 && C::kGInBias == C::kPInBias + 2,
                "each bias segment holds its P and G halves back to back");
  constexpr int kBlock = 128;
  reduce_sums_kernel<<<dim3(unsigned((4 * D + kBlock - 1) / kBlock), SumSegments::kCount), kBlock,
                       0, stream>>>(segs, p.sums);
  check_launch("trimul reduce_sums");
}

void launch_finish_backward(const FinishArgs& a, cudaStream_t stream) {
  constexpr int kBlock = 256;
  const int64_t threads = int64_t(5) * a.D * a.D;
  finish_backward_kernel<<<unsigned((threads + kBlock - 1) / kBlock), kBlock, 0, stream>>>(a);
  check_launch("trimul finish_backward");
}

}  // namespace tpf::cuda::trimul
