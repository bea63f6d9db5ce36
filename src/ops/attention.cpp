// Triangle attention (tpf/attention.h): the one validation of each call, then the CPU path or the
// FP64 reference (src/reference) or the CUDA kernels (src/kernels/attention).
#include <cmath>
#include <string>

#include "core/checks.h"
#include "kernels/attention/api.h"
#include "kernels/info.h"
#include "reference/cpu.h"
#include "tpf/attention.h"
#include "tpf/cuda_info.h"
#include "tpf/error.h"

namespace tpf {
namespace {

// Who runs a validated call: the CPU path or the kernels (inputs float32, bfloat16 or float16), or
// the FP64 reference (CPU tensors of any float dtype).
enum class Path { op, reference };

constexpr const char* kBiasLayout = "[B, H, S, S] (or [B, 1, H, S, S])";
constexpr const char* kMaskLayout = "[B, N, S] (or [B, N, 1, 1, S])";

// t without its dimensions [first, first + count), each of size 1.
TensorView drop_unit_dims(const TensorView& t, int first, int count) {
  TensorView r = t;
  r.ndim = t.ndim - count;
  for (int i = first; i < r.ndim; ++i) {
    r.shape[i] = t.shape[i + count];
    r.stride[i] = t.stride[i + count];
  }
  return r;
}

// cuEquivariance's bias [B, 1, H, Sq, Sk] and dbias as [B, H, Sq, Sk], its mask [B, N, 1, 1, Sk]
// as [B, N, Sk]; other shapes as they are, for check_shape to name.
TensorView bias_view(const TensorView& t) {
  return t.ndim == 5 && t.shape[1] == 1 ? drop_unit_dims(t, 1, 1) : t;
}
OptionalTensor mask_view(const OptionalTensor& m) {
  if (!m.present || m.view.ndim != 5 || m.view.shape[2] != 1 || m.view.shape[3] != 1) return m;
  return {true, drop_unit_dims(m.view, 2, 2)};
}

// The inputs' validation; `bias` and `mask` as bias_view and mask_view give them (the messages show
// the shapes as given).
AttentionDims check_inputs(const TensorView& q, const TensorView& k, const TensorView& v,
                           const TensorView& given_bias, const OptionalTensor& given_mask,
                           double scale, Path path, TensorView* bias_out = nullptr,
                           OptionalTensor* mask_out = nullptr) {
  const TensorView bias = bias_view(given_bias);
  const OptionalTensor mask = mask_view(given_mask);
  TPF_CHECK(q.ndim == 5, "q must have 5 dimensions [B, N, H, S, D], got " + q.shape_string());
  TPF_CHECK(k.ndim == 5, "k must have 5 dimensions [B, N, H, S, D], got " + k.shape_string());
  AttentionDims d{q.shape[0], q.shape[1], q.shape[2], q.shape[3], k.shape[3], q.shape[4]};
  TPF_CHECK(d.B >= 1 && d.N >= 1 && d.H >= 1,
            "q must have B, N and H of at least 1, got " + q.shape_string());
  TPF_CHECK(d.Sq >= 1, "q must have at least one token (S >= 1), got " + q.shape_string());
  TPF_CHECK(d.Sk >= 1, "k must have at least one token (S >= 1), got " + k.shape_string());
  TPF_CHECK(d.D >= 1, "q must have a head dimension D >= 1, got " + q.shape_string());
  check_shape(k, "k", {d.B, d.N, d.H, d.Sk, d.D}, "[B, N, H, S, D]");
  check_shape(v, "v", {d.B, d.N, d.H, d.Sk, d.D}, "[B, N, H, S, D]");
  check_shape(bias, "bias", {d.B, d.H, d.Sq, d.Sk}, kBiasLayout, &given_bias);
  check_float_tensor(q, "q", path == Path::reference);
  check_same_dtype(k, q, "k", "q");
  check_same_dtype(v, q, "v", "q");
  // A float32 bias with 16-bit q, k, v (Protenix passes bias.float()) is read as float32, not
  // rounded to q's dtype.
  if (!(bias.dtype == DType::f32 && (q.dtype == DType::bf16 || q.dtype == DType::f16)))
    TPF_CHECK(bias.dtype == q.dtype,
              std::string("bias must have q's dtype ") + dtype_name(q.dtype) +
                  (q.dtype == DType::bf16 || q.dtype == DType::f16 ? " or float32" : "") +
                  ", got " + dtype_name(bias.dtype));
  check_same_device(k, q, "k", "q");
  check_same_device(v, q, "v", "q");
  check_same_device(bias, q, "bias", "q");
  check_inner_contiguous(q, "q");
  check_inner_contiguous(k, "k");
  check_inner_contiguous(v, "v");
  check_inner_contiguous(bias, "bias");
  if (mask.present) {
    check_shape(mask.view, "mask", {d.B, d.N, d.Sk}, kMaskLayout, &given_mask.view);
    TPF_CHECK(mask.view.dtype == DType::boolean,
              std::string("mask must be bool (True = attend), got ") + dtype_name(mask.view.dtype));
    check_same_device(mask.view, q, "mask", "q");
    check_inner_contiguous(mask.view, "mask");
  }
  TPF_CHECK(std::isfinite(scale) && scale != 0.0,
            "scale must be a finite nonzero number, got " + number(scale));
  TPF_CHECK(path == Path::op || q.device == Device::cpu,
            "the FP64 reference runs on CPU tensors only, got q on " + device_name(q));
  if (bias_out) *bias_out = bias;
  if (mask_out) *mask_out = mask;
  return d;
}

void check_output(const TensorView& t, const char* name, const TensorView& like, Path path) {
  check_shape(t, name, {like.shape[0], like.shape[1], like.shape[2], like.shape[3], like.shape[4]},
              "[B, N, H, S, D]");
  check_float_tensor(t, name, path == Path::reference);
  check_same_device(t, like, name, "q");
  check_inner_contiguous(t, name);
}

void check_lse(const TensorView& lse, const AttentionDims& d, const TensorView& q) {
  check_shape(lse, "lse", {d.B, d.N, d.H, d.Sq}, "[B, N, H, S]");
  TPF_CHECK(lse.dtype == DType::f32 || lse.dtype == DType::f64,
            std::string("lse must be float32 or float64, got ") + dtype_name(lse.dtype));
  check_same_device(lse, q, "lse", "q");
}

void check_residual(const OptionalTensor& r, const TensorView& q) {
  if (!r.present) return;
  check_output(r.view, "residual", q, Path::op);
  TPF_CHECK(r.view.dtype == DType::bf16,
            std::string("residual must be bfloat16, got ") + dtype_name(r.view.dtype));
}

// "[s0, s1, ...]": t's strides in elements.
std::string strides_string(const TensorView& t) {
  std::string r = "[";
  for (int i = 0; i < t.ndim; ++i) r += (i ? ", " : "") + std::to_string(t.stride[i]);
  return r + "]";
}

// The CUDA kernels' TMA copies of t: a 16-byte aligned start, every stride a multiple of 16 bytes.
void check_tma_ready(const TensorView& t, const char* name, const char* kernel) {
  TPF_CHECK(cuda::attention_tma_ready(t),
            std::string(name) + " must start on a 16-byte boundary with every stride a multiple " +
                "of 16 bytes for the CUDA " + kernel + " (its TMA copies), got strides " +
                strides_string(t) + " of " + std::to_string(dtype_size(t.dtype)) +
                "-byte elements");
}

// What the CUDA kernels take beyond the checks above (the tensors' device is made current there):
// every limit of api.h, so that no launch meets one after another was queued.
void check_cuda(const TensorView& q, const AttentionDims& d, bool forward) {
  TPF_CHECK(q.dtype == DType::bf16 || q.dtype == DType::f16,
            std::string("q must be bfloat16 or float16 for the CUDA kernels (float32 CUDA inputs "
                        "take PyTorch's math in the torch layer), got ") +
                dtype_name(q.dtype));
  if (forward) {
    TPF_CHECK(cuda::attention_forward_head_dim_supported(d.D),
              std::string("q must have one of the CUDA forward's head dims D = ") +
                  cuda::kAttentionForwardHeadDims + ", got D = " + std::to_string(d.D));
    TPF_CHECK(d.Sk <= cuda::attention_forward_max_keys(d.D),
              "k must have at most " + std::to_string(cuda::attention_forward_max_keys(d.D)) +
                  " keys for the CUDA forward at D = " + std::to_string(d.D) +
                  ", got Sk = " + std::to_string(d.Sk));
  } else {
    TPF_CHECK(cuda::attention_head_dim_supported(d.D),
              std::string("q must have one of the CUDA backward's head dims D = ") +
                  cuda::kAttentionHeadDims + ", got D = " + std::to_string(d.D));
    TPF_CHECK(d.Sk <= cuda::kAttentionBackwardMaxKeys,
              "k must have at most " + std::to_string(cuda::kAttentionBackwardMaxKeys) +
                  " keys for the CUDA backward, got Sk = " + std::to_string(d.Sk));
  }
  TPF_CHECK(d.B * d.N * d.H <= cuda::kAttentionMaxSlices,
            "q must have at most " + std::to_string(cuda::kAttentionMaxSlices) +
                " slices B * N * H for the CUDA kernels, got " + q.shape_string());
  TPF_CHECK(d.B * d.H <= cuda::kAttentionMaxGridY &&
                (d.Sq + cuda::kAttentionQueryTile - 1) / cuda::kAttentionQueryTile <=
                    cuda::kAttentionMaxGridY,
            "q must have B * H and the number of query tiles each at most " +
                std::to_string(cuda::kAttentionMaxGridY) + " for the CUDA kernels, got " +
                q.shape_string());
}

AttentionForwardArgs validated(const AttentionForwardArgs& a, Path path, AttentionDims* dims) {
  AttentionForwardArgs n = a;
  const AttentionDims d =
      check_inputs(a.q, a.k, a.v, a.bias, a.mask, a.scale, path, &n.bias, &n.mask);
  check_output(n.o, "o", n.q, path);
  check_lse(n.lse, d, n.q);
  if (path == Path::op) check_residual(n.residual, n.q);
  if (path == Path::op && n.q.device == Device::cuda) {
    check_cuda(n.q, d, true);
    check_same_dtype(n.o, n.q, "o", "q");
    TPF_CHECK(n.lse.dtype == DType::f32,
              std::string("lse must be float32 for CUDA tensors, got ") + dtype_name(n.lse.dtype));
    for (const auto& [t, name] : {std::pair{&n.k, "k"}, {&n.v, "v"}})
      check_tma_ready(*t, name, "forward");
    TPF_CHECK(static_cast<bool>(n.workspace),
              "workspace (an allocator) is required for CUDA tensors");
  }
  *dims = d;
  return n;
}

AttentionBackwardArgs validated(const AttentionBackwardArgs& a, Path path, AttentionDims* dims) {
  AttentionBackwardArgs n = a;
  const AttentionDims d =
      check_inputs(a.q, a.k, a.v, a.bias, a.mask, a.scale, path, &n.bias, &n.mask);
  n.dbias = bias_view(a.dbias);
  if (path == Path::op) {  // the reference recomputes O
    check_output(n.o, "o", n.q, path);
    check_lse(n.lse, d, n.q);
    check_residual(n.residual, n.q);
  }
  check_output(n.dout, "grad_out", n.q, path);
  check_output(n.dq, "dq", n.q, path);
  check_output(n.dk, "dk", n.k, path);
  check_output(n.dv, "dv", n.v, path);
  check_shape(n.dbias, "dbias", {d.B, d.H, d.Sq, d.Sk}, kBiasLayout, &a.dbias);
  check_float_tensor(n.dbias, "dbias", path == Path::reference);
  check_same_device(n.dbias, n.q, "dbias", "q");
  check_inner_contiguous(n.dbias, "dbias");
  if (path == Path::op && n.q.device == Device::cuda) {
    check_cuda(n.q, d, false);
    for (const auto& [t, name] :
         {std::pair{&n.dout, "grad_out"}, {&n.dq, "dq"}, {&n.dk, "dk"}, {&n.dv, "dv"}})
      check_same_dtype(*t, n.q, name, "q");
    check_same_dtype(n.dbias, n.bias, "dbias", "bias");  // a float32 bias's gradient is float32
    for (const auto& [t, name] :
         {std::pair{&n.q, "q"}, {&n.k, "k"}, {&n.v, "v"}, {&n.dout, "grad_out"}})
      check_tma_ready(*t, name, "backward");
    TPF_CHECK(static_cast<bool>(n.workspace),
              "workspace (an allocator) is required for CUDA tensors");
  }
  *dims = d;
  return n;
}

}  // namespace

bool cuda_available() { return cuda::available(); }
CudaInfo cuda_info() { return cuda::info(); }

void check_attention_inputs(const TensorView& q, const TensorView& k, const TensorView& v,
                            const TensorView& bias, const OptionalTensor& mask, double scale) {
  check_inputs(q, k, v, bias, mask, scale, Path::op);
}

void attention_forward(const AttentionForwardArgs& a, void* stream) {
  AttentionDims d;
  const AttentionForwardArgs n = validated(a, Path::op, &d);
  if (n.q.device == Device::cpu) return cpu::attention_forward(n, d);
  cuda::attention_forward(n, d, stream);
}

void attention_backward(const AttentionBackwardArgs& a, void* stream) {
  AttentionDims d;
  const AttentionBackwardArgs n = validated(a, Path::op, &d);
  if (n.q.device == Device::cpu) return cpu::attention_backward(n, d);
  cuda::attention_backward(n, d, stream);
}

namespace reference {

void attention_forward_f64(const AttentionForwardArgs& a) {
  AttentionDims d;
  cpu::attention_forward_f64(validated(a, Path::reference, &d), d);
}

void attention_backward_f64(const AttentionBackwardArgs& a) {
  AttentionDims d;
  cpu::attention_backward_f64(validated(a, Path::reference, &d), d);
}

}  // namespace reference
}  // namespace tpf
