// Triangle attention on the CPU: the FP32 path against the FP64 reference, the reference's
// gradients against finite differences, determinism, and argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
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

// p's backward arguments over out's buffers (the forward's are their first fields).
template <typename T>
AttentionBackwardArgs backward_args(Problem& p, Outputs<T>& out) {
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
  AttentionBackwardArgs b = backward_args_of(f);
  b.dout = p.qkv(p.dout);
  b.dq = make_view(out.dq.data(), dt, {p.B, p.N, p.H, p.S, p.D});
  b.dk = make_view(out.dk.data(), dt, {p.B, p.N, p.H, p.S, p.D});
  b.dv = make_view(out.dv.data(), dt, {p.B, p.N, p.H, p.S, p.D});
  b.dbias = make_view(out.dbias.data(), dt, {p.B, p.H, p.S, p.S});
  return b;
}

// The forward's arguments of a backward's (the fields they share).
AttentionForwardArgs forward_args_of(const AttentionBackwardArgs& b) {
  AttentionForwardArgs f;
  f.q = b.q, f.k = b.k, f.v = b.v, f.bias = b.bias, f.mask = b.mask, f.o = b.o, f.lse = b.lse;
  f.residual = b.residual, f.scale = b.scale, f.workspace = b.workspace;
  return f;
}

template <typename T>
void run(Problem& p, Outputs<T>& out, bool reference) {
  const AttentionBackwardArgs b = backward_args(p, out);
  const AttentionForwardArgs f = forward_args_of(b);
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
    return dot(o.o, p.dout);
  };
  auto check = [&](std::vector<float>& x, const std::vector<double>& grad, const char* name) {
    expect_matches_finite_differences(x, grad, name, loss, 3, 2e-4);
  };
  check(p.q, g.dq, "dq");
  check(p.k, g.dk, "dk");
  check(p.v, g.dv, "dv");
  check(p.bias, g.dbias, "dbias");
}

// Each bad argument of the forward, the backward and the reference gets an Error that names it and
// what was expected. Views that claim to be on a CUDA device (host memory that is never read)
// reach the CUDA path's checks in a build with or without the kernels: they run first.
struct BadInput {
  const char* expected;  // a fragment of the message
  std::function<void(AttentionBackwardArgs&)> mutate;
};

void expect_errors(const AttentionBackwardArgs& good, const std::vector<BadInput>& cases,
                   const std::function<void(const AttentionBackwardArgs&)>& call) {
  for (const BadInput& c : cases) {
    AttentionBackwardArgs a = good;
    c.mutate(a);
    try {
      call(a);
      ADD_FAILURE() << "expected an error mentioning " << c.expected;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(c.expected), std::string::npos) << e.what();
    }
  }
}

void on_cuda(AttentionBackwardArgs& a) {
  for (TensorView* t : {&a.q, &a.k, &a.v, &a.bias, &a.mask.view, &a.o, &a.lse, &a.dout, &a.dq,
                        &a.dk, &a.dv, &a.dbias, &a.residual.view})
    t->device = Device::cuda;
  for (TensorView* t : {&a.q, &a.k, &a.v, &a.bias, &a.o, &a.dout, &a.dq, &a.dk, &a.dv, &a.dbias})
    t->dtype = DType::bf16;
  a.lse.dtype = DType::f32;
  a.residual.present = false;
  a.workspace = [](size_t) -> void* { throw Error("no workspace in this test"); };
}

TEST(Errors, NameTheArgument) {
  Problem p(1, 2, 1, 5, 16, 3);
  Outputs<float> out(p);
  AttentionBackwardArgs g = backward_args(p, out);
  g.scale = 0.3;
  auto forward = [](const AttentionBackwardArgs& b) { attention_forward(forward_args_of(b)); };
  auto backward = [](const AttentionBackwardArgs& b) { attention_backward(b); };
  forward(g);
  backward(g);
  const std::vector<BadInput> inputs = {
      {"q must have 5 dimensions [B, N, H, S, D], got [1, 2, 1, 5]", [](auto& a) { a.q.ndim = 4; }},
      {"k must have 5 dimensions", [](auto& a) { a.k.ndim = 6; }},
      {"q must have B, N and H of at least 1", [](auto& a) { a.q.shape[2] = 0; }},
      {"q must have at least one token (S >= 1)", [](auto& a) { a.q.shape[3] = 0; }},
      {"k must have at least one token (S >= 1)", [](auto& a) { a.k.shape[3] = 0; }},
      {"q must have a head dimension D >= 1", [](auto& a) { a.q.shape[4] = 0; }},
      {"k must have shape [B, N, H, S, D] = [1, 2, 1, 5, 16], got [1, 2, 1, 5, 8]",
       [](auto& a) { a.k.shape[4] = 8; }},
      {"v must have shape [B, N, H, S, D] = [1, 2, 1, 5, 16], got [1, 1, 1, 5, 16]",
       [](auto& a) { a.v.shape[1] = 1; }},
      {"bias must have shape [B, H, S, S] (or [B, 1, H, S, S]) = [1, 1, 5, 5], got [1, 1, 5, 4]",
       [](auto& a) { a.bias.shape[3] = 4; }},
      {"bias must have shape [B, H, S, S] (or [B, 1, H, S, S]) = [1, 1, 5, 5], got [1, 2, 1, 5, 5]",
       [](auto& a) {
         a.bias = make_view(a.bias.data, DType::f32, {1, 2, 1, 5, 5});
       }},
      {"q must be float32, bfloat16 or float16, got float64",
       [](auto& a) { a.q.dtype = DType::f64; }},
      {"k must have q's dtype float32, got float16", [](auto& a) { a.k.dtype = DType::f16; }},
      {"v must have q's dtype float32, got bfloat16", [](auto& a) { a.v.dtype = DType::bf16; }},
      {"bias must have q's dtype float32, got float16", [](auto& a) { a.bias.dtype = DType::f16; }},
      {"k must be on q's device cpu, got cuda:0", [](auto& a) { a.k.device = Device::cuda; }},
      {"v must be on q's device cpu, got cuda:1",
       [](auto& a) { a.v.device = Device::cuda, a.v.device_index = 1; }},
      {"bias must be on q's device cpu", [](auto& a) { a.bias.device = Device::cuda; }},
      {"q must have stride 1 in its last dimension, got stride 2",
       [](auto& a) { a.q.stride[4] = 2; }},
      {"v must have stride 1", [](auto& a) { a.v.stride[4] = 2; }},
      {"bias must have stride 1", [](auto& a) { a.bias.stride[3] = 3; }},
      {"mask must have shape [B, N, S] (or [B, N, 1, 1, S]) = [1, 2, 5], got [1, 5]",
       [](auto& a) {
         a.mask.view = make_view(a.mask.view.data, DType::boolean, {1, 5});
       }},
      {"mask must be bool (True = attend), got float32",
       [](auto& a) { a.mask.view.dtype = DType::f32; }},
      {"mask must be on q's device", [](auto& a) { a.mask.view.device = Device::cuda; }},
      {"scale must be a finite nonzero number, got 0", [](auto& a) { a.scale = 0; }},
      {"scale must be a finite nonzero number, got inf", [](auto& a) { a.scale = INFINITY; }},
      {"o must have shape [B, N, H, S, D] = [1, 2, 1, 5, 16], got [1, 2, 1, 4, 16]",
       [](auto& a) { a.o.shape[3] = 4; }},
      {"lse must have shape [B, N, H, S] = [1, 2, 1, 5]", [](auto& a) { a.lse.ndim = 3; }},
      {"lse must be float32 or float64, got bfloat16", [](auto& a) { a.lse.dtype = DType::bf16; }},
      {"residual must be bfloat16, got float32",
       [&](auto& a) {
         a.residual = {true, p.qkv(out.dq)};
       }},
  };
  expect_errors(g, inputs, forward);
  expect_errors(g, inputs, backward);
  expect_errors(g,
                {{"grad_out must have shape [B, N, H, S, D]", [](auto& a) { a.dout.shape[0] = 2; }},
                 {"dq must be float32, bfloat16 or float16, got int32",
                  [](auto& a) { a.dq.dtype = DType::i32; }},
                 {"dk must be on q's device", [](auto& a) { a.dk.device = Device::cuda; }},
                 {"dv must have stride 1", [](auto& a) { a.dv.stride[4] = 0; }},
                 {"dbias must have shape [B, H, S, S] (or [B, 1, H, S, S]) = [1, 1, 5, 5], got "
                  "[1, 1, 5]",
                  [](auto& a) { a.dbias.ndim = 3; }}},
                backward);
  // The CUDA kernels' own requirements.
  const std::vector<BadInput> cuda_inputs = {
      {"q must be bfloat16 or float16 for the CUDA kernels",
       [](auto& a) {
         on_cuda(a);
         for (TensorView* t : {&a.q, &a.k, &a.v, &a.bias, &a.o}) t->dtype = DType::f32;
       }},
      {"q must have B * H and the number of query tiles each at most 65535 for the CUDA kernels",
       [](auto& a) {
         on_cuda(a);
         for (TensorView* t : {&a.q, &a.k, &a.v, &a.o, &a.dout, &a.dq, &a.dk, &a.dv})
           t->shape[2] = 70000;
         for (TensorView* t : {&a.bias, &a.dbias}) t->shape[1] = 70000;
         a.lse.shape[2] = 70000;
       }},
  };
  expect_errors(g, cuda_inputs, forward);
  expect_errors(g, cuda_inputs, backward);
  // Head dims: the forward and the backward take multiples of 8 up to 128.
  auto head_dim = [](int64_t D) {
    return [D](auto& a) {
      on_cuda(a);
      for (TensorView* t : {&a.q, &a.k, &a.v, &a.o, &a.dout, &a.dq, &a.dk, &a.dv}) t->shape[4] = D;
    };
  };
  expect_errors(g,
                {{"q must have one of the CUDA forward's head dims D = 8, 16, 24, ..., 128 "
                  "(multiples of 8), got D = 20",
                  head_dim(20)},
                 {"q must have one of the CUDA forward's head dims", head_dim(136)}},
                forward);
  expect_errors(
      g,
      {{"q must have one of the CUDA backward's head dims D = 8, 16, 24, ..., 128 (multiples "
        "of 8), got D = 136",
        head_dim(136)}},
      backward);
  // The CUDA forward's most keys (its key tiles' mask words in shared memory): before any launch.
  expect_errors(g,
                {{"keys for the CUDA forward at D = 16, got Sk = 4194304",
                  [](auto& a) {
                    on_cuda(a);
                    const int64_t sk = int64_t(1) << 22;
                    a.k.shape[3] = a.v.shape[3] = a.bias.shape[3] = a.dbias.shape[3] = sk;
                    a.mask.view.shape[2] = sk;
                  }}},
                forward);
  // The backward's most keys (its dbias finish kernel's grid) and both kernels' most slices.
  expect_errors(g,
                {{"k must have at most 2097120 keys for the CUDA backward, got Sk = 2097121",
                  [](auto& a) {
                    on_cuda(a);
                    const int64_t sk = 2097121;
                    a.k.shape[3] = a.v.shape[3] = a.dk.shape[3] = a.dv.shape[3] = sk;
                    a.bias.shape[3] = a.dbias.shape[3] = sk;
                    a.mask.view.shape[2] = sk;
                  }}},
                backward);
  const std::vector<BadInput> slices = {
      {"q must have at most 2147483647 slices B * N * H for the CUDA kernels, got [1, "
       "2147483648, 1, 5, 16]",
       [](auto& a) {
         on_cuda(a);
         for (TensorView* t : {&a.q, &a.k, &a.v, &a.o, &a.dout, &a.dq, &a.dk, &a.dv, &a.lse})
           t->shape[1] = int64_t(1) << 31;
         a.mask.view.shape[1] = int64_t(1) << 31;
       }},
      // N alone within the limit, B * N * H past it.
      {"q must have at most 2147483647 slices B * N * H for the CUDA kernels, got [2, "
       "1073741824, 1, 5, 16]",
       [](auto& a) {
         on_cuda(a);
         for (TensorView* t : {&a.q, &a.k, &a.v, &a.o, &a.dout, &a.dq, &a.dk, &a.dv, &a.lse}) {
           t->shape[0] = 2;
           t->shape[1] = int64_t(1) << 30;
         }
         a.bias.shape[0] = a.dbias.shape[0] = a.mask.view.shape[0] = 2;
         a.mask.view.shape[1] = int64_t(1) << 30;
       }}};
  expect_errors(g, slices, forward);
  expect_errors(g, slices, backward);
  expect_errors(g,
                {{"o must have q's dtype bfloat16, got float32",
                  [](auto& a) { on_cuda(a), a.o.dtype = DType::f32; }},
                 {"lse must be float32 for CUDA tensors, got float64",
                  [](auto& a) { on_cuda(a), a.lse.dtype = DType::f64; }},
                 {"k must start on a 16-byte boundary with every stride a multiple of 16 bytes for "
                  "the CUDA forward (its TMA copies), got strides [",
                  [](auto& a) { on_cuda(a), a.k.stride[3] = 12; }},
                 {"v must start on a 16-byte boundary",
                  [](auto& a) {
                    on_cuda(a);
                    a.v.data = static_cast<char*>(a.v.data) + 2;
                  }},
                 {"workspace (an allocator) is required for CUDA tensors",
                  [](auto& a) { on_cuda(a), a.workspace = nullptr; }}},
                forward);
  // A float32 bias with 16-bit q, k, v is read by both CUDA kernels; its gradient is float32.
  expect_errors(g,
                {{"dbias must have bias's dtype float32, got bfloat16",
                  [](auto& a) { on_cuda(a), a.bias.dtype = DType::f32; }},
                 {cuda_available() ? "no workspace in this test" : "has no CUDA kernels",
                  [](auto& a) {
                    on_cuda(a);
                    a.bias.dtype = a.dbias.dtype = DType::f32;
                  }}},
                backward);
  expect_errors(g,
                {{"dbias must have bias's dtype bfloat16, got float32",
                  [](auto& a) { on_cuda(a), a.dbias.dtype = DType::f32; }},
                 {"grad_out must have q's dtype bfloat16, got float16",
                  [](auto& a) { on_cuda(a), a.dout.dtype = DType::f16; }},
                 {"workspace (an allocator) is required for CUDA tensors",
                  [](auto& a) { on_cuda(a), a.workspace = nullptr; }}},
                backward);
  // Past the checks, a build without the kernels says so; with them, the workspace is asked for.
  for (const auto& run : {std::function<void(const AttentionBackwardArgs&)>(forward),
                          std::function<void(const AttentionBackwardArgs&)>(backward)})
    expect_errors(g,
                  {{cuda_available() ? "no workspace in this test" : "has no CUDA kernels",
                    [](auto& a) { on_cuda(a); }}},
                  run);
  expect_errors(g,
                {{"the FP64 reference runs on CPU tensors only, got q on cuda:0",
                  [](auto& a) {
                    for (TensorView* t : {&a.q, &a.k, &a.v, &a.bias, &a.mask.view, &a.o, &a.lse,
                                          &a.dout, &a.dq, &a.dk, &a.dv, &a.dbias})
                      t->device = Device::cuda;
                  }}},
                [](const AttentionBackwardArgs& b) { reference::attention_backward_f64(b); });
}

// cuEquivariance's bias [B, 1, H, S, S] and mask [B, N, 1, 1, S] are the same call as [B, H, S, S]
// and [B, N, S].
TEST(Attention, TakesCuEquivarianceBiasAndMaskLayouts) {
  Problem p(2, 3, 2, 9, 8, 5);
  Outputs<float> four(p), five(p);
  auto run = [&](Outputs<float>& out, bool five_d) {
    AttentionForwardArgs f = forward_args_of(backward_args(p, out));
    f.bias = five_d ? make_view(p.bias.data(), DType::f32, {p.B, 1, p.H, p.S, p.S})
                    : make_view(p.bias.data(), DType::f32, {p.B, p.H, p.S, p.S});
    f.mask = {true, five_d ? make_view(p.mask.data(), DType::boolean, {p.B, p.N, 1, 1, p.S})
                           : make_view(p.mask.data(), DType::boolean, {p.B, p.N, p.S})};
    f.scale = 0.4;
    attention_forward(f);
  };
  run(four, false);
  run(five, true);
  EXPECT_EQ(std::memcmp(four.o.data(), five.o.data(), four.o.size() * sizeof(float)), 0);
}

}  // namespace
}  // namespace tpf
