"""Inputs, the FP64 reference and FlashAttention-3's error rule for triangle attention tests
(shared by the CPU tests and the GPU tests)."""
from __future__ import annotations

import math

import torch

from turbopairformer import _C
from turbopairformer.ops.torch_reference import triangle_attention_torch

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
    """O and the four gradients from the C++ FP64 reference (CPU), as float64."""
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
    return {"o": o, "dq": dq, "dk": dk, "dv": dv, "dbias": dbias.reshape(bias.shape)}


def run_with_grads(fn, q, k, v, bias, mask, grad, **kwargs):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, bias)]
    o = fn(*leaves, mask, **kwargs)
    o.backward(grad)
    return {"o": o.detach(), **{name: t.grad for name, t in zip(GRADS, leaves)}}


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
    return (x.detach().double().cpu() - ref).abs().max().item()


def rounding_noise(ref, dtype):
    """What rounding a value once to the output dtype may cost: half a unit in the last place at
    the largest |ref|, at least 1e-5 (a gradient that is exactly zero in FP64, e.g. one key, has no
    rounding of its own, while FP32 arithmetic on O(1) values leaves ~1e-6 there). The bound, not
    the error this ref happens to round with: a value whose last intermediate is off by less than
    PyTorch's may still round to the other neighbour (seen: dp_in_bias at S = 1, 4.6308 -> 4.65625
    where PyTorch's landed on 4.625)."""
    largest = ref.abs().max().item()
    if largest == 0.0:
        return 1e-5
    half_ulp = 0.5 * torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(largest))
    return max(half_ulp, 1e-5)


def check_fa3_rule(ours, baseline, ref, dtype, context=""):
    """FlashAttention-3's rule: |ours - ref| <= 2 |baseline - ref| + rounding noise, per tensor."""
    for name in ("o",) + GRADS:
        assert torch.isfinite(ours[name]).all(), f"{name} has non-finite values {context}"
        err, err_base = max_err(ours[name], ref[name]), max_err(baseline[name], ref[name])
        noise = rounding_noise(ref[name], dtype)
        assert err <= 2 * err_base + noise, (
            f"{name}: error {err:.3e} > 2 x baseline {err_base:.3e} + noise {noise:.3e} {context}")
