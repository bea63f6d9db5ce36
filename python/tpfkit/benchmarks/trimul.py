"""Triangle multiplicative update: forward and forward+backward time against PyTorch (and peers on
GPUs).

B = 1, a tenth of the positions masked, weights scaled like trained ones. On the CPU the peer is plain
PyTorch eager; trimul_gpu.py adds the GPU peers (torch.compile, cuEquivariance), peak memory and
the error against FP64.
"""
from __future__ import annotations

import argparse
from typing import Callable, Optional

import torch

from tpfkit.benchmarks.results import add_run_arguments, default_dtype, write_json
from tpfkit.benchmarks.timing import median_ms
from tpfkit.ops.torch_reference import triangle_multiplicative_update_torch
from tpfkit.ops.trimul import WEIGHT_NAMES, triangle_multiplicative_update

TrimulFn = Callable[..., torch.Tensor]


def make_inputs(S: int, D: int, dtype: torch.dtype, device, seed: int, B: int = 1):
    """x, mask (bool, a tenth False), weights by name (in dtype, biases included), grad_out."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0, shift=0.0):
        return (shift + scale * torch.randn(shape, generator=g)).to(device=device, dtype=dtype)

    x = randn(B, S, S, D)
    mask = (torch.rand((B, S, S), generator=g) > 0.1).to(device)
    w = {
        "norm_in_weight": randn(D, scale=0.2, shift=1.0), "norm_in_bias": randn(D, scale=0.2),
        "p_in_weight": randn(2 * D, D, scale=D ** -0.5), "p_in_bias": randn(2 * D, scale=0.5),
        "g_in_weight": randn(2 * D, D, scale=D ** -0.5), "g_in_bias": randn(2 * D, scale=0.5),
        "norm_out_weight": randn(D, scale=0.2, shift=1.0), "norm_out_bias": randn(D, scale=0.2),
        "p_out_weight": randn(D, D, scale=D ** -0.5), "p_out_bias": randn(D, scale=0.5),
        "g_out_weight": randn(D, D, scale=D ** -0.5), "g_out_bias": randn(D, scale=0.5),
    }
    return x, mask, w, randn(B, S, S, D)


def forward_backward_call(fn: TrimulFn, inputs, direction: str) -> Callable[[], None]:
    """A call of fn's forward+backward on `inputs` (x, mask, weights, grad_out) with gradients for
    x and every weight (fresh leaves, their .grad cleared before each call)."""
    x, mask, w, grad = inputs
    leaves = {"x": x.detach().requires_grad_(True)}
    leaves.update({k: w[k].detach().requires_grad_(True) for k in WEIGHT_NAMES})

    def call() -> None:
        for t in leaves.values():
            t.grad = None
        fn(leaves["x"], direction, mask, **{k: leaves[k] for k in WEIGHT_NAMES}).backward(grad)
    return call


def time_impl(fn: TrimulFn, input_sets, direction: str, device: torch.device,
              repeats: int) -> tuple[float, float]:
    """(forward ms, forward+backward ms), medians; gradients for x and every weight. Calls rotate
    over the input sets (two on a GPU, so that one call's inputs are not in L2 for the next)."""
    backward_calls = [forward_backward_call(fn, inputs, direction) for inputs in input_sets]
    calls = [0]

    def next_set() -> int:
        calls[0] += 1
        return calls[0] % len(input_sets)

    def forward():
        x, mask, w, _ = input_sets[next_set()]
        with torch.no_grad():
            return fn(x, direction, mask, **w)

    def forward_backward():
        backward_calls[next_set()]()

    return (median_ms(forward, device, repeats=repeats),
            median_ms(forward_backward, device, repeats=repeats))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 64, 96], help="S")
    parser.add_argument("--dims", type=int, nargs="+", default=[32], help="D")
    parser.add_argument("--directions", nargs="+", default=["outgoing", "incoming"],
                        choices=["outgoing", "incoming"])
    add_run_arguments(parser)


def run(args: argparse.Namespace, extra_impls: Optional[dict[str, TrimulFn]] = None) -> int:
    device = torch.device(args.device)
    dtype = default_dtype(args, device)
    impls: dict[str, TrimulFn] = {
        "tpfkit": triangle_multiplicative_update,
        "torch_eager": triangle_multiplicative_update_torch,
    }
    impls.update(extra_impls or {})
    rows = []
    print(f"triangle multiplicative update, B=1, {dtype}, {device}")
    print(f"{'impl':<18}{'direction':>10}{'D':>6}{'S':>6}{'fwd ms':>12}{'fwd+bwd ms':>14}")
    for D in args.dims:
        for S in args.sizes:
            inputs = make_inputs(S, D, dtype, device, seed=S + D)
            for direction in args.directions:
                for name, fn in impls.items():
                    fwd, fwd_bwd = time_impl(fn, [inputs], direction, device, args.repeats)
                    rows.append({"impl": name, "direction": direction, "D": D, "S": S,
                                 "fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd})
                    print(f"{name:<18}{direction:>10}{D:>6}{S:>6}{fwd:>12.2f}{fwd_bwd:>14.2f}",
                          flush=True)
    if args.json:
        write_json(args.json, rows, device)
    return 0
