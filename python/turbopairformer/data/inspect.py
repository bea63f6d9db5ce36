"""`tpf inspect FILE`: a store file's headers, generation, record count, schema and sizes."""
from __future__ import annotations

import argparse

from turbopairformer import _C


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="a store file (.tpf)")


def run(args: argparse.Namespace) -> int:
    text = _C.store_describe(args.file)
    print(text, end="")
    return 1 if "\nerror " in text else 0
