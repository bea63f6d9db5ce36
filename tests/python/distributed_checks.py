"""Multi-rank checks of tpfkit.distributed, run by test_distributed.py (gloo, CPU) and
tests/gpu/test_distributed_gpu.py (NCCL, one GPU per rank).

`python distributed_checks.py --world P --out DIR --seed S [--backend nccl --dtype bfloat16]`
spawns P ranks; every rank runs every check (all ranks enter the same collectives in the same order,
and a check records its failures instead of raising, so one failing rank cannot leave the others
waiting) and writes DIR/rank<r>.json: {check: {"ok": bool, "detail": str}}.

Each sharded result is compared by the suite's accuracy rule (accuracy.py) against an FP64
reference, with the single-process result in the same precision as the baseline and one more
rounding in the error model for each partial result the sharded version adds up in working
precision (a gradient summed over P ranks' blocks rounds P - 1 more times than a single kernel's).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import seeds  # noqa: E402
from accuracy import accuracy_failure  # noqa: E402

# Roundings of one sharded op's own chain (its output and the one stored intermediate, as the
# single-process op), before the partial sums across ranks (accuracy.py).
OP_ROUNDINGS = 2

SIZES = {  # per device kind: token counts are never multiples of P, channels rarely
    "cpu": dict(B=2, H=2, D=5, C=7, c_z=14, c_s=16, pair_heads=2, pair_dim=6, bias_heads=2,
                bias_dim=5, model_B=2),
    "cuda": dict(B=2, H=4, D=32, C=64, c_z=64, c_s=32, pair_heads=4, pair_dim=32, bias_heads=4,
                 bias_dim=32, model_B=1),
}


def token_counts(world: int, device: str) -> list[int]:
    """Not multiples of P; on the CPU also fewer tokens than ranks (the last ranks hold padding)."""
    if device == "cpu":
        return [4 * world + 1, max(1, world - 1)]
    return [64 * world + 17]


class Checker:
    """Collects failures of one check instead of raising them."""

    def __init__(self, seed: int):
        self.seed = seed
        self.failures: list[str] = []

    def fa3(self, name: str, out: torch.Tensor, baseline, ref: torch.Tensor,
            terms: int = 1) -> None:
        """The suite's accuracy rule (accuracy.py). baseline: the single-process result, or
        several equally valid ones (the largest error counts); terms: how many partial results
        (one per rank's block) `out` is the working-precision sum of, each sum rounding once
        more on top of the op's own roundings."""
        failure = accuracy_failure(name, out, baseline, ref.double(), roundings=OP_ROUNDINGS + terms,
                                   context=f"seed {self.seed}")
        if failure:
            self.failures.append(failure)

    def equal(self, name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        if a.shape != b.shape or not torch.equal(a, b):
            diff = "shapes differ" if a.shape != b.shape else \
                f"max difference {(a.double() - b.double()).abs().max().item():.3e}"
            self.failures.append(f"{name}: not bitwise equal, {diff} (seed {self.seed})")

    def raises(self, name: str, kind: type, words: str, fn) -> None:
        try:
            fn()
        except kind as e:
            if words not in str(e):
                self.failures.append(f"{name}: message {str(e)!r} does not name {words!r}")
            return
        except Exception as e:  # noqa: BLE001 - a wrong exception type is the failure reported
            self.failures.append(
                f"{name}: raised {type(e).__name__} ({e}), expected {kind.__name__}")
            return
        self.failures.append(f"{name}: did not raise {kind.__name__}")


# Layout helpers: attention tensors [B, N (slices), H, N (tokens), D] and bias [B, H, N, N] go
# through RowSharding's pair layout [B, N, N, ...] by moving their token dimension next to N.

def shard_heads(x, sharding):
    return sharding.shard_pair(x.permute(0, 1, 3, 2, 4)).permute(0, 1, 3, 2, 4).contiguous()


def gather_heads(x, sharding):
    return sharding.gather_pair(x.permute(0, 1, 3, 2, 4)).permute(0, 1, 3, 2, 4)


def shard_bias(x, sharding):
    return sharding.shard_pair(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2).contiguous()


def gather_bias(x, sharding):
    return sharding.gather_pair(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def randn(gen, *shape, dtype, device):
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


def random_mask(gen, *shape, device, p=0.25):
    """Random keys masked, plus a few rows with no key at all."""
    mask = torch.rand(shape, generator=gen) > p
    mask.view(-1, shape[-1])[:: 5] = False
    return mask.to(device)


def grads_of(out, leaves, grad):
    for t in leaves:
        t.grad = None
    out.backward(grad)
    return [t.grad for t in leaves]


# The checks. Each takes (checker, env) and returns nothing; env carries the rank's settings.

def check_transpose(c: Checker, env) -> None:
    from tpfkit.distributed import RowSharding, transpose_pair
    s = env.sizes
    for n in token_counts(env.world, env.device.type):
        sh = RowSharding.of(n)
        z = randn(env.gen, s["B"], n, n, s["C"], dtype=env.dtype, device=env.device)
        mask = random_mask(env.gen, s["B"], n, n, device=env.device)
        grad = randn(env.gen, s["B"], n, n, s["C"], dtype=env.dtype, device=env.device)
        local = sh.shard_pair(z).requires_grad_()
        out = transpose_pair(local, sh)
        out.backward(sh.shard_pair(grad.transpose(1, 2)))
        c.equal(f"transpose N={n}", sh.gather_pair(out.detach()), z.transpose(1, 2))
        c.equal(f"transpose backward N={n}", sh.gather_pair(local.grad), grad)
        mask_t = transpose_pair(sh.shard_mask(mask, s["B"]), sh)
        c.equal(f"mask transpose N={n}", sh.gather_pair(mask_t), mask.transpose(1, 2))
        c.equal(f"transpose twice N={n}", transpose_pair(transpose_pair(local.detach(), sh), sh),
                local.detach())


def check_replication(c: Checker, env) -> None:
    """gather_rows into a replicated tensor (same gradient on every rank: each keeps its rows) and
    sum_gradients out of one (each rank's partial gradient: summed)."""
    from tpfkit.distributed import RowSharding, gather_rows, sum_gradients
    s = env.sizes
    n = token_counts(env.world, env.device.type)[0]
    sh = RowSharding.of(n)
    full = randn(env.gen, s["B"], s["H"], sh.n_padded, s["D"], dtype=env.dtype, device=env.device)
    grad = randn(env.gen, *full.shape, dtype=env.dtype, device=env.device)
    local = full[:, :, sh.local_rows].clone().requires_grad_()
    out = gather_rows(local, 2, sh)
    out.backward(grad)
    c.equal("gather_rows", out.detach(), full)
    c.equal("gather_rows backward", local.grad, grad[:, :, sh.local_rows])

    parts = [randn(env.gen, *full.shape, dtype=env.dtype, device=env.device)
             for _ in range(env.world)]
    replicated = full.clone().requires_grad_()
    (same,) = sum_gradients(sh, replicated)
    c.equal("sum_gradients forward", same.detach(), full)
    same.backward(parts[env.rank])
    c.fa3("sum_gradients backward", replicated.grad, sum(parts), sum(p.double() for p in parts))


def check_contraction(c: Checker, env) -> None:
    from tpfkit.distributed import RowSharding, sharded_triangle_contraction
    s = env.sizes
    equations = {"outgoing": "bikc,bjkc->bijc", "incoming": "bkic,bkjc->bijc"}
    for n in token_counts(env.world, env.device.type):
        sh = RowSharding.of(n)
        for direction, eq in equations.items():
            a, b, grad = (randn(env.gen, s["B"], n, n, s["C"], dtype=env.dtype, device=env.device)
                          for _ in range(3))
            ref_leaves = [a.double().requires_grad_(), b.double().requires_grad_()]
            ref = torch.einsum(eq, *ref_leaves)
            ref_grads = grads_of(ref, ref_leaves, grad.double())
            base_leaves = [a.clone().requires_grad_(), b.clone().requires_grad_()]
            base = torch.einsum(eq, *base_leaves)
            base_grads = grads_of(base, base_leaves, grad)
            for chunks in (1, 2, 5):
                name = f"{direction} N={n} chunks={chunks}"
                leaves = [sh.shard_pair(a).requires_grad_(), sh.shard_pair(b).requires_grad_()]
                out = sharded_triangle_contraction(*leaves, direction, sh, chunks)
                got = grads_of(out, leaves, sh.shard_pair(grad))
                c.fa3(f"{name} x", sh.gather_pair(out.detach()), base, ref)
                for label, g, bg, rg in zip("ab", got, base_grads, ref_grads):
                    c.fa3(f"{name} d{label}", sh.gather_pair(g), bg, rg)


def check_ring_attention(c: Checker, env) -> None:
    import tpfkit as tpf
    from tpfkit.distributed import RowSharding, ring_triangle_attention
    from tpfkit.ops.torch_reference import triangle_attention_torch
    s = env.sizes
    for n in token_counts(env.world, env.device.type):
        sh = RowSharding.of(n)
        shape = (s["B"], n, s["H"], n, s["D"])
        q, k, v, grad = (randn(env.gen, *shape, dtype=env.dtype, device=env.device)
                         for _ in range(4))
        bias = randn(env.gen, s["B"], s["H"], n, n, dtype=env.dtype, device=env.device)
        for masked in (False, True):
            mask = random_mask(env.gen, s["B"], n, n, device=env.device) if masked else None
            name = f"ring attention N={n} {'masked' if masked else 'unmasked'}"
            ref_leaves = [t.double().requires_grad_() for t in (q, k, v, bias)]
            ref_grads = grads_of(triangle_attention_torch(*ref_leaves, mask), ref_leaves,
                                 grad.double())
            ref = triangle_attention_torch(*[t.detach() for t in ref_leaves], mask)
            base_leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
            base = tpf.triangle_attention(*base_leaves, mask)
            base_grads = grads_of(base, base_leaves, grad)
            runs = []
            for _ in range(2):
                leaves = [shard_heads(t, sh).requires_grad_() for t in (q, k, v)]
                leaves.append(shard_bias(bias, sh).requires_grad_())
                out = ring_triangle_attention(*leaves, sh.shard_mask(mask, s["B"], env.device), sh)
                runs.append([out.detach()] + grads_of(out, leaves, shard_heads(grad, sh)))
            for i, (a, b) in enumerate(zip(*runs)):
                c.equal(f"{name} deterministic ({['o', 'dq', 'dk', 'dv', 'dbias'][i]})", a, b)
            out, dq, dk, dv, dbias = runs[0]
            c.fa3(f"{name} o", gather_heads(out, sh), base, ref)
            c.fa3(f"{name} dq", gather_heads(dq, sh), base_grads[0], ref_grads[0])
            # dk, dv: one partial per bias block (query rows) of the ring; dbias: one per rank
            for label, g, bg, rg in zip(("dk", "dv"), (dk, dv), base_grads[1:3], ref_grads[1:3]):
                c.fa3(f"{name} {label}", gather_heads(g, sh), bg, rg, terms=env.world)
            c.fa3(f"{name} dbias", gather_bias(dbias, sh), base_grads[3], ref_grads[3],
                  terms=env.world)


def check_subgroup(c: Checker, env) -> None:
    """The primitives on a process group that is not the default one: the last two ranks (group
    ranks differ from global ranks when there are 3), while the other ranks stay out."""
    import tpfkit as tpf
    from tpfkit.distributed import RowSharding, ring_triangle_attention, transpose_pair
    from tpfkit.ops.torch_reference import triangle_attention_torch
    members = [env.world - 2, env.world - 1]
    group = dist.new_group(members)
    s, n = env.sizes, 2 * token_counts(env.world, env.device.type)[0] + 1
    z = randn(env.gen, s["B"], n, n, s["C"], dtype=env.dtype, device=env.device)
    q, k, v = (randn(env.gen, s["B"], n, s["H"], n, s["D"], dtype=env.dtype, device=env.device)
               for _ in range(3))
    bias = randn(env.gen, s["B"], s["H"], n, n, dtype=env.dtype, device=env.device)
    mask = random_mask(env.gen, s["B"], n, n, device=env.device)
    if env.rank not in members:
        return
    sh = RowSharding.of(n, group)
    if sh.rank != members.index(env.rank):
        c.failures.append(f"group rank {sh.rank} for global rank {env.rank}")
    c.equal("subgroup transpose", sh.gather_pair(transpose_pair(sh.shard_pair(z), sh)),
            z.transpose(1, 2))
    out = ring_triangle_attention(*(shard_heads(t, sh) for t in (q, k, v)), shard_bias(bias, sh),
                                  sh.shard_mask(mask, s["B"], env.device), sh)
    ref = triangle_attention_torch(q.double(), k.double(), v.double(), bias.double(), mask)
    base = tpf.triangle_attention(q, k, v, bias, mask)
    c.fa3("subgroup ring attention", gather_heads(out, sh), base, ref)


def make_pairformer(env):
    """A 2-block PairFormer with a single track and every weight perturbed (the zero "final"
    initializations would leave whole branches untested). Same weights on every rank."""
    from tpfkit.nn import PairFormer, TriangleMultiplication, set_backend
    s = env.sizes
    torch.manual_seed(env.seed)
    model = PairFormer(2, s["c_z"], c_s=s["c_s"], c_hidden_pair_att=s["pair_dim"],
                       no_heads_pair=s["pair_heads"], c_hidden_pair_bias=s["bias_dim"],
                       no_heads_pair_bias=s["bias_heads"], transition_n=2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    # The single-process baseline runs what the sharded model runs: the attention op, and the
    # PyTorch triangle multiplication.
    set_backend(model, "turbo")
    for m in model.modules():
        if isinstance(m, TriangleMultiplication):
            m.backend = "reference"
    return model.to(device=env.device, dtype=env.dtype)


def run_model(model, inputs, grads):
    """Forward, backward with the given output gradients; returns outputs and input/param grads."""
    s, z, single_mask, pair_mask = inputs
    s, z = s.clone().requires_grad_(), z.clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    s_out, z_out = model(s, z, single_mask, pair_mask)
    torch.autograd.backward([s_out, z_out], list(grads))
    return s_out.detach(), z_out.detach(), s, z


def check_pairformer(c: Checker, env) -> None:
    from tpfkit.distributed import ContextParallel
    from tpfkit.nn import set_backend
    s = env.sizes
    n, B = token_counts(env.world, env.device.type)[0], s["model_B"]
    z = randn(env.gen, B, n, n, s["c_z"], dtype=env.dtype, device=env.device)
    single = randn(env.gen, B, n, s["c_s"], dtype=env.dtype, device=env.device)
    single_mask = torch.rand(B, n, generator=env.gen).to(env.device) > 0.15
    pair_mask = random_mask(env.gen, B, n, n, device=env.device, p=0.1)
    grad_z = randn(env.gen, B, n, n, s["c_z"], dtype=env.dtype, device=env.device)
    grad_s = randn(env.gen, B, n, s["c_s"], dtype=env.dtype, device=env.device)
    inputs, grads = (single, z, single_mask, pair_mask), (grad_s, grad_z)

    model = make_pairformer(env)
    reference = set_backend(copy.deepcopy(model).double(), "reference")
    ref_s, ref_z, ref_in_s, ref_in_z = run_model(
        reference, (single.double(), z.double(), single_mask, pair_mask),
        (grad_s.double(), grad_z.double()))
    ref_params = dict(reference.named_parameters())
    # Two single-process baselines: the tokens in order and permuted (the PairFormer is
    # permutation-equivariant). Through two blocks, rounding differences grow, and how far one
    # summation order lands from FP64 varies by about 2x; the larger of the two errors is the
    # error of this precision, not the luck of one order.
    perm = torch.randperm(n, generator=env.gen).to(env.device)
    inverse = torch.argsort(perm)
    baselines = []
    for order in (None, perm):
        def reorder(t, pair, idx=order):
            return t if idx is None else (t[:, idx][:, :, idx] if pair else t[:, idx])
        out_s, out_z, in_s, in_z = run_model(
            model, (reorder(single, False), reorder(z, True), reorder(single_mask, False),
                    reorder(pair_mask, True)), (reorder(grad_s, False), reorder(grad_z, True)))
        back = inverse if order is not None else None
        baselines.append([reorder(out_s, False, back), reorder(out_z, True, back),
                          reorder(in_s.grad, False, back), reorder(in_z.grad, True, back),
                          {name: p.grad.clone() for name, p in model.named_parameters()}])
    base_s, base_z, base_ds, base_dz, base_params = (list(t) for t in zip(*baselines))

    # Default, then the PairFormer's own checkpointing, then the trimul's activations kept.
    for variant in ("", "checkpointed", "trimul activations kept"):
        model.checkpoint = variant == "checkpointed"
        label = f"PairFormer N={n} {variant}".strip()
        runs = []
        for _ in range(1 if variant else 2):
            cp = ContextParallel(model, trimul_chunks=3,
                                 trimul_recompute=not variant.startswith("trimul"))
            sh = cp.sharding(n)
            local = cp.shard(z, pair_mask, single, single_mask)
            local_grads = (torch.nn.functional.pad(grad_s, (0, 0, 0, sh.n_padded - n)),
                           sh.shard_pair(grad_z))
            s_out, z_out, in_s, in_z = run_model(cp, (local[0], local[1], local[2], local[3]),
                                                 local_grads)
            cp.all_reduce_gradients()
            out_s, out_z = cp.gather(s_out, z_out, n)
            runs.append([out_s, out_z, in_s.grad[:, :n], sh.gather_pair(in_z.grad)] +
                        [p.grad.clone() for _, p in model.named_parameters()])
            # The single track is replicated: s, its gradient and every parameter's gradient
            # must be the same bits on every rank.
            for i, t in enumerate([runs[-1][0], runs[-1][2]] + runs[-1][4:]):
                copies = [torch.empty_like(t) for _ in range(env.world)]
                dist.all_gather(copies, t.contiguous())
                for r, other in enumerate(copies):
                    c.equal(f"{label} tensor {i} on rank {r} as on rank {env.rank}", other, t)
        if len(runs) == 2:
            for i, (a, b) in enumerate(zip(*runs)):
                c.equal(f"{label} deterministic (tensor {i})", a, b)
        out_s, out_z, ds, dz, *param_grads = runs[0]
        c.fa3(f"{label} s", out_s, base_s, ref_s)
        c.fa3(f"{label} z", out_z, base_z, ref_z)
        c.fa3(f"{label} ds", ds, base_ds, ref_in_s.grad)
        c.fa3(f"{label} dz", dz, base_dz, ref_in_z.grad)
        # Parameter gradients by sub-module of a block (tri_mul_out, ..., single_transition): a
        # few-element tensor's max error is a single draw, and some are zero in exact arithmetic
        # (the softmax ignores a bias shift), leaving only rounding noise to compare.
        groups: dict[str, list[tuple]] = {}
        for (name, _), g in zip(model.named_parameters(), param_grads):
            group = ".".join(name.split(".")[:4 if ".pair_stack." in name else 3])
            groups.setdefault(group, []).append(
                (g, [b[name] for b in base_params], ref_params[name].grad))
        for group, members in groups.items():
            flat = [torch.cat([m[0].reshape(-1) for m in members]),
                    [torch.cat([m[1][i].reshape(-1) for m in members]) for i in range(2)],
                    torch.cat([m[2].reshape(-1) for m in members])]
            # each rank's partial parameter gradient, summed over the ranks
            c.fa3(f"{label} {group} parameter gradients", *flat, terms=env.world)


def check_errors(c: Checker, env) -> None:
    from tpfkit.distributed import (
        ContextParallel,
        RowSharding,
        ring_triangle_attention,
        sharded_triangle_contraction,
        transpose_pair,
    )
    from tpfkit.nn import PairFormer, TriangleAttention
    sh = RowSharding.of(5)
    n, N = sh.n_local, sh.n_padded
    q = torch.zeros(1, n, 2, N, 4, device=env.device, dtype=env.dtype)
    c.raises("bias shape", ValueError, "bias",
             lambda: ring_triangle_attention(q, q, q, torch.zeros(1, 2, N, N), None, sh))
    c.raises("q shape", ValueError, "q",
             lambda: ring_triangle_attention(q[:, :, :, :1], q, q, torch.zeros(1, 2, n, N), None,
                                             sh))
    c.raises("mask dtype", TypeError, "mask",
             lambda: ring_triangle_attention(q, q, q, q.new_zeros(1, 2, n, N),
                                             q.new_zeros(1, n, N), sh))
    c.raises("transpose shape", ValueError, "x",
             lambda: transpose_pair(torch.zeros(1, N, N, 3), sh))
    a = torch.zeros(1, n, N, 3, device=env.device, dtype=env.dtype)
    c.raises("direction", ValueError, "direction",
             lambda: sharded_triangle_contraction(a, a, "sideways", sh))
    c.raises("b shape", ValueError, "b",
             lambda: sharded_triangle_contraction(a, a[:, :, :, :2], "outgoing", sh))
    c.raises("model type", TypeError, "model", lambda: ContextParallel(TriangleAttention(4, 2, 2)))
    cp = ContextParallel(PairFormer(1, 4, c_hidden_pair_att=2, no_heads_pair=2))
    z = torch.zeros(1, n, N, 4, device=env.device)
    c.raises("missing pair mask", ValueError, "pair_mask", lambda: cp(None, z, None, None))
    c.raises("pair mask shape", ValueError, "pair_mask",
             lambda: cp(None, z, None, torch.ones(1, N, N, dtype=torch.bool, device=env.device)))
    c.raises("token count", ValueError, "tokens", lambda: RowSharding.of(0))


CHECKS = {name[len("check_"):]: fn for name, fn in globals().items() if name.startswith("check_")}


class Env:
    def __init__(self, rank, world, seed, device, dtype):
        self.rank, self.world, self.seed = rank, world, seed
        self.device, self.dtype = device, dtype
        self.sizes = SIZES[device.type]
        self.gen = torch.Generator().manual_seed(seed)  # same stream on every rank


def worker(rank: int, world: int, args) -> None:
    seeds.current = args.seed  # what accuracy.py logs with each check
    os.environ["TPF_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if args.backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend, init_method=f"file://{args.out}/rendezvous", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    results = {}
    for name in args.checks or CHECKS:
        env = Env(rank, world, args.seed, device, getattr(torch, args.dtype))
        checker = Checker(args.seed)
        try:
            CHECKS[name](checker, env)
        except Exception:  # noqa: BLE001 - recorded as this check's failure
            checker.failures.append(traceback.format_exc())
        results[name] = {"ok": not checker.failures, "detail": "\n".join(checker.failures)}
        dist.barrier()
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


def run_ranks(world: int, out: Path, seed: int, backend: str = "gloo", dtype: str = "float32"):
    """Runs every check on `world` ranks in a fresh process tree; returns the seed and
    {check: [result of each rank]}."""
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    if backend == "gloo":  # all ranks on this machine: loopback, whatever the host name resolves to
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cmd = [sys.executable, __file__, "--world", str(world), "--out", str(out), "--seed", str(seed),
           "--backend", backend, "--dtype", dtype]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{world} ranks exited with {proc.returncode} (reproduce with "
                           f"TPF_SEED={seed}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    return seed, {name: [results[name] for results in per_rank] for name in per_rank[0]}


def failures_of(check: str, world: int, seed: int, results: dict) -> str:
    """The failure report of one check over all ranks ("" when it passed everywhere)."""
    if check not in results:
        return f"check {check} did not run on {world} ranks (TPF_SEED={seed})"
    lines = [f"rank {r}: {res['detail']}" for r, res in enumerate(results[check]) if not res["ok"]]
    if not lines:
        return ""
    return f"{check} on {world} ranks (reproduce with TPF_SEED={seed}):\n" + "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--out", required=True, help="folder for the rendezvous file and the results")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--checks", nargs="*", choices=sorted(CHECKS), help="default: all")
    args = p.parse_args(argv)
    mp.spawn(worker, args=(args.world, args), nprocs=args.world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
