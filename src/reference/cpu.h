// The CPU paths (blocked like the GPU kernels, sums in FP64) and the FP64 references of every op, on
// arguments that src/ops has validated, with the sizes its validation found: nothing here checks
// them again.
#pragma once
#include <cstdint>

#include "core/glue_geometry.h"
#include "tpf/attention.h"
#include "tpf/glue.h"
#include "tpf/trimul.h"

namespace tpf::cpu {

void attention_forward(const AttentionForwardArgs& a, const AttentionDims& d);
void attention_backward(const AttentionBackwardArgs& a, const AttentionDims& d);
void attention_forward_f64(const AttentionForwardArgs& a, const AttentionDims& d);
void attention_backward_f64(const AttentionBackwardArgs& a, const AttentionDims& d);

void trimul_forward(const TrimulForwardArgs& a, const TrimulDims& d);
void trimul_backward(const TrimulBackwardArgs& a, const TrimulDims& d);
void trimul_forward_f64(const TrimulForwardArgs& a, const TrimulDims& d);
void trimul_backward_f64(const TrimulBackwardArgs& a, const TrimulDims& d);

void layer_norm_forward(const LayerNormForwardArgs& a, const glue::Rows& rows, int64_t n_rows);
void layer_norm_backward(const LayerNormBackwardArgs& a, const glue::Rows& rows, int64_t n_rows);
// Forward (h from ab) or backward (dab from dh and ab): M rows of H columns.
void swiglu(const SwigluArgs& a, bool backward, int64_t M, int64_t H);
void gated_output(const GatedOutputArgs& a, const glue::Heads& heads, bool backward);

}  // namespace tpf::cpu
