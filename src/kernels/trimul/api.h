// Entry points of libtpf_cuda for the triangle multiplicative update. Arguments are validated by
// the caller (src/ops/trimul.cpp); these only launch. Defined in the CUDA library, or by
// src/kernels/unavailable.cpp in a build without it.
#pragma once
#include <cstddef>
#include "tpf/trimul.h"

namespace tpf::cuda {

// The CUDA kernels' limits on the channel count D (a multiple of 8, at most this).
constexpr int64_t kTrimulMaxD = 128;
// ... and on the sizes (src/ops checks them before anything is queued): B S S positions and B D
// channels at most this, cuBLAS's 32-bit GEMM sizes (positions: the weight gradients' K; channels:
// the contraction's batch), which also bounds the forward kernels' grids (a CTA per 64 positions).
constexpr int64_t kTrimulMaxPositions = 2147483647;

// Each sizes its workspace once and asks a.workspace for it.
void trimul_forward(const TrimulForwardArgs& a, const TrimulDims& d, void* stream);
void trimul_backward(const TrimulBackwardArgs& a, const TrimulDims& d, void* stream);

}  // namespace tpf::cuda
