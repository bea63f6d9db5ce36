#!/usr/bin/env python3
"""`tpf bench context-parallel` (tpfkit/benchmarks/context_parallel.py, whose docstring and
--help say what it measures), writing into bench/results/ by default:

    python bench/context_parallel.py                    # everything, about 5 minutes
    python bench/context_parallel.py --gpus 4 --sizes 1024 2048
    python bench/context_parallel.py --device cpu --gpus 2 --sizes 24 40   # smoke run, no GPU
"""
import sys
from pathlib import Path

from tpfkit.benchmarks.cli import script_main

if __name__ == "__main__":
    sys.exit(script_main("context-parallel", out_dir=str(Path(__file__).resolve().parent / "results")))
