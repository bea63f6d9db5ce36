#!/usr/bin/env python3
"""Trimul variants against the FP64 reference over many seeds (FlashAttention-3's rule, as
tests/gpu): how often each variant fails at each shape, and by how much. A failure at one seed
that the other variant passes at every seed points at the kernel; failures by a hair on both
variants point at the test's margin. Prints one line per failure and a count per variant."""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests/python"))
from trimul_cases import check_against_reference  # noqa: E402


def _gpu_conftest():
    """tests/gpu/conftest.py as a module (its name clashes with tests/python/conftest.py)."""
    spec = importlib.util.spec_from_file_location("gpu_conftest", ROOT / "tests/gpu/conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


poison_allocator = _gpu_conftest().poison_allocator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["3", "4"])
    parser.add_argument("--seeds", type=int, default=12)
    parser.add_argument("--sizes", type=int, nargs="+", default=[7, 33, 100])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    args = parser.parse_args()
    for variant in args.variants:
        os.environ["TPF_TRIMUL_VARIANT"] = variant
        failed = total = 0
        for seed in range(1, args.seeds + 1):
            for D in args.dims:
                for S in args.sizes:
                    for direction in ("outgoing", "incoming"):
                        total += 1
                        poison_allocator()
                        try:
                            check_against_reference(2, S, D, torch.bfloat16, "cuda", direction,
                                                    True, 1000 * seed + S)
                        except AssertionError as e:
                            failed += 1
                            print(f"variant {variant} FAIL: {str(e).splitlines()[0]}")
        print(f"variant {variant}: {failed} of {total} cases failed")


if __name__ == "__main__":
    main()
