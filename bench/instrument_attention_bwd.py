#!/usr/bin/env python3
"""Instruments the Hopper attention backward with clock64 timers, for a profiling build only (never
committed): run it on a copy of the tree (a git worktree), build the kernels there
(`scripts/build-cuda`), carry the library as .prebuilt/ab/NAME/libtpf_cuda.so.xz and run
`AB_AREAS=attention scripts/gpu-check ab`. Every 8th backward call prints one line, in thousands of
cycles per CTA: per consumer warpgroup (wg0, wg1) the waits for K/V, for a stage's loads, the S/dP
MMAs, the softmax, the named barrier, the dV/dK/dQ MMAs, the wait for a free dQ staging buffer, the
dQ staging, the wait for the dbias staging and the total; the producer's K/V prologue, its waits for
a free stage and its issue time; the dQ writers' (summed over the writer warps) turn waits, staged
waits, writes, fences and total; the dbias writer's staged waits, turn waits, fences and total.
Usage: python3 bench/instrument_attention_bwd.py TREE
"""
import re, sys
root = sys.argv[1]
ml = f"{root}/src/kernels/attention/backward_sm90_mainloop.cuh"
ep = f"{root}/src/kernels/attention/backward_sm90_epilogue.cuh"
kc = f"{root}/src/kernels/attention/backward_sm90.cu"
def sub(path, old, new, count=1):
    s = open(path).read()
    n = s.count(old)
    assert n >= 1, (path, old[:60])
    if count == 1: assert n == 1, (path, old[:60], n)
    s = s.replace(old, new)
    open(path, "w").write(s)

# Smem: prof slots [role][16]; role 0,1 consumer WGs, 2 producer, 3 dq writer, 4 dbias writer
sub(ml, "  uint64_t kv_full, full[2],", "  unsigned long long prof[5][16];\n  uint64_t kv_full, full[2],")
sub(ml, "namespace tpf::cuda {\n", """namespace tpf::cuda {
__device__ unsigned long long g_bwd_prof[5][16];
#define PT(v) long long v = clock64()
#define PA(role, slot, t0) do { if (prof_on) sm.prof[role][slot] += clock64() - (t0); } while (0)
""")
# ---- producer
sub(ml, """  const AttentionForwardParams& f = p.fwd;
  const int tid = threadIdx.x;
""", """  const AttentionForwardParams& f = p.fwd;
  const int tid = threadIdx.x;
  const bool prof_on = tid == 0;
  PT(t_kv);
""")
sub(ml, """  mbar_arrive(&sm.kv_full);

  // Per query tile""", """  mbar_arrive(&sm.kv_full);
  PA(2, 0, t_kv);

  // Per query tile""")
sub(ml, """    const int stage = i & 1;
    mbar_wait(&sm.empty[stage], ((i >> 1) & 1) ^ 1);
    if (cta_alive) {""", """    const int stage = i & 1;
    PT(t_e);
    mbar_wait(&sm.empty[stage], ((i >> 1) & 1) ^ 1);
    PA(2, 1, t_e);
    PT(t_l);
    if (cta_alive) {""")
sub(ml, """    }
    mbar_arrive(&sm.full[stage]);
  }
}""", """    }
    PA(2, 2, t_l);
    mbar_arrive(&sm.full[stage]);
  }
}""")
# ---- consumer
sub(ml, """  const float scale = in_register(p.fwd.scale);  // see in_register (mma.cuh)

  mbar_wait(&sm.kv_full, 0);""", """  const float scale = in_register(p.fwd.scale);  // see in_register (mma.cuh)
  const bool prof_on = ctid == 0;
  PT(t_all);
  PT(t_kv);
  mbar_wait(&sm.kv_full, 0);
  PA(w, 0, t_kv);""")
sub(ml, """    mbar_wait(&sm.full[stage], (i >> 1) & 1);
    if constexpr (!S::kF32Bias) {""", """    PT(t_f);
    mbar_wait(&sm.full[stage], (i >> 1) & 1);
    PA(w, 1, t_f);
    if constexpr (!S::kF32Bias) {""")
sub(ml, """      if (state[u] == kTileSkip) {
        mbar_wait(&sm.dq_empty[buf], ((staged / DQS) & 1) ^ 1);""", """      if (state[u] == kTileSkip) {
        PT(t_q0);
        mbar_wait(&sm.dq_empty[buf], ((staged / DQS) & 1) ^ 1);
        PA(w, 6, t_q0);""")
sub(ml, """      float st[8][4], dpt[8][4];  // S^T, dP^T: this warp's 16 keys x 64 queries
      wgmma_fence();""", """      float st[8][4], dpt[8][4];  // S^T, dP^T: this warp's 16 keys x 64 queries
      PT(t_m1);
      wgmma_fence();""")
sub(ml, """      fence_regs(st);
      fence_regs(dpt);
""", """      fence_regs(st);
      fence_regs(dpt);
      PA(w, 2, t_m1);
      PT(t_sm);
""")
sub(ml, """      named_barrier(1 + w, 128);

      float dq[D / 8][4];""", """      PA(w, 3, t_sm);
      PT(t_nb);
      named_barrier(1 + w, 128);
      PA(w, 4, t_nb);
      PT(t_m2);

      float dq[D / 8][4];""")
sub(ml, """      fence_regs(da);
      ++computed;

      mbar_wait(&sm.dq_empty[buf], ((staged / DQS) & 1) ^ 1);""", """      fence_regs(da);
      ++computed;
      PA(w, 5, t_m2);
      PT(t_qe);
      mbar_wait(&sm.dq_empty[buf], ((staged / DQS) & 1) ^ 1);
      PA(w, 6, t_qe);
      PT(t_qs);""")
sub(ml, """      if (ctid == 0) sm.dq_valid[buf][w] = 1;
      mbar_arrive(&sm.dq_full[buf]);
      ++staged;
    }""", """      if (ctid == 0) sm.dq_valid[buf][w] = 1;
      mbar_arrive(&sm.dq_full[buf]);
      PA(w, 7, t_qs);
      ++staged;
    }""")
sub(ml, """    mbar_wait(&sm.dbias_empty, (i & 1) ^ 1);
    if (any) {""", """    PT(t_de);
    mbar_wait(&sm.dbias_empty, (i & 1) ^ 1);
    PA(w, 8, t_de);
    if (any) {""")
sub(ml, """    if (ctid == 0) sm.dbias_valid[w] = any;
    mbar_arrive(&sm.dbias_full);
  }
}""", """    if (ctid == 0) sm.dbias_valid[w] = any;
    mbar_arrive(&sm.dbias_full);
  }
  PA(w, 9, t_all);
}""")
# ---- dq writer
sub(ep, """  const bool first = jb == 0, last = jb == J - 1;
  int staged = 0;""", """  const bool first = jb == 0, last = jb == J - 1;
  int staged = 0;
  const bool prof_on = lane == 0;
  PT(t_all);""")
sub(ep, """    wait_turn(sem, kBwdDqWriters * jb);
    const int q0 = i * kTileQ, qrows = min(kTileQ, f.Sq - q0);""", """    PT(t_t);
    wait_turn(sem, kBwdDqWriters * jb);
    PA(3, 0, t_t);
    const int q0 = i * kTileQ, qrows = min(kTileQ, f.Sq - q0);""")
sub(ep, """      mbar_wait(&sm.dq_full[buf], (staged / DQS) & 1);
      const int n = g * A + u;""", """      PT(t_f);
      mbar_wait(&sm.dq_full[buf], (staged / DQS) & 1);
      PA(3, 1, t_f);
      PT(t_w);
      const int n = g * A + u;""")
sub(ep, """      __syncwarp();
      mbar_arrive(&sm.dq_empty[buf]);
    }
    pass_turn(sem, lane);
  }
}""", """      __syncwarp();
      PA(3, 2, t_w);
      mbar_arrive(&sm.dq_empty[buf]);
    }
    PT(t_p);
    pass_turn(sem, lane);
    PA(3, 3, t_p);
  }
  PA(3, 4, t_all);
}""")
# ---- dbias writer
sub(ep, """  constexpr int C4 = kTileQ / 4;
#pragma unroll 1
  for (int i = 0; i < T_tiles; ++i) {
    mbar_wait(&sm.dbias_full, i & 1);
    int* sem = p.dbias_sem + ((int64_t(b) * f.H + h) * T_tiles + i) * J + jb;
    wait_turn(sem, g);""", """  constexpr int C4 = kTileQ / 4;
  const bool prof_on = lane == 0;
  PT(t_all);
#pragma unroll 1
  for (int i = 0; i < T_tiles; ++i) {
    PT(t_f);
    mbar_wait(&sm.dbias_full, i & 1);
    PA(4, 0, t_f);
    int* sem = p.dbias_sem + ((int64_t(b) * f.H + h) * T_tiles + i) * J + jb;
    PT(t_t);
    wait_turn(sem, g);
    PA(4, 1, t_t);""")
sub(ep, """    __syncwarp();
    mbar_arrive(&sm.dbias_empty);
    pass_turn(sem, lane);
  }
}""", """    __syncwarp();
    mbar_arrive(&sm.dbias_empty);
    PT(t_p);
    pass_turn(sem, lane);
    PA(4, 2, t_p);
  }
  PA(4, 3, t_all);
}""")
# ---- kernel: zero smem prof, flush at end
sub(kc, """  if (threadIdx.x == 0) {
    mbar_init(&sm.kv_full, kBwdLoadThreads);""", """  for (int e = threadIdx.x; e < 5 * 16; e += blockDim.x) (&sm.prof[0][0])[e] = 0;
  if (threadIdx.x == 0) {
    mbar_init(&sm.kv_full, kBwdLoadThreads);""")
sub(kc, """    sm90_backward_store_dkdv<T, D, S::A>(p, acc, blk.g, blk.b, blk.h, blk.jb, w);
  }
}""", """    sm90_backward_store_dkdv<T, D, S::A>(p, acc, blk.g, blk.b, blk.h, blk.jb, w);
  }
  __syncthreads();
  if (threadIdx.x < 5 * 16) atomicAdd(&g_bwd_prof[0][0] + threadIdx.x, (&sm.prof[0][0])[threadIdx.x]);
  if (threadIdx.x == 0) atomicAdd(&g_bwd_prof[4][15], 1ull);
}""")
sub(kc, """  attention_dbias_finish_kernel<BT>
      <<<finish, dim3(kBwdFinishTile, kBwdFinishRows), 0, stream>>>(p, sq_pad, sk_pad);
}""", """  attention_dbias_finish_kernel<BT>
      <<<finish, dim3(kBwdFinishTile, kBwdFinishRows), 0, stream>>>(p, sq_pad, sk_pad);
  {
    static int calls = 0;
    unsigned long long h[5][16];
    cudaStreamSynchronize(stream);
    cudaMemcpyFromSymbol(h, g_bwd_prof, sizeof(h));
    const unsigned long long zero[5][16] = {};
    cudaMemcpyToSymbol(g_bwd_prof, zero, sizeof(zero));
    if (++calls % 8 == 0) {
      const double ctas = double(h[4][15]);
      fprintf(stderr, "PROF D=%d S=%d ctas=%.0f per-CTA kcycles:", D, f.Sq, ctas);
      const char* names[5] = {"wg0", "wg1", "prod", "dqw", "dbw"};
      for (int r = 0; r < 5; ++r) {
        fprintf(stderr, " | %s", names[r]);
        for (int s = 0; s < (r == 4 ? 4 : 10); ++s) fprintf(stderr, " %.1f", h[r][s] / ctas / 1000.0);
      }
      fprintf(stderr, "\\n");
    }
  }
}""")
sub(kc, "#include <cstdint>\n", "#include <cstdint>\n#include <cstdio>\n")
print("patched")
