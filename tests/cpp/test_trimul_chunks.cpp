// The chunks of positions over which the trimul backward's input side runs (src/kernels/trimul/
// params.h, InputChunks): every row (b, i) once and in order, each chunk whole samples or rows of
// one sample, every chunk's x_ln and dP | dG inside the slot that dz held, the smallest chunk as
// the plan says (the persistent grid is at most its tiles), one chunk below kChunkFromBytes.
#include <gtest/gtest.h>

#include <cstdint>

#include "kernels/trimul/params.h"

namespace tpf::cuda::trimul {
namespace {

TEST(TrimulInputChunks, CoverEveryRowOnceWithinTheSlot) {
  for (int elem : {2, 4})
    for (int64_t D : {8, 64, 128})
      for (int64_t B : {1, 2, 5, 12})
        for (int64_t S : {1, 7, 160, 384, 401, 768, 1024}) {
          const InputChunks c = input_chunks(B, S, D, elem);
          const Workspace w = workspace_layout(B, S, D, elem, true);
          const size_t unit = size_t(B) * S * S * D * elem;
          ASSERT_GE(c.count, 1);
          if (unit < kChunkFromBytes) EXPECT_EQ(c.count, 1) << B << " " << S << " " << D;
          int64_t next = 0, smallest = B * S, largest = 0;
          for (int64_t k = 0; k < c.count; ++k) {
            const ChunkRows r = chunk_rows(c, B, S, k);
            ASSERT_EQ(r.first, next) << "chunk " << k;
            ASSERT_GE(r.count, 1);
            // Whole samples, or rows of one sample.
            const bool whole = r.first % S == 0 && r.count % S == 0;
            EXPECT_TRUE(whole || r.first / S == (r.first + r.count - 1) / S) << "chunk " << k;
            next += r.count;
            smallest = std::min(smallest, r.count);
            largest = std::max(largest, r.count);
          }
          EXPECT_EQ(next, B * S);
          EXPECT_EQ(smallest, c.min_rows) << B << " " << S << " " << D;
          EXPECT_LE(largest * S, c.max_positions);
          // x_ln then dP | dG of the largest chunk inside the dz slot, which is one tensor where
          // it chunks.
          const size_t dz_slot = w.dpo_da - w.dz_chunk;
          EXPECT_EQ(w.chunk_xln, w.dz_chunk);
          EXPECT_GE(w.chunk_dpg, w.chunk_xln + size_t(c.max_positions) * D * elem);
          EXPECT_LE(w.chunk_dpg + size_t(c.max_positions) * 4 * D * elem, w.dz_chunk + dz_slot);
          if (c.count > 1) EXPECT_LT(dz_slot, unit + 512);
        }
}

TEST(TrimulInputChunks, ChunksWhereOneTensorIsLarge) {
  // D = 128, S = 768, bf16: one tensor is 151 MB; six chunks of 128 rows.
  const InputChunks c = input_chunks(1, 768, 128, 2);
  EXPECT_EQ(c.count, 6);
  EXPECT_EQ(c.min_rows, 128);
  // Twelve samples of S = 160: two whole samples per chunk.
  const InputChunks w = input_chunks(12, 160, 128, 2);
  EXPECT_EQ(w.samples, 2);
  EXPECT_EQ(w.count, 6);
  // The backward's workspace at D = 128, S = 768: 4 tensors (dz / chunks, dpo / dA, z_ln / dB,
  // dgo) plus the fixed parts, where it was 8.
  const size_t unit = size_t(768) * 768 * 128 * 2;
  const Workspace ws = workspace_layout(1, 768, 128, 2, true);
  EXPECT_LT(ws.total, 4 * unit + (size_t(64) << 20));
}

}  // namespace
}  // namespace tpf::cuda::trimul
