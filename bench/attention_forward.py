#!/usr/bin/env python3
"""Triangle attention forward times on a GPU, side by side in one process: TurboPairFormer (the
CUDA library this process loaded) and its peers from bench/attention.py (TriFast by default),
B = 1, N = S, H = 4, bf16, the tail S/8 keys masked (make_inputs), no gradient. Also our per-kernel
CUDA times of one forward (profiler). Runs of several libraries (scripts/gpu-check attention-forward
swaps them under one binding) land in one JSON each; --compare prints their ratios."""
from __future__ import annotations

import argparse
import hashlib
import json
import sys

import torch


from tpfkit.benchmarks.attention import make_inputs
from tpfkit.benchmarks.results import git_commit
from tpfkit.benchmarks.attention_gpu import IMPLS  # the peers' layouts
from tpfkit.benchmarks.timing import kernel_times, median_ms


def library_digest() -> str:
    path = next((line.split()[-1] for line in open("/proc/self/maps") if "libtpf_cuda" in line), "")
    return hashlib.md5(open(path, "rb").read()).hexdigest()[:12] if path else "none"


def forward_ms(impl, inputs_sets, repeats):
    prepared = [impl.prepare(*inp) for inp in inputs_sets]
    state = {"i": 0}

    def forward():
        args, extra = prepared[state["i"] % len(prepared)]
        state["i"] += 1
        with torch.no_grad():
            return impl.run(*args, extra)

    return median_ms(forward, torch.device("cuda"), warmup=3, repeats=repeats), forward


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[384, 640, 768, 1024, 1536])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--impls", nargs="+", default=["tpfkit", "trifast"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--label", default="new", help="name of this library in the JSON")
    parser.add_argument("--json", default=None)
    parser.add_argument("--compare", nargs="+", default=None,
                        help="JSON files of earlier runs: print ratios and exit")
    args = parser.parse_args()
    if args.compare:
        return compare(args.compare)
    dev = torch.device("cuda")
    rows = []
    for D in args.head_dims:
        for S in args.sizes:
            sets = [make_inputs(S, D, 4, torch.bfloat16, dev, seed=s)[:5] for s in (1, 2)]
            row = {"D": D, "S": S}
            for name in args.impls:
                try:
                    impl = IMPLS[name]()
                    ms, fn = forward_ms(impl, sets, args.repeats)
                except Exception as e:  # a peer that is not installed or fails at this size
                    row[name] = None
                    row[name + "_error"] = f"{type(e).__name__}: {e}"[:200]
                    continue
                row[name] = ms
                if name == "tpfkit":
                    per, _ = kernel_times(fn)
                    row["kernels"] = {k: round(v[0], 4) for k, v in per.items()}
                torch.cuda.empty_cache()
            del sets
            torch.cuda.empty_cache()
            rows.append(row)
            print(f"[{args.label}] D={D} S={S}: " + ", ".join(
                f"{n} {row[n]:.3f} ms" if row.get(n) is not None else f"{n} -" for n in args.impls)
                + (f" | {row['kernels']}" if "kernels" in row else ""), flush=True)
    out = {"label": args.label, "commit": git_commit(), "library": library_digest(),
           "gpu": torch.cuda.get_device_name(), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def compare(paths) -> int:
    runs = [json.load(open(p)) for p in paths]
    print("forward ms (tpfkit per library; TriFast from the first run); ratio = ours / TriFast")
    for i, row in enumerate(runs[0]["rows"]):
        tri = row.get("trifast")
        cells = []
        for run in runs:
            ours = run["rows"][i].get("tpfkit")
            ratio = f" ({ours / tri:.2f}x)" if ours and tri else ""
            cells.append(f"{run['label']} {ours:.3f}{ratio}" if ours else f"{run['label']} -")
        print(f"D={row['D']} S={row['S']}: TriFast {tri if tri is None else round(tri, 3)} | "
              + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
