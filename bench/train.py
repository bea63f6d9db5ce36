#!/usr/bin/env python3
"""The training benchmark, written to run unattended on one GPU (an H200) in one go.

1. Step time and peak memory of a full training step (forward, backward, Adam) of the distogram model
   with a 4-block trunk (c_z 128, 4 heads of dim 32, bf16 autocast, batch 1) at crops 384/640/768,
   for `reference` eager, `reference` with each block under torch.compile, `turbo` eager, and
   `turbo_compile` (each block under torch.compile: our ops stay custom ops, the code around them
   is fused, as for the reference under compile); `--backends ... turbo_unfused` adds eager turbo
   with PyTorch's LayerNorm, SwiGLU and gate instead of the fused glue (what the glue brings).
2. Stability: one shared warm-up from the same initial weights, then 400 steps at lr 1.8e-3 for each
   backend with the same data order, plus the reference again with another data order to measure
   seed-to-seed noise; every non-finite step is reported with its number.

Writes bench/results/train-<gpu>.json (one row per backend and crop: backend, crop, step_ms,
peak_gib, commit, gpu, date), train-stability-<gpu>.json, and a PNG plot of each.
    python bench/train.py                 # everything (about 10 minutes on an H200)
    python bench/train.py --part timing   # or --part stability, or --part profile (kernels of one step)
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from tpfkit.benchmarks.results import git_commit
from tpfkit.benchmarks.timing import kernel_times, print_kernel_times
from tpfkit.nn import set_backend
from tpfkit.train.data import load_chains
from tpfkit.train.loop import Trainer, TrainConfig
from tpfkit.train.model import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("reference", "reference_compile", "turbo", "turbo_compile", "turbo_unfused")
DEFAULT_BACKENDS = BACKENDS[:4]


def gpu_tag(name: str) -> str:
    for tag in ("H200", "H100", "A100", "B200", "GH200"):
        if tag in name:
            return tag.lower()
    return "".join(c for c in name.lower() if c.isalnum()) or "gpu"


def make_trainer(args, backend: str, crop: int, chains, seed: int, steps: int, warmup: int,
                 schedule: str, checkpointing: bool = False) -> Trainer:
    model = ModelConfig(blocks=args.blocks, c_z=args.c_z, heads=args.heads, head_dim=args.head_dim,
                        transition_n=4, checkpoint=checkpointing)
    cfg = TrainConfig(data=args.data, out="", steps=steps, batch_size=1, crop=crop, lr=args.lr,
                      warmup=warmup, schedule=schedule, device=args.device, precision="bf16",
                      seed=seed, val_fraction=0.0, model=model,
                      backend=backend.removesuffix("_compile").removesuffix("_unfused"),
                      compile=backend.endswith("_compile"))
    trainer = Trainer(cfg, chains=chains, progress=False)
    if backend == "turbo_unfused":
        set_backend(trainer.model, "turbo", fused_glue=False)
    return trainer


def release() -> None:
    """Gives the memory of dropped models back (the caller drops its references first)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def warm_trainer(args, backend: str, crop: int, chains, checkpointing: bool = False) -> Trainer:
    """A trainer at a constant learning rate after its untimed warm-up steps (more under compile)."""
    trainer = make_trainer(args, backend, crop, chains, args.seed, 10**6, 0, "constant",
                           checkpointing)
    for _ in range(args.compile_warmup if backend.endswith("_compile") else args.warmup):
        trainer.step()
    return trainer


def time_one(args, backend: str, crop: int, chains, checkpointing: bool) -> dict:
    """Median step time and peak memory of one backend at one crop."""
    trainer = None
    try:
        trainer = warm_trainer(args, backend, crop, chains, checkpointing)
        on_gpu = trainer.device.type == "cuda"
        if on_gpu:
            torch.cuda.synchronize(trainer.device)
            torch.cuda.reset_peak_memory_stats(trainer.device)
        times = [trainer.step()["step_ms"] for _ in range(args.repeats)]
        peak = torch.cuda.max_memory_allocated(trainer.device) / 2**30 if on_gpu else None
        return {"step_ms": statistics.median(times), "peak_gib": peak}
    finally:
        del trainer
        release()


def time_steps(args, chains, meta) -> list[dict]:
    """One row per crop and backend. A backend that runs out of memory is measured again with
    activation checkpointing (each block recomputed in the backward); the row says which."""
    rows = []
    for crop in args.crops:
        for backend in args.backends:
            row = {"backend": backend, "crop": crop, "step_ms": None, "peak_gib": None,
                   "activation_checkpointing": False, **meta}
            for checkpointing in (False, True):
                release()  # what an out-of-memory attempt's traceback held
                row["activation_checkpointing"] = checkpointing
                try:
                    row.update(time_one(args, backend, crop, chains, checkpointing))
                    row.pop("error", None)
                    break
                except torch.OutOfMemoryError:
                    row["error"] = "out of memory"
                except Exception as e:  # a failing peer is reported in its row, the run goes on
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                    break
            rows.append(row)
            shown = (f"{row['step_ms']:9.1f} ms {row['peak_gib'] or 0:7.2f} GiB"
                     f"{' (activation checkpointing)' if checkpointing else ''}"
                     if row["step_ms"] else row["error"])
            print(f"  {backend:<18} crop {crop:4d}: {shown}", flush=True)
    return rows


def profile_steps(args, chains) -> None:
    """Per-kernel CUDA time of one training step of each backend at --profile-crop, after warm-up:
    where the step time goes (kernels, and the host time the GPU is not busy)."""
    for backend in args.backends:
        trainer = warm_trainer(args, backend, args.profile_crop, chains)
        per, wall = kernel_times(trainer.step)
        busy = sum(v[0] for v in per.values())
        print(f"{backend}, crop {args.profile_crop}: step {wall:.1f} ms (profiled), kernels "
              f"{busy:.1f} ms in {sum(v[1] for v in per.values())} launches")
        print_kernel_times(per, args.top)
        del trainer
        release()


def print_acceptance(rows: list[dict]) -> None:
    """Issue 7's timing lines: turbo at most 0.5x reference eager at crop 384, and faster than the
    reference under torch.compile at every crop (turbo eager, and turbo under compile)."""
    ms = {(r["backend"], r["crop"]): r["step_ms"] for r in rows if r["step_ms"]}
    print("acceptance (step time ratios):")
    for crop in sorted({r["crop"] for r in rows}):
        ref, ref_c = ms.get(("reference", crop)), ms.get(("reference_compile", crop))
        for backend in ("turbo", "turbo_compile"):
            t = ms.get((backend, crop))
            if t is None:
                continue
            if ref and crop == 384:
                print(f"  crop {crop} {backend} / reference: {t / ref:.3f} (at most 0.5: "
                      f"{'met' if t <= 0.5 * ref else 'MISSED'})")
            if ref_c:
                print(f"  crop {crop} {backend} / reference_compile: {t / ref_c:.3f} (below 1: "
                      f"{'met' if t < ref_c else 'MISSED'})")


def run_steps(trainer: Trainer, steps: int, desc: str) -> tuple[list[float], list[int]]:
    losses, nonfinite = [], []
    for _ in tqdm(range(steps), desc=desc, unit="step", dynamic_ncols=True):
        row = trainer.step()
        losses.append(row["loss"])
        if not row["finite"]:
            nonfinite.append(row["step"])
    return losses, nonfinite


def trailing_mean(xs: list[float], window: int) -> list[float]:
    finite = [x if x == x and abs(x) != float("inf") else None for x in xs]
    out = []
    for i in range(len(finite)):
        w = [x for x in finite[max(0, i - window + 1):i + 1] if x is not None]
        out.append(statistics.fmean(w) if w else float("nan"))
    return out


def stability(args, chains, meta) -> dict:
    crop = args.stability_crop
    warm = make_trainer(args, "reference", crop, chains, args.seed, args.warmup_steps,
                        args.warmup_steps, "constant")
    run_steps(warm, args.warmup_steps, f"shared warm-up (reference, crop {crop})")
    state = {"model": warm.model.state_dict(), "optimizer": warm.optimizer.state_dict(),
             "scheduler": warm.scheduler.state_dict(), "step": warm.step_count}
    state = {k: (v if k == "step" else _cpu_copy(v)) for k, v in state.items()}
    del warm
    release()
    runs, failed = {}, {}
    plan = [(b, args.seed) for b in args.stability_backends] + [("reference", args.seed + 1)]
    for backend, seed in plan:
        name = backend if seed == args.seed else f"{backend}_seed{seed}"
        trainer = None
        try:
            trainer = make_trainer(args, backend, crop, chains, seed,
                                   args.warmup_steps + args.steps, args.warmup_steps, "constant")
            trainer.load_state(state)
            losses, nonfinite = run_steps(trainer, args.steps, f"{name} (crop {crop})")
            runs[name] = {"backend": backend, "data_seed": seed, "losses": losses,
                          "nonfinite_steps": nonfinite}
        except Exception as e:  # reported in the result, the other runs go on
            failed[name] = f"{type(e).__name__}: {e}"[:300]
            print(f"  {name}: {failed[name]}", flush=True)
        del trainer
        release()
    window = 25
    smooth = {k: trailing_mean(v["losses"], window) for k, v in runs.items()}

    def gap(other: str) -> float:
        """Mean |difference| of the smoothed curves to the reference's, past the first window."""
        if "reference" not in smooth or other not in smooth:
            return float("nan")
        pairs = [(a, b) for a, b in zip(smooth["reference"][window:], smooth[other][window:])
                 if a == a and b == b]
        return statistics.fmean(abs(a - b) for a, b in pairs) if pairs else float("nan")

    noise = gap(f"reference_seed{args.seed + 1}")
    summary = {name: {"nonfinite_steps": r["nonfinite_steps"],
                      "final_loss_25": smooth[name][-1],
                      "mean_gap_to_reference": gap(name) if name != "reference" else 0.0}
               for name, r in runs.items()}
    for name in summary:
        summary[name]["within_seed_noise"] = summary[name]["mean_gap_to_reference"] <= noise
    return {"crop": crop, "lr": args.lr, "warmup_steps": args.warmup_steps, "steps": args.steps,
            "window": window, "seed_to_seed_gap": noise, "summary": summary, "failed": failed,
            "runs": runs, **meta}


def _cpu_copy(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cpu_copy(v) for v in obj]
    return obj


def plot_timing(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    crops = sorted({r["crop"] for r in rows})
    backends = [b for b in BACKENDS if any(r["backend"] == b for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    width = 0.8 / max(1, len(backends))
    for i, b in enumerate(backends):
        for ax, key in zip(axes, ("step_ms", "peak_gib")):
            vals = [next((r[key] for r in rows if r["backend"] == b and r["crop"] == c), None) or 0
                    for c in crops]
            ax.bar([x + i * width for x in range(len(crops))], vals, width, label=b)
    for ax, label in zip(axes, ("step time (ms)", "peak memory (GiB)")):
        ax.set_xticks([x + width * (len(backends) - 1) / 2 for x in range(len(crops))])
        ax.set_xticklabels([str(c) for c in crops])
        ax.set_xlabel("crop")
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_stability(result: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    w = result["window"]
    for name, run in result["runs"].items():
        steps = range(1, len(run["losses"]) + 1)
        ax.plot(steps, trailing_mean(run["losses"], w), label=name,
                ls="--" if "seed" in name else "-")
        for s in run["nonfinite_steps"]:
            ax.axvline(s - result["warmup_steps"], color="red", alpha=0.3)
    ax.set_xlabel(f"step after the shared {result['warmup_steps']}-step warm-up")
    ax.set_ylabel(f"distogram loss ({w}-step trailing mean)")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("all", "timing", "stability", "profile"), default="all")
    p.add_argument("--profile-crop", type=int, default=384, help="crop of --part profile")
    p.add_argument("--top", type=int, default=25, help="kernels listed per backend by --part profile")
    p.add_argument("--data", default=str(ROOT / "data" / "structures"))
    p.add_argument("--crops", type=int, nargs="+", default=[384, 640, 768])
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(DEFAULT_BACKENDS))
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--c-z", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before timing")
    p.add_argument("--compile-warmup", type=int, default=3, help="untimed steps under torch.compile")
    p.add_argument("--repeats", type=int, default=10, help="timed steps (the median is reported)")
    p.add_argument("--stability-crop", type=int, default=384)
    p.add_argument("--stability-backends", nargs="+", choices=("reference", "turbo"),
                   default=["reference", "turbo"])
    p.add_argument("--warmup-steps", type=int, default=100, help="shared warm-up (linear lr ramp)")
    p.add_argument("--steps", type=int, default=400, help="stability steps after the warm-up")
    p.add_argument("--lr", type=float, default=1.8e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="timing rows (default OUT_DIR/train-<gpu>.json)")
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    p.add_argument("--device", default="cuda", help="cpu only for a smoke test of this script")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench/train.py needs a CUDA GPU (or --device cpu for a smoke test)", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    date = datetime.date.today().isoformat()
    meta = {"commit": git_commit(), "gpu": gpu, "date": date}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = gpu_tag(gpu)  # one current result per machine; older ones are in git history
    chains = load_chains(args.data)
    print(f"{len(chains)} chains, {gpu}, commit {meta['commit']}")
    model_desc = f"{args.blocks} blocks, c_z {args.c_z}, {args.heads}x{args.head_dim} heads, bf16"
    if args.part in ("all", "timing"):
        print(f"training step time and peak memory ({model_desc}, batch 1)")
        rows = time_steps(args, chains, meta)
        path = Path(args.json) if args.json else out / f"train-{tag}.json"
        path.write_text(json.dumps(rows, indent=1))
        print_acceptance(rows)
        plot_timing(rows, path.with_suffix(".png"),
                    f"tpf training step, {model_desc}, {gpu}, {meta['commit']}")
        print(f"wrote {path} and {path.with_suffix('.png')}")
    if args.part == "profile":
        profile_steps(args, chains)
    if args.part in ("all", "stability"):
        result = stability(args, chains, meta)
        path = out / f"train-stability-{tag}.json"
        path.write_text(json.dumps(result, indent=1))
        plot_stability(result, path.with_suffix(".png"),
                       f"stability: {args.steps} steps at lr {args.lr} after a shared "
                       f"{args.warmup_steps}-step warm-up, crop {args.stability_crop}, {model_desc}")
        for name, s in result["summary"].items():
            print(f"  {name:<22} final {s['final_loss_25']:.4f}  mean gap to reference "
                  f"{s['mean_gap_to_reference']:.4f} (seed-to-seed {result['seed_to_seed_gap']:.4f})"
                  f"  non-finite steps {s['nonfinite_steps'] or 'none'}")
        print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
