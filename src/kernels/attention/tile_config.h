// Tile sizes of the attention kernels, in one place, with the reason for each.
#pragma once

namespace tpf::cuda {

// 64 queries x 64 keys per tile: four warps of 16 rows each cover a query tile with m16n8k16 MMAs;
// 64 keys keep the score tile (32 fp32 registers per thread) and the bias tile (8 KB) small enough
// for several blocks per SM, and make the padded shared-memory rows conflict-free for ldmatrix.
constexpr int kTileQ = 64;
constexpr int kTileK = 64;
constexpr int kWarpRows = 16;  // rows of one warp's MMA tile
constexpr int kForwardWarps = kTileQ / kWarpRows;
constexpr int kPad = 8;  // elements (16 bytes) of padding per shared-memory row

// Forward: each of a block's four warps owns MT row tiles of 16 queries. Measured on an H200 with
// MT = 1: sharing bias tiles between slices (two or four slices per block) was slower than one
// slice per block at S = 768 (D = 32: 2.95 / 3.21 / 4.55 ms): the bias reads hit L2, and fewer,
// larger blocks wait longer at their barriers. TPF_ATTENTION_FWD_ROW_TILES=2 selects MT = 2.
constexpr int kForwardRowTiles = 1;

// Backward: two groups of four warps ("quads"); each quad owns the 64-key tile in kSlicesPerQuad
// slices, keeping their dK and dV in registers (D fp32 registers per slice per thread, so at most
// 64 registers). The block's 2 * kSlicesPerQuad slices share one bias tile and sum their dbias on
// chip, which divides the dbias partials written to memory by that many.
// Lean (the default at head dims 16 and 32; TPF_ATTENTION_BWD_LEAN=0 selects the other): one slice
// per quad and dS summed for dbias in shared memory instead of 32 registers, so two blocks (16
// warps) fit per SM where the other runs one (8 warps at ~250 registers, latency-bound). It writes
// 2x (D = 32) or 4x (D = 16) more dbias partials and still wins: on the H200, main kernel at S=768
// 11.0 -> 7.2 ms (D = 32) and 8.1 -> 5.2 ms (D = 16), forward+backward 16.4 -> 12.9 and
// 11.5 -> 9.1 ms. D = 64 keeps one slice per quad with dK/dV (64 registers) too large for two blocks.
template <int D, bool Lean = false>
struct BackwardTiles {
  static_assert(D == 16 || D == 32 || D == 64, "head dims 16, 32 and 64 are supported");
  static_assert(!Lean || D <= 32, "the lean backward is for head dims 16 and 32");
  static constexpr int kSlicesPerQuad = Lean ? 1 : D == 16 ? 4 : D == 32 ? 2 : 1;
  static constexpr int kSlices = 2 * kSlicesPerQuad;  // G: slices per thread block
  static constexpr int kWarps = 8;
  static constexpr int kMinBlocksPerSm = Lean ? 2 : 1;
};

// dQ partials are bounded to this many bytes; the slices run in chunks that fit.
constexpr long long kDqPartialBudgetBytes = 256LL << 20;

// TPF_ATTENTION_BWD_DQ=cluster (backward_workspace.h): the largest portable thread-block cluster.
constexpr int kDqClusterMax = 8;

}  // namespace tpf::cuda
