// The order of the Hopper backward's CTAs (backward_sm90.cu), which the cross-CTA sums of dQ and
// dbias rely on. Pure integer arithmetic, host and device alike (no CUDA types), so that a CPU test
// (tests/cpp/test_attention_schedule.cpp) checks what the semaphores need: every CTA once, and
// every CTA a writer waits for numbered lower.
#pragma once
#include "kernels/attention/backward_sm90_tiles.h"

#if defined(__CUDACC__)
#define TPF_HOST_DEVICE __host__ __device__
#else
#define TPF_HOST_DEVICE
#endif

namespace tpf::cuda {

// ---- scheduler --------------------------------------------------------------------------------------
// One CTA per (slice group g, b, h, key block jb). dQ of a (slice, query tile) sums over the key
// blocks of its slice group in the order jb = 0, 1, ..., dbias of a (query tile, key block) over the
// slice groups in the order g = 0, 1, ...: each writer waits for the CTA before it in its order
// (semaphores, backward_sm90_epilogue.cuh). The numbering keeps both orders increasing (a CTA only
// waits for lower-numbered ones) and puts the CTA a writer waits for far enough back that it has
// usually passed that tile already: the groups go in blocks of kBwdGroupBlock, numbered
// (group block, jb, group in block, b, h) from the slowest, so the previous key block of a slice
// group is kBwdGroupBlock * B * H CTAs back and the previous slice group at least B * H.
// Numbered with jb fastest (before 2026-12-07), the key blocks of a group started together and
// each waited a writer's round trip for the one before it: blocks of 2 groups measured 5-9% faster
// (H100; 1, 2 and 4 tried: notes-attention's designs table).
constexpr int kBwdGroupBlock = 2;
struct Sm90BackwardGrid {
  int query_tiles, key_blocks;  // T, J
  int groups;                   // slice groups in all, ceil(N / kSlices)
};
TPF_HOST_DEVICE inline Sm90BackwardGrid sm90_backward_grid(int N, int Sq, int Sk, int slices,
                                                           int key_block) {
  return {(Sq + kTileQ - 1) / kTileQ, (Sk + key_block - 1) / key_block, (N + slices - 1) / slices};
}
struct Sm90BackwardBlock {
  int g, b, h, jb;  // g counts slice groups from the first slice (all chunks)
};
// CTA `block` of a launch over `groups` slice groups from `group_begin`.
TPF_HOST_DEVICE inline Sm90BackwardBlock sm90_backward_block(int block, int group_begin, int groups,
                                                             int B, int H, int J) {
  const int BH = B * H, per_block = kBwdGroupBlock * J * BH;
  const int g_hi = block / per_block;
  int rest = block % per_block;
  const int left = groups - g_hi * kBwdGroupBlock;
  const int in_block = left < kBwdGroupBlock ? left : kBwdGroupBlock;
  Sm90BackwardBlock c;
  c.jb = rest / (in_block * BH);
  rest %= in_block * BH;
  c.g = group_begin + g_hi * kBwdGroupBlock + rest / BH;
  rest %= BH;
  c.b = rest / H;
  c.h = rest % H;
  return c;
}

}  // namespace tpf::cuda
