#!/usr/bin/env python3
"""Where the time of one TurboPairFormer triangle multiplicative update goes: per-kernel CUDA time
from the PyTorch profiler for one forward+backward (outgoing, bf16, B=1), beside the median
forward and forward+backward times, so that bench/notes-trimul.md's per-kernel predictions can be
checked in one run."""
from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from turbopairformer.benchmarks.trimul import make_inputs, time_impl
from turbopairformer.ops.trimul import WEIGHT_NAMES, triangle_multiplicative_update


def kernel_name(raw: str) -> str:
    """The kernel's own name without namespaces, template arguments or parameters."""
    name = raw.replace("void ", "").split("(")[0]
    name = name.split("<")[0] if not name.startswith("<") else name
    return name.split("::")[-1][:40]


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
            x, mask, w, grad = inputs
            leaves = {"x": x.detach().requires_grad_(True)}
            leaves.update({k: w[k].detach().requires_grad_(True) for k in WEIGHT_NAMES})
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                triangle_multiplicative_update(leaves["x"], args.direction, mask,
                                               **{k: leaves[k] for k in WEIGHT_NAMES}).backward(grad)
                torch.cuda.synchronize()
            per = collections.defaultdict(lambda: [0.0, 0])
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    t = getattr(e, "device_time_total", None)
                    t = e.cuda_time_total if t is None else t
                    entry = per[kernel_name(e.name)]
                    entry[0] += t / 1000
                    entry[1] += 1
            total = sum(v[0] for v in per.values())
            print(f"D={D} S={S} {args.direction}: fwd {fwd_ms:.3f} ms, fwd+bwd {fwd_bwd_ms:.3f} ms, "
                  f"kernels {total:.3f} ms in {sum(v[1] for v in per.values())} launches")
            for name, (ms, count) in sorted(per.items(), key=lambda kv: -kv[1][0])[:args.top]:
                print(f"    {ms:8.3f} ms  {count:3d}x  {name}")
            del inputs, leaves
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
