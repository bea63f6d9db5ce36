#!/usr/bin/env python3
"""Where the time of one TurboPairFormer triangle multiplicative update goes: per-kernel CUDA time
from the PyTorch profiler for one forward+backward (outgoing, bf16, B=1), beside the median
forward and forward+backward times, so that bench/notes-trimul.md's per-kernel predictions can be
checked in one run."""
from __future__ import annotations

import argparse
import torch

from tpfkit.benchmarks.timing import kernel_times, print_kernel_times
from tpfkit.benchmarks.trimul import forward_backward_call, make_inputs, time_impl
from tpfkit.ops.trimul import triangle_multiplicative_update


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[384, 768])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--direction", default="outgoing", choices=["outgoing", "incoming"])
    parser.add_argument("--top", type=int, default=12, help="kernels listed per shape")
    args = parser.parse_args()
    device = torch.device("cuda")
    for D in args.dims:
        for S in args.sizes:
            inputs = make_inputs(S, D, torch.bfloat16, device, seed=S + D)
            fwd_ms, fwd_bwd_ms = time_impl(triangle_multiplicative_update, [inputs], args.direction,
                                           device, repeats=10)
            per, _ = kernel_times(forward_backward_call(triangle_multiplicative_update, inputs,
                                                        args.direction))
            total = sum(v[0] for v in per.values())
            print(f"D={D} S={S} {args.direction}: fwd {fwd_ms:.3f} ms, fwd+bwd {fwd_bwd_ms:.3f} ms, "
                  f"kernels {total:.3f} ms in {sum(v[1] for v in per.values())} launches")
            print_kernel_times(per, args.top)
            del inputs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
