"""The one accuracy rule of the test suite (CPU, GPU, nn, fused, trimul, distributed).

For a result `got` of our ops, a `baseline` computed in the same precision by plain PyTorch, and
`ref`, the same computation in FP64:

    max |got - ref|  <=  2 x max( max |baseline - ref| ,  sqrt(2 ln n) x rms(baseline - ref) ,  model )

    model = roundings x u(dtype) x scale x sqrt(terms)

This is FlashAttention-3's rule (our error at most twice the baseline's), except that the baseline's
max error is not trusted below what the baseline must cost. It is a random variable: two
computations with errors of the same distribution have max errors that differ by tens of percent
from seed to seed, and on small tensors the baseline can land near the exact value by chance (a
gradient that sums two cancelling terms at S = 1; a PyTorch build whose float32 kernels happen to
round favourably on this processor). Then the plain rule asks our result to be luckier still.
Two floors stop that:
- the baseline's own RMS error times sqrt(2 ln n), the expected maximum of n errors of that spread
  (n elements): a baseline whose largest error falls below what its spread predicts got lucky;
- the error model, the worst case of the roundings the design stores: `roundings` is the number of
  times a value on the longest chain from the inputs to this output is rounded to `dtype` (each
  costs at most u = 2^-p relative, p the significand's bits: 2^-8 bfloat16, 2^-11 float16, 2^-24
  float32), at the magnitude where those roundings happen, `scale` (by default max |ref|). `terms`
  is for results that are sums of cancelling terms, e.g. a gradient that is zero in exact
  arithmetic: there the roundings happen at the terms' magnitude (`scale`), and the error of a sum
  of `terms` of them grows like its square root. A chain that rounds to several precisions (16-bit
  intermediates, a float32 weight gradient) passes `roundings` as {dtype: count}.
`ref` is computed in FP64 from the inputs (and parameters) as the implementations see them, that
is, already rounded to their dtype: rounding the inputs is not the computation's error, and how far
it moves a result depends on the conditioning at each input, which two implementations share only
in part.
Neither floor loosens the rule where the baseline is a real yardstick: on tensors of realistic size
the baseline's max error is at its predicted value and above the model (long sums round many more
times than the stored intermediates).

Parameter gradients are sums over every position (token, pair, sample) of one term each, and the
roundings happen in the terms: with independent errors of k x u relative per term, the sum's error
is about k x u x sqrt(sum of the terms' squares), which cancellation between the terms does not
shrink (a LayerNorm weight feeding a softmax bias sums 10^3 terms whose magnitudes add to 100x the
result). `gradient_terms` measures that root sum of squares for the parameters of nn.Linear and
LayerNorm modules in the FP64 run, and `gradient_scale` makes it the model's scale where it exceeds
max |ref|; each term sum is checked to add up to the FP64 gradient before it is used.

Where a result is ill-conditioned in a stored value (one element that a rounding upstream moves
20x more than the others), the model's single scale under-counts and the baseline's max error is
a lottery over a few such elements: a test may pass `emulated`, the largest error of an FP64
emulation of the design (each value the design stores perturbed by its rounding's size, u relative,
with random signs; the largest over a few draws), which measures the conditioning directly.

`ratio` (error / bound) is what tests/sweep_accuracy.py collects: with TPF_ACCURACY_LOG=path set,
every check appends one JSON line (test, tensor, ratio, seed) to that file.
"""
from __future__ import annotations

import contextlib
import json
import math
import os

import torch
import torch.nn.functional as F

import seeds

UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8,
                 torch.float16: 2.0**-11}


def unit_roundoff(dtype: torch.dtype) -> float:
    if dtype not in UNIT_ROUNDOFF:
        raise TypeError(f"dtype must be a floating dtype, got {dtype}")
    return UNIT_ROUNDOFF[dtype]


def _errors(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (x.detach().to("cpu", torch.float64) - ref.detach().to("cpu", torch.float64)).abs()


def max_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return _errors(x, ref).max().item()


def largest(t: torch.Tensor) -> float:
    return t.detach().abs().max().item() if t.numel() else 0.0


def baseline_error(baseline: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max error, the max error its RMS error predicts for a tensor of this size)."""
    e = _errors(baseline, ref)
    n = e.numel()
    predicted = math.sqrt(2 * math.log(n)) * e.pow(2).mean().sqrt().item() if n > 1 else 0.0
    return e.max().item(), predicted


def roundoff(roundings, dtype: torch.dtype) -> float:
    """The relative error of a chain of roundings: `roundings` to `dtype`, or a dict
    {dtype: count} for a chain that rounds to several (e.g. intermediates stored in bfloat16, the
    result in float32)."""
    if isinstance(roundings, dict):
        return sum(n * unit_roundoff(dt) for dt, n in roundings.items())
    return roundings * unit_roundoff(dtype)


def _describe(roundings, dtype: torch.dtype) -> str:
    if isinstance(roundings, dict):
        return " + ".join(f"{n} x u({dt})" for dt, n in roundings.items())
    return f"{roundings} roundings x u({dtype})"


def error_bound(baseline_errors: tuple[float, float], ref: torch.Tensor, dtype: torch.dtype,
                roundings, scale: float | None = None, terms: int = 1,
                emulated: float | None = None) -> tuple[float, float]:
    """(bound, model): the rule's bound on max |got - ref| and the error model inside it (the
    larger of the roundings' model and the emulation's error, where one is given)."""
    scale = largest(ref) if scale is None else scale
    model = roundoff(roundings, dtype) * scale * math.sqrt(terms)
    model = max(model, emulated or 0.0)
    return 2.0 * max(*baseline_errors, model), model


def accuracy_failure(name: str, got: torch.Tensor, baseline, ref: torch.Tensor, *, roundings,
                     dtype: torch.dtype | None = None, scale: float | None = None, terms: int = 1,
                     emulated: float | None = None, context: str = "") -> str | None:
    """The rule for one tensor: None if it holds, else what failed. `baseline` may be a list of
    equally valid baselines (the largest error counts). `dtype` defaults to got's; `roundings` is
    a count of roundings to `dtype` or a dict {dtype: count} (roundoff)."""
    dtype = got.dtype if dtype is None else dtype
    if got.shape != ref.shape:
        return f"{name}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}; {context}"
    if not torch.isfinite(got).all():
        return f"{name} has non-finite values (an unwritten element?); {context}"
    baselines = baseline if isinstance(baseline, (list, tuple)) else [baseline]
    base = [baseline_error(b, ref) for b in baselines]
    base = (max(b[0] for b in base), max(b[1] for b in base))
    err = max_error(got, ref)
    bound, model = error_bound(base, ref, dtype, roundings, scale, terms, emulated)
    _record(name, err / bound if bound > 0 else (0.0 if err == 0 else math.inf))
    if err <= bound:
        return None
    return (f"{name}: max error {err:.3e} > bound {bound:.3e} = 2 x max(baseline's {base[0]:.3e}, "
            f"its spread's {base[1]:.3e}, model {model:.3e} = ({_describe(roundings, dtype)}) x "
            f"scale{f' x sqrt({terms})' if terms != 1 else ''}"
            f"{f' or the emulation {emulated:.3e}' if emulated else ''}); {context}")


def assert_accurate(name: str, got: torch.Tensor, baseline, ref: torch.Tensor, *, roundings,
                    dtype: torch.dtype | None = None, scale: float | None = None, terms: int = 1,
                    emulated: float | None = None, context: str = "") -> None:
    """Raises AssertionError when accuracy_failure finds one."""
    failure = accuracy_failure(name, got, baseline, ref, roundings=roundings, dtype=dtype,
                               scale=scale, terms=terms, emulated=emulated, context=context)
    assert failure is None, failure


def _record(name: str, ratio: float) -> None:
    path = os.environ.get("TPF_ACCURACY_LOG")
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", os.environ.get("TPF_ACCURACY_TEST", "?"))
    test = test.rsplit(" ", 1)[0]  # drop pytest's " (call)"
    row = {"test": test, "tensor": name, "ratio": ratio, "seed": None if seeds.current is None else str(seeds.current),
           "threads": os.environ.get("TPF_NUM_THREADS")}
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _term_kind(module: torch.nn.Module) -> str | None:
    """How a module's parameters enter its output: "linear" (y = x W^T + b), "layer_norm"
    (y = xhat w + b over the weight's trailing dims), or None (not modelled)."""
    if isinstance(module, torch.nn.Linear):
        return "linear"
    weight = getattr(module, "weight", None)
    if (isinstance(module, torch.nn.LayerNorm) or
            (type(module).__name__.endswith("LayerNorm") and hasattr(module, "eps"))) and \
            (weight is None or isinstance(weight, torch.nn.Parameter)):
        return "layer_norm"
    return None


def _add_terms(sums: dict, key: str, signed: torch.Tensor, squares: torch.Tensor) -> None:
    if key in sums:
        sums[key] = (sums[key][0] + signed, sums[key][1] + squares)
    else:
        sums[key] = (signed, squares)


@contextlib.contextmanager
def gradient_terms(model: torch.nn.Module):
    """Yields a dict that the FP64 forward and backward run inside the block fill, for each
    parameter of model's nn.Linear and LayerNorm modules, key f"d[{name}]", with (sum of its
    gradient's terms, sum of their squares), one term per position of the module's input. Copies
    of model made inside the block (copy.deepcopy) carry the hooks; they are removed on exit."""
    sums: dict = {}

    def hook(name, kind, module, args, out):
        if not args or not torch.is_tensor(args[0]) or not torch.is_tensor(out) or \
                not out.requires_grad:
            return
        x = args[0].detach()

        def on_grad(g):
            g = g.detach()
            if kind == "linear":
                gm, xm = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
                _add_terms(sums, f"d[{name}.weight]", gm.T @ xm, gm.square().T @ xm.square())
                if module.bias is not None:
                    _add_terms(sums, f"d[{name}.bias]", gm.sum(0), gm.square().sum(0))
                return
            shape = tuple(module.normalized_shape) if hasattr(module, "normalized_shape") else \
                tuple(module.weight.shape)
            lead = tuple(range(g.dim() - len(shape)))
            if getattr(module, "weight", None) is not None:
                t = g * F.layer_norm(x, shape, eps=module.eps)
                _add_terms(sums, f"d[{name}.weight]", t.sum(lead), t.square().sum(lead))
            if getattr(module, "bias", None) is not None:
                _add_terms(sums, f"d[{name}.bias]", g.sum(lead), g.square().sum(lead))
        out.register_hook(on_grad)

    handles = []
    for name, module in model.named_modules():
        kind = _term_kind(module)
        if kind is not None:
            handles.append(module.register_forward_hook(
                lambda m, a, o, _n=name, _k=kind: hook(_n, _k, m, a, o)))
    try:
        yield sums
    finally:
        for h in handles:
            h.remove()


def gradient_scale(name: str, g64: dict, per_sample=(), terms: dict | None = None
                   ) -> tuple[float | None, int]:
    """(scale, terms) of the error model for the FP64 gradient g64[name].
    - Zero in exact arithmetic (a LayerNorm bias that only feeds a softmax bias, whose rows sum to
      zero): what both backends compute is a sum of cancelling terms, whose rounding grows like
      sqrt(terms) times the noise at the gradients' scale, not at its own.
    - A parameter gradient: at least the largest sum of the samples' contributions' magnitudes
      (per_sample: each sample's FP64 gradients), where the roundings of the batch sum happen, and
      at least the root sum of squares of its terms (gradient_terms), where the roundings of the
      sum over positions happen; a term sum that does not add up to g64[name] is not used.
    - Otherwise the default, max |g64[name]|."""
    largest_g = max((g for g in g64.values() if g is not None), key=lambda g: g.abs().max())
    ref = g64[name]
    if ref.abs().max() <= 1e-9 * largest_g.abs().max():
        return largest_g.abs().max().item(), largest_g.numel()
    if not name.startswith("d["):
        return None, 1
    scale = ref.abs().max().item()
    if per_sample:
        scale = max(scale, sum(g[name].abs() for g in per_sample).max().item())
    if terms and name in terms:
        signed, squares = (t.to(ref.dtype).reshape(ref.shape) for t in terms[name])
        if (signed - ref).abs().max() <= 1e-9 * ref.abs().max():
            scale = max(scale, squares.sqrt().max().item())
    return scale, 1
