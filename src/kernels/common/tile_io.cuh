// Global -> shared tile copies (attention's tiles, trimul's split input backward).
#pragma once
#include <cstdint>

#include "kernels/common/mma.cuh"
#include "kernels/common/shared_layout.h"

namespace tpf::cuda {

// Copies a ROWS x COLS tile whose origin is `g` (row stride `stride` elements, feature stride 1)
// into shared memory `s` laid out [ROWS][COLS + kPad]. Rows >= valid_rows and columns >= valid_cols
// become zero, so padded keys and queries contribute nothing. `aligned`: every row starts on a
// 16-byte boundary, so 16-byte cp.async copies are used (the caller waits for them); otherwise a
// scalar path. `safe` is any readable address of the tensor, handed to copies that read nothing.
// CORE: the shared layout is instead wgmma's no-swizzle "core matrix" layout, [COLS / 8][ROWS][8]
// with no padding: each 8-row x 16-byte core matrix is 128 contiguous bytes, core matrices 128 bytes
// apart along the rows and ROWS * 16 bytes apart along the columns (the descriptor strides in
// wgmma.cuh); consecutive threads copy consecutive 16-byte chunks of one column block.
template <typename T, int ROWS, int COLS, int THREADS, bool CORE = false>
__device__ __forceinline__ void load_tile(T* s, const T* g, int64_t stride, int valid_rows,
                                          int valid_cols, bool aligned, const T* safe) {
  static_assert(COLS % 8 == 0, "tiles are whole 16-byte chunks wide");
  constexpr int LD = COLS + kPad;
  constexpr int CHUNKS = COLS / 8;
  auto at = [](int r, int c) { return CORE ? ((c / 8) * ROWS + r) * 8 + c % 8 : r * LD + c; };
  if (aligned) {
#pragma unroll 4
    for (int i = threadIdx.x; i < ROWS * CHUNKS; i += THREADS) {
      const int r = CORE ? i % ROWS : i / CHUNKS, c = (CORE ? i / ROWS : i % CHUNKS) * 8;
      int bytes = r < valid_rows ? (valid_cols - c) * 2 : 0;
      bytes = bytes < 0 ? 0 : (bytes > 16 ? 16 : bytes);
      cp_async_16(s + at(r, c), bytes > 0 ? g + r * stride + c : safe, bytes);
    }
  } else {
    for (int i = threadIdx.x; i < ROWS * COLS; i += THREADS) {
      const int r = i / COLS, c = i % COLS;
      s[at(r, c)] = (r < valid_rows && c < valid_cols) ? g[r * stride + c] : from_float<T>(0.f);
    }
  }
}

}  // namespace tpf::cuda
