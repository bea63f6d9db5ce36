"""Triangle attention on a GPU, side by side in one run: TurboPairFormer, PyTorch eager, PyTorch
SDPA (bias as attn_mask), TriFast and cuEquivariance (each when importable).

B = 1, N = S, H = 4, BF16, the tail 10% of keys masked. Reports forward and forward+backward median
time (CUDA events, warm-up, two rotating input sets), peak extra memory of forward+backward, and the
relative L2 error (%) of O, dQ, dK, dV and dbias against an FP64 reference computed on the GPU.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import tpfkit as tpf
from tpfkit.benchmarks.attention import make_inputs
from tpfkit.benchmarks.results import git_commit
from tpfkit.benchmarks.timing import median_ms
from tpfkit.ops.torch_reference import triangle_attention_torch

GRADS = ("dq", "dk", "dv", "dbias")


@dataclass
class Impl:
    """An implementation in its native layout: prepare() converts our layout once, outside the
    timed region; run() is timed; to_ours() converts outputs/gradients back for the error."""
    prepare: Callable
    run: Callable
    to_ours: Callable = lambda name, x: x


def ours_layout():
    return Impl(prepare=lambda q, k, v, b, m: ((q, k, v, b), m),
                run=lambda q, k, v, b, m: tpf.triangle_attention(q, k, v, b, m))


def ours_no_residual():
    """Our kernels with output-residual compensation switched off: the accuracy line's baseline."""
    return Impl(prepare=lambda q, k, v, b, m: ((q, k, v, b), m),
                run=lambda q, k, v, b, m: tpf.triangle_attention(q, k, v, b, m, residual=False))


def torch_eager():
    return Impl(prepare=lambda q, k, v, b, m: ((q, k, v, b), m),
                run=lambda q, k, v, b, m: triangle_attention_torch(q, k, v, b, m))


def torch_sdpa():
    # B = 1 and the same masked keys in every slice: the slices become SDPA's batch and the bias
    # plus the key mask one [1, H, S, S] attn_mask broadcast over it.
    def prepare(q, k, v, b, m):
        B, N, H, S, D = q.shape
        keys = m.reshape(B * N, S)[0]
        add = torch.zeros(S, device=q.device, dtype=q.dtype).masked_fill(~keys, float("-inf"))
        return (q.reshape(B * N, H, S, D), k.reshape(B * N, H, S, D), v.reshape(B * N, H, S, D),
                b.reshape(B, H, S, S)), add

    def run(q, k, v, b, add):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=b + add)

    def to_ours(name, x):
        return x.reshape(1, *x.shape) if name != "dbias" else x.reshape(1, 1, *x.shape[1:])

    return Impl(prepare, run, to_ours)


def trifast_impl():
    from trifast import triangle_attention as trifast_attention

    # TriFast: q, k, v [B, H, N, S, D], bias [B, H, S, S], mask [B, N, S] with True = masked.
    def prepare(q, k, v, b, m):
        B, N, H, S, D = q.shape
        t = lambda x: x.permute(0, 2, 1, 3, 4).contiguous()
        return (t(q), t(k), t(v), b.reshape(B, H, S, S).contiguous()), (~m.reshape(B, N, S)).contiguous()

    def to_ours(name, x):
        return x.reshape(x.shape[0], 1, *x.shape[1:]) if name == "dbias" else x.permute(0, 2, 1, 3, 4)

    return Impl(prepare, lambda q, k, v, b, m: trifast_attention(q, k, v, b, m), to_ours)


def cuequivariance_impl():
    import cuequivariance_ops_torch  # noqa: F401  (the kernels: cuequivariance_torch imports without them)
    import cuequivariance_torch as cuet

    return Impl(prepare=lambda q, k, v, b, m: ((q, k, v, b), m),
                run=lambda q, k, v, b, m: cuet.triangle_attention(q, k, v, b, m))


IMPLS = {
    "tpfkit": ours_layout,
    "tpfkit_no_residual": ours_no_residual,
    "torch_eager": torch_eager,
    "torch_sdpa": torch_sdpa,
    "trifast": trifast_impl,
    "cuequivariance": cuequivariance_impl,
}


def reference_fp64(q, k, v, bias, mask, grad, chunk=32):
    """O and gradients in float64 on the GPU, slices in chunks (dbias summed over them)."""
    out = {name: [] for name in ("o", "dq", "dk", "dv")}
    dbias = torch.zeros(bias.shape, dtype=torch.float64, device=bias.device)
    b64 = bias.double().requires_grad_(True)
    for n0 in range(0, q.shape[1], chunk):
        sl = slice(n0, n0 + chunk)
        leaves = [x[:, sl].double().requires_grad_(True) for x in (q, k, v)]
        o = triangle_attention_torch(*leaves, b64, mask[:, sl])
        o.backward(grad[:, sl].double())
        out["o"].append(o.detach())
        for name, x in zip(("dq", "dk", "dv"), leaves):
            out[name].append(x.grad)
        dbias += b64.grad
        b64.grad = None
    ref = {name: torch.cat(parts, dim=1) for name, parts in out.items()}
    ref["dbias"] = dbias
    return ref


def rel_err_percent(x, ref):
    return 100.0 * (torch.linalg.vector_norm(x.double() - ref) / torch.linalg.vector_norm(ref)).item()


def rounding_floor(ref, dtype, bias_dtype) -> dict:
    """The errors of the FP64 results themselves once stored in the outputs' dtypes (O, dQ, dK, dV in
    q's, dbias in the bias's, as autograd returns them): no implementation's outputs can be closer
    than this except by chance. On these inputs bf16 gives ~0.166 % for every output (D 32, S 384),
    which is why the issue's 0.081 % dbias of the former kernel (another harness) cannot be met on a
    bf16 dbias."""
    dtypes = {"O": dtype, "dQ": dtype, "dK": dtype, "dV": dtype, "dbias": bias_dtype}
    return {f"rel_err_{k}": rel_err_percent(ref[k.lower()].to(dt), ref[k.lower()])
            for k, dt in dtypes.items()}


def measure(impl: Impl, inputs_sets, grad_sets, repeats):
    prepared = [impl.prepare(*inp) for inp in inputs_sets]
    grads = []
    for (args, _), g in zip(prepared, grad_sets):
        grads.append(impl.prepare(g, g, g, inputs_sets[0][3], inputs_sets[0][4])[0][0])
    leaves_sets = [[a.detach().requires_grad_(True) for a in args] for args, _ in prepared]
    state = {"i": 0}

    def forward():
        args, extra = prepared[state["i"] % 2]
        state["i"] += 1
        with torch.no_grad():
            return impl.run(*args, extra)

    def forward_backward():
        i = state["i"] % 2
        state["i"] += 1
        leaves, (_, extra) = leaves_sets[i], prepared[i]
        for t in leaves:
            t.grad = None
        impl.run(*leaves, extra).backward(grads[i])

    fwd = median_ms(forward, torch.device("cuda"), warmup=3, repeats=repeats)
    try:
        fwd_bwd = median_ms(forward_backward, torch.device("cuda"), warmup=3, repeats=repeats)
    except ValueError as e:  # a backward this implementation does not take
        print(f"#   forward only: {str(e).splitlines()[0]}", flush=True)
        args, extra = prepared[0]
        with torch.no_grad():
            out = impl.run(*args, extra)
        return fwd, None, None, {"o": impl.to_ours("o", out)}

    # Peak extra memory of one forward+backward over what the inputs already hold.
    leaves, (_, extra) = leaves_sets[0], prepared[0]
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = impl.run(*leaves, extra)
    out.backward(grads[0])
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    result = {"o": out.detach(), **{n: t.grad for n, t in zip(GRADS, leaves)}}
    return fwd, fwd_bwd, peak, {n: impl.to_ours(n, x) for n, x in result.items()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=int, nargs="+", default=[384, 640, 768])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--impls", nargs="+", default=list(IMPLS))
    parser.add_argument("--bias-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="float32: Protenix's bias (bias.float()) with bf16 q, k, v")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)


def run(args: argparse.Namespace) -> int:

    impls = {}
    for name in args.impls:
        try:
            impls[name] = IMPLS[name]()
        except ImportError as e:
            print(f"# {name}: not importable here ({e}); skipped", flush=True)
    meta = {"commit": git_commit(), "gpu": torch.cuda.get_device_name(),
            "date": datetime.date.today().isoformat()}
    rows = []
    print(f"{'impl':<16}{'D':>4}{'S':>6}{'fwd ms':>9}{'f+b ms':>9}{'GiB':>7}"
          f"{'O%':>7}{'dQ%':>7}{'dK%':>7}{'dV%':>7}{'db%':>7}", flush=True)
    for D in args.head_dims:
        for S in args.sizes:
            sets = [make_inputs(S, D, args.heads, torch.bfloat16, torch.device("cuda"), seed=S * 10 + D + i)
                    for i in range(2)]
            if args.bias_dtype == "float32":
                sets = [(q, k, v, b.float(), m, g) for q, k, v, b, m, g in sets]
            inputs_sets = [s[:5] for s in sets]
            grad_sets = [s[5] for s in sets]
            ref = reference_fp64(*inputs_sets[0], grad_sets[0])
            floor = rounding_floor(ref, inputs_sets[0][0].dtype, inputs_sets[0][3].dtype)
            rows.append({"impl": "fp64_rounded", "D": D, "S": S, "bias_dtype": args.bias_dtype,
                         "fwd_ms": None, "fwd_bwd_ms": None, "peak_extra_gib": None, **floor, **meta})
            print(f"{'fp64_rounded':<16}{D:>4}{S:>6}{'-':>9}{'-':>9}{'-':>7}"
                  + "".join(f"{floor[f'rel_err_{k}']:>7.3f}" for k in ("O", "dQ", "dK", "dV", "dbias")),
                  flush=True)
            for name, impl in impls.items():
                try:
                    fwd, fwd_bwd, peak, res = measure(impl, inputs_sets, grad_sets, args.repeats)
                except Exception as e:  # a peer that does not take these inputs, or memory
                    print(f"# {name} D={D} S={S} failed: {str(e).splitlines()[0]}", flush=True)
                    torch.cuda.empty_cache()
                    continue
                errs = {f"rel_err_{k}": (rel_err_percent(res[k.lower()], ref[k.lower()])
                                         if k.lower() in res else None)
                        for k in ("O", "dQ", "dK", "dV", "dbias")}
                row = {"impl": name, "D": D, "S": S, "bias_dtype": args.bias_dtype, "fwd_ms": fwd,
                       "fwd_bwd_ms": fwd_bwd, "peak_extra_gib": peak, **errs, **meta}
                rows.append(row)
                if args.json:  # after every row: a run stopped by a time limit keeps what it measured
                    with open(args.json, "w") as f:
                        json.dump(rows, f, indent=1)
                num = lambda x, w, p: f"{x:>{w}.{p}f}" if x is not None else f"{'-':>{w}}"
                print(f"{name:<16}{D:>4}{S:>6}{num(fwd, 9, 3)}{num(fwd_bwd, 9, 3)}{num(peak, 7, 3)}"
                      + "".join(num(errs[f"rel_err_{k}"], 7, 3) for k in ("O", "dQ", "dK", "dV", "dbias")),
                      flush=True)
                del res
                torch.cuda.empty_cache()
            del ref, sets, inputs_sets, grad_sets
            torch.cuda.empty_cache()
    print_acceptance(rows)
    if args.plot:
        plot(rows, args.plot)
    return 0


def print_acceptance(rows) -> None:
    """Issue 29's lines: forward+backward at most 0.5x TriFast's, the backward alone at most 3x our
    forward, each error at or below the lowest of the peers run (SDPA, TriFast, cuEquivariance),
    peak extra memory at D = 32, S = 768 no more than cuEquivariance's."""
    at = {(r["impl"], r["D"], r["S"]): r for r in rows}
    print("acceptance:")
    for (impl, D, S), r in sorted(at.items()):
        if impl != "tpfkit":
            continue
        if r["fwd_bwd_ms"] is None:
            cq = at.get(("cuequivariance", D, S))
            print(f"  D={D} S={S}: forward only {r['fwd_ms']:.3f} ms"
                  + (f" (cuEquivariance {cq['fwd_ms']:.3f})" if cq else ""))
            continue
        tf = at.get(("trifast", D, S))
        if tf and tf["fwd_bwd_ms"]:
            fbr = r["fwd_bwd_ms"] / tf["fwd_bwd_ms"]
            print(f"  D={D} S={S} forward+backward / TriFast {fbr:.2f} (at most 0.5: "
                  f"{'met' if fbr <= 0.5 else 'MISSED'})")
        bwd = (r["fwd_bwd_ms"] - r["fwd_ms"]) / r["fwd_ms"]
        print(f"  D={D} S={S} backward / forward {bwd:.2f} (at most 3: {'met' if bwd <= 3 else 'MISSED'})")
        peers = [at[(p, D, S)] for p in ("torch_sdpa", "trifast", "cuequivariance") if (p, D, S) in at]
        worse = []
        for k in ("O", "dQ", "dK", "dV", "dbias"):
            best = [p[f"rel_err_{k}"] for p in peers if p[f"rel_err_{k}"] is not None]
            if best and r[f"rel_err_{k}"] > min(best):
                worse.append(f"{k} {r[f'rel_err_{k}']:.3f} > {min(best):.3f}")
        if peers:
            print(f"  D={D} S={S} errors at or below the peers' lowest: "
                  f"{'met' if not worse else 'MISSED on ' + ', '.join(worse)}")
        fl = at.get(("fp64_rounded", D, S))
        if fl:
            print(f"  D={D} S={S} errors / the rounding floor (FP64 stored in the outputs' dtypes): "
                  + ", ".join(f"{k} {r[f'rel_err_{k}'] / fl[f'rel_err_{k}']:.2f}"
                              for k in ("O", "dQ", "dK", "dV", "dbias") if r[f"rel_err_{k}"] is not None))
        cq = at.get(("cuequivariance", D, S))
        if D == 32 and S == 768 and cq and cq["peak_extra_gib"] is not None:
            # Three decimals: at two, a miss by a few MB prints as 0.90 against 0.90 (2026-12-07).
            print(f"  D=32 S=768 peak extra memory {r['peak_extra_gib']:.3f} GiB (cuEquivariance "
                  f"{cq['peak_extra_gib']:.3f}: {'met' if r['peak_extra_gib'] <= cq['peak_extra_gib'] else 'MISSED'})")


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = sorted({r["D"] for r in rows})
    fig, axes = plt.subplots(2, len(dims), figsize=(5 * len(dims), 8), squeeze=False)
    for col, D in enumerate(dims):
        for row_i, key in enumerate(("fwd_ms", "fwd_bwd_ms")):
            ax = axes[row_i][col]
            for impl in sorted({r["impl"] for r in rows}):
                pts = sorted((r["S"], r[key]) for r in rows
                             if r["impl"] == impl and r["D"] == D and r[key] is not None)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=impl)
            ax.set_title(f"D={D}: {'forward' if key == 'fwd_ms' else 'forward+backward'}")
            ax.set_xlabel("S (= N)")
            ax.set_ylabel("ms")
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    meta = rows[0] if rows else {}
    fig.suptitle(f"Triangle attention, B=1, H=4, bf16 — {meta.get('gpu', '')}, commit {meta.get('commit', '')}, {meta.get('date', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)

