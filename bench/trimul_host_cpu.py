#!/usr/bin/env python3
"""Host time of the triangle multiplicative update's Python/autograd/binding path, on the CPU: the
op at a tiny shape (S=2, D=8, float32), so that its arithmetic is negligible and what is timed is
what every call pays on the host (the same path as on CUDA up to the kernels themselves)."""
from __future__ import annotations

import argparse
import time

import torch

from turbopairformer.benchmarks.trimul import make_inputs
from turbopairformer.ops.trimul import WEIGHT_NAMES, triangle_multiplicative_update as op


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    x, mask, w, grad = make_inputs(2, 8, torch.float32, "cpu", 0)
    leaves = {"x": x.requires_grad_(True)}
    leaves.update({k: w[k].requires_grad_(True) for k in WEIGHT_NAMES})

    def forward():
        with torch.no_grad():
            op(x, "outgoing", mask, **w)

    def forward_backward():
        for t in leaves.values():
            t.grad = None
        op(leaves["x"], "outgoing", mask, **{k: leaves[k] for k in WEIGHT_NAMES}).backward(grad)

    for fn in (forward, forward_backward):
        for _ in range(50):
            fn()
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            times.append((time.perf_counter() - t0) / args.calls * 1e3)
        print(f"{fn.__name__}: " + ", ".join(f"{t:.3f}" for t in times) + " ms per call")


if __name__ == "__main__":
    main()
