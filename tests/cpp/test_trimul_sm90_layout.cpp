// The Hopper input kernel's layout (src/kernels/trimul/input_forward_sm90.h): the 128-byte swizzle
// its LayerNorm reads and writes is the one TMA writes and the wgmma descriptors read, its shared
// memory fits one CTA, and its persistent tile order gives every tile to one consumer once with
// the ring's stages and phases in the order the producer fills them.
#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <vector>

#include "kernels/trimul/input_forward_sm90.h"

namespace tpf::cuda::trimul::sm90 {
namespace {

// TMA's CU_TENSOR_MAP_SWIZZLE_128B on a 1024-byte aligned box of 128-byte rows: address bits
// 4-6 XOR bits 7-9 (CUDA programming guide, "TMA swizzle"), the box's columns in 64-element
// blocks of `rows` rows each.
uint32_t tma_sw128(int rows, int r, int c) {
  const uint32_t linear = uint32_t((c / kAtomCols) * rows * 128 + r * 128 + (c % kAtomCols) * 2);
  return linear ^ (((linear >> 7) & 7u) << 4);
}

TEST(TrimulSm90Layout, SwizzleIsTmasAndABijection) {
  for (int rows : {64, 128})
    for (int D : {64, 128}) {
      std::set<uint32_t> seen;
      for (int r = 0; r < rows; ++r)
        for (int c = 0; c < D; ++c) {
          const uint32_t o = sw128_offset(rows, r, c);
          ASSERT_EQ(o, tma_sw128(rows, r, c)) << "rows " << rows << " r " << r << " c " << c;
          ASSERT_EQ(o % 2, 0u);
          ASSERT_LT(o, uint32_t(rows * D * 2));
          ASSERT_TRUE(seen.insert(o).second);
        }
    }
}

// The kernel's k step kk starts its descriptors at block kk / 4, byte (kk % 4) * 32 of row 0: where
// element (0, 16 kk) lies, its 16 k values in two 16-byte chunks (row 0 is not permuted).
TEST(TrimulSm90Layout, DescriptorStepsStartOnTheirK) {
  for (int rows : {64, 128})
    for (int kk = 0; kk < 128 / 16; ++kk) {
      const uint32_t start = uint32_t((kk / 4) * rows * 128 + (kk % 4) * 32);
      for (int e = 0; e < 16; ++e) EXPECT_EQ(sw128_offset(rows, 0, 16 * kk + e), start + 2 * e);
    }
}

template <int kD>
void check_layout() {
  using L = Layout<kD>;
  EXPECT_LE(L::kBytes, uint32_t(kSmemLimit));
  // Regions in order, each starting where the one before it ends (or later), the swizzled ones on
  // 1024 bytes, the others on 16 (16-byte staging reads), the barriers on 8.
  EXPECT_EQ(L::kW % 1024, 0u);
  EXPECT_EQ(L::kX % 1024, 0u);
  EXPECT_GE(L::kX, L::kW + L::kWBytes);
  EXPECT_GE(L::kStaging, L::kX + L::kStages * L::kXBytes);
  EXPECT_EQ(L::kStaging % 16, 0u);
  EXPECT_EQ(L::kStagingBytes % 16, 0u);
  EXPECT_GE(L::kBiasIn, L::kStaging + kConsumers * L::kStagingBytes);
  EXPECT_GE(L::kBiasGo, L::kBiasIn + 4 * kD * 4);
  EXPECT_GE(L::kMask, L::kBiasGo + kD * 4);
  EXPECT_GE(L::kBars, L::kMask + kConsumers * kRows * 4);
  EXPECT_EQ(L::kBars % 8, 0u);
  EXPECT_EQ(L::kEnd, L::kBars + 8 * L::kBarCount);
  // One TMA box is 64 columns of 128-byte rows: the weights' 128 rows, x's kRows.
  EXPECT_EQ(L::kWBlockBytes, uint32_t(L::kKHalves * kChunkN * 128));
  EXPECT_EQ(L::kXBytes, uint32_t(L::kKHalves * kRows * 128));
  // Staging rows of 16-bit values, 16-byte aligned; both epilogue parts fit; parts divide the
  // a | b step's channels and go's columns.
  EXPECT_EQ((L::kLdAB * 2) % 16, 0);
  EXPECT_EQ((L::kLdGo * 2) % 16, 0);
  EXPECT_LE(uint32_t(L::kPart * L::kLdAB * 2), L::kStagingBytes);
  EXPECT_LE(uint32_t(kRows * L::kLdGo * 2), L::kStagingBytes);
  EXPECT_EQ(kChunkChannels % L::kPart, 0);
  EXPECT_EQ(kD % L::kPart, 0);
}

TEST(TrimulSm90Layout, SharedMemoryFitsOneCta) {
  check_layout<64>();
  check_layout<128>();
}

// Every tile once, to consumer k % kConsumers of its CTA; each stage's uses in the producer's
// order k have phases 0, 1, 0, ... (parity = use number & 1). A stage may pass from one consumer
// to the other (3 stages, 2 consumers): the release of use u - 1 precedes the load of use u in
// k order, so every wait depends on lower k only (no cycle).
TEST(TrimulSm90Layout, PersistentOrderCoversEveryTileOnce) {
  for (int stages : {Layout<64>::kStages, Layout<128>::kStages}) {
    for (int64_t grid : {1, 2, 3, 132})
      for (int64_t tiles : {0, 1, 2, 5, 131, 132, 133, 1000}) {
        std::vector<int> count(size_t(tiles), 0);
        for (int64_t cta = 0; cta < grid; ++cta) {
          std::vector<int> uses(size_t(stages), 0);
          const int64_t n = tiles_of(cta, grid, tiles);
          for (int64_t k = 0; k < n; ++k) {
            const Slot s = slot_of(cta, grid, k, stages);
            ASSERT_GE(s.tile, 0);
            ASSERT_LT(s.tile, tiles);
            ++count[size_t(s.tile)];
            EXPECT_EQ(s.consumer, int(k % kConsumers));
            EXPECT_EQ(s.stage, int(k % stages));
            EXPECT_EQ(s.parity, uses[size_t(s.stage)] & 1);
            ++uses[size_t(s.stage)];
          }
          // The next k would be past the tiles.
          EXPECT_GE(slot_of(cta, grid, n, stages).tile, tiles);
        }
        for (int64_t t = 0; t < tiles; ++t)
          EXPECT_EQ(count[size_t(t)], 1) << "tile " << t << " of " << tiles << ", grid " << grid;
      }
  }
}

}  // namespace
}  // namespace tpf::cuda::trimul::sm90
