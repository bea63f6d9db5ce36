// Layout of the attention backward's workspace: computed the same way by the size query and by
// the launcher, so the caller's allocation always fits.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

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

// TPF_ATTENTION_BWD_DQ=cluster: the lean backward sums dQ over the key tiles of a slice inside a
// thread-block cluster (distributed shared memory, rank order) instead of writing one partial per
// key tile for attention_dq_reduce_kernel. Read at each call, like TPF_ATTENTION_BWD_LEAN; only
// where the lean backward runs (head dims 16 and 32), else today's path.
inline bool backward_dq_cluster(int head_dim) {
  const char* env = std::getenv("TPF_ATTENTION_BWD_DQ");
  return env != nullptr && std::strcmp(env, "cluster") == 0 && backward_lean(head_dim);
}

// The clusters over the key tiles of a slice: `parts` clusters of `size` CTAs each (the grid's key
// tiles padded to parts x size; the padding CTAs have no keys). Each cluster leaves one dQ: the
// final dQ when parts == 1, else one of `parts` partials summed in order by the reduce kernel.
// Clusters of up to kDqClusterMax CTAs (portable); TPF_ATTENTION_DQ_CLUSTER_MAX up to 16 allows
// larger, non-portable ones (S = 768: 12 key tiles in one cluster instead of two of 6).
struct DqClusters {
  int size, parts;
};
inline DqClusters dq_clusters(int64_t key_tiles) {
  int most = kDqClusterMax;
  if (const char* env = std::getenv("TPF_ATTENTION_DQ_CLUSTER_MAX")) most = std::atoi(env);
  most = std::min(16, std::max(1, most));
  const int64_t parts = (key_tiles + most - 1) / most;
  return {int((key_tiles + parts - 1) / parts), int(parts)};
}

inline int backward_slices_per_block(int head_dim) {
  if (backward_lean(head_dim))
    return head_dim == 16 ? BackwardTiles<16, true>::kSlices : BackwardTiles<32, true>::kSlices;
  return head_dim == 16   ? BackwardTiles<16>::kSlices
         : head_dim == 32 ? BackwardTiles<32>::kSlices
                          : BackwardTiles<64>::kSlices;
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
  // The same chunks with the cluster dQ (so that it changes nothing else), but dQ partials only
  // when the key tiles need more than one cluster: parts instead of key_tiles per slice.
  const int64_t dq_slots =
      backward_dq_cluster(int(D))
          ? (dq_clusters(key_tiles).parts > 1 ? dq_clusters(key_tiles).parts : 0)
          : key_tiles;
  BackwardWorkspaceLayout w;
  w.chunk = int(chunk);
  w.delta = 0;
  w.dq_partial = align(w.delta + size_t(B * N * H * Sq) * sizeof(float));
  w.dbias_partial = align(w.dq_partial + size_t(dq_slots * chunk * B * H * Sq * D) * sizeof(float));
  w.dbias_acc = align(w.dbias_partial + size_t(groups * B * H * Sq * Sk) * sizeof(float));
  w.total = align(w.dbias_acc + size_t(B * H * Sq * Sk) * sizeof(float));
  return w;
}

}  // namespace tpf::cuda
