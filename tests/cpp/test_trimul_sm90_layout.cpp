// The Hopper input kernel's layout (src/kernels/trimul/input_forward_sm90.h): the 128-byte swizzle
// its LayerNorm reads and writes is the one TMA writes and the wgmma descriptors read, its shared
// memory fits one CTA, and its persistent tile order gives every tile to one consumer once with
// the ring's stages and phases in the order the producer fills them.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
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

// The ring's mbarrier protocol as the kernel runs it (input_forward.cu), on a model of the
// hardware: a barrier completes a phase when its arrivals and transaction bytes are in, a parity
// wait passes while the barrier's current phase has the other parity (so also for the phase two
// back: the aliasing the kernel must rule out), and TMA loads complete in any order. Random
// schedules of the producer, the consumers and the loads' completions; a consumer must find its
// own tile whole in the stage when its full wait passes, and no load may land in a stage that a
// consumer still reads. `wait_release`: the consumer's wait on empty before full (the kernel's,
// for an odd number of stages).
struct ModelBarrier {
  int count, pending, tx = 0, phases = 0;
  explicit ModelBarrier(int c) : count(c), pending(c) {}
  void complete_if_done() {
    if (pending == 0 && tx == 0) {
      ++phases;
      pending = count;
    }
  }
  void arrive() {
    --pending;
    complete_if_done();
  }
  bool passes(int parity) const { return (phases & 1) != parity; }
};

struct ProtocolResult {
  bool violated = false, deadlocked = false;
};

ProtocolResult run_protocol(int stages, int64_t ntiles, bool wait_release, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<ModelBarrier> full(size_t(stages), ModelBarrier(1)),
      empty(size_t(stages), ModelBarrier(1));  // one arrival per consumer release (its 128 threads)
  constexpr int64_t kNone = -1;
  std::vector<int64_t> landed(size_t(stages), kNone);  // whole tile in the stage, or kNone
  std::vector<int> readers(size_t(stages), 0);
  std::vector<std::pair<int, int64_t>> in_flight;  // (stage, tile) loads not yet complete
  ProtocolResult res;
  // Program counters: the producer's k and step (0: wait empty, 1: issue); each consumer's k and
  // step (0: wait empty, 1: wait full, 2: release).
  int64_t pk = 0;
  int pstep = 0;
  int64_t ck[kConsumers];
  int cstep[kConsumers];
  for (int c = 0; c < kConsumers; ++c) ck[c] = c, cstep[c] = wait_release ? 0 : 1;
  for (;;) {
    std::vector<int> enabled;  // 0: producer, 1 + c: consumer c, 1 + kConsumers + i: load i lands
    if (pk < ntiles) {
      const Slot s = slot_of(0, 1, pk, stages);
      if (pstep == 1 || empty[size_t(s.stage)].passes(s.parity ^ 1)) enabled.push_back(0);
    }
    for (int c = 0; c < kConsumers; ++c) {
      if (ck[c] >= ntiles) continue;
      const Slot s = slot_of(0, 1, ck[c], stages);
      const bool ok = cstep[c] == 2 ||
                      (cstep[c] == 0 && empty[size_t(s.stage)].passes(s.parity ^ 1)) ||
                      (cstep[c] == 1 && full[size_t(s.stage)].passes(s.parity));
      if (ok) enabled.push_back(1 + c);
    }
    for (size_t i = 0; i < in_flight.size(); ++i) enabled.push_back(1 + kConsumers + int(i));
    if (enabled.empty()) {
      res.deadlocked = pk < ntiles || ck[0] < ntiles || ck[1 % kConsumers] < ntiles;
      return res;
    }
    const int a = enabled[std::uniform_int_distribution<size_t>(0, enabled.size() - 1)(rng)];
    if (a == 0) {
      const Slot s = slot_of(0, 1, pk, stages);
      if (pstep == 0) {
        pstep = 1;
      } else {
        if (readers[size_t(s.stage)] != 0) res.violated = true;  // overwrites a stage in use
        ModelBarrier& f = full[size_t(s.stage)];
        f.tx += 1;
        f.arrive();
        landed[size_t(s.stage)] = kNone;
        in_flight.push_back({s.stage, s.tile});
        ++pk;
        pstep = 0;
      }
    } else if (a <= kConsumers) {
      const int c = a - 1;
      const Slot s = slot_of(0, 1, ck[c], stages);
      if (cstep[c] == 0) {
        cstep[c] = 1;
      } else if (cstep[c] == 1) {
        if (landed[size_t(s.stage)] != s.tile) res.violated = true;  // not its whole tile
        ++readers[size_t(s.stage)];
        cstep[c] = 2;
      } else {
        --readers[size_t(s.stage)];
        empty[size_t(s.stage)].arrive();
        ck[c] += kConsumers;
        cstep[c] = wait_release ? 0 : 1;
      }
    } else {
      const size_t i = size_t(a - 1 - kConsumers);
      const auto [stage, tile] = in_flight[i];
      in_flight.erase(in_flight.begin() + std::ptrdiff_t(i));
      landed[size_t(stage)] = tile;
      --full[size_t(stage)].tx;
      full[size_t(stage)].complete_if_done();
    }
    if (res.violated) return res;
  }
}

TEST(TrimulSm90Layout, RingProtocolUnderAnyLoadOrder) {
  for (int stages : {Layout<64>::kStages, Layout<128>::kStages}) {
    const bool wait_release = stages % kConsumers != 0;  // as the kernel: if constexpr
    for (int64_t tiles : {0, 1, 2, 3, 7, 40})
      for (uint32_t seed = 0; seed < 2000; ++seed) {
        const ProtocolResult r = run_protocol(stages, tiles, wait_release, seed);
        ASSERT_FALSE(r.violated) << "stages " << stages << " tiles " << tiles << " seed " << seed;
        ASSERT_FALSE(r.deadlocked) << "stages " << stages << " tiles " << tiles << " seed " << seed;
      }
  }
  // The model finds the aliasing that the wait on empty rules out: at 3 stages without it, a
  // consumer's full wait for use u passes while use u - 1's load (the other consumer's) is in
  // flight.
  int found = 0;
  for (uint32_t seed = 0; seed < 2000; ++seed)
    found += run_protocol(Layout<128>::kStages, 40, false, seed).violated;
  EXPECT_GT(found, 0);
}

}  // namespace
}  // namespace tpf::cuda::trimul::sm90
