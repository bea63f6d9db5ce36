// The Hopper backward (backward_sm90.cu): its TMA maps and its workspace, shared by the host
// launcher, the workspace query and the kernel; its tile sizes are backward_sm90_tiles.h, the order
// of its CTAs backward_sm90_schedule.h. Host and device code; nothing here launches
// anything.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "kernels/attention/backward_sm90_schedule.h"
#include "kernels/attention/backward_sm90_tiles.h"
#include "kernels/attention/params.h"

namespace tpf::cuda {

// fp32 dQ accumulators are bounded to this many bytes; the slices run in chunks that fit (one
// kernel launch each). 128 MiB is three chunks at S = 768, D = 32, which keeps the peak memory of
// forward + backward under cuEquivariance's.
constexpr int64_t kSm90DqBudgetBytes = 128LL << 20;
// The most CTAs of one launch (grid dimension x).
constexpr int64_t kSm90MaxCtas = 2147483647;

// ---- TMA ---------------------------------------------------------------------------------------------
// q, k, v and dO as 5-d TMA maps (tma.cuh) with a box of 64 rows x 8 features: one column block
// of the no-swizzle core-matrix layout that the wgmma descriptors read (64 rows of 16 bytes), so
// a 64-row tile of D features is D / 8 boxes. Features past the tensors' D and rows past S read
// as zero. Built by the launcher; a __grid_constant__ kernel argument.
// A 16-bit bias [B, H, Sq, Sk] likewise, as a 4-d map with a box of 64 queries x 64 keys,
// 128-byte swizzled (each consumer warpgroup reads its 64 keys with ldmatrix).
struct Sm90BackwardMaps {
  CUtensorMap q, k, v, dout, bias;
  uint32_t q_dims, k_dims, v_dims, dout_dims, bias_dims;
};

// ---- workspace --------------------------------------------------------------------------------------
// delta and lse2 (lse log2(e)) [B][N][H][Sq_pad] (Sq_pad: whole 64-query tiles; past Sq: 0 and
// +inf), each query tile's 64 values one bulk copy; dq_acc [chunk slices][B][H][Sq_pad][D] (each
// 64 x D query tile in the consumers' staging order, stage_offset); dbias_acc [lanes][B][H][key
// block][query tile][key block's keys][64 queries] (the consumers' dS^T tiles in their staging
// order; lanes: backward_sm90_tiles.h); the semaphores, zeroed at each call: dq_sem
// [groups][B][H][T], dbias_sem [lanes][B][H][T][J];
// where a 16-bit bias's rows are not TMA-ready (Sk not a multiple of 8, say), bias_copy: the bias
// [B][H][Sq][Sk8] with Sk8 = Sk rounded up to 8.
struct Sm90BackwardWorkspace {
  int chunk;        // slices per launch, a multiple of kSlices
  int dbias_lanes;  // sm90_backward_dbias_lanes
  // Byte offsets and sizes; sem is dq_sem's, dbias_sem follows it, sem_bytes covers both.
  size_t delta, lse2, dq_acc, dbias_acc, sem, dbias_sem, sem_bytes, bias_copy, total;
};
inline int64_t sm90_backward_bias_pitch(int64_t Sk) { return (Sk + 7) / 8 * 8; }
inline Sm90BackwardWorkspace sm90_backward_workspace(int64_t B, int64_t N, int64_t H, int64_t Sq,
                                                     int64_t Sk, int64_t head_dim, bool f32_bias,
                                                     bool bias_copy) {
  auto align = [](size_t x) { return (x + 255) / 256 * 256; };
  const int64_t D = sm90_backward_head_dim(head_dim);
  const int64_t A = sm90_backward_slices(D, f32_bias);
  const int key_block = sm90_backward_key_block(head_dim);
  const Sm90BackwardGrid grid = sm90_backward_grid(int(N), int(Sq), int(Sk), int(A), key_block);
  const int64_t sq_pad = int64_t(grid.query_tiles) * kTileQ,
                sk_pad = int64_t(grid.key_blocks) * key_block;
  const int64_t per_slice = B * H * sq_pad * D * int64_t(sizeof(float));
  // TPF_ATTENTION_DQ_BUDGET_BYTES lowers the budget (tests use it to force many chunks).
  int64_t budget = kSm90DqBudgetBytes;
  if (const char* env = std::getenv("TPF_ATTENTION_DQ_BUDGET_BYTES")) budget = std::atoll(env);
  int64_t most = std::max<int64_t>(A, budget / std::max<int64_t>(per_slice, 1) / A * A);
  // A launch is at most kSm90MaxCtas CTAs (grid x): chunks of whole groups fit, since one group's
  // B H J CTAs do (src/ops bounds B H and Sk, api.h).
  most = std::min(most, std::max<int64_t>(1, kSm90MaxCtas / (B * H * grid.key_blocks)) * A);
  const int64_t n_pad = grid.groups * A;
  const int64_t chunks = (n_pad + most - 1) / most;
  const int64_t chunk = ((n_pad + chunks - 1) / chunks + A - 1) / A * A;  // balanced chunks
  const size_t rows = size_t(B * N * H * sq_pad) * sizeof(float);
  Sm90BackwardWorkspace w;
  w.chunk = int(chunk);
  w.delta = 0;
  w.lse2 = align(w.delta + rows);
  w.dq_acc = align(w.lse2 + rows);
  const int64_t lane_floats = B * H * sk_pad * sq_pad;
  w.dbias_lanes = sm90_backward_dbias_lanes(grid.groups, B * H * grid.key_blocks,
                                            lane_floats * int64_t(sizeof(float)));
  w.dbias_acc = align(w.dq_acc + size_t(chunk * per_slice));
  w.sem = align(w.dbias_acc + size_t(w.dbias_lanes * lane_floats) * sizeof(float));
  w.dbias_sem = w.sem + size_t(int64_t(grid.groups) * B * H * grid.query_tiles) * sizeof(int);
  w.sem_bytes = (w.dbias_sem - w.sem) +
                size_t(w.dbias_lanes * B * H * grid.query_tiles * grid.key_blocks) * sizeof(int);
  w.bias_copy = align(w.sem + w.sem_bytes);
  w.total =
      align(w.bias_copy + (bias_copy ? size_t(B * H * Sq * sm90_backward_bias_pitch(Sk)) * 2 : 0));
  return w;
}

// The launcher (backward_sm90.cu). T: __nv_bfloat16 or __half; p.head_dim: api.h's
// attention_head_dim_supported;
// w: the workspace p's pointers were laid out by (sm90_backward_workspace, the one layout per
// call); f32_bias: the bias (and dbias) is float32, else T.
template <typename T>
void attention_backward_sm90_launch(const AttentionBackwardParams& p,
                                    const Sm90BackwardWorkspace& w, bool f32_bias,
                                    cudaStream_t stream);

}  // namespace tpf::cuda
