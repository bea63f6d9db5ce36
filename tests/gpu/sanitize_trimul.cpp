// A small forward + backward of the triangle multiplicative update through the C++ API with no
// Python, for compute-sanitizer (memcheck, racecheck, synccheck, initcheck): bf16 and float32,
// S not a tile multiple, D a multiple of 16 or not, both directions, with and without biases,
// float32 or bf16 weights (read and given back in their dtype), a mask of x's dtype, bool or float32.
// bf16 runs the 16-bit types' kernels, float32 its own (src/kernels/trimul/launch.h).
// Exits non-zero on any CUDA error or non-finite output.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "device_workspace.h"
#include "tpf/trimul.h"

namespace {

struct Buffer {
  void* data = nullptr;
  size_t bytes = 0;
  explicit Buffer(size_t n) : bytes(n) { check(cudaMalloc(&data, n ? n : 1), "cudaMalloc"); }
  ~Buffer() { cudaFree(data); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

template <typename T>
T convert(float v) {
  if constexpr (sizeof(T) == 2)
    return __float2bfloat16(v);
  else
    return T(v);
}

template <typename T>
float back(T v) {
  if constexpr (sizeof(T) == 2)
    return __bfloat162float(v);
  else
    return v;
}

std::mt19937 rng(7);

// A device buffer of n normal values (scale, shift) of type T.
template <typename T>
Buffer* random_buffer(int64_t n, float scale = 1.0f, float shift = 0.0f) {
  std::normal_distribution<float> normal;
  std::vector<T> host(n);
  for (auto& e : host) e = convert<T>(shift + scale * normal(rng));
  auto* b = new Buffer(n * sizeof(T));
  check(cudaMemcpy(b->data, host.data(), b->bytes, cudaMemcpyHostToDevice), "copy");
  return b;
}

template <typename T>
bool all_finite(const Buffer& b) {
  std::vector<T> host(b.bytes / sizeof(T));
  check(cudaMemcpy(host.data(), b.data, b.bytes, cudaMemcpyDeviceToHost), "copy back");
  for (const T& v : host)
    if (!std::isfinite(back(v))) return false;
  return true;
}

// T: x's element type (dtype); W: the weights' (wdtype); M: the mask's (mdtype; uint8_t for bool).
template <typename T, typename W, typename M>
bool run(int64_t B, int64_t S, int64_t D, bool outgoing, bool biases, tpf::DType dtype,
         tpf::DType wdtype, tpf::DType mdtype) {
  using tpf::make_view;
  const tpf::Device cuda = tpf::Device::cuda;
  std::vector<Buffer*> owned;
  auto keep = [&](Buffer* b) {
    owned.push_back(b);
    return b->data;
  };
  auto view = [&](void* p, tpf::DType dt, std::initializer_list<int64_t> shape) {
    return make_view(p, dt, shape, cuda);
  };
  const float w_scale = 1.0f / std::sqrt(float(D));
  tpf::TrimulWeights w;
  w.norm_in_weight = view(keep(random_buffer<W>(D, 0.2f, 1.0f)), wdtype, {D});
  w.norm_in_bias = view(keep(random_buffer<W>(D, 0.2f)), wdtype, {D});
  w.p_in_weight = view(keep(random_buffer<W>(2 * D * D, w_scale)), wdtype, {2 * D, D});
  w.g_in_weight = view(keep(random_buffer<W>(2 * D * D, w_scale)), wdtype, {2 * D, D});
  w.norm_out_weight = view(keep(random_buffer<W>(D, 0.2f, 1.0f)), wdtype, {D});
  w.norm_out_bias = view(keep(random_buffer<W>(D, 0.2f)), wdtype, {D});
  w.p_out_weight = view(keep(random_buffer<W>(D * D, w_scale)), wdtype, {D, D});
  w.g_out_weight = view(keep(random_buffer<W>(D * D, w_scale)), wdtype, {D, D});
  if (biases) {
    w.p_in_bias = {true, view(keep(random_buffer<W>(2 * D)), wdtype, {2 * D})};
    w.g_in_bias = {true, view(keep(random_buffer<W>(2 * D)), wdtype, {2 * D})};
    w.p_out_bias = {true, view(keep(random_buffer<W>(D)), wdtype, {D})};
    w.g_out_bias = {true, view(keep(random_buffer<W>(D)), wdtype, {D})};
  }
  tpf::TrimulWeightGrads g = w;
  std::vector<Buffer*> grads;
  auto zeros_like = [&](tpf::TensorView& t) {
    grads.push_back(new Buffer(t.numel() * sizeof(W)));
    t.data = keep(grads.back());
  };
  for (tpf::TensorView* t :
       {&g.norm_in_weight, &g.norm_in_bias, &g.p_in_weight, &g.g_in_weight, &g.norm_out_weight,
        &g.norm_out_bias, &g.p_out_weight, &g.g_out_weight})
    zeros_like(*t);
  for (tpf::OptionalTensor* t : {&g.p_in_bias, &g.g_in_bias, &g.p_out_bias, &g.g_out_bias})
    if (t->present) zeros_like(t->view);

  const int64_t n = B * S * S * D;
  std::vector<M> mask_h(B * S * S);
  for (size_t i = 0; i < mask_h.size(); ++i) mask_h[i] = convert<M>((i % 7) != 3 ? 1.0f : 0.0f);
  auto* mask = new Buffer(mask_h.size() * sizeof(M));
  owned.push_back(mask);
  check(cudaMemcpy(mask->data, mask_h.data(), mask->bytes, cudaMemcpyHostToDevice), "copy mask");
  Buffer y(n * sizeof(T)), a(n * sizeof(T)), b(n * sizeof(T)), z(n * sizeof(T)), go(n * sizeof(T)),
      dx(n * sizeof(T));

  const tpf::TrimulDims d{B, S, D};
  DeviceWorkspace workspace;

  tpf::TrimulForwardArgs f;
  f.x = view(keep(random_buffer<T>(n)), dtype, {B, S, S, D});
  f.mask = {true, view(mask->data, mdtype, {B, S, S})};
  f.w = w;
  f.outgoing = outgoing;
  f.y = view(y.data, dtype, {B, S, S, D});
  f.saved = {view(a.data, dtype, {B, D, S, S}), view(b.data, dtype, {B, D, S, S}),
             view(z.data, dtype, {B, D, S, S}), view(go.data, dtype, {B, S, S, D})};
  f.workspace = workspace.allocator();
  tpf::trimul_forward(f);

  tpf::TrimulBackwardArgs bw;
  bw.x = f.x;
  bw.mask = f.mask;
  bw.w = w;
  bw.outgoing = outgoing;
  bw.saved = f.saved;
  bw.dy = view(keep(random_buffer<T>(n)), dtype, {B, S, S, D});
  bw.dx = view(dx.data, dtype, {B, S, S, D});
  bw.dw = g;
  bw.workspace = workspace.allocator();
  tpf::trimul_backward(bw);
  check(cudaDeviceSynchronize(), "kernels");

  bool ok = all_finite<T>(y) && all_finite<T>(dx);
  for (const Buffer* grad : grads) ok = ok && all_finite<W>(*grad);
  for (Buffer* p : owned) delete p;
  std::printf("trimul B=%lld S=%lld D=%lld %s weights %s mask %s %s biases=%d: %s\n", (long long)B,
              (long long)S, (long long)D, tpf::dtype_name(dtype), tpf::dtype_name(wdtype),
              tpf::dtype_name(mdtype), outgoing ? "outgoing" : "incoming", int(biases),
              ok ? "ok" : "NON-FINITE");
  return ok;
}

}  // namespace

int main() {
  bool ok = true;
  using bf16 = __nv_bfloat16;
  const tpf::DType f32 = tpf::DType::f32, bf = tpf::DType::bf16, boolean = tpf::DType::boolean;
  for (bool outgoing : {true, false}) {
    ok &= run<bf16, float, bf16>(2, 70, 128, outgoing, true, bf, f32, bf);
    ok &= run<bf16, float, bf16>(1, 70, 24, outgoing, false, bf, f32, bf);
    ok &= run<float, float, float>(1, 33, 40, outgoing, true, f32, f32, f32);
    ok &= run<bf16, bf16, uint8_t>(1, 70, 64, outgoing, true, bf, bf, boolean);
    ok &= run<bf16, bf16, float>(1, 33, 40, outgoing, false, bf, bf, f32);
    // 408 tiles: more than the 396 persistent CTAs of the 16-bit backward kernels, so some CTAs
    // take a second tile (the shared-memory reuse across tiles is checked);
    // S a multiple of 8: the 16-byte store and copy paths.
    ok &= run<bf16, float, bf16>(1, 136, 64, outgoing, true, bf, f32, bf);
  }
  return ok ? 0 : 2;
}
