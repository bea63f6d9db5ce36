#!/usr/bin/env python3
"""Is one call of an op (forward+backward, bf16, B=1) bound by the GPU or by the host?

The ops: the triangle multiplicative update (--op trimul, shapes DxS, outgoing or incoming) and
triangle attention (--op attention, shapes DxS, H = 4, N = S, the tail 10 % of keys masked, as
bench/attention.py makes them; there also the forward alone, under no_grad, as that bench times it).
Per shape, four numbers: the median time by CUDA events (as bench/trimul.py and bench/attention.py
time it), the host's time to issue that call (perf_counter around the call, no synchronization; the GPU
is drained between calls), the same work replayed from a CUDA graph (no host work at all), and from
one profiled call the kernels' busy time, the idle time between them, and the largest idle gaps
with the kernels on either side. CUDA runtime calls that stall the host (synchronizations, copies,
allocations) are counted, so a hidden synchronization shows up by name."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import tpfkit as tpf
from tpfkit.benchmarks import attention as attention_inputs
from tpfkit.benchmarks.timing import kernel_name, median_ms
from tpfkit.benchmarks.trimul import forward_backward_call, make_inputs
from tpfkit.ops.trimul import triangle_multiplicative_update

# CUDA runtime calls (the profiler records those, not library calls such as cuBLAS's) that stall
# the host or cost more than a launch.
STALLING = ("Synchronize", "Memcpy", "Malloc", "Free", "HostAlloc", "Memset", "GetDeviceProperties",
            "FuncSetAttribute", "FuncGetAttributes", "OccupancyMaxActive", "EventQuery",
            "StreamQuery")


def host_issue_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def graph_ms(fn, device, repeats: int):
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as e:  # report and go on: the other numbers still say where the time goes
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return median_ms(graph.replay, device, repeats=repeats), ""


def timeline(fn):
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels, runtime = [], {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.append((e.time_range.start, e.time_range.end, kernel_name(e.name)))
        elif any(s in e.name for s in STALLING):
            entry = runtime.setdefault(e.name, [0, 0.0])
            entry[0] += 1
            entry[1] += (e.time_range.end - e.time_range.start) / 1000
    kernels.sort()
    busy = sum(end - start for start, end, _ in kernels) / 1000
    gaps = []
    for (s0, e0, n0), (s1, e1, n1) in zip(kernels, kernels[1:]):
        gaps.append(((s1 - e0) / 1000, n0, n1))
    span = (kernels[-1][1] - kernels[0][0]) / 1000 if kernels else 0.0
    return len(kernels), busy, span, sorted(gaps, reverse=True), runtime


def python_profile(fn, calls: int = 30, top: int = 14) -> None:
    """cProfile of `calls` calls: where the host's time goes, by function (own time)."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    lines = [l for l in out.getvalue().splitlines() if l.strip()]
    start = next((i for i, l in enumerate(lines) if l.lstrip().startswith("ncalls")), 0)
    print(f"    cProfile over {calls} calls (tottime, cumtime in s):")
    for l in lines[start:start + top + 1]:
        print("      " + l.strip()[:150])


def calibration_us(device) -> float:
    """Host time of one small CUDA torch.add, in us: how fast this host issues PyTorch ops."""
    a = torch.ones(16, device=device)
    for _ in range(100):
        torch.add(a, 1.0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(1000):
        torch.add(a, 1.0)
    us = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    return us


def calls(op: str, D: int, S: int, direction: str, device) -> dict:
    """The timed calls of one shape by name: forward+backward, and for attention the forward alone."""
    if op == "trimul":
        return {"fwd+bwd": forward_backward_call(
            triangle_multiplicative_update, make_inputs(S, D, torch.bfloat16, device, seed=S + D),
            direction)}
    q, k, v, b, m, g = attention_inputs.make_inputs(S, D, 4, torch.bfloat16, device, seed=S + D)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v, b)]

    def forward():
        with torch.no_grad():
            return tpf.triangle_attention(q, k, v, b, m)

    def forward_backward():
        for t in leaves:
            t.grad = None
        tpf.triangle_attention(*leaves, m).backward(g)
    return {"fwd": forward, "fwd+bwd": forward_backward}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", default="trimul", choices=["trimul", "attention"])
    parser.add_argument("--shapes", nargs="+", default=None,
                        help="DxS (default: trimul 64x384 128x384 128x768, attention 16x384 16x768 "
                             "32x640)")
    parser.add_argument("--direction", default="outgoing", choices=["outgoing", "incoming"])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    shapes = args.shapes or (["64x384", "128x384", "128x768"] if args.op == "trimul" else
                             ["16x384", "16x768", "32x640"])
    device = torch.device("cuda")
    print(f"host calibration: one small CUDA torch.add issues in {calibration_us(device):.2f} us")
    for shape in shapes:
        D, S = (int(v) for v in shape.split("x"))
        what = args.direction if args.op == "trimul" else "attention"
        for name, fn in calls(args.op, D, S, args.direction, device).items():
            event = median_ms(fn, device, repeats=args.repeats)
            host = host_issue_ms(fn, args.repeats)
            replay, why = graph_ms(fn, device, args.repeats)
            n, busy, span, gaps, runtime = timeline(fn)
            print(f"D={D} S={S} {what} {name}: events {event:.3f} ms, host issue {host:.3f} ms, "
                  f"graph replay {'-' if replay is None else f'{replay:.3f}'} ms {why}")
            print(f"    {n} kernels: busy {busy:.3f} ms, first start to last end {span:.3f} ms, "
                  f"idle between kernels {sum(g for g, _, _ in gaps):.3f} ms")
            for g, before, after in gaps[:6]:
                print(f"    gap {g:7.3f} ms  after {before}  before {after}")
            for rt, (count, ms) in sorted(runtime.items(), key=lambda kv: -kv[1][1]):
                print(f"    host {rt}: {count}x, {ms:.3f} ms")
            python_profile(fn)
            del fn
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
