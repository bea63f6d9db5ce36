// Whether wgmma (the Hopper input kernel's m64n128k16 chain, input_forward_sm90_kernel) and
// mma.sync m16n8k16 (input_forward_16bit_kernel) give the same fp32 bits for the same 16-bit
// products, accumulated in the same k order (16 at a time, from +0): the premise of a bitwise A/B
// between the two kernels (bench/trimul_bitwise_ab.py). One warpgroup computes C = A W^T for
// A [64][128] and W [128][128] both ways; prints the number of differing elements per dtype and
// input distribution. Exit status 1 if any differs.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -I $CUTLASS_INCLUDE -I src -o /tmp/wgmma_mma_bits bench/trimul_wgmma_mma_bits.cu && \
//   /tmp/wgmma_mma_bits
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

#include "kernels/common/mma.cuh"
#include "kernels/trimul/input_forward_sm90.h"
#include "kernels/trimul/sm90_gmma.cuh"

namespace {

constexpr int M = 64, N = 128, K = 128;
static_assert(M == tpf::cuda::trimul::kRows && N == tpf::cuda::trimul::kChunkN,
              "step_gemm's operand strides are the kernel's tile sizes");
using tpf::cuda::smem_addr;
using tpf::cuda::fence_regs;
using tpf::cuda::wgmma_wait;
using tpf::cuda::trimul::step_gemm;
using tpf::cuda::trimul::sm90::sw128_offset;

template <typename T>
__device__ void mma16816(float c[4], const uint32_t a[4], const uint32_t b[2]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <typename T>
__device__ uint32_t pair(const T* p) {  // p[0] low, p[1] high
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}

// 128 threads: out_wg and out_mma [M][N] fp32.
template <typename T>
__global__ void __launch_bounds__(128) both(const T* A, const T* W, float* out_wg, float* out_mma) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* base = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  unsigned char* sa = base;              // [2 blocks][64 rows][128 bytes]
  unsigned char* sw = base + M * K * 2;  // [2 blocks][128 rows][128 bytes]
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2, tq = lane & 3;
  for (int i = tid; i < M * K; i += 128)
    *reinterpret_cast<T*>(sa + sw128_offset(M, i / K, i % K)) = A[i];
  for (int i = tid; i < N * K; i += 128)
    *reinterpret_cast<T*>(sw + sw128_offset(N, i / K, i % K)) = W[i];
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();

  // wgmma: the kernel's own step_gemm (sm90_gmma.cuh), waited for as the kernel waits.
  float acc[N / 8][4];
  step_gemm<T, N, K>(acc, smem_addr(sa), smem_addr(sw));
  wgmma_wait<0>();
  fence_regs(acc);
#pragma unroll
  for (int j = 0; j < N / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      out_wg[(16 * warp + g + 8 * (e >> 1)) * N + 8 * j + 2 * tq + (e & 1)] = acc[j][e];

  // mma.sync: warp w takes rows 16 w .. 16 w + 15, every 8-column block, k in the same order.
  for (int j = 0; j < N / 8; ++j) {
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int k0 = 0; k0 < K; k0 += 16) {
      const T* ar = A + (16 * warp + g) * K + k0 + 2 * tq;
      const uint32_t a[4] = {pair(ar), pair(ar + 8 * K), pair(ar + 8), pair(ar + 8 * K + 8)};
      const T* wr = W + (8 * j + g) * K + k0 + 2 * tq;
      const uint32_t b[2] = {pair(wr), pair(wr + 8)};
      mma16816<T>(c, a, b);
    }
    for (int e = 0; e < 4; ++e)
      out_mma[(16 * warp + g + 8 * (e >> 1)) * N + 8 * j + 2 * tq + (e & 1)] = c[e];
  }
}

template <typename T>
T to_t(float v) {
  if constexpr (std::is_same_v<T, __half>)
    return __float2half_rn(v);
  else
    return __float2bfloat16_rn(v);
}

template <typename T>
int run(const char* what, int dist, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> expo(-12, 12);
  std::vector<T> A(M * K), W(N * K);
  for (auto& v : A) v = to_t<T>(dist == 0 ? normal(rng) : std::ldexp(normal(rng), expo(rng)));
  for (auto& v : W)
    v = to_t<T>(dist == 0 ? 0.1f * normal(rng) : std::ldexp(normal(rng), expo(rng)));
  T *dA, *dW;
  float *dwg, *dmma;
  cudaMalloc(&dA, A.size() * sizeof(T));
  cudaMalloc(&dW, W.size() * sizeof(T));
  cudaMalloc(&dwg, M * N * sizeof(float));
  cudaMalloc(&dmma, M * N * sizeof(float));
  cudaMemcpy(dA, A.data(), A.size() * sizeof(T), cudaMemcpyHostToDevice);
  cudaMemcpy(dW, W.data(), W.size() * sizeof(T), cudaMemcpyHostToDevice);
  const int smem = (M + N) * K * 2 + 1024;
  cudaFuncSetAttribute(both<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  both<T><<<1, 128, smem>>>(dA, dW, dwg, dmma);
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    std::printf("%s: %s\n", what, cudaGetErrorString(e));
    return 1;
  }
  std::vector<float> wg(M * N), mma(M * N);
  cudaMemcpy(wg.data(), dwg, wg.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(mma.data(), dmma, mma.size() * 4, cudaMemcpyDeviceToHost);
  int differ = 0;
  double worst = 0.0, ref_err_wg = 0.0, ref_err_mma = 0.0;
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      const float x = wg[m * N + n], y = mma[m * N + n];
      double ref = 0.0;  // also a check of the fragment mapping: both near the fp64 product
      for (int k = 0; k < K; ++k) ref += double(float(A[m * K + k])) * double(float(W[n * K + k]));
      ref_err_wg = std::max(ref_err_wg, std::fabs(x - ref) / (std::fabs(ref) + 1e-30));
      ref_err_mma = std::max(ref_err_mma, std::fabs(y - ref) / (std::fabs(ref) + 1e-30));
      uint32_t bx, by;
      std::memcpy(&bx, &x, 4);
      std::memcpy(&by, &y, 4);
      if (bx != by) {
        ++differ;
        worst = std::max(worst, std::fabs(double(x) - double(y)) / (std::fabs(double(y)) + 1e-30));
      }
    }
  std::printf(
      "%-28s %5d of %d elements differ (largest relative %.3g); against fp64: "
      "wgmma %.3g, mma.sync %.3g\n",
      what, differ, M * N, worst, ref_err_wg, ref_err_mma);
  cudaFree(dA);
  cudaFree(dW);
  cudaFree(dwg);
  cudaFree(dmma);
  return differ != 0;
}

}  // namespace

int main() {
  int bad = 0;
  for (uint32_t seed = 1; seed <= 3; ++seed) {
    bad |= run<__nv_bfloat16>("bf16, normal", 0, seed);
    bad |= run<__nv_bfloat16>("bf16, exponents -12..12", 1, seed);
    bad |= run<__half>("fp16, normal", 0, seed);
    bad |= run<__half>("fp16, exponents -12..12", 1, seed);
  }
  std::printf(bad ? "wgmma and mma.sync DIFFER\n" : "wgmma and mma.sync agree bitwise\n");
  return bad;
}
