// The fused glue kernels (tpf/glue.h): LayerNorm forward and backward (one warp per row, the row
// in registers), SwiGLU and the attention's output gate (elementwise, 16-byte accesses where the
// shapes and pointers allow). Every reduction runs in a fixed order: LayerNorm's weight gradients
// are summed per warp over a fixed set of rows, then over a block's warps, then over the blocks, so
// results are bitwise reproducible.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/common/column_sums.cuh"
#include "kernels/common/convert.cuh"
#include "kernels/common/device_guard.h"
#include "kernels/glue/api.h"
#include "tpf/error.h"

namespace tpf::cuda {
namespace {

using glue::Heads;
using glue::Rows;

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// LayerNorm backward's blocks: a fixed function of the row count (not of the device), so the
// order of the weight-gradient sums is too.
constexpr int64_t kMaxBackwardBlocks = 1024;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t backward_blocks(int64_t rows) {
  const int64_t b = ceil_div(rows, kWarps);
  return b < 1 ? 1 : b > kMaxBackwardBlocks ? kMaxBackwardBlocks : b;
}
unsigned grid_for(int64_t items, int64_t per_block) {
  const int64_t b = ceil_div(items, per_block);
  return unsigned(b < 1 ? 1 : b > (int64_t(1) << 20) ? (int64_t(1) << 20) : b);
}

// ---- LayerNorm -----------------------------------------------------------------------------

template <typename TX, typename TY, int PL>
__global__ void __launch_bounds__(kThreads)
    layer_norm_forward_kernel(const TX* __restrict__ x, Rows rows, int64_t n_rows, int C,
                              const float* __restrict__ w, const float* __restrict__ b, float eps,
                              TY* __restrict__ y, float* __restrict__ mean,
                              float* __restrict__ rstd) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * kWarps;
  const float inv_c = 1.0f / float(C);
  for (int64_t r = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5); r < n_rows; r += warps) {
    const TX* xr = x + rows.offset(r);
    float v[PL];
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < PL; ++i) {
      const int c = lane + 32 * i;
      v[i] = c < C ? to_float(xr[c]) : 0.0f;
      s += v[i];
    }
    const float m = warp_sum(s) * inv_c;
    float q = 0.0f;
#pragma unroll
    for (int i = 0; i < PL; ++i) {
      const int c = lane + 32 * i;
      const float d = c < C ? v[i] - m : 0.0f;
      q += d * d;
    }
    const float rs = rsqrtf(warp_sum(q) * inv_c + eps);
    TY* yr = y + r * C;
#pragma unroll
    for (int i = 0; i < PL; ++i) {
      const int c = lane + 32 * i;
      if (c < C) yr[c] = from_float<TY>((v[i] - m) * rs * w[c] + b[c]);
    }
    if (lane == 0) {
      mean[r] = m;
      rstd[r] = rs;
    }
  }
}

// partial [blocks][2C]: each block's sums of dy * xhat (dweight) and dy (dbias).
template <typename TX, typename TD, int PL>
__global__ void __launch_bounds__(kThreads)
    layer_norm_backward_kernel(const TD* __restrict__ dy, const TX* __restrict__ x, Rows rows,
                               int64_t n_rows, int C, const float* __restrict__ w,
                               const float* __restrict__ mean, const float* __restrict__ rstd,
                               TX* __restrict__ dx, float* __restrict__ partial) {
  extern __shared__ float smem[];  // [kWarps][2C]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t warps = int64_t(gridDim.x) * kWarps;
  const float inv_c = 1.0f / float(C);
  float dw[PL], db[PL];
#pragma unroll
  for (int i = 0; i < PL; ++i) dw[i] = db[i] = 0.0f;
  for (int64_t r = int64_t(blockIdx.x) * kWarps + warp; r < n_rows; r += warps) {
    const int64_t off = rows.offset(r);
    const TX* xr = x + off;
    const TD* dyr = dy + r * C;
    const float m = mean[r], rs = rstd[r];
    float xh[PL], g[PL];
    float sg = 0.0f, sgx = 0.0f;
#pragma unroll
    for (int i = 0; i < PL; ++i) {
      const int c = lane + 32 * i;
      float d = 0.0f;
      xh[i] = 0.0f;
      if (c < C) {
        d = to_float(dyr[c]);
        xh[i] = (to_float(xr[c]) - m) * rs;
        dw[i] += d * xh[i];
        db[i] += d;
        d *= w[c];
      }
      g[i] = d;
      sg += d;
      sgx += d * xh[i];
    }
    const float mg = warp_sum(sg) * inv_c, mgx = warp_sum(sgx) * inv_c;
    TX* dxr = dx + off;
#pragma unroll
    for (int i = 0; i < PL; ++i) {
      const int c = lane + 32 * i;
      if (c < C) dxr[c] = from_float<TX>(rs * (g[i] - mg - xh[i] * mgx));
    }
  }
#pragma unroll
  for (int i = 0; i < PL; ++i) {
    const int c = lane + 32 * i;
    if (c < C) {
      smem[warp * 2 * C + c] = dw[i];
      smem[warp * 2 * C + C + c] = db[i];
    }
  }
  __syncthreads();
  for (int k = threadIdx.x; k < 2 * C; k += kThreads) {
    float s = 0.0f;
    for (int v = 0; v < kWarps; ++v) s += smem[v * 2 * C + k];
    partial[int64_t(blockIdx.x) * 2 * C + k] = s;
  }
}

// The blocks' partials summed in FP64 in a fixed order (deterministic): a float sum of 1000-odd
// partials lost up to 4x PyTorch's accuracy on dweight (tests/gpu/test_glue_gpu.py).
__global__ void __launch_bounds__(kColumnSumCols* kColumnSumRowGroups)
    layer_norm_finish_kernel(const float* __restrict__ partial, int blocks, int C,
                             float* __restrict__ dweight, float* __restrict__ dbias) {
  const int c0 = int(blockIdx.x) * kColumnSumCols;
  double s;
  if (!ordered_column_sum(partial, blocks, 2 * C, 2 * C, c0, s)) return;
  const int k = c0 + int(threadIdx.x);
  if (k < C)
    dweight[k] = float(s);
  else
    dbias[k - C] = float(s);
}

template <typename F>
void with_per_lane(int C, F&& f) {
  if (C <= 128) return f(std::integral_constant<int, 4>{});
  if (C <= 256) return f(std::integral_constant<int, 8>{});
  if (C <= 512) return f(std::integral_constant<int, 16>{});
  return f(std::integral_constant<int, 32>{});
}

// ---- SwiGLU and the output gate: V elements per thread (16 bytes, or 1) -----------------------

template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <typename T, int V>
__device__ __forceinline__ void load(const T* p, float (&f)[V]) {
  const Pack<T, V> k = *reinterpret_cast<const Pack<T, V>*>(p);
#pragma unroll
  for (int i = 0; i < V; ++i) f[i] = to_float(k.v[i]);
}

template <typename T, int V>
__device__ __forceinline__ void store(T* p, const float (&f)[V]) {
  Pack<T, V> k;
#pragma unroll
  for (int i = 0; i < V; ++i) k.v[i] = from_float<T>(f[i]);
  *reinterpret_cast<Pack<T, V>*>(p) = k;
}

template <typename T, int V, bool Backward>
__global__ void __launch_bounds__(kThreads)
    swiglu_kernel(const T* __restrict__ ab, const T* __restrict__ dh, T* __restrict__ out,
                  int64_t M, int64_t H) {
  const int64_t per_row = H / V, n = M * per_row;
  for (int64_t e = int64_t(blockIdx.x) * kThreads + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * kThreads) {
    const int64_t m = e / per_row, j = (e % per_row) * V;
    float a[V], b[V];
    load<T, V>(ab + m * 2 * H + j, a);
    load<T, V>(ab + m * 2 * H + H + j, b);
    if constexpr (Backward) {
      float d[V], da[V], dbv[V];
      load<T, V>(dh + m * H + j, d);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float s = sigmoid(a[i]);
        da[i] = d[i] * b[i] * glue::silu_grad_factor(a[i], s);
        dbv[i] = d[i] * a[i] * s;
      }
      store<T, V>(out + m * 2 * H + j, da);
      store<T, V>(out + m * 2 * H + H + j, dbv);
    } else {
      float h[V];
#pragma unroll
      for (int i = 0; i < V; ++i) h[i] = a[i] * sigmoid(a[i]) * b[i];
      store<T, V>(out + m * H + j, h);
    }
  }
}

template <typename T, int V, bool Backward>
__global__ void __launch_bounds__(kThreads)
    gated_output_kernel(const T* __restrict__ g, int64_t g_stride, const T* __restrict__ o,
                        const T* __restrict__ dy, T* __restrict__ out, T* __restrict__ d_o,
                        int64_t R, int64_t HD, Heads heads) {
  const int64_t per_row = HD / V, n = R * per_row;
  for (int64_t e = int64_t(blockIdx.x) * kThreads + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * kThreads) {
    const int64_t r = e / per_row, c = (e % per_row) * V;
    const int64_t oo = heads.o_offset(r, c);
    float gv[V], ov[V], res[V];
    load<T, V>(g + r * g_stride + c, gv);
    load<T, V>(o + oo, ov);
    if constexpr (Backward) {
      float d[V], dov[V];
      load<T, V>(dy + r * HD + c, d);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float s = sigmoid(gv[i]);
        res[i] = d[i] * ov[i] * s * (1.0f - s);
        dov[i] = d[i] * s;
      }
      store<T, V>(d_o + oo, dov);
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) res[i] = sigmoid(gv[i]) * ov[i];
    }
    store<T, V>(out + r * HD + c, res);
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

void layer_norm_forward(const LayerNormForwardArgs& a, const Rows& rows, int64_t n_rows,
                        void* stream) {
  DeviceGuard guard(a.x.device_index);
  const int C = int(a.x.shape[a.x.ndim - 1]);
  const unsigned grid = grid_for(n_rows, kWarps);
  with_float_type(a.x.dtype, [&](auto tx) {
    using TX = decltype(tx);
    with_float_type(a.y.dtype, [&](auto ty) {
      using TY = decltype(ty);
      with_per_lane(C, [&](auto pl) {
        layer_norm_forward_kernel<TX, TY, decltype(pl)::value>
            <<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
                static_cast<const TX*>(a.x.data), rows, n_rows, C,
                static_cast<const float*>(a.weight.data), static_cast<const float*>(a.bias.data),
                float(a.eps), static_cast<TY*>(a.y.data), static_cast<float*>(a.mean.data),
                static_cast<float*>(a.rstd.data));
      });
    });
  });
  check_launch("layer_norm_forward_kernel");
}

void layer_norm_backward(const LayerNormBackwardArgs& a, const Rows& rows, int64_t n_rows,
                         void* stream) {
  DeviceGuard guard(a.x.device_index);
  const int C = int(a.x.shape[a.x.ndim - 1]);
  const int64_t blocks = backward_blocks(n_rows);
  const size_t smem = size_t(kWarps) * 2 * C * sizeof(float);
  auto s = static_cast<cudaStream_t>(stream);
  float* partial = static_cast<float*>(a.workspace(size_t(blocks) * size_t(2 * C) * sizeof(float)));
  with_float_type(a.x.dtype, [&](auto tx) {
    using TX = decltype(tx);
    with_float_type(a.dy.dtype, [&](auto td) {
      using TD = decltype(td);
      with_per_lane(C, [&](auto pl) {
        auto kernel = layer_norm_backward_kernel<TX, TD, decltype(pl)::value>;
        check_cuda(
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
            "cudaFuncSetAttribute");
        kernel<<<unsigned(blocks), kThreads, smem, s>>>(
            static_cast<const TD*>(a.dy.data), static_cast<const TX*>(a.x.data), rows, n_rows, C,
            static_cast<const float*>(a.weight.data), static_cast<const float*>(a.mean.data),
            static_cast<const float*>(a.rstd.data), static_cast<TX*>(a.dx.data), partial);
      });
    });
  });
  check_launch("layer_norm_backward_kernel");
  layer_norm_finish_kernel<<<unsigned((2 * C + kColumnSumCols - 1) / kColumnSumCols),
                             dim3(kColumnSumCols, kColumnSumRowGroups), 0, s>>>(
      partial, int(blocks), C, static_cast<float*>(a.dweight.data),
      static_cast<float*>(a.dbias.data));
  check_launch("layer_norm_finish_kernel");
}

namespace {
template <bool Backward>
void swiglu(const SwigluArgs& a, void* stream) {
  DeviceGuard guard(a.ab.device_index);
  const int64_t M = a.ab.shape[0], H = a.ab.shape[1] / 2;
  const TensorView& out = Backward ? a.dab : a.h;
  with_float_type(a.ab.dtype, [&](auto t) {
    using T = decltype(t);
    constexpr int V = 16 / sizeof(T);
    const T* ab = static_cast<const T*>(a.ab.data);
    const T* dh = Backward ? static_cast<const T*>(a.dh.data) : nullptr;
    T* o = static_cast<T*>(out.data);
    const bool vec = H % V == 0 && aligned16(ab) && aligned16(o) && (!Backward || aligned16(dh));
    auto s = static_cast<cudaStream_t>(stream);
    if (vec)
      swiglu_kernel<T, V, Backward>
          <<<grid_for(M * H / V, kThreads), kThreads, 0, s>>>(ab, dh, o, M, H);
    else
      swiglu_kernel<T, 1, Backward><<<grid_for(M * H, kThreads), kThreads, 0, s>>>(ab, dh, o, M, H);
  });
  check_launch("swiglu_kernel");
}

template <bool Backward>
void gated_output(const GatedOutputArgs& a, const Heads& heads, void* stream) {
  DeviceGuard guard(a.g.device_index);
  const int64_t R = a.g.shape[0], HD = a.g.shape[1], gs = a.g.stride[0];
  const TensorView& out = Backward ? a.dg : a.y;
  with_float_type(a.g.dtype, [&](auto t) {
    using T = decltype(t);
    constexpr int V = 16 / sizeof(T);
    const T* g = static_cast<const T*>(a.g.data);
    const T* o = static_cast<const T*>(a.o.data);
    const T* dy = Backward ? static_cast<const T*>(a.dy.data) : nullptr;
    T* res = static_cast<T*>(out.data);
    T* d_o = Backward ? static_cast<T*>(a.do_.data) : nullptr;
    const bool vec = heads.D % V == 0 && gs % V == 0 && aligned16(g) && aligned16(o) &&
                     aligned16(res) && (!Backward || (aligned16(dy) && aligned16(d_o)));
    auto s = static_cast<cudaStream_t>(stream);
    if (vec)
      gated_output_kernel<T, V, Backward><<<grid_for(R * HD / V, kThreads), kThreads, 0, s>>>(
          g, gs, o, dy, res, d_o, R, HD, heads);
    else
      gated_output_kernel<T, 1, Backward>
          <<<grid_for(R * HD, kThreads), kThreads, 0, s>>>(g, gs, o, dy, res, d_o, R, HD, heads);
  });
  check_launch("gated_output_kernel");
}
}  // namespace

void swiglu_forward(const SwigluArgs& a, void* stream) { swiglu<false>(a, stream); }
void swiglu_backward(const SwigluArgs& a, void* stream) { swiglu<true>(a, stream); }
void gated_output_forward(const GatedOutputArgs& a, const Heads& h, void* stream) {
  gated_output<false>(a, h, stream);
}
void gated_output_backward(const GatedOutputArgs& a, const Heads& h, void* stream) {
  gated_output<true>(a, h, stream);
}

}  // namespace tpf::cuda
