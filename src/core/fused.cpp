// The fused glue ops (tpf/fused.h): validation, the CPU path, dispatch to the CUDA kernels.
#include <cmath>
#include <string>
#include <vector>

#include "core/checks.h"
#include "core/numeric.h"
#include "core/parallel.h"
#include "kernels/fused/api.h"
#include "tpf/error.h"
#include "tpf/fused.h"

namespace tpf {
namespace {

using fused::Heads;
using fused::Rows;

std::string str(const char* name, const char* what) { return std::string(name) + what; }

void check_contiguous_like(const TensorView& t, const char* name, const TensorView& ref,
                           const char* ref_name) {
  check_same_device(t, ref, name, ref_name);
  TPF_CHECK(t.ndim == ref.ndim && t.shape == ref.shape, str(name, " must have ") + ref_name +
                                                            "'s shape " + ref.shape_string() +
                                                            ", got " + t.shape_string());
  TPF_CHECK(t.is_contiguous(), str(name, " must be contiguous"));
}

void check_f32_vector(const TensorView& t, const char* name, int64_t n, const TensorView& ref) {
  check_same_device(t, ref, name, "x");
  TPF_CHECK(t.dtype == DType::f32, str(name, " must be float32, got ") + dtype_name(t.dtype));
  check_shape(t, name, {n}, "[n]");
  TPF_CHECK(t.is_contiguous(), str(name, " must be contiguous"));
}

void check_storage(const TensorView& t, const char* name) {
  check_float_tensor(t, name);
  TPF_CHECK(t.device == Device::cpu || t.dtype != DType::f64,
            str(name, " must be float32, bfloat16 or float16 for CUDA tensors, got float64"));
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
  check_storage(x, "x");
  int64_t n_rows = 0;
  *rows = rows_of(x, &n_rows);
  const int64_t C = x.shape[x.ndim - 1];
  check_f32_vector(weight, "weight", C, x);
  check_f32_vector(mean, "mean", n_rows, x);
  check_f32_vector(rstd, "rstd", n_rows, x);
  return n_rows;
}

// Fixed chunks of rows for the CPU path's weight gradients: the partial sums, and so the result,
// do not depend on the thread count.
constexpr int64_t kCpuRowsPerChunk = 256;

void layer_norm_forward_cpu(const LayerNormForwardArgs& a, const Rows& rows, int64_t n_rows) {
  const int64_t C = a.x.shape[a.x.ndim - 1];
  const float* w = static_cast<const float*>(a.weight.data);
  const float* b = static_cast<const float*>(a.bias.data);
  float* mean = static_cast<float*>(a.mean.data);
  float* rstd = static_cast<float*>(a.rstd.data);
  parallel_for((n_rows + kCpuRowsPerChunk - 1) / kCpuRowsPerChunk, [&](int64_t chunk) {
    // FP64 throughout, one rounding to y's dtype: at least as accurate as PyTorch's at any dtype.
    std::vector<double> v(size_t(C), 0.0);
    const int64_t end = std::min(n_rows, (chunk + 1) * kCpuRowsPerChunk);
    for (int64_t r = chunk * kCpuRowsPerChunk; r < end; ++r) {
      load_row(a.x, rows.offset(r), C, v.data());
      double m = 0;
      for (double e : v) m += e;
      m /= double(C);
      double var = 0;
      for (double e : v) var += (e - m) * (e - m);
      const double rs = 1.0 / std::sqrt(var / double(C) + a.eps);
      for (int64_t c = 0; c < C; ++c) v[c] = (v[c] - m) * rs * double(w[c]) + double(b[c]);
      store_row(a.y, r * C, C, v.data());
      mean[r] = float(m);
      rstd[r] = float(rs);
    }
  });
}

void layer_norm_backward_cpu(const LayerNormBackwardArgs& a, const Rows& rows, int64_t n_rows) {
  const int64_t C = a.x.shape[a.x.ndim - 1];
  const float* w = static_cast<const float*>(a.weight.data);
  const float* mean = static_cast<const float*>(a.mean.data);
  const float* rstd = static_cast<const float*>(a.rstd.data);
  const int64_t chunks = (n_rows + kCpuRowsPerChunk - 1) / kCpuRowsPerChunk;
  // FP64 throughout (the saved float32 mean and rstd as given), one rounding per output.
  std::vector<double> partial(size_t(chunks * 2 * C), 0.0);
  parallel_for(chunks, [&](int64_t chunk) {
    std::vector<double> x(static_cast<size_t>(C)), dy(static_cast<size_t>(C)),
        dx(static_cast<size_t>(C));
    double* dw = &partial[size_t(chunk * 2 * C)];
    double* db = dw + C;
    const int64_t end = std::min(n_rows, (chunk + 1) * kCpuRowsPerChunk);
    for (int64_t r = chunk * kCpuRowsPerChunk; r < end; ++r) {
      load_row(a.x, rows.offset(r), C, x.data());
      load_row(a.dy, r * C, C, dy.data());
      const double mu = mean[r], rs = rstd[r];
      double sum_g = 0, sum_gx = 0;
      for (int64_t c = 0; c < C; ++c) {
        const double xhat = (x[c] - mu) * rs;
        const double g = dy[c] * double(w[c]);
        sum_g += g;
        sum_gx += g * xhat;
        dw[c] += dy[c] * xhat;
        db[c] += dy[c];
        x[c] = xhat;
      }
      const double mg = sum_g / double(C), mgx = sum_gx / double(C);
      for (int64_t c = 0; c < C; ++c) dx[c] = rs * (dy[c] * double(w[c]) - mg - x[c] * mgx);
      store_row(a.dx, rows.offset(r), C, dx.data());
    }
  });
  float* dw = static_cast<float*>(a.dweight.data);
  float* db = static_cast<float*>(a.dbias.data);
  for (int64_t c = 0; c < C; ++c) {
    double sw = 0, sb = 0;  // chunks in order: the same result for any thread count
    for (int64_t k = 0; k < chunks; ++k) {
      sw += partial[size_t(k * 2 * C + c)];
      sb += partial[size_t(k * 2 * C + C + c)];
    }
    dw[c] = float(sw);
    db[c] = float(sb);
  }
}

// M rows of H columns of ab [M, 2H] (and h, dh [M, H]).
void check_swiglu(const SwigluArgs& a, bool backward, int64_t* M, int64_t* H) {
  check_storage(a.ab, "ab");
  TPF_CHECK(a.ab.ndim == 2 && a.ab.shape[1] % 2 == 0,
            "ab must have shape [M, 2H] (a then b), got " + a.ab.shape_string());
  TPF_CHECK(a.ab.is_contiguous(), "ab must be contiguous");
  *M = a.ab.shape[0];
  *H = a.ab.shape[1] / 2;
  const TensorView& h = backward ? a.dh : a.h;
  const char* h_name = backward ? "grad_h" : "h";
  check_same_device(h, a.ab, h_name, "ab");
  TPF_CHECK(h.dtype == a.ab.dtype, str(h_name, " must have ab's dtype ") + dtype_name(a.ab.dtype));
  check_shape(h, h_name, {*M, *H}, "[M, H]");
  TPF_CHECK(h.is_contiguous(), str(h_name, " must be contiguous"));
  if (backward) {
    check_contiguous_like(a.dab, "dab", a.ab, "ab");
    TPF_CHECK(a.dab.dtype == a.ab.dtype, "dab must have ab's dtype");
  }
}

void swiglu_cpu(const SwigluArgs& a, bool backward, int64_t M, int64_t H) {
  parallel_for(M, [&](int64_t m) {
    // FP64, one rounding per output.
    std::vector<double> ab(static_cast<size_t>(2 * H)), h(static_cast<size_t>(H));
    load_row(a.ab, m * 2 * H, 2 * H, ab.data());
    if (backward) load_row(a.dh, m * H, H, h.data());
    for (int64_t j = 0; j < H; ++j) {
      const double x = ab[j], b = ab[H + j], s = 1.0 / (1.0 + std::exp(-x));
      if (backward) {
        ab[j] = h[j] * b * (s * (1.0 + x * (1.0 - s)));  // d silu(x) / dx
        ab[H + j] = h[j] * x * s;
      } else {
        h[j] = x * s * b;
      }
    }
    if (backward)
      store_row(a.dab, m * 2 * H, 2 * H, ab.data());
    else
      store_row(a.h, m * H, H, h.data());
  });
}

Heads check_gated_output(const GatedOutputArgs& a, bool backward) {
  check_storage(a.g, "g");
  TPF_CHECK(a.g.ndim == 2, "g must have shape [R, H*D], got " + a.g.shape_string());
  check_inner_contiguous(a.g, "g");
  TPF_CHECK(a.o.ndim == 4, "o must have shape [BN, H, S, D], got " + a.o.shape_string());
  check_same_device(a.o, a.g, "o", "g");
  TPF_CHECK(a.o.dtype == a.g.dtype, "o must have g's dtype " + std::string(dtype_name(a.g.dtype)));
  TPF_CHECK(a.o.is_contiguous(), "o must be contiguous");
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
    TPF_CHECK(t.dtype == a.g.dtype, str(name, " must have g's dtype ") + dtype_name(a.g.dtype));
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

void gated_output_cpu(const GatedOutputArgs& a, const Heads& heads, bool backward) {
  const int64_t R = a.g.shape[0], HD = a.g.shape[1];
  parallel_for(R, [&](int64_t r) {
    // FP64, one rounding per output.
    std::vector<double> g(static_cast<size_t>(HD)), o(static_cast<size_t>(HD)),
        dy(static_cast<size_t>(HD)), out1(static_cast<size_t>(HD)), out2(static_cast<size_t>(HD));
    load_row(a.g, r * a.g.stride[0], HD, g.data());
    for (int64_t h = 0; h < heads.H; ++h)
      load_row(a.o, heads.o_offset(r, h * heads.D), heads.D, &o[size_t(h * heads.D)]);
    if (backward) load_row(a.dy, r * HD, HD, dy.data());
    for (int64_t c = 0; c < HD; ++c) {
      const double s = 1.0 / (1.0 + std::exp(-g[c]));
      if (backward) {
        out1[c] = dy[c] * o[c] * s * (1.0 - s);  // dg
        out2[c] = dy[c] * s;                     // do
      } else {
        out1[c] = s * o[c];
      }
    }
    if (!backward) return store_row(a.y, r * HD, HD, out1.data());
    store_row(a.dg, r * HD, HD, out1.data());
    for (int64_t h = 0; h < heads.H; ++h)
      store_row(a.do_, heads.o_offset(r, h * heads.D), heads.D, &out2[size_t(h * heads.D)]);
  });
}

}  // namespace

void layer_norm_forward(const LayerNormForwardArgs& a, void* stream) {
  Rows rows;
  const int64_t n_rows = check_layer_norm_common(a.x, a.weight, a.mean, a.rstd, &rows);
  check_f32_vector(a.bias, "bias", a.x.shape[a.x.ndim - 1], a.x);
  check_storage(a.y, "y");
  check_contiguous_like(a.y, "y", a.x, "x");
  TPF_CHECK(std::isfinite(a.eps) && a.eps > 0,
            "eps must be a positive number, got " + std::to_string(a.eps));
  if (n_rows == 0) return;
  if (a.x.device == Device::cpu) return layer_norm_forward_cpu(a, rows, n_rows);
  cuda::layer_norm_forward(a, rows, n_rows, stream);
}

void layer_norm_backward(const LayerNormBackwardArgs& a, void* stream) {
  Rows rows;
  const int64_t n_rows = check_layer_norm_common(a.x, a.weight, a.mean, a.rstd, &rows);
  const int64_t C = a.x.shape[a.x.ndim - 1];
  check_storage(a.dy, "grad_y");
  check_contiguous_like(a.dy, "grad_y", a.x, "x");
  check_same_device(a.dx, a.x, "dx", "x");
  TPF_CHECK(a.dx.dtype == a.x.dtype && a.dx.ndim == a.x.ndim && a.dx.shape == a.x.shape &&
                a.dx.stride == a.x.stride,
            "dx must have x's dtype, shape and strides");
  check_f32_vector(a.dweight, "dweight", C, a.x);
  check_f32_vector(a.dbias, "dbias", C, a.x);
  if (a.x.device == Device::cpu) return layer_norm_backward_cpu(a, rows, n_rows);
  const size_t need = cuda::layer_norm_backward_workspace_bytes(n_rows, C);
  TPF_CHECK(a.workspace_bytes >= need, "workspace must hold at least " + std::to_string(need) +
                                           " bytes, got " + std::to_string(a.workspace_bytes));
  cuda::layer_norm_backward(a, rows, n_rows, stream);
}

size_t layer_norm_backward_workspace_bytes(int64_t rows, int64_t channels, Device device) {
  return device == Device::cpu ? 0 : cuda::layer_norm_backward_workspace_bytes(rows, channels);
}

void swiglu_forward(const SwigluArgs& a, void* stream) {
  int64_t M = 0, H = 0;
  check_swiglu(a, false, &M, &H);
  if (M * H == 0) return;
  if (a.ab.device == Device::cpu) return swiglu_cpu(a, false, M, H);
  cuda::swiglu_forward(a, stream);
}

void swiglu_backward(const SwigluArgs& a, void* stream) {
  int64_t M = 0, H = 0;
  check_swiglu(a, true, &M, &H);
  if (M * H == 0) return;
  if (a.ab.device == Device::cpu) return swiglu_cpu(a, true, M, H);
  cuda::swiglu_backward(a, stream);
}

void gated_output_forward(const GatedOutputArgs& a, void* stream) {
  const Heads heads = check_gated_output(a, false);
  if (a.g.numel() == 0) return;
  if (a.g.device == Device::cpu) return gated_output_cpu(a, heads, false);
  cuda::gated_output_forward(a, heads, stream);
}

void gated_output_backward(const GatedOutputArgs& a, void* stream) {
  const Heads heads = check_gated_output(a, true);
  if (a.g.numel() == 0) return;
  if (a.g.device == Device::cpu) return gated_output_cpu(a, heads, true);
  cuda::gated_output_backward(a, heads, stream);
}

}  // namespace tpf
