// The Hopper gates kernel's layout (input_backward_split.cu, input_backward_gates_sm90_kernel):
// its shared memory, its dA | dB staging (TMA's 128-byte swizzle, read by ldmatrix.trans), and
// how a persistent CTA's two consumer warpgroups share out the tiles so that the bias partial sums
// keep the mma.sync gates kernel's layout. Pure integer arithmetic, host and device alike, checked
// by tests/cpp/test_trimul_sm90_layout.cpp; the swizzle, the consumer count and the tile counts
// are input_forward_sm90.h's.
//
// Partial sums. The mma.sync kernel runs G = Params::grid_input_backward CTAs; CTA v takes tiles
// v, v + G, ... and writes row 2 v + h of partials_bias_in [2 G][4D] (h: rows [32 h, 32 h + 32)
// of every tile; columns dP sums of channels 0..2D-1, then dG sums). Here those G "virtual CTAs"
// stay: virtual CTA v's tiles split into two parts (the first ceil(n / 2) of its n tiles, then the
// rest), a part is one unit of work, and row 2 v + h = part 0's sum + part 1's, each part summed
// tile after tile in its order. Which consumer of which CTA takes a unit changes nothing in the
// bits: the sums depend on G alone, as the mma.sync kernel's do, not on the device's SM count.
// CTA b of `grid` takes the virtual CTAs v = b, b + grid, ... (nv of them, 2 nv units, unit
// u = 2 i + part for its i-th virtual CTA); consumer 0 takes units 0 .. nv - 1 in increasing
// order, consumer 1 units 2 nv - 1 down to nv. A unit's partner (the other part of its virtual
// CTA) is then the same consumer's unit just before it, or just after it, except where nv is odd:
// virtual CTA (nv - 1) / 2 is split between the consumers, part 0 consumer 0's last unit and
// part 1 consumer 1's last; the two are added after both consumers are done.
#pragma once
#include <cstdint>

#include "kernels/trimul/input_forward_sm90.h"

namespace tpf::cuda::trimul::sm90 {

template <int kD>
struct GatesLayout {
  static_assert(kD == 64 || kD == 128, "the Hopper gates kernel's D");
  static constexpr int kChunks = 2 * kD / kChunkChannels;  // a/b steps (weight blocks)
  static constexpr int kKHalves = kD / kAtomCols;
  // Per consumer: x stages (one tile each) and dA | dB stages (one step each: the 64 channels of
  // the step, [channel][64 positions], 8 KiB). At D = 128 the 128 KiB of weights leave room for
  // one x stage per consumer (the other consumer's tile covers the reload).
  static constexpr int kXStages = kD == 128 ? 1 : 2;
  static constexpr int kDabStages = kD == 128 ? 2 : 4;
  static constexpr uint32_t kWBlockBytes = uint32_t(kChunkN) * kD * 2;
  static constexpr uint32_t kWBytes = kChunks * kWBlockBytes;
  static constexpr uint32_t kXBytes = uint32_t(kRows) * kD * 2;
  static constexpr uint32_t kDabBytes = uint32_t(kChunkChannels) * kRows * 2;
  // The bias sums of the unit in progress, per consumer and warp ([4 warps][4D] floats: warp w's
  // rows 16 w .. 16 w + 15 of each tile, summed over the unit's tiles), and the per-consumer
  // sums of a finished unit whose partner is still to come ([2 halves][4D]).
  static constexpr int kSumCols = 4 * kD;
  static constexpr uint32_t kRunBytes = 4u * kSumCols * 4;
  static constexpr uint32_t kHeldBytes = 2u * kSumCols * 4;
  // Offsets from the 1024-byte aligned base; consumer c's stages at kX + c * kXStages * kXBytes,
  // kDab + c * kDabStages * kDabBytes.
  static constexpr uint32_t kW = 0;
  static constexpr uint32_t kX = kW + kWBytes;
  static constexpr uint32_t kDab = kX + kConsumers * kXStages * kXBytes;
  static constexpr uint32_t kRun = kDab + kConsumers * kDabStages * kDabBytes;
  static constexpr uint32_t kHeld = kRun + kConsumers * kRunBytes;
  static constexpr uint32_t kBiasIn = kHeld + kConsumers * kHeldBytes;  // [4D] floats
  static constexpr uint32_t kBars = kBiasIn + 4 * kD * 4;
  // Barriers: the weights' one, then per consumer x full[kXStages], x empty[kXStages], dab
  // full[kDabStages], dab empty[kDabStages].
  static constexpr int kBarsPerConsumer = 2 * (kXStages + kDabStages);
  static constexpr int kBarCount = 1 + kConsumers * kBarsPerConsumer;
  static constexpr uint32_t kEnd = kBars + kBarCount * 8;
  static constexpr uint32_t kBytes = kEnd + 1024;  // the base is aligned up to 1024 in the kernel
  static_assert(kBytes <= uint32_t(kSmemLimit), "fits one CTA per SM");
  static_assert(kX % 1024 == 0 && kDab % 1024 == 0 && kXBytes % 1024 == 0 &&
                    kDabBytes % 1024 == 0 && kWBlockBytes % 1024 == 0,
                "swizzled blocks on 1024 bytes");

  // Barrier indices (into the kBarCount barriers at kBars).
  static constexpr int x_full(int c, int s) { return 1 + c * kBarsPerConsumer + s; }
  static constexpr int x_empty(int c, int s) { return x_full(c, kXStages) + s; }
  static constexpr int dab_full(int c, int s) { return x_full(c, 2 * kXStages) + s; }
  static constexpr int dab_empty(int c, int s) { return dab_full(c, kDabStages) + s; }
};

// The byte offset in a dA | dB stage of channel `ch` (0..63 of the step), position r (0..63):
// TMA's box {64 positions, 64 channels} of the channel-major tensor, a 128-byte row per channel,
// swizzled as every 1024-byte aligned box of 128-byte rows.
TPF_TRIMUL_HD constexpr uint32_t dab_offset(int ch, int r) { return sw128_offset(kRows, ch, r); }

// The ldmatrix.x4.trans row address (byte offset in the stage) of `lane` for the thread's dA | dB
// of accumulator blocks j = 2 jj, 2 jj + 1 (channels 8 j ..) of warp `warp`'s rows: matrix
// m = lane / 8 is (j = 2 jj + m / 2, rows 16 warp + 8 (m % 2) ..), the lane's row of it channel
// 8 j + lane % 8. Register m then holds, in the C fragment's layout, channels 8 j + 2 tq, + 1 at
// row 16 warp + 8 (m % 2) + g.
TPF_TRIMUL_HD constexpr uint32_t dab_ldsm_offset(int warp, int lane, int jj) {
  return dab_offset(8 * (2 * jj + (lane / 8) / 2) + lane % 8, 16 * warp + 8 * ((lane / 8) % 2));
}

// A virtual CTA's tiles in two parts: tiles v + m G for m in [part_first, part_first + count).
TPF_TRIMUL_HD constexpr int64_t part_first(int64_t n, int part) { return part ? (n + 1) / 2 : 0; }
TPF_TRIMUL_HD constexpr int64_t part_count(int64_t n, int part) {
  return part ? n / 2 : (n + 1) / 2;
}

// Unit k of consumer c of CTA cta (of grid CTAs, G virtual CTAs, `tiles` tiles): virtual CTA v,
// its part, and that part's tiles v + (first + m) G, m < count.
struct Unit {
  int64_t v;
  int part;
  int64_t first, count;
};
// Units per consumer: both consumers take the CTA's nv virtual CTAs' worth.
TPF_TRIMUL_HD constexpr int64_t units_of(int64_t cta, int64_t grid, int64_t G) {
  return tiles_of(cta, grid, G);
}
TPF_TRIMUL_HD constexpr Unit unit_of(int64_t cta, int64_t grid, int64_t G, int64_t tiles, int c,
                                     int64_t k) {
  const int64_t nv = units_of(cta, grid, G);
  const int64_t u = c == 0 ? k : 2 * nv - 1 - k;
  const int64_t v = cta + (u / 2) * grid;
  const int part = int(u % 2);
  const int64_t n = tiles_of(v, G, tiles);
  return {v, part, part_first(n, part), part_count(n, part)};
}
// Whether the CTA's consumers end with the two halves of one virtual CTA (nv odd): its row is
// written after both are done.
TPF_TRIMUL_HD constexpr bool split_unit(int64_t cta, int64_t grid, int64_t G) {
  return units_of(cta, grid, G) % 2 == 1;
}

// A consumer's ring use n (its n-th tile's x, or its n-th step's dA | dB): stage n % stages, the
// parity of that stage's phase. Each consumer has rings of its own (no stage passes between
// consumers, so a wait never meets a phase of the other consumer's order).
struct Use {
  int stage, parity;
};
TPF_TRIMUL_HD constexpr Use use_of(int64_t n, int stages) {
  return {int(n % stages), int((n / stages) & 1)};
}

// ---- The Hopper dx kernel (input_backward_dx_sm90_kernel): dx_ln = [dP | dG | dgo] W_in as one
// K = 5D GEMM per tile (wgmma; A = kRows x 64 columns of dpg, B = the matching 64 rows of w_in,
// MN-major), then the LayerNorm backward, dx and the d norm_in_weight partial sums. CTAs of
// kConsumers warpgroups, no producer: each consumer copies its own stages (cp.async, wgmma's
// no-swizzle core-matrix layout, the attention kernels' MN-major B path) kStages - 1 ahead, across
// its tiles; units and partial rows as the gates kernel's (virtual CTA v's row kWarps v + w is its
// rows r % kWarps == w, summed part 0 + part 1).
template <int kD>
struct DxLayout {
  static_assert(kD == 64 || kD == 128, "the Hopper dx kernel's D");
  static constexpr int kThreads = 128 * kConsumers;
  static constexpr int kStageK = 64;  // k per stage
  static constexpr int kStagesPerTile = 5 * kD / kStageK;
  static constexpr int kStages = kD == 128 ? 3 : 4;  // copies in flight per consumer: kStages - 1
  static constexpr uint32_t kABytes = uint32_t(kRows) * kStageK * 2;  // [kStageK / 8][kRows][8]
  static constexpr uint32_t kWBytes = uint32_t(kStageK) * kD * 2;     // [kD / 8][kStageK][8]
  static constexpr uint32_t kStageBytes = kABytes + kWBytes;
  static constexpr int kLdC = kD + 4;  // fp32 staging rows of dx_ln (16-byte aligned)
  static constexpr uint32_t kStagingBytes = uint32_t(kRows) * kLdC * 4;
  static constexpr uint32_t kHeldBytes = uint32_t(kWarps) * kD * 4;  // [virtual warp][kD]
  static constexpr uint32_t kConsumerBytes = kStages * kStageBytes + kStagingBytes + kHeldBytes;
  // Consumer c's region at c * kConsumerBytes: its stages, then its staging, then its held sums.
  static constexpr uint32_t kStaging = kStages * kStageBytes;
  static constexpr uint32_t kHeld = kStaging + kStagingBytes;
  static constexpr uint32_t kBytes = kConsumers * kConsumerBytes + 128;  // aligned up to 128
  static_assert(kBytes <= uint32_t(kSmemLimit), "fits one CTA per SM");
  static_assert(kStageBytes % 128 == 0 && kStagingBytes % 16 == 0 && kConsumerBytes % 128 == 0,
                "core matrices on 128 bytes, staging rows on 16");
};

// Element offset of (r, c) in a [rows][cols] tile stored in wgmma's no-swizzle core-matrix layout
// [cols / 8][rows][8] (load_tile's CORE layout, wgmma.cuh's descriptors: 8 rows further = 128
// bytes, 8 columns further = rows * 16 bytes).
TPF_TRIMUL_HD constexpr int core_offset(int rows, int r, int c) {
  return ((c / 8) * rows + r) * 8 + c % 8;
}

// Stage st (0 .. 5 kD / 64 - 1) of a tile's dx GEMM: the first dpg column and the first w_in row
// of its 64 k, in the mma.sync dx kernel's order (load_dx_stage): per a/b step q, its dP columns
// (w_in block q's P rows) then its dG columns (the block's G rows), then dgo (the Wg_out rows).
struct DxStage {
  int col0, wrow;
};
template <int kD>
TPF_TRIMUL_HD constexpr DxStage dx_stage(int st) {
  constexpr int kChunks = 2 * kD / kChunkChannels;
  if (st < 2 * kChunks) {
    const int q = st / 2, part = st % 2;
    return {part * 2 * kD + q * kChunkChannels, q * kChunkN + part * kChunkChannels};
  }
  const int k0 = (st - 2 * kChunks) * kChunkChannels;
  return {4 * kD + k0, kChunks * kChunkN + k0};
}

// A consumer's stages in order, across its units and tiles (empty units skipped): unit k, tile m
// of it, stage st; `valid` false past the last. The copies run kStages - 1 stages ahead of the
// GEMM with a second cursor.
struct StageCursor {
  int64_t cta, grid, G, tiles;
  int c;
  int64_t units, k = 0, m = 0;
  int st = 0, stages_per_tile;
  Unit u{};  // unit k's
  TPF_TRIMUL_HD constexpr StageCursor(int64_t cta_, int64_t grid_, int64_t G_, int64_t tiles_,
                                      int c_, int stages_per_tile_)
      : cta(cta_),
        grid(grid_),
        G(G_),
        tiles(tiles_),
        c(c_),
        units(units_of(cta_, grid_, G_)),
        stages_per_tile(stages_per_tile_) {
    if (units > 0) u = unit_of(cta, grid, G, tiles, c, 0);
    skip_empty();
  }
  TPF_TRIMUL_HD constexpr bool valid() const { return k < units; }
  TPF_TRIMUL_HD constexpr int64_t tile() const { return u.v + (u.first + m) * G; }
  TPF_TRIMUL_HD constexpr void next() {
    if (++st < stages_per_tile) return;
    st = 0;
    ++m;
    skip_empty();
  }
  TPF_TRIMUL_HD constexpr void skip_empty() {
    while (k < units && m >= u.count) {
      m = 0;
      if (++k < units) u = unit_of(cta, grid, G, tiles, c, k);
    }
  }
};

}  // namespace tpf::cuda::trimul::sm90
