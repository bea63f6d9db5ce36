// Device and host pieces shared by the trimul Hopper (sm_90a) kernels, input_forward_sm90_kernel
// (input_forward.cu) and input_backward_gates_sm90_kernel (input_backward_split.cu): the wgmma
// step over a swizzled x_ln stage and a resident weight block, the LayerNorm in place in that
// stage, barrier helpers and the TMA maps of the [positions][D] row tensors and of w_in. Their
// shared-memory layouts and tile orders: input_forward_sm90.h, input_backward_sm90.h.
#pragma once
#include <cuda.h>

#include <cstdint>
#include <utility>

#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

#include "kernels/attention/tma.cuh"
#include "kernels/common/wgmma.cuh"
#include "kernels/trimul/device.cuh"
#include "kernels/trimul/input_forward_sm90.h"
#include "kernels/trimul/launch.h"
#include "kernels/trimul/layer_norm.cuh"

namespace tpf::cuda::trimul {

namespace gmma = cute::SM90::GMMA;

template <typename T, int N>
struct SsAtom;
#define TPF_TRIMUL_SS_ATOM(N)                                                          \
  template <>                                                                          \
  struct SsAtom<__nv_bfloat16, N> {                                                    \
    using type = gmma::MMA_64x##N##x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::K>; \
  };                                                                                   \
  template <>                                                                          \
  struct SsAtom<__half, N> {                                                           \
    using type = gmma::MMA_64x##N##x16_F32F16F16_SS<gmma::Major::K, gmma::Major::K>;   \
  };
TPF_TRIMUL_SS_ATOM(64)
TPF_TRIMUL_SS_ATOM(128)
#undef TPF_TRIMUL_SS_ATOM

template <typename Atom, size_t... I>
__device__ __forceinline__ void ss_fma(uint64_t a, uint64_t b, float* d, gmma::ScaleOut scale,
                                       std::index_sequence<I...>) {
  Atom::fma(a, b, d[I]..., scale);
}

// Descriptor of a K-major operand stored as TMA's 128-byte swizzle writes it: 8-row groups 1024
// bytes apart (SBO), LBO unused for K-major swizzled layouts (1); addr on the k step's first
// 16-byte chunk of row 0 of a 1024-byte aligned block.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {
  cute::GmmaDescriptor d;
  d.bitfield.start_address_ = uint16_t(addr >> 4);
  d.bitfield.leading_byte_offset_ = 1;
  d.bitfield.stride_byte_offset_ = uint16_t(1024 >> 4);
  d.bitfield.base_offset_ = 0;
  d.bitfield.layout_type_ = uint8_t(gmma::LayoutType::B128);
  return d.desc_;
}

// acc = x_ln W^T for one consumer warpgroup: A [64][kD] at a (the stage), B the first N rows of a
// weight block [128][kD] at b, both as kD / 64 swizzled column blocks. Issued and committed; the
// caller waits (wgmma_wait<0>) before it reads acc.
template <typename T, int N, int kD>
__device__ __forceinline__ void step_gemm(float (&acc)[N / 8][4], uint32_t a, uint32_t b) {
#pragma unroll
  for (int j = 0; j < N / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
  fence_regs(acc);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    const uint32_t at = (kk / 4) * (kRows * 128) + (kk % 4) * 32;
    const uint32_t bt = (kk / 4) * (kChunkN * 128) + (kk % 4) * 32;
    ss_fma<typename SsAtom<T, N>::type>(sw128_desc(a + at), sw128_desc(b + bt), &acc[0][0],
                                        gmma::ScaleOut::One, std::make_index_sequence<N / 2>{});
  }
  wgmma_commit();
}

// The producer's arrival on a barrier of count 1 with `bytes` of TMA transactions still to come:
// the phase completes once they have (mbar_expect_tx alone would leave the arrival pending).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile(
      "mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
      "r"(bytes)
      : "memory");
}

// L2 cache hints of the TMA loads: evict-first for the tiles streamed once, evict-last for the
// weights every CTA reads.
constexpr uint64_t kTmaEvictFirst = 0x12F0000000000000ull, kTmaEvictLast = 0x14F0000000000000ull;

// The producer's load of weight blocks 0 .. kBlocks - 1 of w_in ([128][kD] each, rows 128 q ..;
// w_in_map's boxes) into consecutive swizzled blocks at dst, completing on bar (a barrier of count
// 1: this arrival and the blocks' bytes).
template <int kD, int kBlocks>
__device__ __forceinline__ void load_weight_blocks(const CUtensorMap* w_map, uint64_t* bar,
                                                   unsigned char* dst) {
  constexpr uint32_t kBlockBytes = uint32_t(kChunkN) * kD * 2;
  mbar_arrive_expect_tx(bar, kBlocks * kBlockBytes);
#pragma unroll
  for (int q = 0; q < kBlocks; ++q)
#pragma unroll
    for (int h = 0; h < kD / sm90::kAtomCols; ++h)
      cute::SM90_TMA_LOAD_2D::copy(w_map, bar, kTmaEvictLast,
                                   dst + q * kBlockBytes + h * (kChunkN * 128), h * sm90::kAtomCols,
                                   q * kChunkN);
}

// Named barrier of consumer warpgroup c (ids 1.., 128 threads; 0 is __syncthreads).
__device__ __forceinline__ void consumer_sync(int c) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + c) : "memory");
}

// LayerNorm in place in a swizzled x stage [kRows][kD] (TMA wrote x there; the result is wgmma's
// A operand and, in the backward, x_ln's TMA store): warp w of the consumer warpgroup takes rows
// w + 4 i, lane l elements l + 32 t (row_stats's sums, normalize_input_rows's expression: the same
// bits of x_ln). ln_w / ln_b: the lane's norm_in weight and bias, elements l + 32 t.
template <typename T, int kD>
__device__ __forceinline__ void layer_norm_in_place(unsigned char* xs, int warp, int lane,
                                                    const float (&ln_w)[kD / 32],
                                                    const float (&ln_b)[kD / 32], float eps) {
  constexpr int kGroup = 4;
#pragma unroll 1
  for (int i0 = 0; i0 < kRows / 4; i0 += kGroup) {
    float v[kGroup][kD / 32];
#pragma unroll
    for (int u = 0; u < kGroup; ++u)
#pragma unroll
      for (int t = 0; t < kD / 32; ++t)
        v[u][t] = to_f(*reinterpret_cast<const T*>(
            xs + sm90::sw128_offset(kRows, warp + 4 * (i0 + u), lane + 32 * t)));
#pragma unroll
    for (int u = 0; u < kGroup; ++u) {
      const int r = warp + 4 * (i0 + u);
      const RowStats rs = row_stats<kD>(v[u], kD, eps);
#pragma unroll
      for (int t = 0; t < kD / 32; ++t)
        *reinterpret_cast<T*>(xs + sm90::sw128_offset(kRows, r, lane + 32 * t)) =
            from_f<T>((v[u][t] - rs.mean) * rs.rstd * ln_w[t] + ln_b[t]);
    }
  }
}

// ldmatrix.x4.trans with each lane's row address given (shared state space): for swizzled tiles,
// whose rows load_transposed's row-major address arithmetic does not describe.
__device__ __forceinline__ void load_transposed_at(uint32_t r[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// ---- host

inline int multiprocessors() {
  int device = 0, n = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device),
             "cudaDeviceGetAttribute");
  return n;
}

// A row-major [B * S * S, kD] tensor of 16-bit positions (x, x_ln) as a TMA map: box 64 positions
// of one (b, i) row x 64 channels, 128-byte swizzle; positions past S read as zero (loads) or are
// not written (stores).
template <int kD>
CUtensorMap position_rows_map(const void* data, bool fp16, const Params& p, const char* name) {
  uint32_t dims = 0;
  const int64_t size[2] = {p.S, p.B * p.S}, stride[2] = {kD, p.S * kD};
  const uint32_t box[2] = {uint32_t(kRows), 1};
  return tiled_tensor_map(data, fp16, 2, size, stride, box, kD, uint32_t(sm90::kAtomCols),
                          CU_TENSOR_MAP_SWIZZLE_128B, name, dims);
}

// w_in [blocks * 128, kD] as a TMA map: box 128 rows x 64 columns, 128-byte swizzle.
template <int kD>
CUtensorMap w_in_map(const void* w_in, bool fp16, int blocks) {
  uint32_t dims = 0;
  const int64_t size[1] = {int64_t(blocks) * kChunkN}, stride[1] = {kD};
  const uint32_t box[1] = {uint32_t(kChunkN)};
  return tiled_tensor_map(w_in, fp16, 1, size, stride, box, kD, uint32_t(sm90::kAtomCols),
                          CU_TENSOR_MAP_SWIZZLE_128B, "trimul w_in", dims);
}

}  // namespace tpf::cuda::trimul
