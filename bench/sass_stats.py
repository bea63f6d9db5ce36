#!/usr/bin/env python3
"""Static SASS counts of compiled kernels, without a GPU: per kernel, registers and stack (spills),
all instructions, and for its largest loop the instruction count, local-memory accesses (LDL/STL)
and an opcode histogram. The numbers behind the notes' "N -> M instructions per tile" claims.

    python bench/sass_stats.py build/cuda/src/kernels/CMakeFiles/tpf_cuda.dir/attention/forward.cu.o \
        --kernel forward_5_kernel --dtype bfloat16 [--top 20]

Uses cuobjdump from PATH or the one Triton bundles. Static counts: a loop body holds every path
through it (e.g. masked and whole-tile softmax), so they bound rather than equal what one trip
issues; branch targets are printed so that a path can be followed by hand.
"""
from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
from pathlib import Path

INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRANCH = re.compile(r"BRA (?:\S+, )?0x([0-9a-f]+)")


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton  # noqa: PLC0415 - only for the path of its bundled tools
    except ImportError:
        sys.exit("sass_stats: no cuobjdump on PATH and no triton to borrow it from")
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not bundled.exists():
        sys.exit(f"sass_stats: no cuobjdump on PATH or at {bundled}")
    return str(bundled)


def run(tool: str, *args: str) -> str:
    return subprocess.run([tool, *args], check=True, capture_output=True, text=True).stdout


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    out: dict[str, list[tuple[int, str]]] = {}
    current = None
    for line in sass.splitlines():
        if "Function : " in line:
            current = line.split("Function : ", 1)[1].strip()
            out[current] = []
        elif current is not None:
            m = INSTRUCTION.match(line)
            if m:
                out[current].append((int(m.group(1), 16), m.group(2)))
    return out


def resources(text: str) -> dict[str, str]:
    out, current = {}, None
    for line in text.splitlines():
        if "Function " in line:
            current = line.split("Function ", 1)[1].rstrip(":").strip()
        elif current and "REG:" in line:
            out[current] = " ".join(f"{k} {v}" for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", line))
    return out


def opcode(text: str) -> str:
    word = text.split()[1] if text.startswith("@") else text.split()[0]
    return word.split(".")[0]


def largest_loop(ins: list[tuple[int, str]]) -> tuple[int, int] | None:
    best = None
    for addr, text in ins:
        m = BRANCH.search(text)
        if m:
            target = int(m.group(1), 16)
            if target < addr and (best is None or addr - target > best[1] - best[0]):
                best = (target, addr)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("object", help="a .o, .cubin or .so with sm_90 SASS")
    p.add_argument("--kernel", required=True, help="substring of the mangled kernel name")
    p.add_argument("--dtype", default="", help="substring it must also hold (e.g. bfloat16, Li32E)")
    p.add_argument("--top", type=int, default=16, help="opcodes listed per loop")
    p.add_argument("--region", nargs=2, metavar=("FROM", "TO"),
                   help="also count the instructions at addresses FROM..TO (hex), e.g. one path")
    args = p.parse_args()
    tool = cuobjdump()
    funcs = functions(run(tool, "--dump-sass", args.object))
    res = resources(run(tool, "--dump-resource-usage", args.object))
    picked = [n for n in funcs if args.kernel in n and args.dtype in n]
    if not picked:
        sys.exit(f"sass_stats: no kernel matching {args.kernel!r} and {args.dtype!r}")
    for name in picked:
        ins = funcs[name]
        print(f"{name}\n  {res.get(name, '?')}, {len(ins)} instructions")
        loop = largest_loop(ins)
        if loop is None:
            continue
        body = [(a, t) for a, t in ins if loop[0] <= a <= loop[1]]
        local = sum(1 for _, t in body if re.search(r"\b(LDL|STL)", t))
        hist = collections.Counter(opcode(t) for _, t in body)
        print(f"  largest loop 0x{loop[0]:x}-0x{loop[1]:x}: {len(body)} instructions, "
              f"{local} LDL/STL")
        print("  " + ", ".join(f"{op} {n}" for op, n in hist.most_common(args.top)))
        marks = [f"0x{a:x} {t}" for a, t in body if re.search(r"\b(BRA|BAR|VOTE|DEPBAR)", t)]
        print("  control: " + "; ".join(marks[:40]))
        if args.region:
            lo, hi = (int(x, 16) for x in args.region)
            part = [t for a, t in ins if lo <= a <= hi]
            hist = collections.Counter(opcode(t) for t in part)
            print(f"  0x{lo:x}-0x{hi:x}: {len(part)} instructions; "
                  + ", ".join(f"{op} {n}" for op, n in hist.most_common(args.top)))


if __name__ == "__main__":
    main()
