"""Fused glue around the big ops, as torch custom ops with autograd (validated and dispatched in
src/ops/glue.cpp; CUDA kernels in src/kernels/glue/glue.cu, the CPU path's loops of the same
arithmetic in src/reference/glue_cpu.cpp).

- `layer_norm(x, weight, bias, eps, out_dtype)`: LayerNorm over the last dim, reading x in place
  whatever the strides of its leading dims (a transposed pair tensor costs no copy), writing y in
  `out_dtype` (under autocast: the dtype the next GEMM casts to, so no separate cast).
- `swiglu(ab)`: silu(a) * b for ab = [a | b] along the last dim (one GEMM's output).
- `gated_output(g, o)`: sigmoid(g) * o with o's heads [B, N, H, S, D] laid back into rows
  [B, N, S, H*D], one pass; g may be a column slice of a wider GEMM output.

Each is one kernel forward and one backward (LayerNorm's weight gradients: two, summed in a fixed
order), where PyTorch's eager mode runs several.
"""
from __future__ import annotations

import math

import torch

from tpfkit import _C
from tpfkit.ops._common import (
    eager_autograd,
    native,
    require_tensor,
    stream_of,
    workspace,
)

__all__ = ["layer_norm", "swiglu", "gated_output"]


# ---- layer_norm --------------------------------------------------------------------------------

def _dense(x: torch.Tensor) -> bool:
    """Whether x's elements tile its storage without gaps or overlap, in some order of dims."""
    order = sorted(range(x.dim()), key=lambda i: -x.stride(i))
    return x.permute(order).is_contiguous()


def _rows(x: torch.Tensor) -> int:
    return math.prod(x.shape[:-1])


def _ln_fwd_impl(x, weight, bias, eps, out_dtype):
    y, mean, rstd = _ln_fwd_outputs(x, out_dtype)
    native(_C.layer_norm_forward, x, weight, bias, eps, y, mean, rstd, stream_of(x))
    return y, mean, rstd


def _ln_bwd_impl(grad_y, x, weight, mean, rstd):
    dx, dw, db = _ln_bwd_outputs(x)
    native(_C.layer_norm_backward, grad_y, x, weight, mean, rstd, dx, dw, db, workspace(x),
           stream_of(x))
    return dx, dw, db


@torch.library.custom_op("tpfkit::layer_norm_fwd", mutates_args=())
def _ln_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
            out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _ln_fwd_impl(x, weight, bias, eps, out_dtype)


def _ln_fwd_outputs(x: torch.Tensor, out_dtype: torch.dtype):
    rows = _rows(x)
    return (torch.empty(x.shape, dtype=out_dtype, device=x.device),
            x.new_empty((rows,), dtype=torch.float32), x.new_empty((rows,), dtype=torch.float32))


@_ln_fwd.register_fake
def _(x, weight, bias, eps, out_dtype):
    return _ln_fwd_outputs(x, out_dtype)


@torch.library.custom_op("tpfkit::layer_norm_bwd", mutates_args=())
def _ln_bwd(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
            rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _ln_bwd_impl(grad_y, x, weight, mean, rstd)


def _ln_bwd_outputs(x: torch.Tensor):
    C = x.shape[-1] if x.dim() else 0
    dx = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    return dx, x.new_empty((C,), dtype=torch.float32), x.new_empty((C,), dtype=torch.float32)


@_ln_bwd.register_fake
def _(grad_y, x, weight, mean, rstd):
    return _ln_bwd_outputs(x)


def _ln_setup(ctx, inputs, output):
    x, weight, _, _, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)


def _ln_backward(bwd):  # through the custom op (torch.compile) or its body (eager)
    def backward(ctx, grad_y, _grad_mean, _grad_rstd):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = bwd(grad_y.contiguous(), x, weight, mean, rstd)
        return dx, dw, db, None, None
    return backward


_ln_fwd.register_autograd(_ln_backward(_ln_bwd), setup_context=_ln_setup)
_ln_call = eager_autograd(_ln_fwd, _ln_fwd_impl, _ln_setup, _ln_backward(_ln_bwd_impl))


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """LayerNorm over x's last dim (nn.LayerNorm's math), y in out_dtype (default x's dtype).

    x [..., C], C at most 1024; weight and bias [C] are used in float32 (their gradients come back
    in their own dtype). Leading dims of any strides are read in place.
    """
    for t, name in ((x, "x"), (weight, "weight"), (bias, "bias")):
        require_tensor(t, name)
    if out_dtype is None:
        out_dtype = x.dtype  # C++ checks x's
    elif out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    if not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a number, got {type(eps).__name__}")
    # The kernels read up to three leading dims in place, with stride 1 over the channels and
    # without overlap (dx takes x's strides).
    shape = x.shape
    if x.dim() > 4 or (x.dim() and not (x.is_contiguous() or (x.stride(-1) == 1 and _dense(x)))):
        x = x.contiguous()
        if x.dim() > 4:
            x = x.reshape(-1, *x.shape[-3:])
    y, _, _ = _ln_call(x, weight.float(), bias.float(), float(eps), out_dtype)
    return y.reshape(shape)


# ---- swiglu ------------------------------------------------------------------------------------

def _swiglu_fwd_impl(ab):
    h = ab.new_empty((ab.shape[0], ab.shape[1] // 2))
    native(_C.swiglu, ab, None, h, stream_of(ab))
    return h


def _swiglu_bwd_impl(grad_h, ab):
    dab = torch.empty_like(ab)
    native(_C.swiglu, ab, grad_h, dab, stream_of(ab))
    return dab


@torch.library.custom_op("tpfkit::swiglu_fwd", mutates_args=())
def _swiglu_fwd(ab: torch.Tensor) -> torch.Tensor:
    return _swiglu_fwd_impl(ab)


@_swiglu_fwd.register_fake
def _(ab):
    return ab.new_empty((ab.shape[0], ab.shape[1] // 2))


@torch.library.custom_op("tpfkit::swiglu_bwd", mutates_args=())
def _swiglu_bwd(grad_h: torch.Tensor, ab: torch.Tensor) -> torch.Tensor:
    return _swiglu_bwd_impl(grad_h, ab)


@_swiglu_bwd.register_fake
def _(grad_h, ab):
    return torch.empty_like(ab)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _swiglu_backward(bwd):
    def backward(ctx, grad_h):
        (ab,) = ctx.saved_tensors
        return bwd(grad_h.contiguous(), ab)
    return backward


_swiglu_fwd.register_autograd(_swiglu_backward(_swiglu_bwd), setup_context=_swiglu_setup)
_swiglu_call = eager_autograd(_swiglu_fwd, _swiglu_fwd_impl, _swiglu_setup,
                              _swiglu_backward(_swiglu_bwd_impl))


def swiglu(ab: torch.Tensor) -> torch.Tensor:
    """silu(a) * b where a, b = ab.chunk(2, dim=-1): ab [..., 2H] -> [..., H]."""
    require_tensor(ab, "ab")
    if ab.dim() == 0:
        raise ValueError("ab must have shape [..., 2H] (a then b), got []")
    lead = ab.shape[:-1]
    ab2 = ab.reshape(-1, ab.shape[-1]).contiguous()
    h = _swiglu_call(ab2)
    return h.reshape(*lead, ab.shape[-1] // 2)


# ---- gated_output ------------------------------------------------------------------------------

def _gate_fwd_impl(g, o):
    y = g.new_empty(g.shape)
    native(_C.gated_output, g, o, None, y, None, stream_of(g))
    return y


def _gate_bwd_impl(grad_y, g, o):
    dg, do = g.new_empty(g.shape), torch.empty_like(o)
    native(_C.gated_output, g, o, grad_y, dg, do, stream_of(g))
    return dg, do


@torch.library.custom_op("tpfkit::gated_output_fwd", mutates_args=())
def _gate_fwd(g: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    return _gate_fwd_impl(g, o)


@_gate_fwd.register_fake
def _(g, o):
    return g.new_empty(g.shape)


@torch.library.custom_op("tpfkit::gated_output_bwd", mutates_args=())
def _gate_bwd(grad_y: torch.Tensor, g: torch.Tensor, o: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    return _gate_bwd_impl(grad_y, g, o)


@_gate_bwd.register_fake
def _(grad_y, g, o):
    return g.new_empty(g.shape), torch.empty_like(o)


def _gate_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _gate_backward(bwd):
    def backward(ctx, grad_y):
        g, o = ctx.saved_tensors
        return bwd(grad_y.contiguous(), g, o)
    return backward


_gate_fwd.register_autograd(_gate_backward(_gate_bwd), setup_context=_gate_setup)
_gate_call = eager_autograd(_gate_fwd, _gate_fwd_impl, _gate_setup, _gate_backward(_gate_bwd_impl))


def gated_output(g: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """sigmoid(g) * o.transpose(-3, -2).reshape(g.shape) in one pass.

    o [..., H, S, D] (an attention's heads), g [..., S, H*D] with the same leading dims (it may be
    a column slice of a wider tensor). Returns [..., S, H*D], g's dtype.
    """
    require_tensor(g, "g")
    require_tensor(o, "o")
    # The shapes before the flattening below, which C++ cannot see; dtypes and devices it checks.
    if o.dim() < 3:
        raise ValueError(f"o must have shape [..., H, S, D], got {list(o.shape)}")
    *lead, H, S, D = o.shape
    if tuple(g.shape) != (*lead, S, H * D):
        raise ValueError(f"g must have shape {[*lead, S, H * D]} (o's [..., H, S, D] as "
                         f"[..., S, H*D]), got {list(g.shape)}")
    g2 = g.reshape(-1, H * D)
    if g2.numel() and g2.stride(-1) != 1:
        g2 = g2.contiguous()
    o4 = o.reshape(-1, H, S, D).contiguous()
    y = _gate_call(g2, o4)
    return y.reshape(g.shape)
