// Shared-memory layout and tile geometry of the Hopper forward, per padded head dim DP.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/attention/forward_sm90_tiles.h"

namespace tpf::cuda::fwd90 {

constexpr size_t kMaxSmemBytes = 227 * 1024;  // sm_90's opt-in limit per block

template <int DP>
struct Layout {
  static_assert(DP % 16 == 0 && DP >= 16 && DP <= kMaxHeadDim, "padded head dims 16..128");
  // Swizzle atoms W elements (2 W bytes) wide: the widest of 64, 32, 16 that divides DP, so that
  // one TMA box of a K or V tile is one [64 keys][W] block in the canonical swizzled layout.
  static constexpr int W = DP % 64 == 0 ? 64 : DP % 32 == 0 ? 32 : 16;
  static constexpr int kBlocks = DP / W;
  static constexpr int G = slices_per_cta(DP);
  // O = P V: DP / 8 accumulator blocks of 8 columns. The row sums of P are not a column of this
  // MMA: exp_sum_pack adds them from the fp32 P in registers (ConsumerState::l).
  static constexpr int kPvN = DP;
  static constexpr int kPvBlocks = kPvN / 8;
  static constexpr uint32_t kBlockBytes = kKeys * W * 2;
  static constexpr uint32_t kTileBytes = kBlocks * kBlockBytes;  // one slice's K or V tile
  static constexpr uint32_t kBiasBytes = kBiasTileFloats * 4;
  static constexpr uint32_t kStageBytes = kBiasBytes + G * 2 * kTileBytes;
  static constexpr uint32_t kLoadBytes = kStageBytes;  // TMA bytes per stage: all of it
  static constexpr uint32_t k_offset(int g) { return kBiasBytes + g * kTileBytes; }
  static constexpr uint32_t v_offset(int g) { return kBiasBytes + (G + g) * kTileBytes; }
  static constexpr uint32_t kBarriers = kStages * kStageBytes;
  static constexpr uint32_t kWords = kBarriers + 2 * kStages * 8;
  // + 1024: the base is rounded up to 1024 bytes (the 128-byte swizzle's period).
  static size_t smem_bytes(int key_tiles) { return kWords + size_t(G) * key_tiles * 8 + 1024; }
  // The most keys whose mask words still fit (smem_bytes <= kMaxSmemBytes).
  static constexpr int64_t kMaxKeys = int64_t((kMaxSmemBytes - kWords - 1024) / (8 * G)) * kKeys;
  static_assert(kBiasBytes % 1024 == 0 && kBlockBytes % 1024 == 0, "swizzled tiles 1 KB aligned");
};

// The most keys (Sk) the forward takes at head dim d (a multiple of 8 up to kMaxHeadDim).
inline int64_t max_keys(int d) {
  switch (padded_head_dim(d)) {
    case 16: return Layout<16>::kMaxKeys;
    case 32: return Layout<32>::kMaxKeys;
    case 48: return Layout<48>::kMaxKeys;
    case 64: return Layout<64>::kMaxKeys;
    case 80: return Layout<80>::kMaxKeys;
    case 96: return Layout<96>::kMaxKeys;
    case 112: return Layout<112>::kMaxKeys;
    default: return Layout<128>::kMaxKeys;
  }
}

}  // namespace tpf::cuda::fwd90
