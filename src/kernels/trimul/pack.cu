// Small kernels around the fused ones: packing the weights (float32, bfloat16 or float16, read in
// their own dtype) into the blocks the kernels load (T, zero padded) and the biases and LayerNorm
// weights into float32, the ordered sum of the backward's per-CTA partials, and the gradients
// assembled from those sums (in the weights' dtype).
#include "kernels/common/column_sums.cuh"
#include "kernels/trimul/device.cuh"
#include "kernels/trimul/launch.h"

namespace tpf::cuda::trimul {
namespace {

// Element i of a weight of element type W, as a float (exact: W is at most 32 bits wide).
template <typename W>
__device__ __forceinline__ float weight_at(const void* w, int64_t i) {
  return to_f(static_cast<const W*>(w)[i]);
}

// w_in block q < input_chunks, row t: Wp_in row q * kChunkChannels + t for t < kChunkChannels,
// else Wg_in row q * kChunkChannels + t - kChunkChannels; the last block is Wg_out. w_out is
// Wp_out. Everything past D (rows or columns) is zero. The four LayerNorm vectors go to `norms`.
template <typename T, typename W>
__global__ void pack_weights_kernel(const Params p, const PackArgs a) {
  const int64_t D = p.D, Dp = p.Dp;
  const int64_t in_count = int64_t(p.input_chunks + 1) * kChunkN * Dp;
  const int64_t out_count = Dp * Dp;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  T* w_in = static_cast<T*>(a.w_in);
  T* w_out = static_cast<T*>(a.w_out);
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < in_count;
       idx += stride) {
    const int64_t row = idx / Dp, c = idx % Dp, q = row / kChunkN, t = row % kChunkN;
    float v = 0.0f;
    if (c < D) {
      if (q < p.input_chunks) {
        const int64_t o = q * kChunkChannels + t % kChunkChannels;
        if (o < 2 * D) v = weight_at<W>(t < kChunkChannels ? a.p_in : a.g_in, o * D + c);
      } else if (t < D) {
        v = weight_at<W>(a.g_out, t * D + c);
      }
    }
    w_in[idx] = from_f<T>(v);
  }
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < out_count;
       idx += stride) {
    const int64_t o = idx / Dp, c = idx % Dp;
    w_out[idx] = from_f<T>(o < D && c < D ? weight_at<W>(a.p_out, o * D + c) : 0.0f);
  }
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < 10 * D; idx += stride) {
    if (idx < 4 * D) {
      const void* b = a.bias[idx < 2 * D ? 0 : 1];
      a.bias_in[idx] = b ? weight_at<W>(b, idx % (2 * D)) : 0.0f;
    } else if (idx < 6 * D) {
      const int64_t k = idx - 4 * D;
      const void* b = a.bias[k < D ? 2 : 3];
      a.bias_out[k] = b ? weight_at<W>(b, k % D) : 0.0f;
    } else {
      const int64_t k = idx - 6 * D;
      a.norms[k] = weight_at<W>(a.norm[k / D], k % D);
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

// blockIdx.y picks the segment, blockIdx.x a group of kColumnSumCols columns, summed in double
// (hundreds of partials, each already a sum of many rows) in a fixed order.
__global__ void __launch_bounds__(kColumnSumCols* kColumnSumRowGroups)
    reduce_sums_kernel(const SumSegments segs, double* sums) {
  const SumSegment seg = segs.s[blockIdx.y];
  const int c0 = int(blockIdx.x) * kColumnSumCols;
  if (c0 >= seg.cols) return;  // the whole block, before the barrier inside
  double sum;
  if (ordered_column_sum(seg.partials, seg.rows, seg.cols, seg.cols, c0, sum))
    sums[seg.offset + c0 + threadIdx.x] = sum;
}

// Thread g of the grid: element g of dw_in | dw_out (split into the four weight gradients); the
// first D threads also give channel g's LayerNorm weight gradients and the first 2D the projection
// bias ones; warp c < D gives channel c's LayerNorm bias gradients, which are dot products over
// the D or 2D rows of a weight's column (lane l takes rows l, l + 32, ... in order, then a fixed
// butterfly over the lanes: deterministic; one thread walking all 3D rows was latency-bound at
// ~0.09-0.17 ms). Everything is computed as in float32 and rounded once to W at the store.
template <typename W>
__global__ void finish_backward_kernel(const FinishArgs a) {
  using C = SumColumns;
  const int D = a.D;
  const int64_t g = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const double* sums = a.sums;
  auto store = [](void* dst, int64_t i, float v) { static_cast<W*>(dst)[i] = from_f<W>(v); };
  auto weight = [](const void* w, int64_t i) { return double(weight_at<W>(w, i)); };
  const int64_t in_block = int64_t(2) * D * D, dw_in_count = int64_t(5) * D * D;
  if (g < dw_in_count) {
    const float v = a.dw_in[g];
    if (g < in_block)
      store(a.d_p_in_weight, g, v);
    else if (g < 2 * in_block)
      store(a.d_g_in_weight, g - in_block, v);
    else
      store(a.d_g_out_weight, g - 2 * in_block, v);
  } else if (g < dw_in_count + int64_t(D) * D) {
    store(a.d_p_out_weight, g - dw_in_count, a.dw_out[g - dw_in_count]);
  }
  if (g < 2 * D) {
    if (a.d_p_in_bias) store(a.d_p_in_bias, g, float(sums[C::kPInBias * D + g]));
    if (a.d_g_in_bias) store(a.d_g_in_bias, g, float(sums[C::kGInBias * D + g]));
  }
  if (g < D) {
    const int c = int(g);
    if (a.d_p_out_bias) store(a.d_p_out_bias, c, float(sums[C::kPOutBias * D + c]));
    if (a.d_g_out_bias) store(a.d_g_out_bias, c, float(sums[C::kGOutBias * D + c]));
    store(a.d_norm_out_weight, c, float(sums[C::kNormOutWeight * D + c]));
    store(a.d_norm_in_weight, c, float(sums[C::kNormInWeight * D + c]));
  }
  // The launch has max(6 D^2, 256) >= 32 D threads in whole blocks: warps 0 .. D-1 are all full.
  const int64_t warp = g / 32;
  if (warp < D) {  // warp-uniform
    const int c = int(warp), lane = int(threadIdx.x % 32);
    double out_bias = 0.0, in_bias = 0.0;
#pragma unroll 4
    for (int o = lane; o < D; o += 32) {
      out_bias += weight(a.p_out_weight, int64_t(o) * D + c) * sums[C::kPOutBias * D + o];
      in_bias += weight(a.g_out_weight, int64_t(o) * D + c) * sums[C::kGOutBias * D + o];
    }
#pragma unroll 4
    for (int k = lane; k < 2 * D; k += 32)
      in_bias += weight(a.p_in_weight, int64_t(k) * D + c) * sums[C::kPInBias * D + k] +
                 weight(a.g_in_weight, int64_t(k) * D + c) * sums[C::kGInBias * D + k];
      // Butterfly: each step adds two values in either order (the same bits), so every lane ends
      // with the same sum.
#pragma unroll
    for (int s = 16; s > 0; s /= 2) {
      out_bias += __shfl_xor_sync(0xffffffffu, out_bias, s);
      in_bias += __shfl_xor_sync(0xffffffffu, in_bias, s);
    }
    if (lane == 0) {
      store(a.d_norm_out_bias, c, float(out_bias));
      store(a.d_norm_in_bias, c, float(in_bias));
    }
  }
}

}  // namespace

namespace {
template <typename T, typename W>
void launch_pack_weights_as(const Params& p, const PackArgs& a, cudaStream_t stream) {
  pack_weights_kernel<T, W><<<64, kThreads, 0, stream>>>(p, a);
  check_launch("trimul pack_weights");
}
}  // namespace

template <typename T>
void launch_pack_weights(const Params& p, const PackArgs& a, cudaStream_t stream) {
  with_float_type(
      a.dtype, [&](auto w) { launch_pack_weights_as<T, decltype(w)>(p, a, stream); },
      "trimul pack_weights: the weights");
}

template void launch_pack_weights<float>(const Params&, const PackArgs&, cudaStream_t);
template void launch_pack_weights<__nv_bfloat16>(const Params&, const PackArgs&, cudaStream_t);
template void launch_pack_weights<__half>(const Params&, const PackArgs&, cudaStream_t);

void launch_reduce_sums(const Params& p, cudaStream_t stream) {
  using C = SumColumns;
  const int D = int(p.D), grid = p.grid_backward, grid_in = p.grid_input_backward;
  const SumSegments segs{{{p.partials_norm_out, kWarps * grid, D, C::kNormOutWeight * D},
                          {p.partials_bias_out, 2 * grid, 2 * D, C::kPOutBias * D},
                          {p.partials_norm_in, kWarps * grid_in, D, C::kNormInWeight * D},
                          {p.partials_bias_in, 2 * grid_in, 4 * D, C::kPInBias * D}}};
  static_assert(C::kGOutBias == C::kPOutBias + 1 && C::kGInBias == C::kPInBias + 2,
                "each bias segment holds its P and G halves back to back");
  reduce_sums_kernel<<<dim3(unsigned(ceil_div(4 * D, kColumnSumCols)), SumSegments::kCount),
                       dim3(kColumnSumCols, kColumnSumRowGroups), 0, stream>>>(segs, p.sums);
  check_launch("trimul reduce_sums");
}

void launch_finish_backward(const FinishArgs& a, cudaStream_t stream) {
  constexpr int kBlock = 256;
  const int64_t threads = int64_t(6) * a.D * a.D;
  const unsigned grid = unsigned((threads + kBlock - 1) / kBlock);
  with_float_type(
      a.dtype, [&](auto w) { finish_backward_kernel<decltype(w)><<<grid, kBlock, 0, stream>>>(a); },
      "trimul finish_backward: the weights");
  check_launch("trimul finish_backward");
}

}  // namespace tpf::cuda::trimul
