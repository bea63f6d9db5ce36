"""Inputs, the FP64 reference and FlashAttention-3's error rule for triangle attention tests
(shared by the CPU tests and the GPU tests)."""
from __future__ import annotations

import math

import torch

from accuracy import assert_accurate, largest, max_error
import tpfkit as tpf
from tpfkit import _C
from tpfkit.ops.torch_reference import triangle_attention_torch

GRADS = ("dq", "dk", "dv", "dbias")


def make_case(B, N, H, S, D, dtype, device, generator, fully_masked=True, keep=0.8):
    """Random inputs with masked keys and (optionally) one slice whose keys are all masked."""
    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    q, k, v = randn(B, N, H, S, D), randn(B, N, H, S, D), randn(B, N, H, S, D)
    bias = randn(B, 1, H, S, S)
    mask = torch.rand(B, N, 1, 1, S, generator=generator) < keep
    mask[..., 0] |= True  # most slices keep at least one key
    if fully_masked:
        mask[-1, N - 1] = False
    grad = randn(B, N, H, S, D)
    return q, k, v, bias, mask.to(device), grad


def reference_fp64(q, k, v, bias, mask, grad, scale):
    """O and the four gradients from the C++ FP64 reference (CPU), as float64, and under
    "cancelling" the magnitudes that a gradient which is zero in exact arithmetic rounds at."""
    cpu = [t.detach().cpu() for t in (q, k, v, bias, grad)]
    q, k, v, bias, grad = cpu
    B, N, H, S, D = q.shape
    bias4 = bias.reshape(B, H, S, S)
    mask3 = None if mask is None else mask.detach().cpu().reshape(B, N, S)
    o = torch.empty(q.shape, dtype=torch.float64)
    lse = torch.empty((B, N, H, S), dtype=torch.float64)
    _C.attention_forward_reference(q, k, v, bias4, mask3, o, lse, scale)
    dq, dk, dv = (torch.empty(q.shape, dtype=torch.float64) for _ in range(3))
    dbias = torch.empty((B, H, S, S), dtype=torch.float64)
    _C.attention_backward_reference(q, k, v, bias4, mask3, o, lse, grad, dq, dk, dv, dbias, scale)
    return {"o": o, "dq": dq, "dk": dk, "dv": dv, "dbias": dbias.reshape(bias.shape),
            "cancelling": cancelling_terms(q, k, v, grad, scale)}


def run_with_grads(fn, q, k, v, bias, mask, grad, **kwargs):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, bias)]
    o = fn(*leaves, mask, **kwargs)
    o.backward(grad)
    return {"o": o.detach(), **{name: t.grad for name, t in zip(GRADS, leaves)}}


def residual_squared_errors(N, S, device, generator, cases=3):
    """Output-residual compensation's effect on bfloat16 gradients (B 1, H 4, D 32): per gradient,
    the squared error against FP64 with it, without it, and of FP64 rounded once to bfloat16 (the
    floor), each summed over `cases` cases."""
    sq = {name: [0.0, 0.0, 0.0] for name in GRADS}
    for _ in range(cases):
        q, k, v, bias, mask, grad = make_case(1, N, 4, S, 32, torch.bfloat16, device, generator)
        ref = reference_fp64(q, k, v, bias, mask, grad, 1 / math.sqrt(32))
        with_r = run_with_grads(tpf.triangle_attention, q, k, v, bias, mask, grad, residual=True)
        without = run_with_grads(tpf.triangle_attention, q, k, v, bias, mask, grad, residual=False)
        for name in GRADS:
            sq[name][0] += (with_r[name].double().cpu() - ref[name]).square().sum().item()
            sq[name][1] += (without[name].double().cpu() - ref[name]).square().sum().item()
            sq[name][2] += (ref[name].to(torch.bfloat16).double() - ref[name]).square().sum().item()
    return sq


def with_minus_inf_bias(bias, kind):
    """bias with -inf entries: "first-key-tile": keys 0..63 for half of each 16 query rows (those
    rows have no finite score in the first 64-key tile, a finite one later when S > 64);
    "every-key": every key for query rows 3, 10, 17, ... (no finite score at all: the op defines
    such a row like a fully masked one, zeros and zero gradients)."""
    S = bias.shape[-1]
    bias = bias.clone()
    queries = torch.arange(S, device=bias.device)
    if kind == "first-key-tile":
        bias[..., queries % 16 < 8, :64] = float("-inf")
    else:
        bias[..., queries % 7 == 3, :] = float("-inf")
    return bias


def attention_finite_rows_torch(q, k, v, bias, mask=None):
    """triangle_attention_torch's einsum + softmax for inputs whose bias may hold -inf: a row with
    no finite score gets zeros (PyTorch's softmax would give NaN there), as the op defines it."""
    B, N, H, S, D = q.shape
    s = torch.einsum("bnhqd,bnhkd->bnhqk", q, k) / math.sqrt(D) + bias.reshape(B, 1, H, S, S)
    if mask is not None:
        s = s.masked_fill(~mask.reshape(B, N, 1, 1, S), float("-inf"))
    alive = (s > float("-inf")).any(dim=-1, keepdim=True)
    p = torch.softmax(torch.where(alive, s, torch.zeros_like(s)), dim=-1) * alive.to(s.dtype)
    return torch.einsum("bnhqk,bnhkd->bnhqd", p, v)


def max_err(x, ref):
    return max_error(x, ref)


# Roundings on each result's longest chain (accuracy.py). In 16-bit dtypes, the stored values: O
# and dV see P rounded for the PV product, then their own rounding; dQ and dK see dS rounded for
# its product, then their own; dbias is dS summed over slices in fp32, rounded once (fp32 steps
# cost ~2^-13 of a 16-bit rounding each). In float32 every step rounds in the working precision:
# scale and bias, the max, exp2, the rescale, the normalization, the output (8); the backward adds
# dP - delta and the products with P and K or Q (10). Long sums are the baseline's to measure.
ROUNDINGS_16BIT = {"o": 2, "dq": 2, "dk": 2, "dv": 2, "dbias": 1}
ROUNDINGS_FP32 = {"o": 8, "dq": 10, "dk": 10, "dv": 8, "dbias": 10}


def cancelling_terms(q, k, v, grad, scale):
    """For results that are zero in exact arithmetic (one key: P = 1, so dS = P (dP - delta) = 0):
    their roundings happen at the magnitude of the cancelling terms dP and delta (at most
    D max|dO| max|V|), times the softmax scale and K (for dQ) or Q (for dK). (scale, terms) per
    gradient; dbias sums the N slices' dS."""
    B, N, H, S, D = q.shape
    dp = D * largest(grad) * largest(v)
    return {"dq": (scale * dp * largest(k), 1), "dk": (scale * dp * largest(q), 1),
            "dbias": (dp, N)}


def check_fa3_rule(ours, baseline, ref, dtype, context=""):
    """Every output and gradient by the suite's accuracy rule (accuracy.py), against FP64."""
    for name in ("o",) + GRADS:
        scale, terms = None, 1
        if largest(ref[name]) == 0.0 and name in ref["cancelling"]:
            scale, terms = ref["cancelling"][name]
        roundings = (ROUNDINGS_FP32 if dtype == torch.float32 else ROUNDINGS_16BIT)[name]
        assert_accurate(name, ours[name], baseline[name], ref[name], roundings=roundings,
                        dtype=dtype, scale=scale, terms=terms, context=context)


# Bad inputs and the message each must raise (bad_input_message fills in q's dtypes), on the CPU
# (test_attention.py) and on CUDA (tests/gpu: the same messages, before any launch).
# make_case's shapes: q, k, v [1, 3, 2, 6, 8], bias [1, 1, 2, 6, 6], mask [1, 3, 1, 1, 6].
BAD_INPUTS = [
    # [N, H, S, D] is cuEquivariance's B = 1 form (test_cueq_forms); fewer dimensions are wrong.
    ("q must have 5 dimensions [B, N, H, S, D], got [2, 6, 8]",
     lambda q, k, v, b, m: (q[0, 0], k[0, 0], v[0, 0], b, m)),
    ("k must have shape [B, N, H, S, D] = [1, 1, 2, 6, 8], got [1, 3, 2, 6, 8]",
     lambda q, k, v, b, m: (q[:, 0], k, v, b, m)),
    ("k must have q's shape [1, 3, 2, 6, 8]", lambda q, k, v, b, m: (q, k[:, :, :, :-1], v, b, m)),
    ("k must have shape [B, N, H, S, D] = [1, 3, 2, 6, 8], got [1, 3, 2, 6, 7]",
     lambda q, k, v, b, m: (q, k[..., :-1], v, b, m)),
    ("v must have shape [B, N, H, S, D] = [1, 3, 2, 6, 8], got [1, 3, 1, 6, 8]",
     lambda q, k, v, b, m: (q, k, v[:, :, :1], b, m)),
    ("bias must have shape [B, H, S, S] (or [B, 1, H, S, S]) = [1, 2, 6, 6], got [1, 1, 2, 6, 5]",
     lambda q, k, v, b, m: (q, k, v, b[..., :-1], m)),
    ("mask must have shape [B, N, S] (or [B, N, 1, 1, S]) = [1, 3, 6], got [1, 3, 1, 1, 5]",
     lambda q, k, v, b, m: (q, k, v, b, m[..., :-1])),
    ("mask must have shape [B, N, S] (or [B, N, 1, 1, S]) = [1, 3, 6], got [3, 6]",
     lambda q, k, v, b, m: (q, k, v, b, m.reshape(3, 6))),
    ("q must be float32, bfloat16 or float16, got float64",
     lambda q, k, v, b, m: (q.double(), k, v, b, m)),
    ("k must have q's dtype {q}, got {other}", lambda q, k, v, b, m: (q, k.to(_other(q)), v, b, m)),
    # A bias of another float dtype is taken in float32 (test_cueq_forms); a non-float one is wrong.
    ("bias must have q's dtype {bias}, got int64",
     lambda q, k, v, b, m: (q, k, v, b.long(), m)),
    ("q must have a head dimension D >= 1",
     lambda q, k, v, b, m: (q[..., :0], k[..., :0], v[..., :0], b, m)),
    ("q must have at least one token (S >= 1)",
     lambda q, k, v, b, m: (q[:, :, :, :0], k[:, :, :, :0], v[:, :, :, :0], b[..., :0, :0], m[..., :0])),
    ("q must have B, N and H of at least 1",
     lambda q, k, v, b, m: (q[:, :0], k[:, :0], v[:, :0], b, m[:, :0])),
    ("v must be a torch.Tensor, got ndarray", lambda q, k, v, b, m: (q, k, v.detach().cpu().float().numpy(), b, m)),
    ("mask must be a torch.Tensor, got list", lambda q, k, v, b, m: (q, k, v, b, [True] * 6)),
]


def _other(q):
    """A float dtype that is not q's."""
    return torch.float16 if q.dtype != torch.float16 else torch.bfloat16


def bad_input_message(template, q):
    """A BAD_INPUTS message for inputs of q's dtype."""
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    bias = names[q.dtype] + ("" if q.dtype == torch.float32 else " or float32")
    return template.format(q=names[q.dtype], other=names[_other(q)], bias=bias)
