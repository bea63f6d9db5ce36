// The Hopper input kernel's layout (src/kernels/trimul/input_forward_sm90.h): the 128-byte swizzle
// its LayerNorm reads and writes is the one TMA writes and the wgmma descriptors read, its shared
// memory fits one CTA, and its persistent tile order gives every tile to one consumer once with
// the ring's stages and phases in the order the producer fills them. The Hopper gates kernel's
// (src/kernels/trimul/input_backward_sm90.h): its shared memory, the dA | dB stage's swizzle and
// the ldmatrix.trans addresses that read it in the accumulators' layout, and the units of work:
// every tile once, each bias partial-sum row once, from the tiles the mma.sync kernel's CTA of
// that row takes, in an order that depends on G alone. The Hopper dx kernel's: its shared memory,
// the core-matrix layout its copies write and its descriptors read, its stages' k order (the
// mma.sync kernel's: dpg column and w_in row of the same k), its copy cursor's order and the rows
// its warps sum.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "kernels/trimul/input_backward_sm90.h"
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

template <int kD>
void check_gates_layout() {
  using L = GatesLayout<kD>;
  EXPECT_LE(L::kBytes, uint32_t(kSmemLimit));
  EXPECT_EQ(L::kChunks * kChunkChannels, 2 * kD);
  // Regions in order, without overlap; the swizzled ones (TMA destinations, wgmma operands) on
  // 1024 bytes, the float sums on 16 (float2 reads of the biases need 8), the barriers on 8.
  EXPECT_EQ(L::kW, 0u);
  EXPECT_EQ(L::kWBlockBytes, uint32_t(L::kKHalves * kChunkN * 128));
  EXPECT_EQ(L::kXBytes, uint32_t(L::kKHalves * kRows * 128));
  EXPECT_EQ(L::kDabBytes, uint32_t(kChunkChannels * 128));  // one TMA box: 64 channels x 128 B
  EXPECT_GE(L::kX, L::kW + L::kWBytes);
  EXPECT_GE(L::kDab, L::kX + kConsumers * L::kXStages * L::kXBytes);
  EXPECT_GE(L::kRun, L::kDab + kConsumers * L::kDabStages * L::kDabBytes);
  EXPECT_GE(L::kHeld, L::kRun + kConsumers * L::kRunBytes);
  EXPECT_GE(L::kBiasIn, L::kHeld + kConsumers * L::kHeldBytes);
  EXPECT_GE(L::kBars, L::kBiasIn + 4 * kD * 4);
  EXPECT_EQ(L::kEnd, L::kBars + 8 * L::kBarCount);
  for (uint32_t o : {L::kX, L::kDab, L::kXBytes, L::kDabBytes, L::kWBlockBytes})
    EXPECT_EQ(o % 1024, 0u);
  for (uint32_t o : {L::kRun, L::kHeld, L::kBiasIn}) EXPECT_EQ(o % 16, 0u);
  EXPECT_EQ(L::kBars % 8, 0u);
  // Sums: a row of partials_bias_in per half, 4 warps of 16 rows = the tile's kRows.
  EXPECT_EQ(L::kSumCols, 4 * kD);
  EXPECT_EQ(L::kRunBytes, uint32_t(4 * 4 * kD * 4));
  EXPECT_EQ(L::kHeldBytes, uint32_t(2 * 4 * kD * 4));
  // Barrier indices: the weights' 0, then each consumer's, all distinct and in range.
  std::set<int> bars{0};
  for (int c = 0; c < kConsumers; ++c) {
    for (int s = 0; s < L::kXStages; ++s) {
      EXPECT_TRUE(bars.insert(L::x_full(c, s)).second);
      EXPECT_TRUE(bars.insert(L::x_empty(c, s)).second);
    }
    for (int s = 0; s < L::kDabStages; ++s) {
      EXPECT_TRUE(bars.insert(L::dab_full(c, s)).second);
      EXPECT_TRUE(bars.insert(L::dab_empty(c, s)).second);
    }
  }
  EXPECT_EQ(int(bars.size()), L::kBarCount);
  EXPECT_EQ(*bars.rbegin(), L::kBarCount - 1);
}

TEST(TrimulSm90Layout, GatesSharedMemoryFitsOneCta) {
  check_gates_layout<64>();
  check_gates_layout<128>();
}

// dA | dB stage: TMA's box {64 positions, 64 channels} of 128-byte channel rows, swizzled.
TEST(TrimulSm90Layout, GatesDabStageIsTmasSwizzle) {
  std::set<uint32_t> seen;
  for (int ch = 0; ch < kChunkChannels; ++ch)
    for (int r = 0; r < kRows; ++r) {
      ASSERT_EQ(dab_offset(ch, r), tma_sw128(kRows, ch, r));
      ASSERT_TRUE(seen.insert(dab_offset(ch, r)).second);
      ASSERT_LT(dab_offset(ch, r), GatesLayout<64>::kDabBytes);
    }
}

// ldmatrix.x4.trans: lane 8 m + rr gives the address of row rr of matrix m (8 contiguous 16-bit
// values); thread (g, tq) receives in register m rows 2 tq and 2 tq + 1 of it at column g (low
// half first). The kernel's dab[jj][m] must then hold channels 8 j + 2 tq + e, j = 2 jj + m / 2,
// at tile row 16 warp + 8 (m % 2) + g: the C fragment's (row, column) of accumulator blocks j (P)
// and j + 8 (G). Each 8-lane phase reads 8 different 16-byte bank groups (no conflicts).
TEST(TrimulSm90Layout, GatesDabFragmentsAreTheAccumulatorsLayout) {
  for (int warp = 0; warp < 4; ++warp)
    for (int jj = 0; jj < 4; ++jj) {
      uint32_t addr[32];
      for (int lane = 0; lane < 32; ++lane) {
        addr[lane] = dab_ldsm_offset(warp, lane, jj);
        EXPECT_EQ(addr[lane] % 16, 0u);
      }
      for (int m = 0; m < 4; ++m) {
        std::set<uint32_t> groups;
        for (int rr = 0; rr < 8; ++rr) groups.insert((addr[8 * m + rr] / 16) % 8);
        EXPECT_EQ(groups.size(), 8u) << "bank conflict, warp " << warp << " jj " << jj;
      }
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, tq = lane % 4;
        for (int m = 0; m < 4; ++m)
          for (int e = 0; e < 2; ++e) {
            const uint32_t got = addr[8 * m + 2 * tq + e] + 2 * g;
            const int j = 2 * jj + m / 2, row = 16 * warp + 8 * (m % 2) + g;
            EXPECT_EQ(got, dab_offset(8 * j + 2 * tq + e, row));
          }
      }
    }
}

// A tile row r is in row half r / 32 of the mma.sync kernel's sums, and the Hopper kernel's warp
// r / 16 sums it: half h = warps 2 h, 2 h + 1.
TEST(TrimulSm90Layout, GatesRowHalvesAreWarpPairs) {
  for (int r = 0; r < kRows; ++r) EXPECT_EQ((r / 16) / 2, r / 32);
}

// One CTA grid of the Hopper gates kernel over `tiles` tiles with G virtual CTAs: every tile once;
// each consumer's x and dA | dB ring uses with phases 0, 1, 0, ... per stage; and the kernel's
// pairing of units (a unit closes its virtual CTA when the consumer holds the partner's sums,
// else it is held; at the end the split virtual CTA of an odd count is closed across the
// consumers) writes partial row v once, as part 0 + part 1, each part the tiles v + m G of the
// mma.sync kernel's CTA v in increasing m. Returns each row's (part 0 tiles, part 1 tiles).
using RowParts = std::map<int64_t, std::pair<std::vector<int64_t>, std::vector<int64_t>>>;
template <int kD>
RowParts simulate_gates(int64_t grid, int64_t G, int64_t tiles) {
  using L = GatesLayout<kD>;
  RowParts rows;
  std::vector<int> count(size_t(tiles), 0);
  for (int64_t cta = 0; cta < grid; ++cta) {
    std::vector<int64_t> held_v(kConsumers, -1);
    std::vector<std::vector<int64_t>> held(kConsumers);
    const int64_t units = units_of(cta, grid, G);
    for (int c = 0; c < kConsumers; ++c) {
      int64_t xn = 0, dn = 0;
      std::vector<int> x_uses(L::kXStages, 0), dab_uses(L::kDabStages, 0);
      for (int64_t k = 0; k < units; ++k) {
        const Unit u = unit_of(cta, grid, G, tiles, c, k);
        EXPECT_EQ(u.v % grid, cta);
        EXPECT_LT(u.v, G);
        std::vector<int64_t> unit_tiles;
        for (int64_t m = 0; m < u.count; ++m, ++xn) {
          const int64_t t = u.v + (u.first + m) * G;
          EXPECT_LT(t, tiles);
          ++count[size_t(t)];
          unit_tiles.push_back(t);
          const Use x = use_of(xn, L::kXStages);
          EXPECT_EQ(x.parity, x_uses[size_t(x.stage)]++ & 1);
          for (int q = 0; q < L::kChunks; ++q, ++dn) {
            const Use d = use_of(dn, L::kDabStages);
            EXPECT_EQ(d.parity, dab_uses[size_t(d.stage)]++ & 1);
          }
        }
        if (held_v[size_t(c)] == u.v) {
          EXPECT_EQ(rows.count(u.v), 0u) << "row " << u.v << " written twice";
          auto& r = rows[u.v];
          (u.part == 0 ? r.first : r.second) = unit_tiles;
          (u.part == 0 ? r.second : r.first) = held[size_t(c)];
          held_v[size_t(c)] = -1;
        } else {
          held_v[size_t(c)] = u.v;
          held[size_t(c)] = unit_tiles;
        }
      }
    }
    if (split_unit(cta, grid, G)) {
      EXPECT_EQ(held_v[0], held_v[1]);
      EXPECT_GE(held_v[0], 0);
      EXPECT_EQ(rows.count(held_v[0]), 0u);
      rows[held_v[0]] = {held[0], held[1]};
    } else {
      EXPECT_EQ(held_v[0], -1);
      EXPECT_EQ(held_v[1], -1);
    }
  }
  for (int64_t t = 0; t < tiles; ++t) EXPECT_EQ(count[size_t(t)], 1) << "tile " << t;
  EXPECT_EQ(int64_t(rows.size()), G);
  for (const auto& [v, parts] : rows) {
    std::vector<int64_t> all = parts.first;
    all.insert(all.end(), parts.second.begin(), parts.second.end());
    std::vector<int64_t> want;
    for (int64_t t = v; t < tiles; t += G) want.push_back(t);  // the mma.sync kernel's CTA v
    EXPECT_EQ(all, want) << "row " << v;
    EXPECT_EQ(parts.first.size(), (want.size() + 1) / 2);
  }
  return rows;
}

TEST(TrimulSm90Layout, GatesUnitsCoverEveryTileAndRowOnceWhateverTheSmCount) {
  for (int64_t tiles : {1, 2, 3, 7, 131, 132, 133, 395, 396, 397, 1000, 9216}) {
    const int64_t G = std::min<int64_t>(tiles, kSplitBackwardCtas);
    RowParts first;
    for (int64_t sms : {1, 2, 3, 78, 114, 132}) {
      const int64_t grid = std::min(G, sms);
      const RowParts rows = simulate_gates<128>(grid, G, tiles);
      simulate_gates<64>(grid, G, tiles);
      // The same parts (so the same sums, bit for bit) on every device.
      if (first.empty())
        first = rows;
      else
        EXPECT_EQ(rows, first) << "tiles " << tiles << ", " << sms << " SMs";
    }
  }
}

template <int kD>
void check_dx_layout() {
  using L = DxLayout<kD>;
  EXPECT_LE(L::kBytes, uint32_t(kSmemLimit));
  EXPECT_EQ(L::kStagesPerTile * L::kStageK, 5 * kD);
  EXPECT_GE(L::kStages, 2);
  EXPECT_EQ(L::kABytes, uint32_t(kRows * L::kStageK * 2));
  EXPECT_EQ(L::kWBytes, uint32_t(L::kStageK * kD * 2));
  EXPECT_EQ(L::kStaging, L::kStages * L::kStageBytes);
  EXPECT_EQ(L::kHeld, L::kStaging + L::kStagingBytes);
  EXPECT_EQ(L::kConsumerBytes, L::kHeld + L::kHeldBytes);
  EXPECT_GE(L::kBytes, kConsumers * L::kConsumerBytes + 127);  // the base aligned up to 128
  // Core matrices (and so descriptor start addresses) on 128 bytes in every stage of every
  // consumer; staging rows on 16 bytes (float2 stores, row r at r * kLdC floats).
  EXPECT_EQ(L::kABytes % 128, 0u);
  EXPECT_EQ(L::kStageBytes % 128, 0u);
  EXPECT_EQ(L::kConsumerBytes % 128, 0u);
  EXPECT_EQ((L::kLdC * 4) % 16, 0);
  EXPECT_GE(L::kLdC, kD);
  EXPECT_EQ(L::kStagingBytes, uint32_t(kRows * L::kLdC * 4));
  EXPECT_EQ(L::kHeldBytes, uint32_t(kWarps * kD * 4));
  EXPECT_EQ(L::kThreads, 128 * kConsumers);
}

TEST(TrimulSm90Layout, DxSharedMemoryFitsOneCta) {
  check_dx_layout<64>();
  check_dx_layout<128>();
}

// The core-matrix layout of a 64-row tile: a bijection onto [0, 64 cols); 8 rows of 16 bytes are
// 128 contiguous bytes; 8 rows further is 128 bytes (desc_k_major's SBO, desc_mn_major's LBO), 8
// columns further is 1024 bytes (the other offset); the kernel's k step ks of A starts at column
// 16 ks (offset ks * 2 * 64 * 8), of B at row 16 ks (offset ks * 16 * 8), its N half h of B at
// column 64 h (offset h * 8 * 64 * 8).
TEST(TrimulSm90Layout, DxCoreMatrixLayoutIsTheDescriptors) {
  for (int cols : {64, 128}) {
    std::set<int> seen;
    for (int r = 0; r < 64; ++r)
      for (int c = 0; c < cols; ++c) {
        const int o = core_offset(64, r, c);
        ASSERT_TRUE(seen.insert(o).second);
        ASSERT_LT(o, 64 * cols);
        // Within a core matrix: 8 contiguous elements per row, rows 16 bytes apart.
        EXPECT_EQ(o, core_offset(64, r - r % 8, c - c % 8) + 8 * (r % 8) + c % 8);
        if (r + 8 < 64) {
          EXPECT_EQ(2 * (core_offset(64, r + 8, c) - o), 128);
        }
        if (c + 8 < cols) {
          EXPECT_EQ(2 * (core_offset(64, r, c + 8) - o), 1024);
        }
      }
  }
  for (int ks = 0; ks < 4; ++ks) {
    EXPECT_EQ(core_offset(64, 0, 16 * ks), ks * 2 * 64 * 8);
    EXPECT_EQ(core_offset(64, 16 * ks, 0), ks * 16 * 8);
  }
  EXPECT_EQ(core_offset(64, 0, 64), 8 * 64 * 8);
}

// Every k of the K = 5D GEMM once, its dpg column and its w_in row of the same thing (pack.cu's
// w_in: per a/b block q, P rows of channels 64 q.. then their G rows; then Wg_out): dP of channel
// ch with Wp_in's row ch, dG with Wg_in's, dgo column n with Wg_out's row n.
template <int kD>
void check_dx_stages() {
  constexpr int kChunks = 2 * kD / kChunkChannels;
  std::set<int> cols, rows;
  for (int st = 0; st < DxLayout<kD>::kStagesPerTile; ++st) {
    const DxStage s = dx_stage<kD>(st);
    for (int kk = 0; kk < DxLayout<kD>::kStageK; ++kk) {
      const int col = s.col0 + kk, row = s.wrow + kk;
      ASSERT_TRUE(cols.insert(col).second);
      ASSERT_TRUE(rows.insert(row).second);
      ASSERT_LT(col, 5 * kD);
      ASSERT_LT(row, kChunks * kChunkN + kD);
      // What the dpg column holds: kind 0 dP, 1 dG, 2 dgo; and its channel.
      const int kind = col < 2 * kD ? 0 : col < 4 * kD ? 1 : 2, ch = col - kind * 2 * kD;
      if (kind < 2) {
        EXPECT_EQ(row / kChunkN, ch / kChunkChannels);  // block of the channel
        EXPECT_EQ(row % kChunkN, kind * kChunkChannels + ch % kChunkChannels);
      } else {
        EXPECT_EQ(row, kChunks * kChunkN + ch);
      }
    }
  }
  EXPECT_EQ(int(cols.size()), 5 * kD);
}

TEST(TrimulSm90Layout, DxStagesPairEachDpgColumnWithItsWeightRow) {
  check_dx_stages<64>();
  check_dx_stages<128>();
}

// The copy cursor visits exactly the consumer's (tile, stage) sequence of the main loop (units in
// order, their tiles, every stage), with empty units skipped, and is invalid after it.
TEST(TrimulSm90Layout, DxCopyCursorFollowsTheConsumersStages) {
  constexpr int kPer = DxLayout<128>::kStagesPerTile;
  for (int64_t tiles : {1, 2, 3, 131, 133, 397, 1000}) {
    const int64_t G = std::min<int64_t>(tiles, kSplitBackwardCtas);
    for (int64_t sms : {1, 3, 132}) {
      const int64_t grid = std::min(G, sms);
      for (int64_t cta = 0; cta < grid; ++cta)
        for (int c = 0; c < kConsumers; ++c) {
          StageCursor cur(cta, grid, G, tiles, c, kPer);
          for (int64_t k = 0; k < units_of(cta, grid, G); ++k) {
            const Unit u = unit_of(cta, grid, G, tiles, c, k);
            for (int64_t m = 0; m < u.count; ++m)
              for (int st = 0; st < kPer; ++st) {
                ASSERT_TRUE(cur.valid());
                EXPECT_EQ(cur.tile(), u.v + (u.first + m) * G);
                EXPECT_EQ(cur.st, st);
                cur.next();
              }
          }
          EXPECT_FALSE(cur.valid());
        }
    }
  }
}

// The row pass: warp w of a consumer takes rows w + 4 (i0 + i) (i0 in steps of 4, i < 4) and sums
// them into virtual warp w + 4 (i % 2), which must be the mma.sync kernel's warp of the row
// (r % kWarps); each row once, each virtual warp's rows in increasing order.
TEST(TrimulSm90Layout, DxRowPassSumsTheMmaSyncWarpsRows) {
  std::vector<int> seen(kRows, 0);
  for (int warp = 0; warp < 4; ++warp) {
    int last[2] = {-1, -1};
    for (int i0 = 0; i0 < kRows / 4; i0 += 4)
      for (int i = 0; i < 4; ++i) {
        const int r = warp + 4 * (i0 + i);
        ASSERT_LT(r, kRows);
        ++seen[size_t(r)];
        EXPECT_EQ(warp + 4 * (i % 2), r % kWarps);
        EXPECT_GT(r, last[i % 2]);
        last[i % 2] = r;
      }
  }
  for (int r = 0; r < kRows; ++r) EXPECT_EQ(seen[size_t(r)], 1);
}

}  // namespace
}  // namespace tpf::cuda::trimul::sm90
