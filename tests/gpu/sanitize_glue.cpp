// The fused glue ops (tpf/glue.h) through the C++ API with no Python, for compute-sanitizer and as
// a test: each op runs on the GPU (outputs poisoned with NaN first) and on the CPU path from the
// same inputs, and every output element must agree. Cases: LayerNorm over a transposed pair tensor
// (strided rows), 40 channels (partly idle lanes) and 384, float32 in and bfloat16 out, with the
// backward's weight gradients; SwiGLU with 16-byte accesses and without (odd H); the gate over a
// column slice of a wider tensor, vectorized and not (D = 5). Exits non-zero on any mismatch.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "device_workspace.h"
#include "tpf/glue.h"

namespace {

using tpf::Device;
using tpf::DType;
using tpf::TensorView;

int failures = 0;

// One tensor on both sides: host bytes (the CPU path's) and a device copy.
struct Twin {
  std::vector<char> host;
  void* dev = nullptr;
  DType dtype;
  std::vector<int64_t> shape, stride;
  int64_t storage = 0;  // elements

  Twin(DType d, std::vector<int64_t> shp, std::vector<int64_t> strd = {}) : dtype(d), shape(shp) {
    stride = strd;
    if (stride.empty()) {
      stride.resize(shape.size());
      int64_t s = 1;
      for (int i = int(shape.size()) - 1; i >= 0; --i) {
        stride[i] = s;
        s *= shape[i];
      }
    }
    storage = 1;
    for (size_t i = 0; i < shape.size(); ++i) storage += (shape[i] - 1) * stride[i];
    host.assign(size_t(storage * tpf::dtype_size(d)), 0);
    check(cudaMalloc(&dev, host.size()), "cudaMalloc");
    check(cudaMemset(dev, 0xff, host.size()), "poison");  // NaN in every float format
  }
  Twin(const Twin&) = delete;
  ~Twin() { cudaFree(dev); }

  void fill(std::mt19937& rng, float scale = 1.0f) {
    std::normal_distribution<float> normal;
    for (int64_t i = 0; i < storage; ++i) {
      const float v = normal(rng) * scale;
      tpf::store_row(view(Device::cpu), i, 1, &v);  // contiguous storage, element i
    }
    upload();
  }
  void upload() {
    check(cudaMemcpy(dev, host.data(), host.size(), cudaMemcpyHostToDevice), "upload");
  }
  TensorView view(Device device) const {
    TensorView t;
    t.data = device == Device::cpu ? const_cast<char*>(host.data()) : dev;
    t.dtype = dtype;
    t.device = device;
    t.ndim = int(shape.size());
    for (int i = 0; i < t.ndim; ++i) {
      t.shape[i] = shape[i];
      t.stride[i] = stride[i];
    }
    return t;
  }
};

// Every element the view covers agrees between the CPU result and the GPU one.
void compare(const Twin& t, const char* what, float tol) {
  std::vector<char> got(t.host.size());
  check(cudaMemcpy(got.data(), t.dev, got.size(), cudaMemcpyDeviceToHost), "download");
  TensorView cpu = t.view(Device::cpu), gpu = cpu;
  gpu.data = got.data();
  int64_t n = 1;
  for (int64_t s : t.shape) n *= s;
  int bad = 0;
  double worst = 0;
  for (int64_t e = 0; e < n; ++e) {
    int64_t off = 0, rest = e;
    for (int i = int(t.shape.size()) - 1; i >= 0; --i) {
      off += (rest % t.shape[i]) * t.stride[i];
      rest /= t.shape[i];
    }
    float a, b;
    tpf::load_row(cpu, off, 1, &a);
    tpf::load_row(gpu, off, 1, &b);
    const double err = std::fabs(double(a) - double(b));
    if (!(err <= tol * (1.0 + std::fabs(a)))) {
      if (bad++ < 3) std::fprintf(stderr, "%s[%lld]: cpu %g gpu %g\n", what, (long long)e, a, b);
    }
    if (err > worst) worst = err;
  }
  std::printf("  %-28s %8lld elements, max |gpu - cpu| %.3g%s\n", what, (long long)n, worst,
              bad ? "  MISMATCH" : "");
  failures += bad ? 1 : 0;
}

void layer_norm_case(std::mt19937& rng, int64_t B, int64_t I, int64_t J, int64_t C,
                     bool transposed) {
  std::printf("layer_norm B=%lld I=%lld J=%lld C=%lld%s\n", (long long)B, (long long)I,
              (long long)J, (long long)C, transposed ? " (transposed rows)" : "");
  // x: a [B, I, J, C] tensor read as [B, J, I, C] when transposed.
  std::vector<int64_t> shape = {B, transposed ? J : I, transposed ? I : J, C};
  std::vector<int64_t> stride = {I * J * C, transposed ? C : J * C, transposed ? J * C : C, 1};
  Twin x(DType::f32, shape, stride), w(DType::f32, {C}), b(DType::f32, {C});
  x.fill(rng, 2.0f);
  w.fill(rng);
  b.fill(rng);
  const int64_t rows = B * I * J;
  Twin y(DType::bf16, shape), mean(DType::f32, {rows}), rstd(DType::f32, {rows});
  for (Device d : {Device::cpu, Device::cuda}) {
    tpf::LayerNormForwardArgs a;
    a.x = x.view(d);
    a.weight = w.view(d);
    a.bias = b.view(d);
    a.y = y.view(d);
    a.mean = mean.view(d);
    a.rstd = rstd.view(d);
    tpf::layer_norm_forward(a);
  }
  check(cudaDeviceSynchronize(), "layer_norm_forward");
  compare(y, "y", 1e-2f);
  compare(mean, "mean", 1e-5f);
  compare(rstd, "rstd", 1e-4f);

  Twin dy(DType::bf16, shape), dx(DType::f32, shape, stride), dw(DType::f32, {C}),
      db(DType::f32, {C});
  dy.fill(rng);
  DeviceWorkspace workspace;
  for (Device d : {Device::cpu, Device::cuda}) {
    tpf::LayerNormBackwardArgs a;
    a.dy = dy.view(d);
    a.x = x.view(d);
    a.weight = w.view(d);
    a.mean = mean.view(d);
    a.rstd = rstd.view(d);
    a.dx = dx.view(d);
    a.dweight = dw.view(d);
    a.dbias = db.view(d);
    a.workspace = workspace.allocator();
    tpf::layer_norm_backward(a);
  }
  check(cudaDeviceSynchronize(), "layer_norm_backward");
  compare(dx, "dx", 1e-4f);
  compare(dw, "dweight", 1e-4f);
  compare(db, "dbias", 1e-4f);
}

void swiglu_case(std::mt19937& rng, int64_t M, int64_t H) {
  std::printf("swiglu M=%lld H=%lld\n", (long long)M, (long long)H);
  Twin ab(DType::bf16, {M, 2 * H}), h(DType::bf16, {M, H}), dh(DType::bf16, {M, H}),
      dab(DType::bf16, {M, 2 * H});
  ab.fill(rng, 2.0f);
  dh.fill(rng);
  for (Device d : {Device::cpu, Device::cuda}) {
    tpf::SwigluArgs a;
    a.ab = ab.view(d);
    a.h = h.view(d);
    a.dh = dh.view(d);
    a.dab = dab.view(d);
    tpf::swiglu_forward(a);
    tpf::swiglu_backward(a);
  }
  check(cudaDeviceSynchronize(), "swiglu");
  compare(h, "h", 1e-2f);
  compare(dab, "dab", 1e-2f);
}

void gate_case(std::mt19937& rng, int64_t BN, int64_t H, int64_t S, int64_t D) {
  std::printf("gated_output BN=%lld H=%lld S=%lld D=%lld (g: last quarter of [R, 4HD])\n",
              (long long)BN, (long long)H, (long long)S, (long long)D);
  const int64_t R = BN * S, HD = H * D;
  Twin wide(DType::bf16, {R, 4 * HD}), o(DType::bf16, {BN, H, S, D}), y(DType::bf16, {R, HD}),
      dy(DType::bf16, {R, HD}), dg(DType::bf16, {R, HD}), d_o(DType::bf16, {BN, H, S, D});
  wide.fill(rng, 2.0f);
  o.fill(rng);
  dy.fill(rng);
  for (Device d : {Device::cpu, Device::cuda}) {
    tpf::GatedOutputArgs a;
    a.g = wide.view(d);
    a.g.shape[1] = HD;  // columns [3HD, 4HD) of each row
    a.g.data = static_cast<char*>(a.g.data) + 3 * HD * 2;
    a.o = o.view(d);
    a.y = y.view(d);
    a.dy = dy.view(d);
    a.dg = dg.view(d);
    a.do_ = d_o.view(d);
    tpf::gated_output_forward(a);
    tpf::gated_output_backward(a);
  }
  check(cudaDeviceSynchronize(), "gated_output");
  compare(y, "y", 1e-2f);
  compare(dg, "dg", 1e-2f);
  compare(d_o, "do", 1e-2f);
}

}  // namespace

int main() {
  std::mt19937 rng(11);
  layer_norm_case(rng, 2, 37, 29, 128, true);
  layer_norm_case(rng, 1, 5, 13, 40, false);
  layer_norm_case(rng, 1, 3, 7, 384, false);
  swiglu_case(rng, 333, 64);
  swiglu_case(rng, 17, 7);
  gate_case(rng, 6, 4, 37, 32);
  gate_case(rng, 3, 3, 11, 5);
  if (failures) {
    std::fprintf(stderr, "sanitize_glue: %d outputs differ between the GPU and the CPU path\n",
                 failures);
    return 1;
  }
  std::printf("sanitize_glue: ok\n");
  return 0;
}
