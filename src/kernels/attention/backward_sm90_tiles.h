// The tile table of the Hopper backward (backward_sm90.cu): every tile size, thread role and
// register budget, with the reason for each, in one place. Pure numbers, host and device alike (no
// CUDA types), so that src/ops' validation (api.h), the workspace and the kernels read the same.
#pragma once
#include <cstdint>

namespace tpf::cuda {

// The query tile: 64 queries (wgmma's N for S^T = K Q^T), walked by each CTA's key block; the
// validation bounds the number of these tiles (api.h).
constexpr int kTileQ = 64;
constexpr int kWarpRows = 16;  // rows of one warp's MMA tile

// A CTA is one producer warpgroup and two consumer warpgroups. It owns a block of 128 keys (64 per
// consumer warpgroup: wgmma's M for S^T = K Q^T) in kSlices consecutive slices and walks every
// 64-query tile. For each (query tile, slice) a consumer recomputes P^T and dS^T once and uses them
// for dV, dK (kept in registers over the query tiles: D fp32 registers per slice per thread), its
// dQ partial and the dbias tile summed over the CTA's slices. The dbias sum moves one tile per
// slice group, so its traffic is 1 / kSlices of a slice per slice (3.5 GB of bulk reduce-adds at
// D = 32, S = 768 with 2 slices, more than the dQ sum's 1.8 GB). kSlices: D = 16: 4 (dK/dV 64
// registers), 32: 3 (96), 64: 1; at D = 32 a float32 bias's elements, loaded into registers (32
// per tile), leave room for 2 only (3 spilled ~120 bytes). With 3 slices the consumers take 240
// registers (224 spilled ~190 bytes), the producer 24 (Sm90BackwardConfig).
constexpr int kBwdKeysPerWarpgroup = 64;
constexpr int kBwdKeyBlock = 2 * kBwdKeysPerWarpgroup;
constexpr int kBwdThreads = 384;
// setmaxnreg moves registers within the CTA's pool, the launch's kBwdThreads x kBwdLaunchRegisters
// (__launch_bounds__(kBwdThreads, 1): 65536 / 384 rounded down to 8): a setmaxnreg.inc beyond the
// pool waits forever (32 + 2 x 240 = 512 per lane of a warpgroup, past the pool's 504, hung every
// launch on an H100, 2026-12-07). Producer / consumer registers per configuration:
// Sm90BackwardConfig.
constexpr int kBwdLaunchRegisters = 65536 / kBwdThreads / 8 * 8;
constexpr bool sm90_backward_registers_fit(int producer, int consumer) {
  return producer + 2 * consumer <= 3 * kBwdLaunchRegisters && producer % 8 == 0 &&
         consumer % 8 == 0 && producer >= 24 && consumer <= 256;
}
// The producer warpgroup's roles: warp 0 loads (its lanes read the key flags, thread 0 issues every
// TMA copy), warp 1 (kBwdDqWriters) adds the dQ partials, the rest the dbias tiles: one thread
// each, by TMA bulk copies (warp 3 idles).
constexpr int kBwdLoadThreads = 32;
constexpr int kBwdDqWriters = 1;
constexpr int kBwdDbiasWriters = 2;
static_assert(1 + kBwdDqWriters + kBwdDbiasWriters == 4, "the producer warpgroup has four warps");
// attention_dq_finish_kernel: threads per CTA (one CTA per 64 x D query tile of a slice).
constexpr int kBwdDqFinishThreads = 128;

// Every head dim that is a multiple of 8 up to 128 (api.h) runs as the next built one (16, 32, 64,
// 128): the tiles of Q, K, V and dO are zero past the tensors' D (their products and sums are
// exact), and only the tensors' D columns of dQ, dK and dV are stored. D = 8, 24, 40, 48, 56 pay
// 100% / 33% / 60% / 33% / 14% more MMA work than an exact fit would, D = 72 .. 120 78% .. 7%.
constexpr int sm90_backward_head_dim(int64_t D) {
  return D <= 16 ? 16 : D <= 32 ? 32 : D <= 64 ? 64 : 128;
}
// Slices per CTA at head dim D with a 16-bit (f32_bias false) or float32 bias (see above).
constexpr int sm90_backward_slices(int64_t D, bool f32_bias) {
  const int d = sm90_backward_head_dim(D);
  return d == 16 ? 4 : d == 32 ? (f32_bias ? 2 : 3) : 1;
}
// At D = 128 the two consumer warpgroups split D instead of the keys: dK and dV of 64 keys x 128
// fp32 (128 registers) and a 64 x 128 dQ stage per warpgroup do not fit. Both warpgroups take the
// same 64 keys and compute S^T and dP^T over the whole D (the same P^T and dS^T; the two products
// twice, +40% MMA work in all), each owning 64 columns of dK, dV and dQ (as many registers as at
// D = 64); warpgroup 0 stages dbias. A CTA's key block is then 64 keys.
constexpr bool sm90_backward_split_d(int64_t D) { return sm90_backward_head_dim(D) == 128; }
constexpr int sm90_backward_key_block(int64_t D) {
  return sm90_backward_split_d(D) ? kBwdKeysPerWarpgroup : kBwdKeyBlock;
}

template <int D, bool kF32Bias>
struct Sm90BackwardConfig {
  static_assert(D == 16 || D == 32 || D == 64 || D == 128,
                "the Hopper backward is built for D = 16, 32, 64, 128");
  static constexpr int kSlices = sm90_backward_slices(D, kF32Bias);
  // 3 slices (D = 32, 16-bit bias) need the consumers' 240 registers, which leave the producer 24
  // (its loops spill a few bytes there); the other configurations keep 56 / 224, spill-free.
  static constexpr int kProducerRegisters = kSlices == 3 ? 24 : 56;
  static constexpr int kConsumerRegisters = kSlices == 3 ? 240 : 224;
  static_assert(sm90_backward_registers_fit(kProducerRegisters, kConsumerRegisters),
                "setmaxnreg within the CTA's register pool");
  static constexpr bool kSplitD = sm90_backward_split_d(D);
  static constexpr int kKeyTiles = kSplitD ? 1 : 2;  // 64-key tiles per CTA (and per slice)
  static constexpr int kKeyBlock = sm90_backward_key_block(D);
  static constexpr int kCols = kSplitD ? D / 2 : D;  // columns of dK, dV per warpgroup
  // dQ = dS K of a query tile over the CTA's whole key block: warpgroup w computes its half of the
  // columns, w D / 2 .. (w + 1) D / 2 - 1, from both warpgroups' dS (so the CTA's dQ partial is
  // summed inside the MMA, and the writers stage one partial, not two to add).
  static constexpr int kDqCols = D / 2;
  // Staged dQ partials (64 queries x D fp32 per stage, half per warpgroup): two let the consumers
  // run a slice ahead of the dQ writer; D = 128 has shared memory for one.
  static constexpr int kDqStages = D <= 64 ? 2 : 1;
};

// The float offset of (row, col) in a staged tile [rows][COLS] (a warpgroup's dQ half, COLS = DQC;
// its dbias^T, COLS = 64 queries): the 16-byte chunks XOR-swizzled by row so that the consumers'
// float2 stores (8 rows x 4 lanes) are free of bank conflicts. The accumulators in global memory
// keep the same order (the writers copy stage and tile as bytes). A CPU test checks both
// (tests/cpp/test_attention_schedule.cpp).
template <int COLS>
constexpr int stage_offset(int row, int col) {
  constexpr int chunks = COLS / 4;                             // per row: 2, 4, 8 or 16
  constexpr int rows_per_line = chunks >= 8 ? 1 : 8 / chunks;  // rows in 128 bytes
  const int swizzle = (2 * ((row / rows_per_line) & 3)) & (chunks - 1);
  return row * COLS + (((col >> 2) ^ swizzle) << 2) + (col & 3);
}

// dbias^T is summed over the slice groups g in kBwdDbiasLanes-many lanes: lane l holds the sum over
// g = l, l + L, l + 2L, ... in that order (its own turns), and the finish kernel adds the L lanes
// in order: a fixed order, so dbias is bitwise repeatable. One lane (a single chain g = 0, 1, ...)
// made each co-resident group wait for the one before it on every query tile, the last of a wave
// starting as many turns late as the wave has groups (the dQ chain's skew, notes-attention). With
// L at least the groups that are resident together (kBwdResidentCtas CTAs, of J B H each), a
// group's turn comes from a group that left before it started. Capped by kBwdDbiasLanes and by
// the workspace budget (a lane is B H Sk_pad Sq_pad floats). The budget is small on purpose: at
// 96 MiB (9a23a91) seven more lanes of 9.4 MB at D = 32, S = 768 add 66 MB to the 0.836 GiB peak
// measured before the lanes (H100), ~0.898 against cuEquivariance's 0.897 (the H200 run printed
// both as 0.90: an estimate, not a measured miss), and five lanes at D = 128, S = 768 slowed that
// backward by 4 % (H200; the L2 holds ~50 MB). 16 MiB gives S <= 384 its lanes (7 at S = 384,
// B H = 4) and larger S fewer, down to one.
constexpr int kBwdDbiasLanes = 16;
constexpr int64_t kBwdResidentCtas = 132;  // H100 and H200 SXM: 132 SMs x 1 backward CTA
constexpr int64_t kBwdDbiasBudgetBytes = 16LL << 20;
constexpr int sm90_backward_dbias_lanes(int64_t groups, int64_t ctas_per_group,
                                        int64_t lane_bytes) {
  int64_t lanes = (kBwdResidentCtas + ctas_per_group - 1) / ctas_per_group + 2;
  const int64_t fit = kBwdDbiasBudgetBytes / (lane_bytes > 0 ? lane_bytes : 1);
  lanes = lanes < fit ? lanes : fit;
  lanes = lanes < kBwdDbiasLanes ? lanes : kBwdDbiasLanes;
  lanes = lanes < groups ? lanes : groups;
  return int(lanes < 1 ? 1 : lanes);
}

// The dbias finish kernel (backward_sm90_epilogue.cuh): 32 x 32 tiles of dbias transposed through
// shared memory by 32 x 8 threads, one CTA per tile (grid: query tiles, key tiles, B * H).
constexpr int kBwdFinishTile = 32;
constexpr int kBwdFinishRows = 8;

}  // namespace tpf::cuda
