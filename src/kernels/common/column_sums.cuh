// Deterministic column sums of per-block partials: the last step of the backward kernels that
// reduce weight or bias gradients without atomics (trimul's reduce_sums, the fused LayerNorm's
// finish).
#pragma once

#include <cstdint>

namespace tpf::cuda {

// Threads per block of ordered_column_sum: kColumnSumCols columns x kColumnSumRowGroups row groups.
constexpr int kColumnSumCols = 32, kColumnSumRowGroups = 32;

// Sums columns c0 + threadIdx.x (< cols) of the row-major float matrix m [rows, ld] in double, in
// a fixed order: thread (x, y) adds rows y, y + kColumnSumRowGroups, ... in that order (unrolled,
// so that its loads are in flight together), then thread (x, 0) adds the kColumnSumRowGroups sums
// in order y = 0, 1, ... The result does not depend on timing: bitwise the same from call to call.
// (One thread walking all of a column's rows was latency-bound: ~0.1-0.2 ms for 1000-2000 rows.)
// Every thread of the block (kColumnSumCols, kColumnSumRowGroups) must call it: it has a barrier.
// Returns true, with `sum` set, on the threads (x, 0) whose column exists.
__device__ __forceinline__ bool ordered_column_sum(const float* __restrict__ m, int64_t rows,
                                                   int64_t ld, int cols, int c0, double& sum) {
  __shared__ double part[kColumnSumRowGroups][kColumnSumCols];
  const int c = c0 + int(threadIdx.x);
  double acc = 0.0;
  if (c < cols) {
    const float* col = m + c;
#pragma unroll 8
    for (int64_t r = threadIdx.y; r < rows; r += kColumnSumRowGroups) acc += double(col[r * ld]);
  }
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y != 0 || c >= cols) return false;
  double total = 0.0;
#pragma unroll
  for (int y = 0; y < kColumnSumRowGroups; ++y) total += part[y][threadIdx.x];
  sum = total;
  return true;
}

}  // namespace tpf::cuda
