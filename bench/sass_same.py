#!/usr/bin/env python3
"""Whether two builds of the CUDA library hold the same kernels, instruction for instruction: the
check that a refactor of kernel code is pure (no GPU needed).

    cp build/cuda/src/kernels/libtpf_cuda.so /tmp/before.so     # build at the base first
    ... edit, rebuild ...
    python bench/sass_same.py /tmp/before.so build/cuda/src/kernels/libtpf_cuda.so

Compares each kernel's SASS (cuobjdump -sass: every instruction with its encoding) with the
addresses left out, and kernels by name with the hash that an anonymous namespace's mangled name
carries (it follows the file's contents) left out. Prints the kernels that differ or are only in one
library, then a summary; exits 1 if any does. cuobjdump: as bench/sass_stats.py finds it.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from sass_stats import cuobjdump, run  # noqa: E402

FUNCTION = re.compile(r"\s*Function : (\S+)")
INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;?\s*/\*\s*(0x[0-9a-f]+)\s*\*/")
ENCODING = re.compile(r"\s*/\*\s*(0x[0-9a-f]+)\s*\*/")  # the second word of an instruction
ANONYMOUS = re.compile(r"(\d+)_GLOBAL__N__")
FILE = re.compile(r"_GLOBAL__N__[0-9a-f]+_\d+_(\w+?)_[0-9a-f]{8}")


def without_hash(name: str) -> str:
    """name with each anonymous namespace (<length>_GLOBAL__N__<hash>_<n>_<file>_<hash>...) as
    ANON_<file>: its length prefix says where it ends (the digits before it may end a name too)."""
    at = 0
    while m := ANONYMOUS.search(name, at):
        start, digits = m.start() + len(m.group(1)), m.group(1)
        for k in range(len(digits)):
            n = int(digits[k:])
            if 0 < n <= len(name) - start:
                break
        f = FILE.match(name, start)
        anon = f"ANON_{f.group(1) if f else ''}"
        name = name[:m.start() + k] + str(len(anon)) + anon + name[start + n:]
        at = m.start() + k + len(anon)
    return name


def kernels(library: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    body = None
    for line in run(cuobjdump(), "-sass", library).splitlines():
        if m := FUNCTION.match(line):
            body = found.setdefault(without_hash(m.group(1)), [])
        elif body is not None and (m := INSTRUCTION.match(line)):
            body.append(f"{m.group(1)} {m.group(2)}")
        elif body and (m := ENCODING.match(line)):
            body[-1] += " " + m.group(1)
    return found


def main() -> int:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    old, new = kernels(sys.argv[1]), kernels(sys.argv[2])
    same = differ = 0
    for name in sorted(old.keys() | new.keys()):
        if name not in new or name not in old:
            print(f"only in {'the first' if name in old else 'the second'}: {name}")
        elif old[name] != new[name]:
            print(f"differs: {name} ({len(old[name])} -> {len(new[name])} instructions)")
        else:
            same += 1
            continue
        differ += 1
    print(f"{len(old)} and {len(new)} kernels: {same} identical, {differ} differ or are in one "
          f"only; {sum(map(len, new.values()))} instructions in the second")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
