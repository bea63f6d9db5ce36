// Hopper building blocks of the forward (forward_sm90.cu), on CuTe's SM90 atoms (nvidia-cutlass
// headers): warpgroup MMAs with A in registers, shared-memory matrix descriptors for the swizzled
// K and V tiles that TMA writes, mbarriers, TMA and bulk copies, register reconfiguration.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <utility>

// Some N = DP shapes of the PV product (48, 80, 112) are CuTe's "extended" atoms.
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#endif
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

namespace tpf::cuda::fwd90 {

namespace gmma = cute::SM90::GMMA;

// ---- warpgroup MMA: D[64 x N] (+)= A[64 x 16] (registers) B[16 x N] (shared, descriptor) --------

template <typename T, int N, gmma::Major MajorB>
struct RsAtom;
#define TPF_RS_ATOM(N)                                                    \
  template <gmma::Major B>                                                \
  struct RsAtom<__nv_bfloat16, N, B> {                                    \
    using type = gmma::MMA_64x##N##x16_F32BF16BF16_RS<gmma::Major::K, B>; \
  };                                                                      \
  template <gmma::Major B>                                                \
  struct RsAtom<__half, N, B> {                                           \
    using type = gmma::MMA_64x##N##x16_F32F16F16_RS<gmma::Major::K, B>;   \
  };
TPF_RS_ATOM(16)
TPF_RS_ATOM(32)
TPF_RS_ATOM(48)
TPF_RS_ATOM(64)
TPF_RS_ATOM(80)
TPF_RS_ATOM(96)
TPF_RS_ATOM(112)
TPF_RS_ATOM(128)
#undef TPF_RS_ATOM

template <typename Atom, size_t... I>
__device__ __forceinline__ void rs_fma(const uint32_t (&a)[4], uint64_t desc, float* d,
                                       std::index_sequence<I...>) {
  Atom::fma(a[0], a[1], a[2], a[3], desc, d[I]..., gmma::ScaleOut::One);
}

// acc (N / 8 blocks of 4 floats, the wgmma accumulator layout) += A B, issued asynchronously.
template <typename T, int N, gmma::Major MajorB>
__device__ __forceinline__ void wgmma_rs(float (&acc)[N / 8][4], const uint32_t (&a)[4],
                                         uint64_t desc) {
  rs_fma<typename RsAtom<T, N, MajorB>::type>(a, desc, &acc[0][0],
                                              std::make_index_sequence<N / 2>{});
}

template <int R>
__device__ __forceinline__ void fence_operands(float (&d)[R][4]) {
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) cute::warpgroup_fence_operand(d[i][j]);
}

// ---- shared-memory matrix descriptors -----------------------------------------------------------
// Tiles are [rows][W] blocks of 16-bit elements, rows 2W bytes apart, written by TMA with the
// 2W-byte swizzle (W = 16, 32, 64: 32, 64, 128-byte swizzle). In CuTe's terms these are the
// canonical Layout_K_SW{32,64,128}_Atom (K-major: the K tile of S = Q K^T, whose contiguous
// dimension is the MMA's K) and Layout_MN_SW*_Atom (MN-major: the V tile of O = P V, whose
// contiguous dimension is the MMA's N). For both, SBO is the stride of 8-row groups (16 W bytes).
// K-major: LBO unused (1); MN-major: LBO is the stride between W-wide atoms along N.
template <int W>
constexpr uint8_t swizzle_layout_type() {
  static_assert(W == 16 || W == 32 || W == 64, "atoms are 32, 64 or 128 bytes wide");
  return W == 64   ? uint8_t(gmma::LayoutType::B128)
         : W == 32 ? uint8_t(gmma::LayoutType::B64)
                   : uint8_t(gmma::LayoutType::B32);
}

template <int W>
__device__ __forceinline__ uint64_t smem_desc(uint32_t smem_byte_addr, uint32_t lbo_bytes) {
  cute::GmmaDescriptor d;
  d.bitfield.start_address_ = uint16_t(smem_byte_addr >> 4);
  d.bitfield.leading_byte_offset_ = uint16_t(lbo_bytes >> 4);
  d.bitfield.stride_byte_offset_ = uint16_t((16 * W) >> 4);
  d.bitfield.base_offset_ = 0;
  d.bitfield.layout_type_ = swizzle_layout_type<W>();
  return d.desc_;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarriers, TMA ---------------------------------------------------------------------------

using Barrier = cutlass::arch::ClusterTransactionBarrier;

// Named barrier over the two consumer warpgroups (id 0 is __syncthreads).
__device__ __forceinline__ void consumer_barrier() {
  asm volatile("bar.sync 1, 256;\n" ::: "memory");
}

__device__ __forceinline__ float ex2_mufu(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 2^x on the FMA pipe (FlashAttention-4's trick): x = i + f with i = round(x) (the 1.5 x 2^23
// magic constant rounds in one FADD), 2^f on [-1/2, 1/2] by a degree-4 minimax polynomial
// (relative error 2.7e-6 in fp32, far below the P rounding to bf16 or fp16 that follows), and 2^i built
// as a float's exponent field and multiplied in, so that x <= -127 (masked scores are -inf) gives
// exactly 0 like ex2.approx.ftz.
__device__ __forceinline__ float ex2_poly(float x) {
  x = fmaxf(x, -127.f);
  const float rounded = x + 12582912.f;  // 1.5 * 2^23: integer part in the low bits
  const float i = rounded - 12582912.f;
  const float f = x - i;
  float p = 9.57009941e-3f;
  p = fmaf(p, f, 5.59178628e-2f);
  p = fmaf(p, f, 2.40247443e-1f);
  p = fmaf(p, f, 6.93121791e-1f);
  p = fmaf(p, f, 9.99999285e-1f);
  // Exponent bits of 2^i: (i + 127) << 23, i from the rounded value's low mantissa bits.
  const uint32_t scale_bits = (__float_as_uint(rounded) - 0x4B400000u + 127u) << 23;
  return p * __uint_as_float(scale_bits);
}

}  // namespace tpf::cuda::fwd90
