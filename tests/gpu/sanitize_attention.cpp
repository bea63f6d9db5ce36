// Forward and backward through the C++ API with no Python, for compute-sanitizer (memcheck,
// racecheck, synccheck, initcheck). Forward cases of the Hopper kernel: sizes that are not tile
// multiples, 1 to 5 key tiles (stage reuse past the two stages), two query blocks, slice groups
// with absent slices (N not a multiple of G), masked keys, a fully masked slice, rows whose bias
// is -inf everywhere, negative scale, bf16 and fp16, a float32 bias, D = 8, 16, 24, 32, 40, 56,
// 64, 128; outputs poisoned with NaN first and compared with the FP64 reference. The lse is held
// to 1e-4 of the FP64 one: the forward's row sums l are fp32 sums of the fp32 P, so a row sum
// that misses or double-counts P, or is rescaled unlike O, shows there (the former ones column of
// rounded P was off by up to 3.9e-3). Then the backward once on the first case's forward.
// Exits non-zero on any CUDA error, non-finite gradient or forward outside the tolerance.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <random>
#include <vector>

#include "device_workspace.h"
#include "tpf/attention.h"

namespace {

void* device_nan(size_t bytes) {
  void* d = nullptr;
  check(cudaMalloc(&d, bytes), "cudaMalloc");
  check(cudaMemset(d, 0xff, bytes), "poison");  // all-ones bytes: NaN in every float format
  return d;
}

uint16_t to16(float x, bool fp16) {
  if (fp16) {
    const __half h = __float2half_rn(x);
    return *reinterpret_cast<const uint16_t*>(&h);
  }
  const __nv_bfloat16 b = __float2bfloat16_rn(x);
  return *reinterpret_cast<const uint16_t*>(&b);
}
float from16(uint16_t x, bool fp16) {
  return fp16 ? __half2float(*reinterpret_cast<const __half*>(&x))
              : __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(&x));
}

struct Case {
  int64_t B, N, H, S, D;
  bool fp16, minus_inf_rows;
  double scale_sign;
  bool fp32_bias = false;  // a float32 bias with 16-bit q, k, v (read unrounded)
};

// Returns the inputs' host copies and the forward's device outputs for the backward.
struct Run {
  uint16_t *q, *k, *v, *o, *res;
  void* bias;
  uint8_t* mask;
  float* lse;
};

Run run_forward(const Case& c, float* worst_out) {
  using tpf::Device;
  using tpf::DType;
  const int64_t B = c.B, N = c.N, H = c.H, S = c.S, D = c.D;
  const DType dt = c.fp16 ? DType::f16 : DType::bf16;
  std::mt19937 rng(uint32_t(S * 131 + D * 7 + N));
  std::normal_distribution<float> normal;
  const int64_t qn = B * N * H * S * D, bn = B * H * S * S;
  auto randn = [&](int64_t n) {
    std::vector<uint16_t> x(n);
    for (auto& e : x) e = to16(normal(rng), c.fp16);
    return x;
  };
  std::vector<uint16_t> qh = randn(qn), kh = randn(qn), vh = randn(qn), bh = randn(bn);
  if (c.minus_inf_rows)  // every fifth query row of head 0 has no finite score
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < S; i += 5)
        for (int64_t j = 0; j < S; ++j) bh[(b * H * S + i) * S + j] = to16(-INFINITY, c.fp16);
  std::vector<uint8_t> mh(B * N * S);
  for (size_t i = 0; i < mh.size(); ++i) mh[i] = (i % 7) != 3 && (i % S) < S - S / 8;
  for (int64_t s = 0; s < S; ++s) mh[(B * N - 1) * S + s] = 0;  // the last slice: no key
  // The float32 bias: the 16-bit one plus a part no 16-bit format holds.
  std::vector<float> bh32;
  if (c.fp32_bias)
    for (uint16_t x : bh) bh32.push_back(from16(x, c.fp16) + 1e-3f * normal(rng));
  const DType bias_dt = c.fp32_bias ? DType::f32 : dt;
  void* bias_data = c.fp32_bias ? static_cast<void*>(bh32.data()) : static_cast<void*>(bh.data());
  Run r{device_copy(qh),
        device_copy(kh),
        device_copy(vh),
        nullptr,
        nullptr,
        c.fp32_bias ? static_cast<void*>(device_copy(bh32)) : static_cast<void*>(device_copy(bh)),
        device_copy(mh),
        nullptr};
  r.o = static_cast<uint16_t*>(device_nan(qn * 2));
  r.res = static_cast<uint16_t*>(device_nan(qn * 2));
  r.lse = static_cast<float*>(device_nan(B * N * H * S * 4));

  auto view5 = [&](void* p, DType t, Device d) { return tpf::make_view(p, t, {B, N, H, S, D}, d); };
  tpf::AttentionForwardArgs f;
  f.q = view5(r.q, dt, Device::cuda);
  f.k = view5(r.k, dt, Device::cuda);
  f.v = view5(r.v, dt, Device::cuda);
  f.bias = tpf::make_view(r.bias, bias_dt, {B, H, S, S}, Device::cuda);
  f.mask = {true, tpf::make_view(r.mask, DType::boolean, {B, N, S}, Device::cuda)};
  f.o = view5(r.o, dt, Device::cuda);
  f.lse = tpf::make_view(r.lse, DType::f32, {B, N, H, S}, Device::cuda);
  f.residual = {true, view5(r.res, DType::bf16, Device::cuda)};
  f.scale = c.scale_sign / std::sqrt(double(D));
  {
    DeviceWorkspace workspace;  // freed after the forward has finished
    f.workspace = workspace.allocator();
    tpf::attention_forward(f);
    check(cudaDeviceSynchronize(), "sync (forward)");
  }

  // FP64 reference on the host copies.
  std::vector<double> o_ref(qn), lse_ref(B * N * H * S);
  tpf::AttentionForwardArgs h = f;
  h.q = view5(qh.data(), dt, Device::cpu);
  h.k = view5(kh.data(), dt, Device::cpu);
  h.v = view5(vh.data(), dt, Device::cpu);
  h.bias = tpf::make_view(bias_data, bias_dt, {B, H, S, S}, Device::cpu);
  h.mask = {true, tpf::make_view(mh.data(), DType::boolean, {B, N, S}, Device::cpu)};
  h.o = view5(o_ref.data(), DType::f64, Device::cpu);
  h.lse = tpf::make_view(lse_ref.data(), DType::f64, {B, N, H, S}, Device::cpu);
  h.residual = {};
  h.workspace = nullptr;
  tpf::reference::attention_forward_f64(h);

  std::vector<uint16_t> o_h(qn), res_h(qn);
  std::vector<float> lse_h(B * N * H * S);
  check(cudaMemcpy(o_h.data(), r.o, qn * 2, cudaMemcpyDeviceToHost), "copy back");
  check(cudaMemcpy(res_h.data(), r.res, qn * 2, cudaMemcpyDeviceToHost), "copy back");
  check(cudaMemcpy(lse_h.data(), r.lse, lse_h.size() * 4, cudaMemcpyDeviceToHost), "copy back");
  float worst = 0.f;
  for (int64_t i = 0; i < qn; ++i) {
    const float x =
        from16(o_h[i], c.fp16) + __bfloat162float(*reinterpret_cast<__nv_bfloat16*>(&res_h[i]));
    if (!std::isfinite(x)) {
      std::fprintf(stderr, "non-finite O at %lld (S=%lld D=%lld)\n", (long long)i, (long long)S,
                   (long long)D);
      std::exit(1);
    }
    worst = std::fmax(worst, float(std::fabs(x - o_ref[i])));
  }
  // lse = m + ln(l) with l the fp32 sum of the fp32 P: errors of a few fp32 roundings of the
  // scores and of the exponentials (ex2.approx, the 2.7e-6 polynomial), ~1e-5 at most here.
  constexpr double kLseTol = 1e-4;
  double lse_worst = 0.0;
  for (size_t i = 0; i < lse_h.size(); ++i) {
    const bool inf_ref = std::isinf(lse_ref[i]);
    const double err = inf_ref ? 0.0 : std::fabs(double(lse_h[i]) - lse_ref[i]);
    if (inf_ref != std::isinf(lse_h[i]) || !(err <= kLseTol)) {
      std::fprintf(stderr, "lse %zu: %.7g against %.7g (S=%lld D=%lld)\n", i, lse_h[i], lse_ref[i],
                   (long long)S, (long long)D);
      std::exit(1);
    }
    lse_worst = std::fmax(lse_worst, err);
  }
  std::printf("  worst |lse - FP64| %.3g\n", lse_worst);
  // O + residual is the fp32 O of P rounded to the input dtype: a few units of that rounding.
  const float tol = c.fp16 ? 4e-3f : 2e-2f;
  if (worst > tol) {
    std::fprintf(stderr, "forward S=%lld D=%lld fp16=%d: O off the FP64 reference by %g\n",
                 (long long)S, (long long)D, int(c.fp16), worst);
    std::exit(1);
  }
  *worst_out = worst;
  return r;
}

}  // namespace

int run() {
  const Case cases[] = {
      {2, 5, 2, 70, 32, false, false, 1.0},   // the backward's case (below)
      {1, 7, 2, 200, 16, false, true, 1.0},   // 4 key tiles, 2 query blocks, -inf rows
      {1, 3, 1, 300, 32, true, false, -1.0},  // 5 key tiles, fp16, negative scale
      {2, 6, 1, 33, 8, false, false, 1.0},    // D = 8 (padded to 16)
      {1, 5, 3, 129, 24, true, true, 1.0},    // D = 24 (padded to 32), one key past a block
      {1, 3, 2, 100, 64, false, false, 1.0},  // D = 64: 2 slices per CTA, 128-byte swizzle
      {1, 3, 2, 90, 56, false, false, 1.0},   // D = 56 (padded to 64): zero V columns 56-63
      {1, 4, 1, 130, 64, true, true, -1.0},   // D = 64, fp16, 3 key tiles, -inf rows, scale < 0
      {1, 2, 1, 70, 128, true, false, 1.0},   // D = 128: 1 slice, two K/V blocks per tile
      {1, 2, 2, 65, 40, false, true, 1.0},    // D = 40 (padded to 48): three 32-byte blocks
      {2, 5, 2, 150, 32, false, false, 1.0, true},  // float32 bias, bf16 q, k, v
      {1, 3, 1, 70, 16, true, true, -1.0, true},    // float32 bias, fp16, -inf rows
  };
  Run first{};
  float worst_all = 0.f;
  for (const Case& c : cases) {
    std::printf("forward B=%lld N=%lld H=%lld S=%lld D=%lld %s%s scale %+g%s\n", (long long)c.B,
                (long long)c.N, (long long)c.H, (long long)c.S, (long long)c.D,
                c.fp16 ? "fp16" : "bf16", c.minus_inf_rows ? " -inf rows" : "", c.scale_sign,
                c.fp32_bias ? ", float32 bias" : "");
    std::fflush(stdout);
    float worst = 0.f;
    Run r = run_forward(c, &worst);
    worst_all = std::fmax(worst_all, worst);
    if (&c == &cases[0]) first = r;
  }

  // Backward on the first case's forward (bf16, D = 32).
  std::printf("backward on the first case\n");
  std::fflush(stdout);
  using tpf::Device;
  using tpf::DType;
  const Case& c = cases[0];
  const int64_t B = c.B, N = c.N, H = c.H, S = c.S, D = c.D, qn = B * N * H * S * D;
  auto view5 = [&](void* p) {
    return tpf::make_view(p, DType::bf16, {B, N, H, S, D}, Device::cuda);
  };
  std::vector<uint16_t> dout_h(qn);
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  for (auto& e : dout_h) e = to16(normal(rng), false);
  uint16_t* dout = device_copy(dout_h);
  tpf::AttentionBackwardArgs a;
  a.q = view5(first.q);
  a.k = view5(first.k);
  a.v = view5(first.v);
  a.bias = tpf::make_view(first.bias, DType::bf16, {B, H, S, S}, Device::cuda);
  a.mask = {true, tpf::make_view(first.mask, DType::boolean, {B, N, S}, Device::cuda)};
  a.o = view5(first.o);
  a.lse = tpf::make_view(first.lse, DType::f32, {B, N, H, S}, Device::cuda);
  a.residual = {true, view5(first.res)};
  a.dout = view5(dout);
  a.dq = view5(device_nan(qn * 2));
  a.dk = view5(device_nan(qn * 2));
  a.dv = view5(device_nan(qn * 2));
  a.dbias = tpf::make_view(device_nan(B * H * S * S * 2), DType::bf16, {B, H, S, S}, Device::cuda);
  a.scale = c.scale_sign / std::sqrt(double(D));
  // The workspace poisoned with 0x7f bytes (3.4e38, past bf16's range), as sanitize_attention_backward
  // does: an accumulator element the kernels read before writing shows as a non-finite gradient.
  // initcheck cannot say so here: it does not count the backward's TMA bulk stores as writes (on
  // 2026-12-07 it flagged every read of the dbias accumulator after them, on an H100).
  DeviceWorkspace workspace;
  const tpf::Allocator allocate = workspace.allocator();
  a.workspace = [&](size_t bytes) {
    void* p = allocate(bytes);
    check(cudaMemset(p, 0x7f, bytes), "workspace poison");
    return p;
  };
  tpf::attention_backward(a);
  check(cudaDeviceSynchronize(), "sync (backward)");
  std::vector<uint16_t> host(B * H * S * S > qn ? B * H * S * S : qn);
  for (const tpf::TensorView* t : {&a.dq, &a.dk, &a.dv, &a.dbias}) {
    const int64_t n = t == &a.dbias ? B * H * S * S : qn;
    check(cudaMemcpy(host.data(), t->data, n * 2, cudaMemcpyDeviceToHost), "copy back");
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t x = host[i];
      if (!std::isfinite(from16(x, false))) {
        std::fprintf(stderr, "non-finite gradient\n");
        return 1;
      }
    }
  }
  std::printf("sanitize_attention: ok (%zu forward cases, worst |O - FP64| %g; backward finite)\n",
              sizeof(cases) / sizeof(cases[0]), worst_all);
  return 0;
}

int main() { return program_main("sanitize_attention", run); }
