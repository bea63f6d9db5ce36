// The Hopper attention backward's CTA order (src/kernels/attention/backward_sm90_schedule.h): each
// launch covers every (slice group, b, h, key block) once, and the CTA that a dQ or dbias writer
// waits for (the previous key block of its slice group, the previous slice group of its key block)
// is numbered lower, so that the semaphores cannot deadlock however many CTAs are resident.
#include <gtest/gtest.h>

#include <map>
#include <tuple>

#include "kernels/attention/backward_sm90_schedule.h"

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
  EXPECT_EQ(sm90_backward_slices(128), 1);
  EXPECT_EQ(sm90_backward_key_block(96), 64);
  EXPECT_EQ(sm90_backward_key_block(64), 128);
  const Sm90BackwardGrid wide = sm90_backward_grid(7, 65, 129, 1, sm90_backward_key_block(128));
  EXPECT_EQ(wide.key_blocks, 3);
  EXPECT_EQ(wide.groups, 7);
}

}  // namespace
}  // namespace tpf::cuda
