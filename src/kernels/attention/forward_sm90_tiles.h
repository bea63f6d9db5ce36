// The tile table of the Hopper forward (forward_sm90.cu): every tile size, thread role and register
// budget, with the reason for each, in one place. Host and device alike, no CUDA types, so the
// core library (workspace size, api.h's limits) and the kernels compute the same numbers; the
// shared-memory layout these give is forward_sm90_layout.h.
#pragma once
#include <cstddef>
#include <cstdint>

namespace tpf::cuda::fwd90 {

// 128 queries per CTA: two consumer warpgroups of 64 rows each (wgmma's M). 64 keys per tile: one
// tile's scores are 32 fp32 registers per thread, and the bias tile (fp32) is 32 KB.
constexpr int kRows = 128;
constexpr int kRowsPerWarpgroup = 64;
constexpr int kKeys = 64;
constexpr int kStages = 2;
constexpr int kConsumers = 2;                     // consumer warpgroups
constexpr int kThreads = 128 * (1 + kConsumers);  // + the producer warpgroup
// Producer registers: one thread issues copies. Consumers: Q fragments, O and the score tile of
// G slices. 128 x 24 + 256 x 240 = 64512 of the SM's 65536.
constexpr int kProducerRegs = 24;
constexpr int kConsumerRegs = 240;
// The bias pre-pass (forward_sm90.cu): one CTA of this many threads per 32 KB bias block.
constexpr int kPrepassThreads = 256;
constexpr int kBiasTileFloats = kRows * kKeys;  // one stage's bias, fp32 in fragment order
constexpr int kMaxHeadDim = 128;

// The head dim rounded up to whole k-steps of the QK^T MMA (16); the padding columns are zero.
constexpr int padded_head_dim(int d) { return (d + 15) / 16 * 16; }

// Slices (n) per CTA that share one bias tile: the bias is the same for every slice of a head, so
// G slices read it once from L2 (bytes per score: 4 / G for the bias, 4 D / 128 for K and V).
// Each slice keeps its own O (D fp32 columns per row), row sums and Q fragments in registers, which
// bounds G at larger D.
constexpr int slices_per_cta(int padded_d) { return padded_d <= 32 ? 4 : padded_d <= 64 ? 2 : 1; }

// Fraction of the exponentials computed by a polynomial on the FMA pipe instead of the MUFU (the
// MUFU's 16 results per clock per SM bound this kernel at D <= 32): this many of the 8 column
// blocks of each score tile (FlashAttention-4's split). Overridable at build time for A/B runs.
#ifndef TPF_ATTN_FWD_POLY_BLOCKS
#define TPF_ATTN_FWD_POLY_BLOCKS 1
#endif
constexpr int kPolyExpBlocks = TPF_ATTN_FWD_POLY_BLOCKS;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Workspace of the forward: the bias pre-scaled to fp32 in the consumers' fragment order, one
// 32 KB block per (b, h, 128-query block, 64-key tile).
inline size_t forward_workspace_bytes(int64_t B, int64_t H, int64_t Sq, int64_t Sk) {
  return size_t(B * H * ceil_div(Sq, kRows) * ceil_div(Sk, kKeys)) * kBiasTileFloats *
         sizeof(float);
}

}  // namespace tpf::cuda::fwd90
