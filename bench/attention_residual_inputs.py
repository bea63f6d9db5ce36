"""Output-residual compensation on trained-trunk activations against the benchmark's random inputs.

The issue's accuracy line asks dQ, dK and dbias to be at least 25% closer to FP64 with the residual
than without. On bench/attention.py's inputs (zero-mean random q, k, v, bias) the H200 kernels gain
0.5-2.8% (bench/notes-attention.md). The residual corrects delta = rowsum(dO * O), and
delta's error matters in dS = P (dP - delta) only where dP - delta cancels: where the values V_j a
row attends to are alike (a common offset) or the softmax is peaked. This script measures both on
the attention calls of a trunk trained by `tpf train` (forward and backward of one validation
batch, captured at the attention core), cast to bfloat16, through the op on `--device`:

    python bench/attention_residual_inputs.py --run runs/main-job [--device cpu] [--json FILE]

Per call it prints the relative L2 error (%) of dQ, dK, dV, dbias against the FP64 reference with
and without the residual, the reduction, and two statistics of the inputs: the values' offset (norm
of the mean V over keys over the spread of V around it, averaged over slices and heads) and the
mean largest probability of a row. The same for make_case's random inputs of the same shape and
for those inputs with a common offset added to V, for comparison. With `--device cuda` the GPU
kernels are measured instead (their head dims are 16, 32 and 64: train with `--head-dim 16` or 32).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "python"))

import tpfkit as tpf  # noqa: E402
from attention_cases import GRADS, make_case, reference_fp64, run_with_grads  # noqa: E402
from tpfkit.nn.attention import GatedAttention  # noqa: E402
from tpfkit.train.checkpoint import load_checkpoint  # noqa: E402
from tpfkit.train.data import fixed_batches, load_chains, split_by_entry  # noqa: E402
from tpfkit.train.loop import TrainConfig  # noqa: E402
from tpfkit.train.model import DistogramModel  # noqa: E402


def capture_attention_calls(run: Path, batches: int) -> tuple[list[dict], int]:
    """q, k, v, bias, mask and dO (float32, CPU) of every attention call of the trunk in one
    forward and backward of the first `batches` validation batches, and the checkpoint's step."""
    state = load_checkpoint(str(run))
    cfg = TrainConfig.from_dict(state["config"])
    model = DistogramModel(cfg.model, "reference")
    model.load_state_dict(state["model"])
    chains = load_chains(cfg.data, progress=False)
    _, val = split_by_entry(chains, cfg.val_fraction)
    calls: list[dict] = []
    original = GatedAttention.attention

    def capture(self, q, k, v, bias, mask):
        o = original(self, q, k, v, bias, mask)
        plain = lambda t: t.detach().float().contiguous()  # noqa: E731
        call = {"q": plain(q), "k": plain(k), "v": plain(v), "bias": plain(bias),
                "mask": None if mask is None else mask.detach().contiguous()}
        calls.append(call)
        if o.requires_grad:
            o.register_hook(lambda g: call.__setitem__("grad", g.detach().float().contiguous()))
        return o

    GatedAttention.attention = capture
    try:
        for batch in fixed_batches(val, cfg.batch_size, cfg.crop)[:batches]:
            model.zero_grad()
            model.loss(batch).backward()
    finally:
        GatedAttention.attention = original
    return [c for c in calls if "grad" in c], state["step"]


def input_stats(q, k, v, bias, mask):
    """(offset of V, mean largest probability of a row), in float64."""
    B, N, H, S, D = q.shape
    v64 = v.double()
    keep = torch.ones(B, N, 1, S, 1, dtype=torch.float64) if mask is None else \
        mask.reshape(B, N, 1, S, 1).double()
    count = keep.sum(dim=3, keepdim=True).clamp(min=1)
    mean = (v64 * keep).sum(dim=3, keepdim=True) / count
    spread = (((v64 - mean) ** 2) * keep).sum(dim=(3, 4)) / count.squeeze(-1).squeeze(-1)
    offset = (mean.squeeze(3).norm(dim=-1) / spread.clamp(min=1e-30).sqrt()).mean().item()
    s = torch.einsum("bnhqd,bnhkd->bnhqk", q.double(), k.double()) / math.sqrt(D)
    s = s + bias.double().reshape(B, 1, H, S, S)
    if mask is not None:
        s = s.masked_fill(~mask.reshape(B, N, 1, 1, S), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return offset, p.amax(dim=-1).mean().item()


def residual_effect(q, k, v, bias, mask, grad, device) -> dict:
    """Relative L2 errors (%) with and without the residual, bf16 inputs, against FP64."""
    to = lambda t: None if t is None else t.to(device=device, dtype=torch.bfloat16)  # noqa: E731
    q, k, v, bias, grad = (to(t) for t in (q, k, v, bias, grad))
    mask = None if mask is None else mask.to(device)
    ref = reference_fp64(q, k, v, bias, mask, grad, 1 / math.sqrt(q.shape[-1]))
    row = {}
    for label, residual in (("with", True), ("without", False)):
        out = run_with_grads(tpf.triangle_attention, q, k, v, bias, mask, grad, residual=residual)
        for name in GRADS:
            err = (out[name].double().cpu() - ref[name]).norm() / ref[name].norm().clamp(min=1e-300)
            row[f"{name}_{label}"] = 100 * err.item()
    for name in GRADS:
        row[f"{name}_reduction"] = 1 - row[f"{name}_with"] / max(row[f"{name}_without"], 1e-300)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default="runs/main-job", help="a tpf train run directory or checkpoint")
    ap.add_argument("--batches", type=int, default=1, help="validation batches to capture")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--offset", type=float, default=1.0,
                    help="common offset added to V in the synthetic comparison")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    calls, step = capture_attention_calls(Path(args.run), args.batches)
    if not calls:
        sys.exit(f"no attention call with a gradient captured from {args.run}")
    rows = []

    def report(source, q, k, v, bias, mask, grad):
        offset, peak = input_stats(q, k, v, bias, mask)
        row = {"source": source, "shape": list(q.shape), "v_offset": offset, "p_max_mean": peak,
               **residual_effect(q, k, v, bias, mask, grad, args.device)}
        rows.append(row)
        print(f"{source:26s} V offset {offset:5.2f}  mean max P {peak:4.2f}  " + "  ".join(
            f"{n} {row[n + '_with']:.3f}/{row[n + '_without']:.3f}% (-{100 * row[n + '_reduction']:.0f}%)"
            for n in GRADS), flush=True)

    print(f"relative L2 error against FP64 with / without the residual (bf16 inputs, {args.device});"
          f" trunk of {args.run} at step {step}")
    for i, c in enumerate(calls):
        report(f"trunk call {i}", c["q"], c["k"], c["v"], c["bias"], c["mask"], c["grad"])
    B, N, H, S, D = calls[0]["q"].shape
    g = torch.Generator().manual_seed(0)
    q, k, v, bias, mask, grad = make_case(B, N, H, S, D, torch.float32, "cpu", g,
                                          fully_masked=False)
    report("random (make_case)", q, k, v, bias, mask, grad)
    report(f"random, V offset +{args.offset:g}", q, k, v + args.offset, bias, mask, grad)
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=HERE).stdout.strip()
        Path(args.json).write_text(json.dumps(
            {"run": args.run, "step": step, "device": args.device, "machine": platform.node(),
             "commit": commit, "date": datetime.date.today().isoformat(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
