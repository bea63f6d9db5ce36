// Argument validation for triangle attention, shared by the CPU, CUDA and reference paths.
#include <string>

#include "core/checks.h"
#include "tpf/attention.h"
#include "tpf/error.h"

namespace tpf {
namespace {

AttentionDims check_inputs(const TensorView& q, const TensorView& k, const TensorView& v,
                           const TensorView& bias, const OptionalTensor& mask) {
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
  check_shape(bias, "bias", {d.B, d.H, d.Sq, d.Sk}, "[B, H, S, S]");
  check_float_tensor(q, "q");
  TPF_CHECK(k.dtype == q.dtype, std::string("k must have q's dtype ") + dtype_name(q.dtype) +
                                    ", got " + dtype_name(k.dtype));
  TPF_CHECK(v.dtype == q.dtype, std::string("v must have q's dtype ") + dtype_name(q.dtype) +
                                    ", got " + dtype_name(v.dtype));
  // A float32 bias with 16-bit q, k, v is read as float32 (not rounded to q's dtype).
  const bool fp32_bias =
      bias.dtype == DType::f32 && (q.dtype == DType::bf16 || q.dtype == DType::f16);
  TPF_CHECK(bias.dtype == q.dtype || fp32_bias,
            std::string("bias must have q's dtype ") + dtype_name(q.dtype) +
                (q.dtype == DType::bf16 || q.dtype == DType::f16 ? " or float32" : "") + ", got " +
                dtype_name(bias.dtype));
  check_same_device(k, q, "k", "q");
  check_same_device(v, q, "v", "q");
  check_same_device(bias, q, "bias", "q");
  check_inner_contiguous(q, "q");
  check_inner_contiguous(k, "k");
  check_inner_contiguous(v, "v");
  check_inner_contiguous(bias, "bias");
  if (mask.present) {
    check_shape(mask.view, "mask", {d.B, d.N, d.Sk}, "[B, N, S]");
    TPF_CHECK(mask.view.dtype == DType::boolean,
              std::string("mask must be bool (True = attend), got ") + dtype_name(mask.view.dtype));
    check_same_device(mask.view, q, "mask", "q");
    check_inner_contiguous(mask.view, "mask");
  }
  return d;
}

void check_output(const TensorView& t, const char* name, const TensorView& like) {
  check_shape(t, name, {like.shape[0], like.shape[1], like.shape[2], like.shape[3], like.shape[4]},
              "[B, N, H, S, D]");
  check_float_tensor(t, name);
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
  check_output(r.view, "residual", q);
  TPF_CHECK(r.view.dtype == DType::bf16,
            std::string("residual must be bfloat16, got ") + dtype_name(r.view.dtype));
}

}  // namespace

AttentionDims check_attention_forward(const AttentionForwardArgs& a) {
  AttentionDims d = check_inputs(a.q, a.k, a.v, a.bias, a.mask);
  TPF_CHECK(a.scale > 0.0 || a.scale < 0.0, "scale must be a nonzero number");
  check_output(a.o, "o", a.q);
  check_lse(a.lse, d, a.q);
  check_residual(a.residual, a.q);
  return d;
}

AttentionDims check_attention_backward(const AttentionBackwardArgs& a) {
  AttentionDims d = check_inputs(a.q, a.k, a.v, a.bias, a.mask);
  TPF_CHECK(a.scale > 0.0 || a.scale < 0.0, "scale must be a nonzero number");
  check_output(a.o, "o", a.q);
  check_output(a.dout, "grad_out", a.q);
  check_lse(a.lse, d, a.q);
  check_residual(a.residual, a.q);
  check_output(a.dq, "dq", a.q);
  check_output(a.dk, "dk", a.k);
  check_output(a.dv, "dv", a.v);
  check_shape(a.dbias, "dbias", {d.B, d.H, d.Sq, d.Sk}, "[B, H, S, S]");
  check_float_tensor(a.dbias, "dbias");
  check_same_device(a.dbias, a.q, "dbias", "q");
  check_inner_contiguous(a.dbias, "dbias");
  return d;
}

}  // namespace tpf
