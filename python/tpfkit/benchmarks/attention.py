"""Triangle attention: forward and forward+backward time against PyTorch (and peers on GPUs).

B = 1, N = S, H = 4, tail keys masked. On the CPU the peer is plain PyTorch eager; attention_gpu.py
adds the GPU peers (SDPA, TriFast, cuEquivariance) and errors against FP64.
"""
from __future__ import annotations

import argparse
from typing import Callable, Optional

import torch

from tpfkit.benchmarks.results import add_run_arguments, default_dtype, write_json
from tpfkit.benchmarks.timing import median_ms
from tpfkit.ops.attention import triangle_attention
from tpfkit.ops.torch_reference import triangle_attention_torch

AttentionFn = Callable[..., torch.Tensor]


def make_inputs(S: int, D: int, H: int, dtype: torch.dtype, device: torch.device, seed: int,
                masked_fraction: float = 0.1, B: int = 1):
    """Random triangle-attention inputs with the tail keys masked (N = S)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    shape = (B, S, H, S, D)
    q, k, v = (torch.randn(shape, generator=g).to(device=device, dtype=dtype) for _ in range(3))
    bias = torch.randn((B, 1, H, S, S), generator=g).to(device=device, dtype=dtype)
    mask = torch.ones((B, S, 1, 1, S), dtype=torch.bool)
    n_masked = int(S * masked_fraction)
    if n_masked:
        mask[..., S - n_masked:] = False
    grad = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    return q, k, v, bias, mask.to(device), grad


def time_impl(fn: AttentionFn, inputs, device: torch.device, repeats: int) -> tuple[float, float]:
    """(forward ms, forward+backward ms), medians."""
    q, k, v, bias, mask, grad = inputs
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v, bias)]

    def forward():
        with torch.no_grad():
            return fn(q, k, v, bias, mask)

    def forward_backward():
        for t in leaves:
            t.grad = None
        out = fn(*leaves, mask)
        out.backward(grad)

    return (median_ms(forward, device, repeats=repeats),
            median_ms(forward_backward, device, repeats=repeats))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256], help="S (= N)")
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--heads", type=int, default=4)
    add_run_arguments(parser)


def run(args: argparse.Namespace, extra_impls: Optional[dict[str, AttentionFn]] = None) -> int:
    device = torch.device(args.device)
    dtype = default_dtype(args, device)
    impls: dict[str, AttentionFn] = {
        "tpfkit": triangle_attention,
        "torch_eager": triangle_attention_torch,
    }
    impls.update(extra_impls or {})
    rows = []
    print(f"triangle attention, B=1, N=S, H={args.heads}, D={args.head_dim}, {dtype}, {device}")
    print(f"{'impl':<18}{'S':>6}{'fwd ms':>12}{'fwd+bwd ms':>14}")
    for S in args.sizes:
        inputs = make_inputs(S, args.head_dim, args.heads, dtype, device, seed=S)
        for name, fn in impls.items():
            fwd, fwd_bwd = time_impl(fn, inputs, device, args.repeats)
            rows.append({"impl": name, "D": args.head_dim, "S": S, "fwd_ms": fwd,
                         "fwd_bwd_ms": fwd_bwd})
            print(f"{name:<18}{S:>6}{fwd:>12.2f}{fwd_bwd:>14.2f}", flush=True)
    if args.json:
        write_json(args.json, rows, device)
    return 0
