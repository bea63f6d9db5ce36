"""`tpf inspect FILE`: a store file's headers, generation, record count, schema and sizes; exits
with 1 when the file is unreadable or readable only with recover=True."""
from __future__ import annotations

import argparse

from tpfkit import _C


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="a store file (.tpf)")


def run(args: argparse.Namespace) -> int:
    text = _C.store_describe(args.file)
    print(text, end="")
    # A damaged current header is an error for readers too (they need recover=True).
    return 1 if "\nerror " in text or "\ndamaged " in text else 0
