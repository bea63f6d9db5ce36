// The Hopper input kernel's layout (input_forward.cu, input_forward_sm90_kernel): its shared
// memory, the 128-byte swizzle that TMA writes and wgmma reads, and the order in which a
// persistent CTA's producer and consumer warpgroups take the tiles. Pure integer arithmetic, host
// and device alike (no CUDA types), so that a CPU test (tests/cpp/test_trimul_sm90_layout.cpp)
// checks it.
#pragma once
#include <cstdint>

#include "kernels/trimul/tiles.h"

#if defined(__CUDACC__)
#define TPF_TRIMUL_HD __host__ __device__
#else
#define TPF_TRIMUL_HD
#endif

namespace tpf::cuda::trimul::sm90 {

// One producer warpgroup (one thread issues every TMA load) and kConsumers consumer warpgroups;
// each consumer takes whole tiles of kRows = 64 positions (one wgmma M of 64), so a tile's a, b
// and go rows are those of the mma.sync kernel.
constexpr int kConsumers = 2;
constexpr int kThreads = 128 * (1 + kConsumers);
// 16-bit elements per 128-byte swizzle row: x tiles and weight blocks are stored as D / 64
// column blocks of [rows][64], each block 1024-byte aligned (TMA box {64, rows}).
constexpr int kAtomCols = 64;
constexpr int kSmemLimit = 232448;  // 227 KiB per CTA on sm_90

// Byte offset of element (r, c) of a [rows][D] tile stored as D / 64 swizzled blocks [rows][64]:
// TMA's 128-byte swizzle XORs the 16-byte chunk index (address bits 4-6) with the row within
// the 1024-byte period (bits 7-9), which is r % 8 for 128-byte rows of a 1024-byte aligned block.
TPF_TRIMUL_HD constexpr uint32_t sw128_offset(int rows, int r, int c) {
  return uint32_t((c / kAtomCols) * rows * 128 + r * 128 +
                  ((((c % kAtomCols) / 8) ^ (r % 8)) * 16) + (c % 8) * 2);
}

// Static sizes at D = 64 or 128 (16-bit elements).
template <int kD>
struct Layout {
  static_assert(kD == 64 || kD == 128, "the Hopper input kernel's D");
  static constexpr int kChunks = 2 * kD / kChunkChannels;  // a/b steps; then the gate step
  static constexpr int kBlocks = kChunks + 1;              // weight blocks [kChunkN][kD]
  static constexpr int kKHalves = kD / kAtomCols;          // 64-column blocks along K
  // x stages in the ring: three at D = 128 (the 160 KiB of weights leave room for no fourth), so
  // that one tile is loading while both consumers work; six at D = 64 (8 KiB each), four loading.
  static constexpr int kStages = kD == 128 ? 3 : 6;
  static constexpr uint32_t kWBlockBytes = uint32_t(kChunkN) * kD * 2;
  static constexpr uint32_t kWBytes = kBlocks * kWBlockBytes;
  static constexpr uint32_t kXBytes = uint32_t(kRows) * kD * 2;  // one stage (one TMA tx count)
  // Per consumer: the epilogue's 16-bit staging for one part of kPart channels or columns (the
  // epilogues go in parts, so that the staging leaves room for the third stage): a | b
  // channel-major [kPart channels][kRows rows] with row stride kLdAB, go row-major
  // [kRows rows][kPart columns] with row stride kLdGo (the pads: 16-byte aligned rows that start
  // on different banks).
  static constexpr int kPart = 32;
  static constexpr int kLdAB = kRows + kPad;
  static constexpr int kLdGo = kPart + kPad;
  static constexpr uint32_t kStagingBytes =
      uint32_t(kPart * kLdAB > kRows * kLdGo ? kPart * kLdAB : kRows * kLdGo) * 2;
  // Offsets from the 1024-byte aligned base.
  static constexpr uint32_t kW = 0;
  static constexpr uint32_t kX = kW + kWBytes;
  static constexpr uint32_t kStaging = kX + kStages * kXBytes;
  static constexpr uint32_t kBiasIn = kStaging + kConsumers * kStagingBytes;  // [4D] floats
  static constexpr uint32_t kBiasGo = kBiasIn + 4 * kD * 4;                   // [D] floats
  static constexpr uint32_t kMask = kBiasGo + kD * 4;  // [kConsumers][kRows] floats
  static constexpr uint32_t kBars = kMask + kConsumers * kRows * 4;
  // Barriers: the weights' one, then full[kStages], empty[kStages].
  static constexpr int kBarCount = 1 + 2 * kStages;
  static constexpr uint32_t kEnd = kBars + kBarCount * 8;
  // Dynamic shared memory to ask for: the base is aligned up to 1024 bytes in the kernel.
  static constexpr uint32_t kBytes = kEnd + 1024;
  static_assert(kBytes <= uint32_t(kSmemLimit), "fits one CTA per SM");
  static_assert(kX % 1024 == 0 && kXBytes % 1024 == 0 && kWBlockBytes % 1024 == 0,
                "swizzled blocks on 1024 bytes");
  // A stage's use before last (tile k - 2 kStages) is the same consumer's: the consumers' parity
  // waits rely on it (input_forward.cu; slot_of below).
  static_assert((2 * kStages) % kConsumers == 0, "use u - 2 of a stage by the same consumer");
};

// Tile k (0, 1, ...) of a persistent CTA: tile index cta + k * grid (all CTAs sweep the tiles
// together), consumer warpgroup k % kConsumers, ring stage k % stages, and the parity of that
// stage's phase (its (k / stages)-th use). The producer loads in the order k, each consumer takes
// its own k in increasing order: full[stage] completes once per use, empty[stage] once per
// release by the consumer that used it. A parity wait is sound only while the barrier is at most
// one phase behind the awaited one: the producer's wait on empty for use u follows its own wait
// for use u - 1; a consumer's wait on full for use u follows its own use u - 2 (2 kStages is a
// multiple of kConsumers), but use u - 1 may be the other consumer's (kStages odd), so that
// consumer first waits on empty for use u - 1, as the producer does.
struct Slot {
  int64_t tile;
  int consumer, stage, parity;
};
TPF_TRIMUL_HD constexpr Slot slot_of(int64_t cta, int64_t grid, int64_t k, int stages) {
  return {cta + k * grid, int(k % kConsumers), int(k % stages), int((k / stages) & 1)};
}
// Tiles that CTA `cta` of `grid` takes out of `tiles`.
TPF_TRIMUL_HD constexpr int64_t tiles_of(int64_t cta, int64_t grid, int64_t tiles) {
  return cta < tiles ? (tiles - cta + grid - 1) / grid : 0;
}

}  // namespace tpf::cuda::trimul::sm90
