"""Registers, spills and static SASS instruction counts of the trimul CUDA kernels (no GPU needed).

Compiles the trimul kernel files (src/kernels/trimul/*.cu that define kernels) for sm_90a with
`-Xptxas -v`, as the library's build does (same flags), once for this working tree and once for
each git revision given with --ref (exported with `git archive` into a temporary folder), and
prints one table row per kernel instantiation: registers, spill stores / loads and stack bytes
(ptxas), and the kernel's SASS instructions (cuobjdump -sass: every instruction slot of the
function, the alignment NOPs after its final BRA included, as bench/notes-trimul.md counts them;
"no NOP" leaves the NOPs out).

    .venv/bin/python bench/sass_count_trimul.py                 # this tree
    .venv/bin/python bench/sass_count_trimul.py --ref main      # main's kernels, then this tree
    .venv/bin/python bench/sass_count_trimul.py --ref main --only 16bit --markdown

cuobjdump is looked for on PATH, in /usr/local/cuda/bin and in the Triton wheel of .venv.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ["input_forward.cu", "output_forward.cu", "input_backward.cu", "input_backward_split.cu",
         "output_backward.cu"]
FLAGS = ["-O3", "-DNDEBUG", "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
         "-lineinfo", "-std=c++17", "-Xptxas", "-v", "-cubin"]


def tool(name: str) -> str:
    found = shutil.which(name) or (f"/usr/local/cuda/bin/{name}"
                                   if os.path.exists(f"/usr/local/cuda/bin/{name}") else None)
    if not found:
        hits = glob.glob(os.path.join(ROOT, ".venv/lib/python3*/site-packages/triton/backends/"
                                      f"nvidia/bin/{name}"))
        found = hits[0] if hits else None
    if not found:
        sys.exit(f"sass_count_trimul: {name} not found")
    return found


def demangle(names: list[str]) -> dict[str, str]:
    filt = shutil.which("cu++filt") or "/usr/local/cuda/bin/cu++filt"
    if not os.path.exists(filt):
        filt = shutil.which("c++filt")
    out = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True,
                         check=True).stdout.splitlines()
    return dict(zip(names, out))


def short_name(full: str) -> str:
    """`ns::(anonymous namespace)::input_forward_16bit_kernel<__nv_bfloat16, 64>(Params)` ->
    `input_forward_16bit<__nv_bfloat16, 64>`."""
    name = re.sub(r"\(tpf::cuda::trimul::Params( const)?(, CUtensorMap_st( const)?)*\)$", "", full)
    name = name.replace("(anonymous namespace)::", "")
    base, _, args = name.partition("<")
    name = base.split("::")[-1] + ("<" + args if args else "")
    name = name.replace("_kernel", "").replace("__nv_bfloat16", "bf16").replace("__half", "f16")
    return name.replace("(int)", "").replace(" ", "")


def cutlass_include() -> list[str]:
    """-isystem for the CUTLASS/CuTe headers (the Hopper input kernel's wgmma atoms and TMA), found
    as src/kernels/CMakeLists.txt finds them: TPF_CUTLASS_INCLUDE, else the .venv's nvidia-cutlass
    wheel; none where neither exists (trees whose trimul kernels need none)."""
    found = os.environ.get("TPF_CUTLASS_INCLUDE")
    if not found:
        hits = glob.glob(os.path.join(ROOT, ".venv/lib/python3*/site-packages/cutlass_library/"
                                      "source/include"))
        found = hits[0] if hits else None
    return [f"-isystem={found}"] if found else []


def compile_file(src_root: str, path: str, out_dir: str) -> tuple[str, str]:
    cubin = os.path.join(out_dir, os.path.basename(path) + ".cubin")
    cmd = ["nice", "-n", "10", tool("nvcc"), *FLAGS, f"-I{src_root}/include", f"-I{src_root}/src",
           *cutlass_include(), "-o", cubin, path]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"sass_count_trimul: compile failed: {' '.join(cmd)}\n{r.stderr[-4000:]}")
    return cubin, r.stderr


def parse_ptxas(log: str) -> dict[str, dict]:
    res: dict[str, dict] = {}
    cur = None
    for line in log.splitlines():
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            cur = res.setdefault(m.group(1), {})
            continue
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            cur = res.setdefault(m.group(1), {})
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                      line)
        if m:
            cur.update(stack=int(m.group(1)), spill_st=int(m.group(2)), spill_ld=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["regs"] = int(m.group(1))
    return res


def sass_counts(cubin: str) -> dict[str, tuple[int, int]]:
    out = subprocess.run([tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                         check=True).stdout
    counts: dict[str, list[int]] = {}
    cur = None
    for line in out.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            cur = counts.setdefault(m.group(1), [0, 0])
            continue
        if cur is not None and re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+\S", line):
            cur[0] += 1
            if not re.search(r"\bNOP\b", line):
                cur[1] += 1
    return {k: (v[0], v[1]) for k, v in counts.items()}


def measure(src_root: str) -> dict[str, dict]:
    tmp = tempfile.mkdtemp(prefix="sass_trimul_")
    paths = [os.path.join(src_root, "src/kernels/trimul", f) for f in FILES
             if os.path.exists(os.path.join(src_root, "src/kernels/trimul", f))]
    with ThreadPoolExecutor(max_workers=2) as ex:
        built = list(ex.map(lambda p: compile_file(src_root, p, tmp), paths))
    rows: dict[str, dict] = {}
    for cubin, log in built:
        props = parse_ptxas(log)
        for mangled, (n, n_nop) in sass_counts(cubin).items():
            rows[mangled] = {**props.get(mangled, {}), "sass": n, "sass_no_nop": n_nop}
    names = demangle(list(rows))
    shutil.rmtree(tmp, ignore_errors=True)
    return {short_name(names[k]): v for k, v in rows.items()}


def export_ref(ref: str) -> str:
    tmp = tempfile.mkdtemp(prefix="sass_trimul_ref_")
    archive = subprocess.run(["git", "-C", ROOT, "archive", ref, "src", "include"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
    return tmp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", action="append", default=[],
                    help="also measure this git revision's kernels (repeatable)")
    ap.add_argument("--only", default="", help="only kernels whose name contains this")
    ap.add_argument("--markdown", action="store_true", help="a markdown table")
    a = ap.parse_args()
    trees = [(ref, export_ref(ref)) for ref in a.ref] + [("tree", ROOT)]
    rows = []
    for label, root in trees:
        for name, v in sorted(measure(root).items()):
            if a.only in name:
                rows.append((label, name, v))
        if root != ROOT:
            shutil.rmtree(root, ignore_errors=True)
    head = ["source", "kernel", "regs", "spill st/ld", "stack", "SASS", "no NOP"]
    body = [[label, name, str(v.get("regs", "?")), f"{v.get('spill_st', '?')}/{v.get('spill_ld', '?')}",
             str(v.get("stack", "?")), str(v["sass"]), str(v["sass_no_nop"])]
            for label, name, v in rows]
    if a.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + " --- |" * len(head))
        for r in body:
            print("| " + " | ".join(r) + " |")
    else:
        widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
        for r in [head, *body]:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


if __name__ == "__main__":
    main()
