"""`tpf doctor`: what this install of tpfkit runs on.

The GPU (name, compute capability), whether the CUDA kernels are built into this install (and from
which file libtpf_cuda was loaded) and in use, and the versions of the CUDA runtime, cuBLAS, CUTLASS
and PyTorch. Exits 0 wherever tpfkit imports, a machine without a GPU included.
"""
from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options


def _version(v: int, patch: bool = False) -> str:
    """CUDA's 13000 -> "13.0"; cuBLAS's 130100 (major * 10000 + minor * 100 + patch) -> "13.1.0"."""
    if patch:
        return f"{v // 10000}.{v // 100 % 100}.{v % 100}"
    return f"{v // 1000}.{v % 1000 // 10}"


def loaded_libraries(*names: str) -> dict[str, str]:
    """The first loaded file of this process whose name starts with each of `names` (Linux)."""
    found: dict[str, str] = {}
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
                if len(fields) < 6:
                    continue
                path = fields[5].strip()
                base = os.path.basename(path)
                for name in names:
                    if name not in found and base.startswith(name):
                        found[name] = path
    except OSError:
        pass
    return found


def report() -> list[str]:
    import torch

    import tpfkit
    from tpfkit import _C

    info = _C.cuda_info()
    libs = loaded_libraries("libtpf_cuda", "libcublas.so", "libcublasLt")
    lines = [f"tpfkit {tpfkit.__version__} at {os.path.dirname(tpfkit.__file__)}"]

    # The GPUs: as PyTorch sees them, else as the kernels' CUDA runtime does.
    gpus: list[tuple[str, tuple[int, int]]] = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            gpus.append((torch.cuda.get_device_name(i), tuple(torch.cuda.get_device_capability(i))))
    else:
        gpus = [(d["name"], tuple(d["capability"])) for d in info["devices"]]
    if gpus:
        for i, (name, (major, minor)) in enumerate(gpus):
            lines.append(f"GPU {i}: {name}, compute capability {major}.{minor}")
    else:
        if info["built"] and not info["cuda_driver"]:
            why = "no NVIDIA driver"
        elif info["error"]:
            why = info["error"]
        else:
            why = "PyTorch is a CPU build" if torch.version.cuda is None else "PyTorch sees none"
        lines.append("GPU: none" + (f" ({why})" if why else ""))

    if info["built"]:
        where = libs.get("libtpf_cuda", "(not found in this process's maps)")
        lines.append(f"CUDA kernels: built into this install ({info['arch']}); libtpf_cuda loaded "
                     f"from {where}")
    else:
        lines.append("CUDA kernels: not built into this install (the CPU path only; rebuild where "
                     "nvcc is found: pip install .)")
    in_use = tpfkit.cuda_available()
    lines.append(f"CUDA kernels in use: {'yes' if in_use else 'no'} "
                 f"(tpfkit.cuda_available() = {in_use})")
    if info["built"] and gpus and not any(cap == (9, 0) for _, cap in gpus):
        lines.append("  note: the kernels are built for sm_90a (Hopper, compute capability 9.0) "
                     "only; other GPUs fail at their launch")

    if info["built"]:
        runtime = f"CUDA runtime: {_version(info['cuda_runtime'])} (in libtpf_cuda, built with " \
                  f"{_version(info['cuda_compiled'])})"
        runtime += f"; driver supports {_version(info['cuda_driver'])}" if info["cuda_driver"] \
            else "; no CUDA driver"
        lines.append(runtime)
        cublas = _version(info["cublas_runtime"], patch=True) if info["cublas_runtime"] else "?"
        lines.append(f"cuBLAS: {cublas} (built with {_version(info['cublas_compiled'], patch=True)}) "
                     f"from {libs.get('libcublas.so', '?')}")
        lines.append(f"CUTLASS: {info['cutlass']} (headers the kernels were built with)")
    else:
        lines.append("CUDA runtime, cuBLAS, CUTLASS: not used by this build")
    lines.append(f"PyTorch: {torch.__version__} (CUDA {torch.version.cuda or 'none: a CPU build'})")
    lines.append(f"record store and FoldPipe: {'built' if _C.with_data else 'not built'}")
    return lines


def run(args: argparse.Namespace) -> int:
    del args
    print("\n".join(report()))
    return 0
