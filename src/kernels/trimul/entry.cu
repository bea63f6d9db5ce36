// Host entry points of the triangle multiplicative update on CUDA: fill Params from the validated
// arguments, carve the caller's workspace and launch, in stream order, without synchronizing.
//
// Forward:  pack weights -> input_forward (a, b, go) -> contraction (z) -> output_forward (y).
// Backward: pack weights -> output_backward (dz, dgo, dpo, z_ln, partials) -> d p_out_weight ->
//           contraction backward (dA, dB) -> input_backward (dx, x_ln, dP | dG, partials) ->
//           d p_in_weight | d g_in_weight | d g_out_weight (one GEMM over dP | dG | dgo) ->
//           ordered sums of the partials -> the gradients assembled in the weights' dtype (finish).
// The weights (and their gradients) have one dtype, float32, bfloat16 or float16: pack_weights
// reads them in it and finish_backward writes the gradients in it, so the caller casts nothing.
// The mask is read in its own dtype (bool, uint8, float32, bfloat16 or float16).
#include <cuda_runtime.h>

#include "kernels/common/device_guard.h"
#include "kernels/trimul/api.h"
#include "kernels/trimul/blas.h"
#include "kernels/trimul/launch.h"
#include "kernels/trimul/params.h"

namespace tpf::cuda {
namespace {

using namespace trimul;

static_assert(kTrimulMaxD == trimul::kMaxD, "one limit on D");

cudaDataType cuda_type(DType d) {
  return d == DType::f32 ? CUDA_R_32F : d == DType::bf16 ? CUDA_R_16BF : CUDA_R_16F;
}

const void* ptr(const OptionalTensor& t) { return t.present ? t.view.data : nullptr; }
void* out_ptr(const OptionalTensor& t) { return t.present ? t.view.data : nullptr; }

int mask_type(DType d) {
  switch (d) {
    case DType::f32: return kMaskF32;
    case DType::f16: return kMaskF16;
    case DType::bf16: return kMaskBF16;
    default: return kMaskByte;  // bool, uint8 (checked by src/ops/trimul.cpp)
  }
}

Params make_params(const TrimulDims& d, const TensorView& x, const OptionalTensor& mask,
                   bool outgoing, double eps, const TrimulSaved& saved, char* ws,
                   const Workspace& layout) {
  Params p{};
  p.B = d.B;
  p.S = d.S;
  p.D = d.D;
  p.Dp = padded_d(d.D);
  p.input_chunks = int(ceil_div(2 * d.D, kChunkChannels));
  p.tiles_per_row = int(ceil_div(d.S, kRows));
  p.tiles = d.B * d.S * p.tiles_per_row;
  p.positions = d.B * d.S * d.S;
  p.outgoing = outgoing;
  p.eps = float(eps);
  p.x = x.data;
  p.mask = ptr(mask);
  p.mask_type = mask.present ? mask_type(mask.view.dtype) : kMaskByte;
  p.a = saved.a.data;
  p.b = saved.b.data;
  p.z = saved.z.data;
  p.go = saved.go.data;
  p.w_in = ws + layout.w_in;
  p.w_out = ws + layout.w_out;
  p.bias_in = reinterpret_cast<const float*>(ws + layout.bias_in);
  p.bias_out = reinterpret_cast<const float*>(ws + layout.bias_out);
  const float* norms = reinterpret_cast<const float*>(ws + layout.norms);
  p.ln_in_w = norms;
  p.ln_in_b = norms + d.D;
  p.ln_out_w = norms + 2 * d.D;
  p.ln_out_b = norms + 3 * d.D;
  p.grid_backward = int(p.tiles < kBackwardCtas ? p.tiles : kBackwardCtas);
  p.grid_input_backward = p.grid_backward;
  return p;
}

template <typename T>
void pack(const Params& p, const TrimulWeights& w, char* ws, const Workspace& layout,
          cudaStream_t stream) {
  const PackArgs a{
      w.p_in_weight.data,
      w.g_in_weight.data,
      w.g_out_weight.data,
      w.p_out_weight.data,
      {ptr(w.p_in_bias), ptr(w.g_in_bias), ptr(w.p_out_bias), ptr(w.g_out_bias)},
      {w.norm_in_weight.data, w.norm_in_bias.data, w.norm_out_weight.data, w.norm_out_bias.data},
      w.p_in_weight.dtype,
      ws + layout.w_in,
      ws + layout.w_out,
      reinterpret_cast<float*>(ws + layout.bias_in),
      reinterpret_cast<float*>(ws + layout.bias_out),
      reinterpret_cast<float*>(ws + layout.norms)};
  launch_pack_weights<T>(p, a, stream);
}

template <typename T>
void forward(const TrimulForwardArgs& a, const TrimulDims& d, cudaStream_t stream) {
  const Workspace layout = workspace_layout(d.B, d.S, d.D, sizeof(T), false);
  char* ws = static_cast<char*>(a.workspace(layout.total));
  Params p = make_params(d, a.x, a.mask, a.outgoing, a.eps, a.saved, ws, layout);
  p.y = a.y.data;
  pack<T>(p, a.w, ws, layout, stream);
  launch_input_forward<T>(p, stream);
  contract(Blas(stream, ws + layout.cublas, kCublasWorkspaceBytes, cuda_type(a.x.dtype)), p);
  launch_output_forward<T>(p, stream);
}

template <typename T>
void backward(const TrimulBackwardArgs& a, const TrimulDims& d, cudaStream_t stream) {
  const Workspace layout = workspace_layout(d.B, d.S, d.D, sizeof(T), true);
  char* ws = static_cast<char*>(a.workspace(layout.total));
  Params p = make_params(d, a.x, a.mask, a.outgoing, a.eps, a.saved, ws, layout);
  p.dy = a.dy.data;
  p.dx = a.dx.data;
  p.dz = ws + layout.dz_xln;
  p.xln = ws + layout.dz_xln;
  p.dpo = ws + layout.dpo_da;
  p.da = ws + layout.dpo_da;
  p.zln = ws + layout.zln_db;
  p.db = ws + layout.zln_db;
  p.dpg = ws + layout.dpg;
  p.ld_dpg = 5 * d.D;
  p.dgo = ws + layout.dpg + 4 * d.D * sizeof(T);
  p.partials_bias_out = reinterpret_cast<float*>(ws + layout.partials_bias_out);
  p.partials_norm_out = reinterpret_cast<float*>(ws + layout.partials_norm_out);
  p.partials_bias_in = reinterpret_cast<float*>(ws + layout.partials_bias_in);
  p.partials_norm_in = reinterpret_cast<float*>(ws + layout.partials_norm_in);
  p.sums = reinterpret_cast<double*>(ws + layout.sums);
  if constexpr (!kIsF32<T>) {  // the 16-bit types' backward kernels: three CTAs per SM
    p.grid_input_backward = int(p.tiles < kSplitBackwardCtas ? p.tiles : kSplitBackwardCtas);
    p.grid_backward = int(p.tiles < k16BitOutputBackwardCtas ? p.tiles : k16BitOutputBackwardCtas);
  }
  float* dw_in = reinterpret_cast<float*>(ws + layout.dw_in);
  float* dw_out = reinterpret_cast<float*>(ws + layout.dw_out);
  const Blas blas(stream, ws + layout.cublas, kCublasWorkspaceBytes, cuda_type(a.x.dtype));
  const TrimulWeightGrads& g = a.dw;
  const int64_t D = d.D, R = p.positions;

  pack<T>(p, a.w, ws, layout, stream);
  launch_output_backward<T>(p, stream);
  weight_gradient(blas, D, D, R, p.dpo, D, p.zln, D, dw_out);
  contract_backward(blas, p);           // dA, dB overwrite dpo and z_ln
  launch_input_backward<T>(p, stream);  // x_ln overwrites dz
  // [d p_in_weight | d g_in_weight | d g_out_weight] = [dP | dG | dgo]^T x_ln: one pass over both.
  weight_gradient(blas, 5 * D, D, R, p.dpg, p.ld_dpg, p.xln, D, dw_in);
  launch_reduce_sums(p, stream);
  const TrimulWeights& w = a.w;
  launch_finish_backward(FinishArgs{p.sums,
                                    dw_in,
                                    dw_out,
                                    w.p_in_weight.data,
                                    w.g_in_weight.data,
                                    w.p_out_weight.data,
                                    w.g_out_weight.data,
                                    g.norm_in_weight.data,
                                    g.norm_in_bias.data,
                                    g.norm_out_weight.data,
                                    g.norm_out_bias.data,
                                    out_ptr(g.p_in_bias),
                                    out_ptr(g.g_in_bias),
                                    out_ptr(g.p_out_bias),
                                    out_ptr(g.g_out_bias),
                                    g.p_in_weight.data,
                                    g.g_in_weight.data,
                                    g.g_out_weight.data,
                                    g.p_out_weight.data,
                                    w.p_in_weight.dtype,
                                    int(D)},
                         stream);
}

}  // namespace

void trimul_forward(const TrimulForwardArgs& a, const TrimulDims& d, void* stream) {
  DeviceGuard guard(a.x.device_index);
  with_float_type(a.x.dtype,
                  [&](auto t) { forward<decltype(t)>(a, d, static_cast<cudaStream_t>(stream)); });
}

void trimul_backward(const TrimulBackwardArgs& a, const TrimulDims& d, void* stream) {
  DeviceGuard guard(a.x.device_index);
  with_float_type(a.x.dtype,
                  [&](auto t) { backward<decltype(t)>(a, d, static_cast<cudaStream_t>(stream)); });
}

}  // namespace tpf::cuda
