// The fused glue ops (tpf/glue.h): the one validation of each, then the CPU loops
// (src/reference/glue_cpu.cpp) or the CUDA kernels (src/kernels/glue).
#include <cmath>
#include <string>

#include "core/checks.h"
#include "core/glue_geometry.h"
#include "kernels/glue/api.h"
#include "reference/cpu.h"
#include "tpf/error.h"
#include "tpf/glue.h"

namespace tpf {
namespace {

using glue::Heads;
using glue::Rows;

std::string str(const char* name, const char* what) { return std::string(name) + what; }

void check_contiguous_like(const TensorView& t, const char* name, const TensorView& ref,
                           const char* ref_name) {
  check_same_device(t, ref, name, ref_name);
  TPF_CHECK(t.ndim == ref.ndim && t.shape == ref.shape, str(name, " must have ") + ref_name +
                                                            "'s shape " + ref.shape_string() +
                                                            ", got " + t.shape_string());
  check_contiguous(t, name);
}

// A float32 vector of n elements (C channels or the rows), on x's device.
void check_f32_vector(const TensorView& t, const char* name, int64_t n, const char* layout,
                      const TensorView& x) {
  check_same_device(t, x, name, "x");
  TPF_CHECK(t.dtype == DType::f32, str(name, " must be float32, got ") + dtype_name(t.dtype));
  check_shape(t, name, {n}, layout);
  check_contiguous(t, name);
}

void check_workspace(const Allocator& w, const TensorView& x) {
  TPF_CHECK(x.device == Device::cpu || w, "workspace (an allocator) is required for CUDA tensors");
}

// x [..., C] with at most three leading dims: the rows, and their count.
Rows rows_of(const TensorView& x, int64_t* n_rows) {
  TPF_CHECK(x.ndim >= 1 && x.ndim <= 4,
            "x must have 1 to 4 dimensions ([..., C]), got " + x.shape_string());
  check_inner_contiguous(x, "x");
  const int64_t C = x.shape[x.ndim - 1];
  TPF_CHECK(C >= 1 && C <= kLayerNormMaxChannels,
            "x must have 1 to " + std::to_string(kLayerNormMaxChannels) +
                " channels in its last dimension, got " + std::to_string(C));
  int64_t n[3] = {1, 1, 1}, s[3] = {0, 0, 0};
  const int lead = x.ndim - 1;
  for (int i = 0; i < lead; ++i) {
    n[3 - lead + i] = x.shape[i];
    s[3 - lead + i] = x.stride[i];
  }
  *n_rows = n[0] * n[1] * n[2];
  Rows r;
  r.n1 = n[1] > 0 ? n[1] : 1;
  r.n2 = n[2] > 0 ? n[2] : 1;
  r.s0 = s[0];
  r.s1 = s[1];
  r.s2 = s[2];
  return r;
}

int64_t check_layer_norm_common(const TensorView& x, const TensorView& weight,
                                const TensorView& mean, const TensorView& rstd, Rows* rows) {
  check_float_tensor(x, "x");
  int64_t n_rows = 0;
  *rows = rows_of(x, &n_rows);
  const int64_t C = x.shape[x.ndim - 1];
  check_f32_vector(weight, "weight", C, "[C] (x's last dim)", x);
  check_f32_vector(mean, "mean", n_rows, "[rows]", x);
  check_f32_vector(rstd, "rstd", n_rows, "[rows]", x);
  return n_rows;
}

// M rows of H columns of ab [M, 2H] (and h, dh [M, H]).
void check_swiglu(const SwigluArgs& a, bool backward, int64_t* M, int64_t* H) {
  check_float_tensor(a.ab, "ab");
  TPF_CHECK(a.ab.ndim == 2 && a.ab.shape[1] % 2 == 0,
            "ab must have shape [M, 2H] (a then b: an even last dim), got " + a.ab.shape_string());
  check_contiguous(a.ab, "ab");
  *M = a.ab.shape[0];
  *H = a.ab.shape[1] / 2;
  const TensorView& h = backward ? a.dh : a.h;
  const char* h_name = backward ? "grad_h" : "h";
  check_same_device(h, a.ab, h_name, "ab");
  check_same_dtype(h, a.ab, h_name, "ab");
  check_shape(h, h_name, {*M, *H}, "[M, H]");
  check_contiguous(h, h_name);
  if (backward) {
    check_contiguous_like(a.dab, "dab", a.ab, "ab");
    check_same_dtype(a.dab, a.ab, "dab", "ab");
  }
}

Heads check_gated_output(const GatedOutputArgs& a, bool backward) {
  check_float_tensor(a.g, "g");
  TPF_CHECK(a.g.ndim == 2, "g must have shape [R, H*D], got " + a.g.shape_string());
  check_inner_contiguous(a.g, "g");
  TPF_CHECK(a.o.ndim == 4, "o must have shape [BN, H, S, D], got " + a.o.shape_string());
  check_same_device(a.o, a.g, "o", "g");
  check_same_dtype(a.o, a.g, "o", "g");
  check_contiguous(a.o, "o");
  const int64_t BN = a.o.shape[0], H = a.o.shape[1], S = a.o.shape[2], D = a.o.shape[3];
  TPF_CHECK(a.g.shape[0] == BN * S && a.g.shape[1] == H * D,
            "g must have shape [BN*S, H*D] = [" + std::to_string(BN * S) + ", " +
                std::to_string(H * D) + "] for o " + a.o.shape_string() + ", got " +
                a.g.shape_string());
  TPF_CHECK(a.g.shape[0] <= 1 || a.g.stride[0] >= a.g.shape[1],
            "g's rows must not overlap (row stride at least H*D), got row stride " +
                std::to_string(a.g.stride[0]));
  auto same = [&](const TensorView& t, const char* name, const TensorView& like,
                  const char* like_name) {
    check_contiguous_like(t, name, like, like_name);
    check_same_dtype(t, a.g, name, "g");
  };
  if (backward) {
    same(a.dy, "grad_y", a.g, "g");  // g's shape [R, H*D], contiguous
    same(a.dg, "dg", a.g, "g");
    same(a.do_, "do", a.o, "o");
  } else {
    same(a.y, "y", a.g, "g");
  }
  Heads heads;
  heads.S = S > 0 ? S : 1;
  heads.H = H;
  heads.D = D > 0 ? D : 1;
  return heads;
}

}  // namespace

void layer_norm_forward(const LayerNormForwardArgs& a, void* stream) {
  Rows rows;
  const int64_t n_rows = check_layer_norm_common(a.x, a.weight, a.mean, a.rstd, &rows);
  check_f32_vector(a.bias, "bias", a.x.shape[a.x.ndim - 1], "[C] (x's last dim)", a.x);
  check_float_tensor(a.y, "y");
  check_contiguous_like(a.y, "y", a.x, "x");
  TPF_CHECK(std::isfinite(a.eps) && a.eps > 0,
            "eps must be a positive number, got " + number(a.eps));
  if (n_rows == 0) return;
  if (a.x.device == Device::cpu) return cpu::layer_norm_forward(a, rows, n_rows);
  cuda::layer_norm_forward(a, rows, n_rows, stream);
}

void layer_norm_backward(const LayerNormBackwardArgs& a, void* stream) {
  Rows rows;
  const int64_t n_rows = check_layer_norm_common(a.x, a.weight, a.mean, a.rstd, &rows);
  const int64_t C = a.x.shape[a.x.ndim - 1];
  check_float_tensor(a.dy, "grad_y");
  check_contiguous_like(a.dy, "grad_y", a.x, "x");
  check_same_device(a.dx, a.x, "dx", "x");
  TPF_CHECK(a.dx.dtype == a.x.dtype && a.dx.ndim == a.x.ndim && a.dx.shape == a.x.shape &&
                a.dx.stride == a.x.stride,
            "dx must have x's dtype, shape and strides");
  check_f32_vector(a.dweight, "dweight", C, "[C] (x's last dim)", a.x);
  check_f32_vector(a.dbias, "dbias", C, "[C] (x's last dim)", a.x);
  check_workspace(a.workspace, a.x);
  if (a.x.device == Device::cpu) return cpu::layer_norm_backward(a, rows, n_rows);
  cuda::layer_norm_backward(a, rows, n_rows, stream);
}

namespace {

// One validated call of each op, forward or backward: an empty one does nothing.
void swiglu(const SwigluArgs& a, bool backward, void* stream) {
  int64_t M = 0, H = 0;
  check_swiglu(a, backward, &M, &H);
  if (M * H == 0) return;
  if (a.ab.device == Device::cpu) return cpu::swiglu(a, backward, M, H);
  if (backward)
    cuda::swiglu_backward(a, stream);
  else
    cuda::swiglu_forward(a, stream);
}

void gated_output(const GatedOutputArgs& a, bool backward, void* stream) {
  const Heads heads = check_gated_output(a, backward);
  if (a.g.numel() == 0) return;
  if (a.g.device == Device::cpu) return cpu::gated_output(a, heads, backward);
  if (backward)
    cuda::gated_output_backward(a, heads, stream);
  else
    cuda::gated_output_forward(a, heads, stream);
}

}  // namespace

void swiglu_forward(const SwigluArgs& a, void* stream) { swiglu(a, false, stream); }
void swiglu_backward(const SwigluArgs& a, void* stream) { swiglu(a, true, stream); }
void gated_output_forward(const GatedOutputArgs& a, void* stream) {
  gated_output(a, false, stream);
}
void gated_output_backward(const GatedOutputArgs& a, void* stream) {
  gated_output(a, true, stream);
}

}  // namespace tpf
