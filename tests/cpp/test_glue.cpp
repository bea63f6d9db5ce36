// The fused glue ops' validation: each bad argument gets an Error that names it and what was
// expected (their arithmetic is tested against FP64 in tests/python/test_glue.py).
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "tpf/error.h"
#include "tpf/glue.h"

namespace tpf {
namespace {

template <typename Args>
void expect_error(const Args& good, const std::function<void(Args&)>& mutate,
                  const std::function<void(const Args&)>& call, const char* expected) {
  Args a = good;
  mutate(a);
  try {
    call(a);
    ADD_FAILURE() << "expected an error mentioning " << expected;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
  }
}

TEST(GlueErrors, LayerNormNamesTheArgument) {
  const int64_t R = 6, C = 8;
  std::vector<float> x(R * C, 1.0f), y(R * C), w(C, 1.0f), b(C), mean(R), rstd(R), dx(R * C), dw(C),
      db(C);
  LayerNormBackwardArgs g;
  g.dy = make_view(y.data(), DType::f32, {2, 3, C});
  g.x = make_view(x.data(), DType::f32, {2, 3, C});
  g.weight = make_view(w.data(), DType::f32, {C});
  g.mean = make_view(mean.data(), DType::f32, {R});
  g.rstd = make_view(rstd.data(), DType::f32, {R});
  g.dx = make_view(dx.data(), DType::f32, {2, 3, C});
  g.dweight = make_view(dw.data(), DType::f32, {C});
  g.dbias = make_view(db.data(), DType::f32, {C});
  auto forward = [&](const LayerNormBackwardArgs& a) {
    LayerNormForwardArgs f;
    f.x = a.x, f.weight = a.weight, f.bias = make_view(b.data(), DType::f32, {C});
    f.y = a.dy, f.mean = a.mean, f.rstd = a.rstd;
    layer_norm_forward(f);
  };
  auto backward = [](const LayerNormBackwardArgs& a) { layer_norm_backward(a); };
  forward(g);
  backward(g);
  using M = std::function<void(LayerNormBackwardArgs&)>;
  const std::vector<std::pair<M, const char*>> both = {
      {[](auto& a) { a.x.dtype = DType::f64; },
       "x must be float32, bfloat16 or float16, got float64"},
      {[](auto& a) { a.x.ndim = 0; }, "x must have 1 to 4 dimensions ([..., C]), got []"},
      {[](auto& a) { a.x.stride[2] = 2; }, "x must have stride 1 in its last dimension"},
      {[](auto& a) { a.weight.shape[0] = 7; },
       "weight must have shape [C] (x's last dim) = [8], got [7]"},
      {[](auto& a) { a.weight.dtype = DType::bf16; }, "weight must be float32, got bfloat16"},
      {[](auto& a) { a.weight.device = Device::cuda; },
       "weight must be on x's device cpu, got cuda:0"},
      {[](auto& a) { a.mean.shape[0] = 5; }, "mean must have shape [rows] = [6], got [5]"},
      {[](auto& a) { a.rstd.stride[0] = 2; }, "rstd must be contiguous"},
  };
  for (const auto& [mutate, expected] : both) {
    expect_error<LayerNormBackwardArgs>(g, mutate, forward, expected);
    expect_error<LayerNormBackwardArgs>(g, mutate, backward, expected);
  }
  expect_error<LayerNormBackwardArgs>(
      g, [](auto& a) { a.dy.shape[1] = 2; }, forward,
      "y must have x's shape [2, 3, 8], got [2, 2, 8]");
  expect_error<LayerNormBackwardArgs>(
      g, [](auto& a) { a.dy.dtype = DType::i64; }, backward,
      "grad_y must be float32, bfloat16 or float16, got int64");
  expect_error<LayerNormBackwardArgs>(
      g, [](auto& a) { a.dx.stride[0] = 48; }, backward,
      "dx must have x's dtype, shape and strides");
  expect_error<LayerNormBackwardArgs>(
      g, [](auto& a) { a.dbias.shape[0] = 9; }, backward,
      "dbias must have shape [C] (x's last dim) = [8], got [9]");
  expect_error<LayerNormBackwardArgs>(
      g,
      [](auto& a) {
        for (TensorView* t :
             {&a.dy, &a.x, &a.weight, &a.mean, &a.rstd, &a.dx, &a.dweight, &a.dbias})
          t->device = Device::cuda;
      },
      backward, "workspace (an allocator) is required for CUDA tensors");
}

TEST(GlueErrors, SwigluAndGateNameTheArgument) {
  std::vector<float> ab(4 * 6), h(4 * 3), dab(4 * 6);
  SwigluArgs s;
  s.ab = make_view(ab.data(), DType::f32, {4, 6});
  s.h = s.dh = make_view(h.data(), DType::f32, {4, 3});
  s.dab = make_view(dab.data(), DType::f32, {4, 6});
  auto fwd = [](const SwigluArgs& a) { swiglu_forward(a); };
  auto bwd = [](const SwigluArgs& a) { swiglu_backward(a); };
  fwd(s);
  bwd(s);
  expect_error<SwigluArgs>(
      s, [](auto& a) { a.ab.shape[1] = 5; }, fwd,
      "ab must have shape [M, 2H] (a then b: an even last dim), got [4, 5]");
  expect_error<SwigluArgs>(
      s, [](auto& a) { a.h.dtype = DType::bf16; }, fwd,
      "h must have ab's dtype float32, got bfloat16");
  expect_error<SwigluArgs>(
      s, [](auto& a) { a.dh.shape[0] = 3; }, bwd,
      "grad_h must have shape [M, H] = [4, 3], got [3, 3]");
  expect_error<SwigluArgs>(
      s, [](auto& a) { a.dab.shape[1] = 4; }, bwd, "dab must have ab's shape [4, 6], got [4, 4]");

  // o [BN, H, S, D] = [2, 2, 3, 4]: g [BN*S, H*D] = [6, 8]
  std::vector<float> g(6 * 8), o(2 * 2 * 3 * 4), y(6 * 8), dg(6 * 8), dout(o.size());
  GatedOutputArgs t;
  t.g = make_view(g.data(), DType::f32, {6, 8});
  t.o = make_view(o.data(), DType::f32, {2, 2, 3, 4});
  t.y = t.dy = make_view(y.data(), DType::f32, {6, 8});
  t.dg = make_view(dg.data(), DType::f32, {6, 8});
  t.do_ = make_view(dout.data(), DType::f32, {2, 2, 3, 4});
  auto gate_fwd = [](const GatedOutputArgs& a) { gated_output_forward(a); };
  auto gate_bwd = [](const GatedOutputArgs& a) { gated_output_backward(a); };
  gate_fwd(t);
  gate_bwd(t);
  expect_error<GatedOutputArgs>(
      t, [](auto& a) { a.g.shape[1] = 7; }, gate_fwd,
      "g must have shape [BN*S, H*D] = [6, 8] for o [2, 2, 3, 4], got [6, 7]");
  expect_error<GatedOutputArgs>(
      t, [](auto& a) { a.g.stride[0] = 4; }, gate_fwd,
      "g's rows must not overlap (row stride at least H*D), got row stride 4");
  expect_error<GatedOutputArgs>(
      t, [](auto& a) { a.o.ndim = 3; }, gate_fwd, "o must have shape [BN, H, S, D], got [2, 2, 3]");
  expect_error<GatedOutputArgs>(
      t, [](auto& a) { a.o.device = Device::cuda; }, gate_fwd,
      "o must be on g's device cpu, got cuda:0");
  expect_error<GatedOutputArgs>(
      t, [](auto& a) { a.y.dtype = DType::f16; }, gate_fwd,
      "y must have g's dtype float32, got float16");
  expect_error<GatedOutputArgs>(
      t, [](auto& a) { a.do_.shape[0] = 1; }, gate_bwd,
      "do must have o's shape [2, 2, 3, 4], got [1, 2, 3, 4]");
  expect_error<GatedOutputArgs>(
      t, [](auto& a) { a.dy.stride[0] = 16; }, gate_bwd, "grad_y must be contiguous");
}

}  // namespace
}  // namespace tpf
