"""Triangle multiplicative update as a torch custom op (CPU path and CUDA kernels), with autograd.

Signature, weight layouts and semantics are cuequivariance_torch.triangle_multiplicative_update's, so
switching is one import. x [B, S, S, D] (or [S, S, D], or more leading dimensions, flattened into B);
mask [B, S, S] of any dtype (multiplies the gated projections a and b; it receives no gradient;
cuEquivariance's [S, S] for B = 1 too); under autocast x is taken in the autocast dtype, as
cuEquivariance runs it;
weights in nn.Linear's [out, in] layout: p_in_weight, g_in_weight [2D, D], p_out_weight,
g_out_weight [D, D]; the projection biases are optional.

Weights are used in float32 whatever their dtype (their gradients come back in their own dtype);
x's dtype (float32, bfloat16, float16) sets the precision of the projections' inputs and of what the
forward keeps for the backward. All gradients are deterministic.

On CUDA nothing is cast per call where it can be avoided: the kernels read weights that share one
dtype (float32, bfloat16 or float16) as they are and write their gradients in that dtype, and read a
bool, uint8, float32, bfloat16 or float16 mask as it is (each value rounded to x's dtype, as a cast
would). Mixed weight dtypes (or float64 weights) are cast to float32 here, and another mask dtype to
x's; the results are the same either way. The CPU path gets float32 weights and a mask in x's dtype.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from tpfkit import _C
from tpfkit.ops._common import (
    FLOAT_DTYPES,
    autocast_dtype,
    eager_autograd,
    load_named,
    native,
    require_tensor,
    save_named,
    stream_of,
    workspace,
)

__all__ = ["triangle_multiplicative_update"]

# The order in which weights cross into the C++ core (TrimulWeights). Inside the custom ops an absent
# bias is an empty tensor: a list with None in it would not round-trip through autograd's tree specs.
WEIGHT_NAMES = (
    "norm_in_weight", "norm_in_bias", "p_in_weight", "p_in_bias", "g_in_weight", "g_in_bias",
    "norm_out_weight", "norm_out_bias", "p_out_weight", "p_out_bias", "g_out_weight", "g_out_bias",
)
_OPTIONAL = frozenset(("p_in_bias", "g_in_bias", "p_out_bias", "g_out_bias"))


# Mask dtypes that the CUDA kernels read as they are (others are cast to x's dtype first).
_KERNEL_MASK_DTYPES = frozenset((torch.bool, torch.uint8, torch.float32, torch.bfloat16,
                                 torch.float16))


def _fwd_outputs(x: torch.Tensor):
    y = x.new_empty(x.shape)
    # [B, D, S, S] for a valid x [B, S, S, D] (C++ names any other shape)
    B, S, _, D = x.shape if x.dim() == 4 else (0, 0, 0, 0)
    a, b, z = (x.new_empty((B, D, S, S)) for _ in range(3))
    go = x.new_empty(x.shape)
    return y, a, b, z, go


@torch.library.custom_op("tpfkit::trimul_fwd", mutates_args=())
def _trimul_fwd(
    x: torch.Tensor,
    mask: Optional[torch.Tensor],
    weights: list[torch.Tensor],
    outgoing: bool,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _trimul_fwd_impl(x, mask, weights, outgoing, eps)


def _trimul_fwd_impl(x, mask, weights, outgoing, eps):
    y, a, b, z, go = _fwd_outputs(x)
    native(
        _C.trimul_forward,
        x, mask, weights, outgoing, eps, y, a, b, z, go, workspace(x), stream_of(x))
    return y, a, b, z, go


@_trimul_fwd.register_fake
def _(x, mask, weights, outgoing, eps):
    return _fwd_outputs(x)


def _bwd_outputs(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """dx, then one gradient per weight (empty for an absent bias)."""
    return [x.new_empty(x.shape)] + [w.new_empty(w.shape) for w in weights]


@torch.library.custom_op("tpfkit::trimul_bwd", mutates_args=())
def _trimul_bwd(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    mask: Optional[torch.Tensor],
    weights: list[torch.Tensor],
    a: torch.Tensor,
    b: torch.Tensor,
    z: torch.Tensor,
    go: torch.Tensor,
    outgoing: bool,
    eps: float,
) -> list[torch.Tensor]:
    return _trimul_bwd_impl(grad_out, x, mask, weights, a, b, z, go, outgoing, eps)


def _trimul_bwd_impl(grad_out, x, mask, weights, a, b, z, go, outgoing, eps):
    grads = _bwd_outputs(x, weights)
    native(
        _C.trimul_backward,
        x, mask, weights, outgoing, eps, a,
        b, z, go, grad_out, grads[0], grads[1:], workspace(x), stream_of(x))
    return grads


@_trimul_bwd.register_fake
def _(grad_out, x, mask, weights, a, b, z, go, outgoing, eps):
    return _bwd_outputs(x, weights)


def _setup_context(ctx, inputs, output):
    x, mask, weights, outgoing, eps = inputs
    _, a, b, z, go = output
    save_named(ctx, x=x, mask=mask, a=a, b=b, z=z, go=go, **dict(zip(WEIGHT_NAMES, weights)))
    ctx.outgoing = outgoing
    ctx.eps = eps


def _backward(bwd):  # through the backward custom op (torch.compile) or its body (eager)
    def backward(ctx, grad_y, grad_a, grad_b, grad_z, grad_go):
        s = load_named(ctx)
        weights = [getattr(s, name) for name in WEIGHT_NAMES]
        grads = bwd(grad_y.contiguous(), s.x, s.mask, weights, s.a, s.b, s.z, s.go,
                    ctx.outgoing, ctx.eps)
        dweights = [g if w.numel() else None for w, g in zip(weights, grads[1:])]
        return grads[0], None, dweights, None, None
    return backward


_trimul_fwd.register_autograd(_backward(_trimul_bwd), setup_context=_setup_context)
_trimul_call = eager_autograd(_trimul_fwd, _trimul_fwd_impl, _setup_context,
                             _backward(_trimul_bwd_impl), list_arg=2)


def _lecun_normal(shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """cuEquivariance's default for a missing projection weight: a normal of variance 1/fan_in
    truncated at two standard deviations (drawn from torch's generator)."""
    std = math.sqrt(1.0 / shape[1]) / 0.87962566103423978  # std of the [-2, 2]-truncated normal
    w = torch.empty(shape, device=device)
    return torch.nn.init.trunc_normal_(w, std=std, a=-2 * std, b=2 * std)


def _check_weight(w: torch.Tensor, name: str) -> None:
    """What C++ cannot see of a weight: its type, and a dtype before the cast below."""
    require_tensor(w, name)
    if not w.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {w.dtype}")


def _weights(given: dict, x: torch.Tensor, D: int) -> list[torch.Tensor]:
    """The 12 weights in WEIGHT_NAMES order, each contiguous, in one dtype: on CUDA the dtype they
    share if they share a float32, bfloat16 or float16 one (the kernels read it as it is; missing
    LayerNorm weights are made in it, exact in any dtype), otherwise float32. Mixed dtypes are cast
    here (each cast's backward gives its weight's gradient back in that weight's dtype); so is
    everything on the CPU. A missing projection weight is drawn in float32 (cuEquivariance's
    default), so it makes the set float32 too; an absent bias is an empty tensor."""
    weights = {}
    for name in WEIGHT_NAMES:  # in order: draws from torch's generator as before
        w = given[name]
        if w is not None:
            _check_weight(w, name)
        elif name not in _OPTIONAL and not name.startswith("norm_"):
            rows = 2 * D if name.endswith("in_weight") else D
            w = _lecun_normal((rows, D), x.device)
        weights[name] = w
    dtypes = {w.dtype for w in weights.values() if w is not None}
    dtype = torch.float32
    if x.is_cuda and len(dtypes) == 1:
        (only,) = dtypes
        if only in FLOAT_DTYPES:
            dtype = only
    out = []
    for name, w in weights.items():
        if w is None:
            if name in _OPTIONAL:
                w = torch.empty(0, device=x.device, dtype=dtype)
            else:
                fill = 1.0 if name.endswith("weight") else 0.0
                w = torch.full((D,), fill, device=x.device, dtype=dtype)
        if w.dtype != dtype:
            w = w.to(dtype)
        out.append(w if w.is_contiguous() else w.contiguous())  # host time: no call when not needed
    return out


def _flatten_leading(x: torch.Tensor, mask: Optional[torch.Tensor]):
    """x as [B, S, S, D] and mask as [B, S, S] (C++ validates both), the one place that maps the
    forms cuEquivariance takes onto ours: a mask of x's shape without D, or (B = 1) of its last
    dimensions only, e.g. [S, S] with x [1, S, S, D]; a mask of another shape is passed as it is,
    for C++ to name."""
    if x.dim() < 3:
        raise ValueError(f"x must have shape [B, S, S, D] (or [S, S, D]), got {list(x.shape)}")
    x4 = x if x.dim() == 4 else x.unsqueeze(0) if x.dim() == 3 else x.reshape(-1, *x.shape[-3:])
    if mask is None:
        return x4, None
    require_tensor(mask, "mask")
    if mask.requires_grad and torch.is_grad_enabled():
        raise ValueError("mask must not require grad: the op treats it as a constant")
    if mask.is_complex():
        raise TypeError(f"mask must be a bool, integer or floating-point tensor, got {mask.dtype}")
    lead = tuple(x.shape[:-1])
    batchless = (2 <= mask.dim() < len(lead) and tuple(mask.shape) == lead[len(lead) - mask.dim():]
                 and math.prod(lead[:len(lead) - mask.dim()]) == 1)
    mask3 = mask.reshape(x4.shape[:-1]) if tuple(mask.shape) == lead or batchless else mask
    if not (x.is_cuda and mask.dtype in _KERNEL_MASK_DTYPES):
        mask3 = mask3.to(x.dtype)
    return x4, mask3 if mask3.is_contiguous() else mask3.contiguous()


def triangle_multiplicative_update(
    x: torch.Tensor,
    direction: str = "outgoing",
    mask: Optional[torch.Tensor] = None,
    norm_in_weight: Optional[torch.Tensor] = None,
    norm_in_bias: Optional[torch.Tensor] = None,
    p_in_weight: Optional[torch.Tensor] = None,
    p_in_bias: Optional[torch.Tensor] = None,
    g_in_weight: Optional[torch.Tensor] = None,
    g_in_bias: Optional[torch.Tensor] = None,
    norm_out_weight: Optional[torch.Tensor] = None,
    norm_out_bias: Optional[torch.Tensor] = None,
    p_out_weight: Optional[torch.Tensor] = None,
    p_out_bias: Optional[torch.Tensor] = None,
    g_out_weight: Optional[torch.Tensor] = None,
    g_out_bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    precision: Optional[str] = None,
) -> torch.Tensor:
    """Triangle multiplicative update (AlphaFold3 algorithms 12 and 13), cuEquivariance's API.

    x_ln = LayerNorm_in(x); a | b = sigmoid(x_ln Wg_in^T + bg_in) * (x_ln Wp_in^T + bp_in) * mask;
    outgoing: z_ij = sum_k a_ik b_jk, incoming: z_ij = sum_k a_ki b_kj;
    y = sigmoid(x_ln Wg_out^T + bg_out) * (LayerNorm_out(z) Wp_out^T + bp_out).

    A missing norm weight or bias is ones or zeros; a missing projection weight is drawn as
    cuEquivariance draws it (LeCun normal); a missing projection bias is zero. `precision` is
    accepted for compatibility: None or "ieee" (float32 inputs always use IEEE float32 math).
    """
    require_tensor(x, "x")
    dtype = autocast_dtype(x)
    if dtype is not None and x.dtype in FLOAT_DTYPES and x.dtype != dtype:
        # Under autocast, as cuEquivariance: the projections and the contraction in its dtype
        # (float64 is not autocast's to cast).
        x = x.to(dtype)
    if direction not in ("outgoing", "incoming"):
        raise ValueError(f"direction must be 'outgoing' or 'incoming', got {direction!r}")
    if precision is not None and str(precision).lower() != "ieee":
        raise ValueError(f"precision must be None or 'ieee', got {precision!r}")
    if not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a number, got {type(eps).__name__}")
    x4, mask3 = _flatten_leading(x, mask)
    D = x4.shape[-1]
    given = dict(
        norm_in_weight=norm_in_weight, norm_in_bias=norm_in_bias, p_in_weight=p_in_weight,
        p_in_bias=p_in_bias, g_in_weight=g_in_weight, g_in_bias=g_in_bias,
        norm_out_weight=norm_out_weight, norm_out_bias=norm_out_bias, p_out_weight=p_out_weight,
        p_out_bias=p_out_bias, g_out_weight=g_out_weight, g_out_bias=g_out_bias)
    weights = _weights(given, x4, D)
    if not x4.is_contiguous():
        x4 = x4.contiguous()
    y, _, _, _, _ = _trimul_call(x4, mask3, weights, direction == "outgoing", float(eps))
    return y if y.dim() == x.dim() else y.reshape(x.shape)
