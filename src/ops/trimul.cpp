// The triangle multiplicative update (tpf/trimul.h): the one validation of each call, then the CPU
// path or the FP64 reference (src/reference) or the CUDA kernels (src/kernels/trimul).
#include <cmath>
#include <string>
#include <utility>

#include "core/checks.h"
#include "kernels/trimul/api.h"
#include "reference/cpu.h"
#include "tpf/error.h"
#include "tpf/trimul.h"

namespace tpf {
namespace {

// Who runs a validated call: the CPU path or the kernels (x float32, bfloat16 or float16), or the
// FP64 reference (CPU tensors of any float dtype, nothing saved).
enum class Path { op, reference };

void check_like_x(const TensorView& t, const char* name, const TensorView& x) {
  check_shape(t, name, {x.shape[0], x.shape[1], x.shape[2], x.shape[3]}, "[B, S, S, D]");
  check_float_tensor(t, name, true);
  check_same_device(t, x, name, "x");
  check_inner_contiguous(t, name);
}

void check_param(const TensorView& t, const char* name, std::initializer_list<int64_t> shape,
                 const char* layout, const TensorView& x) {
  check_shape(t, name, shape, layout);
  check_float_tensor(t, name, true);
  check_same_device(t, x, name, "x");
  check_inner_contiguous(t, name);
}

void check_optional_param(const OptionalTensor& t, const char* name, int64_t n, const char* layout,
                          const TensorView& x) {
  if (t.present) check_param(t.view, name, {n}, layout, x);
}

TrimulDims check_inputs(const TensorView& x, const OptionalTensor& mask, const TrimulWeights& w,
                        double eps, Path path) {
  TPF_CHECK(x.ndim == 4, "x must have 4 dimensions [B, S, S, D], got " + x.shape_string());
  const TrimulDims d{x.shape[0], x.shape[1], x.shape[3]};
  TPF_CHECK(d.B >= 1 && d.S >= 1 && d.D >= 1,
            "x must have B, S and D of at least 1, got " + x.shape_string());
  TPF_CHECK(x.shape[2] == d.S,
            "x must be square in its two middle dimensions [B, S, S, D], got " + x.shape_string());
  check_float_tensor(x, "x", path == Path::reference);
  check_inner_contiguous(x, "x");
  TPF_CHECK(path == Path::op || x.device == Device::cpu,
            "the FP64 reference runs on CPU tensors only, got x on " + device_name(x));
  if (mask.present) {
    check_shape(mask.view, "mask", {d.B, d.S, d.S}, "[B, S, S]");
    check_same_device(mask.view, x, "mask", "x");
    // The CUDA kernels read other dtypes too (check_cuda says which).
    if (x.device == Device::cpu) check_same_dtype(mask.view, x, "mask", "x");
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
  TPF_CHECK(std::isfinite(eps) && eps > 0, "eps must be a positive number, got " + number(eps));
  return d;
}

void check_saved_tensor(const TensorView& t, const char* name, std::initializer_list<int64_t> shape,
                        const char* layout, const TensorView& x) {
  check_shape(t, name, shape, layout);
  check_same_dtype(t, x, name, "x");
  check_same_device(t, x, name, "x");
  check_contiguous(t, name);
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

void require_contiguous(const TensorView& t, const char* name) {
  TPF_CHECK(t.is_contiguous(), std::string(name) + " must be contiguous for the CUDA kernels");
}

void require_x_dtype(const TensorView& t, const char* name, const TensorView& x) {
  TPF_CHECK(t.dtype == x.dtype, std::string(name) + " must have x's dtype " + dtype_name(x.dtype) +
                                    " for the CUDA kernels, got " + dtype_name(t.dtype));
  require_contiguous(t, name);
}

// Every weight (prefix "") or weight gradient (prefix "d_") has `dtype`, the weights' one dtype,
// and is contiguous; absent biases are skipped.
void require_weights(const TrimulWeights& w, const char* prefix, DType dtype) {
  const std::pair<const char*, OptionalTensor> all[] = {
      {"norm_in_weight", {true, w.norm_in_weight}},   {"norm_in_bias", {true, w.norm_in_bias}},
      {"p_in_weight", {true, w.p_in_weight}},         {"p_in_bias", w.p_in_bias},
      {"g_in_weight", {true, w.g_in_weight}},         {"g_in_bias", w.g_in_bias},
      {"norm_out_weight", {true, w.norm_out_weight}}, {"norm_out_bias", {true, w.norm_out_bias}},
      {"p_out_weight", {true, w.p_out_weight}},       {"p_out_bias", w.p_out_bias},
      {"g_out_weight", {true, w.g_out_weight}},       {"g_out_bias", w.g_out_bias}};
  for (const auto& [weight, t] : all) {
    if (!t.present) continue;
    const std::string name = std::string(prefix) + weight;
    TPF_CHECK(t.view.dtype == dtype, name + " must have the weights' dtype " + dtype_name(dtype) +
                                         " (norm_in_weight's) for the CUDA kernels, got " +
                                         dtype_name(t.view.dtype));
    require_contiguous(t.view, name.c_str());
  }
}

// What the CUDA kernels need beyond the checks above: D a multiple of 8 up to kTrimulMaxD, sizes
// up to kTrimulMaxPositions (api.h: every limit a launch would meet, checked before any), a mask
// of bool, uint8 or a 16- or 32-bit float type, all weights of one 16- or 32-bit float type (the
// kernels read them in it), contiguous tensors. Returns the weights' dtype.
DType check_cuda(const TrimulDims& d, const TensorView& x, const OptionalTensor& mask,
                 const TrimulWeights& w) {
  TPF_CHECK(d.D % 8 == 0 && d.D <= cuda::kTrimulMaxD,
            "x must have D a multiple of 8 and at most " + std::to_string(cuda::kTrimulMaxD) +
                " for the CUDA kernels, got D = " + std::to_string(d.D));
  TPF_CHECK(d.B * d.S * d.S <= cuda::kTrimulMaxPositions && d.B * d.D <= cuda::kTrimulMaxPositions,
            "x must have B * S * S and B * D each at most " +
                std::to_string(cuda::kTrimulMaxPositions) + " for the CUDA kernels, got " +
                x.shape_string());
  require_contiguous(x, "x");
  if (mask.present) {
    const DType m = mask.view.dtype;
    TPF_CHECK(m == DType::boolean || m == DType::u8 || is_float16_or_32(m),
              std::string("mask must be bool, uint8, float32, bfloat16 or float16 for the CUDA "
                          "kernels, got ") +
                  dtype_name(m));
    require_contiguous(mask.view, "mask");
  }
  const DType dtype = w.norm_in_weight.dtype;
  TPF_CHECK(is_float16_or_32(dtype),
            std::string("norm_in_weight (and every other weight) must be float32, bfloat16 or "
                        "float16 for the CUDA kernels, got ") +
                dtype_name(dtype));
  require_weights(w, "", dtype);
  return dtype;
}

void check_workspace(const Allocator& workspace) {
  TPF_CHECK(static_cast<bool>(workspace), "workspace (an allocator) is required for CUDA tensors");
}

TrimulDims validate_forward(const TrimulForwardArgs& a, Path path) {
  const TrimulDims d = check_inputs(a.x, a.mask, a.w, a.eps, path);
  check_like_x(a.y, "y", a.x);
  if (path == Path::reference) return d;
  check_saved(a.saved, d, a.x);
  if (a.x.device == Device::cuda) {
    check_cuda(d, a.x, a.mask, a.w);
    require_x_dtype(a.y, "y", a.x);
    check_workspace(a.workspace);
  }
  return d;
}

TrimulDims validate_backward(const TrimulBackwardArgs& a, Path path) {
  const TrimulDims d = check_inputs(a.x, a.mask, a.w, a.eps, path);
  if (path == Path::op) check_saved(a.saved, d, a.x);
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
  if (path == Path::op && a.x.device == Device::cuda) {
    require_weights(a.dw, "d_", check_cuda(d, a.x, a.mask, a.w));
    require_x_dtype(a.dy, "grad_out", a.x);
    require_x_dtype(a.dx, "dx", a.x);
    check_workspace(a.workspace);
  }
  return d;
}

}  // namespace

void trimul_forward(const TrimulForwardArgs& a, void* stream) {
  const TrimulDims d = validate_forward(a, Path::op);
  if (a.x.device == Device::cpu) return cpu::trimul_forward(a, d);
  cuda::trimul_forward(a, d, stream);
}

void trimul_backward(const TrimulBackwardArgs& a, void* stream) {
  const TrimulDims d = validate_backward(a, Path::op);
  if (a.x.device == Device::cpu) return cpu::trimul_backward(a, d);
  cuda::trimul_backward(a, d, stream);
}

namespace reference {

void trimul_forward_f64(const TrimulForwardArgs& a) {
  cpu::trimul_forward_f64(a, validate_forward(a, Path::reference));
}

void trimul_backward_f64(const TrimulBackwardArgs& a) {
  cpu::trimul_backward_f64(a, validate_backward(a, Path::reference));
}

}  // namespace reference
}  // namespace tpf
