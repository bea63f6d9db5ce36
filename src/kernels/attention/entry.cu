// Host entry points of libtpf_cuda for triangle attention (declared in api.h): TensorViews to the
// params structs, dtype and head-dim dispatch, launch on the caller's stream on the tensors'
// device. Arguments were validated by src/ops/attention.cpp.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "kernels/attention/api.h"
#include "kernels/attention/backward_sm90.h"
#include "kernels/attention/forward_sm90.h"
#include "kernels/attention/forward_sm90_tiles.h"
#include "kernels/attention/params.h"
#include "kernels/common/device_guard.h"
#include "tpf/error.h"

namespace tpf::cuda {
namespace {

bool rows_aligned(const TensorView& t, int row_dim) {
  const int64_t elem = dtype_size(t.dtype);
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0) return false;
  for (int i = 0; i <= row_dim; ++i)
    if ((t.stride[i] * elem) % 16 != 0) return false;
  return true;
}

// The forward's tensors as both kernels see them (params.h), from the forward's or the backward's
// arguments (both name them alike): the one place that fills them.
template <class Args>
AttentionForwardParams forward_params(const Args& a, const AttentionDims& d) {
  const TensorView &q = a.q, &k = a.k, &v = a.v, &bias = a.bias, &o = a.o, &lse = a.lse;
  const OptionalTensor &mask = a.mask, &residual = a.residual;
  AttentionForwardParams p{};
  p.q = q.data;
  p.k = k.data;
  p.v = v.data;
  p.bias = bias.data;
  p.mask = mask.present ? static_cast<const uint8_t*>(mask.view.data) : nullptr;
  p.o = o.data;
  p.lse = static_cast<float*>(lse.data);
  p.residual = residual.present ? residual.view.data : nullptr;
  p.q_stride = strides4(q);
  p.k_stride = strides4(k);
  p.v_stride = strides4(v);
  p.o_stride = strides4(o);
  if (residual.present) p.residual_stride = strides4(residual.view);
  p.bias_stride_b = bias.stride[0];
  p.bias_stride_h = bias.stride[1];
  p.bias_stride_q = bias.stride[2];
  if (mask.present) {
    p.mask_stride_b = mask.view.stride[0];
    p.mask_stride_n = mask.view.stride[1];
  }
  p.lse_stride_b = lse.stride[0];
  p.lse_stride_n = lse.stride[1];
  p.lse_stride_h = lse.stride[2];
  p.lse_stride_s = lse.stride[3];
  p.B = int(d.B);
  p.N = int(d.N);
  p.H = int(d.H);
  p.Sq = int(d.Sq);
  p.Sk = int(d.Sk);
  p.scale = float(a.scale);
  return p;
}

}  // namespace

bool available() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

void attention_forward(const AttentionForwardArgs& a, const AttentionDims& d, void* stream) {
  DeviceGuard guard(a.q.device_index);
  const AttentionForwardParams f = forward_params(a, d);
  void* ws = a.workspace(fwd90::forward_workspace_bytes(d.B, d.H, d.Sq, d.Sk));
  auto s = static_cast<cudaStream_t>(stream);
  if (a.q.dtype == DType::bf16)
    fwd90::launch<__nv_bfloat16>(f, a, d, ws, s);
  else
    fwd90::launch<__half>(f, a, d, ws, s);
  check_launch("triangle attention forward");
}

void attention_backward(const AttentionBackwardArgs& a, const AttentionDims& d, void* stream) {
  DeviceGuard guard(a.q.device_index);
  AttentionBackwardParams p{};
  p.fwd = forward_params(a, d);
  p.dout = a.dout.data;
  p.dq = a.dq.data;
  p.dk = a.dk.data;
  p.dv = a.dv.data;
  p.dbias = a.dbias.data;
  p.dout_stride = strides4(a.dout);
  p.dq_stride = strides4(a.dq);
  p.dk_stride = strides4(a.dk);
  p.dv_stride = strides4(a.dv);
  p.dbias_stride_b = a.dbias.stride[0];
  p.dbias_stride_h = a.dbias.stride[1];
  p.dbias_stride_q = a.dbias.stride[2];
  p.head_dim = int(d.D);
  p.dout_aligned = rows_aligned(a.dout, 3);
  p.delta_vectorized = p.dout_aligned && rows_aligned(a.o, 3) &&
                       (!a.residual.present || rows_aligned(a.residual.view, 3));
  const bool f32_bias = a.bias.dtype == DType::f32;
  const bool bias_copy = !f32_bias && !attention_tma_ready(a.bias);
  const Sm90BackwardWorkspace w =
      sm90_backward_workspace(d.B, d.N, d.H, d.Sq, d.Sk, d.D, f32_bias, bias_copy);
  char* ws = static_cast<char*>(a.workspace(w.total));
  p.delta = reinterpret_cast<float*>(ws + w.delta);
  p.lse2 = reinterpret_cast<float*>(ws + w.lse2);
  p.bias_copy = bias_copy ? ws + w.bias_copy : nullptr;
  p.dq_acc = reinterpret_cast<float*>(ws + w.dq_acc);
  p.dbias_acc_t = reinterpret_cast<float*>(ws + w.dbias_acc);
  p.dq_sem = reinterpret_cast<int*>(ws + w.sem);
  p.dbias_sem = reinterpret_cast<int*>(ws + w.dbias_sem);
  p.dbias_lanes = w.dbias_lanes;
  p.dq_aligned = rows_aligned(a.dq, 3);
  auto s = static_cast<cudaStream_t>(stream);
  if (a.q.dtype == DType::bf16)
    attention_backward_sm90_launch<__nv_bfloat16>(p, w, f32_bias, s);
  else
    attention_backward_sm90_launch<__half>(p, w, f32_bias, s);
  check_launch("triangle attention backward");
}

}  // namespace tpf::cuda
