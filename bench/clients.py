#!/usr/bin/env python3
"""`tpf bench clients-gpu` (tpfkit/benchmarks/clients_gpu.py, whose docstring and --help say what it
measures): the entry point that scripts/gpu-check and the README name."""
import sys

from tpfkit.benchmarks.cli import script_main

if __name__ == "__main__":
    sys.exit(script_main("clients-gpu"))
