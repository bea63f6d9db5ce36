// Triangle attention forward with warpgroup MMAs (sm_90a wgmma), head dims 16 and 32; selected by
// TPF_ATTENTION_FWD_WGMMA=1 (forward.cu), the mma.sync kernel otherwise.
//
// A thread block is one warpgroup (128 threads) and computes one 64-query tile of one slice
// (b, n, h) over all 64-key tiles, like the mma.sync forward, with the same numerics: fp32
// accumulation, the scores scaled and biased in one FMA, the online softmax in the exp2 domain
// (softmax_tile in forward_common.cuh, shared with that kernel), P rounded to the input dtype for
// the second MMA, and the same output store (O, its BF16 residual, the lse).
//   S = Q K^T:  wgmma m64n64k16, A = the Q fragments in registers (loaded once with ldmatrix),
//               B = the key tile in shared memory (K-major: a key's D features are contiguous).
//   O += P V:   wgmma m64nDk16, A = P from registers (the accumulator layout of S is the A fragment
//               layout, so P never goes through shared memory), B = the value tile in shared memory
//               (N-major: a key's D features are contiguous, the MMA's K dimension is the key).
// Key and value tiles are stored in the no-swizzle core-matrix layout (load_tile<..., CORE>), which
// cp.async fills with 16-byte copies; the bias tile and key flags are loaded as in the other kernel.
// The tiles of key tile kt + 1 load (cp.async) while tile kt computes; one barrier per key tile.
//
// Measured on the H200 (commit 24a3224, bench/notes-attention.md section "Session 4"): slower than
// the mma.sync forward at every shape, kernel time D=16 S=384 0.276 against 0.256 ms, D=32 S=768
// 2.75 against 2.38 ms; so it stays behind the switch. A pipelined version (the next key tile's
// score MMA in flight during this tile's softmax: 3 stages, 168 registers) was slower still (3.12
// ms at D=32 S=768) and failed the FP64 test at S=384 when forced for every call: removed (commit
// 24a3224 has it).
// What this version does not do yet (the next optimizations, in the order we expect them to pay):
//  1. Two consumer warpgroups per block (128 queries) ping-ponging on named barriers, so one's
//     softmax runs under the other's MMAs; with a producer warp issuing TMA loads (mbarriers)
//     instead of every thread's cp.async.
//  2. 128-key tiles (m64n128k16) to halve the per-tile fixed costs (barriers, row max shuffles).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/attention/forward.h"
#include "kernels/attention/forward_common.cuh"
#include "kernels/attention/mma.cuh"
#include "kernels/attention/tile_config.h"
#include "kernels/attention/tile_io.cuh"

namespace tpf::cuda {
namespace {

constexpr int kWarpgroupThreads = 128;
static_assert(kForwardWarps * 32 == kWarpgroupThreads && kTileQ == 64,
              "one warpgroup covers a 64-query tile (wgmma's M)");

// ---- wgmma primitives (PTX ISA 9.7.15) ------------------------------------------------------------

// Shared-memory matrix descriptor, no swizzle: start address, leading-dimension byte offset (between
// core matrices along K) and stride-dimension byte offset (between core matrices along M or N),
// each in 16-byte units.
__device__ __forceinline__ uint64_t smem_desc(const void* p, uint32_t lbo, uint32_t sbo) {
  return uint64_t((smem_addr(p) & 0x3FFFFu) >> 4) | uint64_t(lbo >> 4) << 16 |
         uint64_t(sbo >> 4) << 32;
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
// Generic-proxy shared-memory writes (cp.async, st.shared) made visible to wgmma's async proxy.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from moving reads of an accumulator above the wait that completes it.
template <int R>
__device__ __forceinline__ void fence_accumulator(float (&d)[R][4]) {
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+f"(d[i][j])::"memory");
}

// d[N / 8][4] (+)= A (16 bits, registers: the warp's 16 rows x 16 k) x B (shared, descriptor),
// fp32 accumulation. ScaleD = 0 overwrites d. TransB = 0: B is K-major, 1: N-major.
template <typename T, int N>
struct Wgmma;

#define TPF_ACC4(d, j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
// Wgmma<TY, N>: the PTX operand numbers of the accumulator list (DREGS), A's registers (AREGS),
// the descriptor, ScaleD and TransB, and the accumulator operands (TPF_ACC4 for each of the N / 8
// fragments).
#define TPF_WGMMA_RS_N(TY, PTXTY, N, DREGS, AREGS, DESC, SCALE_D, TRANS_B, ...)                \
  template <>                                                                                  \
  struct Wgmma<TY, N> {                                                                        \
    template <int ScaleD, int TransB>                                                          \
    static __device__ __forceinline__ void run(float (&d)[N / 8][4], const uint32_t (&a)[4],   \
                                               uint64_t desc) {                                \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE_D                                 \
                   ", 0;\n"                                                                    \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTXTY "." PTXTY " " DREGS \
                   ", " AREGS ", " DESC ", p, 1, 1, " TRANS_B ";\n}\n"                         \
                   : __VA_ARGS__                                                               \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(ScaleD),       \
                     "n"(TransB));                                                             \
    }                                                                                          \
  };
#define TPF_WGMMA_RS(TY, PTXTY)                                                                    \
  TPF_WGMMA_RS_N(TY, PTXTY, 16, "{%0,%1,%2,%3,%4,%5,%6,%7}", "{%8,%9,%10,%11}", "%12", "%13",      \
                 "%14", TPF_ACC4(d, 0), TPF_ACC4(d, 1))                                            \
  TPF_WGMMA_RS_N(TY, PTXTY, 32, "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}",         \
                 "{%16,%17,%18,%19}", "%20", "%21", "%22", TPF_ACC4(d, 0), TPF_ACC4(d, 1),         \
                 TPF_ACC4(d, 2), TPF_ACC4(d, 3))                                                   \
  TPF_WGMMA_RS_N(TY, PTXTY, 64,                                                                    \
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21," \
                 "%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}",                                       \
                 "{%32,%33,%34,%35}", "%36", "%37", "%38", TPF_ACC4(d, 0), TPF_ACC4(d, 1),         \
                 TPF_ACC4(d, 2), TPF_ACC4(d, 3), TPF_ACC4(d, 4), TPF_ACC4(d, 5), TPF_ACC4(d, 6),   \
                 TPF_ACC4(d, 7))
TPF_WGMMA_RS(__nv_bfloat16, "bf16")
TPF_WGMMA_RS(__half, "f16")
#undef TPF_WGMMA_RS
#undef TPF_WGMMA_RS_N
#undef TPF_ACC4

// ---- the kernel -------------------------------------------------------------------------------------

template <typename T, int D, int STAGES = 2>
struct WgmmaForwardSmem {
  static_assert(D == 16 || D == 32, "the wgmma forward covers head dims 16 and 32");
  static constexpr int LDQ = D + kPad;
  static constexpr int LDB = kTileK + kPad;
  // Core-matrix layout ([D / 8][kTileK][8], load_tile<..., CORE>): the 8 x 8 block of keys
  // 8i..8i+7 and features 8c..8c+7 is 128 contiguous bytes at ((c * kTileK) + 8 i) * 8 elements.
  alignas(128) T k[STAGES][kTileK * D];
  alignas(128) T v[STAGES][kTileK * D];
  T q[kTileQ * LDQ];  // padded rows, read once into registers with ldmatrix
  T bias[STAGES][kTileQ * LDB];
  uint8_t key_ok[STAGES][kTileK];
};

// The block's dynamic shared memory (128-byte aligned, as the core-matrix tiles need).
template <typename S>
__device__ __forceinline__ S& wgmma_smem() {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  return *reinterpret_cast<S*>(smem_raw);
}

// Descriptor strides of the core-matrix layout, in bytes: 128 between core matrices along the
// keys, kTileK * 16 between core matrices along the features.
constexpr uint32_t kAlongKeys = 128;
constexpr uint32_t kAlongFeatures = kTileK * 16;

// s = q k^T (64 x 64), issued (no fence, commit or wait): k-step ks covers features 16 ks ..
// 16 ks + 15, two core-matrix columns of the key tile.
template <typename T, int D>
__device__ __forceinline__ void issue_scores(float (&s)[kTileK / 8][4],
                                             const uint32_t (&qf)[D / 16][4], const T* k_tile) {
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const uint64_t desc = smem_desc(k_tile + ks * 2 * kTileK * 8, kAlongFeatures, kAlongKeys);
    if (ks == 0)
      Wgmma<T, kTileK>::template run<0, 0>(s, qf[ks], desc);
    else
      Wgmma<T, kTileK>::template run<1, 0>(s, qf[ks], desc);
  }
}

// o += p v, issued likewise: k-step kk covers keys 16 kk .. 16 kk + 15, two core-matrix rows of
// the value tile.
template <typename T, int D>
__device__ __forceinline__ void issue_pv(float (&o)[D / 8][4], const uint32_t (&pa)[kTileK / 16][4],
                                         const T* v_tile) {
#pragma unroll
  for (int kk = 0; kk < kTileK / 16; ++kk) {
    const uint64_t desc = smem_desc(v_tile + kk * 16 * 8, kAlongKeys, kAlongFeatures);
    Wgmma<T, D>::template run<1, 1>(o, pa[kk], desc);
  }
}

// Registers: D = 32 needs ~S 32 + O 16 + Q 8 + P 16 fp32/b32 registers plus addressing; capped for
// 4 blocks (16 warps) per SM, which shared memory (~40 KB per block at D = 32) also allows.
template <typename T, int D>
__global__ void __launch_bounds__(kWarpgroupThreads, 4)
    attention_forward_wgmma_kernel(const AttentionForwardParams p) {
  using S = WgmmaForwardSmem<T, D>;
  S& sm = wgmma_smem<S>();

  const ForwardTile<T> t = forward_tile<T, kTileQ>(p);
  const int lane = t.lane;
  auto load_keys = [&](int kt, int stage) {
    load_key_stage<T, D, kTileQ, kWarpgroupThreads, true>(sm, stage, t, p, kt);
  };

  load_query_tile<T, D, kTileQ, kWarpgroupThreads>(sm.q, t, p);
  load_keys(0, 0);
  cp_async_commit();

  // This thread's rows: warp * 16 + lane / 4 and + 8 (wgmma gives warp w of the warpgroup the
  // accumulator rows 16 w .. 16 w + 15, in the mma.sync C fragment layout).
  const int row0 = t.warp * kWarpRows;
  uint32_t qf[D / 16][4];
  float o[D / 8][4], m[2], l[2];
  init_rows<D>(o, m, l);

  const float scale = in_register(p.scale);  // see in_register (mma.cuh)
  const int key_tiles = (p.Sk + kTileK - 1) / kTileK;
  for (int kt = 0; kt < key_tiles; ++kt) {
    const int stage = kt & 1;
    // Tile kt is the only load group in flight. The proxy fence (MEMBAR + FENCE.VIEW.ASYNC in SASS)
    // is issued here, before the next tile's copies start, so that it has no copy to wait for.
    cp_async_wait<0>();
    fence_proxy_async_shared();  // this thread's copies of stage `stage`, before wgmma reads them
    __syncthreads();  // also: every thread is done with tile kt - 1, whose stage the next load reuses
    if (kt + 1 < key_tiles) {
      load_keys(kt + 1, stage ^ 1);  // overlaps this tile's MMAs and softmax
      cp_async_commit();
    }
    if (kt == 0) {
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) load_a(qf[ks], sm.q, S::LDQ, row0, ks * 16);
    }

    float s[kTileK / 8][4];  // s = q k^T
    wgmma_fence();
    issue_scores<T, D>(s, qf, sm.k[stage]);
    wgmma_commit();
    wgmma_wait<0>();
    fence_accumulator(s);

    float correction[2];
    softmax_tile<T>(s, m, l, correction, sm.bias[stage], S::LDB, row0, sm.key_ok[stage], scale,
                    lane);
    rescale_rows<D>(o, correction);

    uint32_t pa[kTileK / 16][4];  // o += p v
#pragma unroll
    for (int kk = 0; kk < kTileK / 16; ++kk) pack_p<T>(pa[kk], s, kk);
    fence_accumulator(o);
    wgmma_fence();  // o's rescale and the P registers, before the MMAs that read them
    issue_pv<T, D>(o, pa, sm.v[stage]);
    wgmma_commit();
    wgmma_wait<0>();
    fence_accumulator(o);
  }

  store_rows<T, D>(p, output_slice<T>(p, t.b, t.n, t.h), t.b, t.n, t.h, t.q0 + row0, o, m, l, lane);
}

// One warpgroup per 64-query tile of one slice; `smem` bytes of dynamic shared memory.
void launch_wgmma(void (*kernel)(AttentionForwardParams), size_t smem,
                  const AttentionForwardParams& p, cudaStream_t stream) {
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                       cudaSharedmemCarveoutMaxShared);
  const dim3 grid(p.N, (p.Sq + kTileQ - 1) / kTileQ, p.B * p.H);
  kernel<<<grid, kWarpgroupThreads, smem, stream>>>(p);
}
}  // namespace

template <typename T, int D>
void attention_forward_wgmma_launch(const AttentionForwardParams& p, cudaStream_t stream) {
  launch_wgmma(attention_forward_wgmma_kernel<T, D>, sizeof(WgmmaForwardSmem<T, D>), p, stream);
}

template void attention_forward_wgmma_launch<__nv_bfloat16, 16>(const AttentionForwardParams&,
                                                                cudaStream_t);
template void attention_forward_wgmma_launch<__nv_bfloat16, 32>(const AttentionForwardParams&,
                                                                cudaStream_t);
template void attention_forward_wgmma_launch<__half, 16>(const AttentionForwardParams&,
                                                         cudaStream_t);
template void attention_forward_wgmma_launch<__half, 32>(const AttentionForwardParams&,
                                                         cudaStream_t);

}  // namespace tpf::cuda
