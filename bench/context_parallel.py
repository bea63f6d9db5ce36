#!/usr/bin/env python3
"""Context parallelism on 2 GPUs, written to run unattended in one go on an H200 x2:
a PairFormer block (c_z 128, 4 heads of dim 32, bf16), forward+backward, on 1 GPU and sharded over
2 GPUs: step time, peak memory per GPU and exposed communication against N from 512 up, and the
largest N that trains on each. Writes bench/results/context_parallel-h200x2.json and a PNG.

    python bench/context_parallel.py                    # everything, about 5 minutes
    python bench/context_parallel.py --gpus 4 --sizes 1024 2048
    python bench/context_parallel.py --device cpu --gpus 2 --sizes 24 40   # smoke run, no GPU

Same options as `tpf bench context-parallel` (see --help); NCCL_NVLS_ENABLE=0 and
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are set for every process it starts.
"""
import argparse
import sys
from pathlib import Path

from turbopairformer.benchmarks import context_parallel

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    context_parallel.add_arguments(parser)
    parser.set_defaults(out_dir=str(Path(__file__).resolve().parent / "results"))
    sys.exit(context_parallel.run(parser.parse_args()))
