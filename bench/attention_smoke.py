#!/usr/bin/env python3
"""A quick check of the attention kernels before a longer GPU run: forward + backward at a few small
shapes (one and several key blocks, query tiles and slice groups, head dims 16, 32, 64) against
PyTorch's float32 math, and twice for bitwise repeatability. Exits 1 on a relative L2 error above
3% or a difference between calls; prints one line per shape. Run it under `timeout`: a kernel that
deadlocks shows as the time limit."""
from __future__ import annotations

import sys

import torch

import tpfkit as tpf
from tpfkit.ops.torch_reference import triangle_attention_torch

GRADS = ("dq", "dk", "dv", "dbias")


def run(fn, q, k, v, bias, mask, grad):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, bias)]
    o = fn(*leaves, mask)
    o.backward(grad)
    torch.cuda.synchronize()
    return {"o": o.detach(), **{n: t.grad for n, t in zip(GRADS, leaves)}}


def main() -> int:
    ok = True
    g = torch.Generator(device="cpu").manual_seed(5)
    for B, N, H, S, D in [(2, 5, 2, 70, 32), (1, 9, 2, 300, 16), (1, 3, 2, 200, 64), (1, 8, 4, 256, 32)]:
        def randn(*shape):
            return torch.randn(*shape, generator=g).to("cuda", torch.bfloat16)

        q, k, v, grad = randn(B, N, H, S, D), randn(B, N, H, S, D), randn(B, N, H, S, D), randn(B, N, H, S, D)
        bias = randn(B, 1, H, S, S)
        mask = (torch.rand(B, N, 1, 1, S, generator=g) < 0.85).to("cuda")
        mask[-1, -1] = False
        ours = run(tpf.triangle_attention, q, k, v, bias, mask, grad)
        again = run(tpf.triangle_attention, q, k, v, bias, mask, grad)
        ref = run(triangle_attention_torch, *(t.float() for t in (q, k, v, bias)), mask, grad.float())
        errs = {}
        for name in ("o",) + GRADS:
            r = ref[name].double()
            errs[name] = (torch.linalg.vector_norm(ours[name].double() - r) /
                          torch.linalg.vector_norm(r).clamp_min(1e-30)).item()
        same = all(torch.equal(ours[n], again[n]) for n in ("o",) + GRADS)
        finite = all(torch.isfinite(ours[n]).all().item() for n in ("o",) + GRADS)
        good = same and finite and max(errs.values()) < 0.03
        ok &= good
        print(f"B={B} N={N} H={H} S={S} D={D}: " + " ".join(f"{n} {100 * e:.3f}%" for n, e in errs.items())
              + f" repeatable={same} finite={finite} {'ok' if good else 'FAILED'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
