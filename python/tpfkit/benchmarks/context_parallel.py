"""Context parallelism: a PairFormer block's forward+backward on 1 GPU and sharded over P GPUs.

Per N: median step time, peak memory per GPU (PyTorch's allocator; NCCL's own buffers are not in
it), the memory one step takes above what is in use before it (on the CPU too, from glibc's
malloc), and the communication left exposed: the time on the GPU timeline when an NCCL kernel
runs and no other kernel does (torch.profiler, one extra step). Then the largest N that trains (one step
fits) on 1 GPU and on P GPUs: peak memory is fitted as a + b N^2 from the sizes measured, and
sizes around the prediction are tried in steps of --n-step. "single" is the model as it runs on one
GPU (backend turbo: the attention and trimul ops); "context_parallel" is the same model wrapped in
tpfkit.distributed.ContextParallel, one process per GPU over NCCL. Every configuration
runs in fresh processes, so a failed size cannot disturb the next. With --device cpu the ranks are
CPU processes over gloo (peak memory, exposed communication and the search are skipped).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from tpfkit.benchmarks.results import git_commit
from tpfkit.benchmarks.timing import median_ms

IMPLS = ("single", "context_parallel")
# Peak memory of the largest N the search tries, as a fraction of what the GPU has free.
FILL = 0.97
OUT_OF_MEMORY = "out of memory"
CRASHED = "the ranks crashed or timed out at this size"
# Sizes the search tries at most per implementation (each in a fresh process tree).
MAX_ATTEMPTS = 6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpus", type=int, default=2, help="ranks of the context-parallel runs")
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 1536, 2048],
                        help="N measured on both (the largest single-GPU N is added for P GPUs)")
    parser.add_argument("--c-z", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--c-s", type=int, default=0,
                        help="single-track channels (0: the pair track alone)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trimul-chunks", type=int, default=4,
                        help="channel groups of the sharded contraction (overlap)")
    parser.add_argument("--no-trimul-recompute", action="store_true",
                        help="keep the sharded trimul's row-local activations (more memory)")
    parser.add_argument("--n-step", type=int, default=128,
                        help="resolution of the largest-N search")
    parser.add_argument("--no-search", action="store_true", help="skip the largest-N search")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--job-timeout", type=float, default=120,
                        help="seconds a size may take before it counts as failed (and NCCL's "
                             "timeout)")
    parser.add_argument("--out-dir", default="bench/results",
                        help="where the default JSON and PNG names go")
    parser.add_argument("--json", default=None,
                        help="rows out (default OUT_DIR/context_parallel-<gpu>x<P>.json)")
    parser.add_argument("--plot", default=None, help="PNG out (default: the JSON's name)")


# One configuration: the ranks of one impl run a list of sizes in one process group.

def _model(spec: dict, device: torch.device):
    from tpfkit.nn import PairFormer
    torch.manual_seed(0)
    model = PairFormer(1, spec["c_z"], c_s=spec["c_s"], c_hidden_pair_att=spec["head_dim"],
                       no_heads_pair=spec["heads"], backend="turbo")
    return model.to(device=device, dtype=getattr(torch, spec["dtype"]))


def _inputs(spec: dict, n: int, model, device: torch.device):
    """(runner, forward arguments, output gradients): full tensors for one GPU, this rank's rows
    (made in place, never the full pair tensor) for the context-parallel runs."""
    from tpfkit.distributed import ContextParallel
    dtype, c_z, c_s = getattr(torch, spec["dtype"]), spec["c_z"], spec["c_s"]

    def randn(*shape):
        return torch.randn(shape, device=device, dtype=dtype)

    if spec["impl"] == "single":
        runner, rows, cols = model, n, n
        single_mask = torch.ones((1, n), dtype=torch.bool, device=device)
        pair_mask = torch.ones((1, n, n), dtype=torch.bool, device=device)
    else:
        runner = ContextParallel(model, trimul_chunks=spec["trimul_chunks"],
                                 trimul_recompute=spec["trimul_recompute"])
        sharding = runner.sharding(n)
        rows, cols = sharding.n_local, sharding.n_padded
        single_mask = torch.arange(cols, device=device)[None] < n
        pair_mask = sharding.shard_mask(None, 1, device)
    s = randn(1, cols, c_s) if c_s else None
    z = randn(1, rows, cols, c_z).requires_grad_()
    grads = ([randn(1, cols, c_s)] if c_s else []) + [randn(1, rows, cols, c_z)]
    return runner, (s, z, single_mask, pair_mask), grads


def _intervals_length(intervals) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _comm_ms(step) -> tuple[float, float]:
    """(exposed, total) GPU time of NCCL kernels over one profiled step; exposed: the time when an
    NCCL kernel runs and no other kernel does."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    comm, compute = [], []
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            (comm if "nccl" in e.name.lower() else compute).append(
                (e.time_range.start, e.time_range.end))
    # |comm minus compute| = |comm or compute| - |compute|
    exposed = _intervals_length(comm + compute) - _intervals_length(compute)
    return exposed / 1e3, _intervals_length(comm) / 1e3


class _MallocPeak(TorchDispatchMode):
    """The most bytes glibc's malloc had handed out, sampled after every op (PyTorch keeps no
    statistics of its CPU allocator)."""

    def __init__(self, mallinfo2):
        super().__init__()
        self._mallinfo2 = mallinfo2
        self.start = self.peak = self.in_use()

    def in_use(self) -> int:
        info = self._mallinfo2()
        return info.uordblks + info.hblkhd  # small blocks in the arenas + mmap-ed large blocks

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.in_use())
        return out


def _cpu_step_peak_gib(step) -> Optional[float]:
    """Memory one step takes above what is in use before it, on the CPU (None off glibc)."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]

    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except AttributeError:
        return None
    mallinfo2.restype = MallInfo2
    gc.collect()
    with _MallocPeak(mallinfo2) as sampler:
        step()
    return (sampler.peak - sampler.start) / 2**30


def _measure(spec: dict, n: int, device: torch.device, world: int) -> dict:
    on_gpu = device.type == "cuda"
    model = runner = args = grads = None
    fits, error, step_ms, peak, reserved, exposed, comm = True, None, None, None, None, None, None
    step_peak = None
    try:
        model = _model(spec, device)
        runner, args, grads = _inputs(spec, n, model, device)
        z = args[1]

        def step():
            outputs = [o for o in runner(*args) if o is not None]
            torch.autograd.backward(outputs, grads)
            if spec["impl"] == "context_parallel":
                runner.all_reduce_gradients()
            model.zero_grad(set_to_none=True)
            z.grad = None

        step()
        if on_gpu:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        else:
            step_peak = _cpu_step_peak_gib(step)
        step_ms = median_ms(step, device, warmup=0, repeats=spec["repeats"])
        if on_gpu:
            peak = torch.cuda.max_memory_allocated(device) / 2**30
            step_peak = peak - before / 2**30
            reserved = torch.cuda.max_memory_reserved(device) / 2**30
            exposed, comm = (_comm_ms(step) if spec["impl"] == "context_parallel"
                             else (0.0, 0.0))
    except torch.OutOfMemoryError:
        fits, error = False, OUT_OF_MEMORY
    except Exception as e:  # noqa: BLE001 - reported in the row; the configuration stops there
        fits, error = False, f"{type(e).__name__}: {e}"
    del model, runner, args, grads
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()
    if world > 1:  # the slowest rank, the fullest GPU; a size fits only where it fits on all
        vals = torch.tensor([step_ms or 0.0, peak or 0.0, reserved or 0.0, exposed or 0.0,
                             comm or 0.0, step_peak or 0.0, 0.0 if fits else 1.0],
                            dtype=torch.float64, device=device)
        dist.all_reduce(vals, op=dist.ReduceOp.MAX)
        fits = vals[6].item() == 0.0
        if fits:
            step_ms = vals[0].item()
            step_peak = vals[5].item() if step_peak is not None else None
            if on_gpu:
                peak, reserved, exposed, comm = (v.item() for v in vals[1:5])
    if not fits:
        step_ms = peak = reserved = exposed = comm = step_peak = None
    return dict(impl=spec["impl"], gpus=world, N=n, fits=fits, step_ms=step_ms,
                peak_gib_per_gpu=peak, peak_reserved_gib_per_gpu=reserved,
                step_peak_gib=step_peak, exposed_comm_ms=exposed, comm_kernel_ms=comm,
                error=error)


def _worker(rank: int, world: int, spec: dict, rows_path: str) -> None:
    if spec["device"] == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        free, total = torch.cuda.mem_get_info(device)
        machine = dict(gpu=torch.cuda.get_device_name(device), gpu_free_gib=free / 2**30,
                       gpu_total_gib=total / 2**30)
    else:  # one thread per rank, as the ranks share the machine
        os.environ["TPF_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        device, machine = torch.device("cpu"), dict(gpu=None)
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"file://{spec['rendezvous']}", rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=spec["timeout"]))
    for n in spec["sizes"]:
        row = _measure(spec, n, device, world)
        if rank == 0:
            with open(rows_path, "a") as f:
                f.write(json.dumps({**row, **machine}) + "\n")
        if not row["fits"] and (spec["stop_at_failure"] or row["error"] != OUT_OF_MEMORY):
            break
    if world > 1:
        dist.destroy_process_group()


class Runner:
    """Runs configurations in fresh process trees and keeps every row they wrote."""

    def __init__(self, args: argparse.Namespace, workdir: Path):
        self.args, self.workdir, self.rows = args, workdir, []
        self.jobs = 0

    def run(self, impl: str, sizes: list[int], stop_at_failure: bool = True) -> list[dict]:
        a = self.args
        self.jobs += 1
        world = 1 if impl == "single" else a.gpus
        rows_path = self.workdir / f"rows{self.jobs}.jsonl"
        spec = dict(impl=impl, sizes=sorted(set(sizes)), c_z=a.c_z, c_s=a.c_s, heads=a.heads,
                    head_dim=a.head_dim, dtype=a.dtype, repeats=a.repeats,
                    trimul_chunks=a.trimul_chunks, trimul_recompute=not a.no_trimul_recompute,
                    device=a.device, timeout=a.job_timeout,
                    stop_at_failure=stop_at_failure,
                    rendezvous=str(self.workdir / f"rendezvous{self.jobs}"))
        ctx = mp.start_processes(_worker, args=(world, spec, str(rows_path)), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + a.job_timeout * len(spec["sizes"])
        crashed = False
        try:
            while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    crashed = True
                    break
        except (mp.ProcessRaisedException, mp.ProcessExitedException):
            crashed = True  # a rank died (NCCL gave up on a size, say); the rows so far count
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        rows = [json.loads(line) for line in rows_path.read_text().splitlines()] \
            if rows_path.exists() else []
        missing = [n for n in spec["sizes"] if n not in {r["N"] for r in rows}]
        if crashed and missing and (not rows or rows[-1]["fits"]):
            rows.append(dict(impl=impl, gpus=world, N=missing[0], fits=False, step_ms=None,
                             peak_gib_per_gpu=None, peak_reserved_gib_per_gpu=None,
                             step_peak_gib=None, exposed_comm_ms=None, comm_kernel_ms=None,
                             gpu=None,
                             error=CRASHED))
        self.rows += rows
        return rows


def _predicted_largest(rows: list[dict], n_step: int) -> Optional[int]:
    """The N whose peak memory, fitted as a + b N^2 through the two largest sizes that fit,
    reaches FILL of the free memory; None without two such sizes."""
    fit = sorted((r for r in rows if r["fits"] and r["peak_gib_per_gpu"]), key=lambda r: r["N"])
    if len(fit) < 2 or not fit[-1].get("gpu_free_gib"):
        return None
    (n1, p1), (n2, p2) = [(r["N"], r["peak_gib_per_gpu"]) for r in fit[-2:]]
    b = (p2 - p1) / (n2 * n2 - n1 * n1)
    if b <= 0:
        return None
    a = p2 - b * n2 * n2
    n = math.sqrt(max(0.0, (FILL * fit[-1]["gpu_free_gib"] - a) / b))
    return max(n2 + n_step, int(n) // n_step * n_step)


def search_largest(runner: Runner, impl: str, rows: list[dict], n_step: int) -> Optional[int]:
    """The largest N (to n_step) at which one step fits: the prediction, then steps up or down."""
    def largest_fit(rs):
        return max((r["N"] for r in rs if r["fits"]), default=None)

    def smallest_failure_above(rs, n):
        return min((r["N"] for r in rs if not r["fits"] and r["N"] > n), default=None)

    lo = largest_fit(rows)
    if lo is None:
        return None
    hi = smallest_failure_above(rows, lo)
    guess = _predicted_largest(rows, n_step)
    for _ in range(MAX_ATTEMPTS):
        if hi is not None and hi - lo <= n_step:
            break
        if guess is not None and lo < guess and (hi is None or guess < hi):
            n = guess
        elif hi is None:
            n = lo + n_step
        else:
            n = lo + max(n_step, (hi - lo) // 2 // n_step * n_step)
            if n >= hi:
                break
        guess = None
        result = runner.run(impl, [n])
        if any(r["fits"] for r in result):
            lo = n
            guess = _predicted_largest([r for r in runner.rows if r["impl"] == impl], n_step)
        elif any(r["error"] in (OUT_OF_MEMORY, CRASHED) for r in result):
            hi = n  # a crash at a new size is most likely NCCL running out of memory
        else:
            break  # not a memory limit: the row says what went wrong
    return lo


def _plot(rows: list[dict], largest: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (mem, time) = plt.subplots(1, 2, figsize=(11, 4.2))
    for impl, color in zip(IMPLS, ("tab:blue", "tab:orange")):
        fits = sorted((r for r in rows if r["impl"] == impl and r["fits"]), key=lambda r: r["N"])
        if not fits:
            continue
        gpus = fits[0]["gpus"]
        label = f"{impl} ({gpus} GPU{'s' if gpus > 1 else ''})"
        for key, style, what in (("peak_gib_per_gpu", "o-", "peak"),
                                 ("step_peak_gib", "x:", "one step")):
            pts = [(r["N"], r[key]) for r in fits if r[key] is not None]
            if pts:
                mem.plot(*zip(*pts), style, color=color, label=f"{label}, {what}")
        time.plot([r["N"] for r in fits], [r["step_ms"] for r in fits], "o-", color=color,
                  label=label)
        if largest.get(impl):
            for ax in (mem, time):
                ax.axvline(largest[impl], ls="--", lw=0.8, color=color)
    mem.set(xlabel="N (tokens)", ylabel="GiB per GPU", title="memory")
    time.set(xlabel="N (tokens)", ylabel="forward+backward step (ms)", title="step time",
             yscale="log")
    for ax in (mem, time):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(title + "  (dashed: largest N that fits)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _summary(rows: list[dict], largest: dict) -> list[str]:
    by = {(r["impl"], r["N"]): r for r in rows if r["fits"]}
    lines = []
    for n in sorted({r["N"] for r in rows}):
        one, cp = by.get(("single", n)), by.get(("context_parallel", n))
        if one and cp:
            mem = (f"peak memory x{cp['peak_gib_per_gpu'] / one['peak_gib_per_gpu']:.3f}, "
                   if one["peak_gib_per_gpu"] else "")
            if one["step_peak_gib"]:
                mem += f"step memory x{cp['step_peak_gib'] / one['step_peak_gib']:.3f}"
            exposed = (f", NCCL kernels {cp['comm_kernel_ms']:.1f} ms of which "
                       f"{cp['exposed_comm_ms']:.1f} ms exposed "
                       f"({100 * cp['exposed_comm_ms'] / cp['step_ms']:.1f}% of the step)"
                       if cp["exposed_comm_ms"] is not None else "")
            lines.append(f"N={n}: {mem}, time x{cp['step_ms'] / one['step_ms']:.3f}{exposed}")
    if largest.get("single") and largest.get("context_parallel"):
        lines.append(f"largest N: {largest['single']} on 1 GPU, {largest['context_parallel']} "
                     f"sharded (x{largest['context_parallel'] / largest['single']:.3f})")
    return lines


def run(args: argparse.Namespace) -> int:
    if args.gpus < 2:
        raise ValueError(f"--gpus must be at least 2, got {args.gpus}")
    if args.device == "cuda" and torch.cuda.device_count() < args.gpus:
        raise ValueError(f"--gpus {args.gpus} needs that many CUDA GPUs, this machine has "
                         f"{torch.cuda.device_count()} (--device cpu runs gloo ranks instead)")
    # Every process this benchmark starts inherits these (no NVLink multicast).
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    if args.device == "cpu":  # gloo ranks on this machine: loopback
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    search = not args.no_search and args.device == "cuda"
    from tqdm import tqdm
    with tempfile.TemporaryDirectory(prefix="tpf-cp-bench-") as tmp:
        runner = Runner(args, Path(tmp))
        largest: dict[str, Optional[int]] = {}
        steps = tqdm(total=2 * (2 if search else 1), desc="context parallel", unit="phase")
        single = runner.run("single", args.sizes)
        steps.update()
        if search:
            largest["single"] = search_largest(runner, "single", single, args.n_step)
            steps.update()
        sizes = args.sizes + ([largest["single"]] if largest.get("single") else [])
        sharded = runner.run("context_parallel", sizes)
        steps.update()
        if search:
            largest["context_parallel"] = search_largest(runner, "context_parallel", sharded,
                                                         args.n_step)
            steps.update()
        steps.close()
    rows = runner.rows
    gpu = next((r["gpu"] for r in rows if r.get("gpu")), None)
    meta = dict(commit=git_commit(), date=datetime.date.today().isoformat(),
                machine=platform.node(), device=args.device, c_z=args.c_z, c_s=args.c_s,
                heads=args.heads, head_dim=args.head_dim, dtype=args.dtype,
                trimul_chunks=args.trimul_chunks, trimul_recompute=not args.no_trimul_recompute)
    out_rows = [{**r, **meta, "largest_fitting_N": largest.get(r["impl"])} for r in rows]
    columns = (("step ms", "step_ms", 1), ("peak GiB", "peak_gib_per_gpu", 2),
               ("step GiB", "step_peak_gib", 3), ("exposed ms", "exposed_comm_ms", 1))
    print(f"{'impl':<18}{'GPUs':>5}{'N':>7}" + "".join(f"{c[0]:>12}" for c in columns))
    for r in sorted(out_rows, key=lambda r: (r["impl"], r["N"])):
        cells = "".join(f"{r[key]:>12.{digits}f}" if r[key] is not None else f"{'-':>12}"
                        for _, key, digits in columns)
        note = "" if r["fits"] else f"  does not run: {r.get('error')}"
        print(f"{r['impl']:<18}{r['gpus']:>5}{r['N']:>7}{cells}{note}")
    for line in _summary(rows, largest):
        print(line)
    tag = _machine_tag(gpu, args)
    default_name = f"context_parallel-{tag}.json"
    json_path = Path(args.json or Path(args.out_dir) / default_name)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(out_rows, indent=1))
    plot_path = Path(args.plot) if args.plot else json_path.with_suffix(".png")
    _plot(rows, largest, plot_path,
          f"PairFormer block, c_z={args.c_z}, {args.heads} heads of {args.head_dim}, "
          f"c_s={args.c_s}, {args.dtype}, {gpu or args.device}, {args.gpus} ranks, "
          f"{meta['commit']}")
    print(f"wrote {json_path} and {plot_path}")
    return 0


def _machine_tag(gpu: Optional[str], args: argparse.Namespace) -> str:
    """h200x2 for two H200s: the GPU's model number and the rank count."""
    if gpu is None:
        return f"cpux{args.gpus}"
    words = [w for w in gpu.lower().replace("-", " ").split() if any(ch.isdigit() for ch in w)]
    return f"{words[0] if words else 'gpu'}x{args.gpus}"

