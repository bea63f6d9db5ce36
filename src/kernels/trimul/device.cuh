// Device building blocks of the triangle multiplicative update kernels: element conversions,
// asynchronous copies, the warp-level GEMM on shared-memory tiles, tile coordinates and LayerNorm
// statistics of one row.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/common/mma.cuh"
#include "kernels/trimul/params.h"
#include "kernels/trimul/tiles.h"

namespace tpf::cuda::trimul {

// kernels/common/convert.cuh's conversions, under this family's short names.
template <typename T>
__device__ __forceinline__ float to_f(T v) {
  return to_float(v);
}
template <typename T>
__device__ __forceinline__ T from_f(float v) {
  return from_float<T>(v);
}

// Two adjacent 16-bit values, each rounded as from_f, in one 32-bit store (dst 4-byte aligned).
template <typename T>
__device__ __forceinline__ void store_pair(T* dst, float a, float b) {
  static_assert(sizeof(T) == 2, "16-bit types");
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(a, b);
  else
    *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(a, b);
}

__device__ __forceinline__ float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

// The same through the approximate exponential and division (MUFU.EX2, MUFU.RCP: a few
// instructions, no slow path), for results that are rounded to 16 bits anyway (the 16-bit types'
// kernels; float32's keep sigmoid above): relative error ~1e-6 against bf16's 4e-3 and fp16's
// 5e-4. For v < -87, expf(-v) is inf and the result 0.
__device__ __forceinline__ float sigmoid_fast(float v) {
  return __fdividef(1.0f, 1.0f + __expf(-v));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ---- Asynchronous global -> shared copies (16 bytes each, sm_80+).

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
// 4 bytes, or zeros where !valid (gmem is then not read but must be a valid address).
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem),
               "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

struct SameRow {
  __device__ int operator()(int r) const { return r; }
};

// Starts copying rows x cols elements (cols * sizeof(T) a multiple of 16) from a row-major global
// matrix with row stride ld_g into shared memory with row stride ld_s; source row r lands in row
// row_map(r). The block waits with cp_async_wait_all() then __syncthreads().
template <typename T, typename RowMap = SameRow>
__device__ __forceinline__ void copy_tile_async(T* dst, int ld_s, const T* src, int64_t ld_g,
                                                int rows, int cols, RowMap row_map = {}) {
  constexpr int kPer = 16 / sizeof(T);
  const int pieces = cols / kPer;
  for (int idx = threadIdx.x; idx < rows * pieces; idx += kThreads) {
    const int r = idx / pieces, c = (idx % pieces) * kPer;
    cp_async16(dst + row_map(r) * ld_s + c, src + r * ld_g + c);
  }
  cp_async_commit();
}

// The same with the tile's shape known at compile time (static D): an unrolled loop of
// kTileRows * kCols / (8 kThreads) copies per thread, the thread's index read anew at each call
// (thread_index_here, below), so that its addresses are not hoisted out of the callers' tile
// loops and spilled under the 80-register bound.
__device__ __forceinline__ unsigned thread_index_here();
template <int kTileRows, int kCols, typename T, typename RowMap = SameRow>
__device__ __forceinline__ void copy_tile_async_static(T* dst, int ld_s, const T* src, int64_t ld_g,
                                                       RowMap row_map = {}) {
  constexpr int kPer = 16 / sizeof(T), kPieces = kCols / kPer, kTotal = kTileRows * kPieces;
  static_assert(kCols % kPer == 0 && kTotal % kThreads == 0, "whole copies per thread");
#pragma unroll
  for (int k = 0; k < kTotal / kThreads; ++k) {
    const unsigned idx = thread_index_here() % kThreads + k * kThreads;
    const int r = int(idx / kPieces), c = int(idx % kPieces) * kPer;
    cp_async16(dst + row_map(r) * ld_s + c, src + r * ld_g + c);
  }
  cp_async_commit();
}

// Starts copying `rows` rows of a packed weight ([rows, Dp], row stride Dp) into shared memory
// (row stride Dp + kPad), source row r to row row_map(r): static D (kD > 0) copies the
// compile-time shape kWRows x kD (rows must equal kWRows), run-time D copy_tile_async's loop.
template <int kD, int kWRows, typename T, typename RowMap = SameRow>
__device__ __forceinline__ void copy_weight_async(T* dst, const T* src, int Dp, int rows,
                                                  RowMap row_map = {}) {
  if constexpr (kD > 0)
    copy_tile_async_static<kWRows, kD>(dst, kD + kPad, src, kD, row_map);
  else
    copy_tile_async(dst, Dp + kPad, src, Dp, rows, Dp, row_map);
}

// Packed row pr of an a/b block of w_in (P of channels 0..63, then G of the same channels) to its
// row in shared memory: the 16 P rows of channels 16u..16u+15, then their 16 G rows, for u = 0..3.
// A warp's two 16-column halves of a WarpTileLdsm product are then P and G of the same channels
// (the 16-bit kernels' epilogues from the MMA registers).
struct InterleavePG {
  __device__ int operator()(int pr) const {
    const int g = pr / kChunkChannels, cl = pr % kChunkChannels;
    return (cl / 16) * 32 + g * 16 + cl % 16;
  }
};

// threadIdx.x read anew at each call (volatile: not hoisted out of loops), for addresses that are
// cheaper to recompute from it than to keep: under the 16-bit kernels' 80-register bound, ptxas
// otherwise hoists them out of the step loops and spills them (bench/notes-trimul.md).
// Unsigned, so that divisions by powers of two stay shifts.
__device__ __forceinline__ unsigned thread_index_here() {
  unsigned t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
}

// Writes a tile of 16-bit values staged in shared memory (row-major, row stride ld_s, a multiple
// of 8 elements) to global memory: staged row rr, columns [0, cols), goes to row_ptr(rr)[0, cols)
// (rows with a null row_ptr are skipped). Consecutive threads take consecutive 16-byte pieces of a
// row; a piece is one vector store where its destination is 16-byte aligned and whole, scalar
// stores otherwise (odd D or S). kMaxRows x kMaxCols bounds the tile (compile time: unrolled).
// kTidHere: the thread's pieces from thread_index_here() (80-register kernels). kWhole: the
// caller knows that the store is whole (every row [0, kMaxRows) non-null and stored in full,
// cols = kMaxCols, every row 16-byte aligned: a full tile of a static-D kernel), so every piece is
// one vector store with no predicate. kAligned: every non-null row is 16-byte aligned and cols a
// multiple of 8 (row-major rows of static D), so a stored piece is one vector store.
template <int kMaxRows, int kMaxCols, bool kTidHere = false, bool kWhole = false,
          bool kAligned = kWhole, typename T, typename RowPtr>
__device__ __forceinline__ void store_staged_rows(const T* st, int ld_s, int cols, RowPtr row_ptr) {
  static_assert(sizeof(T) == 2, "16-bit staging");
  constexpr int kVec = 8, kPieces = kMaxCols / kVec, kTotal = kMaxRows * kPieces;
  static_assert(kMaxCols % kVec == 0 && kTotal % kThreads == 0, "whole pieces per thread");
#pragma unroll
  for (int it = 0; it < kTotal / kThreads; ++it) {
    const int tid = kTidHere ? int(thread_index_here() % kThreads) : int(threadIdx.x);
    const int idx = tid + it * kThreads;
    const int rr = idx / kPieces, c = (idx % kPieces) * kVec;
    T* dst = row_ptr(rr);
    if (!kWhole && (dst == nullptr || c >= cols)) continue;
    const uint4 v = *reinterpret_cast<const uint4*>(st + rr * ld_s + c);
    if (kAligned || (c + kVec <= cols && reinterpret_cast<uintptr_t>(dst + c) % 16 == 0)) {
      *reinterpret_cast<uint4*>(dst + c) = v;
    } else {
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
      uint16_t* d = reinterpret_cast<uint16_t*>(dst + c);
#pragma unroll
      for (int k = 0; k < kVec; ++k)
        if (c + k < cols) d[k] = uint16_t(w[k / 2] >> (16 * (k % 2)));
    }
  }
}

// A tile's staged rows to global through store_staged_rows: with no per-piece predicates where
// `whole` (static D only: see kWhole; the tile interiors), with them otherwise (tile edges, odd
// shapes, run-time D). row_ptr_whole(rr): row rr's destination, never null; row_ptr(rr): the same
// or null for rows that are not stored. kAlignedRows: static D's row-major rows (16-byte aligned,
// D a multiple of 8) also at the edges (see kAligned).
template <bool kStatic, int kMaxRows, int kMaxCols, bool kTidHere, bool kAlignedRows = false,
          typename T, typename RowPtrWhole, typename RowPtr>
__device__ __forceinline__ void store_staged_tile(bool whole, const T* st, int ld_s, int cols,
                                                  RowPtrWhole row_ptr_whole, RowPtr row_ptr) {
  if constexpr (kStatic) {
    if (whole) {
      store_staged_rows<kMaxRows, kMaxCols, kTidHere, true>(st, ld_s, kMaxCols, row_ptr_whole);
      return;
    }
  }
  store_staged_rows<kMaxRows, kMaxCols, kTidHere, false, kStatic && kAlignedRows>(st, ld_s, cols,
                                                                                  row_ptr);
}

// ---- Warp-level GEMM on shared-memory tiles.
//
// A block computes C[64, N] = A[64, K] * op(W) with N <= kChunkN and K, N multiples of 16; the 8
// warps form a 2 x 4 grid of 32 x 32 warp tiles. A is row-major [64][K] (row stride lda). W is
// either [N][K] (kNK: C = A W^T, nn.Linear's forward) or [K][N] (kKN: C = A W).
// 16-bit types run on tensor cores (WarpTileLdsm); float runs on the CUDA cores (WarpTileF32),
// so float inputs keep IEEE float32 products.

enum class WLayout { kNK, kKN };

// float: each lane owns 8 consecutive columns of one row of every 16 x 16 fragment.
struct WarpTileF32 {
  float acc[2][2][8];

  __device__ void zero() {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[i][j][e] = 0.0f;
  }

  template <WLayout L>
  __device__ void mma(const float* A, int lda, const float* W, int ldw, int K, int N) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int m0 = (warp & 1) * 32, n0 = (warp >> 1) * 32;
    const int row = lane >> 1, col = (lane & 1) * 8;
    if (n0 >= N) return;
    for (int k = 0; k < K; ++k) {
      float a[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) a[i] = A[(m0 + 16 * i + row) * lda + k];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int n = n0 + 16 * j + col;
        if (n0 + 16 * j >= N) break;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float wv = L == WLayout::kNK ? W[(n + e) * ldw + k] : W[k * ldw + n + e];
#pragma unroll
          for (int i = 0; i < 2; ++i) acc[i][j][e] = fmaf(a[i], wv, acc[i][j][e]);
        }
      }
    }
  }

  __device__ void store(float* C, int ldc, int N) const { store_as<false>(C, ldc, N); }
  __device__ void store_col_major(float* C, int ldc, int N) const { store_as<true>(C, ldc, N); }

 private:
  // Row-major C[m][n] (kColMajor: C[n][m]) of the warp's columns below N.
  template <bool kColMajor>
  __device__ void store_as(float* C, int ldc, int N) const {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int m0 = (warp & 1) * 32, n0 = (warp >> 1) * 32;
    const int row = lane >> 1, col = (lane & 1) * 8;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (n0 + 16 * j >= N) break;
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          if constexpr (kColMajor)
            C[(n0 + 16 * j + col + e) * ldc + m0 + 16 * i + row] = acc[i][j][e];
          else
            C[(m0 + 16 * i + row) * ldc + n0 + 16 * j + col + e] = acc[i][j][e];
        }
    }
  }
};

// The same warp tile through mma.sync m16n8k16 with fragments loaded by ldmatrix (16-bit types
// only): per k step of 16 a warp issues 4 LDSM.x4 (two for A's 32 rows, one per 16 columns of W)
// for 8 MMAs, ~23 SASS instructions per k step (WMMA's fragment loads compiled to 16 32-bit
// generic loads and 70-77 instructions: bench/notes-trimul.md). Same
// interface as WarpTileF32. Every shared row address is 16-byte aligned: the row strides
// (Dp + kPad, kLdA) are multiples of 8 elements.
// acc[i][j][h][e]: rows m0 + 16 i + (g | g + 8), columns n0 + 16 j + 8 h + 2 t (+1), with
// g = lane / 4 and t = lane % 4 (the C fragment of mma.cuh).
template <typename T>
struct WarpTileLdsm {
  static_assert(!std::is_same_v<T, float>, "tensor-core types only");
  float acc[2][2][2][4];

  __device__ void zero() { *this = WarpTileLdsm{}; }

  template <WLayout L>
  __device__ void mma(const T* A, int lda, const T* W, int ldw, int K, int N) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int m0 = (warp & 1) * 32, n0 = (warp >> 1) * 32;
    if (n0 >= N) return;              // warp-uniform
    const bool second = n0 + 16 < N;  // warp-uniform: N is a multiple of 16
    // Per-lane row and column offsets of the x4 loads (mma.cuh's load_a and its B analogues for
    // two 8-column blocks at once: matrices 0, 1 = k halves of columns n .. n + 7, 2, 3 = n + 8..).
    const T* a_ptr = A + (m0 + (lane & 7) + ((lane >> 3) & 1) * 8) * lda + (lane >> 4) * 8;
    const T* w_ptr = L == WLayout::kNK
                         ? W + (n0 + (lane & 7) + (lane >> 4) * 8) * ldw + ((lane >> 3) & 1) * 8
                         : W + ((lane & 7) + ((lane >> 3) & 1) * 8) * ldw + n0 + (lane >> 4) * 8;
    const uint32_t a_addr = smem_addr(a_ptr);
    const uint32_t w_addr = smem_addr(w_ptr);
    const uint32_t a_row16 = uint32_t(16 * lda * sizeof(T));
    // Byte step of W per 16 columns (j) and per 16 k.
    const uint32_t w_j = uint32_t((L == WLayout::kNK ? 16 * ldw : 16) * sizeof(T));
    const uint32_t w_k = uint32_t((L == WLayout::kNK ? 16 : 16 * ldw) * sizeof(T));
    for (int k0 = 0; k0 < K; k0 += 16) {
      uint32_t a[2][4], b[2][4];
#pragma unroll
      for (int i = 0; i < 2; ++i) ldsm_x4(a[i], a_addr + i * a_row16 + k0 * sizeof(T));
      const uint32_t wk = w_addr + uint32_t(k0 / 16) * w_k;
      load_w<L>(b[0], wk);
      if (second) load_w<L>(b[1], wk + w_j);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        if (j == 1 && !second) break;
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int h = 0; h < 2; ++h) Mma<T>::run(acc[i][j][h], a[i], &b[j][2 * h]);
      }
    }
  }

  __device__ void store(float* C, int ldc, int N) const { store_as<false>(C, ldc, N); }
  __device__ void store_col_major(float* C, int ldc, int N) const { store_as<true>(C, ldc, N); }

  // Row and column of the warp's element acc[i][j][h][e] (for epilogues from the registers).
  static __device__ __forceinline__ int row(int i, int e) {
    return (threadIdx.x / 32 & 1) * 32 + 16 * i + (threadIdx.x % 32 >> 2) + 8 * (e >> 1);
  }
  static __device__ __forceinline__ int col(int j, int h, int e) {
    return (threadIdx.x / 32 >> 1) * 32 + 16 * j + 8 * h + 2 * (threadIdx.x & 3) + (e & 1);
  }
  // f(i, j, h, e) for the thread's elements acc[i][j][h][e], unrolled; kStepE = 2: for the pairs
  // (e = 0, 2: elements e and e + 1, adjacent columns of one row).
  template <int kStepE = 1, typename F>
  static __device__ __forceinline__ void for_each_element(F&& f) {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 4; e += kStepE) f(i, j, h, e);
  }
  // v[j][h][e] = src[col(j, h, e)] for columns below n, zero past them: per-column values (biases)
  // of the thread's elements, 8 loads.
  static __device__ __forceinline__ void column_values(const float* src, int n,
                                                       float (&v)[2][2][2]) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) v[j][h][e] = col(j, h, e) < n ? src[col(j, h, e)] : 0.0f;
  }

 private:
  // Row-major: two float2 per 8-column block (rows g and g + 8); transposed: element (m, n) at
  // C[n * ldc + m], four scalars (conflict-free: lane (g, t) hits bank 8 t + g for ldc = kLdCT).
  template <bool kTransposed>
  __device__ void store_as(float* C, int ldc, int N) const {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int m0 = (warp & 1) * 32, n0 = (warp >> 1) * 32, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (n0 + 16 * j >= N) break;
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float* v = acc[i][j][h];
          const int m = m0 + 16 * i + g, n = n0 + 16 * j + 8 * h + 2 * t;
          if constexpr (kTransposed) {
            float* c = C + n * ldc + m;
            c[0] = v[0];
            c[ldc] = v[1];
            c[8] = v[2];
            c[ldc + 8] = v[3];
          } else {
            float* c = C + m * ldc + n;
            *reinterpret_cast<float2*>(c) = make_float2(v[0], v[1]);
            *reinterpret_cast<float2*>(c + 8 * ldc) = make_float2(v[2], v[3]);
          }
        }
    }
  }

  static __device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  }
  // W is [N][K] (kNK): rows of 8 k are ldmatrix's rows; [K][N] (kKN): transposed on load.
  template <WLayout L>
  static __device__ __forceinline__ void load_w(uint32_t (&r)[4], uint32_t addr) {
    if constexpr (L == WLayout::kNK)
      ldsm_x4(r, addr);
    else
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                   : "r"(addr));
  }
};

// A step's GEMM: waits for this thread's copies and at the barrier (every thread's copies and
// shared-memory writes), then acc = X W^T (X [kRows, k], W [n, k], both with row stride ld).
template <typename Acc, typename T>
__device__ __forceinline__ void wait_and_multiply(Acc& acc, const T* x, const T* w, int ld, int k,
                                                  int n) {
  cp_async_wait_all();
  __syncthreads();
  acc.zero();
  acc.template mma<WLayout::kNK>(x, ld, w, ld, k, n);
}

// ---- Tiles: kRows consecutive positions j0..j0+n-1 of one (b, i).

struct Tile {
  int64_t b, i, j0, row0;  // row0: index of (b, i, j0) among the B * S * S positions
  int n;                   // valid rows, <= kRows

  __device__ Tile(int64_t t, const Params& p) {
    const int64_t bi = t / p.tiles_per_row;
    b = bi / p.S;
    i = bi % p.S;
    j0 = (t % p.tiles_per_row) * kRows;
    n = int(p.S - j0 < kRows ? p.S - j0 : kRows);
    row0 = bi * p.S + j0;
  }
  // The same tile from its coordinates (j0 a multiple of kRows), computed by the caller (e.g.
  // with 32-bit divisions where the tile count allows).
  __device__ Tile(int64_t b_, int64_t i_, int64_t j0_, const Params& p) : b(b_), i(i_), j0(j0_) {
    n = int(p.S - j0 < kRows ? p.S - j0 : kRows);
    row0 = (b * p.S + i) * p.S + j0;
  }
  // Element offset of (channel c, row r) in a channel-major [B, D, S, S] tensor.
  __device__ int64_t channel_major(const Params& p, int64_t c, int r) const {
    return ((b * p.D + c) * p.S + i) * p.S + j0 + r;
  }
  // The same with D given (a compile-time constant in the kernels for static D).
  __device__ int64_t channel_major(const Params& p, int D, int64_t c, int r) const {
    return ((b * D + c) * p.S + i) * p.S + j0 + r;
  }
};

// Tile t, with 32-bit divisions where the tile count fits (Tile(t, p)'s 64-bit divisions are a
// few hundred instructions per tile). kOnly32: the caller knows that p.tiles <= INT32_MAX (the
// forward kernels' grids; the launchers of the static-D kernels check it), so no 64-bit path is
// compiled.
template <bool kOnly32 = false>
__device__ __forceinline__ Tile tile_at(int64_t t, const Params& p) {
  if (kOnly32 || p.tiles <= INT32_MAX) {
    const unsigned tu = unsigned(t), tpr = unsigned(p.tiles_per_row), S = unsigned(p.S);
    const unsigned bi = tu / tpr, b = bi / S;
    return Tile(b, bi - b * S, int64_t(tu - bi * tpr) * kRows, p);
  }
  return Tile(t, p);
}
// Tile t of a persistent kernel: 32-bit divisions for static D (tile_at<true>: its launchers
// check the tile count), Tile(t, p) as before otherwise.
template <bool kStatic>
__device__ __forceinline__ Tile persistent_tile(int64_t t, const Params& p) {
  if constexpr (kStatic)
    return tile_at<true>(t, p);
  else
    return Tile(t, p);
}

// Loop trip counts of the tile passes at the largest D (tiles.h's kRowsPerWarp, kPerLane,
// kTileElemsPerThread): every pass is fully unrolled with these compile-time counts (elements past
// D or past the tile are predicated off), so that each thread issues all of its global loads before
// it waits for the first one. With the loads in one dependent chain per element instead, a CTA
// keeps only a few hundred bytes in flight and the kernels run at DRAM latency rather than
// bandwidth.

// ---- Channel counts fixed at compile time or read at run time.
//
// The 16-bit kernels are instantiated for kD = 64 and kD = 128 (D known at compile time: loop
// bounds, shared-memory strides and channel predicates fold, the channel-major strides are
// constants times S * S) and for kD = 0 (D from Params: every other D). An instantiation changes
// only index arithmetic, trip counts and predicates, never an arithmetic expression or its
// order, so every instantiation gives the same bits. (Where the compiler could contract a product
// and the sum it feeds into one FMA for static D only, because a select between them folded away
// or a division by D became a multiplication, product<kD> and divide_by_d<kD> below round the
// product on its own, as the run-time kernel does.)
template <int kD>
struct Dims {
  static_assert(kD == 0 || (kD % 32 == 0 && kD <= kMaxD && (2 * kD) % kChunkChannels == 0),
                "static D: a multiple of 32 whose a/b channels fill whole input-side steps");
  static constexpr bool kStatic = kD > 0;
  __device__ __forceinline__ static int D(const Params& p) {
    if constexpr (kStatic)
      return kD;
    else
      return int(p.D);
  }
  // D rounded up to 16 (kD itself), and the row stride of the padded shared-memory operands.
  __device__ __forceinline__ static int Dp(const Params& p) {
    if constexpr (kStatic)
      return kD;
    else
      return p.Dp;
  }
  __device__ __forceinline__ static int ld(const Params& p) { return Dp(p) + kPad; }
  __device__ __forceinline__ static int chunks(const Params& p) {
    if constexpr (kStatic)
      return 2 * kD / kChunkChannels;
    else
      return p.input_chunks;
  }
  // Channel c of the a/b channels [0, 2D) exists (always for static D: whole steps).
  __device__ __forceinline__ static bool ab_channel(int c, int D) {
    if constexpr (kStatic)
      return true;
    else
      return c < 2 * D;
  }
  // Channel c of [0, D) exists.
  __device__ __forceinline__ static bool channel(int c, int D) {
    if constexpr (kStatic)
      return c < kD;
    else
      return c < D;
  }
};

// a * b, rounded on its own (__fmul_rn) for static D (kD > 0): a product that the run-time
// kernel selects against zero (`valid ? a * b : 0.0f`) before adding it into a sum is rounded
// there by itself; where the select folds away, __fmul_rn keeps the compiler from contracting the
// product and the sum into an FMA, so the bits stay those of the run-time kernel. For kD = 0 the
// plain product (the run-time kernel's code as it was).
template <int kD>
__device__ __forceinline__ float product(float a, float b) {
  if constexpr (kD > 0)
    return __fmul_rn(a, b);
  else
    return a * b;
}

// x / D. For static D (a power of two) the exact product x * (1 / kD), rounded on its own
// (__fmul_rn): the same bits as the division (both are x / D correctly rounded), and no FMA may
// take it into the difference that follows (v - mean), which would skip that rounding.
template <int kD>
__device__ __forceinline__ float divide_by_d(float x, int D) {
  if constexpr (kD > 0) {
    static_assert((kD & (kD - 1)) == 0, "1 / kD exact");
    return __fmul_rn(x, 1.0f / kD);
  } else {
    return x / float(D);
  }
}

// Row passes (lane l holds elements l + 32 t, t < kPerLane): the t that can hold a channel
// below D, and whether element t of this lane does.
template <int kD>
constexpr int kLanesOf = kD ? kD / 32 : kPerLane;
template <int kD>
__device__ __forceinline__ bool lane_in_d(int lane, int t, int D) {
  if constexpr (kD > 0)
    return t < kD / 32;
  else
    return lane + 32 * t < D;
}

// dst[r][c] = src[b, c, i, j0 + r] for a channel-major src; zeros past the tile and past D (to Dp).
// Thread t takes row t % kRows of channels t / kRows + (kThreads / kRows) k: consecutive threads
// read consecutive j (coalesced). All loads first, then the shared-memory stores. Static D: only
// the k with channels below D, and one pointer stepped by the channel stride.
template <int kD = 0, typename T>
__device__ void load_channel_major_tile(const Params& p, const Tile& tile, const T* src, T* dst,
                                        int ld) {
  const int r = threadIdx.x % kRows, c0 = threadIdx.x / kRows;
  constexpr int kStep = kThreads / kRows;
  if constexpr (kD > 0) {
    static_assert(kD % kStep == 0, "every thread's channels below D");
    constexpr int kIters = kD / kStep;
    const int64_t step = kStep * p.S * p.S;
    const T* at = src + tile.channel_major(p, kD, c0, r);
    const bool row_ok = r < tile.n;
    T v[kIters];
#pragma unroll
    for (int k = 0; k < kIters; ++k) v[k] = row_ok ? at[k * step] : from_f<T>(0.0f);
#pragma unroll
    for (int k = 0; k < kIters; ++k) dst[r * ld + c0 + kStep * k] = v[k];
  } else {
    T v[kTileElemsPerThread];
#pragma unroll
    for (int k = 0; k < kTileElemsPerThread; ++k) {
      const int c = c0 + kStep * k;
      v[k] = (c < p.D && r < tile.n) ? src[tile.channel_major(p, c, r)] : from_f<T>(0.0f);
    }
#pragma unroll
    for (int k = 0; k < kTileElemsPerThread; ++k) {
      const int c = c0 + kStep * k;
      if (c < p.Dp) dst[r * ld + c] = v[k];
    }
  }
}

// Mean and 1/sigma of one row held by a warp: lane l holds v[t] = row[l + 32 t] for
// l + 32 t < D (zeros elsewhere).
struct RowStats {
  float mean, rstd;
};

// kD > 0 (static D): only the t < kD / 32 that hold channels are summed (the others would add
// +0.0f to sums that start at +0.0f and so are never -0.0f: the same bits).
template <int kD = 0, int N>
__device__ __forceinline__ RowStats row_stats(const float (&v)[N], int D, float eps) {
  const int lane = threadIdx.x % 32;
  constexpr int kN = kD ? kD / 32 : N;
  static_assert(kN <= N, "row elements per lane");
  float s = 0.0f;
#pragma unroll
  for (int t = 0; t < kN; ++t) s += v[t];
  const float mean = divide_by_d<kD>(warp_sum(s), D);
  float q = 0.0f;
#pragma unroll
  for (int t = 0; t < kN; ++t) {
    const float d = lane_in_d<kD>(lane, t, D) ? v[t] - mean : 0.0f;
    q += d * d;
  }
  return {mean, rsqrtf(divide_by_d<kD>(warp_sum(q), D) + eps)};
}

// Shared memory carved into 128-byte aligned regions.
struct SmemCarver {
  unsigned char* base;
  size_t at = 0;
  template <typename U>
  __host__ __device__ U* take(size_t count) {
    U* p = reinterpret_cast<U*>(base + at);
    at += (count * sizeof(U) + 127) / 128 * 128;
    return p;
  }
};

// The A and B operands of the input-side kernels' step GEMMs, first in their shared memory: X
// [kRows, Dp] (x_ln) and W [kChunkN, Dp] (one packed weight block), T with padded rows.
template <typename T>
__host__ __device__ inline void take_step_operands(SmemCarver& s, int Dp, T*& x, T*& w) {
  x = s.take<T>(size_t(kRows) * (Dp + kPad));
  w = s.take<T>(size_t(kChunkN) * (Dp + kPad));
}

}  // namespace tpf::cuda::trimul
