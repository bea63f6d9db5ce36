"""`tpf bench NAME`: time an op next to its peers on this machine. Every benchmark of an op lives in
this package; the scripts in bench/ of the same names are entry points that call script_main()."""
from __future__ import annotations

import argparse
import importlib
from typing import Optional

BENCHES = {
    "attention": "tpfkit.benchmarks.attention",
    "attention-gpu": "tpfkit.benchmarks.attention_gpu",
    "trimul": "tpfkit.benchmarks.trimul",
    "trimul-gpu": "tpfkit.benchmarks.trimul_gpu",
    "clients-gpu": "tpfkit.benchmarks.clients_gpu",
    "context-parallel": "tpfkit.benchmarks.context_parallel",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="op", metavar="NAME")
    sub.required = True
    for name, module_name in BENCHES.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.__doc__.splitlines()[0], description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_bench=module.run)


def run(args: argparse.Namespace) -> int:
    return args._bench(args)


def script_main(name: str, argv: Optional[list[str]] = None, **defaults) -> int:
    """A bench/ script: `tpf bench NAME` with these defaults (e.g. where results go)."""
    module = importlib.import_module(BENCHES[name])
    parser = argparse.ArgumentParser(description=module.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    parser.set_defaults(**defaults)
    return int(module.run(parser.parse_args(argv)) or 0)
