// Triangle multiplicative update on the CPU: the CPU path against the FP64 reference, the
// reference's gradients against finite differences, determinism, and argument errors.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "test_util.h"
#include "tpf/attention.h"  // cuda_available
#include "tpf/error.h"
#include "tpf/trimul.h"

namespace tpf {
namespace {

// Inputs as float32 plus outputs of element type T (float for the CPU path, double for the reference).
struct Problem {
  int64_t B, S, D;
  bool outgoing, with_mask, with_bias;
  std::vector<float> x, mask, dy;
  // Parameters in TrimulWeights order: ln_in_w, ln_in_b, wp_in, wg_in, bp_in, bg_in,
  // ln_out_w, ln_out_b, wp_out, wg_out, bp_out, bg_out.
  std::vector<std::vector<float>> params;

  Problem(int64_t B_, int64_t S_, int64_t D_, bool outgoing_, bool with_mask_, bool with_bias_,
          uint32_t seed)
      : B(B_), S(S_), D(D_), outgoing(outgoing_), with_mask(with_mask_), with_bias(with_bias_) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    auto fill = [&](std::vector<float>& v, int64_t n, float scale, float shift) {
      v.resize(n);
      for (auto& e : v) e = shift + scale * normal(rng);
    };
    fill(x, B * S * S * D, 1.0f, 0.0f);
    fill(dy, B * S * S * D, 1.0f, 0.0f);
    mask.resize(B * S * S);
    std::bernoulli_distribution keep(0.8);
    for (auto& m : mask) m = keep(rng) ? 1.0f : 0.0f;
    const float w_scale = 1.0f / std::sqrt(float(D));
    const int64_t sizes[12] = {D, D, 2 * D * D, 2 * D * D, 2 * D, 2 * D, D, D, D * D, D * D, D, D};
    const float scales[12] = {0.2f, 0.2f, w_scale, w_scale, 0.5f, 0.5f,
                              0.2f, 0.2f, w_scale, w_scale, 0.5f, 0.5f};
    const float shifts[12] = {1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0};
    params.resize(12);
    for (int k = 0; k < 12; ++k) fill(params[k], sizes[k], scales[k], shifts[k]);
  }

  TensorView pview(int k) {
    auto& p = params[k];
    if (k == 2 || k == 3) return make_view(p.data(), DType::f32, {2 * D, D});
    if (k == 8 || k == 9) return make_view(p.data(), DType::f32, {D, D});
    return make_view(p.data(), DType::f32, {int64_t(p.size())});
  }

  TrimulWeights weights() {
    TrimulWeights w;
    w.norm_in_weight = pview(0);
    w.norm_in_bias = pview(1);
    w.p_in_weight = pview(2);
    w.g_in_weight = pview(3);
    w.norm_out_weight = pview(6);
    w.norm_out_bias = pview(7);
    w.p_out_weight = pview(8);
    w.g_out_weight = pview(9);
    if (with_bias) {
      w.p_in_bias = {true, pview(4)};
      w.g_in_bias = {true, pview(5)};
      w.p_out_bias = {true, pview(10)};
      w.g_out_bias = {true, pview(11)};
    }
    return w;
  }
  TensorView x_like(void* data, DType dt) { return make_view(data, dt, {B, S, S, D}); }
};

template <typename T>
struct Outputs {
  DType dt = sizeof(T) == 8 ? DType::f64 : DType::f32;
  std::vector<T> y, dx;
  std::vector<std::vector<T>> dparams;
  std::vector<T> a, b, z, go;  // saved (float only)
  explicit Outputs(const Problem& p)
      : y(p.x.size(), T(NAN)),
        dx(p.x.size(), T(NAN)),
        a(p.B * p.D * p.S * p.S),
        b(a.size()),
        z(a.size()),
        go(p.x.size()) {
    for (const auto& q : p.params) dparams.emplace_back(q.size(), T(NAN));
  }
  TensorView grad_view(Problem& p, int k) {
    TensorView v = p.pview(k);
    v.data = dparams[k].data();
    v.dtype = dt;
    return v;
  }
};

// p's forward arguments over out's buffers: x, the mask (where p has one), the weights, y and the
// saved tensors.
template <typename T>
TrimulForwardArgs forward_args(Problem& p, Outputs<T>& out) {
  TrimulForwardArgs f;
  f.x = p.x_like(p.x.data(), DType::f32);
  if (p.with_mask) f.mask = {true, make_view(p.mask.data(), DType::f32, {p.B, p.S, p.S})};
  f.w = p.weights();
  f.outgoing = p.outgoing;
  f.y = p.x_like(out.y.data(), out.dt);
  f.saved.a = make_view(out.a.data(), DType::f32, {p.B, p.D, p.S, p.S});
  f.saved.b = make_view(out.b.data(), DType::f32, {p.B, p.D, p.S, p.S});
  f.saved.z = make_view(out.z.data(), DType::f32, {p.B, p.D, p.S, p.S});
  f.saved.go = p.x_like(out.go.data(), DType::f32);
  return f;
}

// Every view of w, biases included (present or not).
std::vector<TensorView*> views_of(TrimulWeights& w) {
  return {&w.norm_in_weight, &w.norm_in_bias,    &w.p_in_weight,     &w.p_in_bias.view,
          &w.g_in_weight,    &w.g_in_bias.view,  &w.norm_out_weight, &w.norm_out_bias,
          &w.p_out_weight,   &w.p_out_bias.view, &w.g_out_weight,    &w.g_out_bias.view};
}

// p's backward arguments over out's buffers: the forward's inputs and saved tensors, dy, dx and
// the weights' gradients (the biases' where p has them).
template <typename T>
TrimulBackwardArgs backward_args(Problem& p, Outputs<T>& out) {
  TrimulBackwardArgs b = backward_args_of(forward_args(p, out));
  b.dy = p.x_like(p.dy.data(), DType::f32);
  b.dx = p.x_like(out.dx.data(), out.dt);
  b.dw = b.w;  // present where the biases are
  const std::vector<TensorView*> grads = views_of(b.dw);
  // views_of's order (TrimulWeights') against Problem::params' (biases after both weights).
  const int param_of[12] = {0, 1, 2, 4, 3, 5, 6, 7, 8, 10, 9, 11};
  for (int k = 0; k < 12; ++k) *grads[k] = out.grad_view(p, param_of[k]);
  return b;
}

template <typename T>
void run(Problem& p, Outputs<T>& out, bool reference) {
  const TrimulForwardArgs f = forward_args(p, out);
  const TrimulBackwardArgs b = backward_args(p, out);
  if (reference) {
    reference::trimul_forward_f64(f);
    reference::trimul_backward_f64(b);
  } else {
    trimul_forward(f);
    trimul_backward(b);
  }
}

const char* kParamNames[12] = {"norm_in_weight", "norm_in_bias", "p_in_weight",     "g_in_weight",
                               "p_in_bias",      "g_in_bias",    "norm_out_weight", "norm_out_bias",
                               "p_out_weight",   "g_out_weight", "p_out_bias",      "g_out_bias"};
bool is_bias(int k) { return k == 4 || k == 5 || k == 10 || k == 11; }

class TrimulCpuVsReference : public ::testing::TestWithParam<std::tuple<int, int, bool, bool>> {};

TEST_P(TrimulCpuVsReference, MatchesFp64) {
  const auto [S, D, outgoing, with_mask] = GetParam();
  const uint32_t seed = 5000 + S * 31 + D * 7 + outgoing * 2 + with_mask;
  Problem p(2, S, D, outgoing, with_mask, /*with_bias=*/S % 2 == 1, seed);
  Outputs<float> got(p);
  Outputs<double> want(p);
  run(p, got, false);
  run(p, want, true);
  // FP32 math through two LayerNorms and a contraction over S: relative errors stay within a few
  // hundred float ulps of the largest element.
  const double tol = 512 * FLT_EPSILON;
  EXPECT_LT(max_rel_err(got.y, want.y), tol) << "y, seed " << seed;
  EXPECT_LT(max_rel_err(got.dx, want.dx), tol) << "dx, seed " << seed;
  for (int k = 0; k < 12; ++k) {
    if (is_bias(k) && !p.with_bias) continue;
    EXPECT_LT(max_rel_err(got.dparams[k], want.dparams[k]), tol)
        << "d " << kParamNames[k] << ", seed " << seed;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, TrimulCpuVsReference,
                         ::testing::Combine(::testing::Values(1, 7, 33, 100),
                                            ::testing::Values(8, 24), ::testing::Bool(),
                                            ::testing::Bool()));

TEST(TrimulCpu, BitwiseDeterministic) {
  Problem p(2, 70, 16, true, true, true, 7);
  Outputs<float> first(p);
  run(p, first, false);
  for (int call = 0; call < 3; ++call) {
    Outputs<float> again(p);
    run(p, again, false);
    ASSERT_EQ(0, std::memcmp(first.y.data(), again.y.data(), first.y.size() * 4));
    ASSERT_EQ(0, std::memcmp(first.dx.data(), again.dx.data(), first.dx.size() * 4));
    for (int k = 0; k < 12; ++k)
      ASSERT_EQ(0, std::memcmp(first.dparams[k].data(), again.dparams[k].data(),
                               first.dparams[k].size() * 4))
          << kParamNames[k];
  }
}

// The reference's gradients against central finite differences of L = sum(y * dy).
class TrimulReferenceGradients : public ::testing::TestWithParam<bool> {};

TEST_P(TrimulReferenceGradients, MatchFiniteDifferences) {
  Problem p(2, 5, 8, GetParam(), true, true, 11);
  Outputs<double> g(p);
  run(p, g, true);
  auto loss = [&]() {
    Outputs<double> o(p);
    run(p, o, true);
    return dot(o.y, p.dy);
  };
  expect_matches_finite_differences(p.x, g.dx, "dx", loss, 7, 2e-3);
  for (int k = 0; k < 12; ++k)
    expect_matches_finite_differences(p.params[k], g.dparams[k], kParamNames[k], loss, 7, 2e-3);
}

INSTANTIATE_TEST_SUITE_P(Directions, TrimulReferenceGradients, ::testing::Bool());

TEST(TrimulErrors, NameTheArgument) {
  Problem p(1, 5, 8, true, true, false, 3);
  Outputs<float> out(p);
  const TrimulForwardArgs f = forward_args(p, out);
  auto expect_error = [&](TrimulForwardArgs a, const char* fragment) {
    try {
      trimul_forward(a);
      ADD_FAILURE() << "expected an error mentioning " << fragment;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  trimul_forward(f);
  TrimulForwardArgs a = f;
  a.x.ndim = 3;
  expect_error(a, "x must have 4 dimensions");
  a = f;
  a.x.shape[2] = 4;
  expect_error(a, "x must be square");
  a = f;
  a.mask.view.dtype = DType::boolean;
  expect_error(a, "mask must have x's dtype");
  a = f;
  a.w.p_in_weight = make_view(p.params[2].data(), DType::f32, {p.D, 2 * p.D});
  expect_error(a, "p_in_weight must have shape [2D, D]");
  a = f;
  a.w.g_out_bias = {true, make_view(p.params[11].data(), DType::f32, {p.D + 1})};
  expect_error(a, "g_out_bias must have shape [D]");
  a = f;
  a.w.norm_out_weight.dtype = DType::i32;
  expect_error(a, "norm_out_weight must be float32");
  a = f;
  a.eps = 0;
  expect_error(a, "eps must be a positive number");
  a = f;
  a.saved.z = make_view(out.z.data(), DType::f32, {p.B, p.S, p.S, p.D});
  expect_error(a, "z must have shape [B, D, S, S]");
  a = f;
  a.y.stride[3] = 2;
  expect_error(a, "y must have stride 1");
  a = f;
  a.x.shape[0] = 0;
  expect_error(a, "x must have B, S and D of at least 1, got [0, 5, 5, 8]");
  a = f;
  a.x.dtype = DType::f64;
  expect_error(a, "x must be float32, bfloat16 or float16, got float64");
  a = f;
  a.mask.view.shape[1] = 4;
  expect_error(a, "mask must have shape [B, S, S] = [1, 5, 5], got [1, 4, 5]");
  a = f;
  a.mask.view.device = Device::cuda;
  expect_error(a, "mask must be on x's device cpu, got cuda:0");
  a = f;
  a.w.p_out_weight.device = Device::cuda;
  expect_error(a, "p_out_weight must be on x's device cpu, got cuda:0");
  a = f;
  a.saved.go.dtype = DType::bf16;
  expect_error(a, "go must have x's dtype float32, got bfloat16");
  a = f;
  a.saved.a.stride[3] = 2;
  expect_error(a, "a must be contiguous");
  // The FP64 reference runs on CPU tensors only.
  a = f;
  for (TensorView* t : {&a.x, &a.mask.view, &a.y, &a.w.norm_in_weight, &a.w.norm_in_bias,
                        &a.w.p_in_weight, &a.w.g_in_weight, &a.w.norm_out_weight,
                        &a.w.norm_out_bias, &a.w.p_out_weight, &a.w.g_out_weight})
    t->device = Device::cuda;
  a.mask.present = false;
  try {
    reference::trimul_forward_f64(a);
    ADD_FAILURE() << "expected the reference to refuse CUDA tensors";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the FP64 reference runs on CPU tensors only, got x on "
                                         "cuda:0"),
              std::string::npos)
        << e.what();
  }
}

// The CUDA path's own checks, which run before anything is launched: views that claim to be on a
// CUDA device (host memory that is never read) reach them in a build with or without the kernels.
TEST(TrimulErrors, CudaChecksNameTheArgument) {
  Problem p(1, 5, 8, true, true, true, 4);
  Outputs<float> out(p);
  const TrimulBackwardArgs b = backward_args(p, out);
  Problem p12(1, 5, 12, true, true, true, 4);
  Outputs<float> out12(p12);
  auto on_cuda = [](TrimulBackwardArgs a) {
    for (TensorView* t :
         {&a.x, &a.mask.view, &a.saved.a, &a.saved.b, &a.saved.z, &a.saved.go, &a.dy, &a.dx})
      t->device = Device::cuda;
    for (TrimulWeights* w : {&a.w, &a.dw})
      for (TensorView* t : views_of(*w)) t->device = Device::cuda;
    return a;
  };
  auto expect_error = [&](const TrimulBackwardArgs& a, const char* fragment) {
    try {
      trimul_backward(on_cuda(a));
      ADD_FAILURE() << "expected an error mentioning " << fragment;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  TrimulBackwardArgs a = b;
  a.mask.view.dtype = DType::i32;
  expect_error(a,
               "mask must be bool, uint8, float32, bfloat16 or float16 for the CUDA kernels, "
               "got int32");
  a = b;
  a.w.g_out_bias.view.dtype = DType::bf16;
  expect_error(a,
               "g_out_bias must have the weights' dtype float32 (norm_in_weight's) for the "
               "CUDA kernels, got bfloat16");
  a = b;
  for (TensorView* t : views_of(a.w)) t->dtype = DType::f64;
  expect_error(a,
               "norm_in_weight (and every other weight) must be float32, bfloat16 or float16 "
               "for the CUDA kernels, got float64");
  a = b;
  a.dw.p_out_weight.dtype = DType::f16;
  expect_error(a, "d_p_out_weight must have the weights' dtype float32");
  a = b;
  a.w.p_in_weight.stride[0] = 2 * p.D;  // rows 2D apart (never read): not contiguous
  expect_error(a, "p_in_weight must be contiguous for the CUDA kernels");
  // A bool mask passes the CPU path's dtype check on CUDA tensors (the kernels read it).
  a = b;
  a.mask.view.dtype = DType::boolean;
  a.w.norm_in_weight.dtype = DType::f16;
  expect_error(a, "norm_in_bias must have the weights' dtype float16");
  a = backward_args(p12, out12);
  expect_error(a, "x must have D a multiple of 8 and at most 128 for the CUDA kernels, got D = 12");
  // cuBLAS's 32-bit sizes (and the forward kernels' grids): B S S positions at most 2^31 - 1.
  a = b;
  {
    const int64_t S = 46341, D = p.D;  // S^2 = 2^31 + 2^17 - 7
    auto resize = [&](TensorView& t, std::initializer_list<int64_t> shape) {
      t = make_view(t.data, t.dtype, shape, t.device);
    };
    for (TensorView* t : {&a.x, &a.saved.go, &a.dy, &a.dx}) resize(*t, {1, S, S, D});
    for (TensorView* t : {&a.saved.a, &a.saved.b, &a.saved.z}) resize(*t, {1, D, S, S});
    resize(a.mask.view, {1, S, S});
  }
  expect_error(a,
               "x must have B * S * S and B * D each at most 2147483647 for the CUDA kernels, got "
               "[1, 46341, 46341, 8]");
  a = b;
  a.x.stride[1] = 2 * p.S * p.D;
  expect_error(a, "x must be contiguous for the CUDA kernels");
  a = b;
  a.dx.dtype = DType::bf16;
  expect_error(a, "dx must have x's dtype float32 for the CUDA kernels, got bfloat16");
  a = b;
  a.dw.p_in_bias.present = false;
  expect_error(a, "d_p_in_bias must be given exactly when its bias is");
  a = b;
  a.dy.shape[1] = 4;
  expect_error(a, "grad_out must have shape [B, S, S, D] = [1, 5, 5, 8], got [1, 4, 5, 8]");
  a = b;
  expect_error(a, "workspace (an allocator) is required for CUDA tensors");
  // Past the checks, a build without the kernels says so; with them, the workspace is asked for.
  a = b;
  a.workspace = [](size_t) -> void* { throw Error("no workspace in this test"); };
  expect_error(a, cuda_available() ? "no workspace in this test" : "has no CUDA kernels");
}

}  // namespace
}  // namespace tpf
