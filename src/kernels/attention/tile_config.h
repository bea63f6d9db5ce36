// Tile sizes of the attention kernels, in one place, with the reason for each.
#pragma once

#include "kernels/common/shared_layout.h"

namespace tpf::cuda {

// The backward's query tile: 64 queries (wgmma's M), walked by each CTA's key block
// (backward_sm90.h); the validation bounds the number of these tiles (api.h).
constexpr int kTileQ = 64;
constexpr int kWarpRows = 16;  // rows of one warp's MMA tile

}  // namespace tpf::cuda
