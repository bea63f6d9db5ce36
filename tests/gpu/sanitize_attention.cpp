// A small forward + backward through the C++ API with no Python, for compute-sanitizer
// (memcheck, racecheck, initcheck): bf16, sizes that are not tile multiples, masked keys and a
// fully masked slice; then the forward with TPF_ATTENTION_FWD_WGMMA=1 (the wgmma forward) into
// fresh buffers, whose O must be finite and close to the default forward's; then the
// backward once more with TPF_ATTENTION_BWD_DQ=cluster (dQ summed in thread-block clusters), whose
// gradients must be finite and whose dQ must equal the default's (one cluster per slice: the same
// additions in the same order). Exits non-zero on any CUDA error, non-finite output or disagreement.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "device_workspace.h"
#include "tpf/attention.h"

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

template <typename T>
T* device_copy(const std::vector<T>& host) {
  T* d = nullptr;
  check(cudaMalloc(&d, host.size() * sizeof(T)), "cudaMalloc");
  check(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "copy");
  return d;
}

}  // namespace

int main() {
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
       dout = device_copy(randn(qn)), bias = device_copy(randn(B * H * S * S));
  std::vector<uint8_t> mask_h(B * N * S);
  for (size_t i = 0; i < mask_h.size(); ++i) mask_h[i] = (i % 7) != 3;
  for (int64_t s = 0; s < S; ++s) mask_h[(B * N - 1) * S + s] = 0;
  uint8_t* mask = device_copy(mask_h);
  __nv_bfloat16 *o, *res, *dq, *dk, *dv, *dbias;
  float* lse;
  check(cudaMalloc(&o, qn * 2), "o");
  check(cudaMalloc(&res, qn * 2), "res");
  check(cudaMalloc(&dq, qn * 2), "dq");
  check(cudaMalloc(&dk, qn * 2), "dk");
  check(cudaMalloc(&dv, qn * 2), "dv");
  check(cudaMalloc(&dbias, B * H * S * S * 2), "dbias");
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
  tpf::attention_forward(f);

  tpf::AttentionBackwardArgs a;
  a.q = f.q;
  a.k = f.k;
  a.v = f.v;
  a.bias = f.bias;
  a.mask = f.mask;
  a.o = f.o;
  a.lse = f.lse;
  a.residual = f.residual;
  a.dout = view5(dout);
  a.dq = view5(dq);
  a.dk = view5(dk);
  a.dv = view5(dv);
  a.dbias = tpf::make_view(dbias, DType::bf16, {B, H, S, S}, Device::cuda);
  a.scale = f.scale;
  DeviceWorkspace workspace;
  a.workspace = workspace.allocator();
  tpf::attention_backward(a);
  check(cudaDeviceSynchronize(), "sync");

  std::vector<__nv_bfloat16> host(qn);
  for (void* p : {static_cast<void*>(o), static_cast<void*>(dq), static_cast<void*>(dk),
                  static_cast<void*>(dv)}) {
    check(cudaMemcpy(host.data(), p, qn * 2, cudaMemcpyDeviceToHost), "copy back");
    for (auto x : host)
      if (!std::isfinite(__bfloat162float(x))) {
        std::fprintf(stderr, "non-finite output\n");
        return 1;
      }
  }
  // The wgmma forward (TPF_ATTENTION_FWD_WGMMA=1, read at each launch), into fresh buffers: O
  // finite and close to the default forward's.
  std::vector<__nv_bfloat16> o_default(qn);
  check(cudaMemcpy(o_default.data(), o, qn * 2, cudaMemcpyDeviceToHost), "copy back");
  float worst = 0.f;
  {
    __nv_bfloat16 *o2, *res2;
    float* lse2;
    check(cudaMalloc(&o2, qn * 2), "o2");
    check(cudaMalloc(&res2, qn * 2), "res2");
    check(cudaMalloc(&lse2, B * N * H * S * 4), "lse2");
    setenv("TPF_ATTENTION_FWD_WGMMA", "1", 1);
    tpf::AttentionForwardArgs f2 = f;
    f2.o = view5(o2);
    f2.residual = {true, view5(res2)};
    f2.lse = tpf::make_view(lse2, DType::f32, {B, N, H, S}, Device::cuda);
    tpf::attention_forward(f2);
    check(cudaDeviceSynchronize(), "sync (wgmma forward)");
    unsetenv("TPF_ATTENTION_FWD_WGMMA");
    for (void* p : {static_cast<void*>(o2), static_cast<void*>(res2)}) {
      check(cudaMemcpy(host.data(), p, qn * 2, cudaMemcpyDeviceToHost), "copy back");
      for (int64_t i = 0; i < qn; ++i) {
        const float x = __bfloat162float(host[i]);
        if (!std::isfinite(x)) {
          std::fprintf(stderr, "non-finite output of the wgmma forward\n");
          return 1;
        }
        if (p == o2) worst = std::fmax(worst, std::fabs(x - __bfloat162float(o_default[i])));
      }
    }
  }
  if (worst > 0.05f) {
    std::fprintf(stderr, "wgmma forward differs from the default forward by %g\n", worst);
    return 1;
  }
  // The cluster dQ backward (read at each call, like the workspace's size),
  // into fresh gradient buffers.
  std::vector<__nv_bfloat16> dq_default(qn);
  check(cudaMemcpy(dq_default.data(), dq, qn * 2, cudaMemcpyDeviceToHost), "copy back");
  setenv("TPF_ATTENTION_BWD_DQ", "cluster", 1);
  tpf::AttentionBackwardArgs a2 = a;
  __nv_bfloat16 *dq2, *dk2, *dv2, *dbias2;
  check(cudaMalloc(&dq2, qn * 2), "dq2");
  check(cudaMalloc(&dk2, qn * 2), "dk2");
  check(cudaMalloc(&dv2, qn * 2), "dv2");
  check(cudaMalloc(&dbias2, B * H * S * S * 2), "dbias2");
  a2.dq = view5(dq2);
  a2.dk = view5(dk2);
  a2.dv = view5(dv2);
  a2.dbias = tpf::make_view(dbias2, DType::bf16, {B, H, S, S}, Device::cuda);
  tpf::attention_backward(a2);
  check(cudaDeviceSynchronize(), "sync (cluster dQ backward)");
  unsetenv("TPF_ATTENTION_BWD_DQ");
  for (void* p : {static_cast<void*>(dq2), static_cast<void*>(dk2), static_cast<void*>(dv2)}) {
    check(cudaMemcpy(host.data(), p, qn * 2, cudaMemcpyDeviceToHost), "copy back");
    for (int64_t i = 0; i < qn; ++i) {
      if (!std::isfinite(__bfloat162float(host[i]))) {
        std::fprintf(stderr, "non-finite gradient of the cluster dQ backward\n");
        return 1;
      }
      if (p == dq2 && __bfloat162float(host[i]) != __bfloat162float(dq_default[i])) {
        std::fprintf(stderr, "cluster dQ differs from the default dQ at %lld\n", (long long)i);
        return 1;
      }
    }
  }
  std::vector<__nv_bfloat16> dbias_host(B * H * S * S);
  check(cudaMemcpy(dbias_host.data(), dbias2, dbias_host.size() * 2, cudaMemcpyDeviceToHost),
        "copy back");
  for (auto x : dbias_host)
    if (!std::isfinite(__bfloat162float(x))) {
      std::fprintf(stderr, "non-finite dbias of the cluster dQ backward\n");
      return 1;
    }
  std::printf(
      "sanitize_attention: ok (wgmma forward within %g of the default; cluster dQ "
      "equal)\n",
      worst);
  return 0;
}
