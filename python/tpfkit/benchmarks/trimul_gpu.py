"""Triangle multiplicative update on one GPU, side by side in one run: tpfkit, plain PyTorch
(eager), the same under torch.compile, and cuEquivariance when it imports.

Per implementation and shape (B = 1, bf16, both directions): median forward and forward+backward
time (CUDA events, warm-up, two rotating input sets), peak memory above the inputs during
forward+backward, and the relative error of y against FP64 (the PyTorch implementation in float64 on
the GPU, which tests/python checks against the C++ FP64 reference). Writes
bench/results/trimul-<gpu>.json (one row per implementation and shape, as
`tpf bench trimul --json`) and a PNG plot beside it, and prints the issue's acceptance ratios and the
floor at S=768, D=128.

    python bench/trimul.py                       # the issue's grid: S 384 640 768, D 64 128
    python bench/trimul.py --dims 64 && python bench/trimul.py --dims 128 --merge   # in two runs
    python bench/trimul.py --sizes 384 --dims 128 --no-compile   # a quick look

torch.compile compiles each shape statically (as a user with fixed crops would); those compiles
take most of a full run's time.
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch
from tqdm import tqdm

from tpfkit.benchmarks.results import metadata
from tpfkit.benchmarks.trimul import forward_backward_call, make_inputs, time_impl
from tpfkit.ops.torch_reference import triangle_multiplicative_update_torch
from tpfkit.ops.trimul import triangle_multiplicative_update

HBM_BYTES_PER_S = 4.2e12    # the issue's floor: bytes over ~4.2 TB/s
MMA_FLOP_PER_S = 760e12     # and contraction FLOP over ~760 TFLOP/s


def peers(use_compile: bool) -> dict:
    impls = {"tpfkit": triangle_multiplicative_update,
             "torch_eager": triangle_multiplicative_update_torch}
    if use_compile:
        torch._dynamo.config.cache_size_limit = 256
        impls["torch_compile"] = torch.compile(triangle_multiplicative_update_torch, dynamic=False)
    try:
        import cuequivariance_torch as cuet
        impls["cuequivariance"] = cuet.triangle_multiplicative_update
    except Exception as e:  # not installed, or its kernels do not load on this machine
        print(f"cuEquivariance not measured: {type(e).__name__}: {e}")
    return impls


def peak_extra_gib(fn, inputs, direction: str, device) -> float:
    """Peak allocated memory above what was allocated before one forward+backward, in GiB."""
    call = forward_backward_call(fn, inputs, direction)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    call()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del call
    return peak / 2**30


def rel_err_percent(fn, inputs, direction: str, y_ref: torch.Tensor) -> float:
    x, mask, w, _ = inputs
    with torch.no_grad():
        y = fn(x, direction, mask, **w).double()
    return 100.0 * ((y - y_ref).norm() / y_ref.norm()).item()


def fp64_reference(inputs, direction: str) -> torch.Tensor:
    x, mask, w, _ = inputs
    with torch.no_grad():
        return triangle_multiplicative_update_torch(
            x.double(), direction, mask, **{k: v.double() for k, v in w.items()})


def floor_ms(S: int, D: int, elem_bytes: int = 2) -> dict:
    """The issue's floor for forward+backward: bytes over 4.2 TB/s plus contraction FLOP over
    760 TFLOP/s. Bytes counted two ways: the least any design moves (x, y, grad_out, dx once, and the
    saved a, b, z, go written once and read once) and what this design moves (every pass below)."""
    unit = S * S * D * elem_bytes
    minimal = (4 + 2 * 4) * unit
    # Forward: x; a, b, go written; a, b read, z written; z, go read, y written.
    # Backward: z, go, dy read, dz, dgo, dpo, z_ln written; dpo, z_ln read (d p_out_weight); dz, a, b
    # read, dA, dB written; x, dA, dB, dgo read, dx, x_ln, dP|dG (4) written; dP|dG, x_ln (twice),
    # dgo read (weight gradients).
    ours = (1 + 3 + 3 + 3) * unit + (3 + 4 + 2 + 5 + 4 + 6 + 7) * unit
    flop = 3 * 2 * S ** 3 * D  # z forward; dA and dB backward
    compute_ms = 1e3 * flop / MMA_FLOP_PER_S
    return {"minimal_bytes_ms": 1e3 * minimal / HBM_BYTES_PER_S,
            "design_bytes_ms": 1e3 * ours / HBM_BYTES_PER_S, "compute_ms": compute_ms}


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = sorted({(r["D"], r["direction"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.8), squeeze=False)
    for ax, (D, direction) in zip(axes[0], keys):
        for impl in dict.fromkeys(r["impl"] for r in rows):
            pts = sorted((r["S"], r["fwd_bwd_ms"]) for r in rows
                         if r["impl"] == impl and r["D"] == D and r["direction"] == direction
                         and r["fwd_bwd_ms"] is not None)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl)
        ax.set_title(f"D={D}, {direction}")
        ax.set_xlabel("S")
        ax.set_ylabel("forward+backward ms")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=int, nargs="+", default=[384, 640, 768])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--directions", nargs="+", default=["outgoing", "incoming"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-compile", action="store_true", help="leave out torch.compile")
    parser.add_argument("--json", default=None, help="default: bench/results/trimul-<gpu>.json")
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows of other shapes already in the JSON file")


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("tpf bench trimul-gpu (bench/trimul.py) needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    meta = metadata(device)
    gpu_slug = meta["gpu"].lower().replace("nvidia", "").split()[0] if meta["gpu"] else "gpu"
    out = Path(args.json or Path("bench/results") / f"trimul-{gpu_slug}.json")
    out.parent.mkdir(parents=True, exist_ok=True)

    with_meta = lambda r: {**r, "commit": meta["commit"], "gpu": meta["gpu"], "date": meta["date"],
                           "machine": meta["machine"]}
    merged_from = json.loads(out.read_text()) if args.merge and out.exists() else []
    key = lambda r: (r["impl"], r["direction"], r["D"], r["S"])

    def save(rows):  # with --merge, the file's rows of other shapes stay
        fresh = {key(r) for r in rows}
        rows = [r for r in merged_from if key(r) not in fresh] + [with_meta(r) for r in rows]
        out.write_text(json.dumps(rows, indent=1))
        return rows

    impls = peers(not args.no_compile)
    shapes = [(D, S, d) for D in args.dims for S in args.sizes for d in args.directions]
    rows = []
    bar = tqdm(total=len(shapes) * len(impls), desc="trimul bench", unit="run")
    for D, S, direction in shapes:
        input_sets = [make_inputs(S, D, torch.bfloat16, device, seed=S + D + i) for i in range(2)]
        inputs = input_sets[0]
        y_ref = fp64_reference(inputs, direction)
        for name, fn in impls.items():
            bar.set_postfix_str(f"{name} D={D} S={S} {direction}")
            row = {"impl": name, "direction": direction, "D": D, "S": S, "fwd_ms": None,
                   "fwd_bwd_ms": None, "peak_extra_gib": None, "rel_err_y": None}
            try:
                row["fwd_ms"], row["fwd_bwd_ms"] = time_impl(fn, input_sets, direction, device,
                                                             args.repeats)
                row["peak_extra_gib"] = peak_extra_gib(fn, inputs, direction, device)
                row["rel_err_y"] = rel_err_percent(fn, inputs, direction, y_ref)
            except Exception as e:  # one failing peer must not lose the others' numbers
                row["error"] = f"{type(e).__name__}: {e}"
                tqdm.write(f"{name} D={D} S={S} {direction} failed:\n{traceback.format_exc()}")
            rows.append(row)
            bar.update(1)
            save(rows)  # after every row: a run stopped by a time limit keeps what it measured
        del y_ref, inputs, input_sets
        torch.cuda.empty_cache()
    bar.close()

    rows = save(rows)
    plot(rows, out.with_suffix(".png"),
         f"triangle multiplicative update, B=1, bf16, {meta['gpu']} ({meta['commit']})")

    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    print(f"\n{'impl':<16}{'dir':>9}{'D':>5}{'S':>5}{'fwd ms':>9}{'f+b ms':>9}{'peak GiB':>10}"
          f"{'err %':>9}")
    for r in rows:
        print(f"{r['impl']:<16}{r['direction']:>9}{r['D']:>5}{r['S']:>5}{fmt(r['fwd_ms'], '9.3f')}"
              f"{fmt(r['fwd_bwd_ms'], '9.3f')}{fmt(r['peak_extra_gib'], '10.3f')}"
              f"{fmt(r['rel_err_y'], '9.4f')}")

    print("\nAcceptance: forward+backward, tpfkit / torch_compile "
          "(at most 0.5 everywhere, 0.3 at S=768)")
    by_key = {(r["impl"], r["direction"], r["D"], r["S"]): r for r in rows}
    all_ok = True
    for D, S, direction in sorted({(r["D"], r["S"], r["direction"]) for r in rows}):
        ours = by_key[("tpfkit", direction, D, S)]["fwd_bwd_ms"]
        peer = by_key.get(("torch_compile", direction, D, S), {}).get("fwd_bwd_ms")
        if ours is None or peer is None:
            print(f"  D={D} S={S} {direction}: not measured")
            all_ok = False
            continue
        limit = 0.3 if S == 768 else 0.5
        ok = ours / peer <= limit
        all_ok &= ok
        print(f"  D={D} S={S} {direction}: {ours:.3f} / {peer:.3f} = {ours / peer:.3f} "
              f"(limit {limit}) {'met' if ok else 'MISSED'}")
    for direction in ("outgoing", "incoming"):
        r = by_key.get(("tpfkit", direction, 128, 768))
        if r and r["fwd_bwd_ms"] is not None:
            f = floor_ms(768, 128)
            floor = f["design_bytes_ms"] + f["compute_ms"]
            print(f"\nFloor at S=768, D=128, {direction}: contraction {f['compute_ms']:.3f} ms + bytes "
                  f"{f['minimal_bytes_ms']:.3f} ms (least any design moves) or "
                  f"{f['design_bytes_ms']:.3f} ms (what this design moves); ours "
                  f"{r['fwd_bwd_ms']:.3f} ms = {r['fwd_bwd_ms'] / floor:.2f} x the design floor")
    print(f"\nwrote {out} and {out.with_suffix('.png')}")
    print("acceptance ratios: all met" if all_ok else "acceptance ratios: NOT all met")
    return 0

