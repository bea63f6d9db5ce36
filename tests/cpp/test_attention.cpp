// Triangle attention on the CPU: the FP32 path against the FP64 reference, the reference's
// gradients against finite differences, determinism, and argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "test_util.h"
#include "tpf/attention.h"
#include "tpf/error.h"

namespace tpf {
namespace {

struct Problem {
  int64_t B, N, H, S, D;
  std::vector<float> q, k, v, bias, dout;
  std::vector<uint8_t> mask;

  Problem(int64_t B_, int64_t N_, int64_t H_, int64_t S_, int64_t D_, uint32_t seed)
      : B(B_), N(N_), H(H_), S(S_), D(D_) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    auto fill = [&](std::vector<float>& x, int64_t n) {
      x.resize(n);
      for (auto& e : x) e = normal(rng);
    };
    fill(q, B * N * H * S * D);
    fill(k, B * N * H * S * D);
    fill(v, B * N * H * S * D);
    fill(bias, B * H * S * S);
    fill(dout, B * N * H * S * D);
    mask.resize(B * N * S);
    std::bernoulli_distribution keep(0.8);
    for (auto& m : mask) m = keep(rng);
    for (int64_t s = 0; s < S; ++s) mask[(B * N - 1) * S + s] = 0;  // one fully masked slice
  }
  TensorView qkv(std::vector<float>& x) { return make_view(x.data(), DType::f32, {B, N, H, S, D}); }
  OptionalTensor mask_view() { return {true, make_view(mask.data(), DType::boolean, {B, N, S})}; }
};

template <typename T>
struct Outputs {
  std::vector<T> o, lse, dq, dk, dv, dbias;
  explicit Outputs(const Problem& p)
      : o(p.B * p.N * p.H * p.S * p.D, T(NAN)),
        lse(p.B * p.N * p.H * p.S, T(NAN)),
        dq(o.size(), T(NAN)),
        dk(o.size(), T(NAN)),
        dv(o.size(), T(NAN)),
        dbias(p.B * p.H * p.S * p.S, T(NAN)) {}
};

template <typename T>
DType dtype_of() {
  return sizeof(T) == 8 ? DType::f64 : DType::f32;
}

template <typename T>
void run(Problem& p, Outputs<T>& out, bool reference) {
  const DType dt = dtype_of<T>();
  AttentionForwardArgs f;
  f.q = p.qkv(p.q);
  f.k = p.qkv(p.k);
  f.v = p.qkv(p.v);
  f.bias = make_view(p.bias.data(), DType::f32, {p.B, p.H, p.S, p.S});
  f.mask = p.mask_view();
  f.o = make_view(out.o.data(), dt, {p.B, p.N, p.H, p.S, p.D});
  f.lse = make_view(out.lse.data(), dt, {p.B, p.N, p.H, p.S});
  f.scale = 1.0 / std::sqrt(double(p.D));
  AttentionBackwardArgs b;
  b.q = f.q;
  b.k = f.k;
  b.v = f.v;
  b.bias = f.bias;
  b.mask = f.mask;
  b.o = f.o;
  b.lse = f.lse;
  b.dout = p.qkv(p.dout);
  b.dq = make_view(out.dq.data(), dt, {p.B, p.N, p.H, p.S, p.D});
  b.dk = make_view(out.dk.data(), dt, {p.B, p.N, p.H, p.S, p.D});
  b.dv = make_view(out.dv.data(), dt, {p.B, p.N, p.H, p.S, p.D});
  b.dbias = make_view(out.dbias.data(), dt, {p.B, p.H, p.S, p.S});
  b.scale = f.scale;
  if (reference) {
    reference::attention_forward_f64(f);
    reference::attention_backward_f64(b);
  } else {
    attention_forward(f);
    attention_backward(b);
  }
}

class CpuPathVsReference : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(CpuPathVsReference, MatchesFp64) {
  const auto [S, D] = GetParam();
  Problem p(2, std::min(S, 9), 2, S, D, 1000 + S * 7 + D);
  Outputs<float> got(p);
  Outputs<double> want(p);
  run(p, got, false);
  run(p, want, true);
  // FP32 math: errors are a few ulps of float times the reduction length.
  const double tol = 2e-5;
  EXPECT_LT(max_rel_err(got.o, want.o), tol);
  EXPECT_LT(max_rel_err(got.dq, want.dq), tol);
  EXPECT_LT(max_rel_err(got.dk, want.dk), tol);
  EXPECT_LT(max_rel_err(got.dv, want.dv), tol);
  EXPECT_LT(max_rel_err(got.dbias, want.dbias), tol);
  // The fully masked slice: zeros, never NaN.
  const int64_t slice = p.H * p.S * p.D;
  for (int64_t i = (p.B * p.N - 1) * slice; i < p.B * p.N * slice; ++i) {
    ASSERT_EQ(got.o[i], 0.0f);
    ASSERT_EQ(got.dq[i], 0.0f);
    ASSERT_EQ(got.dk[i], 0.0f);
    ASSERT_EQ(got.dv[i], 0.0f);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuPathVsReference,
                         ::testing::Combine(::testing::Values(1, 7, 33, 100),
                                            ::testing::Values(16, 32, 64)));

TEST(CpuPath, BitwiseDeterministic) {
  Problem p(2, 6, 3, 70, 32, 7);
  Outputs<float> first(p);
  run(p, first, false);
  for (int call = 0; call < 4; ++call) {
    Outputs<float> again(p);
    run(p, again, false);
    ASSERT_EQ(0, std::memcmp(first.o.data(), again.o.data(), first.o.size() * 4));
    ASSERT_EQ(0, std::memcmp(first.dq.data(), again.dq.data(), first.dq.size() * 4));
    ASSERT_EQ(0, std::memcmp(first.dk.data(), again.dk.data(), first.dk.size() * 4));
    ASSERT_EQ(0, std::memcmp(first.dv.data(), again.dv.data(), first.dv.size() * 4));
    ASSERT_EQ(0, std::memcmp(first.dbias.data(), again.dbias.data(), first.dbias.size() * 4));
  }
}

// The FP64 reference's gradients against central finite differences of L = sum(o * dout).
TEST(Reference, GradientsMatchFiniteDifferences) {
  Problem p(1, 3, 2, 6, 4, 11);
  Outputs<double> g(p);
  run(p, g, true);
  auto loss = [&]() {
    Outputs<double> o(p);
    run(p, o, true);
    double l = 0;
    for (size_t i = 0; i < o.o.size(); ++i) l += o.o[i] * p.dout[i];
    return l;
  };
  auto check = [&](std::vector<float>& x, const std::vector<double>& grad, const char* name) {
    expect_matches_finite_differences(x, grad, name, loss, 3, 2e-4);
  };
  check(p.q, g.dq, "dq");
  check(p.k, g.dk, "dk");
  check(p.v, g.dv, "dv");
  check(p.bias, g.dbias, "dbias");
}

TEST(Errors, NameTheArgument) {
  Problem p(1, 2, 1, 5, 8, 3);
  Outputs<float> out(p);
  AttentionForwardArgs f;
  f.q = p.qkv(p.q);
  f.k = p.qkv(p.k);
  f.v = p.qkv(p.v);
  f.bias = make_view(p.bias.data(), DType::f32, {p.B, p.H, p.S, p.S});
  f.o = make_view(out.o.data(), DType::f32, {p.B, p.N, p.H, p.S, p.D});
  f.lse = make_view(out.lse.data(), DType::f32, {p.B, p.N, p.H, p.S});
  f.scale = 0.3;
  auto expect_error = [&](AttentionForwardArgs a, const char* fragment) {
    try {
      attention_forward(a);
      ADD_FAILURE() << "expected an error mentioning " << fragment;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  AttentionForwardArgs a = f;
  a.bias = make_view(p.bias.data(), DType::f32, {p.B, p.H, p.S, p.S - 1});
  expect_error(a, "bias must have shape");
  a = f;
  a.mask = {true, make_view(p.mask.data(), DType::f32, {p.B, p.N, p.S})};
  expect_error(a, "mask must be bool");
  a = f;
  a.k.dtype = DType::f16;
  expect_error(a, "k must have q's dtype");
  a = f;
  a.q.ndim = 4;
  expect_error(a, "q must have 5 dimensions");
  a = f;
  a.v.stride[4] = 2;
  expect_error(a, "v must have stride 1");
  a = f;
  a.scale = 0;
  expect_error(a, "scale");
}

}  // namespace
}  // namespace tpf
