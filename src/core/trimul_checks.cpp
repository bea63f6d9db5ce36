// Argument validation for the triangle multiplicative update, shared by the CPU, CUDA and
// reference paths.
#include <cmath>
#include <string>

#include "core/checks.h"
#include "tpf/error.h"
#include "tpf/trimul.h"

namespace tpf {
namespace {

void check_like_x(const TensorView& t, const char* name, const TensorView& x) {
  check_shape(t, name, {x.shape[0], x.shape[1], x.shape[2], x.shape[3]}, "[B, S, S, D]");
  check_float_tensor(t, name);
  check_same_device(t, x, name, "x");
  check_inner_contiguous(t, name);
}

void check_param(const TensorView& t, const char* name, std::initializer_list<int64_t> shape,
                 const char* layout, const TensorView& x) {
  check_shape(t, name, shape, layout);
  check_float_tensor(t, name);
  check_same_device(t, x, name, "x");
  check_inner_contiguous(t, name);
}

void check_optional_param(const OptionalTensor& t, const char* name, int64_t n, const char* layout,
                          const TensorView& x) {
  if (t.present) check_param(t.view, name, {n}, layout, x);
}

TrimulDims check_inputs(const TensorView& x, const OptionalTensor& mask, const TrimulWeights& w,
                        double eps) {
  TPF_CHECK(x.ndim == 4, "x must have 4 dimensions [B, S, S, D], got " + x.shape_string());
  const TrimulDims d{x.shape[0], x.shape[1], x.shape[3]};
  TPF_CHECK(d.B >= 1 && d.S >= 1 && d.D >= 1,
            "x must have B, S and D of at least 1, got " + x.shape_string());
  TPF_CHECK(x.shape[2] == d.S,
            "x must be square in its two middle dimensions [B, S, S, D], got " + x.shape_string());
  check_float_tensor(x, "x");
  check_inner_contiguous(x, "x");
  if (mask.present) {
    check_shape(mask.view, "mask", {d.B, d.S, d.S}, "[B, S, S]");
    // The CUDA kernels read other dtypes too (trimul_dispatch.cpp checks which).
    TPF_CHECK(x.device != Device::cpu || mask.view.dtype == x.dtype,
              std::string("mask must have x's dtype ") + dtype_name(x.dtype) + ", got " +
                  dtype_name(mask.view.dtype));
    check_same_device(mask.view, x, "mask", "x");
    check_inner_contiguous(mask.view, "mask");
  }
  check_param(w.norm_in_weight, "norm_in_weight", {d.D}, "[D]", x);
  check_param(w.norm_in_bias, "norm_in_bias", {d.D}, "[D]", x);
  check_param(w.p_in_weight, "p_in_weight", {2 * d.D, d.D}, "[2D, D]", x);
  check_param(w.g_in_weight, "g_in_weight", {2 * d.D, d.D}, "[2D, D]", x);
  check_optional_param(w.p_in_bias, "p_in_bias", 2 * d.D, "[2D]", x);
  check_optional_param(w.g_in_bias, "g_in_bias", 2 * d.D, "[2D]", x);
  check_param(w.norm_out_weight, "norm_out_weight", {d.D}, "[D]", x);
  check_param(w.norm_out_bias, "norm_out_bias", {d.D}, "[D]", x);
  check_param(w.p_out_weight, "p_out_weight", {d.D, d.D}, "[D, D]", x);
  check_param(w.g_out_weight, "g_out_weight", {d.D, d.D}, "[D, D]", x);
  check_optional_param(w.p_out_bias, "p_out_bias", d.D, "[D]", x);
  check_optional_param(w.g_out_bias, "g_out_bias", d.D, "[D]", x);
  TPF_CHECK(std::isfinite(eps) && eps > 0,
            "eps must be a positive number, got " + std::to_string(eps));
  return d;
}

void check_saved_tensor(const TensorView& t, const char* name, std::initializer_list<int64_t> shape,
                        const char* layout, const TensorView& x) {
  check_shape(t, name, shape, layout);
  TPF_CHECK(t.dtype == x.dtype, std::string(name) + " must have x's dtype " + dtype_name(x.dtype) +
                                    ", got " + dtype_name(t.dtype));
  check_same_device(t, x, name, "x");
  TPF_CHECK(t.is_contiguous(), std::string(name) + " must be contiguous");
}

void check_saved(const TrimulSaved& s, const TrimulDims& d, const TensorView& x) {
  check_saved_tensor(s.a, "a", {d.B, d.D, d.S, d.S}, "[B, D, S, S]", x);
  check_saved_tensor(s.b, "b", {d.B, d.D, d.S, d.S}, "[B, D, S, S]", x);
  check_saved_tensor(s.z, "z", {d.B, d.D, d.S, d.S}, "[B, D, S, S]", x);
  check_saved_tensor(s.go, "go", {d.B, d.S, d.S, d.D}, "[B, S, S, D]", x);
}

void check_bias_grad(const OptionalTensor& bias, const OptionalTensor& grad, const char* name,
                     int64_t n, const char* layout, const TensorView& x) {
  TPF_CHECK(bias.present == grad.present,
            std::string(name) + " must be given exactly when its bias is");
  check_optional_param(grad, name, n, layout, x);
}

}  // namespace

TrimulDims check_trimul_forward(const TrimulForwardArgs& a, bool need_saved) {
  const TrimulDims d = check_inputs(a.x, a.mask, a.w, a.eps);
  check_like_x(a.y, "y", a.x);
  if (need_saved) check_saved(a.saved, d, a.x);
  return d;
}

TrimulDims check_trimul_backward(const TrimulBackwardArgs& a, bool need_saved) {
  const TrimulDims d = check_inputs(a.x, a.mask, a.w, a.eps);
  if (need_saved) check_saved(a.saved, d, a.x);
  check_like_x(a.dy, "grad_out", a.x);
  check_like_x(a.dx, "dx", a.x);
  const TrimulWeightGrads& g = a.dw;
  const TensorView& x = a.x;
  check_param(g.norm_in_weight, "d_norm_in_weight", {d.D}, "[D]", x);
  check_param(g.norm_in_bias, "d_norm_in_bias", {d.D}, "[D]", x);
  check_param(g.p_in_weight, "d_p_in_weight", {2 * d.D, d.D}, "[2D, D]", x);
  check_param(g.g_in_weight, "d_g_in_weight", {2 * d.D, d.D}, "[2D, D]", x);
  check_bias_grad(a.w.p_in_bias, g.p_in_bias, "d_p_in_bias", 2 * d.D, "[2D]", x);
  check_bias_grad(a.w.g_in_bias, g.g_in_bias, "d_g_in_bias", 2 * d.D, "[2D]", x);
  check_param(g.norm_out_weight, "d_norm_out_weight", {d.D}, "[D]", x);
  check_param(g.norm_out_bias, "d_norm_out_bias", {d.D}, "[D]", x);
  check_param(g.p_out_weight, "d_p_out_weight", {d.D, d.D}, "[D, D]", x);
  check_param(g.g_out_weight, "d_g_out_weight", {d.D, d.D}, "[D, D]", x);
  check_bias_grad(a.w.p_out_bias, g.p_out_bias, "d_p_out_bias", d.D, "[D]", x);
  check_bias_grad(a.w.g_out_bias, g.g_out_bias, "d_g_out_bias", d.D, "[D]", x);
  return d;
}

}  // namespace tpf
