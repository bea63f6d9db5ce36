// Warp-level primitives for sm_80+ tensor cores (mma.sync m16n8k16, ldmatrix) and cp.async.
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"), with g = lane / 4, t = lane % 4:
//   A (16x16, row major): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B (16x8, k x n):      b0 = (k = 2t..2t+1, n = g), b1 = (k = 2t+8.., n = g)
//   C (16x8, fp32):       c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1)
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#include "kernels/common/convert.cuh"

namespace tpf::cuda {

template <typename T>
struct Mma;

// Mma<T>::run: c += a b for one warp (the fragments above); pack: two floats as T's 32-bit pair.
#define TPF_MMA_DEFINE(TY, PTXTY, PAIR, PACK)                                           \
  template <>                                                                           \
  struct Mma<TY> {                                                                      \
    static __device__ __forceinline__ void run(float c[4], const uint32_t a[4],         \
                                               const uint32_t b[2]) {                   \
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTXTY "." PTXTY             \
                   ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"       \
                   : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                     \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1])); \
    }                                                                                   \
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {               \
      PAIR v = PACK(lo, hi);                                                            \
      return *reinterpret_cast<uint32_t*>(&v);                                          \
    }                                                                                   \
  };
TPF_MMA_DEFINE(__nv_bfloat16, "bf16", __nv_bfloat162, __floats2bfloat162_rn)
TPF_MMA_DEFINE(__half, "f16", __half2, __floats2half2_rn)
#undef TPF_MMA_DEFINE

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A fragment of the 16x16 block at (row0, col0) of a row-major shared matrix with `ld` elements
// per row.
template <typename T>
__device__ __forceinline__ void load_a(uint32_t a[4], const T* s, int ld, int row0, int col0) {
  const int lane = threadIdx.x & 31;
  const T* p = s + (row0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + col0 + (lane >> 4) * 8;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(smem_addr(p)));
}

// B fragment (16 k x 8 n) from shared storage laid out [n][k] (e.g. K [key][d] for q k^T).
template <typename T>
__device__ __forceinline__ void load_b_nk(uint32_t b[2], const T* s, int ld, int n0, int k0) {
  const int lane = threadIdx.x & 31;
  const T* p = s + (n0 + (lane & 7)) * ld + k0 + ((lane >> 3) & 1) * 8;
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(b[0]), "=r"(b[1])
               : "r"(smem_addr(p)));
}

// B fragment (16 k x 8 n) from shared storage laid out [k][n] (e.g. V [key][d] for p v).
template <typename T>
__device__ __forceinline__ void load_b_kn(uint32_t b[2], const T* s, int ld, int k0, int n0) {
  const int lane = threadIdx.x & 31;
  const T* p = s + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + n0;
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(b[0]), "=r"(b[1])
               : "r"(smem_addr(p)));
}

// The 16x16 block at (row0, col0) of a row-major shared matrix, transposed into registers:
// r[0] holds elements (row0 + 2t, +1; col0 + g), r[1] the same for col0 + 8 + g, r[2] and r[3] the
// same for rows row0 + 8 + 2t. That is the layout of an MMA result (C fragment) of the transposed
// block, so a tile stored [query][key] can be read in the [key][query] order of a key-major MMA.
template <typename T>
__device__ __forceinline__ void load_transposed(uint32_t r[4], const T* s, int ld, int row0,
                                                int col0) {
  const int lane = threadIdx.x & 31;
  const T* p = s + (row0 + (lane & 7) + (lane >> 4) * 8) * ld + col0 + ((lane >> 3) & 1) * 8;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// The inverse of load_transposed: stores registers in that layout into the 16x16 block at
// (row0, col0) of a row-major shared matrix (sm_90 stmatrix).
template <typename T>
__device__ __forceinline__ void store_transposed(T* s, int ld, int row0, int col0,
                                                 const uint32_t r[4]) {
  const int lane = threadIdx.x & 31;
  T* p = s + (row0 + (lane & 7) + (lane >> 4) * 8) * ld + col0 + ((lane >> 3) & 1) * 8;
  asm volatile(
      "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(smem_addr(p)),
      "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]));
}

// The two 16-bit values of a register as floats (low half first).
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t r);
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t r) {
  return make_float2(__uint_as_float(r << 16), __uint_as_float(r & 0xffff0000u));
}
template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t r) {
  return __half22float2(*reinterpret_cast<__half2*>(&r));
}

// 2^x on the SFU, flushing results below 2^-126 to zero: exp2f's extra work keeps those denormal
// (two multiplies and a compare per call around the same MUFU.EX2), which a probability of at
// most 1e-38 relative to the row's largest does not need. -inf gives +0.
constexpr float kLog2e = 1.4426950408889634f;  // log2(e): exp(x) = 2^(x log2(e))

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// `x` as a value only a register holds. A kernel parameter such as the softmax scale, copied to a
// local, is otherwise re-read by ptxas from the constant bank at each use (one predicated LDC per
// score in the softmax loops); ptxas sees through a mov and a shfl of it, not through this add.
__device__ __forceinline__ float in_register(float x) {
  asm volatile("add.rn.f32 %0, %0, 0f80000000;\n" : "+f"(x));  // x + (-0) == x for every x
  return x;
}

// 16-byte asynchronous copy; bytes past src_bytes (0..16) are zero-filled.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Barrier over `threads` threads (a multiple of 32) with id 1..15 (0 is __syncthreads).
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads));
}

}  // namespace tpf::cuda
