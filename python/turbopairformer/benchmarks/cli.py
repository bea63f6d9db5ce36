"""`tpf bench OP`: time an op next to its peers on this machine."""
from __future__ import annotations

import argparse
import importlib

BENCHES = {
    "attention": "turbopairformer.benchmarks.attention",
    "trimul": "turbopairformer.benchmarks.trimul",
    "context-parallel": "turbopairformer.benchmarks.context_parallel",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="op", metavar="OP")
    sub.required = True
    for name, module_name in BENCHES.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.__doc__.splitlines()[0], description=module.__doc__)
        module.add_arguments(p)
        p.set_defaults(_bench=module.run)


def run(args: argparse.Namespace) -> int:
    return args._bench(args)
