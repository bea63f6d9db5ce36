// The Hopper attention backward's CTA order (src/kernels/attention/backward_sm90_schedule.h): each
// launch covers every (slice group, b, h, key block) once, and the CTA that a dQ or dbias writer
// waits for (the previous key block of its slice group, the previous slice group of its key block)
// is numbered lower, so that the semaphores cannot deadlock however many CTAs are resident.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <tuple>

#include "kernels/attention/backward_sm90_schedule.h"
#include "kernels/attention/backward_sm90_tiles.h"

namespace tpf::cuda {
namespace {

TEST(AttentionSchedule, EveryCtaOnceAndEveryWaitOnALowerNumber) {
  for (int groups : {1, 2, 3, 5, 8})
    for (int group_begin : {0, 7})
      for (int B : {1, 2})
        for (int H : {1, 3, 4})
          for (int J : {1, 2, 6}) {
            std::map<std::tuple<int, int, int, int>, int> index;
            const int ctas = groups * B * H * J;
            for (int block = 0; block < ctas; ++block) {
              const Sm90BackwardBlock c = sm90_backward_block(block, group_begin, groups, B, H, J);
              ASSERT_GE(c.g, group_begin);
              ASSERT_LT(c.g, group_begin + groups);
              ASSERT_TRUE(c.b >= 0 && c.b < B && c.h >= 0 && c.h < H && c.jb >= 0 && c.jb < J);
              ASSERT_TRUE(index.emplace(std::make_tuple(c.g, c.b, c.h, c.jb), block).second)
                  << "block " << block << " repeats a CTA (groups " << groups << ", B " << B
                  << ", H " << H << ", J " << J << ")";
            }
            ASSERT_EQ(int(index.size()), ctas);
            for (const auto& [key, block] : index) {
              const auto [g, b, h, jb] = key;
              if (jb > 0) {  // dQ: key block jb - 1 of the same slice group adds first
                EXPECT_LT(index.at(std::make_tuple(g, b, h, jb - 1)), block);
              }
              if (g > group_begin) {  // dbias: slice group g - 1 of the same key block adds first
                EXPECT_LT(index.at(std::make_tuple(g - 1, b, h, jb)), block);
              }
            }
          }
}

TEST(AttentionSchedule, GridCountsWholeTiles) {
  const Sm90BackwardGrid g =
      sm90_backward_grid(/*N=*/7, /*Sq=*/65, /*Sk=*/129, /*slices=*/2, /*key_block=*/128);
  EXPECT_EQ(g.query_tiles, 2);
  EXPECT_EQ(g.key_blocks, 2);
  EXPECT_EQ(g.groups, 4);
  // D = 128: 64-key blocks, one slice per CTA (backward_sm90_tiles.h).
  EXPECT_EQ(sm90_backward_head_dim(72), 128);
  EXPECT_EQ(sm90_backward_slices(128, false), 1);
  EXPECT_EQ(sm90_backward_slices(24, false), 3);  // runs as D = 32
  EXPECT_EQ(sm90_backward_slices(32, true), 2);   // a float32 bias leaves room for two
  EXPECT_EQ(sm90_backward_slices(16, true), 4);
  // setmaxnreg stays inside the CTA's pool (384 x 168): 32 + 2 x 240 hung on an H100.
  EXPECT_EQ(kBwdLaunchRegisters, 168);
  EXPECT_TRUE(sm90_backward_registers_fit(56, 224));
  EXPECT_TRUE(sm90_backward_registers_fit(24, 240));
  EXPECT_FALSE(sm90_backward_registers_fit(32, 240));
  EXPECT_EQ(sm90_backward_key_block(96), 64);
  EXPECT_EQ(sm90_backward_key_block(64), 128);
  const Sm90BackwardGrid wide = sm90_backward_grid(7, 65, 129, 1, sm90_backward_key_block(128));
  EXPECT_EQ(wide.key_blocks, 3);
  EXPECT_EQ(wide.groups, 7);
}

// dbias lanes (backward_sm90_tiles.h): lane l sums the slice groups g = l, l + L, ... in its own
// turns, so every lane needs a first group (L <= groups), the lanes fit the budget unless one
// alone does not, and where budget and groups allow, L covers the co-resident groups plus two.
TEST(AttentionSchedule, DbiasLanesFitTheirRules) {
  for (int64_t groups : {1, 2, 5, 40, 400})
    for (int64_t per_group : {1, 12, 24, 48, 200})
      for (int64_t lane_bytes :
           {int64_t(1) << 10, int64_t(2359296), int64_t(9437184), int64_t(40) << 20}) {
        const int L = sm90_backward_dbias_lanes(groups, per_group, lane_bytes);
        const int64_t resident = (kBwdResidentCtas + per_group - 1) / per_group + 2;
        EXPECT_GE(L, 1);
        EXPECT_LE(L, kBwdDbiasLanes);
        EXPECT_LE(L, groups);
        if (L > 1) {
          EXPECT_LE(L * lane_bytes, kBwdDbiasBudgetBytes);
        }
        // Where nothing caps it, L covers the co-resident groups plus two.
        if (resident <= kBwdDbiasLanes && resident <= groups &&
            resident * lane_bytes <= kBwdDbiasBudgetBytes) {
          EXPECT_EQ(L, resident) << "groups " << groups << ", CTAs per group " << per_group
                                 << ", lane bytes " << lane_bytes;
        }
      }
  // S = 384, B H = 4, D = 32 (J = 3, 2.4 MB a lane): 7 lanes; S = 768 (9.4 MB): one.
  EXPECT_EQ(sm90_backward_dbias_lanes(192, 12, 2359296), 7);
  EXPECT_EQ(sm90_backward_dbias_lanes(384, 24, 9437184), 1);
}

// The staging order of the backward's dQ halves and dbias^T tiles (stage_offset), which the
// accumulators in global memory share: each row's columns are a permutation of the row's own
// floats that keeps 16-byte chunks whole (the writers read float4s, the copies are bytes), and a
// consumer warp's float2 stores of its accumulator fragment (lane: row lane / 4 (+ 8), columns
// 8 c + 2 (lane % 4), +1) hit 32 distinct banks in each half-warp's 16 lanes.
template <int COLS>
void check_stage_order() {
  for (int row = 0; row < 64; ++row) {
    std::set<int> seen;
    for (int col = 0; col < COLS; ++col) {
      const int at = stage_offset<COLS>(row, col);
      ASSERT_GE(at, row * COLS) << "COLS " << COLS << " row " << row << " col " << col;
      ASSERT_LT(at, (row + 1) * COLS) << "COLS " << COLS << " row " << row << " col " << col;
      ASSERT_TRUE(seen.insert(at).second) << "COLS " << COLS << " row " << row << " col " << col;
      if (col % 4)
        ASSERT_EQ(at, stage_offset<COLS>(row, col - 1) + 1);
      else
        ASSERT_EQ(at % 4, 0);
    }
  }
  for (int warp = 0; warp < 4; ++warp)
    for (int r = 0; r < 2; ++r)
      for (int c = 0; c < COLS / 8; ++c)
        for (int half = 0; half < 2; ++half) {
          std::set<int> banks;
          for (int lane = 16 * half; lane < 16 * half + 16; ++lane) {
            const int row = warp * 16 + lane / 4 + 8 * r, col = c * 8 + (lane % 4) * 2;
            const int at = stage_offset<COLS>(row, col);
            banks.insert(at % 32);
            banks.insert((at + 1) % 32);
          }
          EXPECT_EQ(banks.size(), 32u) << "COLS " << COLS << ": a bank conflict (warp " << warp
                                       << ", r " << r << ", c " << c << ", half " << half << ")";
        }
}

TEST(AttentionSchedule, StagingOrderIsAConflictFreePermutation) {
  check_stage_order<8>();   // dQ half at D = 16
  check_stage_order<16>();  // D = 32
  check_stage_order<32>();  // D = 64
  check_stage_order<64>();  // D = 128; dbias^T (64 queries)
}

}  // namespace
}  // namespace tpf::cuda
