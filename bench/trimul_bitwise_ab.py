"""Bitwise A/B of two trimul kernel libraries on a GPU: digests of every output, then a comparison.

Runs the triangle multiplicative update forward + backward (tests/python/trimul_cases.py's inputs,
fixed seeds) over shapes that take the static-D kernels (D = 64, 128: full tiles, partial tiles, S a
multiple of 8 or not, masks and biases on and off, bf16 and fp16, both directions) and a few that
take the run-time-D ones (D = 72, 120), and writes the SHA-256 of y and of every gradient per case
to a JSON file. Run it once under each library (swapped in as scripts/gpu-check's `ab` step swaps
them), then compare: every digest must match, since the static-D instantiations change index
arithmetic only (bench/notes-trimul.md, trimul-static-d).

    python bench/trimul_bitwise_ab.py --out /tmp/base.json      # under main's library
    python bench/trimul_bitwise_ab.py --out /tmp/new.json       # under the new one
    python bench/trimul_bitwise_ab.py --compare /tmp/base.json /tmp/new.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))

CASES = [  # (B, S, D, dtype, direction, mask, bias)
    *[(2, S, D, "bf16", d, True, True) for D in (64, 128) for S in (7, 64, 100, 136, 257, 384)
      for d in ("outgoing", "incoming")],
    *[(1, S, D, "bf16", "outgoing", m, b) for D in (64, 128) for S in (33, 384)
      for m, b in ((False, True), (True, False), (False, False))],
    *[(2, S, D, "f16", "outgoing", True, True) for D in (64, 128) for S in (100, 384)],
    (1, 768, 128, "bf16", "outgoing", True, True),
    *[(2, 100, D, "bf16", "outgoing", True, True) for D in (72, 120)],
]


def digest(t) -> str | None:
    import torch
    if t is None:
        return None
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()
                          ).hexdigest()[:20]


def run(out: str, seed: int, device: str = "cuda", limit: int | None = None) -> None:
    import torch
    from trimul_cases import GRAD_NAMES, make_inputs, ours
    dtypes = {"bf16": torch.bfloat16, "f16": torch.float16}
    rows = {}
    for B, S, D, dt, direction, mask, bias in CASES[:limit]:
        key = f"B{B} S{S} D{D} {dt} {direction} mask={int(mask)} bias={int(bias)}"
        x, m, w, grad = make_inputs(B, S, D, dtypes[dt], device, seed, mask=mask, bias=bias)
        y, g = ours(x, m, w, grad, direction)
        if device == "cuda":
            torch.cuda.synchronize()
        rows[key] = {"y": digest(y), **{f"d{n}": digest(g[n]) for n in GRAD_NAMES}}
        print(key, rows[key]["y"], rows[key]["dx"], flush=True)
    with open(out, "w") as f:
        json.dump({"seed": seed, "cases": rows}, f, indent=1)


def compare(a: str, b: str) -> int:
    ca, cb = json.load(open(a))["cases"], json.load(open(b))["cases"]
    bad = 0
    for key in ca:
        if key not in cb:
            print(f"missing in {b}: {key}")
            bad += 1
            continue
        diff = [n for n in ca[key] if ca[key][n] != cb[key].get(n)]
        if diff:
            bad += 1
            print(f"DIFFERS {key}: {' '.join(diff)}")
    print(f"{len(ca) - bad} of {len(ca)} cases bitwise equal")
    return 1 if bad else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the digests of this library's outputs here")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", default="cuda", help="cpu: a check of this script only")
    ap.add_argument("--limit", type=int, help="only the first LIMIT cases")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    a = ap.parse_args()
    if a.compare:
        sys.exit(compare(*a.compare))
    if not a.out:
        ap.error("--out or --compare")
    run(a.out, a.seed, a.device, a.limit)


if __name__ == "__main__":
    main()
