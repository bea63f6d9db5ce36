// Layout of the attention backward's workspace: computed the same way by the size query and by
// the launcher, so the caller's allocation always fits.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "kernels/attention/tile_config.h"

namespace tpf::cuda {

struct BackwardWorkspaceLayout {
  int chunk;  // slices per chunk, a multiple of G (the slices per thread block)
  size_t delta, dq_partial, dbias_partial, dbias_acc;  // byte offsets
  size_t total;
};

// The lean backward (tile_config.h) at head dims 16 and 32, unless TPF_ATTENTION_BWD_LEAN=0.
inline bool backward_lean(int head_dim) {
  const char* env = std::getenv("TPF_ATTENTION_BWD_LEAN");
  return head_dim <= 32 && !(env != nullptr && env[0] == '0');
}

inline int backward_slices_per_block(int head_dim) {
  if (backward_lean(head_dim))
    return head_dim == 16 ? BackwardTiles<16, true>::kSlices : BackwardTiles<32, true>::kSlices;
  return head_dim == 16 ? BackwardTiles<16>::kSlices
                        : head_dim == 32 ? BackwardTiles<32>::kSlices : BackwardTiles<64>::kSlices;
}

inline BackwardWorkspaceLayout backward_workspace_layout(int64_t B, int64_t N, int64_t H,
                                                         int64_t Sq, int64_t Sk, int64_t D) {
  auto align = [](size_t x) { return (x + 255) / 256 * 256; };
  const int64_t G = backward_slices_per_block(int(D));
  const int64_t key_tiles = (Sk + kTileK - 1) / kTileK;
  const int64_t per_slice = key_tiles * B * H * Sq * D * int64_t(sizeof(float));
  // TPF_ATTENTION_DQ_BUDGET_BYTES lowers the budget (tests use it to force many chunks).
  int64_t budget = kDqPartialBudgetBytes;
  if (const char* env = std::getenv("TPF_ATTENTION_DQ_BUDGET_BYTES")) budget = std::atoll(env);
  int64_t chunk = std::max<int64_t>(1, budget / std::max<int64_t>(per_slice, 1));
  chunk = std::min(chunk, N);
  chunk = std::max<int64_t>(G, chunk / G * G);
  const int64_t groups = (chunk + G - 1) / G;
  BackwardWorkspaceLayout w;
  w.chunk = int(chunk);
  w.delta = 0;
  w.dq_partial = align(w.delta + size_t(B * N * H * Sq) * sizeof(float));
  w.dbias_partial = align(w.dq_partial + size_t(key_tiles * chunk * B * H * Sq * D) * sizeof(float));
  w.dbias_acc = align(w.dbias_partial + size_t(groups * B * H * Sq * Sk) * sizeof(float));
  w.total = align(w.dbias_acc + size_t(B * H * Sq * Sk) * sizeof(float));
  return w;
}

}  // namespace tpf::cuda
