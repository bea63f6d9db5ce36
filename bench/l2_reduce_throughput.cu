// How fast can every SM add fp32 tiles into global memory by TMA bulk copies? The attention
// backward sums dQ and dbias^T that way (backward_sm90_epilogue.cuh: one writer thread per sum per
// CTA, one CTA per SM, 8-32 KB tiles), and its profile shows the writers as the long pole, so this
// measures the ceiling they run against: bulk reduce-add (cp.reduce.async.bulk .add.f32) and plain
// bulk stores, into a footprint that the L2 holds (16 MiB) or not (512 MiB), with each writer
// waiting for every copy to complete before the next (the writers before 9f8280b) or keeping up to
// 4 in flight (write_in_turns' overlap, and more).
//
// Build and run on the GPU machine (prints one JSON row per case, tb_per_s: bytes copied per second):
//   nvcc -O3 -std=c++20 -arch=sm_90a -Isrc -o /tmp/l2r bench/l2_reduce_throughput.cu && /tmp/l2r
#include <cuda_runtime.h>

#include <cstdio>

#include "kernels/common/wgmma.cuh"

using namespace tpf::cuda;

namespace {

constexpr int kMaxTileBytes = 32 * 1024;
constexpr int kWritersMax = 2;

// All but the thread's newest N bulk groups are complete (wait_group takes an immediate).
template <int N>
__device__ __forceinline__ void bulk_wait_newest_pending() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// Writer w (thread 32 w of the CTA) adds its tile `iters` times at CTA-strided tile slots of the
// footprint; `inflight` copies may be outstanding (1: wait for each before the next).
template <int kInflight>
__global__ void writers_kernel(float* dst, long long slots, int tile_bytes, int iters, int writers,
                               bool reduce) {
  extern __shared__ __align__(128) float tile[];
  const int floats = tile_bytes / 4;
  for (int i = threadIdx.x; i < floats * writers; i += blockDim.x) tile[i] = 1e-6f * (i & 7);
  __syncthreads();
  fence_proxy_async();
  const int w = threadIdx.x / 32;
  if (w >= writers || (threadIdx.x & 31) != 0) return;
  const float* src = tile + w * floats;
  const long long tile_floats = floats;
#pragma unroll 1
  for (int it = 0; it < iters; ++it) {
    const long long slot = ((long long)it * gridDim.x * writers + blockIdx.x * writers + w) % slots;
    float* d = dst + slot * tile_floats;
    if (reduce)
      bulk_reduce_add(d, src, tile_bytes);
    else
      bulk_store(d, src, tile_bytes);
    bulk_commit();
    bulk_wait_newest_pending<kInflight - 1>();
  }
  bulk_wait();
}

}  // namespace

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  const long long big = 512LL << 20;
  float* dst = nullptr;
  if (cudaMalloc(&dst, big) != cudaSuccess) return 1;
  cudaMemset(dst, 0, big);
  cudaFuncSetAttribute(writers_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                       kMaxTileBytes * kWritersMax);
  cudaFuncSetAttribute(writers_kernel<4>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                       kMaxTileBytes * kWritersMax);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  const long long footprints[2] = {16LL << 20, big};
  const int tiles[2] = {8 * 1024, 32 * 1024};
  for (long long footprint : footprints)
    for (int tile_bytes : tiles)
      for (int writers = 1; writers <= kWritersMax; ++writers)
        for (int inflight : {1, 4})
          for (bool reduce : {true, false}) {
            const long long slots = footprint / tile_bytes;
            const int iters = int((256LL << 20) / tile_bytes / writers / sms * 4);
            auto run = [&] {
              if (inflight == 1)
                writers_kernel<1><<<sms, 128, tile_bytes * writers>>>(dst, slots, tile_bytes, iters,
                                                                     writers, reduce);
              else
                writers_kernel<4><<<sms, 128, tile_bytes * writers>>>(dst, slots, tile_bytes, iters,
                                                                     writers, reduce);
            };
            run();  // warm-up
            cudaEventRecord(e0);
            run();
            cudaEventRecord(e1);
            if (cudaEventSynchronize(e1) != cudaSuccess) {
              std::printf("{\"error\": \"%s\"}\n", cudaGetErrorString(cudaGetLastError()));
              return 1;
            }
            float ms = 0.f;
            cudaEventElapsedTime(&ms, e0, e1);
            const double bytes = double(tile_bytes) * iters * writers * sms;
            std::printf(
                "{\"gpu\": \"%s\", \"op\": \"%s\", \"footprint_mib\": %lld, \"tile_kib\": %d, "
                "\"writers_per_sm\": %d, \"in_flight\": %d, \"ms\": %.4f, \"tb_per_s\": %.3f}\n",
                prop.name, reduce ? "reduce_add_f32" : "store", footprint >> 20, tile_bytes / 1024,
                writers, inflight, ms, bytes / ms * 1e-9);
          }
  cudaFree(dst);
  return 0;
}
