// Which work a CTA of the Hopper forward does: G slices (n0 .. n0 + G - 1) of one head (b, h) for
// one 128-query block. Slice groups are the fastest grid index, so that the CTAs running together
// read the same bias blocks (shared by all slices of a head) from L2.
#pragma once
#include "kernels/attention/forward_sm90_params.h"

namespace tpf::cuda::fwd90 {

struct Tile {
  int b, h, q_block, n0;
};

template <int G>
__device__ __forceinline__ Tile tile_of_cta(const Params& p) {
  Tile t;
  t.n0 = blockIdx.x * G;
  t.q_block = blockIdx.y;
  t.b = blockIdx.z / p.fwd.H;
  t.h = blockIdx.z % p.fwd.H;
  return t;
}

inline dim3 grid_of(const Params& p) { return dim3(p.slice_groups, p.q_blocks, p.fwd.B * p.fwd.H); }

}  // namespace tpf::cuda::fwd90
