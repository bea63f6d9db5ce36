#!/usr/bin/env python3
"""Where the time of one TurboPairFormer attention call goes: per-kernel CUDA time from the
PyTorch profiler (forward, backward's delta / main / dQ and dbias reductions), at B=1, N=S, H=4."""
from __future__ import annotations

import argparse

import torch

import tpfkit as tpf
from tpfkit.benchmarks.attention import make_inputs
from tpfkit.benchmarks.timing import kernel_times, median_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[384, 768])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[16, 32, 64])
    args = parser.parse_args()
    for D in args.head_dims:
        for S in args.sizes:
            q, k, v, bias, mask, grad = make_inputs(S, D, 4, torch.bfloat16, torch.device("cuda"), seed=1)
            leaves = [t.requires_grad_(True) for t in (q, k, v, bias)]

            def fwd():
                with torch.no_grad():
                    tpf.triangle_attention(q, k, v, bias, mask)

            def fwd_bwd():
                for t in leaves:
                    t.grad = None
                tpf.triangle_attention(*leaves, mask).backward(grad)

            f = median_ms(fwd, torch.device("cuda"), warmup=3, repeats=10)
            fb = median_ms(fwd_bwd, torch.device("cuda"), warmup=3, repeats=10)
            per, _ = kernel_times(fwd_bwd)
            top = sorted(((n, v[0]) for n, v in per.items()), key=lambda kv: -kv[1])[:6]
            print(f"D={D} S={S}: fwd {f:.3f} ms, fwd+bwd {fb:.3f} ms | "
                  + ", ".join(f"{n} {t:.3f}" for n, t in top), flush=True)


if __name__ == "__main__":
    main()
