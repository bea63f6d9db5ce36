"""How close the CPU path's trimul errors come to FlashAttention-3's rule (trimul_cases.py) over
many seeds, per gradient: prints the mean and worst of our error and PyTorch's in units of the
rule's noise, the worst (err - 2 x PyTorch's) / noise (the test fails above 1) and the failures.

    cd tests/python && python sweep_trimul_rule.py --S 1 --seeds 1500
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from attention_cases import max_err, rounding_noise
from trimul_cases import (GRAD_NAMES, NOISE_HALF_ULPS, make_inputs, ours, reference,
                          torch_same_precision)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--S", type=int, default=1)
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--D", type=int, default=16)
    ap.add_argument("--seeds", type=int, default=300)
    ap.add_argument("--first-seed", type=int, default=1000)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    stats: dict[str, list[tuple[float, float, float]]] = {}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for direction in ("outgoing", "incoming"):
            x, m, w, grad = make_inputs(args.B, args.S, args.D, dtype, "cpu", seed, seed % 2 == 1)
            y_ref, g_ref = reference(x, m, w, grad, direction)
            y, g = ours(x, m, w, grad, direction)
            y_pt, g_pt = torch_same_precision(x, m, w, grad, direction)
            g_ref["y"], g["y"], g_pt["y"] = y_ref, y, y_pt
            for name in ("y",) + GRAD_NAMES:
                if g_ref[name] is None:
                    continue
                noise = NOISE_HALF_ULPS * rounding_noise(g_ref[name], dtype)
                e, b = max_err(g[name], g_ref[name]), max_err(g_pt[name], g_ref[name])
                stats.setdefault(name, []).append((e / noise, b / noise, (e - 2 * b) / noise))
    print(f"B={args.B} S={args.S} D={args.D} {args.dtype}, {2 * args.seeds} cases "
          f"(seeds {args.first_seed}..; both directions; odd seeds masked); units of the noise")
    for name, rows in stats.items():
        v = np.array(rows)
        print(f"{name:16s} ours mean {v[:, 0].mean():.2f} worst {v[:, 0].max():.2f}   "
              f"PyTorch mean {v[:, 1].mean():.2f} worst {v[:, 1].max():.2f}   "
              f"worst (ours - 2 PyTorch) {v[:, 2].max():+.2f}   failures {(v[:, 2] > 1).sum()}")


if __name__ == "__main__":
    main()
