#include <string>
#include <utility>

#include "kernels/trimul/api.h"
#include "tpf/error.h"
#include "tpf/trimul.h"

namespace tpf {
namespace {

void require_contiguous(const TensorView& t, const char* name) {
  TPF_CHECK(t.is_contiguous(), std::string(name) + " must be contiguous for the CUDA kernels");
}

void require_x_dtype(const TensorView& t, const char* name, const TensorView& x) {
  TPF_CHECK(t.dtype == x.dtype, std::string(name) + " must have x's dtype " + dtype_name(x.dtype) +
                                    " for the CUDA kernels, got " + dtype_name(t.dtype));
  require_contiguous(t, name);
}

bool is_kernel_float(DType d) { return d == DType::f32 || d == DType::bf16 || d == DType::f16; }

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

// What the CUDA kernels need beyond check_trimul_*: D a multiple of 8 up to kTrimulMaxD, 16- or
// 32-bit x, a mask of bool, uint8 or a 16- or 32-bit float type, all weights of one 16- or 32-bit
// float type (the kernels read them in it), contiguous tensors. Returns the weights' dtype.
DType check_cuda(const TrimulDims& d, const TensorView& x, const OptionalTensor& mask,
                 const TrimulWeights& w) {
  TPF_CHECK(d.D % 8 == 0 && d.D <= cuda::kTrimulMaxD,
            "x must have D a multiple of 8 and at most " + std::to_string(cuda::kTrimulMaxD) +
                " for the CUDA kernels, got D = " + std::to_string(d.D));
  TPF_CHECK(x.dtype != DType::f64, "x must be float32, bfloat16 or float16 for the CUDA kernels");
  require_contiguous(x, "x");
  if (mask.present) {
    const DType m = mask.view.dtype;
    TPF_CHECK(m == DType::boolean || m == DType::u8 || is_kernel_float(m),
              std::string("mask must be bool, uint8, float32, bfloat16 or float16 for the CUDA "
                          "kernels, got ") +
                  dtype_name(m));
    require_contiguous(mask.view, "mask");
  }
  const DType dtype = w.norm_in_weight.dtype;
  TPF_CHECK(is_kernel_float(dtype),
            std::string("norm_in_weight (and every other weight) must be float32, bfloat16 or "
                        "float16 for the CUDA kernels, got ") +
                dtype_name(dtype));
  require_weights(w, "", dtype);
  return dtype;
}

void check_workspace(size_t given, size_t need) {
  TPF_CHECK(given >= need, "workspace must hold at least " + std::to_string(need) + " bytes, got " +
                               std::to_string(given));
}

}  // namespace

void trimul_forward(const TrimulForwardArgs& a, void* stream) {
  const TrimulDims d = check_trimul_forward(a);
  if (a.x.device == Device::cpu) return trimul_forward_cpu(a);
  check_cuda(d, a.x, a.mask, a.w);
  require_x_dtype(a.y, "y", a.x);
  check_workspace(a.workspace_bytes, cuda::trimul_forward_workspace_bytes(d, a.x.dtype));
  cuda::trimul_forward(a, d, stream);
}

void trimul_backward(const TrimulBackwardArgs& a, void* stream) {
  const TrimulDims d = check_trimul_backward(a);
  if (a.x.device == Device::cpu) return trimul_backward_cpu(a);
  require_weights(a.dw, "d_", check_cuda(d, a.x, a.mask, a.w));
  require_x_dtype(a.dy, "grad_out", a.x);
  require_x_dtype(a.dx, "dx", a.x);
  check_workspace(a.workspace_bytes, cuda::trimul_backward_workspace_bytes(d, a.x.dtype));
  cuda::trimul_backward(a, d, stream);
}

size_t trimul_forward_workspace_bytes(const TrimulDims& d, DType dtype, Device device) {
  return device == Device::cpu ? 0 : cuda::trimul_forward_workspace_bytes(d, dtype);
}

size_t trimul_backward_workspace_bytes(const TrimulDims& d, DType dtype, Device device) {
  return device == Device::cpu ? 0 : cuda::trimul_backward_workspace_bytes(d, dtype);
}

}  // namespace tpf
