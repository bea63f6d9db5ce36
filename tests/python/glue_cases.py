"""Cases for the fused glue ops (tpfkit.ops.glue), shared by the CPU tests and the GPU
tests: each op against an FP64 evaluation of the same math, with PyTorch's own ops at the same
precision as the yardstick (FlashAttention-3's rule: our error at most twice theirs, plus a floor)."""
from __future__ import annotations

import torch

from accuracy import assert_accurate
from tpfkit.ops import glue

# (B, I, J, C, transposed rows): sizes off every tile, 40 channels (idle lanes), 384, 1000.
LN_CASES = [(2, 37, 29, 128, True), (1, 5, 13, 40, False), (1, 3, 7, 384, False),
            (2, 9, 4, 1000, True), (1, 1, 3, 1, False)]
# (ab dtype-free) M, H: vector path (H % 8 == 0) and scalar (odd H)
SWIGLU_CASES = [(3 * 70, 64), (17, 7), (5, 1)]
# B, N, H, S, D: vector path (D % 8 == 0) and scalar (D = 5), N = 1 as the single track
GATE_CASES = [(2, 3, 4, 37, 32), (1, 3, 3, 11, 5), (1, 1, 16, 70, 24)]


# Roundings on each op's chain (accuracy.py). In a 16-bit dtype: the op computes in fp32 from exact
# inputs and rounds its result once; the fp32 steps cost ~2^-13 of a 16-bit rounding each, so two
# cover them. In float32 every step rounds in the working precision: the chain's length in fp32
# operations (exp, add, divide and the products of sigmoid / SiLU and their derivatives; LayerNorm's
# mean, variance, rsqrt, centring, scaling, weight and bias, and its backward's projections).
ROUNDINGS_16BIT = 2
ROUNDINGS_FP32 = {"layer_norm": 10, "swiglu": 10, "gated_output": 8}


def _check(name, ours, base, ref, op):
    for o, b, r, what in zip(ours, base, ref, ("out", "grad 1", "grad 2", "grad 3")):
        roundings = ROUNDINGS_FP32[op] if o.dtype == torch.float32 else ROUNDINGS_16BIT
        assert_accurate(f"{name} {what}", o, b, r, roundings=roundings)


def layer_norm_case(B, I, J, C, transposed, x_dtype, y_dtype, device, g):
    z = torch.randn(B, I, J, C, generator=g).mul(2).add(0.5).to(device, x_dtype)
    w = torch.randn(C, generator=g).to(device)
    b = torch.randn(C, generator=g).to(device)
    dy = torch.randn(B, J if transposed else I, I if transposed else J, C, generator=g)
    dy = dy.to(device, y_dtype)

    def run(fn, dtype=None):
        zz = z.detach().to(dtype or z.dtype).requires_grad_()
        ww, bb = (t.detach().to(dtype or t.dtype).requires_grad_() for t in (w, b))
        x = zz.transpose(1, 2) if transposed else zz
        y = fn(x, ww, bb)
        y.backward(dy.to(y.dtype))
        return y.detach(), zz.grad, ww.grad, bb.grad

    ours = run(lambda x, ww, bb: glue.layer_norm(x, ww, bb, 1e-5, y_dtype))
    # PyTorch's LayerNorm at x's precision: a module in x's dtype (its CUDA kernel takes no float32
    # weights with 16-bit x)
    base = run(lambda x, ww, bb: torch.nn.functional.layer_norm(
        x, (C,), ww.to(x.dtype), bb.to(x.dtype), 1e-5).to(y_dtype))
    ref = run(lambda x, ww, bb: torch.nn.functional.layer_norm(x, (C,), ww, bb, 1e-5), torch.float64)
    _check(f"layer_norm {B, I, J, C, transposed} {x_dtype}->{y_dtype}", ours, base, ref, "layer_norm")
    return ours


def swiglu_case(M, H, dtype, device, g):
    ab = torch.randn(M, 2 * H, generator=g).mul(2).to(device, dtype)
    dh = torch.randn(M, H, generator=g).to(device, dtype)

    def run(fn, cast=None):
        x = ab.detach().to(cast or dtype).requires_grad_()
        h = fn(x)
        h.backward(dh.to(h.dtype))
        return h.detach(), x.grad

    def torch_swiglu(x):
        a, b = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(a) * b

    ours = run(glue.swiglu)
    _check(f"swiglu M={M} H={H} {dtype}", ours, run(torch_swiglu), run(torch_swiglu, torch.float64),
           "swiglu")
    return ours


def gate_case(B, N, H, S, D, dtype, device, g):
    wide = torch.randn(B, N, S, 4 * H * D, generator=g).mul(2).to(device, dtype)
    o = torch.randn(B, N, H, S, D, generator=g).to(device, dtype)
    dy = torch.randn(B, N, S, H * D, generator=g).to(device, dtype)

    def run(fn, cast=None):
        w = wide.detach().to(cast or dtype).requires_grad_()
        oo = o.detach().to(cast or dtype).requires_grad_()
        y = fn(w[..., 3 * H * D:], oo)
        y.backward(dy.to(y.dtype))
        return y.detach(), w.grad[..., 3 * H * D:], oo.grad

    def torch_gate(gate, heads):
        return torch.sigmoid(gate) * heads.transpose(2, 3).reshape(B, N, S, H * D)

    ours = run(glue.gated_output)
    _check(f"gated_output {B, N, H, S, D} {dtype}", ours, run(torch_gate),
           run(torch_gate, torch.float64), "gated_output")
    return ours
