// The Hopper trimul kernels' wgmma pieces on CuTe's SM90 atoms: the SS atom of a 16-bit type
// and width N, its call over an accumulator array, and the descriptor of a K-major operand as
// TMA's 128-byte swizzle stores it, and one warpgroup's product over those (step_gemm). Shared by
// input_forward.cu and the check of its sums against mma.sync (bench/trimul_wgmma_mma_bits.cu).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <utility>

#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

#include "kernels/common/wgmma.cuh"
#include "kernels/trimul/tiles.h"

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

}  // namespace tpf::cuda::trimul
