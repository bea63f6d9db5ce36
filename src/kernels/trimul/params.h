// The plain parameter struct that crosses from the host entry points into the kernels, and the
// layout of the caller's workspace. Raw pointers and sizes only.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/trimul/tiles.h"

namespace tpf::cuda::trimul {

// The mask's element type (Params::mask_type). Each value is read as a float and rounded to x's
// dtype, as PyTorch's cast of the mask to x's dtype would round it.
enum MaskType : int { kMaskByte = 0 /* bool or uint8 */, kMaskF32, kMaskF16, kMaskBF16 };

struct Params {
  int64_t B, S, D;
  int Dp;             // D rounded up to 16, the MMA's k and n granularity (zero padded)
  int input_chunks;   // ceil(2D / kChunkChannels): input-side steps over the a/b channels
  int tiles_per_row;  // ceil(S / kRows)
  int64_t tiles;      // B * S * tiles_per_row
  int64_t positions;  // B * S * S
  bool outgoing;
  float eps;

  // Element type T (x's dtype) unless noted; row-major [positions, D] or channel-major [B, D, S, S].
  const void* x;
  const void* mask;  // [positions] (mask_type) or null
  void* y;
  void* a;   // channel-major
  void* b;   // channel-major
  void* z;   // channel-major
  void* go;  // row-major output gate logits

  // Packed weights (T), biases and LayerNorm weights (fp32) in the workspace, see pack.cu.
  const void* w_in;       // (input_chunks + 1) blocks of [kChunkN, Dp]
  const void* w_out;      // p_out_weight, [Dp, Dp]
  const float* bias_in;   // [4D]: p_in_bias | g_in_bias (zeros when absent)
  const float* bias_out;  // [2D]: p_out_bias | g_out_bias
  const float* ln_in_w;  // [D] each: the workspace's norms, ln_in_w | ln_in_b | ln_out_w | ln_out_b
  const float* ln_in_b;
  const float* ln_out_w;
  const float* ln_out_b;

  // Backward.
  const void* dy;
  void* dx;
  void* dz;        // channel-major
  void* dgo;       // row-major [positions, D] with row stride ld_dpg: columns 4D.. of dpg
  void* dpo;       // row-major [positions, D]
  void* zln;       // row-major [positions, D]
  void* da;        // channel-major
  void* db;        // channel-major
  void* xln;       // row-major [positions, D]
  void* dpg;       // row-major [positions, ld_dpg]: dP (2D) | dG (2D) | dgo (D)
  int64_t ld_dpg;  // 5D: one GEMM gives d p_in_weight | d g_in_weight | d g_out_weight
  // Per-CTA running sums (see output_backward.cu and input_backward.cu), reduced in a fixed order
  // into `sums` (double, [8D]: see SumColumns).
  float* partials_bias_out;  // [2 * grid_backward, 2D]: d p_out_bias | d g_out_bias
  float* partials_norm_out;  // [kWarps * grid_backward, D]: d norm_out_weight
  float* partials_bias_in;   // [2 * grid_input_backward, 4D]: d p_in_bias | d g_in_bias
  float* partials_norm_in;   // [kWarps * grid_input_backward, D]: d norm_in_weight
  double* sums;
  int grid_backward;        // persistent CTAs of output_backward (kBackwardCtas for float32,
                            // k16BitOutputBackwardCtas for 16-bit types; the output segments of
                            // launch_reduce_sums follow it)
  int grid_input_backward;  // persistent CTAs of the input_backward kernel(s) (kBackwardCtas for
                            // float32, kSplitBackwardCtas for 16-bit types)
  // Last, so that the fields above keep their offsets in the kernels' parameter space.
  int mask_type;  // MaskType of `mask`
};

// Where each reduced sum lives in Params::sums, in units of D.
struct SumColumns {
  static constexpr int kNormOutWeight = 0, kPOutBias = 1, kGOutBias = 2, kNormInWeight = 3,
                       kPInBias = 4, kGInBias = 6, kTotal = 8;
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int padded_d(int64_t D) { return int(ceil_div(D, 16) * 16); }

// Byte offsets of everything in a workspace, each 256-byte aligned. entry.cu sizes the workspace
// with it and carves the same layout out of what the caller's allocator returns.
struct Workspace {
  size_t w_in, w_out, bias_in, bias_out, norms, cublas;
  // Backward only. Slots are reused once their first contents are consumed (stream order):
  // dz then x_ln, dpo then dA, z_ln then dB. dw_in and dw_out: the fp32 weight gradients from
  // cuBLAS, which finish_backward gives out in the weights' dtype.
  size_t dz_xln, dpo_da, zln_db, dpg, partials_bias_out, partials_norm_out, partials_bias_in,
      partials_norm_in, sums, dw_in, dw_out;
  size_t total;
};

constexpr size_t kCublasWorkspaceBytes = size_t(32) << 20;  // cuBLAS's recommendation for Hopper

inline Workspace workspace_layout(int64_t B, int64_t S, int64_t D, int elem_bytes, bool backward) {
  auto align = [](size_t n) { return (n + 255) / 256 * 256; };
  Workspace w{};
  const int Dp = padded_d(D);
  const int64_t chunks = ceil_div(2 * D, kChunkChannels);
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t offset = at;
    at += align(bytes);
    return offset;
  };
  w.w_in = take(size_t(chunks + 1) * kChunkN * Dp * elem_bytes);
  w.w_out = take(size_t(Dp) * Dp * elem_bytes);
  w.bias_in = take(4 * D * sizeof(float));
  w.bias_out = take(2 * D * sizeof(float));
  w.norms = take(4 * D * sizeof(float));
  w.cublas = take(kCublasWorkspaceBytes);
  if (backward) {
    const size_t unit = size_t(B) * S * S * D * elem_bytes;
    w.dz_xln = take(unit);
    w.dpo_da = take(unit);
    w.zln_db = take(unit);
    w.dpg = take(5 * unit);
    w.partials_bias_out = take(size_t(2) * kMaxOutputBackwardCtas * 2 * D * sizeof(float));
    w.partials_norm_out = take(size_t(kWarps) * kMaxOutputBackwardCtas * D * sizeof(float));
    w.partials_bias_in = take(size_t(2) * kMaxInputBackwardCtas * 4 * D * sizeof(float));
    w.partials_norm_in = take(size_t(kWarps) * kMaxInputBackwardCtas * D * sizeof(float));
    w.sums = take(size_t(SumColumns::kTotal) * D * sizeof(double));
    w.dw_in = take(size_t(5) * D * D * sizeof(float));
    w.dw_out = take(size_t(D) * D * sizeof(float));
  }
  w.total = at;
  return w;
}

}  // namespace tpf::cuda::trimul
