"""`tpf`: the command line. Each subcommand lives in its own module, imported only when used."""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Each module defines add_arguments(parser) and run(args) -> int.
SUBCOMMANDS = {
    "bench": ("tpfkit.benchmarks.cli", "benchmark an op against its peers"),
    "pack": ("tpfkit.data.pack", "pack mmCIF/PDB/extxyz files into store shards"),
    "inspect": ("tpfkit.data.inspect", "describe a store file"),
    "stream": ("tpfkit.data.stream_cli", "stream a dataset and report its throughput"),
    "train": ("tpfkit.train.cli", "train a PairFormer trunk on protein distograms"),
    "doctor": ("tpfkit.doctor", "show the GPU, the CUDA kernels and the versions in use"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpf", description="TurboPairFormer command line")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            # A build without a component (TPF_WITH_DATA=OFF) keeps the other subcommands.
            p.set_defaults(_run=_unavailable(name, e))
            continue
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def _unavailable(name: str, error: ImportError):
    def run(args) -> int:
        print(f"tpf {name}: not available in this build: {error}", file=sys.stderr)
        return 2

    return run


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"tpf {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
