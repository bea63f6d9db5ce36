// Entry points of libtpf_cuda for the fused glue ops (tpf/glue.h). Arguments are validated by the
// caller (src/ops/glue.cpp); these only launch. Defined in the CUDA library, or by
// src/kernels/unavailable.cpp in a build without it.
#pragma once
#include <cstddef>
#include "core/glue_geometry.h"
#include "tpf/glue.h"

namespace tpf::cuda {

void layer_norm_forward(const LayerNormForwardArgs& a, const glue::Rows& rows, int64_t n_rows,
                        void* stream);
void layer_norm_backward(const LayerNormBackwardArgs& a, const glue::Rows& rows, int64_t n_rows,
                         void* stream);
void swiglu_forward(const SwigluArgs& a, void* stream);
void swiglu_backward(const SwigluArgs& a, void* stream);
void gated_output_forward(const GatedOutputArgs& a, const glue::Heads& heads, void* stream);
void gated_output_backward(const GatedOutputArgs& a, const glue::Heads& heads, void* stream);

}  // namespace tpf::cuda
