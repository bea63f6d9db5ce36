// Tile sizes of the triangle multiplicative update kernels, with the reason for each.
#pragma once

namespace tpf::cuda::trimul {

// 8 warps: a 2 x 4 grid of 32 x 32 warp tiles covers one 64 x 128 block of a GEMM.
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Positions per tile, along j within one (b, i): the GEMMs' M. 64 keeps a tile's channel-major
// accesses (a, b, z, dz, dA, dB) at 128 contiguous bytes per channel for 16-bit types.
constexpr int kRows = 64;
// Output columns per GEMM step: the width of the 2 x 4 warp grid.
constexpr int kChunkN = 128;
// a/b channels per input-side step: their P and G halves fill one kChunkN-wide step, so the gate
// and the value of a channel meet in the same epilogue.
constexpr int kChunkChannels = kChunkN / 2;
// The largest D: one kChunkN step covers every output-side GEMM and the input side's dx_ln.
constexpr int kMaxD = 128;
constexpr int kMaxInputChunks = 2 * kMaxD / kChunkChannels;
// Shared-memory row padding in elements: rows stay 16-byte aligned and consecutive rows start on
// different banks.
constexpr int kPad = 8;
constexpr int kLdC = kChunkN + 4;  // fp32 staging rows (a multiple of 4 floats: 16-byte aligned)
// The same staging stored transposed (column n at n * kLdCT): for epilogues that write
// channel-major outputs, a warp then reads 32 consecutive rows of one column, conflict-free.
constexpr int kLdCT = kRows + 4;
// 16-bit staging rows of kChunkN values (the 16-bit kernels' epilogues from the MMA registers).
constexpr int kLdSt = kChunkN + kPad;
// fp32 staging large enough for either layout.
constexpr int kStagingFloats = kRows * kLdC > kChunkN* kLdCT ? kRows* kLdC : kChunkN* kLdCT;
// CTAs per SM that the kernels are bounded for (__launch_bounds__): the 16-bit types' kernels and
// the float32 ones.
constexpr int k16BitCtas = 3;
constexpr int kF32Ctas = 2;
// Persistent CTAs of the float32 backward kernels (two per SM on a 132-SM H100/H200). A constant,
// not the device's SM count: the order of the bias and LayerNorm gradient sums follows from it.
constexpr int kBackwardCtas = 264;
// Persistent CTAs of the 16-bit types' two input_backward kernels (three per SM), and the most
// that the input side's partial sums are sized for.
constexpr int kSplitBackwardCtas = 396;
constexpr int kMaxInputBackwardCtas =
    kSplitBackwardCtas > kBackwardCtas ? kSplitBackwardCtas : kBackwardCtas;
// Persistent CTAs of the 16-bit types' output_backward (three per SM), and the most that the
// output side's partial sums are sized for.
constexpr int k16BitOutputBackwardCtas = 396;
constexpr int kMaxOutputBackwardCtas =
    k16BitOutputBackwardCtas > kBackwardCtas ? k16BitOutputBackwardCtas : kBackwardCtas;

// The tile passes' trip counts at the largest D (device.cuh): rows per warp and row elements per
// lane in row passes, elements per thread in channel-major passes.
constexpr int kRowsPerWarp = kRows / kWarps;
constexpr int kPerLane = kMaxD / 32;
constexpr int kTileElemsPerThread = kMaxD * kRows / kThreads;

static_assert(kRows % kWarps == 0 && kMaxD % 32 == 0 && (kMaxD * kRows) % kThreads == 0,
              "the tile passes divide evenly among the threads");
static_assert(kThreads % kRows == 0, "a thread keeps one row in channel-major passes");
static_assert(kRows == 2 * 32 && kChunkN == 4 * 32, "the 2 x 4 grid of 32 x 32 warp tiles");
static_assert(kMaxD <= kChunkN, "output-side GEMMs and dx_ln are one kChunkN step");

}  // namespace tpf::cuda::trimul
