#!/usr/bin/env python3
"""Instruments the Hopper attention backward with clock64 timers, for a profiling build only (never
committed): run it on a copy of the tree (a git worktree), build the kernels there
(`scripts/build-cuda`), carry the library as .prebuilt/ab/NAME/libtpf_cuda.so.xz and run
`AB_AREAS=attention scripts/gpu-check ab`. Every 8th backward call prints one line, in thousands of
cycles per CTA (thread 0 of each role records; the CTA count rides in slot [4][15]):
  wg0, wg1 (consumer warpgroups): the waits for K/V, for a stage's loads, the S^T/dP^T MMAs, the
    softmax/dS, the named barrier before the dQ MMA (both warpgroups', or the warpgroup's own with
    split D), the dV/dK/dQ MMAs, the waits for a free dQ staging buffer (dead slices' zero partials
    included), the dQ staging, the wait for the dbias staging (dbias_empty) and the total;
  prod: the K/V prologue, its waits for a free stage and its issue time;
  dqw (the dQ writer's thread): turn waits, dq_full waits, copies (through bulk_commit +
    bulk_wait_read), completion + release (bulk_wait, fence, pass_turn) and total;
  dbw (the single dbias writer thread): dbias_full waits, turn waits, copy + release and total.
  With write_in_turns (9f8280b) the writers' columns are instead: dqw turn waits, issue (full
  waits + copies), completion + release, tiles issued early (a count per CTA), total; dbw turn
  waits, issue, completion + release, total.
Usage: python3 bench/instrument_attention_bwd.py TREE
"""
import sys
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

  // Keys and values""", """  const AttentionForwardParams& f = p.fwd;
  const int tid = threadIdx.x;
  const bool prof_on = tid == 0;
  PT(t_kv);

  // Keys and values""")
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
sub(ml, """      if (!slice_live) {  // a zero partial (the first key block stores it as the sum's start)
        mbar_wait(&sm.dq_empty[buf], ((staged / DQS) & 1) ^ 1);""", """      if (!slice_live) {  // a zero partial (the first key block stores it as the sum's start)
        PT(t_q0);
        mbar_wait(&sm.dq_empty[buf], ((staged / DQS) & 1) ^ 1);
        PA(w, 6, t_q0);""")
sub(ml, """        float st[8][4], dpt[8][4];  // S^T, dP^T: this warp's 16 keys x 64 queries
        wgmma_fence();""", """        float st[8][4], dpt[8][4];  // S^T, dP^T: this warp's 16 keys x 64 queries
        PT(t_m1);
        wgmma_fence();""")
sub(ml, """        fence_regs(st);
        fence_regs(dpt);
""", """        fence_regs(st);
        fence_regs(dpt);
        PA(w, 2, t_m1);
        PT(t_sm);
""")
sub(ml, """        fence_proxy_async();
      }
      if constexpr (kSplit)
        named_barrier(1 + w, 128);
      else
        named_barrier(1, 256);
""", """        fence_proxy_async();
        PA(w, 3, t_sm);
      }
      PT(t_nb);
      if constexpr (kSplit)
        named_barrier(1 + w, 128);
      else
        named_barrier(1, 256);
      PA(w, 4, t_nb);
      PT(t_m2);
""")
sub(ml, """      fence_regs(da);
      ++computed;

      mbar_wait(&sm.dq_empty[buf], ((staged / DQS) & 1) ^ 1);""", """      fence_regs(da);
      ++computed;
      PA(w, 5, t_m2);
      PT(t_qe);
      mbar_wait(&sm.dq_empty[buf], ((staged / DQS) & 1) ^ 1);
      PA(w, 6, t_qe);
      PT(t_qs);""")
sub(ml, """      fence_proxy_async();  // the writer may copy the stage by TMA (async proxy)
      mbar_arrive(&sm.dq_full[buf]);
      ++staged;""", """      fence_proxy_async();  // the writer may copy the stage by TMA (async proxy)
      mbar_arrive(&sm.dq_full[buf]);
      PA(w, 7, t_qs);
      ++staged;""")
sub(ml, """    mbar_wait(&sm.dbias_empty, (i & 1) ^ 1);
    if (!kSplit || w == 0) {""", """    PT(t_de);
    mbar_wait(&sm.dbias_empty, (i & 1) ^ 1);
    PA(w, 8, t_de);
    if (!kSplit || w == 0) {""")
sub(ml, """    mbar_arrive(&sm.dbias_full);
  }
}""", """    mbar_arrive(&sm.dbias_full);
  }
  PA(w, 9, t_all);
}""")
# ---- writers. Either the one-tile-at-a-time writers, or write_in_turns (the writers that issue the
# next tile's copies before waiting for this one's, 9f8280b), whose slots are: turn waits, issue
# (full waits + copies), completion + release, 1000 x the tiles issued early (printed as a count
# per CTA; dQ only: slot 3) and total (dQ: slot 4; dbias: slot 3, its early count left out).
if "write_in_turns" in open(ep).read():
    sub(ep, """                                               Issue issue) {
  if (T <= 0) return;""", """                                               Issue issue, unsigned long long* prof,
                                               int total_slot, bool count_early) {
  if (T <= 0) return;
  const long long t_all = clock64();
#define PW(slot, t0) (prof[slot] += clock64() - (t0))""")
    sub(ep, """  int* sem = sem_of(0);
  wait_turn(sem, turn);
  fence_proxy_async_all();  // the turns before's sums (acquired above) to the bulk copies
  issue(0);""", """  int* sem = sem_of(0);
  PT(t_t0);
  wait_turn(sem, turn);
  PW(0, t_t0);
  fence_proxy_async_all();  // the turns before's sums (acquired above) to the bulk copies
  PT(t_i0);
  issue(0);
  PW(1, t_i0);""")
    sub(ep, """      fence_proxy_async_all();
      bulk_wait_all_but(issue(i + 1));  // tile i's copies complete, i + 1's under way
      fence_proxy_async_all();
      pass_turn(sem);
      sem = next;
      continue;""", """      fence_proxy_async_all();
      PT(t_i);
      const int newest = issue(i + 1);
      PW(1, t_i);
      PT(t_c);
      bulk_wait_all_but(newest);  // tile i's copies complete, i + 1's under way
      fence_proxy_async_all();
      pass_turn(sem);
      PW(2, t_c);
      if (count_early) prof[3] += 1000;
      sem = next;
      continue;""")
    sub(ep, """    bulk_wait();
    fence_proxy_async_all();
    pass_turn(sem);
    if (next == nullptr) break;
    sem = next;
    wait_turn(sem, turn);
    fence_proxy_async_all();
    issue(i + 1);
  }
}""", """    PT(t_c);
    bulk_wait();
    fence_proxy_async_all();
    pass_turn(sem);
    PW(2, t_c);
    if (next == nullptr) break;
    sem = next;
    PT(t_t);
    wait_turn(sem, turn);
    PW(0, t_t);
    fence_proxy_async_all();
    PT(t_i);
    issue(i + 1);
    PW(1, t_i);
  }
  PW(total_slot, t_all);
#undef PW
}""")
    sub(ep, """      T_tiles, jb, [&](int i) { return sems + i; }, staged_ready, issue);""",
        """      T_tiles, jb, [&](int i) { return sems + i; }, staged_ready, issue, sm.prof[3], 4, true);""")
    sub(ep, """      [&](int i) { return mbar_ready(&sm.dbias_full, i & 1); }, issue);""",
        """      [&](int i) { return mbar_ready(&sm.dbias_full, i & 1); }, issue, sm.prof[4], 3, false);""")
# The one-tile-at-a-time writers (main since 8f977fc):
sub_old = (lambda *args, **kw: None) if "write_in_turns" in open(ep).read() else sub
# ---- dq writer: one thread (warp 1, lane 0), bulk copies in every key block
sub_old(ep, """  if ((threadIdx.x & 31) != 0) return;""", """  if ((threadIdx.x & 31) != 0) return;
  const bool prof_on = true;
  PT(t_all);""")
sub_old(ep, """    wait_turn(sem, jb);
    fence_proxy_async_all();""", """    PT(t_t);
    wait_turn(sem, jb);
    PA(3, 0, t_t);
    fence_proxy_async_all();""")
sub_old(ep, """      mbar_wait(&sm.dq_full[buf], (staged / DQS) & 1);
      const int n = g * A + u;
      if (n < f.N && (first || sm.dq_valid[buf] != 0)) {""", """      PT(t_f);
      mbar_wait(&sm.dq_full[buf], (staged / DQS) & 1);
      PA(3, 1, t_f);
      PT(t_w);
      const int n = g * A + u;
      if (n < f.N && (first || sm.dq_valid[buf] != 0)) {""")
sub_old(ep, """        bulk_commit();
        bulk_wait_read();
      }
      mbar_arrive(&sm.dq_empty[buf]);
    }
    bulk_wait();
    fence_proxy_async_all();
    pass_turn(sem);
  }
}""", """        bulk_commit();
        bulk_wait_read();
      }
      PA(3, 2, t_w);
      mbar_arrive(&sm.dq_empty[buf]);
    }
    PT(t_p);
    bulk_wait();
    fence_proxy_async_all();
    pass_turn(sem);
    PA(3, 3, t_p);
  }
  PA(3, 4, t_all);
}""")
# ---- dbias writer (one thread: part 0, lane 0)
sub_old(ep, """  if (part != 0 || (threadIdx.x & 31) != 0) return;""", """  if (part != 0 || (threadIdx.x & 31) != 0) return;
  const bool prof_on = true;
  PT(t_all);""")
sub_old(ep, """    mbar_wait(&sm.dbias_full, i & 1);
    int* sem = p.dbias_sem + (bh * T_tiles + i) * J + jb;
    wait_turn(sem, turn);""", """    PT(t_f);
    mbar_wait(&sm.dbias_full, i & 1);
    PA(4, 0, t_f);
    int* sem = p.dbias_sem + (bh * T_tiles + i) * J + jb;
    PT(t_t);
    wait_turn(sem, turn);
    PA(4, 1, t_t);
    PT(t_c);""")
sub_old(ep, """    bulk_wait();
    fence_proxy_async_all();
    pass_turn(sem);
  }
}""", """    bulk_wait();
    fence_proxy_async_all();
    pass_turn(sem);
    PA(4, 2, t_c);
  }
  PA(4, 3, t_all);
}""")
# ---- kernel: zero smem prof, flush at end. The kernel body has no return: threads leaving a role
# function early (load's tid != 0, the writers' idle lanes) fall through to the __syncthreads.
sub(kc, """  if (threadIdx.x == 0) {
    mbar_init(&sm.kv_full, kBwdLoadThreads);""", """  for (int e = threadIdx.x; e < 5 * 16; e += blockDim.x) (&sm.prof[0][0])[e] = 0;
  if (threadIdx.x == 0) {
    mbar_init(&sm.kv_full, kBwdLoadThreads);""")
sub(kc, """        split ? w * S::DC : 0, w);
  }
}""", """        split ? w * S::DC : 0, w);
  }
  __syncthreads();
  if (threadIdx.x < 5 * 16) atomicAdd(&g_bwd_prof[0][0] + threadIdx.x, (&sm.prof[0][0])[threadIdx.x]);
  if (threadIdx.x == 0) atomicAdd(&g_bwd_prof[4][15], 1ull);
}""")
sub(kc, """  attention_dbias_finish_kernel<BT><<<finish, dim3(kBwdFinishTile, kBwdFinishRows), 0, stream>>>(
      p, grid.query_tiles, grid.key_blocks, S::Config::kKeyBlock);
}""", """  attention_dbias_finish_kernel<BT><<<finish, dim3(kBwdFinishTile, kBwdFinishRows), 0, stream>>>(
      p, grid.query_tiles, grid.key_blocks, S::Config::kKeyBlock);
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
      const int slots[5] = {10, 10, 3, 5, 4};
      for (int r = 0; r < 5; ++r) {
        fprintf(stderr, " | %s", names[r]);
        for (int s = 0; s < slots[r]; ++s) fprintf(stderr, " %.1f", h[r][s] / ctas / 1000.0);
      }
      fprintf(stderr, "\\n");
    }
  }
}""")
sub(kc, "#include <cstdint>\n", "#include <cstdint>\n#include <cstdio>\n")
print("patched")
