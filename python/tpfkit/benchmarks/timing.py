"""Timing helpers: warm-up, repeats, median; CUDA events on GPUs, a monotonic clock on CPUs."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int = 2, repeats: int = 5) -> float:
    """Median wall time of fn() in milliseconds, measured after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def kernel_name(raw: str) -> str:
    """A CUDA kernel's own name, without namespaces, template arguments or parameters."""
    name = raw.replace("(anonymous namespace)", "").replace("void ", "")
    depth, cut = 0, len(name)
    for i, ch in enumerate(name):  # the first '<' or '(' outside template brackets ends the name
        if ch == "<":
            if depth == 0 and i > 0:
                cut = min(cut, i)
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            cut = min(cut, i)
            break
    return name[:cut].split("::")[-1][:48] or raw[:48]


def kernel_times(fn: Callable[[], object]) -> tuple[dict[str, list], float]:
    """Runs fn() once under the PyTorch profiler: {kernel name: [CUDA ms, launches]} and the wall
    time of the call in ms (the GPU is synchronized at its end)."""
    from torch.profiler import ProfilerActivity, profile

    per: dict[str, list] = {}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = getattr(e, "device_time_total", None)
            t = e.cuda_time_total if t is None else t
            entry = per.setdefault(kernel_name(e.name), [0.0, 0])
            entry[0] += t / 1000
            entry[1] += 1
    return per, wall


def print_kernel_times(per: dict[str, list], top: int, indent: str = "    ") -> None:
    for name, (ms, count) in sorted(per.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{indent}{ms:8.3f} ms  {count:4d}x  {name}")
