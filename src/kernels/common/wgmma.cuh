// Hopper (sm_90a) primitives for the warp-specialized attention kernels: warpgroup MMAs (wgmma) with
// A from shared memory (SS) or registers (RS), their shared-memory descriptors, mbarriers, register
// reallocation between warpgroups, and the global-memory semaphores that order cross-CTA sums.
//
// Shared-memory operands use wgmma's no-swizzle "core matrix" layout: an 8-row x 16-byte core matrix
// is 128 contiguous bytes. A 64-row tile of `cols` 16-bit columns is stored [cols / 8][64][8]
// (load_tile<..., CORE = true> in tile_io.cuh writes it), so that
//   K-major use (the MMA's K runs along the columns): LBO = 1024 bytes (next 8 columns),
//                                                     SBO = 128 bytes (next 8 rows);
//   MN-major use (the MMA's K runs along the rows):   LBO = 128 bytes (next 8 rows),
//                                                     SBO = 1024 bytes (next 8 columns).
// (CUTLASS's canonical INTERLEAVE layouts.)
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/common/mma.cuh"

namespace tpf::cuda {

// Byte strides of a 64-row core-matrix tile.
constexpr uint32_t kCoreNextRows = 128;   // 8 rows further
constexpr uint32_t kCoreNextCols = 1024;  // 8 columns further (64 rows x 16 bytes)

// Shared-memory matrix descriptor, no swizzle: start address, leading-dimension byte offset and
// stride-dimension byte offset, each in 16-byte units.
__device__ __forceinline__ uint64_t wgmma_desc(const void* p, uint32_t lbo, uint32_t sbo) {
  return uint64_t((smem_addr(p) & 0x3FFFFu) >> 4) | uint64_t(lbo >> 4) << 16 |
         uint64_t(sbo >> 4) << 32;
}
// A 64-row core-matrix tile read K-major (K along its columns) or MN-major (K along its rows).
__device__ __forceinline__ uint64_t desc_k_major(const void* p) {
  return wgmma_desc(p, kCoreNextCols, kCoreNextRows);
}
__device__ __forceinline__ uint64_t desc_mn_major(const void* p) {
  return wgmma_desc(p, kCoreNextRows, kCoreNextCols);
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Generic-proxy shared-memory writes (cp.async, st.shared, stmatrix) made visible to wgmma's async
// proxy; each writing thread issues it before the barrier that the MMA's warps wait on.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from moving accesses of an accumulator across the wait that completes it.
template <int R>
__device__ __forceinline__ void fence_regs(float (&d)[R][4]) {
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+f"(d[i][j])::"memory");
}
template <int R>
__device__ __forceinline__ void fence_regs(uint32_t (&a)[R][4]) {
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
}

// d[N / 8][4] (+)= A x B for one warpgroup, m64nNk16, fp32 accumulators in the mma.sync C fragment
// layout per warp (warp w of the warpgroup holds rows 16 w .. 16 w + 15). ScaleD = 0 overwrites d.
// SS: A and B from shared memory (descriptors); TransA / TransB = 1 for an MN-major operand.
// RS: A from registers (the mma.sync A fragment layout per warp), B from shared memory.
template <typename T, int N>
struct Wgmma;

#define TPF_WG_ACC4(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define TPF_WG_DEFINE(TY, PTXTY, N, SS_OPS, RS_OPS, ...)                                      \
  template <>                                                                                 \
  struct Wgmma<TY, N> {                                                                       \
    template <int ScaleD, int TransA, int TransB>                                             \
    static __device__ __forceinline__ void ss(float (&d)[N / 8][4], uint64_t a, uint64_t b) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" SS_OPS "\n}\n"                        \
                   : __VA_ARGS__                                                              \
                   : "l"(a), "l"(b), "n"(ScaleD), "n"(TransA), "n"(TransB));                  \
    }                                                                                         \
    template <int ScaleD, int TransB>                                                         \
    static __device__ __forceinline__ void rs(float (&d)[N / 8][4], const uint32_t (&a)[4],   \
                                              uint64_t b) {                                   \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" RS_OPS "\n}\n"                        \
                   : __VA_ARGS__                                                              \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(ScaleD),         \
                     "n"(TransB));                                                            \
    }                                                                                         \
  };
// Operand numbers: the N / 2 accumulators first, then (SS) descA, descB, ScaleD, TransA, TransB or
// (RS) a0..a3, descB, ScaleD, TransB.
#define TPF_WG_MMA(N, PTXTY) "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTXTY "." PTXTY " "
#define TPF_WG_ALL(TY, PTXTY)                                                                      \
  TPF_WG_DEFINE(TY, PTXTY, 8,                                                                      \
                "6, 0;\n" TPF_WG_MMA(8, PTXTY) "{%0,%1,%2,%3}, %4, %5, p, 1, 1, %7, %8;",          \
                "9, 0;\n" TPF_WG_MMA(8, PTXTY) "{%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1, %10;",  \
                TPF_WG_ACC4(0))                                                                    \
  TPF_WG_DEFINE(                                                                                   \
      TY, PTXTY, 16,                                                                               \
      "10, 0;\n" TPF_WG_MMA(16, PTXTY) "{%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, p, 1, 1, %11, %12;",    \
      "13, 0;\n" TPF_WG_MMA(                                                                       \
          16, PTXTY) "{%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1, %14;",             \
      TPF_WG_ACC4(0), TPF_WG_ACC4(1))                                                              \
  TPF_WG_DEFINE(TY, PTXTY, 32,                                                                   \
                "18, 0;\n" TPF_WG_MMA(32, PTXTY)                                                   \
                "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, %19, %20;", \
                "21, 0;\n" TPF_WG_MMA(32, PTXTY)                                                   \
                "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1, %22;", \
                TPF_WG_ACC4(0), TPF_WG_ACC4(1), TPF_WG_ACC4(2), TPF_WG_ACC4(3)) \
  TPF_WG_DEFINE(TY, PTXTY, 64,                                                                   \
                "34, 0;\n" TPF_WG_MMA(64, PTXTY)                                                   \
                "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,"  \
                "%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, %35, %36;",          \
                "37, 0;\n" TPF_WG_MMA(64, PTXTY)                                                   \
                "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,"  \
                "%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, %38;", \
                TPF_WG_ACC4(0), TPF_WG_ACC4(1), TPF_WG_ACC4(2), TPF_WG_ACC4(3), TPF_WG_ACC4(4),   \
                TPF_WG_ACC4(5), TPF_WG_ACC4(6), TPF_WG_ACC4(7))
TPF_WG_ALL(__nv_bfloat16, "bf16")
TPF_WG_ALL(__half, "f16")
#undef TPF_WG_ALL
#undef TPF_WG_MMA
#undef TPF_WG_DEFINE
#undef TPF_WG_ACC4

// ---- mbarriers (CTA scope) -------------------------------------------------------------------------
// A phase completes when `count` threads have arrived; waiting on parity P returns once the phase of
// parity P has completed, and at once for parity 1 before the first phase (so a producer's first
// wait on an "empty" barrier, parity 1, passes).

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar))
               : "memory");
}
// `bytes` more to arrive (TMA's complete_tx) before the barrier's current phase can complete.
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// ---- warp specialization ----------------------------------------------------------------------------
// Registers per thread of the calling warpgroup (all its threads execute it; the kernel needs a
// register cap at entry, __launch_bounds__(threads, 1)).
template <int R>
__device__ __forceinline__ void warpgroup_registers_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void warpgroup_registers_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}

// ---- cross-CTA order in global memory -----------------------------------------------------------------
// A semaphore counts the CTAs that have added their part of a sum; CTA number t of the order waits
// until it reads t (acquire), adds, then increments it (release): the additions happen in the
// order 0, 1, 2, ... whatever the schedule, so the sum is bitwise the same on every call. Only a
// CTA waits for lower-numbered work, which the hardware dispatches first: no cycle.
__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.global.acquire.gpu.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// Waits until the count reaches `turn`: "at least", never "equal". Where several warps of one CTA
// take the same turn (the backward's dQ writers), the first to pass it moves the count on before a
// slow one has looked; an equality test then spins forever and every later CTA of the chain with
// it (a hang seen on an H100, 2026-12-07). Counts only grow within a call (zeroed before each), and
// a value past `turn` implies `turn` was reached first: every pass follows its own wait.
__device__ __forceinline__ void wait_turn(const int* sem, int turn) {
  while (load_acquire(sem) < turn) {}
}
// The count moves on: one thread releases its own writes (bulk copies included, after bulk_wait).
__device__ __forceinline__ void pass_turn(int* sem) {
  asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
  asm volatile("red.relaxed.gpu.global.add.s32 [%0], 1;\n" ::"l"(sem) : "memory");
}
// ---- bulk copies from shared to global memory (TMA, async proxy; one thread issues them) -----------
// `bytes` (a multiple of 16, both ends on 16 bytes) of shared memory stored to, or added as floats
// to, global memory; each joins the thread's current bulk group.
__device__ __forceinline__ void bulk_store(float* dst, const float* src, int bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst),
               "r"(smem_addr(src)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_reduce_add(float* dst, const float* src, int bytes) {
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
      "r"(smem_addr(src)), "r"(bytes)
      : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// The thread's bulk groups have read their shared memory (it may be overwritten).
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
// The thread's bulk groups are complete: their writes are visible to it (and, after a release,
// to whoever acquires it).
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
// Orders the calling thread's generic-proxy accesses with its async-proxy (TMA) ones, all state
// spaces: after an acquire, before bulk copies that read what it made visible; after a bulk wait,
// before the release that hands the copies' writes on.
__device__ __forceinline__ void fence_proxy_async_all() {
  asm volatile("fence.proxy.async;\n" ::: "memory");
}

}  // namespace tpf::cuda
