// A small forward + backward through the C++ API with no Python, for compute-sanitizer
// (memcheck, racecheck, synccheck, initcheck): bf16, sizes that are not tile multiples, masked keys
// and a fully masked slice. The backward (the Hopper kernel, backward_sm90.cu) runs at head dims
// 16, 32 and 64 and the padded 24 and 48, with bf16 and float32 biases, one and several key
// blocks, slice groups and query tiles: twice, and once more in chunks of one slice group
// (TPF_ATTENTION_DQ_BUDGET_BYTES), all into fresh buffers whose gradients must be finite and
// bitwise equal (the semaphore-ordered sums run in the same order whatever the schedule and the
// chunking). Exits non-zero on any CUDA error, non-finite output or
// disagreement.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <random>
#include <vector>

#include "device_workspace.h"
#include "tpf/attention.h"

namespace {

// The forward, its workspace from a DeviceWorkspace freed once the forward has finished. (This
// called itself, not tpf::attention_forward: the recursion overflowed the stack before any output.)
void forward(tpf::AttentionForwardArgs& f) {
  DeviceWorkspace workspace;
  f.workspace = workspace.allocator();
  tpf::attention_forward(f);
  check(cudaDeviceSynchronize(), "sync (forward)");
  f.workspace = nullptr;
}

// One forward + backward case for the backward's checks: random bf16 inputs, every 7th key masked
// and the last slice fully masked; the bias bf16 or float32 (read as float32, dbias float32).
struct BackwardCase {
  int64_t B, N, H, S, D;
  bool f32_bias = false;
};

std::vector<__nv_bfloat16> randn_bf16(std::mt19937& rng, int64_t n) {
  std::normal_distribution<float> normal;
  std::vector<__nv_bfloat16> x(n);
  for (auto& e : x) e = __float2bfloat16(normal(rng));
  return x;
}

// The four gradients of one backward call into fresh buffers, copied to the host as floats (dbias
// in the bias's dtype).
std::vector<std::vector<float>> backward_grads(tpf::AttentionBackwardArgs a,
                                               const tpf::AttentionDims& d) {
  using tpf::Device;
  using tpf::DType;
  const int64_t qn = d.B * d.N * d.H * d.Sq * d.D, bn = d.B * d.H * d.Sq * d.Sk;
  const DType dbias_type = a.bias.dtype;
  const int64_t sizes[] = {qn * 2, qn * 2, qn * 2, bn * int64_t(tpf::dtype_size(dbias_type))};
  std::vector<void*> bufs;
  for (int64_t bytes : sizes) {
    void* p = nullptr;
    check(cudaMalloc(&p, bytes), "gradient");
    check(cudaMemset(p, 0xff, bytes), "poison");  // NaN: an element never written shows up
    bufs.push_back(p);
  }
  auto view5 = [&](void* p) {
    return tpf::make_view(p, DType::bf16, {d.B, d.N, d.H, d.Sq, d.D}, Device::cuda);
  };
  a.dq = view5(bufs[0]);
  a.dk = view5(bufs[1]);
  a.dv = view5(bufs[2]);
  a.dbias = tpf::make_view(bufs[3], dbias_type, {d.B, d.H, d.Sq, d.Sk}, Device::cuda);
  DeviceWorkspace workspace;
  const tpf::Allocator allocate = workspace.allocator();
  a.workspace = [&](size_t bytes) {  // poisoned: the kernels must initialize what they read
    void* p = allocate(bytes);
    check(cudaMemset(p, 0x7f, bytes), "workspace poison");
    return p;
  };
  tpf::attention_backward(a);
  check(cudaDeviceSynchronize(), "sync (backward)");
  std::vector<std::vector<float>> out;
  for (size_t i = 0; i < bufs.size(); ++i) {
    const int64_t n = i < 3 ? qn : bn;
    std::vector<float> h(n);
    if (i == 3 && dbias_type == DType::f32) {
      check(cudaMemcpy(h.data(), bufs[i], n * 4, cudaMemcpyDeviceToHost), "copy back");
    } else {
      std::vector<__nv_bfloat16> b(n);
      check(cudaMemcpy(b.data(), bufs[i], n * 2, cudaMemcpyDeviceToHost), "copy back");
      for (int64_t e = 0; e < n; ++e) h[e] = __bfloat162float(b[e]);
    }
    out.push_back(std::move(h));
    check(cudaFree(bufs[i]), "free");
  }
  return out;
}

bool backward_cases() {
  using tpf::Device;
  using tpf::DType;
  // (S = 70: one key block, two query tiles; S = 200: two key blocks, four query tiles; S = 300:
  // three, so a middle key block adds to dQ; N = 5: several slice groups with a partial last one at
  // every head dim; at D = 96, 128 a key block is 64 keys, so S = 100, 150: two and three.)
  const BackwardCase cases[] = {
      {2, 5, 2, 70, 32},        {1, 5, 2, 200, 32},
      {1, 5, 1, 200, 16},       {1, 3, 1, 150, 64},
      {2, 5, 2, 70, 32, true},  {1, 5, 1, 200, 16, true},
      {1, 3, 1, 150, 64, true}, {1, 4, 2, 90, 24},
      {1, 3, 1, 130, 48, true}, {1, 3, 2, 150, 128},
      {1, 2, 1, 100, 96, true}, {1, 3, 1, 300, 32, true}};  // D 96, 128: split D, 64-key blocks
  std::mt19937 rng(11);
  for (const BackwardCase& c : cases) {
    std::printf(
        "backward B=%lld N=%lld H=%lld S=%lld D=%lld bias %s: forward, backward twice, chunked\n",
        (long long)c.B, (long long)c.N, (long long)c.H, (long long)c.S, (long long)c.D,
        c.f32_bias ? "float32" : "bf16");
    std::fflush(stdout);
    const int64_t qn = c.B * c.N * c.H * c.S * c.D;
    auto q = device_copy(randn_bf16(rng, qn)), k = device_copy(randn_bf16(rng, qn)),
         v = device_copy(randn_bf16(rng, qn)), dout = device_copy(randn_bf16(rng, qn));
    const int64_t bn = c.B * c.H * c.S * c.S;
    void* bias = nullptr;
    if (c.f32_bias) {
      std::normal_distribution<float> normal;
      std::vector<float> b(bn);
      for (auto& e : b) e = normal(rng);
      bias = device_copy(b);
    } else {
      bias = device_copy(randn_bf16(rng, bn));
    }
    std::vector<uint8_t> mask_h(c.B * c.N * c.S);
    for (size_t i = 0; i < mask_h.size(); ++i) mask_h[i] = (i % 7) != 3;
    for (int64_t s = 0; s < c.S; ++s) mask_h[(c.B * c.N - 1) * c.S + s] = 0;
    uint8_t* mask = device_copy(mask_h);
    __nv_bfloat16 *o, *res;
    float* lse;
    check(cudaMalloc(&o, qn * 2), "o");
    check(cudaMalloc(&res, qn * 2), "res");
    check(cudaMalloc(&lse, c.B * c.N * c.H * c.S * 4), "lse");
    auto view5 = [&](void* p) {
      return tpf::make_view(p, DType::bf16, {c.B, c.N, c.H, c.S, c.D}, Device::cuda);
    };
    tpf::AttentionForwardArgs f;
    f.q = view5(q);
    f.k = view5(k);
    f.v = view5(v);
    f.bias = tpf::make_view(bias, c.f32_bias ? DType::f32 : DType::bf16, {c.B, c.H, c.S, c.S},
                            Device::cuda);
    f.mask = {true, tpf::make_view(mask, DType::boolean, {c.B, c.N, c.S}, Device::cuda)};
    f.o = view5(o);
    f.lse = tpf::make_view(lse, DType::f32, {c.B, c.N, c.H, c.S}, Device::cuda);
    f.residual = {true, view5(res)};
    f.scale = 1.0 / std::sqrt(double(c.D));
    forward(f);
    tpf::AttentionBackwardArgs a = tpf::backward_args_of(f);
    a.dout = view5(dout);
    const tpf::AttentionDims dims{c.B, c.N, c.H, c.S, c.S, c.D};
    const auto first = backward_grads(a, dims), again = backward_grads(a, dims);
    setenv("TPF_ATTENTION_DQ_BUDGET_BYTES", "1", 1);  // one slice group per launch
    const auto chunked = backward_grads(a, dims);
    unsetenv("TPF_ATTENTION_DQ_BUDGET_BYTES");
    const char* names[] = {"dq", "dk", "dv", "dbias"};
    for (int t = 0; t < 4; ++t)
      for (size_t i = 0; i < first[t].size(); ++i) {
        const float x = first[t][i];
        if (!std::isfinite(x)) {
          std::fprintf(stderr, "S=%lld D=%lld: non-finite %s at %zu\n", (long long)c.S,
                       (long long)c.D, names[t], i);
          return false;
        }
        if (x != again[t][i] || x != chunked[t][i]) {
          std::fprintf(stderr, "S=%lld D=%lld: %s differs between calls or chunkings at %zu\n",
                       (long long)c.S, (long long)c.D, names[t], i);
          return false;
        }
      }
    for (void* p : {static_cast<void*>(q), static_cast<void*>(k), static_cast<void*>(v),
                    static_cast<void*>(dout), static_cast<void*>(bias), static_cast<void*>(mask),
                    static_cast<void*>(o), static_cast<void*>(res), static_cast<void*>(lse)})
      check(cudaFree(p), "free");
  }
  return true;
}

}  // namespace

int run() {
  const int64_t B = 2, N = 5, H = 2, S = 70, D = 32;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  auto randn = [&](int64_t n) {
    std::vector<__nv_bfloat16> x(n);
    for (auto& e : x) e = __float2bfloat16(normal(rng));
    return x;
  };
  const int64_t qn = B * N * H * S * D;
  auto q = device_copy(randn(qn)), k = device_copy(randn(qn)), v = device_copy(randn(qn)),
       bias = device_copy(randn(B * H * S * S));
  std::vector<uint8_t> mask_h(B * N * S);
  for (size_t i = 0; i < mask_h.size(); ++i) mask_h[i] = (i % 7) != 3;
  for (int64_t s = 0; s < S; ++s) mask_h[(B * N - 1) * S + s] = 0;
  uint8_t* mask = device_copy(mask_h);
  __nv_bfloat16 *o, *res;
  float* lse;
  check(cudaMalloc(&o, qn * 2), "o");
  check(cudaMalloc(&res, qn * 2), "res");
  check(cudaMalloc(&lse, B * N * H * S * 4), "lse");

  using tpf::Device;
  using tpf::DType;
  auto view5 = [&](void* p) {
    return tpf::make_view(p, DType::bf16, {B, N, H, S, D}, Device::cuda);
  };
  tpf::AttentionForwardArgs f;
  f.q = view5(q);
  f.k = view5(k);
  f.v = view5(v);
  f.bias = tpf::make_view(bias, DType::bf16, {B, H, S, S}, Device::cuda);
  f.mask = {true, tpf::make_view(mask, DType::boolean, {B, N, S}, Device::cuda)};
  f.o = view5(o);
  f.lse = tpf::make_view(lse, DType::f32, {B, N, H, S}, Device::cuda);
  f.residual = {true, view5(res)};
  f.scale = 1.0 / std::sqrt(double(D));
  std::printf("forward B=%lld N=%lld H=%lld S=%lld D=%lld\n", (long long)B, (long long)N,
              (long long)H, (long long)S, (long long)D);
  std::fflush(stdout);
  forward(f);

  std::vector<__nv_bfloat16> host(qn);
  check(cudaMemcpy(host.data(), o, qn * 2, cudaMemcpyDeviceToHost), "copy back");
  for (auto x : host)
    if (!std::isfinite(__bfloat162float(x))) {
      std::fprintf(stderr, "non-finite output\n");
      return 1;
    }
  if (!backward_cases()) return 1;
  std::printf("sanitize_attention_backward: ok (backward repeatable and chunk-independent)\n");
  return 0;
}

int main() { return program_main("sanitize_attention_backward", run); }
