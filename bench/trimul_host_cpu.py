#!/usr/bin/env python3
"""Host time of the triangle multiplicative update's Python/autograd/binding path, on the CPU: the
op at a tiny shape (S=2, D=8, float32), so that its arithmetic is negligible and what is timed is
what every call pays on the host (the same path as on CUDA up to the kernels themselves)."""
from __future__ import annotations

import argparse
import time

import torch

from tpfkit.benchmarks.trimul import forward_backward_call, make_inputs
from tpfkit.ops.trimul import triangle_multiplicative_update as op


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    inputs = make_inputs(2, 8, torch.float32, "cpu", 0)
    x, mask, w, _ = inputs

    def forward():
        with torch.no_grad():
            op(x, "outgoing", mask, **w)

    forward_backward = forward_backward_call(op, inputs, "outgoing")
    for name, fn in (("forward", forward), ("forward_backward", forward_backward)):
        for _ in range(50):
            fn()
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            times.append((time.perf_counter() - t0) / args.calls * 1e3)
        print(f"{name}: " + ", ".join(f"{t:.3f}" for t in times) + " ms per call")


if __name__ == "__main__":
    main()
