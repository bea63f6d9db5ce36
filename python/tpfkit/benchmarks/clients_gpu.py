"""The client packages' own PairFormer stacks on three paths: their PyTorch code, their
cuEquivariance path and ours (tpfkit.integrations), issue 21.

For OpenFold3 0.5.0, Boltz 2.2.1 and Protenix 2.0.0: the PairFormer stack in its default
configuration (AlphaFold3's widths: c_s 384, c_z 128, 4 triangle heads of dim 32, 16 single heads;
4 blocks; dropout 0.25, in training mode), fp32 parameters under bf16 autocast (as their trainers
run: Lightning's bf16-mixed), batch 1, the last 1/8 of the tokens padded (OpenFold3, Boltz;
Protenix's stack takes no token mask and pads none). Per client, N and path: the median time of a
forward + backward step (CUDA events, after warm-up steps), the peak memory allocated during the
timed steps, and whether every gradient (parameters, s and z) is bitwise the same in every timed
step (each step reseeds, so dropout draws the same masks). A path that runs out of memory is
recorded as such; what the time budget leaves unrun is recorded as not run.

Protenix runs with LAYERNORM_TYPE=torch (PyTorch's LayerNorm on every path: its default, a CUDA
extension compiled at import, is not built on the benchmark machine). Where biotite or rdkit is
absent (the GPU machine), placeholders of the names the PairFormer modules import stand in for
them (OpenFold3 imports biotite's AtomArray for type hints; Protenix names its element features
by rdkit's element symbols at import, which the placeholder numbers instead; neither runs in a
PairFormer step, and anything else of a placeholder raises if called).

    python bench/clients.py --json OUT/clients.json --plot OUT/clients.png

Module rows (issue 30): one module of each client's pair stack alone, fwd + bwd, in the same
configuration and precision (its default widths, z [1, N, N, 128], the client's own module and
parameters, on each path):

    python bench/clients.py --module tri_att_start --paths ours cuequivariance \
        --json OUT/clients-tri-att.json          # N = 384, 768, 1024 by default

Breakdown (issue 30, --breakdown; stack or module rows): after the timed steps, one more step of
each row under torch.profiler, its kernels classified by name (tpfkit.benchmarks.
breakdown.CLASSES: our attention, our trimul, our fused glue, cuBLAS/GEMM, cuEquivariance, other
PyTorch): ms and share of the step per class in each row's "breakdown", printed as a table with
the largest kernel names no pattern matched, and stacked bars in the plot. On the CPU it runs too
(ops' self CPU times), for testing: `--config small` builds the clients' small test configurations.

    python bench/clients.py --breakdown --sizes 384 768 --json OUT/clients-breakdown.json \
        --plot OUT/clients-breakdown.png
"""
from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import importlib.util
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

import torch
from tqdm import tqdm

from tpfkit.benchmarks import breakdown
from tpfkit.benchmarks.results import git_commit
from tpfkit.benchmarks.clients import CLIENTS, MODULES, PATHS, widths

PAD_FRACTION = 1 / 8


def placeholder_modules() -> list[str]:
    """Placeholders for the absent packages whose names the PairFormer modules import."""
    def unavailable(name):
        def call(*args, **kwargs):
            raise RuntimeError(f"{name} is a placeholder (bench/clients.py): not installed here")
        return call

    class PeriodicTable:  # Protenix names its element features by symbol at import
        def GetElementSymbol(self, number):
            return f"placeholder-element-{number}"

        def __getattr__(self, name):
            return unavailable(f"GetPeriodicTable().{name}")

    names = {"biotite": {"biotite.structure": {"AtomArray": type("AtomArray", (), {})}},
             "rdkit": {"rdkit.Chem": {"GetPeriodicTable": PeriodicTable}}}
    made = []
    for package, modules in names.items():
        if importlib.util.find_spec(package) is not None:
            continue
        sys.modules[package] = types.ModuleType(package)
        for name, attrs in modules.items():
            module = types.ModuleType(name)
            module.__dict__.update(attrs)
            sys.modules[name] = module
            setattr(sys.modules[package], name.rsplit(".", 1)[1], module)
        made.append(package)
    return made


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(client, model, inputs, grads_out, path, args) -> dict:
    """Step time, peak memory and bitwise repeatability of one path."""
    s_in = inputs["s"].detach().requires_grad_(True)
    z_in = inputs["z"].detach().requires_grad_(True)
    x = {**inputs, "s": s_in, "z": z_in}

    def forward():
        s, z = client.run(model, x, path)
        return [s, z], [grads_out["s"], grads_out["z"]]
    return measure_steps(forward, [s_in, z_in] + list(model.parameters()), inputs["z"].device,
                         args)


def measure_module(client, kind, module, z, pair_mask, grad_out, path, args) -> dict:
    """measure() for one module of the pair stack (MODULES) on z: its forward + backward."""
    z_in = z.detach().requires_grad_(True)

    def forward():
        return [client.run_module(kind, module, z_in, pair_mask, path)], [grad_out]
    return measure_steps(forward, [z_in] + list(module.parameters()), z.device, args)


def measure_steps(forward, leaves, device, args) -> dict:
    """Times forward() (outputs and their gradients) + backward under bf16 autocast: the median
    step, the peak memory during the timed steps, and whether the leaves' gradients are bitwise
    the same in every timed step."""
    cuda = device.type == "cuda"

    def step():
        torch.manual_seed(args.seed)  # the same dropout masks every step
        for t in leaves:
            t.grad = None
        with torch.autocast(device.type, dtype=torch.bfloat16):
            outs, grads = forward()
        torch.autograd.backward(outs, [g.to(o.dtype) for g, o in zip(grads, outs)])

    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0
    times, first, same = [], None, True
    for i in range(args.steps):
        t0 = time.perf_counter()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        step()
        if cuda:
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            times.append((time.perf_counter() - t0) * 1e3)
        grads = [t.grad for t in leaves]
        if first is None:
            first = [None if g is None else g.clone() for g in grads]
        else:
            same = same and all((a is None and b is None) or
                                (a is not None and b is not None and torch.equal(a, b))
                                for a, b in zip(first, grads))
    peak = torch.cuda.max_memory_allocated(device) if cuda else 0
    out = {"status": "ok", "step_ms": statistics.median(times), "step_ms_all": times,
           "peak_gib": peak / 2**30 if cuda else None,
           "peak_above_inputs_gib": (peak - base) / 2**30 if cuda else None,
           "bitwise_repeatable": same, "steps": args.steps}
    if getattr(args, "breakdown", False):  # one more step, profiled (after the peak is read)
        try:
            out["breakdown"] = breakdown.profile_step(step, device, out["step_ms"])
        except Exception as e:  # noqa: BLE001  (the row's timings stand without it)
            out["breakdown_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            release()
    return out


def configuration(client, args) -> dict:
    """The client's default configuration (AlphaFold3's widths), or its small test one."""
    return client.small if getattr(args, "config", "default") == "small" else client.defaults


def not_run(path: str, deadline: float) -> str | None:
    """Why a row is not run (the time budget is spent, cuEquivariance is missing), or None."""
    if time.monotonic() > deadline:
        return "not run: time budget"
    if path == "cuequivariance" and importlib.util.find_spec("cuequivariance_ops_torch") is None:
        return "not run: cuequivariance_ops_torch is not installed"
    return None


def run_rows(args) -> list[dict]:
    if args.module:
        return run_modules(args)
    device = torch.device(args.device)
    deadline = time.monotonic() + args.budget_s
    jobs = [(c, n, p) for c in args.clients for n in args.sizes for p in ("ours", "cuequivariance")
            if p in args.paths]
    # The PyTorch path last: it is the slowest and the acceptance lines compare the others.
    jobs += [(c, n, "pytorch") for c in args.clients for n in args.sizes if "pytorch" in args.paths]
    rows, models = [], {}
    for client_name, N, path in tqdm(jobs, desc="client steps"):
        client = CLIENTS[client_name]
        row = {"client": client_name, "N": N, "path": path}
        rows.append(row)
        if reason := not_run(path, deadline):
            row["status"] = reason
            continue
        if client_name not in models:
            models.clear()
            release()
            torch.manual_seed(args.seed)
            config = {**configuration(client, args)}
            models[client_name] = client.build(**config).to(device).train()
        model = models[client_name]
        c_s, c_z = widths(client, configuration(client, args))
        gen = torch.Generator().manual_seed(args.seed + N)
        padded = int(N * PAD_FRACTION) if client.batched else 0
        inputs = client.inputs(N, c_s, c_z, padded=padded, generator=gen, device=device)
        grads_out = {k: torch.randn(inputs[k].shape, generator=gen).to(device) for k in ("s", "z")}
        try:
            row.update(measure(client, model, inputs, grads_out, path, args))
        except torch.OutOfMemoryError:
            row["status"] = "out of memory"
        except Exception as e:  # noqa: BLE001  (a path that fails is recorded, the rest still runs)
            row["status"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
        finally:
            for p in model.parameters():
                p.grad = None
            del inputs, grads_out
            release()
        tqdm.write(f"{client_name:9s} N={N:5d} {path:15s} {describe(row)}")
    return rows


def run_modules(args) -> list[dict]:
    """Module rows (--module): one module of each client's pair stack in its default
    configuration (AlphaFold3's widths), fwd + bwd on z [1, N, N, c_z], per N and path."""
    device = torch.device(args.device)
    deadline = time.monotonic() + args.budget_s
    jobs = [(c, n, p) for c in args.clients for n in args.sizes for p in PATHS if p in args.paths]
    rows = []
    for client_name, N, path in tqdm(jobs, desc=f"{args.module} steps"):
        client = CLIENTS[client_name]
        row = {"client": client_name, "module": args.module, "N": N, "path": path}
        rows.append(row)
        if reason := not_run(path, deadline):
            row["status"] = reason
            continue
        torch.manual_seed(args.seed)
        module = client.module(args.module, configuration(client, args)).to(device).train()
        c_s, c_z = widths(client, configuration(client, args))
        gen = torch.Generator().manual_seed(args.seed + N)
        padded = int(N * PAD_FRACTION) if client.batched else 0
        inputs = client.inputs(N, c_s, c_z, padded=padded, generator=gen, device=device)
        grad_out = torch.randn(inputs["z"].shape, generator=gen).to(device)
        try:
            row.update(measure_module(client, args.module, module, inputs["z"],
                                      inputs["pair_mask"], grad_out, path, args))
        except torch.OutOfMemoryError:
            row["status"] = "out of memory"
        except Exception as e:  # noqa: BLE001  (a path that fails is recorded, the rest still runs)
            row["status"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
        finally:
            del module, inputs, grad_out
            release()
        tqdm.write(f"{client_name:9s} {args.module} N={N:5d} {path:15s} {describe(row)}")
    return rows


def ours_and_cueq(rows: list[dict]):
    """(client, N, our row, cuEquivariance's row) per client and N measured; a row is None where
    that path did not run or failed."""
    def get(client, N, path):
        return next((r for r in rows if r["client"] == client and r["N"] == N
                     and r["path"] == path and r.get("status") == "ok"), None)

    for client in sorted({r["client"] for r in rows}):
        for N in sorted({r["N"] for r in rows if r["client"] == client}):
            yield client, N, get(client, N, "ours"), get(client, N, "cuequivariance")


def module_lines(rows: list[dict]) -> list[str]:
    """Ours against cuEquivariance per client and N, module rows (issue 30: the triangle attention
    module at most 0.6x at N = 768)."""
    lines = []
    for client, N, ours, cueq in ours_and_cueq(rows):
        if ours is None or cueq is None:
            lines.append(f"{client} {rows[0]['module']} N={N}: not measured (ours or "
                         f"cuEquivariance missing)")
            continue
        peak = ("" if ours["peak_gib"] is None else
                f", peak {ours['peak_gib']:.2f} vs {cueq['peak_gib']:.2f} GiB")
        lines.append(f"{client} {rows[0]['module']} N={N}: ours {ours['step_ms']:.2f} ms, "
                     f"cuEquivariance {cueq['step_ms']:.2f} ms, ratio "
                     f"{ours['step_ms'] / cueq['step_ms']:.2f}{peak}")
    return lines


def describe(row: dict) -> str:
    if row.get("status") != "ok":
        return row["status"]
    peak = "" if row["peak_gib"] is None else f"{row['peak_gib']:6.1f} GiB  "
    return f"{row['step_ms']:8.1f} ms  {peak}repeatable {row['bitwise_repeatable']}"


def acceptance(rows: list[dict]) -> list[str]:
    """Issue 30's lines, from the rows: each client's step at most 0.6x its cuEquivariance step
    at N >= 768 and 0.7x below, peak memory no higher, bitwise repeatable."""
    lines = []
    for client, N, ours, cueq in ours_and_cueq(rows):
        if ours is None or cueq is None:
            lines.append(f"{client} N={N}: not measured (ours or cuEquivariance missing)")
            continue
        ratio, bar = ours["step_ms"] / cueq["step_ms"], 0.6 if N >= 768 else 0.7
        mem = (ours["peak_gib"] or 0) <= (cueq["peak_gib"] or 0)
        lines.append(f"{client} N={N}: ours/cuEquivariance step {ratio:.2f} (<= {bar}: "
                     f"{'met' if ratio <= bar else 'MISSED'}), peak {ours['peak_gib']:.1f} vs "
                     f"{cueq['peak_gib']:.1f} GiB ({'no higher' if mem else 'HIGHER'})")
    for client in sorted({r["client"] for r in rows}):
        ours_rows = [r for r in rows if r["client"] == client and r["path"] == "ours"
                     and r.get("status") == "ok"]
        if ours_rows:
            rep = all(r["bitwise_repeatable"] for r in ours_rows)
            lines.append(f"{client}: ours bitwise repeatable over {ours_rows[0]['steps']} steps at "
                         f"every N measured: {'yes' if rep else 'NO'}")
    return lines


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clients = sorted({r["client"] for r in rows})
    bars = any(r.get("breakdown") for r in rows)  # a third row: the --breakdown's stacked bars
    fig, axes = plt.subplots(3 if bars else 2, len(clients),
                             figsize=(4.5 * len(clients), 10.5 if bars else 7), dpi=120,
                             squeeze=False)
    for j, client in enumerate(clients):
        for i, (key, label) in enumerate((("step_ms", "fwd+bwd step (ms)"),
                                          ("peak_gib", "peak memory (GiB)"))):
            ax = axes[i][j]
            for p in PATHS:
                pts = sorted((r["N"], r[key]) for r in rows if r["client"] == client
                             and r["path"] == p and r.get("status") == "ok" and r.get(key))
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=p)
            ax.set_xlabel("N (tokens)")
            ax.set_ylabel(label)
            ax.set_title(client)
            ax.grid(alpha=0.3)
            if ax.lines:  # no memory on the CPU
                ax.legend()
        if bars:
            ax = axes[2][j]
            breakdown.plot_bars(ax, sorted(
                (r for r in rows if r["client"] == client and r.get("breakdown")),
                key=lambda r: (r["N"], PATHS.index(r["path"]))))
            ax.set_title(f"{client}: one profiled step by component")
            ax.grid(alpha=0.3, axis="y")
            ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def print_rows(rows: list[dict], title: str) -> None:
    """One line a row (client, N, path order), under `title`."""
    print(f"\nsummary ({title}):")
    for r in sorted(rows, key=lambda r: (r["client"], r["N"], PATHS.index(r["path"]))):
        print(f"  {r['client']:9s} N={r['N']:5d} {r['path']:15s} {describe(r)}")


def print_breakdown(rows: list[dict]) -> None:
    """The --breakdown table (ms and share of the step per class) and the largest unknown names."""
    for r in rows:
        if r.get("breakdown_error"):
            print(f"breakdown of {r['client']} N={r['N']} {r['path']} failed: "
                  f"{r['breakdown_error']}")
    rows = sorted((r for r in rows if r.get("breakdown")),
                  key=lambda r: (r["client"], r["N"], PATHS.index(r["path"])))
    if not rows:
        return
    print(f"\nbreakdown of one profiled step ({rows[0]['breakdown']['source']}; ms and share "
          f"of the step; outside: the median step's time outside them):")
    for line in breakdown.table(rows):
        print("  " + line)
    unknown = breakdown.unknown_top(rows)
    print("\nlargest names no pattern of breakdown.CLASSES matched (counted as other PyTorch):")
    for name, ms, count in unknown:
        print(f"  {ms:9.3f} ms  x{count:<5d} {name[:160]}")
    if not unknown:
        print("  none")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", nargs="+", default=list(CLIENTS), choices=list(CLIENTS))
    parser.add_argument("--sizes", nargs="+", type=int, default=None,
                        help="N (default 384 640 768 1024; with --module 384 768 1024)")
    parser.add_argument("--module", choices=MODULES, default=None,
                        help="module rows: this module of each client's pair stack alone (fwd + "
                             "bwd), not the stack; e.g. --module tri_att_start --paths ours "
                             "cuequivariance")
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    parser.add_argument("--breakdown", action="store_true",
                        help="also profile one step per row and break its time down by component "
                             "(our kernels, fused glue, GEMMs, cuEquivariance, other PyTorch)")
    parser.add_argument("--config", choices=("default", "small"), default="default",
                        help="the clients' default configurations (AlphaFold3's widths) or their "
                             "small test ones (CPU smoke runs)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (and the repeatability check)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget-s", type=float, default=330.0,
                        help="rows not started by then are recorded as not run")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)


def run(args: argparse.Namespace) -> int:
    if args.sizes is None:
        args.sizes = [384, 768, 1024] if args.module else [384, 640, 768, 1024]

    os.environ.setdefault("LAYERNORM_TYPE", "torch")
    placeholders = placeholder_modules()
    device = torch.device(args.device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    meta = {"commit": git_commit(), "gpu": gpu, "date": datetime.date.today().isoformat(),
            "torch": torch.__version__, "precision": "bf16 autocast, fp32 parameters",
            "placeholders": placeholders, "module": args.module, "config": args.config,
            "breakdown_classes": ([list(row) for row in breakdown.CLASSES]
                                  if args.breakdown else None)}
    for name in ("openfold3", "boltz", "protenix", "cuequivariance_torch",
                 "cuequivariance_ops_torch"):
        try:
            meta[name] = importlib.metadata.version(name.replace("_", "-")
                                                    if "cuequivariance" in name else name)
        except importlib.metadata.PackageNotFoundError:
            meta[name] = None
    print("clients benchmark:", json.dumps(meta))
    rows = [{**r, **{k: meta[k] for k in ("commit", "gpu", "date")}} for r in run_rows(args)]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if args.module:
        print_rows(rows, f"{args.module} alone, fwd + bwd: median step, peak memory, gradients "
                         f"bitwise the same in every timed step")
        print("\nours against cuEquivariance:")
        for line in module_lines(rows):
            print("  " + line)
        print_breakdown(rows)
        return 0
    if args.plot:
        plot(rows, args.plot, f"client PairFormer stacks (4 blocks, bf16 autocast), {gpu}, "
                              f"{meta['commit']}")
    print_rows(rows, "median step, peak memory, gradients bitwise the same in every timed step")
    print("\nacceptance (issue 21):")
    for line in acceptance(rows):
        print("  " + line)
    print_breakdown(rows)
    return 0

